"""History pruning on both databases: what goes, what stays whatever its age, the dry run,
the CLI's refusals, and a real beat process pruning on its own."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from sqlalchemy import func, select

from preheat.core import processes
from preheat.core.errors import ConfigError
from preheat.core.states import JobStatus, RunStatus, TriggerKind
from preheat.history import prune, service
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import (
    AppliedWrite,
    Schedule,
    ScheduleSlot,
    SlotStatus,
    TrafficCount,
    WarmupJob,
    WarmupRun,
    WorkerRecord,
)

NOW = utcnow()
OLD = NOW - dt.timedelta(days=40)
YOUNG = NOW - dt.timedelta(days=2)


def _run(created_at, status: RunStatus, job_statuses, target="w-gone@host") -> uuid.UUID:
    with session_scope() as session:
        run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
        service.add_jobs(
            session,
            run,
            target=target,
            task_id=str(uuid.uuid4()),
            model_templates=[("tiny", f"t{n}") for n in range(len(job_statuses))],
        )
        run.created_at, run.status = created_at, status
        for job, job_status in zip(run.jobs, job_statuses, strict=True):
            job.status = job_status
        return run.id


def _worker(nodename: str, heartbeat_at, stopped_at=None) -> None:
    with session_scope() as session:
        session.add(
            WorkerRecord(
                nodename=nodename,
                hostname="host",
                pid=1,
                started_at=heartbeat_at,
                heartbeat_at=heartbeat_at,
                stopped_at=stopped_at,
            )
        )


def _schedule_with_slots(name: str, slots: list[tuple[dt.datetime, SlotStatus]]) -> None:
    with session_scope() as session:
        schedule = Schedule(name=name, cron="0 8 * * *", targets={"templates": ["support"]})
        session.add(schedule)
        session.flush()
        for slot_at, status in slots:
            session.add(
                ScheduleSlot(
                    schedule_id=schedule.id, schedule_name=name, slot_at=slot_at, fire_at=slot_at, status=status
                )
            )


def _seed() -> dict:
    """One of each thing prune decides about; returns the ids that must stay."""
    keep = {
        "running_job": _run(OLD, RunStatus.running, [JobStatus.warm, JobStatus.running], target="w-busy@host"),
        "queued_run": _run(OLD, RunStatus.queued, [JobStatus.queued], target="w-busy@host"),
        "young": _run(YOUNG, RunStatus.succeeded, [JobStatus.warm]),
    }
    for _ in range(5):  # more than a batch (2 below), so the loop is exercised
        _run(OLD, RunStatus.succeeded, [JobStatus.warm, JobStatus.skipped])
    _run(OLD, RunStatus.failed, [JobStatus.lost])
    _schedule_with_slots(
        "daily",
        [
            (OLD - dt.timedelta(days=2), SlotStatus.sent),
            (OLD - dt.timedelta(days=1), SlotStatus.missed),
            (OLD, SlotStatus.sent),  # the newest: beat counts from it, so it stays
        ],
    )
    _schedule_with_slots("stuck", [(OLD - dt.timedelta(days=1), SlotStatus.failed), (OLD, SlotStatus.unsent)])
    _worker("w-gone@host", OLD)  # silent for 40 days, nothing unfinished
    _worker("w-stopped@host", OLD, stopped_at=OLD)
    _worker("w-busy@host", OLD)  # silent, but a running job names it: the reaper reads it
    _worker("w-live@host", NOW)
    with session_scope() as session:
        for minute, template in ((OLD, "support"), (OLD, "code"), (YOUNG, "support")):
            session.add(TrafficCount(minute=minute, model="tiny", template=template, requests=3))
        for age_days in (3, 10, 40):
            session.add(AppliedWrite(source="w", kind="job_finish", applied_at=NOW - dt.timedelta(days=age_days)))
    return keep


def _rows(model) -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(model))


EXPECTED = {
    "warmup_runs": 6,
    "warmup_jobs": 11,
    "schedule_slots": 3,
    "traffic_counts": 2,
    "workers": 2,
    "applied_writes": 1,
}


def test_prune_deletes_what_is_finished_and_old_and_keeps_what_is_still_needed(stack):
    keep = _seed()
    before = {model: _rows(model) for model in (WarmupRun, WarmupJob, ScheduleSlot, TrafficCount, WorkerRecord)}

    counted = prune.prune(dt.timedelta(days=30), dry_run=True, now=NOW)
    assert counted.counts == EXPECTED and counted.dry_run
    assert {model: _rows(model) for model in before} == before  # a dry run deletes nothing

    pruned = prune.prune(dt.timedelta(days=30), batch_size=2, now=NOW)
    assert pruned.counts == EXPECTED  # what the dry run counted is what went

    with session_scope() as session:
        assert set(session.scalars(select(WarmupRun.id))) == set(keep.values())
        assert session.scalar(select(func.count()).select_from(WarmupJob)) == 4  # the kept runs' jobs, all
        slots = {(s.schedule_name, s.status) for s in session.scalars(select(ScheduleSlot))}
        assert slots == {("daily", SlotStatus.sent), ("stuck", SlotStatus.unsent)}
        workers = set(session.scalars(select(WorkerRecord.nodename)))
        assert workers == {"w-busy@host", "w-live@host"}
        assert session.scalar(select(func.count()).select_from(TrafficCount)) == 1
        assert session.scalar(select(func.count()).select_from(AppliedWrite)) == 2

    again = prune.prune(dt.timedelta(days=30), now=NOW)
    assert again.total == 0  # idempotent

    # A day's retention still keeps a week of applied outbox writes: a worker that died just
    # after applying an entry replays it on its return, and this row stops a second write.
    assert prune.prune(dt.timedelta(days=1), now=NOW).counts["applied_writes"] == 1
    with session_scope() as session:
        [kept] = session.scalars(select(AppliedWrite.applied_at))
        assert NOW - aware(kept) < dt.timedelta(days=4)


@pytest.mark.parametrize("older_than", [dt.timedelta(hours=23), dt.timedelta(0), dt.timedelta(days=-3)])
def test_a_retention_shorter_than_a_day_is_refused(embedded_stack, older_than):
    with pytest.raises(ConfigError, match="at least 1 day"):
        prune.prune(older_than)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "12h"], "at least 1 day"),
        (["--older-than", "soon"], "expected e.g. 30d"),
        (["--older-than", "99999999999d"], "longer than the calendar"),
        (["--older-than", "30d", "--batch-size", "0"], "batch-size"),
        ([], "--older-than"),
    ],
)
def test_the_cli_refuses_bad_input_with_one_line_and_deletes_nothing(embedded_stack, args, message):
    _run(OLD, RunStatus.succeeded, [JobStatus.warm])
    result = embedded_stack.cli_here("db", "prune", *args)
    assert result.returncode == 2 and message in result.stdout + result.stderr, result
    assert "Traceback" not in result.stderr
    assert _rows(WarmupRun) == 1


def test_the_cli_counts_with_dry_run_and_then_prunes(embedded_stack):
    _run(OLD, RunStatus.succeeded, [JobStatus.warm, JobStatus.warm])
    dry = embedded_stack.cli_here("db", "prune", "--older-than", "30d", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] and report["counts"]["warmup_runs"] == 1 and report["counts"]["warmup_jobs"] == 2
    assert _rows(WarmupRun) == 1
    done = embedded_stack.cli_here("db", "prune", "--older-than", "30d")
    assert done.returncode == 0 and "rows deleted" in done.stdout and "warmup_jobs" in done.stdout, done
    assert _rows(WarmupRun) == 0 and _rows(WarmupJob) == 0


def test_a_leading_beat_prunes_history_past_the_retention_setting(embedded_stack, tmp_path):
    """A real `celery beat`: it prunes once it leads (and daily after), from the setting."""
    old = _run(OLD, RunStatus.succeeded, [JobStatus.warm])
    young = _run(YOUNG, RunStatus.succeeded, [JobStatus.warm])
    env = {**embedded_stack.env, "PREHEAT_HISTORY_RETENTION_DAYS": "30", "PREHEAT_BEAT_TICK_S": "0.5"}
    beat = processes.start(
        "beat", processes.celery_command("beat", "--loglevel=INFO"), env, tmp_path / "logs", cwd=embedded_stack.home
    )
    with processes.running(beat):
        processes.wait_for_log(beat, "history older than 30 days pruned", 60)
    with session_scope() as session:
        assert set(session.scalars(select(WarmupRun.id))) == {young}
    assert old != young and "warmup_runs=1" in beat.log() and "Traceback" not in beat.log()
