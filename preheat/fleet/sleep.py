"""Sleep, as the fleet decides it: which models the schedules say are asleep now (the rule a
worker starts by), the sleep and wake runs sent to workers and endpoints, and the wake a
waiting request asks for (on demand).

**The start-asleep rule.** A worker restarted off-peak (a node drained at 03:00, a rolling
update) must not load a model its schedule put to sleep, nor stay cold at the peak. For each
model, the latest slot *sent* among the enabled schedules that act on it (on this worker: a
schedule naming other workers does not count) decides; if that slot is a sleep, the worker
starts with the model asleep (nothing loaded: a wake loads it, as level 2 does). Anything
else (a warm, a wake, no schedule at all) loads it as usual.

**On demand.** A sleeping worker does not consume its model's inference queue, so a request
that comes anyway waits there. While any of its models sleeps, a worker looks at each
sleeping model's queue (`DemandWaker`). When messages wait and no live worker has the model
awake, one worker wakes: the first by nodename among the live workers that hold it asleep
(as their heartbeats say), so a fleet of sleepers wakes one replica, not all. The wake is a
run like any other (trigger `demand`, keyed by the worker and the sleep it ends, so one sleep
is woken once): a user waits the wake time, never the next schedule.

What a sleep does on a worker is preheat.workers.sleep; on a vLLM server preheat.endpoints.sleep.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from sqlalchemy import select
from sqlalchemy.orm import Session

from preheat.celery.app import app
from preheat.celery.queues import infer_queue, waiting_messages
from preheat.core.catalog import Catalog, load_catalog
from preheat.core.errors import ConfigError
from preheat.core.settings import get_settings
from preheat.core.states import WHOLE_MODEL
from preheat.fleet import registry
from preheat.fleet.dispatch import (
    Dispatched,
    check_requested_by,
    choose_targets,
    duplicate_of,
    ensure_broker,
    live_workers,
    record_run,
    send,
)
from preheat.history.db import session_scope
from preheat.history.models import RunAction, Schedule, ScheduleSlot, SlotStatus, TargetKind, TriggerKind

log = logging.getLogger(__name__)

# The start-asleep rule ------------------------------------------------------------------

# Slots looked at, newest first: far more than a fleet's schedules fire between two restarts.
RECENT_SLOTS = 2000


def asleep_by_schedule(session: Session, catalog: Catalog, worker: str, now: dt.datetime) -> dict[str, str]:
    """Each model this worker should start asleep, with the schedule and slot that say so."""
    rows = session.execute(
        select(ScheduleSlot.fire_at, Schedule.name, Schedule.action, Schedule.targets)
        .join(Schedule, Schedule.id == ScheduleSlot.schedule_id)
        .where(ScheduleSlot.status == SlotStatus.sent, Schedule.enabled.is_(True), ScheduleSlot.fire_at <= now)
        .order_by(ScheduleSlot.fire_at.desc())
        .limit(RECENT_SLOTS)
    ).all()
    decided: dict[str, str | None] = {}
    for fire_at, name, action, targets in rows:
        if targets.get("endpoints") or (targets.get("workers") and worker not in targets["workers"]):
            continue
        for model in catalog.models_targeted(targets) - decided.keys():
            asleep = RunAction(action) == RunAction.sleep
            decided[model] = f"schedule {name} put it to sleep at {fire_at:%Y-%m-%d %H:%M} UTC" if asleep else None
    return {model: why for model, why in decided.items() if why is not None and model in catalog.models}


# Sleep and wake runs --------------------------------------------------------------------


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
    check_requested_by(requested_by)
    ensure_broker()
    targets = choose_targets(workers, live_workers())
    rows = [(model, WHOLE_MODEL) for model in chosen]
    woken = [name for model in chosen for name in catalog.templates_of(model)] if action == RunAction.wake else []
    rows += [(catalog.template(name).model, name) for name in woken]
    recorded = record_run(
        trigger, requested_by, detail, TargetKind.worker, dict.fromkeys(targets, rows), trigger_key, action
    )
    if recorded is None:
        return duplicate_of(trigger_key)
    run_id, task_ids = recorded
    for worker, task_id in task_ids.items():
        kwargs = {"run_id": str(run_id), "worker": worker, "models": chosen}
        kwargs.update({"level": level} if action == RunAction.sleep else {"templates": woken})
        shown = f"run={run_id.hex[:8]} worker={worker} models={','.join(chosen)}"
        send(
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
    check_requested_by(requested_by)
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
    ensure_broker()
    recorded = record_run(trigger, requested_by, detail, TargetKind.endpoint, plan, trigger_key, action)
    if recorded is None:
        return duplicate_of(trigger_key)
    run_id, task_ids = recorded
    for name, task_id in task_ids.items():
        send(
            f"preheat.{action}_endpoint",
            {"run_id": str(run_id), **calls[name]},
            task_id,
            f"run={run_id.hex[:8]} endpoint={name}",
        )
    return Dispatched(
        run_id, list(plan), sorted({t for c in calls.values() for t in c.get("templates", [])}), models=tuple(plan)
    )


# On demand ------------------------------------------------------------------------------


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
