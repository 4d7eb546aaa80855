"""Fleet metrics: what no single worker knows, from the history, the registry and the broker.

Served by `preheat exporter` (one per fleet: a process of its own, so that a beat's leader
change or a watcher's restart never gaps the series, and Prometheus scrapes one stable
target). Read at scrape time, in one transaction, cheaply on a large history:

- jobs are counted **incrementally**: the first scrape counts every finished job once
  (grouped, one statement); each later one reads only the jobs finished since its
  watermark less `lag_s` (an index on `finished_at`), deduplicated by id, so a result written
  late from a worker's outbox within the lag is still counted once. Counters are monotonic in
  the process: a prune deletes rows, never counts;
- schedules, slots and workers are small tables, read whole;
- each sleeping-or-warm model's inference queue depth is one passive declare on the broker.

Names follow Prometheus's conventions: counters end in `_total`, times are `_seconds` (and
instants `_timestamp_seconds`), labels are bounded (workers, templates, schedules, statuses).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from preheat.core.catalog import Catalog
from preheat.core.cron import fire_time_after
from preheat.core.states import WHOLE_MODEL, RunAction
from preheat.fleet import registry
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import (
    JobStatus,
    Schedule,
    ScheduleSlot,
    SlotStatus,
    TargetKind,
    WarmupJob,
    WarmupRun,
)

log = logging.getLogger(__name__)

FINAL = [status for status in JobStatus if status.is_final]
# How far behind the watermark each scrape looks again: a worker's outbox writes a finished
# job later, with the time it finished.
DEFAULT_LAG_S = 3600.0


@dataclass
class JobCounts:
    """Finished jobs counted once each, by (action, trigger, status), and the latest verified
    warm per (worker, template)."""

    lag_s: float = DEFAULT_LAG_S
    totals: Counter = field(default_factory=Counter)
    last_warm: dict[tuple[str, str], dt.datetime] = field(default_factory=dict)
    watermark: dt.datetime | None = None
    _seen: dict = field(default_factory=dict)  # job id -> finished_at, within the lag window

    def update(self, session: Session) -> None:
        if self.watermark is None:
            self._first(session)
        since = self.watermark - dt.timedelta(seconds=self.lag_s)
        rows = session.execute(
            _jobs_query().where(WarmupJob.finished_at >= since).add_columns(WarmupJob.id, WarmupJob.finished_at)
        ).all()
        for action, trigger, status, target, template, kind, job_id, finished_at in rows:
            if job_id in self._seen:
                continue
            self._seen[job_id] = aware(finished_at)
            self._count(action, trigger, status, target, template, kind, aware(finished_at), 1)
        self.watermark = max([self.watermark, *self._seen.values()])
        cutoff = self.watermark - dt.timedelta(seconds=self.lag_s)
        self._seen = {job_id: at for job_id, at in self._seen.items() if at >= cutoff}

    def _first(self, session: Session) -> None:
        """Every finished job, grouped: one statement, once per process."""
        self.watermark = aware(session.scalar(select(func.max(WarmupJob.finished_at))) or utcnow())
        since = self.watermark - dt.timedelta(seconds=self.lag_s)
        grouped = session.execute(
            _jobs_query()
            .where(WarmupJob.finished_at < since)
            .add_columns(func.count(), func.max(WarmupJob.finished_at))
            .group_by(WarmupRun.action, WarmupRun.trigger, WarmupJob.status, WarmupJob.target, WarmupJob.template)
            .group_by(WarmupJob.target_kind)
        ).all()
        for action, trigger, status, target, template, kind, count, latest in grouped:
            self._count(action, trigger, status, target, template, kind, aware(latest), count)

    def _count(self, action, trigger, status, target, template, kind, finished_at, count: int) -> None:
        self.totals[(str(action), str(trigger), str(status))] += count
        if status == JobStatus.warm and kind == TargetKind.worker and template != WHOLE_MODEL:
            key = (target, template)
            if key not in self.last_warm or finished_at > self.last_warm[key]:
                self.last_warm[key] = finished_at


def _jobs_query():
    return (
        select(
            WarmupRun.action,
            WarmupRun.trigger,
            WarmupJob.status,
            WarmupJob.target,
            WarmupJob.template,
            WarmupJob.target_kind,
        )
        .join(WarmupRun, WarmupRun.id == WarmupJob.run_id)
        .where(WarmupJob.status.in_(FINAL), WarmupJob.finished_at.is_not(None))
    )


@dataclass
class SlotCounts:
    """Schedule slots by (schedule, status), monotonic though a prune deletes old ones: a
    count that falls is taken as rows pruned, and the fall is carried."""

    seen: Counter = field(default_factory=Counter)
    carried: Counter = field(default_factory=Counter)

    def update(self, session: Session) -> Counter:
        now = Counter(
            {
                (name, str(status)): count
                for name, status, count in session.execute(
                    select(ScheduleSlot.schedule_name, ScheduleSlot.status, func.count()).group_by(
                        ScheduleSlot.schedule_name, ScheduleSlot.status
                    )
                )
            }
        )
        for key, before in self.seen.items():
            if now[key] < before:
                self.carried[key] += before - now[key]
        self.seen = now
        return now + self.carried


class FleetCollector:
    """The prometheus_client collector `preheat exporter` registers."""

    def __init__(self, catalog: Catalog, settings, *, queue_depth=None, lag_s: float = DEFAULT_LAG_S) -> None:
        self.catalog, self.settings = catalog, settings
        self.jobs, self.slots = JobCounts(lag_s), SlotCounts()
        self._queue_depth = queue_depth  # model -> messages waiting (None: not read)
        self.last_scrape_s = 0.0

    def collect(self):
        started = time.perf_counter()
        now = utcnow()
        with session_scope() as session:
            self.jobs.update(session)
            slots = self.slots.update(session)
            schedules = list(session.scalars(select(Schedule).where(Schedule.enabled.is_(True))))
            latest_sent = _latest_sent(session)
            records = registry.workers(session)
        live = [r for r in records if registry.is_live(r, self.settings.worker_dead_after_s, now)]
        yield from self._jobs(live)
        yield from self._schedules(schedules, slots, latest_sent, live, now)
        yield from self._workers(records, live, now)
        yield from self._queues()
        self.last_scrape_s = time.perf_counter() - started
        yield GaugeMetricFamily(
            "preheat_fleet_scrape_duration_seconds", "How long this scrape read the fleet.", value=self.last_scrape_s
        )

    def _jobs(self, live):
        jobs = CounterMetricFamily(
            "preheat_fleet_warmup_jobs",
            "Finished warmup, sleep and wake jobs, by action, trigger and final status.",
            labels=["action", "trigger", "status"],
        )
        for (action, trigger, status), count in sorted(self.jobs.totals.items()):
            jobs.add_metric([action, trigger, status], count)
        yield jobs
        warm = GaugeMetricFamily(
            "preheat_fleet_last_warm_timestamp_seconds",
            "When each live worker last verified each template warm (a warm job's end).",
            labels=["worker", "template"],
        )
        names = {r.nodename for r in live}
        for (worker, template), at in sorted(self.jobs.last_warm.items()):
            if worker in names:
                warm.add_metric([worker, template], at.timestamp())
        yield warm

    def _schedules(self, schedules, slots, latest_sent, live, now):
        next_fire = GaugeMetricFamily(
            "preheat_fleet_schedule_next_fire_timestamp_seconds", "The schedule's next fire time.", labels=["schedule"]
        )
        lead = GaugeMetricFamily(
            "preheat_fleet_schedule_lead_seconds", "How far ahead of its peak the schedule fires.", labels=["schedule"]
        )
        unwarmed = GaugeMetricFamily(
            "preheat_fleet_schedule_unwarmed_targets",
            "Inside a warm or wake schedule's lead (fired, its peak not begun): live (worker, template) pairs it "
            "targets not verified warm since it fired.",
            labels=["schedule"],
        )
        for schedule in schedules:
            upcoming = fire_time_after(schedule.cron, schedule.timezone, schedule.lead_time_s, now)
            if upcoming is not None:
                next_fire.add_metric([schedule.name], upcoming.timestamp())
            lead.add_metric([schedule.name], schedule.lead_time_s)
            if schedule.action != RunAction.sleep and not schedule.targets.get("endpoints"):
                unwarmed.add_metric([schedule.name], self._unwarmed(schedule, latest_sent.get(schedule.id), live, now))
        yield next_fire
        yield lead
        yield unwarmed
        counted = CounterMetricFamily(
            "preheat_fleet_schedule_slots", "Schedule slots by what became of them.", labels=["schedule", "status"]
        )
        for (name, status), count in sorted(slots.items()):
            counted.add_metric([name, status], count)
        yield counted
        late = GaugeMetricFamily(
            "preheat_fleet_schedule_slot_lateness_seconds",
            "The latest sent slot's delay from its fire time to its sending.",
            labels=["schedule"],
        )
        names = {schedule.id: schedule.name for schedule in schedules}
        for schedule_id, slot in latest_sent.items():
            if schedule_id in names and slot.claimed_at is not None:
                late.add_metric([names[schedule_id]], (aware(slot.claimed_at) - aware(slot.fire_at)).total_seconds())
        yield late

    def _unwarmed(self, schedule, slot, live, now) -> int:
        """0 outside the lead window; inside it, the targets not verified warm since the fire."""
        if slot is None or not aware(slot.fire_at) <= now < aware(slot.slot_at):
            return 0
        models = self.catalog.models_targeted(schedule.targets)
        templates = schedule.targets.get("templates") or [
            name for name in self.catalog.templates if self.catalog.template(name).model in models
        ]
        workers = [
            r.nodename for r in live if not schedule.targets.get("workers") or r.nodename in schedule.targets["workers"]
        ]
        fired = aware(slot.fire_at)
        return sum(
            1
            for worker in workers
            for template in templates
            if self.jobs.last_warm.get((worker, template), dt.datetime.min.replace(tzinfo=dt.UTC)) < fired
        )

    def _workers(self, records, live, now):
        states = Counter()
        ready = GaugeMetricFamily("preheat_fleet_worker_ready", "1 when the live worker is ready.", labels=["worker"])
        asleep = GaugeMetricFamily(
            "preheat_fleet_worker_asleep_models", "Models asleep on the worker.", labels=["worker"]
        )
        idle = GaugeMetricFamily(
            "preheat_fleet_worker_idle_seconds", "How long the live worker has run no task.", labels=["worker"]
        )
        outbox = GaugeMetricFamily(
            "preheat_fleet_outbox_pending", "History writes waiting in the worker's outbox.", labels=["worker"]
        )
        names = {r.nodename for r in live}
        for record in records:
            state = record.state or {}
            if record.nodename not in names:
                states["stopped" if record.stopped_at else "dead"] += 1
                continue
            states["live"] += 1
            states["ready"] += int(record.ready)
            states["asleep"] += int(bool(state.get("asleep")))
            ready.add_metric([record.nodename], int(record.ready))
            asleep.add_metric([record.nodename], len(state.get("asleep") or {}))
            since = state.get("idle_since")
            idle.add_metric([record.nodename], (now - dt.datetime.fromisoformat(since)).total_seconds() if since else 0)
            outbox.add_metric([record.nodename], (state.get("outbox") or {}).get("pending", 0))
        counts = GaugeMetricFamily("preheat_fleet_workers", "Workers in the registry, by state.", labels=["state"])
        for name in ("live", "ready", "asleep", "dead", "stopped"):
            counts.add_metric([name], states[name])
        yield counts
        yield ready
        yield asleep
        yield idle
        yield outbox

    def _queues(self):
        if self._queue_depth is None:
            return
        depth = GaugeMetricFamily(
            "preheat_fleet_queue_messages", "Requests waiting in each model's inference queue.", labels=["model"]
        )
        for model in self.catalog.models:
            try:
                depth.add_metric([model], self._queue_depth(model))
            except Exception as exc:  # the broker away: the series is absent, the scrape goes on
                log.warning("could not read the queue of %s: %s", model, exc)
        yield depth


def _latest_sent(session: Session) -> dict:
    """Each schedule's newest sent slot."""
    newest = (
        select(ScheduleSlot.schedule_id, func.max(ScheduleSlot.slot_at).label("slot_at"))
        .where(ScheduleSlot.status == SlotStatus.sent)
        .group_by(ScheduleSlot.schedule_id)
        .subquery()
    )
    rows = session.scalars(
        select(ScheduleSlot).join(
            newest, (ScheduleSlot.schedule_id == newest.c.schedule_id) & (ScheduleSlot.slot_at == newest.c.slot_at)
        )
    )
    return {slot.schedule_id: slot for slot in rows}
