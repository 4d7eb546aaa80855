"""Work on the scheduler's thread that is not a request (preheat.workers.engine.scheduler).

A *call* (a template's pre-fill, a model's compile) runs between two steps, one an iteration,
its caller waiting for what it returns. *Idle work* is what a model's runner leaves for
moments with no request (`ModelRunner.idle_work`: its weights packed for oneDNN): done a
piece an iteration while no request waits or runs, nobody waiting for it, so a request that
comes meanwhile waits for one piece, never for the whole. A piece that fails drops its
model's idle work: it is speed, never an answer (the steps run without it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Call:
    work: Callable[[], object]
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class IdleWork:
    """Each model's idle work, one callable a model returning whether more is left. Read and
    changed under the scheduler's lock, except `run_piece`, which runs without it."""

    def __init__(self) -> None:
        self._work: dict[str, Callable[[], bool]] = {}

    def __bool__(self) -> bool:
        return bool(self._work)

    def add(self, runner) -> None:
        if (work := runner.idle_work()) is not None:
            self._work[runner.name] = work

    def drop(self, model: str) -> None:
        """`model`'s left undone (its weights are about to go: a sleep)."""
        self._work.pop(model, None)

    def next_piece(self) -> tuple[str, Callable[[], bool]]:
        return next(iter(self._work.items()))

    def run_piece(self, model: str, work: Callable[[], bool], lock) -> None:
        """One piece of `model`'s `work`, run without `lock`; its entry taken under it once done."""
        try:
            more = work()
        except Exception:
            log.exception("model %s: its idle work failed and is dropped", model)
            more = False
        with lock:
            if not more and self._work.get(model) is work:
                del self._work[model]
