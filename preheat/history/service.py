"""History service: every warmup run and job, written as it happens, read by the CLI.

Functions take a session and ids; callers own the transaction (``session_scope``).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from preheat.core.states import WHOLE_MODEL
from preheat.history import outbox
from preheat.history.db import utcnow
from preheat.history.models import (
    EndpointKeepAlive,
    JobStatus,
    RunAction,
    RunStatus,
    TargetKind,
    TriggerKind,
    WarmupJob,
    WarmupRun,
)

# A job in one of these states counts for the run as…
_SUCCESS = {JobStatus.warm, JobStatus.skipped, JobStatus.asleep, JobStatus.awake}
_FAILURE = {JobStatus.failed, JobStatus.lost}


def create_run(
    session: Session,
    *,
    trigger: TriggerKind,
    requested_by: str,
    detail: dict | None = None,
    trigger_key: str | None = None,
    action: RunAction = RunAction.warm,
) -> WarmupRun:
    run = WarmupRun(
        trigger=trigger,
        trigger_detail=detail or {},
        requested_by=requested_by,
        trigger_key=trigger_key,
        action=action,
    )
    session.add(run)
    session.flush()
    return run


def run_for_key(session: Session, trigger_key: str) -> WarmupRun | None:
    """The run a trigger already made (see WarmupRun.trigger_key)."""
    return session.scalars(select(WarmupRun).where(WarmupRun.trigger_key == trigger_key)).first()


def add_jobs(
    session: Session,
    run: WarmupRun,
    *,
    target: str,
    model_templates: Iterable[tuple[str, str]],
    task_id: str,
    target_kind: TargetKind = TargetKind.worker,
) -> list[WarmupJob]:
    jobs = [
        WarmupJob(
            run=run, target_kind=target_kind, target=target, model=model, template=template, celery_task_id=task_id
        )
        for model, template in model_templates
    ]
    session.add_all(jobs)
    session.flush()
    return jobs


def _jobs_of(
    session: Session, run_id: uuid.UUID, target: str, templates: Sequence[str], model: str | None = None
) -> list[WarmupJob]:
    """A target's jobs of `templates`; `model` tells apart the whole-model rows (WHOLE_MODEL)
    of two models slept or woken by one task."""
    query = select(WarmupJob).where(
        WarmupJob.run_id == run_id, WarmupJob.target == target, WarmupJob.template.in_(templates)
    )
    if model is not None:
        query = query.where(WarmupJob.model == model)
    return list(session.scalars(query.with_for_update()))


def lock_run(session: Session, run_id: uuid.UUID, *, skip_locked: bool = False) -> WarmupRun | None:
    """Lock the run's row until commit. Every change of a job's state takes its run's lock
    first (runs before jobs, always, so two writers never deadlock): two workers finishing
    the last two jobs of a run at once would otherwise each see the other's job unfinished,
    and the run would stay `running` for ever (seen, on Postgres, with two workers)."""
    query = select(WarmupRun).where(WarmupRun.id == run_id).with_for_update(skip_locked=skip_locked)
    return session.scalars(query.execution_options(populate_existing=True)).first()


def start_jobs(
    session: Session,
    run_id: uuid.UUID,
    *,
    target: str,
    templates: Sequence[str],
    task_id: str,
    at: dt.datetime | None = None,
) -> list[WarmupJob]:
    """Mark a target's jobs running (`at`: when, if written later from the outbox).
    Returns [] when the run is gone (deleted meanwhile)."""
    run = lock_run(session, run_id)
    if run is None:
        return []
    jobs = _jobs_of(session, run_id, target, templates)
    now = at or utcnow()
    for job in jobs:
        # A re-delivered message (worker died, visibility timeout) restarts its own row;
        # a final outcome it had is kept in `superseded`, not wiped.
        _supersede(job)
        job.status, job.started_at, job.finished_at, job.error = JobStatus.running, now, None, None
        job.celery_task_id = task_id
    if run.status in FINAL_RUN_STATUSES:
        _record_change(run, run.status, RunStatus.running)
    if run.status in (RunStatus.queued, *FINAL_RUN_STATUSES):
        run.status = RunStatus.running
    return jobs


def _supersede(job: WarmupJob) -> None:
    if job.status.is_final:
        earlier = {
            "status": str(job.status),
            "error": job.error,
            "at": job.finished_at.isoformat() if job.finished_at else None,
        }
        job.superseded = [*(job.superseded or []), earlier]


def _record_change(run: WarmupRun, before: RunStatus, after: RunStatus) -> None:
    run.status_changes = [
        *(run.status_changes or []),
        {"from": str(before), "to": str(after), "at": utcnow().isoformat()},
    ]


def finish_job(
    session: Session,
    run_id: uuid.UUID,
    *,
    target: str,
    template: str,
    status: JobStatus,
    measured: dict,
    at: dt.datetime | None = None,
    model: str | None = None,
) -> WarmupJob | None:
    if lock_run(session, run_id) is None:
        return None
    jobs = _jobs_of(session, run_id, target, [template], model)
    if not jobs:
        return None
    job = jobs[0]
    # The worker's word is final, even over a `lost` a reaper wrote while its writes waited;
    # what was said before is kept in `superseded`, so the record does not change silently.
    _supersede(job)
    for column, value in measured.items():
        setattr(job, column, value)
    job.status, job.finished_at = status, at or utcnow()
    session.flush()
    refresh_run_status(session, run_id)
    return job


def fail_task_jobs(session: Session, task_id: str, error: str, at: dt.datetime | None = None) -> int:
    """A task died with an exception: its unfinished jobs are failed with the reason."""
    unfinished = [JobStatus.queued, JobStatus.running]
    run_ids = session.scalars(select(WarmupJob.run_id).where(WarmupJob.celery_task_id == task_id).distinct()).all()
    failed = 0
    for run_id in sorted(run_ids):
        lock_run(session, run_id)
        jobs = session.scalars(
            select(WarmupJob)
            .where(WarmupJob.run_id == run_id, WarmupJob.celery_task_id == task_id, WarmupJob.status.in_(unfinished))
            .with_for_update()
        ).all()
        for job in jobs:
            job.status, job.finished_at, job.error = JobStatus.failed, at or utcnow(), error
        session.flush()
        refresh_run_status(session, run_id)
        failed += len(jobs)
    return failed


def derive_run_status(statuses: Sequence[JobStatus]) -> RunStatus:
    if not statuses or all(s == JobStatus.queued for s in statuses):
        return RunStatus.queued
    if not all(s.is_final for s in statuses):
        return RunStatus.running
    if any(s in _FAILURE for s in statuses):
        return RunStatus.failed
    if all(s in _SUCCESS for s in statuses):
        return RunStatus.succeeded
    return RunStatus.degraded


FINAL_RUN_STATUSES = (RunStatus.succeeded, RunStatus.degraded, RunStatus.failed)


def refresh_run_status(session: Session, run_id: uuid.UUID) -> RunStatus:
    run = session.get(WarmupRun, run_id)
    jobs = session.execute(select(WarmupJob.status, WarmupJob.finished_at).where(WarmupJob.run_id == run_id)).all()
    before = run.status
    run.status = derive_run_status([status for status, _ in jobs])
    if run.status in FINAL_RUN_STATUSES:
        # When its last job finished (a write from the outbox knows it better than now),
        # not when a reaper or a replay happened to settle it.
        run.finished_at = max((at for _, at in jobs if at is not None), default=None) or utcnow()
    if before in FINAL_RUN_STATUSES and run.status != before:
        _record_change(run, before, run.status)  # a final status that changes says so
    return run.status


def get_run(session: Session, run_id: uuid.UUID) -> WarmupRun | None:
    return session.scalars(
        select(WarmupRun).where(WarmupRun.id == run_id).options(selectinload(WarmupRun.jobs))
    ).first()


def find_run(session: Session, prefix: str) -> WarmupRun | None:
    """A run by full id or by a unique prefix of its hex form, as printed by the CLI."""
    hex_prefix = prefix.replace("-", "").lower()
    if not 1 <= len(hex_prefix) <= 32 or any(c not in "0123456789abcdef" for c in hex_prefix):
        return None
    # UUIDs order like their hex digits on Postgres (uuid) and SQLite (char(32)): a prefix is a range.
    low = uuid.UUID(hex_prefix.ljust(32, "0"))
    high = uuid.UUID(hex_prefix.ljust(32, "f"))
    matches = session.scalars(select(WarmupRun.id).where(WarmupRun.id.between(low, high)).limit(2)).all()
    return get_run(session, matches[0]) if len(matches) == 1 else None


def list_runs(
    session: Session,
    *,
    trigger: TriggerKind | None = None,
    status: RunStatus | None = None,
    since: dt.datetime | None = None,
    limit: int = 20,
) -> list[WarmupRun]:
    query = select(WarmupRun).options(selectinload(WarmupRun.jobs)).order_by(WarmupRun.created_at.desc())
    if trigger is not None:
        query = query.where(WarmupRun.trigger == trigger)
    if status is not None:
        query = query.where(WarmupRun.status == status)
    if since is not None:
        query = query.where(WarmupRun.created_at >= since)
    return list(session.scalars(query.limit(limit)))


def record_keepalive(
    session: Session,
    endpoint: str,
    *,
    sent: int,
    failed: int,
    skipped: bool,
    ttft_ms: float | None,
    error: str | None,
    at: dt.datetime | None = None,
) -> EndpointKeepAlive:
    """Add one keep-alive tick to the endpoint's counters."""
    row = session.scalars(
        select(EndpointKeepAlive).where(EndpointKeepAlive.endpoint == endpoint).with_for_update()
    ).first()
    if row is None:
        row = EndpointKeepAlive(endpoint=endpoint, pings_sent=0, pings_failed=0, skipped_inactive=0)
        session.add(row)
    row.pings_sent += sent
    row.pings_failed += failed
    row.skipped_inactive += int(skipped)
    if sent or failed:
        row.last_ping_at, row.last_error = at or utcnow(), error
        row.last_ttft_ms = ttft_ms if ttft_ms is not None else row.last_ttft_ms
    session.flush()
    return row


def keepalives(session: Session) -> list[EndpointKeepAlive]:
    return list(session.scalars(select(EndpointKeepAlive).order_by(EndpointKeepAlive.endpoint)))


# The same writes as outbox entries (preheat.history.outbox): a worker's record of its own work,
# written later, with the times it happened, when the database was away. Each kind is
# defined here once: its name, the payload `report_*` builds, and how it is applied.


def _at(payload: dict) -> dt.datetime | None:
    return dt.datetime.fromisoformat(payload["at"]) if payload.get("at") else None


def _apply_job_start(session: Session, p: dict) -> bool:
    return bool(
        start_jobs(
            session,
            uuid.UUID(p["run_id"]),
            target=p["target"],
            templates=p["templates"],
            task_id=p["task_id"],
            at=_at(p),
        )
    )


def _apply_job_finish(session: Session, p: dict) -> None:
    finish_job(
        session,
        uuid.UUID(p["run_id"]),
        target=p["target"],
        template=p["template"],
        status=JobStatus(p["status"]),
        measured=p["measured"],
        at=_at(p),
        model=p.get("model"),
    )


def _apply_task_failure(session: Session, p: dict) -> None:
    fail_task_jobs(session, p["task_id"], p["error"], at=_at(p))


def _apply_wake_on_demand(session: Session, p: dict) -> None:
    """A wake a request made inline on a worker (no run dispatched it): a run of its own, with
    the worker's whole-model job as it started and ended; once, by its key."""
    if run_for_key(session, p["key"]) is not None:
        return
    detail = {"model": p["model"], "woken_by": "a request on the worker's own queue"}
    run = create_run(
        session,
        trigger=TriggerKind.demand,
        requested_by=f"request on {p['target']}",
        detail=detail,
        trigger_key=p["key"],
        action=RunAction.wake,
    )
    add_jobs(session, run, target=p["target"], model_templates=[(p["model"], WHOLE_MODEL)], task_id=p["task_id"])
    start_jobs(
        session,
        run.id,
        target=p["target"],
        templates=[WHOLE_MODEL],
        task_id=p["task_id"],
        at=dt.datetime.fromisoformat(p["started_at"]),
    )
    finish_job(
        session,
        run.id,
        target=p["target"],
        template=WHOLE_MODEL,
        status=JobStatus(p["status"]),
        measured=p["measured"],
        at=_at(p),
        model=p["model"],
    )


def _apply_keepalive(session: Session, p: dict) -> None:
    record_keepalive(
        session,
        p["endpoint"],
        sent=p["sent"],
        failed=p["failed"],
        skipped=p["skipped"],
        ttft_ms=p["ttft_ms"],
        error=p["error"],
        at=_at(p),
    )


JOB_START = outbox.EntryKind("job.start", _apply_job_start)
JOB_FINISH = outbox.EntryKind("job.finish", _apply_job_finish)
TASK_FAILURE = outbox.EntryKind("task.fail", _apply_task_failure)
KEEPALIVE = outbox.EntryKind("keepalive", _apply_keepalive)
WAKE_ON_DEMAND = outbox.EntryKind("wake.demand", _apply_wake_on_demand)
OUTBOX_KINDS = (JOB_START, JOB_FINISH, TASK_FAILURE, KEEPALIVE, WAKE_ON_DEMAND)


def report_job_start(run_id: str, target: str, templates: list[str], task_id: str) -> object:
    """Mark a task's jobs running, now or from the outbox: False when the run is gone,
    outbox.DEFERRED when the database is away."""
    payload = {"run_id": run_id, "target": target, "templates": templates, "task_id": task_id, "at": utcnow()}
    return outbox.record(JOB_START, payload)


def report_job_finish(
    run_id: str, target: str, template: str, status: str, measured: dict, model: str | None = None
) -> None:
    payload = {"run_id": run_id, "target": target, "template": template, "status": status, "measured": measured}
    if model is not None:
        payload["model"] = model
    outbox.record(JOB_FINISH, {**payload, "at": utcnow()})


def report_task_failure(task_id: str, error: str) -> None:
    outbox.record(TASK_FAILURE, {"task_id": task_id, "error": error, "at": utcnow()})


def report_wake_on_demand(
    target: str, model: str, status: str, measured: dict, started: dt.datetime, task_id: str | None
) -> None:
    """A wake a request made inline on `target` (WorkerRuntime: a request on the worker's own
    queue while its model slept), recorded as a run of trigger `demand`, now or from the outbox."""
    key = f"demand:{target}:{model}:{started.isoformat()}"
    payload = {"key": key, "target": target, "model": model, "status": status, "measured": measured}
    outbox.record(WAKE_ON_DEMAND, {**payload, "task_id": task_id, "started_at": started, "at": utcnow()})


def report_keepalive(
    endpoint: str, *, sent: int, failed: int, skipped: int, ttft_ms: float | None, error: str | None
) -> None:
    payload = {"endpoint": endpoint, "sent": sent, "failed": failed, "skipped": skipped, "ttft_ms": ttft_ms}
    outbox.record(KEEPALIVE, {**payload, "error": error, "at": utcnow()})
