"""`preheat watch-workers`: a worker that comes online (new, or restarted) is warmed.

It listens to Celery's `worker-online` events (sent by every worker, no `-E` needed) and
sends that worker a `preheat.warm_worker` with `only_if_cold`: a worker whose own start-up
warmup already pre-filled its templates reports them `skipped`, with no second pre-fill;
one that is cold (a model failed at start, a template added since) is warmed. Each run is
keyed by the worker's name, pid and start event, so two watchers, or one re-receiving an
event, make one run.

Events are Redis pub/sub: a watcher that is down when a worker starts does not see it.
That worker warmed itself at start anyway; the watcher is the second line, not the first.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from preheat.errors import PreheatError
from preheat.models import TriggerKind

log = logging.getLogger(__name__)

# A worker's registry row is written before it starts consuming (tasks/worker.py); these
# retries cover a database that is a moment behind the event.
REGISTRY_RETRIES, REGISTRY_RETRY_S = 5, 1.0


def trigger_key(event: dict) -> str:
    return f"worker_online:{event['hostname']}:{event.get('pid')}:{float(event.get('timestamp') or 0):.3f}"


def warm_online_worker(event: dict, templates: list[str] | None = None) -> str | None:
    """Send the worker that just came online its warmup; the run id, or None if none was sent."""
    from preheat.dispatch import dispatch_warmup

    worker = event["hostname"]
    online_at = dt.datetime.fromtimestamp(float(event.get("timestamp") or time.time()), dt.UTC)
    detail = {"worker": worker, "pid": event.get("pid"), "online_at": online_at.isoformat()}
    for attempt in range(REGISTRY_RETRIES):
        try:
            dispatched = dispatch_warmup(
                templates=templates,
                workers=[worker],
                trigger=TriggerKind.worker_online,
                requested_by="watch-workers",
                detail=detail,
                only_if_cold=True,
                trigger_key=trigger_key(event),
            )
        except PreheatError as exc:
            if attempt + 1 == REGISTRY_RETRIES:
                log.warning("worker %s came online but was not warmed: %s", worker, exc)
                return None
            time.sleep(REGISTRY_RETRY_S)
            continue
        if dispatched.duplicate:
            log.info("worker %s online: warmed already by run %s", worker, dispatched.run_id.hex[:8])
        else:
            log.info(
                "worker %s online: run %s sent (templates %s, only if cold)",
                worker,
                dispatched.run_id.hex[:8],
                ", ".join(dispatched.templates),
            )
        return str(dispatched.run_id)
    return None


class WorkerOnlineWatcher:
    """Receive worker events until stopped, reconnecting to the broker with backoff."""

    def __init__(self, app, templates: list[str] | None = None, max_backoff_s: float = 30.0) -> None:
        self.app = app
        self.templates = templates
        self.max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self._receiver = None

    def on_online(self, event: dict) -> None:
        try:
            warm_online_worker(event, self.templates)
        except Exception:  # the broker or database is away: log, keep listening
            log.exception("could not warm worker %s", event.get("hostname"))

    def run(self) -> None:
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
