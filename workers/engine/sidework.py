"""Work on the scheduler's thread that is not a request (preheat.workers.engine.scheduler).

A *call* (a template's pre-fill, a model's compile) runs between two steps, one an
iteration, its caller waiting for what it returns. *Idle work* is what a model's runner
leaves for moments with no request (`ModelRunner.idle_work`: its weights moved into huge
pages, then packed for oneDNN): done a piece an iteration, nobody waiting for it, so a
request that comes meanwhile waits for one piece, never for the whole. Pieces run while no
request waits or runs; once requests have left no such moment for `STARVED_AFTER_S`, beside
them too, for at most `SHARE_BESIDE_REQUESTS` of the scheduler's time: a worker whose
traffic is there when it becomes ready (a queue's backlog) and never pauses would otherwise
never finish it. A piece that fails drops its model's idle work: it is speed, never an
answer (the steps run without it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Beside running requests, a piece runs once the time since the last ended is (1 / share - 1)
# times what it took, so at most one a step (a step outlasts most pieces). The real model in
# bf16, 4 users back to back from ready on 2 Zen 4 cores: its 211 layers packed within 6-7 s
# (never, without pieces beside requests), and 14-30 % more requests answered in 16 s.
SHARE_BESIDE_REQUESTS = 0.25
# Only once no idle moment came for this long, so a burst shorter than it never has a piece
# beside its steps. Steady traffic of any size gets them after it: a closed-loop client's
# next request comes before the scheduler's next iteration, so even one user leaves no idle
# moment (`bench load` on 2 Zen 4 cores: the weights never packed without this rule).
STARVED_AFTER_S = 1.0


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
        self._next_beside = 0.0  # time.monotonic() from which a piece may run beside requests
        self._last_idle = time.monotonic()  # when the work last found the scheduler with nothing to run

    def __bool__(self) -> bool:
        return bool(self._work)

    def due(self, busy: bool) -> bool:
        """Whether a piece runs now (called each iteration; a call with `busy` False is an idle
        moment, noted): any time no request waits or runs; beside requests once they have left
        no idle moment for STARVED_AFTER_S and the last piece's time has been paid back
        (SHARE_BESIDE_REQUESTS)."""
        now = time.monotonic()
        if not busy:
            self._last_idle = now
            return bool(self._work)
        return bool(self._work) and now - self._last_idle >= STARVED_AFTER_S and now >= self._next_beside

    def add(self, runner) -> None:
        if (work := runner.idle_work()) is not None:
            self._work[runner.name] = work
            self._last_idle = time.monotonic()  # its wait for an idle moment starts now

    def drop(self, model: str) -> None:
        """`model`'s left undone (its weights are about to go: a sleep)."""
        self._work.pop(model, None)

    def next_piece(self) -> tuple[str, Callable[[], bool]]:
        return next(iter(self._work.items()))

    def run_piece(self, model: str, work: Callable[[], bool], lock) -> None:
        """One piece of `model`'s `work`, run without `lock`; its entry taken under it once done."""
        started = time.monotonic()
        try:
            more = work()
        except Exception:
            log.exception("model %s: its idle work failed and is dropped", model)
            more = False
        ended = time.monotonic()
        with lock:
            self._next_beside = ended + (ended - started) * (1 / SHARE_BESIDE_REQUESTS - 1)
            if not more and self._work.get(model) is work:
                del self._work[model]
