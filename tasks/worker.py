"""What a preheat worker does around its tasks: warm from the start, observable, gated.

A bootstep, so it lives and dies with the worker: at start the health server comes up at
once, the worker registers and keeps a heartbeat (preheat.fleet.registry), and a background
thread loads every catalog model in parallel and pre-fills every template, while the
worker already consumes its own warmup queue. A model's inference queue is consumed only
once its templates are warm, so no request lands on a cold model.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import ClassVar

from celery import bootsteps
from celery.signals import task_postrun, task_prerun, worker_shutdown, worker_shutting_down

from preheat.celery import transport
from preheat.celery.app import app
from preheat.celery.queues import infer_queue
from preheat.core import startheap
from preheat.core.errors import ConfigError, exit_with
from preheat.core.settings import get_settings
from preheat.endpoints.pools import POOLS
from preheat.fleet import liveness, traffic
from preheat.fleet.registry import Heartbeat
from preheat.fleet.sleep import DemandWaker
from preheat.history import outbox, service
from preheat.history.db import utcnow
from preheat.tasks.runtime import get_runtime, start_asleep_by_schedule
from preheat.workers.health import HealthServer

log = logging.getLogger(__name__)

# Pools that run tasks in this process, where the models are. A prefork parent would load
# them (and initialise CUDA) before forking its children.
IN_PROCESS_POOLS = ("solo", "thread")  # module names: --pool=solo, --pool=threads
# Every history write a worker makes that may wait in its outbox while the database is away.
HISTORY_WRITES = (*service.OUTBOX_KINDS, *traffic.OUTBOX_KINDS)


def pool_name(pool_cls) -> str:
    """`prefork`, `solo`, `thread`, … for a Celery pool class (or its name)."""
    return getattr(pool_cls, "__module__", str(pool_cls)).rsplit(".", 1)[-1]


def current_task_id() -> str | None:
    """The id of the task this thread runs (the request's, for a wake it made), or None."""
    from celery import current_task

    return current_task.request.id if current_task else None


def check_concurrency(pool: str, concurrency: int, settings) -> None:
    """The pool's threads against the engine's rows: each request holds a thread while the
    engine decodes it, so fewer threads than rows leave rows idle (said once, at start), and
    more threads than rows and queue would take messages the engine must refuse."""
    rows, queued = settings.max_running_requests, settings.max_queued_requests
    if pool == "solo" or concurrency < 2:
        log.warning(
            "--pool=%s runs one task at a time: requests are decoded one by one; --pool=threads "
            "decodes up to PREHEAT_MAX_RUNNING_REQUESTS=%d together",
            pool,
            rows,
        )
    elif concurrency > rows + queued:
        exit_with(
            ConfigError(
                f"--concurrency={concurrency} takes more requests than the engine runs and queues "
                f"(PREHEAT_MAX_RUNNING_REQUESTS={rows} + PREHEAT_MAX_QUEUED_REQUESTS={queued}); "
                f"use --concurrency={rows + 1} (the default)"
            )
        )


class WorkerRuntimeStep(bootsteps.StartStopStep):
    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}

    def __init__(self, worker, **kwargs) -> None:
        super().__init__(worker, **kwargs)
        self.health: HealthServer | None = None
        self.heartbeat: Heartbeat | None = None
        self.demand: DemandWaker | None = None

    def create(self, worker) -> None:
        pool = pool_name(worker.pool_cls)
        if pool not in IN_PROCESS_POOLS:
            exit_with(
                ConfigError(
                    f"preheat workers hold models in the process that runs tasks: start them "
                    f"with --pool=threads (one process per GPU), not --pool={pool}"
                )
            )
        check_concurrency(pool, worker.concurrency, get_settings())
        start_asleep_by_schedule(worker.hostname)
        # The models load from here on, while Celery builds its pool and consumer: torch and
        # transformers (2-3 s, imported lazily: beat and the CLI import the task modules too),
        # then each model's own classes and weights. Pre-fills wait for start(), which sets
        # the gate they open. The collector is held until they are resident (preheat-worker
        # holds it from its first line; `celery -A preheat worker` from here).
        startheap.hold_collector()
        threading.Thread(target=_load_models, name="preheat-load", daemon=True).start()

    def start(self, worker) -> None:
        global _HUB
        settings = get_settings()
        try:
            runtime = get_runtime()
        except ConfigError as exc:
            exit_with(exc)  # e.g. a catalog that is not valid TOML: one line, exit 2
        consumer = worker.consumer
        _HUB = worker.hub  # the event loop of brokers that have one (Redis, AMQP); None for the embedded

        def soon(work, *args) -> None:
            consumer.call_soon(work, *args)
            transport.wake()  # the embedded broker's consumer would run it up to 2 s later

        def consume(model: str) -> None:
            soon(consumer.add_task_queue, infer_queue(model))

        def pulse_now() -> None:  # the router sees a change of what is served now, not a beat later
            if self.heartbeat is not None:
                self.heartbeat.pulse_now()

        def stop_consuming(model: str) -> None:  # asleep: its requests wait for a worker awake
            def on_consumer_thread() -> None:
                consumer.cancel_task_queue(infer_queue(model))
                pulse_now()  # else a routed request lands on its own queue, woken unrecorded

            soon(on_consumer_thread)

        def serve_once_warm(model: str) -> None:
            # The scheduler's thread, which runs every forward pass, pays its own first-call
            # costs (measured at 4x steady) before the first request does.
            def on_serving_thread() -> None:
                runtime.exercise(model)
                consumer.add_task_queue(infer_queue(model))
                runtime.taking_requests(model)  # /health/ready turns 200 now, not before
                pulse_now()

            soon(on_serving_thread)

        if settings.gate_inference:
            runtime.announce_to(serve_once_warm, on_model_sleep=stop_consuming)
        else:
            log.warning("PREHEAT_GATE_INFERENCE is off: requests are taken before the models are warm")
            runtime.announce_to(consume, gated=False, on_model_sleep=stop_consuming)  # again after a wake
            for model in runtime.catalog.models:
                consume(model)
        try:
            self.health = HealthServer(runtime, settings.health_host, settings.health_port).start()
        except OSError as exc:
            exit_with(
                ConfigError(
                    f"health server cannot listen on {settings.health_host}:{settings.health_port} "
                    f"({exc.strerror}); set PREHEAT_HEALTH_PORT"
                )
            )
        health_port = self.health.port
        history_outbox = outbox.open_for(worker.hostname, settings.outbox_folder, HISTORY_WRITES)
        runtime.sleeps.on_demand_wake = lambda model, woken, began: service.report_wake_on_demand(
            worker.hostname, model, woken.status, woken.as_record(), began, current_task_id()
        )
        runtime.metrics.collectors.register(outbox.OutboxCollector(history_outbox))
        self.heartbeat = Heartbeat(
            worker.hostname,
            lambda: {
                **runtime.describe(),
                "health_port": health_port,
                "outbox": history_outbox.counts().as_state(),
                "idle_since": ACTIVITY.idle_since_iso(),
            },
            settings.heartbeat_interval_s,
            settings.worker_dead_after_s,
            settings.task_time_limit_s,
            on_beat=lambda: _bookkeeping(runtime),
            pulses=liveness.pulses_for(settings),
            lost_message_after_s=settings.lost_message_after_s,
        ).start()
        self.demand = DemandWaker(
            runtime,
            worker.hostname,
            poll_s=settings.wake_on_demand_poll_s,
            dead_after_s=settings.worker_dead_after_s,
        ).start()
        runtime.planner = lambda: planned_share(runtime, worker.hostname, settings)
        threading.Thread(target=runtime.preload, name="preheat-preload", daemon=True).start()

    def stop(self, worker) -> None:
        """Every step of the stop, whatever one of them raises: the row is always marked
        stopped and the pulse removed, so nothing is routed or dispatched to this worker."""
        steps = [
            ("on-demand waker", self.demand.stop if self.demand else None),
            ("endpoint pools", POOLS.close_all),  # connections closed cleanly rather than dropped
            ("runtime", lambda: get_runtime().close()),  # prefix files being written are finished
            ("heartbeat", self.heartbeat.stop if self.heartbeat else None),
            ("outbox", outbox.close),
            ("health server", self.health.stop if self.health else None),
        ]
        self.demand = self.heartbeat = self.health = None
        for what, step in steps:
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                log.warning("stopping the %s failed (%s: %s); the stop goes on", what, type(exc).__name__, exc)


def _load_models() -> None:
    try:
        runtime = get_runtime()
    except ConfigError:
        return  # a catalog or setting that cannot be used: start() says so, in one line
    runtime.load_models()


class Activity:
    """Whether this worker runs a task, and since when it has run none: what tells a lost
    message (a job queued while the worker sat idle) from a queue behind a long task."""

    def __init__(self) -> None:
        self._running = 0
        self._idle_since = utcnow()
        self._lock = threading.Lock()

    def started(self, **_) -> None:
        with self._lock:
            self._running += 1

    def finished(self, **_) -> None:
        with self._lock:
            self._running = max(0, self._running - 1)
            if not self._running:
                self._idle_since = utcnow()

    def idle_since_iso(self) -> str | None:
        with self._lock:
            return None if self._running else self._idle_since.isoformat()


ACTIVITY = Activity()
task_prerun.connect(ACTIVITY.started, weak=False)
task_postrun.connect(ACTIVITY.finished, weak=False)


def _bookkeeping(runtime) -> None:
    """With each heartbeat: history writes that waited for the database, then traffic
    counts, then the fleet's template plan (a worker joined or left: pins move)."""
    outbox.replay()
    traffic.flush()
    _PLAN_FOLLOWER.follow(runtime)


def planned_share(runtime, nodename: str, settings) -> set[str] | None:
    """This worker's templates in the fleet's plan (preheat.fleet.placement), read now; None when
    it is every template (the catalog fits: nothing is spread)."""
    from preheat.fleet.placement import Capacity, fleet_plan
    from preheat.history.db import session_scope

    budget = runtime.config.cache_budget
    own = Capacity(budget.max_pinned_bytes, budget.max_pinned_entries)
    sizes = {name: runtime.template_nbytes(name) for name in runtime.catalog.templates}
    with session_scope() as session:
        plan = fleet_plan(session, runtime.catalog, sizes, nodename, own, settings.worker_dead_after_s)
    share = set(plan[nodename])
    return None if share == set(runtime.catalog.templates) else share


class PlanFollower:
    """Pins move in a thread of their own: a pre-fill must not hold up the heartbeat."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def follow(self, runtime) -> None:
        if runtime.planner is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=runtime.follow_plan, name="preheat-plan", daemon=True)
        self._thread.start()


_PLAN_FOLLOWER = PlanFollower()


app.steps["worker"].add(WorkerRuntimeStep)


_HUB = None


@worker_shutting_down.connect
def _stop_waiting_for_messages(**_) -> None:
    """The consumer's wait ends now, not in up to 2 s (embedded broker) or 1 s (the event
    loop of Redis and AMQP, in epoll until its next timer: SIGTERM does not wake it)."""
    transport.stop_waiting()
    if _HUB is not None:
        threading.Thread(target=_wake_hub, args=(_HUB,), name="preheat-stop", daemon=True).start()


def _wake_hub(hub) -> None:
    # From another thread, call_soon wakes the loop. Celery notes the stop just after this
    # signal: a few wake-ups, so one comes after it.
    for delay in (0.01, 0.05, 0.2):
        time.sleep(delay)
        hub.call_soon(lambda: None)


@worker_shutdown.connect
def _exit_without_teardown(sender, **_) -> None:
    """Exit as soon as the warm shutdown is done (tasks acked, registry told, counts written),
    without the interpreter's teardown: it spent about 2 s garbage-collecting the model's
    objects (measured, small model), time a rolling update or a test waits for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(sender.exitcode or 0)
