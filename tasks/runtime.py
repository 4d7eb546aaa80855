"""The one WorkerRuntime of this worker process, built on first use.

Built lazily inside the process that runs tasks, never at import: CUDA must not be
initialised in a process that forks afterwards. Importing it is lazy too: beat, the watchers
and the CLI import the task modules to send them, and must not pay for torch and transformers
(3-8 s on 2 busy cores; a beat started that slowly misses the slot it came back for).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from preheat.settings import get_settings

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

_RUNTIME: WorkerRuntime | None = None
_BUILDING = threading.Lock()  # the worker's start-up thread and its bootstep may ask at once


def get_runtime() -> WorkerRuntime:
    global _RUNTIME
    with _BUILDING:
        if _RUNTIME is None:
            from workers.runtime import WorkerRuntime

            _RUNTIME = WorkerRuntime.from_settings(get_settings())
        return _RUNTIME
