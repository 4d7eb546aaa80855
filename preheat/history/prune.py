"""History that does not grow for ever: `preheat db prune` and beat's daily prune.

What goes, when older than the cut-off:
- runs whose every job has finished (and with them their jobs): a run that is queued or
  running, or has a job that is, stays whatever its age, because the reaper, a re-delivered
  result or the outbox may still write to it;
- schedule slots that are settled, except each schedule's newest: beat finds the slots
  still to fire from the newest one recorded (preheat.schedules.store.last_slots), so pruning it
  would make beat record a day of `missed` slots again;
- traffic counts (what peaks and template ranks learn from: keep more days than
  `preheat peaks suggest --days` reads);
- workers stopped or silent since before the cut-off that no unfinished job targets (the
  reaper reads a job's worker to call it lost);
- `applied_writes`, but never younger than APPLIED_WRITES_KEPT: an outbox entry applied
  just before its worker died is replayed when the worker returns, and this row is what
  keeps the replay from writing it twice.

Deletes go in batches of `batch_size` rows, one transaction each, so no lock is held for
long and every statement stays inside the database timeout; a prune stopped half-way has
deleted whole batches only and is simply run again. A dry run counts what would go.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Select, delete, exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from preheat.core.errors import ConfigError
from preheat.core.states import JobStatus, RunStatus, SlotStatus
from preheat.history.db import session_scope, utcnow
from preheat.history.models import AppliedWrite, ScheduleSlot, TrafficCount, WarmupJob, WarmupRun, WorkerRecord

# Beat looks back a day for slots it must record as missed (preheat.schedules.beat.MISSED_LOOKBACK);
# a shorter retention would delete what it is still reasoning about.
MIN_OLDER_THAN = dt.timedelta(days=1)
APPLIED_WRITES_KEPT = dt.timedelta(days=7)
DEFAULT_BATCH_SIZE = 1000
TABLES = ("warmup_runs", "warmup_jobs", "schedule_slots", "traffic_counts", "workers", "applied_writes")

UNFINISHED_JOB = WarmupJob.status.in_([JobStatus.queued, JobStatus.running])
FINAL_RUN = WarmupRun.status.in_([RunStatus.succeeded, RunStatus.degraded, RunStatus.failed])
SETTLED_SLOT = ScheduleSlot.status.in_([SlotStatus.sent, SlotStatus.failed, SlotStatus.missed])


@dataclass
class PruneResult:
    cutoff: dt.datetime
    dry_run: bool
    counts: dict[str, int] = field(default_factory=dict)  # table -> rows deleted (or that would be)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_older_than(older_than: dt.timedelta) -> None:
    if older_than < MIN_OLDER_THAN:
        raise ConfigError(
            f"--older-than must be at least {MIN_OLDER_THAN.days} day: beat still reads the last day's "
            "slots, and a younger run may yet be written to"
        )


def check_within_retention(days_read: int, retention_days: int, option: str) -> None:
    """A command that learns from `days_read` days of history must not read past what the
    prune keeps: it would learn from fewer days than it says, without a word."""
    if retention_days and days_read > retention_days:
        raise ConfigError(
            f"{option} reads {days_read} days of traffic, but history keeps {retention_days} "
            "(PREHEAT_HISTORY_RETENTION_DAYS): read fewer days or keep more"
        )


def prune(
    older_than: dt.timedelta,
    *,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: dt.datetime | None = None,
) -> PruneResult:
    """Delete (or, with `dry_run`, count) the history older than `older_than`."""
    check_older_than(older_than)
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, not {batch_size}")
    now = now or utcnow()
    cutoff = now - older_than
    result = PruneResult(cutoff=cutoff, dry_run=dry_run, counts=dict.fromkeys(TABLES, 0))
    applied_cutoff = min(cutoff, now - APPLIED_WRITES_KEPT)
    steps = (
        ("warmup_runs", _runs(cutoff), _delete_runs),
        ("schedule_slots", _slots(cutoff), _delete_rows(ScheduleSlot)),
        ("traffic_counts", select(TrafficCount.id).where(TrafficCount.minute < cutoff), _delete_rows(TrafficCount)),
        ("workers", _workers(cutoff), _delete_rows(WorkerRecord)),
        (
            "applied_writes",
            select(AppliedWrite.id).where(AppliedWrite.applied_at < applied_cutoff),
            _delete_rows(AppliedWrite),
        ),
    )
    for table, ids, remove in steps:
        if dry_run:
            result.counts[table] = _count(ids)
            if table == "warmup_runs":
                result.counts["warmup_jobs"] = _count(select(WarmupJob.id).where(WarmupJob.run_id.in_(ids)))
        else:
            for name, deleted in _in_batches(ids, remove, batch_size).items():
                result.counts[name] += deleted
    return result


def _runs(cutoff: dt.datetime) -> Select:
    unfinished = exists().where(WarmupJob.run_id == WarmupRun.id, UNFINISHED_JOB)
    return select(WarmupRun.id).where(WarmupRun.created_at < cutoff, FINAL_RUN, ~unfinished)


def _slots(cutoff: dt.datetime) -> Select:
    newer = aliased(ScheduleSlot)
    has_newer = exists().where(newer.schedule_id == ScheduleSlot.schedule_id, newer.slot_at > ScheduleSlot.slot_at)
    return select(ScheduleSlot.id).where(ScheduleSlot.slot_at < cutoff, SETTLED_SLOT, has_newer)


def _workers(cutoff: dt.datetime) -> Select:
    gone = or_(WorkerRecord.stopped_at < cutoff, WorkerRecord.heartbeat_at < cutoff)
    targeted = exists().where(WarmupJob.target == WorkerRecord.nodename, UNFINISHED_JOB)
    return select(WorkerRecord.id).where(gone, ~targeted)


def _count(ids: Select) -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(ids.subquery()))


def _in_batches(ids: Select, remove: Callable[[Session, list], dict[str, int]], batch_size: int) -> Counter:
    deleted: Counter = Counter()
    while True:
        # Each batch re-asks which rows qualify, in its own transaction: a run that got a
        # new job meanwhile is no longer picked, and a prune stopped half-way resumes.
        with session_scope() as session:
            batch = list(session.scalars(ids.limit(batch_size)))
            if batch:
                deleted.update(remove(session, batch))
        if len(batch) < batch_size:
            return deleted


def _delete_runs(session: Session, run_ids: list) -> dict[str, int]:
    # Jobs first and slots' references cleared, by statement: the same on SQLite and
    # Postgres whatever the foreign keys' ON DELETE says.
    jobs = session.execute(delete(WarmupJob).where(WarmupJob.run_id.in_(run_ids))).rowcount
    session.execute(update(ScheduleSlot).where(ScheduleSlot.run_id.in_(run_ids)).values(run_id=None))
    runs = session.execute(delete(WarmupRun).where(WarmupRun.id.in_(run_ids))).rowcount
    return {"warmup_runs": runs, "warmup_jobs": jobs}


def _delete_rows(model) -> Callable[[Session, list], dict[str, int]]:
    def remove(session: Session, ids: list) -> dict[str, int]:
        return {model.__tablename__: session.execute(delete(model).where(model.id.in_(ids))).rowcount}

    return remove
