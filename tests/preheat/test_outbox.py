"""The history outbox against a real Postgres that goes away: this process reaches it
through a TCP proxy the test cuts; the test reads the database directly."""

from __future__ import annotations

import datetime as dt
import shutil
import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from preheat.fleet import traffic
from preheat.history import outbox, service
from preheat.history.db import open_database
from preheat.history.models import (
    AppliedWrite,
    JobStatus,
    RunAction,
    RunStatus,
    TrafficCount,
    TriggerKind,
    WarmupJob,
    WarmupRun,
)
from tests.tcp_proxy import TcpProxy

WORKER = "gpu0@outbox-test"
T0 = dt.datetime(2026, 11, 29, 22, 0, tzinfo=dt.UTC)
KINDS = (*service.OUTBOX_KINDS, *traffic.OUTBOX_KINDS)


@pytest.fixture
def away(services_stack, apply_env):
    """This process's database is behind a proxy (`away.cut()`, `away.restore()`);
    `away.direct` is a session factory on the real server."""
    real_url = services_stack.env["PREHEAT_DATABASE_URL"]
    proxy = TcpProxy("127.0.0.1", 5432).start()
    apply_env({**services_stack.env, "PREHEAT_DATABASE_URL": real_url.replace(":5432/", f":{proxy.port}/")})
    engine = open_database(real_url)
    proxy.direct = lambda: Session(engine, expire_on_commit=False)
    yield proxy
    proxy.close()
    engine.dispose()


@pytest.fixture
def box(tmp_path):
    opened = outbox.Outbox(outbox.path_for(tmp_path, WORKER), WORKER, KINDS)
    yield opened
    opened.close()


def _run_with_jobs(direct, templates=("support", "summarise")) -> tuple[str, str]:
    task_id = str(uuid.uuid4())
    with direct() as session, session.begin():
        run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
        service.add_jobs(session, run, target=WORKER, model_templates=[("tiny", t) for t in templates], task_id=task_id)
        return str(run.id), task_id


def _jobs(direct, run_id: str) -> dict[str, WarmupJob]:
    with direct() as session:
        return {job.template: job for job in service.get_run(session, uuid.UUID(run_id)).jobs}


def _start(run_id, task_id, at, templates=("support", "summarise")) -> dict:
    return {"run_id": run_id, "target": WORKER, "templates": list(templates), "task_id": task_id, "at": at}


def _finish(run_id, template, at, status="warm") -> dict:
    return {
        "run_id": run_id,
        "target": WORKER,
        "template": template,
        "status": status,
        "measured": {"prefill_ms": 12.5, "ttft_warm_ms": 3.25, "cached_tokens": 48},
        "at": at,
    }


def _tally(requests: int, template: str = "support") -> dict:
    return {
        "tallies": [
            {
                "minute": T0,
                "model": "tiny",
                "template": template,
                "requests": requests,
                "prompt_tokens": 10 * requests,
                "prefix_tokens": 48,
            }
        ]
    }


def test_writes_go_straight_to_the_database_while_it_answers(away, box):
    run_id, task_id = _run_with_jobs(away.direct)
    assert box.write(service.JOB_START, _start(run_id, task_id, T0)) is True
    assert box.counts() == outbox.Counts(0, 0)
    assert {job.status for job in _jobs(away.direct, run_id).values()} == {JobStatus.running}


def test_with_the_database_away_writes_wait_and_are_written_later_in_order_with_their_times(away, box):
    run_id, task_id = _run_with_jobs(away.direct)
    away.cut()
    assert box.write(service.JOB_START, _start(run_id, task_id, T0)) is outbox.DEFERRED
    assert box.write(service.JOB_FINISH, _finish(run_id, "support", T0 + dt.timedelta(seconds=2))) is outbox.DEFERRED
    assert box.replay() == 0  # still away: nothing applied, nothing lost
    away.restore()
    # The database is back, but earlier writes still wait: this one queues behind them.
    assert box.write(service.JOB_FINISH, _finish(run_id, "summarise", T0 + dt.timedelta(seconds=3))) is outbox.DEFERRED
    assert [entry["kind"] for entry in box.entries()] == ["job.start", "job.finish", "job.finish"]
    assert box.entries()[0]["attempts"] == 1
    with away.direct() as session:
        assert {job.status for job in service.get_run(session, uuid.UUID(run_id)).jobs} == {JobStatus.queued}

    assert box.replay() == 3
    jobs = _jobs(away.direct, run_id)
    assert {t: j.status for t, j in jobs.items()} == {"support": JobStatus.warm, "summarise": JobStatus.warm}
    assert jobs["support"].started_at == T0 and jobs["support"].finished_at == T0 + dt.timedelta(seconds=2)
    assert jobs["support"].prefill_ms == 12.5 and jobs["support"].cached_tokens == 48
    with away.direct() as session:
        run = service.get_run(session, uuid.UUID(run_id))
        assert run.status == RunStatus.succeeded and run.finished_at == T0 + dt.timedelta(seconds=3)
        assert session.scalar(select(func.count()).select_from(AppliedWrite)) == 3
    assert box.counts() == outbox.Counts(0, 0)
    # Empty again: the next write goes straight through.
    assert box.write(service.JOB_START, _start(run_id, task_id, T0, ["support"])) is True


def test_an_entry_applied_just_before_a_crash_is_not_applied_again(away, box, tmp_path):
    away.cut()
    box.write(traffic.TALLIES, _tally(7))
    box.write(traffic.TALLIES, _tally(5))
    # The worker dies after the database committed but before the file forgot the entries:
    # its restart finds them still there.
    left_behind = tmp_path / "restarted" / box.path.name
    left_behind.parent.mkdir()
    box._db.execute("PRAGMA wal_checkpoint(FULL)")
    shutil.copy(box.path, left_behind)
    away.restore()
    assert box.replay() == 2

    restarted = outbox.Outbox(left_behind, WORKER, KINDS)
    try:
        assert restarted.counts().pending == 2
        assert restarted.replay() == 2  # found applied, removed
        assert restarted.counts() == outbox.Counts(0, 0)
    finally:
        restarted.close()
    with away.direct() as session:
        assert session.scalar(select(TrafficCount.requests)) == 12


def test_an_entry_the_database_refuses_is_set_aside_and_does_not_block_the_rest(away, box):
    away.cut()
    box.write(traffic.TALLIES, _tally(3, template="x" * 65))  # longer than the column: refused for good
    box.write(traffic.TALLIES, _tally(4))
    away.restore()
    assert box.replay() == 1
    assert box.counts() == outbox.Counts(pending=0, dead=1)
    [dead] = box.entries()
    assert "StringDataRightTruncation" in dead["dead_reason"] or "too long" in dead["dead_reason"]
    with away.direct() as session:
        assert session.scalars(select(TrafficCount.requests)).all() == [4]


def test_a_finish_for_a_run_deleted_meanwhile_is_applied_as_nothing(away, box):
    run_id, _task_id = _run_with_jobs(away.direct)
    away.cut()
    box.write(service.JOB_FINISH, _finish(run_id, "support", T0))
    with away.direct() as session, session.begin():
        session.delete(service.get_run(session, uuid.UUID(run_id)))
    away.restore()
    assert box.replay() == 1
    assert box.counts() == outbox.Counts(0, 0)


def test_without_an_outbox_the_caller_sees_the_database_away(away):
    assert outbox.current() is None
    away.cut()
    with pytest.raises(OperationalError):
        outbox.record(traffic.TALLIES, _tally(1))


def test_an_unknown_kind_is_refused_before_it_is_kept(box):
    with pytest.raises(KeyError, match="no writer"):
        box.append(outbox.EntryKind("job.teleport", lambda session, payload: None), {})
    assert box.counts() == outbox.Counts(0, 0)


def test_the_process_outbox_is_one_file_per_worker_name(tmp_path):
    try:
        opened = outbox.open_for("gpu0@node-3", tmp_path, KINDS)
        assert opened.path == tmp_path / "gpu0_node-3.sqlite3" and outbox.current() is opened
    finally:
        outbox.close()
    assert outbox.current() is None


def test_a_wake_a_request_made_waits_while_the_database_is_away_and_is_recorded_once(away, box):
    """A wake a request made inline (a request on the worker's own queue while its model
    slept) is a run of its own: kept while the database is away, written later with its
    times, and once, however often it is written."""
    key = f"demand:{WORKER}:tiny:{T0.isoformat()}"
    payload = {
        "key": key,
        "target": WORKER,
        "model": "tiny",
        "status": "awake",
        "measured": {"wake_ms": 812.5, "sleep_level": 1},
        "task_id": "a-request",
        "started_at": T0,
        "at": T0 + dt.timedelta(seconds=1),
    }
    away.cut()
    assert box.write(service.WAKE_ON_DEMAND, payload) is outbox.DEFERRED
    away.restore()
    assert box.replay() == 1
    box.write(service.WAKE_ON_DEMAND, payload)  # again: the key finds the run, nothing is added
    with away.direct() as session:
        run = service.run_for_key(session, key)
        [job] = run.jobs
        assert (run.trigger, run.action, run.status) == (TriggerKind.demand, RunAction.wake, RunStatus.succeeded)
        assert (job.target, job.model, job.template, job.status) == (WORKER, "tiny", "*", JobStatus.awake)
        assert (job.wake_ms, job.celery_task_id, job.started_at) == (812.5, "a-request", T0)
        assert job.finished_at == T0 + dt.timedelta(seconds=1) and run.requested_by == f"request on {WORKER}"
        assert session.scalar(select(func.count()).select_from(WarmupRun).where(WarmupRun.trigger_key == key)) == 1
