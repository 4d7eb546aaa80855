"""Where a model runs and in which dtype.

Called lazily, inside the worker process: touching CUDA (even ``is_available``) before
a prefork pool forks makes every child fail with "Cannot re-initialize CUDA".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{self.device.type}/{str(self.dtype).removeprefix('torch.')}"


def pick_placement(preference: str = "auto", dtype: str = "auto") -> Placement:
    """CUDA with bf16 when present (fp16 on pre-Ampere cards), else CPU float32."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("PREHEAT_DEVICE=cuda but no CUDA device is visible")
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if dtype != "auto":
        return Placement(device, DTYPES[dtype])
    if device.type == "cuda":
        return Placement(device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    return Placement(device, torch.float32)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
