"""The Celery app and its configuration.

``celery -A preheat worker|beat|flower`` finds ``app`` through the package (preheat.app). The
base task is preheat.celery.task, the queues preheat.celery.queues, the Flower guard
preheat.celery.flower.
"""

from __future__ import annotations

import logging
import os
import sys

from celery import Celery
from celery.signals import celeryd_after_setup, worker_process_init

from preheat.celery import transport
from preheat.celery.flower import refuse_open_flower
from preheat.celery.queues import DEFAULT_QUEUE, route_task, worker_queue
from preheat.celery.task import PreheatTask
from preheat.core.errors import ConfigError, exit_with
from preheat.core.settings import Settings, get_settings

log = logging.getLogger(__name__)

TASK_MODULES = ["preheat.tasks.warmup", "preheat.tasks.endpoints", "preheat.tasks.infer", "preheat.tasks.worker"]


def result_backend(settings: Settings) -> str:
    """Where `preheat.infer` results go: PREHEAT_RESULT_BACKEND_URL, else Redis when the broker
    is Redis, else files in home. Redis results go through preheat.celery.redisresults'
    consumer, which misses no published answer; files through results' prompt watcher."""
    from preheat.celery.results import REDIS_URL_PREFIX, URL_PREFIX

    if settings.result_backend_url:
        url = settings.result_backend_url.get_secret_value()
    elif settings.broker.startswith(("redis://", "rediss://")):
        url = settings.broker
    else:
        return f"{URL_PREFIX}file://{(settings.home / 'results').resolve()}"
    return REDIS_URL_PREFIX + url if url.startswith(("redis://", "rediss://")) else url


RESULT_RETRIES = 20  # 10 ms doubling to 5 s, then 5 s: about a minute (less with jitter)
RESULT_SOCKET_TIMEOUT_S = 10.0


def _transport_options(settings: Settings) -> dict:
    if settings.is_embedded:
        folder = settings.broker_folder
        for sub in ("queue", "control", "processed"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        (settings.home / "results").mkdir(parents=True, exist_ok=True)  # infer results, when not overridden
        return {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "control_folder": str(folder / "control"),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
            # How often an idle worker looks for a message: the latency floor of every task.
            # 10 ms: a preheat.infer caller waits 21 ms for a 10 ms answer (50 ms: 63 ms); an
            # idle worker spends 0.9 % of a core on it.
            "polling_interval": 0.01,
        }
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        # Redis: a worker's BRPOP returns at least this often (kombu's brpop_timeout), and
        # a stopping worker waits for the outstanding one before it closes: 1 s (the
        # default) was most of every stop. An idle worker sends 4 BRPOPs a second.
        "polling_interval": 0.25,
    }


def celery_config(settings: Settings) -> dict:
    return {
        "broker_url": settings.broker,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": _transport_options(settings),
        # JSON only: a pickled message from anyone who can reach the broker is code execution.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        # History lives in Postgres; only `preheat.infer` returns a result to its caller.
        "task_ignore_result": True,
        "result_backend": result_backend(settings),
        "result_expires": 3600,
        # A result the backend cannot take (Redis restarting, a connection the outage reset)
        # is kept and stored again with backoff, up to about a minute, instead of failing a
        # request whose answer the model has computed; callers' reads retry the same way.
        "result_backend_always_retry": True,
        "result_backend_max_retries": RESULT_RETRIES,
        "result_backend_max_sleep_between_retries_ms": 5000,
        # Each Redis result command (a GET, a SET, a PUBLISH) is bounded: a connection that
        # went silent (a stalled server, a reset that never arrived) is given up and retried
        # above, not waited on for Celery's default 120 s.
        "redis_socket_timeout": RESULT_SOCKET_TIMEOUT_S,
        "redis_socket_connect_timeout": RESULT_SOCKET_TIMEOUT_S,
        # GPU workers run one process per GPU, with the models in it (see tasks/worker.py).
        # Pool threads only wait: each hands its request to the engine's one scheduler
        # thread, which decodes them together. A thread per row the engine has, and one
        # for a warmup; prefetch is one message a thread, so what the worker reserves never
        # exceeds what its engine can run.
        "worker_pool": "threads",
        "worker_consumer": "preheat.celery.consumer:PreheatConsumer",  # a reconnect with tasks running
        "worker_concurrency": settings.max_running_requests + 1,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": DEFAULT_QUEUE,
        "task_create_missing_queues": True,
        "task_routes": (route_task,),
        "task_time_limit": settings.task_time_limit_s,
        "task_soft_time_limit": settings.warmup_time_limit_s,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # The worker's timer thread sleeps up to this between ticks, and a warm shutdown waits
        # for it: 1 s (Celery's default) was a second of every stop.
        "worker_timer_precision": 0.1,
        "timezone": settings.timezone,
        "enable_utc": True,
        # By name: the scheduler lives in schedules/, which may import preheat, not the reverse.
        "beat_scheduler": "preheat.schedules.beat:DatabaseScheduler",
    }


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    transport.install()  # filesystem:// with messages that appear whole
    celery_app = Celery("preheat", include=TASK_MODULES, task_cls=PreheatTask)
    celery_app.conf.update(celery_config(settings))
    return celery_app


@celeryd_after_setup.connect
def _consume_own_queue(sender, instance, **_):
    queue = worker_queue(sender)
    instance.app.amqp.queues.select_add(queue)
    log.info("worker %s consumes its own queue %s", sender, queue)


@worker_process_init.connect
def _fresh_connections_after_fork(**_):
    # A forked child must not reuse the parent's DB connections.
    from preheat.history.db import reset_connections

    reset_connections()


try:
    refuse_open_flower(sys.argv, dict(os.environ))
    app = create_app()
except ConfigError as exc:
    # `celery -A preheat …` imports this module: one clear line instead of a traceback.
    exit_with(exc)
