"""The one WorkerRuntime of this worker process, built on first use.

Built lazily inside the process that runs tasks, never at import: CUDA must not be
initialised in a process that forks afterwards. Importing it is lazy too: beat, the watchers
and the CLI import the task modules to send them, and must not pay for torch and transformers
(3-8 s on 2 busy cores; a beat started that slowly misses the slot it came back for).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from preheat.core.settings import get_settings

if TYPE_CHECKING:
    from preheat.workers.runtime import WorkerRuntime

_RUNTIME: WorkerRuntime | None = None
_BUILDING = threading.Lock()  # the worker's start-up thread and its bootstep may ask at once
_NODENAME: list[str] = []  # this worker's name, once its bootstep knows it


def get_runtime() -> WorkerRuntime:
    global _RUNTIME
    with _BUILDING:
        if _RUNTIME is None:
            from preheat.workers.runtime import WorkerRuntime

            _RUNTIME = WorkerRuntime.from_settings(get_settings())
            if _NODENAME:
                # Asked once, by whichever start-up thread loads the models first.
                _RUNTIME.asleep_at_start = lambda: asleep_by_schedule(_NODENAME[0])
        return _RUNTIME


def start_asleep_by_schedule(nodename: str) -> None:
    """This process is worker `nodename`: its runtime starts with the models asleep that the
    schedules say are (preheat.fleet.sleep's rule), before it loads any."""
    _NODENAME[:] = [nodename]


def asleep_by_schedule(nodename: str) -> dict[str, str]:
    """The models to start asleep, and why. With the database away, none: a worker awake
    off-peak costs memory, one asleep at the peak costs users."""
    import logging

    from preheat.core.catalog import load_catalog
    from preheat.fleet.sleep import asleep_by_schedule as rule
    from preheat.history.db import session_scope, utcnow

    try:
        with session_scope() as session:
            return rule(session, load_catalog(get_settings().catalog), nodename, utcnow())
    except Exception as exc:
        logging.getLogger(__name__).warning("could not read the schedules (%s): every model loads", exc)
        return {}
