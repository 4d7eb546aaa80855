"""The history: runs (why a warmup happened) and jobs (where it ran, what it measured);
the schedules that start runs, each slot they fired, and the traffic that peaks are learned from."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from preheat.core.states import (
    JobStatus,
    RunAction,
    RunStatus,
    ScheduleKind,
    SlotStatus,
    TargetKind,
    TriggerKind,
)
from preheat.history.db import Model, utcnow


class WarmupRun(Model):
    __tablename__ = "warmup_runs"

    trigger: Mapped[TriggerKind]
    trigger_detail: Mapped[dict] = mapped_column(default=dict)
    # What made this run, as a unique key: a schedule's slot, a pod's Ready transition, a
    # worker's start. A trigger that fires again (beat restarted, a watcher re-listed) finds
    # its run instead of making a second one.
    trigger_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    requested_by: Mapped[str] = mapped_column(String(200))
    action: Mapped[RunAction] = mapped_column(default=RunAction.warm, server_default=RunAction.warm.value)
    status: Mapped[RunStatus] = mapped_column(default=RunStatus.queued)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]
    # Each change of a final status ({from, to, at}): a re-delivered result over `lost`.
    status_changes: Mapped[list | None] = mapped_column(JSON)

    jobs: Mapped[list[WarmupJob]] = relationship(
        back_populates="run", order_by="WarmupJob.target, WarmupJob.template", cascade="all, delete-orphan"
    )

    __table_args__ = (
        Index("ix_warmup_runs_created_at", "created_at"),
        # `preheat history --status/--trigger`: newest first among the matching runs only.
        Index("ix_warmup_runs_status_created_at", "status", "created_at"),
        Index("ix_warmup_runs_trigger_created_at", "trigger", "created_at"),
    )


class WarmupJob(Model):
    __tablename__ = "warmup_jobs"

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("warmup_runs.id", ondelete="CASCADE"))
    target_kind: Mapped[TargetKind] = mapped_column(default=TargetKind.worker)
    target: Mapped[str] = mapped_column(String(255))  # worker nodename or endpoint name
    model: Mapped[str] = mapped_column(String(64))
    template: Mapped[str] = mapped_column(String(64))
    celery_task_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[JobStatus] = mapped_column(default=JobStatus.queued)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    load_ms: Mapped[float | None]
    # How the model's steps came to run (a start's first job, a wake): compiled, restored
    # (from the compile store, in compile_ms) or eager.
    compile_source: Mapped[str | None] = mapped_column(String(16))
    compile_ms: Mapped[float | None]
    prefill_ms: Mapped[float | None]
    # How the prefix came to be cached: computed, restored (from the prefix store, in
    # restore_ms) or cached (already there).
    prefix_source: Mapped[str | None] = mapped_column(String(16))
    restore_ms: Mapped[float | None]
    ttft_cold_ms: Mapped[float | None]
    ttft_warm_ms: Mapped[float | None]
    ttft_bare_ms: Mapped[float | None]  # the same probe with no system prompt: the floor warm can reach
    # What warm requests take on this worker in steady operation (served cache hits), the
    # reference the warm probe is judged against; None before the worker served any.
    ttft_steady_ms: Mapped[float | None]
    connect_ms: Mapped[float | None]  # endpoints: opening the pool's connections, by the job that did
    cached_tokens: Mapped[int | None]
    cache_bytes: Mapped[int | None] = mapped_column(BigInteger)  # exact KV bytes; GBs on real models
    device: Mapped[str | None] = mapped_column(String(32))
    # Sleep and wake (a whole model's row, template WHOLE_MODEL): the level, how long the
    # sleep took (running requests finished first), the bytes it freed (KV and weights, as
    # counted), and how long the weights took to come back.
    sleep_level: Mapped[int | None]
    sleep_ms: Mapped[float | None]
    bytes_freed: Mapped[int | None] = mapped_column(BigInteger)
    wake_ms: Mapped[float | None]
    error: Mapped[str | None] = mapped_column(Text)
    # Final outcomes this job had before a later one replaced them ({status, error, at}): a
    # `lost` the reaper wrote, then the re-delivered or outbox-kept result of the worker.
    superseded: Mapped[list | None] = mapped_column(JSON)

    run: Mapped[WarmupRun] = relationship(back_populates="jobs")

    # A re-delivered job updates its own row: one row per run, target, model and template.
    __table_args__ = (
        UniqueConstraint("run_id", "target", "model", "template", name="uq_warmup_jobs_run_target_model_template"),
        Index("ix_warmup_jobs_status", "status"),
        Index("ix_warmup_jobs_celery_task_id", "celery_task_id"),  # a task's failure finds its jobs
        Index("ix_warmup_jobs_finished_at", "finished_at"),  # the exporter reads what finished since its last scrape
    )


class WorkerRecord(Model):
    """A worker process as its heartbeat last described it: the registry behind `preheat
    workers`, the dispatcher's list of live workers, and the reaper's evidence of death.

    Heartbeats come from a thread, so a solo worker busy with a warmup still shows alive
    (it cannot answer a broadcast ping until the task ends)."""

    __tablename__ = "workers"

    nodename: Mapped[str] = mapped_column(String(255), unique=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    started_at: Mapped[dt.datetime]  # of this incarnation: a restart under the same name resets it
    heartbeat_at: Mapped[dt.datetime]
    stopped_at: Mapped[dt.datetime | None]  # a clean shutdown; a killed worker just stops beating
    ready: Mapped[bool] = mapped_column(default=False)
    state: Mapped[dict] = mapped_column(default=dict)  # runtime.describe(): models, cache, reasons


class EndpointKeepAlive(Model):
    """Keep-alive pings of one endpoint, counted (a history run per ping would drown the record)."""

    __tablename__ = "endpoint_keepalives"

    endpoint: Mapped[str] = mapped_column(String(64), unique=True)
    pings_sent: Mapped[int] = mapped_column(default=0)
    pings_failed: Mapped[int] = mapped_column(default=0)
    skipped_inactive: Mapped[int] = mapped_column(default=0)  # ticks outside the active hours
    last_ping_at: Mapped[dt.datetime | None]
    last_ttft_ms: Mapped[float | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Schedule(Model):
    """A peak to be warm for: `cron` (in `timezone`) says when traffic arrives; the warmup
    fires `lead_time_s` earlier. Beat reads this table every tick, so edits need no restart."""

    __tablename__ = "schedules"

    name: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[ScheduleKind] = mapped_column(default=ScheduleKind.manual)
    cron: Mapped[str] = mapped_column(String(120))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    # {"templates": [...], "workers": [...]} or {"templates": [...], "endpoints": [...]}
    targets: Mapped[dict] = mapped_column(default=dict)
    lead_time_s: Mapped[int] = mapped_column(default=0)
    # warm (the default), sleep or wake; a sleep's level (1 or 2).
    action: Mapped[RunAction] = mapped_column(default=RunAction.warm, server_default=RunAction.warm.value)
    sleep_level: Mapped[int | None]
    enabled: Mapped[bool] = mapped_column(default=True)
    # Slots before this are not wanted (added or resumed later), so never `missed`.
    active_since: Mapped[dt.datetime] = mapped_column(default=utcnow)
    detail: Mapped[dict] = mapped_column(default=dict)  # kind peak: the peak it anticipates
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ScheduleSlot(Model):
    """One slot of one schedule, recorded before it is sent: the unique key is what makes
    two beats, or a beat restarted mid-send, fire a slot at most once."""

    __tablename__ = "schedule_slots"

    schedule_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    schedule_name: Mapped[str] = mapped_column(String(64))
    slot_at: Mapped[dt.datetime]  # the cron time: when the peak begins
    fire_at: Mapped[dt.datetime]  # slot_at - lead time
    status: Mapped[SlotStatus]
    run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("warmup_runs.id", ondelete="SET NULL"))
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claimed_at: Mapped[dt.datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("schedule_id", "slot_at", name="uq_schedule_slots_schedule_slot"),
        Index("ix_schedule_slots_status", "status"),
    )


class BeatLease(Model):
    """The leader lock of beat: the holder fires slots until `expires_at`, renewing each tick."""

    __tablename__ = "beat_leases"

    name: Mapped[str] = mapped_column(String(64), unique=True)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[dt.datetime]
    expires_at: Mapped[dt.datetime]


class TrafficCount(Model):
    """Requests per model, template and minute: what peaks and template ranks are learned from."""

    __tablename__ = "traffic_counts"

    minute: Mapped[dt.datetime]
    model: Mapped[str] = mapped_column(String(64))
    template: Mapped[str] = mapped_column(String(64))  # "" for raw prompts (no template)
    requests: Mapped[int]
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # summed over the requests
    prefix_tokens: Mapped[int | None]  # the template's system prompt, in tokens

    __table_args__ = (UniqueConstraint("minute", "model", "template", name="uq_traffic_counts_minute_model_template"),)


class AppliedWrite(Model):
    """An outbox entry written (preheat.history.outbox), in the same transaction as what it wrote:
    a replay after a crash finds it here and does not write it twice."""

    __tablename__ = "applied_writes"

    source: Mapped[str] = mapped_column(String(255))  # the worker whose outbox held it
    kind: Mapped[str] = mapped_column(String(32))
    applied_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_applied_writes_applied_at", "applied_at"),)
