"""The one WorkerRuntime of this worker process, built on first use.

Built lazily inside the process that runs tasks, never at import: CUDA must not be
initialised in a process that forks afterwards.
"""

from __future__ import annotations

import functools

from preheat.settings import get_settings
from workers.runtime import WorkerRuntime


@functools.cache
def get_runtime() -> WorkerRuntime:
    return WorkerRuntime.from_settings(get_settings())
