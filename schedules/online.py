"""`preheat watch-workers`: a worker that comes online (new, or restarted) is warmed.

It listens to Celery's `worker-online` events (sent by every worker, no `-E` needed) and
sends that worker a `preheat.warm_worker` with `only_if_cold`: a worker whose own start-up
warmup already pre-filled its templates reports them `skipped`, with no second pre-fill;
one that is cold (a model failed at start, a template added since) is warmed. Each run is
keyed by the worker's start as its registry row records it (name, pid, started_at), so
two watchers, one re-receiving an event, and the sweep below make one run per start.

Events are Redis pub/sub: a watcher that is down when a worker starts does not see it.
So the watcher also sweeps the worker registry, at start and every `sweep_s`: a live
worker whose current start has no worker_online run gets the same only-if-cold warmup
the event would have sent (the worker itself decides what is cold: templates its start-up
warmup made warm come back `skipped`). No worker start is missed, none warmed twice.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from sqlalchemy import select

from preheat.core.errors import PreheatError
from preheat.core.settings import get_settings
from preheat.fleet import registry
from preheat.history import service
from preheat.history.db import aware, session_scope
from preheat.history.models import TriggerKind, WorkerRecord

log = logging.getLogger(__name__)

# A worker's registry row is written before it starts consuming (tasks/worker.py); these
# retries cover a database that is a moment behind the event.
REGISTRY_RETRIES, REGISTRY_RETRY_S = 5, 1.0


# A registry row whose start is this much before the event is the previous incarnation's
# (a restart under the same name and, in a container, often the same pid).
START_BEFORE_EVENT = dt.timedelta(minutes=5)


def start_key(nodename: str, pid: int, started_at: dt.datetime) -> str:
    """One worker start, as events and the registry sweep both see it."""
    return f"worker_online:{nodename}:{pid}:{aware(started_at).isoformat()}"


def _start_of(nodename: str, pid, online_at: dt.datetime) -> tuple[int, dt.datetime] | None:
    """(pid, started_at) of the registry row for the start this event announces, if written."""
    with session_scope() as session:
        record = session.scalars(select(WorkerRecord).where(WorkerRecord.nodename == nodename)).first()
        if record is None or (pid is not None and record.pid != pid):
            return None
        started_at = aware(record.started_at)
        if not online_at - START_BEFORE_EVENT <= started_at <= online_at + START_BEFORE_EVENT:
            return None
        return record.pid, started_at


def warm_online_worker(event: dict, templates: list[str] | None = None) -> str | None:
    """Send the worker that just came online its warmup; the run id, or None if none was sent."""
    worker = event["hostname"]
    online_at = dt.datetime.fromtimestamp(float(event.get("timestamp") or time.time()), dt.UTC)
    for attempt in range(REGISTRY_RETRIES):
        start = _start_of(worker, event.get("pid"), online_at)
        if start is not None:
            return warm_worker_start(worker, *start, templates, via="event")
        if attempt + 1 < REGISTRY_RETRIES:
            time.sleep(REGISTRY_RETRY_S)
    log.warning("worker %s came online but its registry row does not show this start; the sweep will see it", worker)
    return None


def sweep_registry(templates: list[str] | None = None) -> list[str]:
    """Warm every live worker whose current start has no worker_online run yet (one that
    started while this watcher was down); the run ids sent."""
    settings = get_settings()
    with session_scope() as session:
        starts = [
            (w.nodename, w.pid, aware(w.started_at))
            for w in registry.live_workers(session, settings.worker_dead_after_s)
            if service.run_for_key(session, start_key(w.nodename, w.pid, w.started_at)) is None
        ]
    sent = [warm_worker_start(name, pid, started_at, templates, via="sweep") for name, pid, started_at in starts]
    return [run_id for run_id in sent if run_id is not None]


def warm_worker_start(
    worker: str, pid: int, started_at: dt.datetime, templates: list[str] | None, *, via: str
) -> str | None:
    """Send one start of a worker its only-if-cold warmup (once: the start is the trigger key)."""
    from preheat.fleet.dispatch import dispatch_warmup

    detail = {"worker": worker, "pid": pid, "started_at": started_at.isoformat(), "seen_by": via}
    try:
        dispatched = dispatch_warmup(
            templates=templates,
            workers=[worker],
            trigger=TriggerKind.worker_online,
            requested_by="watch-workers",
            detail=detail,
            only_if_cold=True,
            trigger_key=start_key(worker, pid, started_at),
        )
    except PreheatError as exc:
        log.warning("worker %s came online but was not warmed: %s", worker, exc)
        return None
    if dispatched.duplicate:
        log.info("worker %s online: warmed already by run %s", worker, dispatched.run_id.hex[:8])
    else:
        log.info(
            "worker %s online (seen by %s): run %s sent (templates %s, only if cold)",
            worker,
            via,
            dispatched.run_id.hex[:8],
            ", ".join(dispatched.templates),
        )
    return str(dispatched.run_id)


class WorkerOnlineWatcher:
    """Receive worker events until stopped, reconnecting to the broker with backoff."""

    def __init__(
        self, app, templates: list[str] | None = None, max_backoff_s: float = 30.0, sweep_s: float = 60.0
    ) -> None:
        self.app = app
        self.templates = templates
        self.max_backoff_s = max_backoff_s
        self.sweep_s = sweep_s
        self._stop = threading.Event()
        self._receiver = None

    def on_online(self, event: dict) -> None:
        try:
            warm_online_worker(event, self.templates)
        except Exception:  # the broker or database is away: log, keep listening
            log.exception("could not warm worker %s", event.get("hostname"))

    def sweep(self) -> None:
        """At start and every `sweep_s`: the starts no event announced to this watcher."""
        while True:
            try:
                sent = sweep_registry(self.templates)
                if sent:
                    log.info("registry sweep: %d worker start(s) no event announced, warmed", len(sent))
            except Exception as exc:  # the database is away: the next sweep tries again
                log.warning("registry sweep failed: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            if self._stop.wait(self.sweep_s):
                return

    def run(self) -> None:
        sweeper = threading.Thread(target=self.sweep, name="preheat-worker-sweep", daemon=True)
        sweeper.start()
        backoff = 1.0
        while not self._stop.is_set():
            try:
                with self.app.connection_for_read() as connection:
                    connection.ensure_connection(max_retries=1)
                    self._receiver = self.app.events.Receiver(connection, handlers={"worker-online": self.on_online})
                    log.info("watching for workers coming online on %s", connection.as_uri())
                    backoff = 1.0
                    self._receiver.capture(limit=None, timeout=None, wakeup=False)
            except Exception as exc:  # connection lost: reconnect, doubling the wait
                if self._stop.is_set():
                    break
                log.warning(
                    "worker events: %s; reconnecting in %.0f s",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def stop(self) -> None:
        self._stop.set()
        if self._receiver is not None:
            self._receiver.should_stop = True
