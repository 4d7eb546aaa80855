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

from preheat import history, registry
from preheat.catalog import load_catalog
from preheat.celery import app
from preheat.db import session_scope
from preheat.errors import ConfigError, NoWorkersError, UnknownNameError
from preheat.models import RunAction, TargetKind, TriggerKind, WarmupRun
from preheat.settings import get_settings
from preheat.states import WHOLE_MODEL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dispatched:
    run_id: uuid.UUID
    workers: list[str]
    templates: list[str]
    duplicate: bool = False  # the trigger key had a run already: nothing was sent
    models: tuple[str, ...] = ()  # a sleep's or a wake's models


def live_workers() -> list[str]:
    """Nodenames whose heartbeat is fresh (a busy solo worker beats too; see preheat.registry)."""
    with session_scope() as session:
        return [record.nodename for record in registry.live_workers(session, get_settings().worker_dead_after_s)]


def _choose_targets(requested: list[str] | None, live: list[str]) -> list[str]:
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
    _check_requested_by(requested_by)
    _ensure_broker()  # before anything is recorded: a run whose jobs cannot be sent is half-written
    targets = _choose_targets(workers, live_workers())

    recorded = _record_run(
        trigger, requested_by, detail, TargetKind.worker, {worker: model_templates for worker in targets}, trigger_key
    )
    if recorded is None:
        return _duplicate(trigger_key)
    run_id, task_ids = recorded
    for worker, task_id in task_ids.items():
        kwargs = {"run_id": str(run_id), "worker": worker, "templates": templates, "only_if_cold": only_if_cold}
        _send(
            "preheat.warm_worker",
            kwargs,
            task_id,
            f"run={run_id.hex[:8]} worker={worker} "
            f"templates={','.join(templates)}{' only_if_cold' if only_if_cold else ''}",
        )
    return Dispatched(run_id, targets, templates)


def dispatch_sleep_wake(
    action: RunAction,
    *,
    models: list[str] | None = None,
    templates: list[str] | None = None,
    workers: list[str] | None = None,
    level: int = 1,
    trigger: TriggerKind = TriggerKind.manual,
    requested_by: str,
    detail: dict | None = None,
    trigger_key: str | None = None,
) -> Dispatched:
    """A sleep or a wake of `models` (or the models of `templates`; default: every catalog
    model) on every live worker (or those named): one row per worker and model, and for a
    wake one per template of each model too, which the wake warms (a wake is a warmup)."""
    if action not in (RunAction.sleep, RunAction.wake):
        raise ConfigError(f"action {action!r} is neither sleep nor wake")
    if level not in (1, 2):
        raise ConfigError(f"sleep level must be 1 or 2, got {level}")
    catalog = load_catalog(get_settings().catalog)
    chosen = models_of(catalog, models, templates)
    _check_requested_by(requested_by)
    _ensure_broker()
    targets = _choose_targets(workers, live_workers())
    rows = [(model, WHOLE_MODEL) for model in chosen]
    woken = [name for model in chosen for name in catalog.templates_of(model)] if action == RunAction.wake else []
    rows += [(catalog.template(name).model, name) for name in woken]
    recorded = _record_run(
        trigger, requested_by, detail, TargetKind.worker, dict.fromkeys(targets, rows), trigger_key, action
    )
    if recorded is None:
        return _duplicate(trigger_key)
    run_id, task_ids = recorded
    for worker, task_id in task_ids.items():
        kwargs = {"run_id": str(run_id), "worker": worker, "models": chosen}
        kwargs.update({"level": level} if action == RunAction.sleep else {"templates": woken})
        shown = f"run={run_id.hex[:8]} worker={worker} models={','.join(chosen)}"
        _send(
            f"preheat.{action}_worker",
            kwargs,
            task_id,
            shown + (f" level={level}" if action == RunAction.sleep else ""),
        )
    return Dispatched(run_id, targets, woken, models=tuple(chosen))


def models_of(catalog, models: list[str] | None, templates: list[str] | None) -> list[str]:
    """The catalog models named, and those of the templates named; every model when neither."""
    if models and templates:
        raise ConfigError("give --model or --template, not both: a sleep or a wake acts on whole models")
    if templates:
        return list(dict.fromkeys(catalog.template(name).model for name in templates))
    for name in models or []:
        catalog.model(name)  # an unknown name is refused with the catalog's error
    chosen = list(dict.fromkeys(models or catalog.models))
    if not chosen:
        raise ConfigError(f"catalog {get_settings().catalog} has no models")
    return chosen


MAX_REQUESTED_BY = WarmupRun.__table__.c.requested_by.type.length


def _check_requested_by(requested_by: str) -> None:
    if not requested_by.strip():
        raise ConfigError("--requested-by must not be empty")
    if len(requested_by) > MAX_REQUESTED_BY:
        raise ConfigError(f"--requested-by is {len(requested_by)} characters; at most {MAX_REQUESTED_BY}")


def _record_run(
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
            if trigger_key and history.run_for_key(session, trigger_key) is not None:
                return None
            run = history.create_run(
                session,
                trigger=trigger,
                requested_by=requested_by,
                detail=detail,
                trigger_key=trigger_key,
                action=action,
            )
            for target, model_templates in plan.items():
                history.add_jobs(
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


def _duplicate(trigger_key: str) -> Dispatched:
    with session_scope() as session:
        run = history.get_run(session, history.run_for_key(session, trigger_key).id)
        return Dispatched(
            run.id, sorted({job.target for job in run.jobs}), sorted({job.template for job in run.jobs}), duplicate=True
        )


def prime_dispatch() -> None:
    """Open the broker connection, its producer pool and the DB pool now, so the first
    dispatch of a long-lived process does not pay for them (about 0.2 s here)."""
    _ensure_broker()
    live_workers()
    with app.producer_or_acquire():
        pass


def _ensure_broker() -> None:
    """Raise kombu's OperationalError (the CLI's exit 5) when the broker cannot be reached."""
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.5)


def _send(task: str, kwargs: dict, task_id: str, shown: str) -> None:
    """Send one task whose jobs are recorded; if it cannot be sent, its jobs fail with why."""
    try:
        # Flower and the logs show `shown` instead of the raw kwargs.
        app.send_task(task, kwargs=kwargs, task_id=task_id, kwargsrepr=shown)
    except Exception as exc:  # broker unreachable after kombu's own retries
        log.error("could not enqueue %s (%s): %s", task, shown, exc)
        with session_scope() as session:
            history.fail_task_jobs(session, task_id, f"could not enqueue: {type(exc).__name__}: {exc}")


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
    _check_requested_by(requested_by)
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
    _ensure_broker()
    recorded = _record_run(trigger, requested_by, detail, TargetKind.endpoint, plan, trigger_key)
    if recorded is None:
        return _duplicate(trigger_key)
    run_id, task_ids = recorded
    for target, task_id in task_ids.items():
        call = calls[target]
        _send(
            "preheat.warm_endpoint",
            {"run_id": str(run_id), **call},
            task_id,
            f"run={run_id.hex[:8]} endpoint={target} templates={','.join(call['templates'])}",
        )
    return Dispatched(run_id, list(plan), sorted({t for ts in plan.values() for _, t in ts}))


def dispatch_endpoint_sleep_wake(
    action: RunAction,
    endpoints: list[str],
    *,
    templates: list[str] | None = None,
    level: int | None = None,
    trigger: TriggerKind = TriggerKind.manual,
    requested_by: str,
    detail: dict | None = None,
    trigger_key: str | None = None,
) -> Dispatched:
    """A sleep or a wake of vLLM endpoints that declare sleep: one whole-model row each, and
    for a wake one row per template it primes again (`templates`, default the endpoint's)."""
    if action not in (RunAction.sleep, RunAction.wake):
        raise ConfigError(f"action {action!r} is neither sleep nor wake")
    if level is not None and level not in (1, 2):
        raise ConfigError(f"sleep level must be 1 or 2, got {level}")
    catalog = load_catalog(get_settings().catalog)
    _check_requested_by(requested_by)
    plan, calls = {}, {}
    for name in dict.fromkeys(endpoints):
        spec = catalog.endpoint(name)
        if spec.sleep is None:
            raise ConfigError(f"endpoint {name!r} declares no sleep: add [endpoints.{name}.sleep] (vLLM's sleep mode)")
        chosen = list(dict.fromkeys(templates or spec.templates)) if action == RunAction.wake else []
        if action == RunAction.wake and not chosen:
            raise ConfigError(f"endpoint {name!r} names no templates to prime after the wake; give --template")
        catalog.check_prompts(chosen)
        model = spec.model or (catalog.template(spec.templates[0]).model if spec.templates else name)
        plan[name] = [(model, WHOLE_MODEL)] + [(spec.model or catalog.template(t).model, t) for t in chosen]
        calls[name] = {"endpoint": name, **({"templates": chosen} if action == RunAction.wake else {"level": level})}
    _ensure_broker()
    recorded = _record_run(trigger, requested_by, detail, TargetKind.endpoint, plan, trigger_key, action)
    if recorded is None:
        return _duplicate(trigger_key)
    run_id, task_ids = recorded
    for name, task_id in task_ids.items():
        _send(
            f"preheat.{action}_endpoint",
            {"run_id": str(run_id), **calls[name]},
            task_id,
            f"run={run_id.hex[:8]} endpoint={name}",
        )
    return Dispatched(
        run_id, list(plan), sorted({t for c in calls.values() for t in c.get("templates", [])}), models=tuple(plan)
    )


def replica_url(base_url: str, replica: str) -> str:
    """The endpoint's URL with one replica's host:port in place of its own (path kept)."""
    return urlsplit(base_url)._replace(netloc=replica).geturl()
