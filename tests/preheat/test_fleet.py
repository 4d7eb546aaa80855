"""Fleet metrics from history, the registry and the broker: counted once each, monotonic
through a prune, the lead window's unwarmed targets, and `preheat exporter` as a process."""

from __future__ import annotations

import datetime as dt
import re
import subprocess

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from preheat.core.catalog import load_catalog
from preheat.core.settings import get_settings
from preheat.fleet.exporter import FleetCollector
from preheat.history.db import session_scope, utcnow
from preheat.history.models import (
    JobStatus,
    RunAction,
    RunStatus,
    Schedule,
    ScheduleSlot,
    SlotStatus,
    TargetKind,
    TriggerKind,
    WarmupJob,
    WarmupRun,
    WorkerRecord,
)
from tests.conftest import PREHEAT_CLI


def _job(finished: dt.datetime, status=JobStatus.warm, *, target="w1@h", template="support", action=RunAction.warm):
    with session_scope() as session:
        run = WarmupRun(
            trigger=TriggerKind.schedule,
            requested_by="t",
            status=RunStatus.succeeded,
            created_at=finished,
            action=action,
        )
        run.jobs.append(
            WarmupJob(
                target=target,
                model="tiny",
                template=template,
                status=status,
                target_kind=TargetKind.worker,
                finished_at=finished,
            )
        )
        session.add(run)
        session.flush()
        return run.id


def _worker(name: str, *, ready=True, state=None, beat=None) -> None:
    now = utcnow()
    with session_scope() as session:
        session.add(
            WorkerRecord(
                nodename=name,
                hostname="h",
                pid=1,
                started_at=now,
                heartbeat_at=beat or now,
                ready=ready,
                state=state or {},
            )
        )


def scrape(collector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_jobs_are_counted_once_each_late_writes_included_and_a_prune_never_lowers_a_count(stack):
    collector = FleetCollector(load_catalog(get_settings().catalog), get_settings(), lag_s=600)
    now = utcnow()
    _job(now - dt.timedelta(days=3))
    _job(now - dt.timedelta(minutes=2))  # inside the lag window of the first scrape
    _job(now - dt.timedelta(minutes=1), JobStatus.lost)
    first = scrape(collector)
    assert value(first, "preheat_fleet_warmup_jobs_total", action="warm", trigger="schedule", status="warm") == 2
    assert value(first, "preheat_fleet_warmup_jobs_total", action="warm", trigger="schedule", status="lost") == 1
    assert value(first, "preheat_fleet_warmup_jobs_total", action="warm", trigger="schedule", status="warm") == 2

    _job(now - dt.timedelta(minutes=5), JobStatus.failed, action=RunAction.sleep, template="*")  # from an outbox, late
    _job(now, JobStatus.warm)
    second = scrape(collector)
    assert value(second, "preheat_fleet_warmup_jobs_total", action="warm", trigger="schedule", status="warm") == 3
    assert value(second, "preheat_fleet_warmup_jobs_total", action="sleep", trigger="schedule", status="failed") == 1
    assert _counts(scrape(collector)) == _counts(second)  # nothing new: nothing counted again

    with session_scope() as session:  # a prune: rows go, counts stay
        session.query(WarmupRun).filter(WarmupRun.created_at < now - dt.timedelta(days=1)).delete()
    third = scrape(collector)
    assert value(third, "preheat_fleet_warmup_jobs_total", action="warm", trigger="schedule", status="warm") == 3


def _counts(samples):
    return {key: v for key, v in samples.items() if key[0] == "preheat_fleet_warmup_jobs_total"}


def test_workers_outboxes_last_warm_and_a_lead_window_not_yet_warm(stack):
    now = utcnow()
    _worker("w1@h", state={"outbox": {"pending": 7}, "idle_since": (now - dt.timedelta(seconds=90)).isoformat()})
    _worker("w2@h", ready=False, state={"asleep": {"tiny": {"level": 1}}})
    _worker("w3@h", beat=now - dt.timedelta(hours=1))  # dead
    warm_at = now - dt.timedelta(minutes=30)
    _job(warm_at, target="w1@h")
    with session_scope() as session:  # a warm schedule fired 2 min ago for a peak in 3 min
        schedule = Schedule(name="morning", cron="0 9 * * *", targets={"templates": ["support"]}, lead_time_s=300)
        session.add(schedule)
        session.flush()
        session.add(
            ScheduleSlot(
                schedule_id=schedule.id,
                schedule_name="morning",
                slot_at=now + dt.timedelta(minutes=3),
                fire_at=now - dt.timedelta(minutes=2),
                status=SlotStatus.sent,
                claimed_at=now - dt.timedelta(minutes=2) + dt.timedelta(seconds=4),
            )
        )
    collector = FleetCollector(load_catalog(get_settings().catalog), get_settings(), queue_depth=lambda model: 5)
    samples = scrape(collector)
    assert [value(samples, "preheat_fleet_workers", state=s) for s in ("live", "ready", "asleep", "dead")] == [
        2,
        1,
        1,
        1,
    ]
    assert value(samples, "preheat_fleet_outbox_pending", worker="w1@h") == 7
    assert 89 <= value(samples, "preheat_fleet_worker_idle_seconds", worker="w1@h") < 120
    assert value(samples, "preheat_fleet_worker_asleep_models", worker="w2@h") == 1
    last = value(samples, "preheat_fleet_last_warm_timestamp_seconds", worker="w1@h", template="support")
    assert last == pytest.approx(warm_at.timestamp())
    # Both live workers target `support`; neither verified it since the fire: 2 unwarmed.
    assert value(samples, "preheat_fleet_schedule_unwarmed_targets", schedule="morning") == 2
    assert value(samples, "preheat_fleet_schedule_lead_seconds", schedule="morning") == 300
    assert value(samples, "preheat_fleet_schedule_slot_lateness_seconds", schedule="morning") == pytest.approx(4)
    assert value(samples, "preheat_fleet_schedule_slots_total", schedule="morning", status="sent") == 1
    assert value(samples, "preheat_fleet_queue_messages", model="tiny") == 5
    _job(utcnow(), target="w1@h")
    _job(utcnow(), target="w2@h")
    assert value(scrape(collector), "preheat_fleet_schedule_unwarmed_targets", schedule="morning") == 0


@pytest.mark.slow
def test_the_exporter_process_serves_the_fleet_on_metrics_only(stack, tmp_path):
    _job(utcnow())
    exporter = subprocess.Popen(
        [PREHEAT_CLI, "exporter", "--port", "0"],
        env=stack.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=stack.home,
    )
    try:
        url = re.search(r"http://\S+/metrics", exporter.stdout.readline()).group(0).replace("0.0.0.0", "127.0.0.1")
        text = httpx.get(url).text
        assert 'preheat_fleet_warmup_jobs_total{action="warm",status="warm",trigger="schedule"} 1.0' in text
        assert httpx.get(url.replace("/metrics", "/")).status_code == 404
    finally:
        exporter.terminate()
        assert exporter.wait(10) == 0
