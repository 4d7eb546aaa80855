"""The schedules table and its slots: the service behind `preheat schedule …` and beat.

Functions take a session; callers own the transaction. A schedule is validated whole
before anything is written (cron, time zone, targets against the catalog), so a bad
`preheat schedule add` leaves nothing behind.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from preheat.core.catalog import NAME_PATTERN, Catalog
from preheat.core.cron import Cron, CronError, cron_of, fire_time_after
from preheat.core.errors import ConfigError, UnknownNameError
from preheat.history.db import aware, utcnow
from preheat.history.models import RunAction, Schedule, ScheduleKind, ScheduleSlot, SlotStatus

MAX_LEAD_TIME_S = 86400
# How far ahead `add` and `resume` look for a contradicting schedule (a week and a day:
# every weekly pattern meets itself once).
CONTRADICTION_HORIZON = dt.timedelta(days=8)


def targets_of(
    catalog: Catalog,
    *,
    templates: list[str] | None,
    workers: list[str] | None,
    endpoints: list[str] | None,
    models: list[str] | None = None,
    action: RunAction = RunAction.warm,
) -> dict:
    """The targets a schedule acts on, checked against the catalog; one clear error otherwise."""
    if workers and endpoints:
        raise ConfigError("a schedule warms workers or endpoints, not both: give --worker or --endpoint")
    if models and action == RunAction.warm:
        raise ConfigError("--model is for sleep and wake schedules; a warm schedule names templates")
    if models and templates:
        raise ConfigError("give --model or --template, not both: a sleep or a wake acts on whole models")
    if endpoints and models:
        raise ConfigError("--model names workers' models; an endpoint's sleep or wake acts on the endpoint")
    for endpoint in endpoints or []:
        if action != RunAction.warm and catalog.endpoint(endpoint).sleep is None:
            raise ConfigError(f"endpoint {endpoint!r} declares no sleep: add [endpoints.{endpoint}.sleep]")
    for model in models or []:
        catalog.model(model)
    for template in templates or []:
        catalog.template(template)
    for endpoint in endpoints or []:
        catalog.endpoint(endpoint)
    for worker in workers or []:
        # A Celery nodename (name@host): printable, no spaces, as its own queue's name is made from it.
        if not worker or len(worker) > 255 or not worker.isprintable() or any(c.isspace() for c in worker):
            raise ConfigError(f"worker name {worker!r} is not a Celery nodename (no spaces, at most 255)")
    targets = {"templates": list(dict.fromkeys(templates or []))}
    if endpoints:
        targets["endpoints"] = list(dict.fromkeys(endpoints))
    if workers:
        targets["workers"] = list(dict.fromkeys(workers))
    if models:
        targets["models"] = list(dict.fromkeys(models))
    return targets


def _contradict(a: RunAction, b: RunAction) -> bool:
    """A sleep against a warm or a wake of the same model: one undoes the other."""
    return RunAction.sleep in (a, b) and a != b


def overlap(catalog: Catalog, a: dict, b: dict) -> set[str]:
    """What two schedules both act on: the models they share on workers both may reach, or
    the endpoints they both name."""
    if a.get("endpoints") or b.get("endpoints"):
        return set(a.get("endpoints") or []) & set(b.get("endpoints") or [])
    if a.get("workers") and b.get("workers") and not set(a["workers"]) & set(b["workers"]):
        return set()
    return catalog.models_targeted(a) & catalog.models_targeted(b)


def _fire_minutes(cron: str, timezone: str, lead_s: int, now: dt.datetime) -> set[dt.datetime]:
    lead = dt.timedelta(seconds=lead_s)
    slots = cron_of(cron, timezone).slots(now + lead, now + lead + CONTRADICTION_HORIZON)
    return {minute_of(slot - lead) for slot in slots}


def minute_of(moment: dt.datetime) -> dt.datetime:
    """The minute a fire time falls in: what two contradicting schedules are compared by."""
    return moment.replace(second=0, microsecond=0)


def check_contradictions(session: Session, catalog: Catalog, schedule: Schedule, now: dt.datetime) -> None:
    """The written rule: no two enabled schedules may sleep and warm (or wake) one model in
    the same minute within the next CONTRADICTION_HORIZON; the one being added or resumed
    is refused, naming the other and the minute. (Past the horizon, beat applies the rule
    at fire time: the warm or wake fires, the sleep is recorded failed.)"""
    mine = None
    for other in enabled(session):
        if other.id == schedule.id or not _contradict(schedule.action, other.action):
            continue
        shared = overlap(catalog, schedule.targets, other.targets)
        if not shared:
            continue
        if mine is None:
            mine = _fire_minutes(schedule.cron, schedule.timezone, schedule.lead_time_s, now)
        same = mine & _fire_minutes(other.cron, other.timezone, other.lead_time_s, now)
        if same:
            raise ConfigError(
                f"schedule {schedule.name!r} would {schedule.action} {', '.join(sorted(shared))} in the same minute "
                f"as schedule {other.name!r} would {other.action} it ({min(same):%Y-%m-%d %H:%M} UTC): "
                "move one of them, or pause one"
            )


MAX_CRON_LENGTH = Schedule.__table__.c.cron.type.length


def check(name: str, cron: str, timezone: str, lead_time_s: int) -> Cron:
    if not re.match(NAME_PATTERN, name):
        raise ConfigError(f"schedule name {name!r}: letters, digits, '.', '_' or '-', at most 64")
    if len(cron) > MAX_CRON_LENGTH:
        raise ConfigError(f"cron is {len(cron)} characters; at most {MAX_CRON_LENGTH}")
    if not timezone.strip():
        raise ConfigError("time zone must not be empty (an IANA name such as Europe/Berlin)")
    if not 0 <= lead_time_s <= MAX_LEAD_TIME_S:
        raise ConfigError(f"lead time {lead_time_s} s must be between 0 and {MAX_LEAD_TIME_S} (a day)")
    try:
        return Cron.parse(cron, timezone)
    except CronError as exc:
        raise ConfigError(str(exc)) from None


def next_fire_at(schedule: Schedule, after: dt.datetime) -> dt.datetime | None:
    """The schedule's first fire time (cron time − lead) after `after`."""
    return fire_time_after(schedule.cron, schedule.timezone, schedule.lead_time_s, after)


def add(
    session: Session,
    *,
    name: str,
    cron: str,
    timezone: str,
    targets: dict,
    lead_time_s: int = 0,
    kind: ScheduleKind = ScheduleKind.manual,
    detail: dict | None = None,
    enabled: bool = True,
    action: RunAction = RunAction.warm,
    sleep_level: int | None = None,
    catalog: Catalog | None = None,
) -> Schedule:
    """A new schedule. `catalog`: checked against the enabled schedules for a contradiction
    (check_contradictions); a worker sleep's level defaults to 1, an endpoint's to its own."""
    parsed = check(name, cron, timezone, lead_time_s)
    if action != RunAction.sleep and sleep_level is not None:
        raise ConfigError(f"--level is a sleep's; a {action} schedule has none")
    if sleep_level is not None and sleep_level not in (1, 2):
        raise ConfigError(f"sleep level must be 1 or 2, got {sleep_level}")
    if session.scalars(select(Schedule.id).where(Schedule.name == name)).first() is not None:
        raise ConfigError(f"schedule {name!r} exists; remove it first or pick another name")
    schedule = Schedule(
        name=name,
        kind=kind,
        cron=parsed.expression,
        timezone=timezone,
        targets=targets,
        lead_time_s=lead_time_s,
        enabled=enabled,
        detail=detail or {},
        active_since=utcnow(),
        action=action,
        # An endpoint's sleep without a level takes the level it declares.
        sleep_level=(sleep_level or (None if targets.get("endpoints") else 1)) if action == RunAction.sleep else None,
    )
    if enabled and catalog is not None:
        check_contradictions(session, catalog, schedule, utcnow())
    session.add(schedule)
    try:
        session.flush()
    except IntegrityError:  # added by someone else between the check and the insert
        raise ConfigError(f"schedule {name!r} exists; remove it first or pick another name") from None
    return schedule


def get(session: Session, name: str) -> Schedule:
    schedule = session.scalars(select(Schedule).where(Schedule.name == name)).first()
    if schedule is None:
        names = session.scalars(select(Schedule.name).order_by(Schedule.name)).all()
        raise UnknownNameError(f"unknown schedule {name!r} (have: {', '.join(names) or 'none'})")
    return schedule


def list_all(session: Session) -> list[Schedule]:
    return list(session.scalars(select(Schedule).order_by(Schedule.name)))


def enabled(session: Session) -> list[Schedule]:
    return list(session.scalars(select(Schedule).where(Schedule.enabled.is_(True)).order_by(Schedule.name)))


def set_enabled(session: Session, name: str, value: bool, catalog: Catalog | None = None) -> Schedule:
    schedule = get(session, name)
    if value and not schedule.enabled and catalog is not None:
        check_contradictions(session, catalog, schedule, utcnow())
    if value and not schedule.enabled:
        # Slots that passed while paused were not wanted: they are neither fired nor missed.
        schedule.active_since = utcnow()
    schedule.enabled = value
    return schedule


def remove(session: Session, name: str) -> None:
    schedule = get(session, name)
    if schedule.kind == ScheduleKind.catalog:
        raise ConfigError(
            f"schedule {name!r} is declared in the catalog ([schedules.{name}]): remove it there, or pause it"
        )
    session.delete(schedule)


def sync_catalog(session: Session, catalog: Catalog, default_timezone: str) -> list[str]:
    """Make the `catalog` schedules match the file's [schedules.*]; returns what changed."""
    changes = []
    declared = {name: spec for name, spec in catalog.schedules.items()}
    for schedule in session.scalars(select(Schedule).where(Schedule.kind == ScheduleKind.catalog)):
        if schedule.name not in declared:
            session.delete(schedule)
            changes.append(f"-{schedule.name}")
    for name, spec in declared.items():
        timezone = spec.timezone or default_timezone
        targets = {"templates": list(spec.templates)}
        existing = session.scalars(select(Schedule).where(Schedule.name == name)).first()
        if existing is None:
            add(
                session,
                name=name,
                cron=spec.cron,
                timezone=timezone,
                targets=targets,
                lead_time_s=spec.lead_time_s,
                kind=ScheduleKind.catalog,
            )
            changes.append(f"+{name}")
        elif existing.kind != ScheduleKind.catalog:
            raise ConfigError(
                f"catalog schedule {name!r} has the name of a {existing.kind} schedule in the "
                f"database; rename one of them"
            )
        elif (existing.cron, existing.timezone, existing.targets, existing.lead_time_s) != (
            spec.cron,
            timezone,
            targets,
            spec.lead_time_s,
        ):
            existing.cron, existing.timezone, existing.targets = spec.cron, timezone, targets
            existing.lead_time_s, existing.active_since = spec.lead_time_s, utcnow()
            changes.append(f"~{name}")
    session.flush()
    return changes


# Slots --------------------------------------------------------------------------------


def last_slots(session: Session) -> dict[uuid.UUID, dt.datetime]:
    """Each schedule's newest recorded slot: beat looks for slots after it."""
    rows = session.execute(
        select(ScheduleSlot.schedule_id, func.max(ScheduleSlot.slot_at)).group_by(ScheduleSlot.schedule_id)
    )
    return {schedule_id: aware(slot_at) for schedule_id, slot_at in rows}


def claim(
    session: Session,
    schedule_id: uuid.UUID,
    schedule_name: str,
    slot_at: dt.datetime,
    fire_at: dt.datetime,
    holder: str,
    now: dt.datetime | None = None,
) -> ScheduleSlot | None:
    """Record the slot as claimed by `holder`; None when it is recorded already (by another
    beat, or before a restart), or its schedule was removed meanwhile. The unique key
    decides, not the leader lock alone."""
    slot = ScheduleSlot(
        schedule_id=schedule_id,
        schedule_name=schedule_name,
        slot_at=slot_at,
        fire_at=fire_at,
        status=SlotStatus.claimed,
        claimed_by=holder,
        claimed_at=now or utcnow(),
        attempts=1,
    )
    try:
        with session.begin_nested():
            session.add(slot)
    except IntegrityError:
        return None
    return slot


def record_missed(
    session: Session, schedule: Schedule, slot_at: dt.datetime, fire_at: dt.datetime, reason: str
) -> bool:
    slot = ScheduleSlot(
        schedule_id=schedule.id,
        schedule_name=schedule.name,
        slot_at=slot_at,
        fire_at=fire_at,
        status=SlotStatus.missed,
        error=reason,
    )
    try:
        with session.begin_nested():
            session.add(slot)
    except IntegrityError:
        return False
    return True


def to_retry(session: Session, stale_before: dt.datetime) -> list[ScheduleSlot]:
    """Slots to send again: unsent (the broker was away), or claimed by a beat that has not
    settled them since `stale_before` (it died between claiming and recording the outcome)."""
    query = (
        select(ScheduleSlot)
        .where(
            (ScheduleSlot.status == SlotStatus.unsent)
            | ((ScheduleSlot.status == SlotStatus.claimed) & (ScheduleSlot.claimed_at < stale_before))
        )
        .order_by(ScheduleSlot.fire_at)
    )
    return list(session.scalars(query))


def reclaim(
    session: Session, slot: ScheduleSlot, holder: str, stale_before: dt.datetime, now: dt.datetime | None = None
) -> bool:
    """Take a slot to retry; a conditional update, so two beats never both retry it."""
    result = session.execute(
        update(ScheduleSlot)
        .where(
            ScheduleSlot.id == slot.id,
            (ScheduleSlot.status == SlotStatus.unsent)
            | ((ScheduleSlot.status == SlotStatus.claimed) & (ScheduleSlot.claimed_at < stale_before)),
        )
        .values(
            status=SlotStatus.claimed, claimed_by=holder, claimed_at=now or utcnow(), attempts=ScheduleSlot.attempts + 1
        )
        .execution_options(synchronize_session=False)  # SQLite's naive times cannot be compared in Python
    )
    return result.rowcount == 1


def settle(
    session: Session,
    slot_id: uuid.UUID,
    status: SlotStatus,
    *,
    run_id: uuid.UUID | None = None,
    error: str | None = None,
) -> None:
    session.execute(
        update(ScheduleSlot).where(ScheduleSlot.id == slot_id).values(status=status, run_id=run_id, error=error)
    )


def recent_slots(session: Session, name: str | None = None, limit: int = 20) -> list[ScheduleSlot]:
    query = select(ScheduleSlot).order_by(ScheduleSlot.slot_at.desc()).limit(limit)
    if name is not None:
        query = query.where(ScheduleSlot.schedule_name == name)
    return list(session.scalars(query))
