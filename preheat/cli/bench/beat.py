"""`preheat bench beat`: how late scheduled warmups fire, and how long a standby beat takes
to take over from a leader that was killed, with real `celery beat` processes and a real
worker on the configured stack.

Each slot's lateness is its run's creation time minus its fire time (cron time − lead): what
a peak schedule's user waits beyond the time they asked for. Slots whose fire time falls
between the kill and the takeover fire late by up to the lease; the table shows them apart.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path

import typer
from sqlalchemy import delete, select

from preheat.cli.bench.common import ensure_no_live_workers, host, prepare, worker_env, worker_name, write_report
from preheat.core import processes
from preheat.core.errors import ConfigError
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import Schedule, ScheduleSlot, SlotStatus, WarmupRun


@dataclass(frozen=True)
class SlotTiming:
    fire_at: dt.datetime
    fired_at: dt.datetime | None  # the run's creation; None if the slot was not sent
    status: str
    fired_by: str | None

    @property
    def late_ms(self) -> float | None:
        return None if self.fired_at is None else (self.fired_at - self.fire_at).total_seconds() * 1000


@dataclass(frozen=True)
class Phase:
    name: str
    slots: int
    sent: int
    late_p50_ms: float | None
    late_max_ms: float | None


def minutely_lead_for(fire_at: dt.datetime) -> int:
    """The lead time that makes a per-minute cron ("* * * * *") fire at `fire_at`, to the
    second: how the benchmark (and the tests) put several slots into one minute."""
    slot = dt.datetime.fromtimestamp(math.ceil(fire_at.timestamp() / 60) * 60, dt.UTC)
    return int((slot - fire_at).total_seconds())


def ensure_no_beat() -> None:
    from preheat.schedules import leader

    with session_scope() as session:
        lease = leader.current(session)
    if lease is not None and aware(lease.expires_at) > utcnow():
        raise ConfigError(
            f"a beat is running ({lease.holder} holds the lead): stop it, or point PREHEAT_HOME / the "
            f"database at a separate stack"
        )


def run(
    slots: int, spacing_s: int, kill_after: int, lease_s: float, template: str, log_dir: Path, timeout_s: float
) -> tuple[list[SlotTiming], dt.datetime, dt.datetime | None, int]:
    """Start a worker and two beats, schedule `slots` fire times `spacing_s` apart, kill the
    leader after `kill_after` have fired; returns each slot, the kill time, the takeover time
    and how many runs the slots made (one each, if no slot fired twice)."""
    from preheat.schedules import leader, store

    ensure_no_live_workers("bench beat starts its own worker")
    ensure_no_beat()
    env = worker_env(PREHEAT_BEAT_LEASE_S=f"{lease_s:g}")
    nodename = worker_name("beat")
    worker = processes.start_worker(nodename, env, log_dir)
    beat_argv = processes.celery_command("beat", "--loglevel=INFO")
    prefix = f"bench-beat-{uuid.uuid4().hex[:6]}"
    try:
        with processes.running(worker):
            processes.wait_for_log(worker, f"{nodename} ready.", timeout_s)
            leader_proc = processes.start("beat-leader", beat_argv, env, log_dir)
            with processes.running(leader_proc):
                processes.wait_for_log(leader_proc, "leads", timeout_s)
                standby = processes.start("beat-standby", beat_argv, env, log_dir)
                with processes.running(standby):
                    processes.wait_for_log(standby, "is standby", timeout_s)
                    first = utcnow() + dt.timedelta(seconds=3)
                    fire_times = [first + dt.timedelta(seconds=i * spacing_s) for i in range(slots)]
                    with session_scope() as session:
                        for i, fire_at in enumerate(fire_times):
                            store.add(
                                session,
                                name=f"{prefix}-{i:02d}",
                                cron="* * * * *",
                                timezone="UTC",
                                targets={"templates": [template], "workers": [nodename]},
                                lead_time_s=minutely_lead_for(fire_at),
                            )
                    processes.poll(lambda: _settled(prefix, kill_after), timeout_s, what="the slots before the kill")
                    processes.kill(leader_proc)
                    killed_at = utcnow()
                    processes.poll(lambda: _settled(prefix, slots), timeout_s + lease_s, what="every slot")
                    with session_scope() as session:
                        lease = leader.current(session)
                        took_over = (
                            aware(lease.acquired_at) if lease and f":{standby.popen.pid}:" in lease.holder else None
                        )
        return _timings(prefix), killed_at, took_over, _runs_of(prefix, first)
    finally:
        with session_scope() as session:
            session.execute(delete(Schedule).where(Schedule.name.like(f"{prefix}-%")))


def _runs_of(prefix: str, since: dt.datetime) -> int:
    with session_scope() as session:
        details = session.scalars(
            select(WarmupRun.trigger_detail).where(WarmupRun.created_at >= since - dt.timedelta(minutes=1))
        ).all()
    return sum(1 for detail in details if str(detail.get("schedule", "")).startswith(prefix))


def _settled(prefix: str, count: int) -> bool:
    with session_scope() as session:
        rows = session.scalars(select(ScheduleSlot.status).where(ScheduleSlot.schedule_name.like(f"{prefix}-%"))).all()
    return len([s for s in rows if s != SlotStatus.claimed]) >= count


def _timings(prefix: str) -> list[SlotTiming]:
    with session_scope() as session:
        rows = session.execute(
            select(ScheduleSlot, WarmupRun.created_at)
            .outerjoin(WarmupRun, WarmupRun.id == ScheduleSlot.run_id)
            .where(ScheduleSlot.schedule_name.like(f"{prefix}-%"))
            .order_by(ScheduleSlot.fire_at)
        ).all()
        return [
            SlotTiming(aware(slot.fire_at), aware(created) if created else None, str(slot.status), slot.claimed_by)
            for slot, created in rows
        ]


def phases(timings: list[SlotTiming], killed_at: dt.datetime, took_over: dt.datetime | None) -> list[Phase]:
    took_over = took_over or killed_at
    groups = {
        "leader (before the kill)": [t for t in timings if t.fire_at < killed_at],
        "between kill and takeover": [t for t in timings if killed_at <= t.fire_at < took_over],
        "standby (after takeover)": [t for t in timings if t.fire_at >= took_over],
    }
    return [_phase(name, group) for name, group in groups.items()]


def _phase(name: str, group: list[SlotTiming]) -> Phase:
    late = [t.late_ms for t in group if t.late_ms is not None]
    return Phase(name, len(group), len(late), statistics.median(late) if late else None, max(late) if late else None)


def main(slots: int, spacing: int, kill_after: int, template: str, timeout: float, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render

    console = render.console()
    if slots * spacing >= 55:
        raise typer.BadParameter("slots x spacing must stay under 55 s (each schedule fires once a minute)")
    if kill_after >= slots:
        raise typer.BadParameter("--kill-after must leave slots for the standby")
    settings, catalog = prepare(console, exclusive="bench beat starts its own worker and beats")
    template = template or next(iter(catalog.templates))
    catalog.template(template)
    lease_s = settings.beat_lease_s
    timings, killed_at, took_over, runs = run(
        slots, spacing, kill_after, lease_s, template, settings.home / "bench" / "logs", timeout
    )
    takeover_s = (took_over - killed_at).total_seconds() if took_over else None
    rows = phases(timings, killed_at, took_over)
    report = {
        "benchmark": "beat",
        "host": host(),
        "slots": slots,
        "spacing_s": spacing,
        "tick_s": settings.beat_tick_s,
        "lease_s": lease_s,
        "takeover_s": takeover_s,
        "runs": runs,
        "phases": [vars(row) for row in rows],
        "slots_detail": [
            {"fire_at": t.fire_at.isoformat(), "late_ms": t.late_ms, "status": t.status, "fired_by": t.fired_by}
            for t in timings
        ],
    }
    table = Table(
        title="scheduled warmups: fired how late, leader killed midway",
        title_justify="left",
        caption=f"late = run recorded − fire time; tick {settings.beat_tick_s:g} s, lease {lease_s:g} s; "
        f"takeover {'-' if takeover_s is None else f'{takeover_s:.1f} s'} after the kill",
        caption_justify="left",
    )
    for header in ("phase", "slots", "sent", "late p50 ms", "late max ms"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for row in rows:
        table.add_row(
            row.name,
            str(row.slots),
            str(row.sent),
            "-" if row.late_p50_ms is None else f"{row.late_p50_ms:,.0f}",
            "-" if row.late_max_ms is None else f"{row.late_max_ms:,.0f}",
        )
    console.print(table)
    console.print(
        f"{sum(r.sent for r in rows)} of {slots} slots sent, {runs} run(s) recorded; takeover "
        + (
            f"{takeover_s:.1f} s (bound: lease {lease_s:g} s + tick {settings.beat_tick_s:g} s)"
            if takeover_s is not None
            else "not seen"
        )
    )
    write_report(report, json_path or settings.home / "bench" / "beat.json", console)
