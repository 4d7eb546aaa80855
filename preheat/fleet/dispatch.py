"""The dispatch service: one warmup sent to each worker or endpoint. Behind `preheat warm`,
beat, both watchers and the `preheat.warm_fleet` task.

Each worker holds its own model copy and cache, so a warmup must reach every replica:
one message per worker, on that worker's own durable queue.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from sqlalchemy.exc import IntegrityError

from preheat.celery.app import app
from preheat.core.catalog import load_catalog
from preheat.core.errors import ConfigError, NoWorkersError, UnknownNameError
from preheat.core.settings import get_settings
from preheat.fleet import registry
from preheat.history import service
from preheat.history.db import session_scope
from preheat.history.models import RunAction, TargetKind, TriggerKind, WarmupRun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dispatched:
    run_id: uuid.UUID
    workers: list[str]
    templates: list[str]
    duplicate: bool = False  # the trigger key had a run already: nothing was sent
    models: tuple[str, ...] = ()  # a sleep's or a wake's models


def live_workers() -> list[str]:
    """Nodenames whose heartbeat is fresh (a busy solo worker beats too; see preheat.fleet.registry)."""
    with session_scope() as session:
        return [record.nodename for record in registry.live_workers(session, get_settings().worker_dead_after_s)]


def choose_targets(requested: list[str] | None, live: list[str]) -> list[str]:
    if requested:
        missing = sorted(set(requested) - set(live))
        if missing:
            raise UnknownNameError(f"worker(s) not live: {', '.join(missing)} (live: {', '.join(live) or 'none'})")
        return sorted(set(requested))
    if not live:
        raise NoWorkersError(
            "no live preheat worker (none sent a heartbeat lately); start one with `preheat-worker --pool=threads`"
        )
    return live


def dispatch_warmup(
    *,
    templates: list[str] | None = None,
    workers: list[str] | None = None,
    trigger: TriggerKind = TriggerKind.manual,
    requested_by: str,
    detail: dict | None = None,
    only_if_cold: bool = False,
    trigger_key: str | None = None,
) -> Dispatched:
    """Validate the request, record the run and its queued jobs, then send one task per worker.
    With a `trigger_key` that already has a run (a trigger firing again), send nothing."""
    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    templates = list(dict.fromkeys(templates or catalog.templates))
    if not templates:
        raise ConfigError(f"catalog {settings.catalog} has no templates to warm")
    model_templates = [(catalog.template(name).model, name) for name in templates]
    catalog.check_prompts(templates)  # a prompt file that can only fail is refused before anything is recorded
    check_requested_by(requested_by)
    ensure_broker()  # before anything is recorded: a run whose jobs cannot be sent is half-written
    targets = choose_targets(workers, live_workers())

    recorded = record_run(
        trigger, requested_by, detail, TargetKind.worker, {worker: model_templates for worker in targets}, trigger_key
    )
    if recorded is None:
        return duplicate_of(trigger_key)
    run_id, task_ids = recorded
    for worker, task_id in task_ids.items():
        kwargs = {"run_id": str(run_id), "worker": worker, "templates": templates, "only_if_cold": only_if_cold}
        send(
            "preheat.warm_worker",
            kwargs,
            task_id,
            f"run={run_id.hex[:8]} worker={worker} "
            f"templates={','.join(templates)}{' only_if_cold' if only_if_cold else ''}",
        )
    return Dispatched(run_id, targets, templates)


MAX_REQUESTED_BY = WarmupRun.__table__.c.requested_by.type.length


def check_requested_by(requested_by: str) -> None:
    if not requested_by.strip():
        raise ConfigError("--requested-by must not be empty")
    if len(requested_by) > MAX_REQUESTED_BY:
        raise ConfigError(f"--requested-by is {len(requested_by)} characters; at most {MAX_REQUESTED_BY}")


def record_run(
    trigger: TriggerKind,
    requested_by: str,
    detail: dict | None,
    kind: TargetKind,
    plan: dict[str, list[tuple[str, str]]],
    trigger_key: str | None = None,
    action: RunAction = RunAction.warm,
) -> tuple[uuid.UUID, dict[str, str]] | None:
    """Record a run and each target's queued (model, template) jobs, and commit; returns the
    run id and each target's task id, or None when `trigger_key` has its run already.
    Callers send only after this: a task never arrives for a row that was rolled back."""
    task_ids = {target: str(uuid.uuid4()) for target in plan}
    try:
        with session_scope() as session:
            if trigger_key and service.run_for_key(session, trigger_key) is not None:
                return None
            run = service.create_run(
                session,
                trigger=trigger,
                requested_by=requested_by,
                detail=detail,
                trigger_key=trigger_key,
                action=action,
            )
            for target, model_templates in plan.items():
                service.add_jobs(
                    session,
                    run,
                    target=target,
                    model_templates=model_templates,
                    task_id=task_ids[target],
                    target_kind=kind,
                )
            return run.id, task_ids
    except IntegrityError:
        if trigger_key is None:
            raise
        return None  # another process recorded this trigger between our check and insert


def duplicate_of(trigger_key: str) -> Dispatched:
    with session_scope() as session:
        run = service.get_run(session, service.run_for_key(session, trigger_key).id)
        return Dispatched(
            run.id, sorted({job.target for job in run.jobs}), sorted({job.template for job in run.jobs}), duplicate=True
        )


def prime_dispatch() -> None:
    """Open the broker connection, its producer pool and the DB pool now, so the first
    dispatch of a long-lived process does not pay for them (about 0.2 s here)."""
    ensure_broker()
    live_workers()
    with app.producer_or_acquire():
        pass


def ensure_broker() -> None:
    """Raise kombu's OperationalError (the CLI's exit 5) when the broker cannot be reached."""
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.5)


def send(task: str, kwargs: dict, task_id: str, shown: str) -> None:
    """Send one task whose jobs are recorded; if it cannot be sent, its jobs fail with why."""
    try:
        # Flower and the logs show `shown` instead of the raw kwargs.
        app.send_task(task, kwargs=kwargs, task_id=task_id, kwargsrepr=shown)
    except Exception as exc:  # broker unreachable after kombu's own retries
        log.error("could not enqueue %s (%s): %s", task, shown, exc)
        with session_scope() as session:
            service.fail_task_jobs(session, task_id, f"could not enqueue: {type(exc).__name__}: {exc}")


def dispatch_endpoint_warmup(
    endpoints: list[str],
    *,
    templates: list[str] | None = None,
    trigger: TriggerKind = TriggerKind.manual,
    requested_by: str,
    detail: dict | None = None,
    trigger_key: str | None = None,
    replica: str | None = None,
) -> Dispatched:
    """Record a run with one job per endpoint and template, then send one
    `preheat.warm_endpoint` per endpoint (any worker runs it: it only talks HTTP).
    `replica` ("host:port") warms one replica of each endpoint (a pod that just became
    ready): the job's target is then "endpoint@host:port"."""
    catalog = load_catalog(get_settings().catalog)
    check_requested_by(requested_by)
    plan, calls = {}, {}
    for name in dict.fromkeys(endpoints):
        spec = catalog.endpoint(name)
        chosen = list(dict.fromkeys(templates or spec.templates))
        if not chosen:
            raise ConfigError(f"endpoint {name!r} names no templates to prime; give --template")
        target = f"{name}@{replica}" if replica else name
        plan[target] = [(spec.model or catalog.template(t).model, t) for t in chosen]
        catalog.check_prompts(chosen)  # as for workers: a prompt that can only fail records nothing
        calls[target] = {"endpoint": name, "templates": chosen}
        if replica:
            calls[target].update(base_url=replica_url(spec.base_url, replica), target=target)
    ensure_broker()
    recorded = record_run(trigger, requested_by, detail, TargetKind.endpoint, plan, trigger_key)
    if recorded is None:
        return duplicate_of(trigger_key)
    run_id, task_ids = recorded
    for target, task_id in task_ids.items():
        call = calls[target]
        send(
            "preheat.warm_endpoint",
            {"run_id": str(run_id), **call},
            task_id,
            f"run={run_id.hex[:8]} endpoint={target} templates={','.join(call['templates'])}",
        )
    return Dispatched(run_id, list(plan), sorted({t for ts in plan.values() for _, t in ts}))


def replica_url(base_url: str, replica: str) -> str:
    """The endpoint's URL with one replica's host:port in place of its own (path kept)."""
    return urlsplit(base_url)._replace(netloc=replica).geturl()
