"""The worker registry: who is alive, what each worker holds, and the reaper of lost jobs.

Every worker writes a heartbeat row from a thread (so a solo worker busy with a warmup
still shows alive). The dispatcher sends warmups to the live ones; `preheat workers`
lists them; and the reaper, run by every worker's heartbeat and by `preheat warm --wait`,
marks `lost` the unfinished jobs of workers that stopped beating, stopped or restarted.
A lost job that is re-delivered later updates its own row again.

Functions take a session; callers own the transaction (``session_scope``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from preheat.fleet.liveness import Pulse, read_quietly
from preheat.history import service
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import JobStatus, TargetKind, WarmupJob, WarmupRun, WorkerRecord

log = logging.getLogger(__name__)


def beat(
    session: Session,
    nodename: str,
    *,
    started_at: dt.datetime,
    ready: bool,
    state: dict,
    now: dt.datetime | None = None,
) -> WorkerRecord:
    """Insert or refresh this worker's row. A new `started_at` marks a restart."""
    now = now or utcnow()
    record = session.scalars(select(WorkerRecord).where(WorkerRecord.nodename == nodename)).first()
    if record is None:
        record = WorkerRecord(nodename=nodename)
        session.add(record)
    record.hostname, record.pid = socket.gethostname(), os.getpid()
    record.started_at, record.heartbeat_at, record.stopped_at = started_at, now, None
    record.ready, record.state = ready, state
    session.flush()
    return record


def mark_stopped(session: Session, nodename: str) -> None:
    record = session.scalars(select(WorkerRecord).where(WorkerRecord.nodename == nodename)).first()
    if record is not None:
        record.stopped_at, record.ready = utcnow(), False


def is_live(record: WorkerRecord, dead_after_s: float, now: dt.datetime) -> bool:
    return record.stopped_at is None and now - aware(record.heartbeat_at) <= dt.timedelta(seconds=dead_after_s)


def workers(session: Session) -> list[WorkerRecord]:
    return list(session.scalars(select(WorkerRecord).order_by(WorkerRecord.nodename)))


def live_workers(session: Session, dead_after_s: float, now: dt.datetime | None = None) -> list[WorkerRecord]:
    now = now or utcnow()
    return [record for record in workers(session) if is_live(record, dead_after_s, now)]


# The reaper ------------------------------------------------------------------------------


def why_lost(
    job: WarmupJob,
    created_at: dt.datetime,
    worker: WorkerRecord | None,
    *,
    dead_after_s: float,
    time_limit_s: float,
    now: dt.datetime,
    pulse: Pulse | None = None,
    lost_message_after_s: float | None = None,
) -> tuple[JobStatus, str] | None:
    """The state an unfinished job must take now, and why; None while it may still finish.
    `pulse` is the worker's pulse through the broker: a worker whose database heartbeat is
    stale but whose pulse is fresh is alive (its database was away), and its jobs wait for
    its outbox. With `lost_message_after_s`, a job queued for a live worker that has sat idle
    that long since the job was queued is `lost`: its message never reached the worker."""
    grace = dt.timedelta(seconds=dead_after_s)
    if worker is None:
        if now - aware(created_at) > grace:
            return JobStatus.lost, f"worker {job.target} never registered"
        return None
    if job.status == JobStatus.running and job.started_at and aware(job.started_at) < aware(worker.started_at):
        return JobStatus.lost, f"worker {job.target} restarted while running this job"
    if worker.stopped_at is not None:
        # A queued job waits a while in the stopped worker's own queue for its restart.
        if job.status == JobStatus.running or now - aware(worker.stopped_at) > grace:
            return JobStatus.lost, f"worker {job.target} stopped at {aware(worker.stopped_at):%H:%M:%S} UTC"
        return None
    pulsing = pulse is not None and pulse.fresh(now, dead_after_s)
    if not is_live(worker, dead_after_s, now) and not pulsing:
        return JobStatus.lost, (
            f"worker {job.target} sent no heartbeat since {aware(worker.heartbeat_at):%H:%M:%S} "
            f"UTC (dead after {dead_after_s:g} s)"
        )
    if (
        job.status == JobStatus.running
        and job.started_at
        and now - aware(job.started_at) > dt.timedelta(seconds=time_limit_s)
    ):
        return JobStatus.failed, f"still running after the {time_limit_s:g} s time limit"
    return _lost_message(job, created_at, worker, pulse if pulsing else None, lost_message_after_s, now)


def _lost_message(
    job: WarmupJob,
    created_at: dt.datetime,
    worker: WorkerRecord,
    pulse: Pulse | None,
    bound_s: float | None,
    now: dt.datetime,
) -> tuple[JobStatus, str] | None:
    if bound_s is None or job.status != JobStatus.queued:
        return None
    seen = pulse if pulse is not None else Pulse.from_state(worker.state, aware(worker.heartbeat_at))
    if seen.idle_since is None:
        return None  # busy right now: the job may be behind the task it runs
    if seen.pending:
        return None  # its record waits in its outbox: it may have run this job already
    idle_s = (now - max(aware(seen.idle_since), aware(created_at))).total_seconds()
    if idle_s <= bound_s:
        return None
    return JobStatus.lost, (
        f"message lost: worker {job.target} was live and idle for {idle_s:.0f} s after this job was queued "
        f"and never took it (bound {bound_s:g} s, PREHEAT_LOST_MESSAGE_AFTER_S)"
    )


def reap(
    session: Session,
    *,
    dead_after_s: float,
    time_limit_s: float,
    now: dt.datetime | None = None,
    pulses=None,
    lost_message_after_s: float | None = None,
) -> int:
    """Settle the unfinished worker jobs that cannot finish. Returns how many changed.
    `pulses` (preheat.fleet.liveness) is asked before a worker is called dead."""
    now = now or utcnow()
    unfinished = WarmupJob.status.in_([JobStatus.queued, JobStatus.running])
    run_ids = session.scalars(
        select(WarmupJob.run_id).where(WarmupJob.target_kind == TargetKind.worker, unfinished).distinct()
    ).all()
    reaped = 0
    for run_id in sorted(run_ids):
        # Runs before jobs, as every writer locks them (service.lock_run); a run a writer
        # holds right now is left for the next heartbeat, as is one another reaper holds.
        if service.lock_run(session, run_id, skip_locked=True) is None:
            continue
        rows = session.execute(
            select(WarmupJob, WarmupRun.created_at, WorkerRecord)
            .join(WarmupRun, WarmupRun.id == WarmupJob.run_id)
            .outerjoin(WorkerRecord, WorkerRecord.nodename == WarmupJob.target)
            .where(WarmupJob.run_id == run_id, WarmupJob.target_kind == TargetKind.worker, unfinished)
            .with_for_update(of=WarmupJob)
        ).all()
        settled = 0
        for job, created_at, worker in rows:
            pulse = read_quietly(pulses, job.target) if worker is not None else None
            outcome = why_lost(
                job,
                created_at,
                worker,
                dead_after_s=dead_after_s,
                time_limit_s=time_limit_s,
                now=now,
                pulse=pulse,
                lost_message_after_s=lost_message_after_s,
            )
            if outcome is not None:
                job.status, job.error = outcome
                job.finished_at = now
                settled += 1
                log.warning("job %s/%s on %s is %s: %s", run_id.hex[:8], job.template, job.target, *outcome)
        if settled:
            session.flush()
            service.refresh_run_status(session, run_id)
            reaped += settled
    return reaped


# The heartbeat thread ------------------------------------------------------------------


@dataclass
class Heartbeat:
    """Writes this worker's row every `interval_s` and reaps lost jobs, in its own thread."""

    nodename: str
    describe: Callable[[], dict]  # the runtime's state: {"ready": bool, ...}
    interval_s: float
    dead_after_s: float
    time_limit_s: float
    on_beat: Callable[[], object] | None = None  # more bookkeeping on the same beat (traffic counts)
    pulses: object | None = None  # preheat.liveness: the same beat through the broker
    lost_message_after_s: float | None = None

    def __post_init__(self) -> None:
        self.started_at = utcnow()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preheat-heartbeat", daemon=True)
        # The pulse has a thread of its own: a database that stalls each write for its whole
        # bound (PREHEAT_DB_TIMEOUT_S) slows the heartbeat loop, and must not slow the pulse.
        self._pulser = threading.Thread(target=self._pulse_loop, name="preheat-pulse", daemon=True)

    def start(self) -> Heartbeat:
        self._pulse(self.describe())
        self.beat_once()  # registered before the worker says it is ready
        self._thread.start()
        if self.pulses is not None:
            self._pulser.start()
        return self

    def pulse_now(self) -> None:
        """A pulse at once, off the beat: the router sees a change (a model now served) now."""
        self._pulse(self.describe())

    def _pulse_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._pulse(self.describe())

    def beat_once(self) -> bool:
        """Write the heartbeat, then the bookkeeping (which keeps its writes in the outbox
        while the database is away), then reap. True when the heartbeat was recorded."""
        state = self.describe()
        recorded = self._guarded("heartbeat", lambda: self._write_beat(state))
        if self.on_beat is not None:  # before reaping: writes that waited may finish jobs
            self._guarded("bookkeeping", self.on_beat)
        if recorded:
            self._guarded("reaper", self._reap)
        return recorded

    def _write_beat(self, state: dict) -> None:
        with session_scope() as session:
            beat(session, self.nodename, started_at=self.started_at, ready=bool(state.get("ready")), state=state)

    def _pulse(self, state: dict) -> None:
        """The beat through the broker first: it needs no database (see preheat.fleet.liveness)."""
        if self.pulses is None:
            return
        try:
            self.pulses.write(self.nodename, Pulse.from_state(state, utcnow(), self.nodename))
        except Exception as exc:  # the broker away: the database row still says it
            log.warning("pulse of %s not sent: %s", self.nodename, str(exc).splitlines()[0] if str(exc) else exc)

    def _reap(self) -> None:
        with session_scope() as session:
            reap(
                session,
                dead_after_s=self.dead_after_s,
                time_limit_s=self.time_limit_s,
                pulses=self.pulses,
                lost_message_after_s=self.lost_message_after_s,
            )

    def _guarded(self, what: str, step: Callable[[], object]) -> bool:
        try:
            step()
        except SQLAlchemyError as exc:
            # The worker keeps serving; it shows as dead only if this lasts past dead_after_s.
            log.warning("%s of %s not recorded: %s", what, self.nodename, str(exc).splitlines()[0])
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat_once()

    def stop(self) -> None:
        """The worker is stopping: its last bookkeeping, its row marked stopped, its pulse
        gone (the router sends it nothing from now on). Each step whatever the one before
        raised: a stop always completes."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 5)
        steps = [("pulse removal", self._remove_pulse), ("stop record", self._mark_stopped)]
        if self.on_beat is not None:
            steps.insert(0, ("last bookkeeping", self.on_beat))
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                log.warning("%s of %s failed: %s", what, self.nodename, str(exc).splitlines()[0] if str(exc) else exc)

    def _remove_pulse(self) -> None:
        if self.pulses is not None:
            self.pulses.remove(self.nodename)

    def _mark_stopped(self) -> None:
        with session_scope() as session:
            mark_stopped(session, self.nodename)
