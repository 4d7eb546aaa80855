"""On-demand wake: a request for a model that sleeps on every worker wakes one.

A sleeping worker does not consume its model's inference queue, so a request that comes
anyway waits there. While any of its models sleeps, the worker looks at each sleeping
model's queue every PREHEAT_WAKE_ON_DEMAND_POLL_S. When messages wait and no live worker
has the model awake, one worker wakes: the first by nodename among the live workers that
hold it asleep (as their heartbeats say), so a fleet of sleepers wakes one replica, not
all. The wake is a run like any other (trigger `demand`, keyed by the worker and the sleep
it ends, so one sleep is woken once): a user waits the wake time, never the next schedule.
"""

from __future__ import annotations

import logging
import threading

from preheat import registry
from preheat.celery import app, infer_queue, waiting_messages
from preheat.db import session_scope
from preheat.states import RunAction, TriggerKind

log = logging.getLogger(__name__)


def first_sleeper(model: str, me: str, dead_after_s: float) -> str | None:
    """Who wakes for `model`: None when a live worker has it awake (it takes the requests),
    else the first by name of the live workers holding it asleep (me included)."""
    with session_scope() as session:
        live = registry.live_workers(session, dead_after_s)
    sleepers = {me}
    for record in live:
        state = record.state or {}
        if model in (state.get("asleep") or {}):
            sleepers.add(record.nodename)
        elif record.nodename != me and model in (state.get("models") or {}):
            return None
    return min(sleepers)


class DemandWaker:
    """The thread that watches sleeping models' queues for one worker."""

    def __init__(self, runtime, nodename: str, *, poll_s: float, dead_after_s: float) -> None:
        self._runtime, self._me, self._poll_s, self._dead_after_s = runtime, nodename, poll_s, dead_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preheat-demand", daemon=True)

    def start(self) -> DemandWaker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        connection = None
        while not self._stop.wait(self._poll_s):
            asleep = dict(self._runtime.sleeps.asleep)
            if not asleep:
                continue
            try:
                connection = connection or app.connection_for_read()
                for model, state in asleep.items():
                    if waiting_messages(connection.default_channel, infer_queue(model)):
                        self._wake(model, state.since)
            except Exception as exc:  # the broker or the database away: look again next time
                log.warning("could not look at sleeping models' queues: %s", exc)
                if connection is not None:
                    connection.release()
                connection = None
        if connection is not None:
            connection.release()

    def _wake(self, model: str, since: float) -> None:
        from preheat.dispatch import dispatch_sleep_wake

        if first_sleeper(model, self._me, self._dead_after_s) != self._me:
            return
        dispatched = dispatch_sleep_wake(
            RunAction.wake,
            models=[model],
            workers=[self._me],
            trigger=TriggerKind.demand,
            requested_by=f"demand {self._me}",
            detail={"model": model, "asleep_since": since},
            trigger_key=f"demand:{self._me}:{model}:{since:.6f}",
        )
        if not dispatched.duplicate:
            log.info("a request waits for %s, asleep here: woken by run %s", model, dispatched.run_id.hex[:8])
