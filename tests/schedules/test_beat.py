"""Beat's slots against the real database and broker: each slot fires once, with its slot in
history; late slots are missed, not fired; a beat that died mid-send is taken over.

These drive `fire_due` with a chosen "now", so a slot's whole life fits in a test; the
guarantees with real `celery beat` processes are in test_beat_processes.py.
"""

import datetime as dt
import threading

import pytest
from sqlalchemy import select

from preheat.core.catalog import load_catalog
from preheat.fleet import registry
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import ScheduleKind, ScheduleSlot, SlotStatus, TriggerKind, WarmupRun
from preheat.schedules import beat, leader, store
from tests.conftest import write_catalog

UTC = dt.UTC
WORKER = "gpu0@beat-test"
GRACE_S, LEASE_S = 300.0, 15.0


def live_worker(name: str = WORKER) -> None:
    with session_scope() as session:
        registry.beat(session, name, started_at=utcnow(), ready=True, state={})


def add_schedule(
    name: str,
    cron: str,
    *,
    timezone: str = "UTC",
    lead: int = 0,
    since: dt.datetime,
    kind: ScheduleKind = ScheduleKind.manual,
    detail: dict | None = None,
    targets: dict | None = None,
):
    with session_scope() as session:
        schedule = store.add(
            session,
            name=name,
            cron=cron,
            timezone=timezone,
            lead_time_s=lead,
            kind=kind,
            targets=targets or {"templates": ["support"]},
            detail=detail,
        )
        schedule.active_since = since
        return schedule.id


def slots_of(name: str) -> list[ScheduleSlot]:
    with session_scope() as session:
        return list(
            session.scalars(
                select(ScheduleSlot).where(ScheduleSlot.schedule_name == name).order_by(ScheduleSlot.slot_at)
            )
        )


def runs() -> list[WarmupRun]:
    with session_scope() as session:
        return list(session.scalars(select(WarmupRun).order_by(WarmupRun.created_at)))


def fire(now: dt.datetime, holder: str = "beat-a", grace_s: float = GRACE_S) -> dict:
    return beat.fire_due(now, holder, grace_s=grace_s, lease_s=LEASE_S)


def at(*fields: int) -> dt.datetime:
    return dt.datetime(*fields, tzinfo=UTC)


def test_a_due_slot_fires_once_and_its_run_carries_the_slot(stack, stack_app, redis_client):
    live_worker()
    add_schedule("morning", "0 9 * * *", lead=600, since=at(2026, 11, 30))
    assert fire(at(2026, 11, 30, 8, 49, 59)) == {}  # fire time 08:50 not yet
    fired = fire(at(2026, 11, 30, 8, 50, 1))
    assert list(fired.values()) == [SlotStatus.sent]
    assert fire(at(2026, 11, 30, 8, 50, 2)) == {}  # the same slot never again
    [slot] = slots_of("morning")
    [run] = runs()
    assert (slot.status, slot.run_id, aware(slot.slot_at)) == (SlotStatus.sent, run.id, at(2026, 11, 30, 9))
    assert run.trigger == TriggerKind.schedule and run.requested_by == "beat beat-a"
    assert run.trigger_detail["schedule"] == "morning" and run.trigger_detail["slot"] == "2026-11-30T09:00:00+00:00"
    assert run.trigger_detail["lead_time_s"] == 600 and run.trigger_key.startswith("schedule:")
    if stack.kind == "services":
        assert redis_client.llen("preheat.w.gpu0_beat-test") == 1  # one job on the worker's own queue


def test_slots_past_the_grace_window_are_missed_and_only_the_newest_in_time_fires(stack, stack_app):
    live_worker()
    add_schedule("quarterly", "*/15 * * * *", since=at(2026, 11, 30, 9, 0))
    # No beat ran from 09:00 to 10:02: 09:15 … 09:45 are older than the grace, 10:00 is not.
    fired = fire(at(2026, 11, 30, 10, 2), grace_s=300)
    assert list(fired.values()) == [SlotStatus.sent]
    slots = slots_of("quarterly")
    assert [(f"{s.slot_at:%H:%M}", s.status) for s in slots] == [
        ("09:15", SlotStatus.missed),
        ("09:30", SlotStatus.missed),
        ("09:45", SlotStatus.missed),
        ("10:00", SlotStatus.sent),
    ]
    assert slots[0].error == "no beat ran: fire time passed 2820 s ago (grace 300 s)"
    # Two slots within a wide grace: the older is superseded, one warmup goes out.
    add_schedule("minutely", "* * * * *", since=at(2026, 11, 30, 10, 0))
    fire(at(2026, 11, 30, 10, 2, 30), grace_s=600)
    assert [(f"{s.slot_at:%H:%M}", s.status) for s in slots_of("minutely")] == [
        ("10:01", SlotStatus.missed),
        ("10:02", SlotStatus.sent),
    ]
    assert len(runs()) == 2


@pytest.mark.parametrize("stack", ["services"], indirect=True)
def test_beats_racing_for_one_slot_fire_it_once(stack, stack_app):
    live_worker()
    add_schedule("race", "0 9 * * *", since=at(2026, 11, 30))
    from preheat.fleet.dispatch import prime_dispatch

    prime_dispatch()  # the app's connection pool, made once (beat makes it on its one thread)
    barrier, results = threading.Barrier(4), []

    def one_beat(holder: str) -> None:
        barrier.wait()
        results.append(fire(at(2026, 11, 30, 9, 0, 1), holder=holder))

    threads = [threading.Thread(target=one_beat, args=(f"beat-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(len(result) for result in results) == [0, 0, 0, 1]
    assert len(runs()) == 1 and [s.status for s in slots_of("race")] == [SlotStatus.sent]


def test_a_beat_that_died_between_claim_and_send_is_taken_over_once(stack, stack_app):
    live_worker()
    schedule_id = add_schedule("crashy", "0 9 * * *", since=at(2026, 11, 30))
    now = at(2026, 11, 30, 9, 0, 1)
    # Beat A claims the slot and dies before sending.
    [due] = beat.find_due(now, GRACE_S)
    with session_scope() as session:
        store.claim(session, schedule_id, due.name, due.slot_at, due.fire_at, "beat-a", now)
    # Beat B, within A's lease, leaves it alone; once the lease is over, it sends it.
    assert fire(now + dt.timedelta(seconds=LEASE_S / 2), holder="beat-b") == {}
    assert list(fire(now + dt.timedelta(seconds=LEASE_S + 2), holder="beat-b").values()) == [SlotStatus.sent]
    [slot] = slots_of("crashy")
    assert (slot.status, slot.claimed_by, slot.attempts) == (SlotStatus.sent, "beat-b", 2)
    assert len(runs()) == 1


def test_a_beat_that_died_after_recording_the_run_does_not_send_it_twice(stack, stack_app):
    live_worker()
    schedule_id = add_schedule("halfway", "0 9 * * *", since=at(2026, 11, 30))
    now = at(2026, 11, 30, 9, 0, 1)
    [due] = beat.find_due(now, GRACE_S)
    with session_scope() as session:
        store.claim(session, schedule_id, due.name, due.slot_at, due.fire_at, "beat-a", now)
    _status, run_id, _ = beat.send_slot(due, "beat-a", now)  # recorded and sent; then beat A died
    assert fire(now + dt.timedelta(seconds=LEASE_S + 2), holder="beat-b")
    [slot] = slots_of("halfway")
    assert (slot.status, slot.run_id) == (SlotStatus.sent, run_id) and len(runs()) == 1


def test_no_live_worker_fails_the_slot_with_the_reason(stack, stack_app):
    add_schedule("lonely", "0 9 * * *", since=at(2026, 11, 30))
    assert list(fire(at(2026, 11, 30, 9, 0, 1)).values()) == [SlotStatus.failed]
    [slot] = slots_of("lonely")
    assert "no live preheat worker" in slot.error and runs() == []


def test_paused_slots_are_neither_fired_nor_missed_and_resume_starts_afresh(stack, stack_app):
    live_worker()
    add_schedule("nightly", "0 2 * * *", since=at(2026, 11, 1))
    with session_scope() as session:
        store.set_enabled(session, "nightly", False)
    assert fire(at(2026, 11, 30, 2, 0, 1)) == {}
    with session_scope() as session:
        store.set_enabled(session, "nightly", True)
    assert fire(utcnow()) == {}  # resumed now: the slots while paused are not wanted
    assert slots_of("nightly") == []


def test_a_peak_schedule_fires_as_trigger_peak_with_the_peak_it_anticipates(stack, stack_app):
    live_worker()
    peak = {"model": "tiny", "weekday": "mon", "starts": "09:00", "requests_per_min": 120.0}
    add_schedule(
        "peak-tiny-mon-0900", "0 9 * * mon", lead=90, since=at(2026, 11, 30), kind=ScheduleKind.peak, detail=peak
    )
    fire(at(2026, 11, 30, 8, 58, 31))  # Monday, 90 s before 09:00
    [run] = runs()
    assert run.trigger == TriggerKind.peak and run.trigger_detail["peak"] == peak


def test_daylight_saving_slots_through_the_beat(stack, stack_app):
    live_worker()
    add_schedule("ny-early", "30 2 * * *", timezone="America/New_York", since=at(2026, 3, 7, 12))
    # 2026-03-08: 02:30 does not exist in New York; the slot is the change itself, 07:00 UTC.
    assert fire(at(2026, 3, 8, 6, 59, 59)) == {}
    assert list(fire(at(2026, 3, 8, 7, 0, 1)).values()) == [SlotStatus.sent]
    assert [aware(s.slot_at) for s in slots_of("ny-early")] == [at(2026, 3, 8, 7, 0)]


def test_catalog_schedules_are_kept_in_step_with_the_file(stack, stack_app, tmp_path, tiny_model):
    morning = '\n[schedules.morning]\ncron = "50 8 * * 1-5"\ntemplates = ["support"]\ntimezone = "Europe/Berlin"\n'
    catalog = load_catalog(write_catalog(tmp_path, tiny_model, morning))
    with session_scope() as session:
        assert store.sync_catalog(session, catalog, "UTC") == ["+morning"]
        assert store.sync_catalog(session, catalog, "UTC") == []
    with session_scope() as session:
        schedule = store.get(session, "morning")
        assert (schedule.kind, schedule.timezone, schedule.targets) == (
            ScheduleKind.catalog,
            "Europe/Berlin",
            {"templates": ["support"]},
        )
        with pytest.raises(Exception, match="declared in the catalog"):
            store.remove(session, "morning")
    changed = load_catalog(write_catalog(tmp_path, tiny_model, morning.replace("50 8", "55 8")))
    with session_scope() as session:
        assert store.sync_catalog(session, changed, "UTC") == ["~morning"]
    with session_scope() as session:
        assert store.sync_catalog(session, load_catalog(write_catalog(tmp_path, tiny_model)), "UTC") == ["-morning"]


def test_the_lease_has_one_holder_and_passes_on_when_it_expires(stack, stack_app):
    now = utcnow()
    with session_scope() as session:
        assert leader.hold(session, "beat-a", 10, now)
    with session_scope() as session:
        assert not leader.hold(session, "beat-b", 10, now + dt.timedelta(seconds=5))
        assert leader.hold(session, "beat-a", 10, now + dt.timedelta(seconds=5))  # renewed to +15
        assert not leader.hold(session, "beat-b", 10, now + dt.timedelta(seconds=14))
        assert leader.hold(session, "beat-b", 10, now + dt.timedelta(seconds=16))
        assert not leader.hold(session, "beat-a", 10, now + dt.timedelta(seconds=17))
    with session_scope() as session:
        leader.release(session, "beat-b")
    with session_scope() as session:
        assert leader.hold(session, "beat-a", 10)  # a clean stop hands over at once


def test_each_endpoint_gets_a_keep_alive_entry_below_its_prompt_cache_ttl(tmp_path, tiny_model):
    catalog = load_catalog(
        write_catalog(
            tmp_path,
            tiny_model,
            (
                '\n[endpoints.hosted]\nbase_url = "https://api.example/v1"\ntemplates = ["support"]\n'
                '\n[endpoints.quiet]\nbase_url = "https://api.example/v1"\ntemplates = ["support"]\n'
                "keepalive_interval_s = 0.5\n"
                "prompt_cache_ttl_s = 1\n"
                '\n[endpoints.no-templates]\nbase_url = "https://api.example/v1"\n'
            ),
        )
    )
    entries = beat.keepalive_entries(catalog)
    assert sorted(entries) == ["keepalive:hosted", "keepalive:quiet"]
    hosted = entries["keepalive:hosted"]
    assert hosted["task"] == "preheat.keep_alive_endpoint" and hosted["kwargs"] == {"endpoint": "hosted"}
    assert hosted["schedule"] == dt.timedelta(seconds=270) and hosted["options"] == {"expires": 270}


def test_beat_sleeps_until_the_next_fire_time_when_it_comes_before_the_next_tick(stack, stack_app, monkeypatch):
    from preheat.core.settings import get_settings

    monkeypatch.setenv("PREHEAT_BEAT_TICK_S", "5")
    get_settings.cache_clear()
    live_worker()
    scheduler = beat.DatabaseScheduler(app=stack_app)
    try:
        assert scheduler.tick() == pytest.approx(5, abs=0.01)  # leads; nothing scheduled: the tick
        now = utcnow()
        fire_at = now.replace(microsecond=0) + dt.timedelta(seconds=2)  # 1 to 2 s away, on a whole second
        add_schedule("soon", "* * * * *", lead=(60 - fire_at.second) % 60, since=now)
        wait = scheduler.tick()
        assert wait == pytest.approx((fire_at - utcnow()).total_seconds(), abs=0.2)
    finally:
        scheduler.close()
        get_settings.cache_clear()


def test_a_sleep_due_in_the_minute_of_a_warm_of_its_model_is_overruled_and_the_warm_fires(embedded_stack):
    """The rule at fire time, for contradictions `schedule add` could not see (past its
    horizon): the warm or wake fires, the sleep is recorded failed with the reason."""
    import uuid

    from preheat.history.models import RunAction
    from preheat.schedules.beat import DueSlot, overruled_sleeps

    at = dt.datetime(2027, 3, 1, 9, 0, 30, tzinfo=dt.UTC)

    def due(name, action, targets):
        return DueSlot(uuid.uuid4(), name, ScheduleKind.manual, targets, {}, 0, at, at, action, None)

    sleep = due("night", RunAction.sleep, {"models": ["tiny"]})
    wake = due("morning", RunAction.wake, {"templates": ["support"]})
    elsewhere = due("other", RunAction.warm, {"templates": ["support"], "workers": ["w2@b"]})
    assert overruled_sleeps([sleep, wake]) == {
        sleep.trigger_key: "overruled: schedule 'morning' wakes tiny in the same minute"
    }
    mine = due("mine", RunAction.sleep, {"models": ["tiny"], "workers": ["w1@a"]})
    assert overruled_sleeps([mine, elsewhere]) == {}  # other workers: no contradiction
    assert overruled_sleeps([sleep]) == {}
