"""The base task every preheat task uses: the plumbing lives here, once, so a task body is
only domain work.

- **Arguments parsed once.** A message is untrusted input (anyone who can reach the broker can
  send one): its keyword arguments are parsed by the task's schema (`arguments`,
  preheat/tasks/arguments.py) before the body runs, and the body is handed the parsed
  arguments. A call that does not fit is one `BadTaskArguments` naming the argument, refused
  at send (`apply_async`) as at run, and one WARNING line at the worker, not a traceback.
- **A delivery again** while the first delivery of the same message still runs here waits
  for it and takes its stored answer; a message answered already is not computed twice.
- **History**: a warmup's jobs are marked running and finished through the worker's outbox,
  and a task that raises marks its jobs failed with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from celery import Task, states
from celery.signals import task_postrun
from sqlalchemy.exc import OperationalError

from preheat.core.errors import ArgumentError, PreheatError, RequestRefused
from preheat.history import service

log = logging.getLogger(__name__)

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
    """See the module's docstring. `arguments` is the task's schema: a class whose
    `model_validate(kwargs)` returns the parsed arguments (a pydantic model, or a parser
    of the same shape) and raises pydantic's ValidationError."""

    # The schema checks a call, at send and at run; Celery's own check would compare the
    # keyword arguments with the body's one parameter.
    typing = False
    arguments = None
    # Refusals are answers, not faults: Celery logs them without a traceback.
    throws = (BadTaskArguments, RequestRefused)

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            with self.alone():
                answered = self.answered_before()
                if answered is not None:
                    return answered
                try:
                    return super().__call__(self.parse(kwargs, args))
                except (BadTaskArguments, RequestRefused) as exc:  # a client's: one line, no traceback
                    log.warning("%s[%s] refused: %s", self.name, self.request.id, exc)
                    raise
        finally:
            log.info("%s[%s] took %.0f ms", self.name, self.request.id, (time.perf_counter() - started) * 1000)

    def apply_async(self, args=None, kwargs=None, **options):
        """Sent only when the arguments fit: a sender's mistake is its own error, not a worker's."""
        self.parse(kwargs or {}, args or ())
        return super().apply_async(args, kwargs, **options)

    def parse(self, kwargs: dict, args: tuple = ()):
        """The call's arguments, parsed by `arguments`; BadTaskArguments with the first problem."""
        if args:
            raise BadTaskArguments(f"{self.name}: takes keyword arguments only ({len(args)} positional given)")
        return parse_arguments(self.name, self.arguments, kwargs)

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

    # History of the run a warmup task works for: the task takes ids and re-fetches rows.
    # Written through the worker's outbox (preheat.history.outbox): with the database away, the
    # warmup goes on and its record is written when the database is back.

    def start_jobs(self, run_id: str, target: str, templates: list[str]) -> bool:
        """Mark this target's jobs running; False (quietly) when the run is gone. With the
        database away the run cannot be checked: the warmup goes ahead."""
        if service.report_job_start(run_id, target, templates, self.request.id) is False:
            log.info("run %s is gone; nothing to warm", run_id)
            return False
        return True

    def finish_job(
        self, run_id: str, target: str, template: str, status: str, measured: dict, model: str | None = None
    ) -> None:
        service.report_job_finish(run_id, target, template, status, measured, model)

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        try:
            service.report_task_failure(task_id, f"{type(exc).__name__}: {exc}")
        except OperationalError:
            log.exception("could not record the failure of %s[%s] in history", self.name, task_id)


def parse_arguments(task: str, schema, kwargs: dict):
    """`kwargs` parsed by `schema` (a task's arguments: tasks/arguments.py, preheat/api/infer.py);
    BadTaskArguments naming the first argument that is wrong. Whoever sends a task may call it
    first (the router does), so a sender's mistake is refused before anything is sent."""
    from pydantic import ValidationError

    try:
        return schema.model_validate(dict(kwargs))
    except ArgumentError as exc:
        raise BadTaskArguments(f"{task}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        # A whole-request check (the chat form's, as the HTTP route words it) names its field itself.
        raise BadTaskArguments(f"{task}: {where + ': ' if where else ''}{message}") from None
