"""Where a model runs and in which dtype.

Called lazily, inside the worker process: touching CUDA (even ``is_available``) before
a prefork pool forks makes every child fail with "Cannot re-initialize CUDA".
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from preheat.core.errors import DeviceOutOfMemory

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{self.device.type}/{str(self.dtype).removeprefix('torch.')}"


def pick_placement(preference: str = "auto", dtype: str = "auto", default_dtype: str = "auto") -> Placement:
    """CUDA when present, else the CPU; in `dtype` (the catalog model's), else `default_dtype`
    (PREHEAT_DTYPE), else the precision the hardware computes fast (`fast_dtype`)."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("PREHEAT_DEVICE=cuda but no CUDA device is visible")
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    chosen = dtype if dtype != "auto" else default_dtype
    return Placement(device, DTYPES[chosen] if chosen != "auto" else fast_dtype(device))


# CPU features with which bfloat16 is computed natively (a dot product of bf16 pairs).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def fast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it: CUDA (float16 on cards before Ampere), a CPU
    with avx512_bf16 or AMX; float32 elsewhere (bf16 emulated is slower than float32)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if any(flag in cpu_flags() for flag in BF16_CPU_FLAGS) else torch.float32


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; none where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The CPU allocator says it with a RuntimeError (malloc failed: a cgroup or rlimit bound, or
# the machine is full); CUDA's caching allocator with torch.OutOfMemoryError.
_CPU_ALLOC_FAILED = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+ bytes")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and _CPU_ALLOC_FAILED.search(str(exc)) is not None
    )


def _what_failed(exc: BaseException) -> str:
    match = _CPU_ALLOC_FAILED.search(str(exc))
    # CUDA's: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity…"
    return match.group(0) if match else ". ".join(str(exc).split(". ")[:2]).rstrip(".") + "."


def out_of_memory_as_error(device: torch.device, doing: str, compute: Callable[[], T]) -> T:
    """`compute()`, with the device running out of memory turned into DeviceOutOfMemory naming
    `doing`, after what the failed work held is given back; other errors pass through.
    A function, not a context manager: a `with` block's __exit__ runs while the error is
    still being handled, and the error's traceback would keep the failed work's tensors
    alive through the release (measured on CUDA: 3 MB still allocated)."""
    failed = None
    try:
        return compute()
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(exc):
            raise
        failed = _what_failed(exc)
    # Out of the except block: the traceback, and the tensors its frames hold, are gone.
    release_memory(device)
    raise DeviceOutOfMemory(f"out of memory on {device.type} while {doing}: {failed}")


def release_memory(device: torch.device) -> None:
    """Give back what failed work held: Python's cycles, and CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
