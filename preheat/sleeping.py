"""Which models the schedules say are asleep now: the rule a worker starts by.

A worker restarted off-peak (a node drained at 03:00, a rolling update) must not load a
model its schedule put to sleep, nor stay cold at the peak. The written rule: for each
model, the latest slot *sent* among the enabled schedules that act on it (on this worker:
a schedule naming other workers does not count) decides; if that slot is a sleep, the
worker starts with the model asleep (nothing loaded: a wake loads it, as level 2 does).
Anything else (a warm, a wake, no schedule at all) loads it as usual. A request that comes
meanwhile wakes it (tasks/demand.py), and the next wake or warm slot wakes it on time.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from preheat.catalog import Catalog
from preheat.models import RunAction, Schedule, ScheduleSlot, SlotStatus

# Slots looked at, newest first: far more than a fleet's schedules fire between two restarts.
RECENT_SLOTS = 2000


def models_targeted(catalog: Catalog, targets: dict) -> set[str]:
    """The models a schedule acts on: those named, those of its templates, else all."""
    if targets.get("models"):
        return set(targets["models"])
    if targets.get("templates"):
        return {catalog.template(name).model for name in targets["templates"] if name in catalog.templates}
    return set(catalog.models)


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
        for model in models_targeted(catalog, targets) - decided.keys():
            asleep = RunAction(action) == RunAction.sleep
            decided[model] = f"schedule {name} put it to sleep at {fire_at:%Y-%m-%d %H:%M} UTC" if asleep else None
    return {model: why for model, why in decided.items() if why is not None and model in catalog.models}
