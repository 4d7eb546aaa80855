"""The history: runs (why a warmup happened) and jobs (where it ran, what it measured),
plus the peak schedules that start runs."""

from __future__ import annotations

import datetime as dt
import enum
import uuid

from sqlalchemy import BigInteger, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from preheat.db import Model, utcnow


class TriggerKind(enum.StrEnum):
    schedule = "schedule"
    pod_event = "pod_event"
    worker_online = "worker_online"
    manual = "manual"
    peak = "peak"


class RunStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"  # every job warm (or skipped)
    degraded = "degraded"  # every job finished, some degraded, none failed
    failed = "failed"  # at least one job failed or was lost


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    warm = "warm"
    degraded = "degraded"
    failed = "failed"
    skipped = "skipped"
    lost = "lost"

    @property
    def is_final(self) -> bool:
        return self not in (JobStatus.queued, JobStatus.running)


class TargetKind(enum.StrEnum):
    worker = "worker"
    endpoint = "endpoint"


class ScheduleKind(enum.StrEnum):
    manual = "manual"
    peak = "peak"


class WarmupRun(Model):
    __tablename__ = "warmup_runs"

    trigger: Mapped[TriggerKind]
    trigger_detail: Mapped[dict] = mapped_column(default=dict)
    requested_by: Mapped[str] = mapped_column(String(200))
    status: Mapped[RunStatus] = mapped_column(default=RunStatus.queued)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]

    jobs: Mapped[list[WarmupJob]] = relationship(
        back_populates="run", order_by="WarmupJob.target, WarmupJob.template", cascade="all, delete-orphan"
    )

    __table_args__ = (Index("ix_warmup_runs_created_at", "created_at"),)


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
    prefill_ms: Mapped[float | None]
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
    error: Mapped[str | None] = mapped_column(Text)

    run: Mapped[WarmupRun] = relationship(back_populates="jobs")

    # A re-delivered job updates its own row: one row per run, target, model and template.
    __table_args__ = (
        UniqueConstraint("run_id", "target", "model", "template", name="uq_warmup_jobs_run_target_model_template"),
        Index("ix_warmup_jobs_status", "status"),
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
    __tablename__ = "schedules"

    name: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[ScheduleKind] = mapped_column(default=ScheduleKind.manual)
    cron: Mapped[str] = mapped_column(String(120))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    targets: Mapped[dict] = mapped_column(default=dict)  # {"templates": [...], "workers": [...]}
    lead_time_s: Mapped[int] = mapped_column(default=0)
    enabled: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
