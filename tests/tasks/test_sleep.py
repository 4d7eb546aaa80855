"""Sleep and wake on real worker processes, through the CLI and the broker, on the embedded
default and on Redis + Postgres: recorded in history, the inference queue left alone while
asleep, a request that comes anyway wakes the worker, and a restart off-peak starts asleep."""

import datetime as dt
import json

import httpx
import pytest

from preheat.celery.queues import worker_queue
from preheat.core import processes
from preheat.history.db import session_scope, utcnow
from tests.tasks.test_worker import send_infer

pytestmark = pytest.mark.slow

WORKER = "w1@preheat-sleep"


@pytest.fixture
def worker(stack, tmp_path):
    proc = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(proc):
        processes.wait_for_log(proc, f"{WORKER} ready.")
        processes.poll(
            lambda: httpx.get(f"{processes.health_url(proc)}/health/ready").status_code == 200, 60, what="ready"
        )
        yield proc


def _app():
    from preheat.celery.app import create_app
    from preheat.core.settings import get_settings

    return create_app(get_settings())


def _ready(proc) -> httpx.Response:
    return httpx.get(f"{processes.health_url(proc)}/health/ready")


def test_sleep_and_wake_are_recorded_and_a_request_while_asleep_wakes_the_worker(stack, worker):
    answer = send_infer(max_tokens=6).get(timeout=60)

    slept = stack.cli("sleep", "--model", "tiny", "--wait", "--json")
    assert slept.returncode == 0, slept.stderr + worker.log()[-3000:]
    run = json.loads(slept.stdout)
    assert (run["action"], run["status"]) == ("sleep", "succeeded")
    [job] = run["jobs"]
    assert (job["target"], job["model"], job["template"], job["status"]) == (WORKER, "tiny", "*", "asleep")
    assert job["sleep_level"] == 1 and job["sleep_ms"] > 0 and job["bytes_freed"] > job["cache_bytes"] > 0
    assert _ready(worker).json() == {"status": "not ready", "reasons": ["model tiny: asleep (level 1)"]}
    processes.wait_for_log(worker, "Canceling queue preheat.infer.tiny", 10)
    again = stack.cli("sleep", "--model", "tiny", "--wait", "--json")
    assert json.loads(again.stdout)["jobs"][0]["status"] == "skipped"  # idempotent

    # A request while the only worker sleeps: it waits in the queue, the worker sees it and wakes.
    woken_answer = send_infer(max_tokens=6).get(timeout=90)
    assert woken_answer["token_ids"] == answer["token_ids"]
    assert woken_answer["cached_tokens"] == answer["cached_tokens"]
    demand = json.loads(stack.cli("history", "--trigger", "demand", "--json").stdout)
    assert len(demand) == 1 and demand[0]["action"] == "wake" and demand[0]["status"] == "succeeded"
    rows = {job["template"]: job for job in demand[0]["jobs"]}
    assert rows["*"]["status"] == "awake" and rows["*"]["wake_ms"] > 0
    assert rows["support"]["status"] == "warm" and rows["support"]["ttft_warm_ms"] > 0
    processes.poll(lambda: _ready(worker).status_code == 200, 30, what="ready after the wake")

    # A wake of a model awake is skipped, and its templates are warmed all the same.
    woke = stack.cli("wake", "--template", "support", "--wait", "--json")
    assert woke.returncode == 0, woke.stderr
    statuses = {job["template"]: job["status"] for job in json.loads(woke.stdout)["jobs"]}
    assert statuses == {"*": "skipped", "support": "warm"}
    shown = stack.cli("history", json.loads(slept.stdout)["id"][:8])
    assert "sleep" in shown.stdout and "asleep" in shown.stdout

    # A request routed to this worker's own queue while its model sleeps (the router's view of
    # the fleet is a moment old): the worker wakes inline for it, and history records that wake
    # as a run of its own, with the request's task.
    assert stack.cli("sleep", "--model", "tiny", "--wait", "--json").returncode == 0
    routed = _app().send_task(
        "preheat.infer",
        kwargs={"template": "support", "user_input": "Where is my parcel?", "max_tokens": 6},
        queue=worker_queue(WORKER),
    )
    assert routed.get(timeout=90)["token_ids"] == answer["token_ids"]

    def inline_wake():  # its record may land a moment after the answer
        runs = json.loads(stack.cli("history", "--trigger", "demand", "--json").stdout)
        return next((run for run in runs if run["requested_by"] == f"request on {WORKER}"), None)

    inline = processes.poll(inline_wake, 30, every_s=0.5, what="the inline wake recorded")
    [job] = inline["jobs"]
    assert (inline["action"], inline["status"], job["target"], job["model"]) == ("wake", "succeeded", WORKER, "tiny")
    assert job["status"] == "awake" and job["wake_ms"] > 0 and job["celery_task_id"] == routed.id


def test_a_scheduled_wake_brings_the_worker_back_warm_and_a_restart_off_peak_starts_asleep(
    stack, stack_app, worker, tmp_path
):
    from preheat.schedules import beat, store

    added = stack.cli("schedule", "add", "night", "--cron", "* * * * *", "--action", "sleep", "--level", "2")
    assert added.returncode == 0, added.stderr
    clash = stack.cli("schedule", "add", "morning", "--cron", "* * * * *", "--action", "wake")
    assert clash.returncode == 2 and "same minute as schedule 'night'" in clash.stderr

    with session_scope() as session:  # added two minutes ago: its latest slot is due now
        store.get(session, "night").active_since = utcnow() - dt.timedelta(minutes=2)
    fired = beat.fire_due(utcnow(), "beat-test", grace_s=300, lease_s=15)
    assert list(fired.values()) == ["sent"]
    with session_scope() as session:
        slot = next(slot for slot in store.recent_slots(session, "night") if slot.status == "sent")
    run = processes.poll(lambda: _final(stack, str(slot.run_id)), 60, what="the night's sleep")
    assert run["action"] == "sleep" and run["jobs"][0]["status"] == "asleep" and run["jobs"][0]["sleep_level"] == 2

    # Restarted while the schedule says asleep: it starts asleep, nothing loaded.
    processes.stop(worker)
    restarted = processes.start_worker(WORKER, stack.env, tmp_path / "logs2", cwd=stack.home)
    with processes.running(restarted):
        processes.wait_for_log(restarted, "model tiny starts asleep: schedule night put it to sleep", 60)
        processes.poll(lambda: _ready(restarted).status_code == 503, 30, what="health")
        assert _ready(restarted).json()["reasons"] == ["model tiny: asleep (level 2)"]
        assert "model tiny resident" not in restarted.log()

        woke = stack.cli("wake", "--wait", "--json", "--timeout", "120")
        assert woke.returncode == 0, woke.stderr + restarted.log()[-3000:]
        rows = {job["template"]: job for job in json.loads(woke.stdout)["jobs"]}
        assert rows["*"]["status"] == "awake" and rows["*"]["load_ms"] > 0  # loaded through the weight loader
        assert rows["support"]["status"] == "warm"
        processes.poll(lambda: _ready(restarted).status_code == 200, 30, what="ready after the wake")
        assert send_infer(max_tokens=2).get(timeout=60)["cached_tokens"] > 20


def _final(stack, run_id: str):
    run = json.loads(stack.cli("history", run_id[:8], "--json").stdout)
    run = run[0] if isinstance(run, list) else run
    return run if run["status"] in ("succeeded", "degraded", "failed") else None


def test_a_day_in_minutes_asleep_at_night_woken_by_a_request_and_warm_for_the_morning_peak(stack, stack_app, worker):
    """Every slot fired by beat's own code at the moment it falls (a chosen clock), the worker
    real: a night's sleep, a request at 23:30 that wakes it on demand and is answered as
    before, the next night's sleep, and the morning's wake ahead of the peak that makes the
    peak's first request start from the cached prefix."""
    from preheat.schedules import beat, store

    answer = send_infer(max_tokens=6).get(timeout=60)
    assert stack.cli("schedule", "add", "night", "--cron", "0 22 * * *", "--action", "sleep").returncode == 0
    morning = ("schedule", "add", "morning", "--cron", "0 7 * * *", "--lead", "120", "--action", "wake")
    assert stack.cli(*morning).returncode == 0
    day = (utcnow() + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)

    def fire(at: dt.datetime) -> dict:
        fired = beat.fire_due(at, "beat-test", grace_s=300, lease_s=15)
        assert list(fired.values()) == ["sent"], fired
        with session_scope() as session:
            [slot] = store.recent_slots(session, limit=1)
        return processes.poll(lambda: _final(stack, str(slot.run_id)), 90, what=f"the slot at {at}")

    night = fire(day + dt.timedelta(hours=22, seconds=5))
    assert (night["action"], night["trigger"], night["jobs"][0]["status"]) == ("sleep", "schedule", "asleep")
    late = send_infer(max_tokens=6).get(timeout=90)  # 23:30, asleep: woken on demand
    assert late["token_ids"] == answer["token_ids"] and late["cached_tokens"] == answer["cached_tokens"]

    second_night = fire(day + dt.timedelta(days=1, hours=22, seconds=5))  # the morning between: missed
    assert second_night["jobs"][0]["status"] == "asleep"
    wake = fire(day + dt.timedelta(days=2, hours=6, minutes=58, seconds=5))  # 07:00 less the lead
    rows = {job["template"]: job for job in wake["jobs"]}
    assert (wake["action"], rows["*"]["status"], rows["support"]["status"]) == ("wake", "awake", "warm")
    first = send_infer(max_tokens=6).get(timeout=60)  # the peak's first request
    assert first["token_ids"] == answer["token_ids"] and first["cached_tokens"] == answer["cached_tokens"]
    # The two mornings the compressed day skipped are recorded missed, not fired late.
    slots = json.loads(stack.cli("schedule", "slots", "morning", "--json").stdout)
    assert [slot["status"] for slot in slots] == ["sent", "missed", "missed"]
