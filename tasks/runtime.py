"""The one WorkerRuntime of this worker process, built on first use.

Built lazily inside the process that runs tasks, never at import: with a prefork pool
the model must be loaded after the fork (CUDA cannot be re-initialised in a child).
"""

from __future__ import annotations

import functools

from preheat.catalog import load_catalog
from preheat.settings import get_settings
from workers.warmup import WorkerRuntime


@functools.cache
def get_runtime() -> WorkerRuntime:
    settings = get_settings()
    return WorkerRuntime(
        catalog=load_catalog(settings.catalog),
        device_preference=settings.device,
        probe_repeats=settings.probe_repeats,
    )
