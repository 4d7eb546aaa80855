"""The schedule guarantees with real `celery beat` processes, a real worker, Redis and Postgres.

Slots are minutes apart in cron, so each schedule here fires every minute with a lead time
that puts its fire time a few seconds from now: several slots fit in one test, on the clock.
"""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from preheat.cli.bench.beat import minutely_lead_for
from preheat.core import processes
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import ScheduleSlot, SlotStatus, WarmupRun
from preheat.schedules import store

pytestmark = pytest.mark.slow

WORKER = "gpu0@beat-procs"
BEAT_ENV = {"PREHEAT_BEAT_TICK_S": "0.5", "PREHEAT_BEAT_LEASE_S": "3"}


def add_firing_at(stack, name: str, fire_at: dt.datetime, cli: bool = False) -> None:
    """Add a schedule while beat runs: through the CLI, or the same service in-process (faster)."""
    if cli:
        added = stack.cli("schedule", "add", name, "--cron", "* * * * *", "--lead", str(minutely_lead_for(fire_at)))
        assert added.returncode == 0, added.stderr
        return
    with session_scope() as session:
        store.add(
            session,
            name=name,
            cron="* * * * *",
            timezone="UTC",
            targets={"templates": ["support"]},
            lead_time_s=minutely_lead_for(fire_at),
        )


def slot_rows() -> dict[str, list[ScheduleSlot]]:
    rows: dict[str, list[ScheduleSlot]] = {}
    with session_scope() as session:
        for row in session.scalars(select(ScheduleSlot).order_by(ScheduleSlot.slot_at)):
            rows.setdefault(row.schedule_name, []).append(row)
    return rows


def settled(name: str):
    rows = slot_rows().get(name, [])
    return rows if rows and all(row.status != SlotStatus.claimed for row in rows) else None


def runs_by_schedule() -> dict[str, list[WarmupRun]]:
    found: dict[str, list[WarmupRun]] = {}
    with session_scope() as session:
        for run in session.scalars(select(WarmupRun)):
            found.setdefault(run.trigger_detail.get("schedule"), []).append(run)
    return found


@pytest.fixture
def fleet(services_stack, tmp_path):
    stack = services_stack
    stack.env.update(BEAT_ENV)
    worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        yield stack


def start_beat(stack, name: str, tmp_path):
    return processes.start(
        name, processes.celery_command("beat", "--loglevel=INFO"), stack.env, tmp_path / "logs", cwd=stack.home
    )


def test_two_beats_a_killed_leader_and_a_restart_fire_each_slot_once_and_record_what_was_missed(fleet, tmp_path):
    """One timeline, to start the worker once: (1) two beats, the leader killed, the standby
    fires the next slot; (2) the standby killed too, beat down past one slot's grace window,
    then restarted: that slot is `missed`, one within the window fires late, the next on time,
    and nothing fired before the crash fires again."""
    stack = fleet
    stack.env["PREHEAT_SCHEDULE_GRACE_S"] = "10"
    first = start_beat(stack, "beat-a", tmp_path)
    with processes.running(first):
        processes.wait_for_log(first, "leads")
        second = start_beat(stack, "beat-b", tmp_path)
        with processes.running(second):
            processes.wait_for_log(second, "is standby")
            # Added while both run: picked up without a restart.
            now = utcnow()
            add_firing_at(stack, "before-kill", now + dt.timedelta(seconds=5), cli=True)
            add_firing_at(stack, "after-kill", now + dt.timedelta(seconds=12))
            add_firing_at(stack, "paused", now + dt.timedelta(seconds=7))
            with session_scope() as session:
                store.set_enabled(session, "paused", False)
            processes.poll(lambda: settled("before-kill"), 30, what="the first slot fired")
            processes.kill(first)  # SIGKILL: no lease released; the standby waits for it to expire
            killed_at = utcnow()
            processes.poll(lambda: settled("after-kill"), 40, what="the standby firing the next slot")
            assert "leads" in second.log()
            processes.kill(second)
            crashed_at = utcnow()
    rows, runs = slot_rows(), runs_by_schedule()
    assert "paused" not in rows and "paused" not in runs
    for name in ("before-kill", "after-kill"):
        [row] = rows[name]
        assert row.status == SlotStatus.sent, (row.status, row.error)
        assert [run.id for run in runs[name]] == [row.run_id]  # one run per slot, the slot's
    taken_over = rows["after-kill"][0]
    assert taken_over.claimed_by.split(":")[1] == str(second.popen.pid)
    assert aware(taken_over.claimed_at) - killed_at < dt.timedelta(seconds=15)
    assert "Traceback" not in second.log(), second.log()[-3000:]

    # (2) No beat runs. One slot passes and its window closes; another passes within it.
    restart_at = crashed_at + dt.timedelta(seconds=3 + 10 + 3)
    add_firing_at(stack, "too-late", crashed_at + dt.timedelta(seconds=3))
    add_firing_at(stack, "late-in-grace", restart_at - dt.timedelta(seconds=2))
    add_firing_at(stack, "on-time", restart_at + dt.timedelta(seconds=6))
    processes.poll(lambda: utcnow() >= restart_at, 40, every_s=0.1, what="the restart time")
    third = start_beat(stack, "beat-c", tmp_path)
    with processes.running(third):
        processes.poll(lambda: settled("on-time"), 40, what="the slot after the restart")
    rows, runs = slot_rows(), runs_by_schedule()
    for name in ("before-kill", "after-kill"):  # not repeated by the restarted beat
        assert len(rows[name]) == 1 and len(runs[name]) == 1
    [missed] = rows["too-late"]
    assert missed.status == SlotStatus.missed and "no beat ran" in missed.error and "too-late" not in runs
    [late] = rows["late-in-grace"]
    assert late.status == SlotStatus.sent and runs["late-in-grace"][0].trigger_detail["late_s"] > 0
    assert [row.status for row in rows["on-time"]] == [SlotStatus.sent] and len(runs["on-time"]) == 1
    assert "Traceback" not in third.log(), third.log()[-3000:]
