"""Beat, with the schedules in the database: `celery -A preheat beat` runs DatabaseScheduler.

Why not a library: celery-redbeat keeps schedules in Redis (they would not survive a Redis
restart without persistence) and has no per-schedule time zone; sqlalchemy-celery-beat
has time zones and runtime edits but no leader lock, creates its own tables outside
Alembic and records no slots. Celery's ``Scheduler`` still runs the loop and the static
entries (each endpoint's keep-alive); slots come from the ``schedules`` table.

Each tick the leader (preheat.schedules.leader) reads the enabled schedules, so edits apply within
a tick. For each schedule it finds the slots whose fire time (cron time − lead time) has
come since its last recorded slot. A slot is recorded (claimed) before it is sent, under a
unique (schedule, slot) key, and its run carries the slot as trigger key; so two beats, or
a beat restarted mid-send, fire a slot at most once. A slot whose fire time passed longer
than the grace window ago, while no beat ran, is recorded `missed`; of several slots within
the window only the newest fires (the others are `missed`, superseded). A slot that could
not be sent (broker away) is `unsent` and retried while within the window.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from dataclasses import dataclass

from celery.beat import Scheduler
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import SQLAlchemyError

from preheat.core.catalog import Catalog, load_catalog
from preheat.core.errors import PreheatError
from preheat.core.settings import get_settings
from preheat.history import prune
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import RunAction, Schedule, ScheduleKind, SlotStatus, TriggerKind
from preheat.schedules import leader, store

log = logging.getLogger(__name__)

KEEPALIVE_PREFIX = "keepalive:"
# After a long outage, look back this far for slots to record as missed, and record at most
# this many per schedule (a per-minute cron down for a week would be 10,080 rows).
MISSED_LOOKBACK = dt.timedelta(days=1)
MAX_MISSED_RECORDED = 100
NEVER = dt.datetime.min.replace(tzinfo=dt.UTC)
# The leader prunes history (preheat/prune.py) when it takes the lead and this often after;
# a prune that failed (database away) is tried again sooner.
PRUNE_EVERY = dt.timedelta(days=1)
PRUNE_RETRY = dt.timedelta(hours=1)


def keepalive_entries(catalog: Catalog) -> dict:
    """A keep-alive entry per endpoint with templates, fired as `preheat.keep_alive_endpoint`."""
    entries = {}
    for name, endpoint in catalog.endpoints.items():
        if endpoint.keepalive_interval_s and endpoint.templates:
            # Below the provider's prompt-cache TTL (checked by the catalog); the task itself
            # sends nothing outside the endpoint's active hours.
            entries[f"{KEEPALIVE_PREFIX}{name}"] = {
                "task": "preheat.keep_alive_endpoint",
                "schedule": dt.timedelta(seconds=endpoint.keepalive_interval_s),
                "kwargs": {"endpoint": name},
                "options": {"expires": endpoint.keepalive_interval_s},  # a late ping is no ping
            }
    return entries


@dataclass(frozen=True)
class DueSlot:
    schedule_id: uuid.UUID
    name: str
    kind: ScheduleKind
    targets: dict
    detail: dict
    lead_time_s: int
    slot_at: dt.datetime
    fire_at: dt.datetime
    action: RunAction = RunAction.warm
    sleep_level: int | None = None

    @classmethod
    def of(cls, schedule: Schedule, slot_at: dt.datetime, fire_at: dt.datetime) -> DueSlot:
        return cls(
            schedule.id,
            schedule.name,
            schedule.kind,
            dict(schedule.targets),
            dict(schedule.detail),
            schedule.lead_time_s,
            slot_at,
            fire_at,
            RunAction(schedule.action),
            schedule.sleep_level,
        )

    @property
    def trigger_key(self) -> str:
        return f"schedule:{self.schedule_id}:{self.slot_at:%Y-%m-%dT%H:%M:%SZ}"


def find_due(now: dt.datetime, grace_s: float) -> list[DueSlot]:
    """Record the slots that are too late as missed; return the ones to fire now."""
    return _due_and_next(now, grace_s)[0]


def _due_and_next(now: dt.datetime, grace_s: float) -> tuple[list[DueSlot], dt.datetime | None]:
    """The slots to fire now, and the next fire time after now of any enabled schedule."""
    grace = dt.timedelta(seconds=grace_s)
    due, next_fire = [], None
    with session_scope() as session:
        last = store.last_slots(session)
        for schedule in store.enabled(session):
            lead = dt.timedelta(seconds=schedule.lead_time_s)
            # Fire times after the schedule became active, slots after its newest recorded one.
            since = max(aware(schedule.active_since) + lead, last.get(schedule.id, NEVER), now + lead - MISSED_LOOKBACK)
            slots = list(store.cron_of(schedule.cron, schedule.timezone).slots(since, now + lead))
            slots = slots[-MAX_MISSED_RECORDED:]
            in_time = [slot for slot in slots if now - (slot - lead) <= grace]
            for slot in slots[: len(slots) - len(in_time)]:  # slots are in order: the late ones come first
                late = (now - (slot - lead)).total_seconds()
                store.record_missed(
                    session,
                    schedule,
                    slot,
                    slot - lead,
                    f"no beat ran: fire time passed {late:.0f} s ago (grace {grace_s:g} s)",
                )
            for slot in in_time[:-1]:
                store.record_missed(
                    session, schedule, slot, slot - lead, f"superseded by the slot at {in_time[-1]:%Y-%m-%d %H:%M}Z"
                )
            if in_time:
                due.append(DueSlot.of(schedule, in_time[-1], in_time[-1] - lead))
            upcoming = store.next_fire_at(schedule, now)
            if upcoming is not None and (next_fire is None or upcoming < next_fire):
                next_fire = upcoming
    return due, next_fire


def send_slot(slot: DueSlot, holder: str, now: dt.datetime) -> tuple[SlotStatus, uuid.UUID | None, str | None]:
    """Dispatch the slot's warmup (its run keyed by the slot); what became of it, and why."""
    from preheat.fleet.dispatch import dispatch_endpoint_warmup, dispatch_warmup
    from preheat.fleet.sleep import dispatch_endpoint_sleep_wake, dispatch_sleep_wake

    detail = {
        "schedule": slot.name,
        "slot": slot.slot_at.isoformat(),
        "fire_at": slot.fire_at.isoformat(),
        "lead_time_s": slot.lead_time_s,
        "late_s": round((now - slot.fire_at).total_seconds(), 1),
    }
    if slot.detail:
        detail["peak"] = slot.detail
    trigger = TriggerKind.peak if slot.kind == ScheduleKind.peak else TriggerKind.schedule
    common = {
        "templates": slot.targets.get("templates") or None,
        "trigger": trigger,
        "detail": detail,
        "requested_by": f"beat {holder}",
        "trigger_key": slot.trigger_key,
    }
    try:
        if slot.action != RunAction.warm and slot.targets.get("endpoints"):
            dispatched = dispatch_endpoint_sleep_wake(
                slot.action, slot.targets["endpoints"], level=slot.sleep_level, **common
            )
        elif slot.action != RunAction.warm:
            dispatched = dispatch_sleep_wake(
                slot.action,
                models=slot.targets.get("models") or None,
                workers=slot.targets.get("workers") or None,
                level=slot.sleep_level or 1,
                **common,
            )
        elif slot.targets.get("endpoints"):
            dispatched = dispatch_endpoint_warmup(slot.targets["endpoints"], **common)
        else:
            dispatched = dispatch_warmup(workers=slot.targets.get("workers") or None, **common)
    except PreheatError as exc:  # no live worker, a target gone from the catalog: nothing to send
        return SlotStatus.failed, None, str(exc)
    except BrokerError as exc:
        return SlotStatus.unsent, None, f"broker unreachable: {exc}"
    log.info(
        "fired %s slot %s (lead %d s) -> run %s on %s%s",
        slot.name,
        slot.slot_at.isoformat(),
        slot.lead_time_s,
        dispatched.run_id.hex[:8],
        ", ".join(dispatched.workers),
        " (recorded before)" if dispatched.duplicate else "",
    )
    return SlotStatus.sent, dispatched.run_id, None


def fire(slot: DueSlot, slot_id: uuid.UUID, holder: str, now: dt.datetime) -> SlotStatus:
    status, run_id, error = send_slot(slot, holder, now)
    if error:
        log.warning("slot %s of %s is %s: %s", slot.slot_at.isoformat(), slot.name, status, error)
    with session_scope() as session:
        store.settle(session, slot_id, status, run_id=run_id, error=error)
    return status


def fire_due(now: dt.datetime, holder: str, *, grace_s: float, lease_s: float) -> dict[str, SlotStatus]:
    """One pass of the leader: new due slots, then slots to retry. Returns what each became."""
    return _fire_pass(now, holder, grace_s=grace_s, lease_s=lease_s)[0]


def _fire_pass(
    now: dt.datetime, holder: str, *, grace_s: float, lease_s: float
) -> tuple[dict[str, SlotStatus], dt.datetime | None]:
    fired = {}
    due, next_fire = _due_and_next(now, grace_s)
    overruled = overruled_sleeps(due)
    for slot in due:
        with session_scope() as session:
            claimed = store.claim(session, slot.schedule_id, slot.name, slot.slot_at, slot.fire_at, holder, now)
            slot_id = claimed.id if claimed else None
        if slot_id is None:
            continue
        if slot.trigger_key in overruled:
            with session_scope() as session:
                store.settle(session, slot_id, SlotStatus.failed, error=overruled[slot.trigger_key])
            fired[slot.trigger_key] = SlotStatus.failed
        else:
            fired[slot.trigger_key] = fire(slot, slot_id, holder, now)
    fired.update(retry(now, holder, grace_s=grace_s, stale_before=now - dt.timedelta(seconds=lease_s)))
    return fired, next_fire


def overruled_sleeps(due: list[DueSlot]) -> dict[str, str]:
    """The rule at fire time (store.check_contradictions refuses most at add): a sleep due
    together with a warm or a wake of a model it shares does not fire; the warm does, as a
    user at the peak matters more than the memory saved. Returns the sleeps' reasons."""
    catalog = load_catalog(get_settings().catalog)
    overruled = {}
    for sleep in (slot for slot in due if slot.action == RunAction.sleep):
        for other in (slot for slot in due if slot.action != RunAction.sleep):
            shared = store.overlap(catalog, sleep.targets, other.targets)
            if shared and store.minute_of(sleep.fire_at) == store.minute_of(other.fire_at):
                overruled[sleep.trigger_key] = (
                    f"overruled: schedule {other.name!r} {other.action}s {', '.join(sorted(shared))} in the same minute"
                )
    return overruled


def retry(now: dt.datetime, holder: str, *, grace_s: float, stale_before: dt.datetime) -> dict[str, SlotStatus]:
    fired = {}
    with session_scope() as session:
        pending = [(row, session.get(Schedule, row.schedule_id)) for row in store.to_retry(session, stale_before)]
        work = []
        for row, schedule in pending:
            if schedule is None:
                continue
            if not schedule.enabled:
                store.settle(session, row.id, SlotStatus.missed, error=f"paused before it could be sent: {row.error}")
                continue
            if (now - aware(row.fire_at)).total_seconds() > grace_s:
                why = row.error or "beat stopped mid-send"
                store.settle(
                    session,
                    row.id,
                    SlotStatus.missed,
                    error=f"could not be sent within the grace window ({grace_s:g} s): {why}",
                )
                continue
            if store.reclaim(session, row, holder, stale_before, now):
                work.append((row.id, DueSlot.of(schedule, aware(row.slot_at), aware(row.fire_at))))
    for slot_id, slot in work:
        fired[slot.trigger_key] = fire(slot, slot_id, holder, now)
    return fired


class DatabaseScheduler(Scheduler):
    """Celery beat over the schedules table, with a leader lease (see the module's docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        self.settings = get_settings()
        self.holder = leader.holder_id()
        self.leading: bool | None = None  # unknown until the first tick: then logged either way
        self._catalog_synced = False
        self._pruner: threading.Thread | None = None
        self._next_prune = NEVER
        super().__init__(*args, **kwargs)
        self.max_interval = min(self.max_interval, self.settings.beat_tick_s)

    def setup_schedule(self) -> None:
        self.install_default_entries(self.data)
        catalog = load_catalog(self.settings.catalog)
        entries = keepalive_entries(catalog)
        self.merge_inplace({**self.app.conf.beat_schedule, **entries})
        log.info(
            "beat %s: %d keep-alive entr%s; schedules from the database",
            self.holder,
            len(entries),
            "y" if len(entries) == 1 else "ies",
        )

    def _sync_catalog(self) -> None:
        if self._catalog_synced:
            return
        try:
            with session_scope() as session:
                changes = store.sync_catalog(session, load_catalog(self.settings.catalog), self.settings.timezone)
            log.info("beat: catalog schedules in step%s", f" ({', '.join(changes)})" if changes else "")
        except PreheatError as exc:  # a clash of names: the database's schedules still fire
            log.error("beat: catalog schedules not copied: %s", exc)
        self._catalog_synced = True

    def _prune_when_due(self, now: dt.datetime) -> None:
        # In a thread of its own: a first prune of a large history takes minutes, and slots
        # must go on firing meanwhile.
        days = self.settings.history_retention_days
        if not days or now < self._next_prune or (self._pruner and self._pruner.is_alive()):
            return
        self._next_prune = now + PRUNE_EVERY
        self._pruner = threading.Thread(target=self._prune, args=(days,), name="preheat-prune", daemon=True)
        self._pruner.start()

    def _prune(self, days: int) -> None:
        try:
            result = prune.prune(dt.timedelta(days=days))
        except (SQLAlchemyError, PreheatError) as exc:
            self._next_prune = utcnow() + PRUNE_RETRY
            log.warning("beat: history prune failed, tried again within the hour: %s", str(exc).splitlines()[0])
            return
        counts = " ".join(f"{table}={count}" for table, count in result.counts.items())
        log.info("beat: history older than %d days pruned: %s", days, counts)

    def _hold(self) -> bool:
        with session_scope() as session:
            held = leader.hold(session, self.holder, self.settings.beat_lease_s)
        if held != self.leading:
            log.info("beat %s %s", self.holder, "leads" if held else "is standby")
        self.leading = held
        return held

    def tick(self, *args, **kwargs) -> float:
        tick_s = self.settings.beat_tick_s
        try:
            if not self._hold():
                return tick_s
            self._sync_catalog()
            self._prune_when_due(utcnow())
            _, next_fire = _fire_pass(
                utcnow(), self.holder, grace_s=self.settings.schedule_grace_s, lease_s=self.settings.beat_lease_s
            )
        except SQLAlchemyError as exc:
            # Beat outlives a database outage: nothing is fired (nothing could be recorded),
            # and slots still within the grace window fire once it is back.
            log.warning("beat: history database unavailable, retrying: %s", str(exc).splitlines()[0])
            self.leading = False
            return tick_s
        except PreheatError as exc:
            log.error("beat: %s", exc)
            return tick_s
        # Wake for the next fire time itself, not the tick after it (a slot fires on time,
        # late only by the work of sending it); the tick bounds how soon edits are seen.
        until_next = (next_fire - utcnow()).total_seconds() if next_fire else tick_s
        return min(super().tick(*args, **kwargs), tick_s, max(until_next, 0.01))

    def close(self) -> None:
        if self.leading:
            try:
                with session_scope() as session:
                    leader.release(session, self.holder)
                log.info("beat %s gave up the lead", self.holder)
                self.leading = False  # Celery may close a scheduler twice
            except SQLAlchemyError as exc:
                log.warning("beat: could not release the lead (it expires): %s", str(exc).splitlines()[0])
        super().close()
