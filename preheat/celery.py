"""The Celery app, its configuration, and the base task every preheat task uses.

``celery -A preheat worker|beat|flower`` finds ``app`` here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from celery import Celery, Task, states
from celery.signals import celeryd_after_setup, task_postrun, worker_process_init
from sqlalchemy.exc import OperationalError

from preheat import fstransport, history
from preheat.errors import ConfigError, PreheatError, UnknownNameError, exit_with
from preheat.settings import Settings, get_settings
from preheat.text import safe_name

log = logging.getLogger(__name__)

TASK_MODULES = ["tasks.warmup", "tasks.endpoints", "tasks.infer", "tasks.worker"]
DEFAULT_QUEUE = "preheat"


def _queue_name(prefix: str, name: str) -> str:
    # The filesystem transport allows only [A-Za-z0-9._-] in names, so '@' and the like
    # become '_' on every transport.
    return prefix + safe_name(name)


def worker_queue(nodename: str) -> str:
    """Each worker's own durable queue: a warmup sent there waits for that worker, even
    one that is restarting (Redis fanout would drop it)."""
    return _queue_name("preheat.w.", nodename)


def infer_queue(model: str) -> str:
    """Requests for one model; a worker consumes it only once that model is warm."""
    return _queue_name("preheat.infer.", model)


# Tasks for one worker, sent to its own queue: each replica holds its own model and cache.
WORKER_TASKS = ("preheat.warm_worker", "preheat.sleep_worker", "preheat.wake_worker")


def waiting_messages(channel, queue: str) -> int:
    """Messages waiting in `queue` (0 for a queue never declared: Redis has none until a
    message is sent to it)."""
    from kombu.exceptions import ChannelError

    try:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except ChannelError:
        return 0


def route_task(name, args, kwargs, options, task=None, **_):
    if name in WORKER_TASKS:
        return {"queue": worker_queue(kwargs["worker"])}
    if name == "preheat.infer":
        return {"queue": infer_queue(model_of_request(kwargs, args))}
    return None


def model_of_request(kwargs: dict, args: tuple = ()) -> str:
    """The catalog model a `preheat.infer` is for: its template's, or the chat form's `model`.
    An unknown name is refused here, before anything is sent."""
    from preheat.catalog import current_catalog

    catalog = current_catalog(get_settings().catalog)
    template = kwargs.get("template") or (args[0] if args else None)
    if template is not None:
        return catalog.template(template).model
    model = kwargs.get("model")
    if not isinstance(model, str):
        raise UnknownNameError("preheat.infer needs a template or a model")
    catalog.model(model)
    return model


def _result_backend(url: str) -> str:
    """Redis results through preheat.results' consumer, which misses no published answer."""
    if url.startswith(("redis://", "rediss://")):
        from preheat.results import REDIS_URL_PREFIX

        return REDIS_URL_PREFIX + url
    return url


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
        "result_backend": _result_backend(settings.result_backend),
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
        "worker_consumer": "preheat.consumer:PreheatConsumer",  # a reconnect with tasks running
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
        "beat_scheduler": "schedules.beat:DatabaseScheduler",
    }


# The retry policy of tasks that touch the database: they retry while it is briefly away
# (the warmup itself is idempotent). Declared in each task's decorator.
DB_RETRY = {"autoretry_for": (OperationalError,), "retry_backoff": 2, "retry_backoff_max": 60, "max_retries": 8}


class BadTaskArguments(PreheatError):
    """A task message whose arguments do not fit the task's schema; nothing was done."""

    exit_code = 2


_IN_FLIGHT: dict[str, threading.Event] = {}  # task id -> set when its first run ends
_IN_FLIGHT_LOCK = threading.Lock()


def _release(task_id: str | None) -> None:
    """Wake the deliveries of `task_id` waiting for its first run (PreheatTask.alone)."""
    with _IN_FLIGHT_LOCK:
        first = _IN_FLIGHT.pop(task_id, None)
    if first is not None:
        first.set()


@task_postrun.connect
def _answered(task_id=None, **_) -> None:
    _release(task_id)


class PreheatTask(Task):
    """The plumbing every task shares, so task bodies are only domain work:
    timing and logging, and failed jobs recorded in history when a task raises."""

    typing = True
    arguments = None  # a pydantic model of the task's arguments (tasks/arguments.py)

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            with self.alone():
                answered = self.answered_before()
                if answered is not None:
                    return answered
                return super().__call__(*args, **self.checked(args, kwargs))
        finally:
            log.info("%s[%s] took %.0f ms", self.name, self.request.id, (time.perf_counter() - started) * 1000)

    @contextlib.contextmanager
    def alone(self):
        """A message delivered again while its first delivery still runs in this worker (a
        broker blip restores unacknowledged messages at once) waits for that run, then takes
        its stored answer (answered_before) instead of computing it a second time."""
        task_id = self.request.id
        if self.ignore_result or not task_id:
            yield
            return
        with _IN_FLIGHT_LOCK:
            first = _IN_FLIGHT.get(task_id)
            if first is None:
                _IN_FLIGHT[task_id] = threading.Event()
        if first is not None:
            first.wait(self.app.conf.task_time_limit)
            yield
            return
        try:
            yield
        except BaseException:  # raised before the tracer stores anything: released now
            _release(task_id)
            raise
        # Otherwise released once the answer is stored (task_postrun, after the tracer's
        # mark_as_done): released at the body's end, a delivery waiting on it read no answer
        # yet and computed it again (seen under load with a broker blip).

    def answered_before(self) -> object | None:
        """The stored result of this very message, when it was answered already: a message
        is delivered again when its ack could not reach the broker (a broker blip after the
        result was stored), and the caller has its answer; it is not computed twice."""
        if self.ignore_result or not self.request.id or self.request.is_eager:
            return None
        meta = self.backend.get_task_meta(self.request.id, cache=False)
        if meta.get("status") != states.SUCCESS:
            return None
        log.warning("%s[%s] came again after it was answered; its stored answer stands", self.name, self.request.id)
        return meta.get("result")

    def checked(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name, checked against `arguments` before the body runs:
        a message is untrusted input. Raises BadTaskArguments with the first problem."""
        if self.arguments is None:
            return kwargs
        import inspect

        from pydantic import ValidationError

        signature = inspect.signature(self.run)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise BadTaskArguments(f"{self.name}: {exc}") from None
        values = dict(bound.arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is parameter.VAR_KEYWORD:  # **options: checked by their own names
                values.update(values.pop(name, {}))
        try:
            self.arguments.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            # A whole-request check (the chat form's, as the HTTP route words it) names its field itself.
            raise BadTaskArguments(f"{self.name}: {where + ': ' if where else ''}{first['msg']}") from None
        return kwargs

    # History of the run a warmup task works for: the task takes ids and re-fetches rows.
    # Written through the worker's outbox (preheat.outbox): with the database away, the
    # warmup goes on and its record is written when the database is back.

    def start_jobs(self, run_id: str, target: str, templates: list[str]) -> bool:
        """Mark this target's jobs running; False (quietly) when the run is gone. With the
        database away the run cannot be checked: the warmup goes ahead."""
        if history.report_job_start(run_id, target, templates, self.request.id) is False:
            log.info("run %s is gone; nothing to warm", run_id)
            return False
        return True

    def finish_job(
        self, run_id: str, target: str, template: str, status: str, measured: dict, model: str | None = None
    ) -> None:
        history.report_job_finish(run_id, target, template, status, measured, model)

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        try:
            history.report_task_failure(task_id, f"{type(exc).__name__}: {exc}")
        except OperationalError:
            log.exception("could not record the failure of %s[%s] in history", self.name, task_id)


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    fstransport.install()  # filesystem:// with messages that appear whole
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
    from preheat.db import reset_engine

    reset_engine()


MIN_FLOWER_PASSWORD = 8


def _option_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """Every value given to one of `names`, as --name=value or --name value."""
    values = []
    for index, argument in enumerate(argv):
        name, equals, value = argument.partition("=")
        if name in names:
            values.append(value if equals else (argv[index + 1] if index + 1 < len(argv) else ""))
    return values


def _given(argv: list[str], environ: dict[str, str], names: tuple[str, ...], variable: str) -> list[tuple[str, str]]:
    """(where, value) of an option from the command line and its variable, set or empty."""
    found = [(names[0], value) for value in _option_values(argv, names)]
    return found + ([(variable, environ[variable])] if variable in environ else [])


def check_basic_auth(where: str, value: str) -> None:
    """Every entry user:password with both parts non-empty and a password of at least
    MIN_FLOWER_PASSWORD characters; no empty entry (a trailing comma added one that
    `Authorization: Basic =` matched). The message never shows a password."""
    for number, entry in enumerate(value.split(","), start=1):
        user, colon, password = entry.partition(":")
        if not entry.strip():
            raise ConfigError(f"{where}: entry {number} is empty; every entry is user:password")
        if not colon or not user.strip():
            raise ConfigError(f"{where}: entry {number} is not user:password")
        if len(password) < MIN_FLOWER_PASSWORD or not password.strip():
            raise ConfigError(
                f"{where}: the password of {user!r} is shorter than {MIN_FLOWER_PASSWORD} characters or blank"
            )


def check_oauth(where: str, value: str, argv: list[str], environ: dict[str, str]) -> None:
    """--auth is the e-mail pattern OAuth users must match: it opens nothing without a
    provider and its client credentials."""
    if not value.strip():
        raise ConfigError(f"{where} is empty: it is the e-mail pattern of the users OAuth lets in")
    for names, variable in (
        (("--auth_provider", "--auth-provider"), "FLOWER_AUTH_PROVIDER"),
        (("--oauth2_key", "--oauth2-key"), "FLOWER_OAUTH2_KEY"),
        (("--oauth2_secret", "--oauth2-secret"), "FLOWER_OAUTH2_SECRET"),
    ):
        if not any(v.strip() for _, v in _given(argv, environ, names, variable)):
            raise ConfigError(f"{where} needs {variable} (or {names[0]}): OAuth without it lets nobody in safely")


def refuse_open_flower(argv: list[str], environ: dict[str, str]) -> None:
    """Flower can run any registered task and shut workers down: it never starts here
    without a real credential. The value is checked, not its presence."""
    if "flower" not in argv[1:]:
        return
    basic = _given(argv, environ, ("--basic-auth", "--basic_auth"), "FLOWER_BASIC_AUTH")
    oauth = _given(argv, environ, ("--auth",), "FLOWER_AUTH")
    if not basic and not oauth:
        raise ConfigError("Flower needs auth: set FLOWER_BASIC_AUTH=user:password (or --auth with an OAuth provider)")
    for where, value in basic:
        check_basic_auth(where, value)
    for where, value in oauth:
        check_oauth(where, value, argv, environ)


try:
    refuse_open_flower(sys.argv, dict(os.environ))
    app = create_app()
except ConfigError as exc:
    # `celery -A preheat …` imports this module: one clear line instead of a traceback.
    exit_with(exc)
