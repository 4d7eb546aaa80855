"""The states and kinds the history records, as plain enums: importable without the
database layer (the CLI's options take them, and `preheat --help` must not load SQLAlchemy)."""

from __future__ import annotations

import enum


class TriggerKind(enum.StrEnum):
    schedule = "schedule"
    pod_event = "pod_event"
    worker_online = "worker_online"
    manual = "manual"
    peak = "peak"
    demand = "demand"  # a request came for a model asleep on every worker (on-demand wake)


class RunAction(enum.StrEnum):
    """What a run does to its targets. A wake is a warmup: the model back on the device,
    then every template of it pre-filled (or restored), probed and judged."""

    warm = "warm"
    sleep = "sleep"  # KV freed and weights off the device (level 1) or dropped (level 2)
    wake = "wake"


class RunStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"  # every job warm (or skipped)
    degraded = "degraded"  # every job finished, some degraded, none failed
    failed = "failed"  # at least one job failed or was lost

    @property
    def is_final(self) -> bool:
        return self not in (RunStatus.queued, RunStatus.running)


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    warm = "warm"
    degraded = "degraded"
    failed = "failed"
    skipped = "skipped"
    lost = "lost"
    asleep = "asleep"  # a sleep job done: the model's KV freed, its weights off the device
    awake = "awake"  # a wake job done: the weights back (its templates' jobs say how warm)

    @property
    def is_final(self) -> bool:
        return self not in (JobStatus.queued, JobStatus.running)


class TargetKind(enum.StrEnum):
    worker = "worker"
    endpoint = "endpoint"


class ScheduleKind(enum.StrEnum):
    manual = "manual"  # `preheat schedule add`
    peak = "peak"  # `preheat peaks suggest --apply`: learned from traffic
    catalog = "catalog"  # declared in the catalog's [schedules.*]; beat keeps it in step with the file


class SlotStatus(enum.StrEnum):
    claimed = "claimed"  # a beat took it and is sending it
    sent = "sent"  # its run is recorded and its jobs sent
    unsent = "unsent"  # sending failed (broker away); retried while within the grace window
    failed = "failed"  # nothing to send it to (no live worker), with the reason
    missed = "missed"  # no beat could fire it in time (or a later slot fired instead)


# A sleep or wake acts on a model as a whole: its job row names the model and, in place of a
# template, this mark.
WHOLE_MODEL = "*"
