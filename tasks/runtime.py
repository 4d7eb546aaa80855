"""The one WorkerRuntime of this worker process, built on first use.

Built lazily inside the process that runs tasks, never at import: CUDA must not be
initialised in a process that forks afterwards.
"""

from __future__ import annotations

import functools

from preheat.catalog import load_catalog
from preheat.settings import get_settings
from workers.kvcache import CacheBudget
from workers.runtime import WorkerRuntime


@functools.cache
def get_runtime() -> WorkerRuntime:
    settings = get_settings()
    return WorkerRuntime(
        catalog=load_catalog(settings.catalog),
        device_preference=settings.device,
        probe_repeats=settings.probe_repeats,
        warm_factor=settings.warm_factor,
        cache_budget=CacheBudget(settings.kv_cache_max_entries, int(settings.kv_cache_max_bytes),
                                 settings.kv_cache_pinned_share),
    )
