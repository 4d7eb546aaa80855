"""`preheat bench memory`: what a cached template costs the process in resident memory,
against its exact KV bytes, side by side in one run: each template's tensors in heap
allocations of their own (how entries were kept before), the same with the heap's free
pages given back after each pre-fill (`malloc_trim`), and settled into one slab outside the
heap, then trimmed (`preheat.workers.engine.kvtensors.settle`, production).

Each layout runs in a fresh process (a resident set carries everything a process did
before), which loads the model, pre-fills one template to warm the allocator, and then
pre-fills `templates` more through the production scheduler (its thread, as a worker's):
the resident set's growth over those, divided by the KV bytes the cache counts for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from preheat.cli.bench.common import dev_model, host, write_report

LAYOUTS = ("heap", "heap + trim", "slab")
TARGET_RATIO = 1.1


def _heap_copies(cache) -> None:
    """The layout before the slab: each key/value tensor a heap allocation of its own."""
    from preheat.workers.engine.kvtensors import kv_tensors

    for layer, name, tensor in kv_tensors(cache):
        setattr(layer, name, tensor.clone())


def _heap_copies_trimmed(cache) -> None:
    """The same, and the heap's free pages given back after each pre-fill, as the slab does."""
    from preheat.workers.engine.kvtensors import release_free_heap

    _heap_copies(cache)
    release_free_heap()


def child(model_dir: str, templates: int, tokens: int, layout: str) -> dict:
    """In its own process: pre-fill and measure (run by `main` through this module)."""
    import torch

    from preheat.workers.engine import kvtensors, prefixes
    from preheat.workers.engine.kvcache import CacheBudget, KVCacheManager
    from preheat.workers.engine.prefixes import Prefixes
    from preheat.workers.engine.resident import ModelSource, ResidentModels
    from preheat.workers.engine.scheduler import BatchLimits, Scheduler
    from preheat.workers.sleep import resident_set_bytes

    if layout != "slab":
        prefixes.settle = kvtensors.settle = _heap_copies if layout == "heap" else _heap_copies_trimmed
    resident, _ = ResidentModels("cpu").ensure(ModelSource("bench", model_dir))
    budget = CacheBudget(max_entries=templates + 2, max_bytes=64 * 1024**3)
    cache = KVCacheManager(budget)
    scheduler = Scheduler(Prefixes(cache), BatchLimits())
    generator = torch.Generator().manual_seed(0)

    def prompt() -> torch.Tensor:
        return torch.randint(10, resident.tokenizer.vocab_size - 10, (1, tokens), generator=generator)

    try:
        scheduler.prefill(resident, prompt())  # the allocator's first pass, not counted
        before, kv_bytes = resident_set_bytes(), 0
        for _ in range(templates):
            kv_bytes += scheduler.prefill(resident, prompt()).entry.nbytes
        grown = resident_set_bytes() - before
        cache.clear()  # every entry evicted: what comes back at once, with no pre-fill after
        returned = before + grown - resident_set_bytes()
    finally:
        scheduler.close()
    return {
        "layout": layout,
        "templates": templates,
        "tokens": tokens,
        "kv_bytes": kv_bytes,
        "rss_growth": grown,
        "returned_on_eviction": returned,
    }


def main(shape: str, templates: int, tokens: int, json_path: Path | None) -> None:
    from rich.table import Table

    from preheat.cli import render
    from preheat.core.settings import get_settings

    console = render.console()
    settings = get_settings()
    model_dir = dev_model(settings.home / "bench" / "models" / shape, shape, console)
    rows = []
    for layout in LAYOUTS:
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(model_dir), str(templates), str(tokens), layout],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["ratio"] = row["rss_growth"] / row["kv_bytes"]
        rows.append(row)
    table = Table(
        title=f"resident memory per cached template, {shape} dev model, {templates} × {tokens} tokens",
        title_justify="left",
    )
    headers = ("layout", "KV bytes (MiB)", "resident growth (MiB)", "growth / KV bytes", "back on eviction (MiB)")
    for header in headers:
        table.add_column(header, justify="left" if header == "layout" else "right")
    for row in rows:
        table.add_row(
            row["layout"],
            f"{row['kv_bytes'] / 2**20:,.1f}",
            f"{row['rss_growth'] / 2**20:,.1f}",
            f"{row['ratio']:.2f}",
            f"{row['returned_on_eviction'] / 2**20:,.1f}",
        )
    console.print(table)
    slab = next(row for row in rows if row["layout"] == "slab")
    verdict = "met" if slab["ratio"] <= TARGET_RATIO else "NOT met"
    console.print(f"slab (production): {slab['ratio']:.2f}× the KV bytes (target ≤ {TARGET_RATIO}: {verdict})")
    report = {"benchmark": "memory", "host": host(), "shape": shape, "rows": rows, "target_ratio": TARGET_RATIO}
    write_report(report, json_path or settings.home / "bench" / "memory.json", console)


if __name__ == "__main__":
    model_dir, templates, tokens, layout = sys.argv[1:5]
    print(json.dumps(child(model_dir, int(templates), int(tokens), layout)))
