"""A CPU model's weights moved into 2 MiB pages while the scheduler is idle.

A decode step at one row streams every weight once, and in 4 KiB pages (a float32 model's
weights are its mapped safetensors file; a converted one's, the allocator's) the reads miss
the TLB every 4 KiB. On a 2-core Zen 1 the products read 18.5 GB/s there against 22.5 in
memory advised for transparent huge pages (`MADV_HUGEPAGE`), and the real model's one-row
float32 step took 24.1-25.8 ms against 28.0-29.4 (docs/benchmarks.md). The cost is the first
touch of those pages (665-789 ms for its 513 MB on that VM), so neither a start nor a wake
waits for it: the scheduler copies `QUANTUM` bytes a piece while no request waits or runs, as
it packs the weights for oneDNN (preheat.workers.engine.sidework), and each parameter takes
its new storage once all of it is copied. The bits are the same, in other pages; until the
last parameter has moved, the old storage (a float32 model's file pages) is held too.

Nothing moves on another device, or where the kernel's transparent huge pages are `never`.
"""

from __future__ import annotations

import logging
import mmap
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

QUANTUM = 8 << 20  # bytes a piece copies: 16 MiB took up to 31 ms of first touches on a 2-core Zen 1
HUGE_PAGE = 2 << 20
ALIGN = 64  # each parameter's start: a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def why_not(device: torch.device) -> str | None:
    """Why a model's weights on `device` stay where they were loaded, or None."""
    if device.type != "cpu":
        return f"weights on {device.type}"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return "this kernel has no transparent huge pages"
    return "transparent huge pages are off (never)" if "[never]" in mode else None


class HugePageWeights:
    """One model's parameters and the private mapping, advised for huge pages, they move into."""

    def __init__(self, name: str, model: torch.nn.Module) -> None:
        self.name = name
        self.parameters = list({id(p): p for p in model.parameters()}.values())  # a tied one once
        sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in self.parameters]
        self._mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mapping.madvise(mmap.MADV_HUGEPAGE)
        pages = torch.frombuffer(self._mapping, dtype=torch.uint8)  # holds the mapping while a view lives
        at = -pages.data_ptr() % HUGE_PAGE  # the first parameter on a huge page's boundary
        self._places = []
        for parameter, size in zip(self.parameters, sizes, strict=True):
            place = pages[at : at + parameter.numel() * parameter.element_size()]
            self._places.append(place.view(parameter.dtype).view(parameter.shape))
            at += size
        self._next, self._copied = 0, 0  # the parameter being copied, and its elements copied so far
        self._ms = 0.0

    @classmethod
    def of(cls, name: str, model: torch.nn.Module, device: torch.device) -> HugePageWeights | None:
        if (why := why_not(device)) is not None:
            log.info("model %s: weights stay in the pages they were loaded into: %s", name, why)
            return None
        return cls(name, model)

    def left(self) -> bool:
        return self._next < len(self.parameters)

    def move_next(self) -> bool:
        """Up to QUANTUM bytes copied into the mapping; a parameter whose elements are all
        copied takes its new storage. Returns whether any is left."""
        started, budget = time.perf_counter(), QUANTUM
        while budget > 0 and self.left():
            parameter, place = self.parameters[self._next], self._places[self._next]
            if parameter.data.is_contiguous():
                count = min(parameter.numel() - self._copied, max(1, budget // parameter.element_size()))
                span = slice(self._copied, self._copied + count)
                place.view(-1)[span].copy_(parameter.data.view(-1)[span])
            else:  # nothing of the kind in transformers' models: copied whole
                count = parameter.numel()
                place.copy_(parameter.data)
            self._copied += count
            budget -= count * parameter.element_size()
            if self._copied == parameter.numel():
                parameter.data = place
                self._next, self._copied = self._next + 1, 0
        self._ms += (time.perf_counter() - started) * 1000
        if not self.left():
            log.info("model %s: weights moved into huge pages in %.0f ms, while idle", self.name, self._ms)
        return self.left()
