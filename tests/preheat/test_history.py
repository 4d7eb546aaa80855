"""The history service on both databases: runs, jobs, derived run status, re-delivery."""

import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from preheat.history import service
from preheat.history.db import session_scope
from preheat.history.models import JobStatus, RunStatus, TriggerKind, WarmupJob

J = JobStatus


@pytest.fixture
def db(stack):
    """The stack's history database, migrated and empty (no processes needed)."""
    return stack


def _run_with_jobs(templates=("support", "code"), target="w1@host", task_id="t-1"):
    with session_scope() as session:
        run = service.create_run(session, trigger=TriggerKind.manual, requested_by="alice", detail={"why": "test"})
        service.add_jobs(session, run, target=target, model_templates=[("tiny", t) for t in templates], task_id=task_id)
        return run.id


def _measured(**overrides):
    values = dict(
        load_ms=10.0,
        prefill_ms=2.0,
        ttft_cold_ms=8.0,
        ttft_warm_ms=3.0,
        ttft_bare_ms=2.5,
        cached_tokens=40,
        cache_bytes=3 * 2**31,
        device="cpu/float32",
        error=None,
    )
    return values | overrides


def test_a_run_goes_queued_running_succeeded(db):
    run_id = _run_with_jobs()
    with session_scope() as session:
        assert service.get_run(session, run_id).status == RunStatus.queued
        jobs = service.start_jobs(session, run_id, target="w1@host", templates=["support", "code"], task_id="t-1")
        assert {job.status for job in jobs} == {J.running}
    with session_scope() as session:
        assert service.get_run(session, run_id).status == RunStatus.running
        service.finish_job(session, run_id, target="w1@host", template="support", status=J.warm, measured=_measured())
        assert service.get_run(session, run_id).status == RunStatus.running
        service.finish_job(session, run_id, target="w1@host", template="code", status=J.warm, measured=_measured())
    with session_scope() as session:
        run = service.get_run(session, run_id)
        assert run.status == RunStatus.succeeded and run.finished_at is not None
        job = run.jobs[1]
        assert (job.template, job.ttft_warm_ms, job.cache_bytes) == ("support", 3.0, 3 * 2**31)  # > 32-bit


def test_a_redelivered_job_restarts_its_own_row(db):
    run_id = _run_with_jobs(templates=("support",))
    for task_id in ("t-1", "t-1-redelivered"):
        with session_scope() as session:
            service.start_jobs(session, run_id, target="w1@host", templates=["support"], task_id=task_id)
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(WarmupJob)) == 1
        assert service.get_run(session, run_id).jobs[0].celery_task_id == "t-1-redelivered"


def test_one_row_per_run_target_model_template(db):
    run_id = _run_with_jobs(templates=("support",))
    with pytest.raises(IntegrityError), session_scope() as session:
        run = service.get_run(session, run_id)
        service.add_jobs(session, run, target="w1@host", model_templates=[("tiny", "support")], task_id="t-2")


def test_a_gone_run_starts_nothing(db):
    with session_scope() as session:
        assert service.start_jobs(session, uuid.uuid4(), target="w1@host", templates=["support"], task_id="t-9") == []


def test_a_failed_task_fails_only_its_unfinished_jobs(db):
    run_id = _run_with_jobs(templates=("support", "code"))
    with session_scope() as session:
        service.start_jobs(session, run_id, target="w1@host", templates=["support", "code"], task_id="t-1")
        service.finish_job(session, run_id, target="w1@host", template="support", status=J.warm, measured=_measured())
    with session_scope() as session:
        assert service.fail_task_jobs(session, "t-1", "MemoryError: out of memory") == 1
    with session_scope() as session:
        run = service.get_run(session, run_id)
        assert [(job.template, job.status, job.error) for job in run.jobs] == [
            ("code", J.failed, "MemoryError: out of memory"),
            ("support", J.warm, None),
        ]
        assert run.status == RunStatus.failed


def test_runs_are_listed_newest_first_with_filters_and_found_by_prefix(db):
    first, second = _run_with_jobs(task_id="a"), _run_with_jobs(task_id="b")
    with session_scope() as session:
        assert [run.id for run in service.list_runs(session)] == [second, first]
        assert service.list_runs(session, status=RunStatus.succeeded) == []
        assert service.list_runs(session, trigger=TriggerKind.schedule) == []
        assert len(service.list_runs(session, limit=1)) == 1
        assert service.find_run(session, first.hex[:8]).id == first
        assert service.find_run(session, str(second)).id == second
        assert service.find_run(session, "zz") is None


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([], RunStatus.queued),
        ([J.queued, J.queued], RunStatus.queued),
        ([J.running, J.queued], RunStatus.running),
        ([J.warm, J.running], RunStatus.running),
        ([J.warm, J.skipped], RunStatus.succeeded),
        ([J.warm, J.degraded], RunStatus.degraded),
        ([J.warm, J.failed], RunStatus.failed),
        ([J.degraded, J.lost], RunStatus.failed),
    ],
)
def test_run_status_follows_from_its_jobs(statuses, expected):
    assert service.derive_run_status(statuses) == expected


def test_an_ambiguous_prefix_finds_nothing(db):
    from preheat.history.models import WarmupRun

    with session_scope() as session:
        for tail in ("0" * 28, "f" * 28):
            session.add(WarmupRun(id=uuid.UUID("abcd" + tail), trigger=TriggerKind.manual, requested_by="t"))
    with session_scope() as session:
        assert service.find_run(session, "abcd") is None
        assert service.find_run(session, "abcd0").id == uuid.UUID("abcd" + "0" * 28)
        assert service.find_run(session, "abcdf").id == uuid.UUID("abcd" + "f" * 28)


def test_two_workers_finishing_a_runs_last_jobs_at_once_leave_it_finished(services_stack):
    """On Postgres (read committed), each finisher would see the other's job unfinished and
    leave the run `running` for ever; the run's row lock makes the second wait for the first."""
    import threading

    with session_scope() as session:
        run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
        for target in ("w1@h", "w2@h"):
            service.add_jobs(session, run, target=target, model_templates=[("tiny", "support")], task_id=target)
            service.start_jobs(session, run.id, target=target, templates=["support"], task_id=target)
        run_id = run.id
    first_written, release = threading.Event(), threading.Event()

    def finish(target: str, hold: bool) -> None:
        with session_scope() as session:
            service.finish_job(session, run_id, target=target, template="support", status=J.warm, measured={})
            if hold:  # written, not yet committed: the other finisher runs now
                first_written.set()
                release.wait(10)

    first = threading.Thread(target=finish, args=("w1@h", True))
    first.start()
    assert first_written.wait(10)
    second = threading.Thread(target=finish, args=("w2@h", False))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for the run's lock, not reading a stale picture
    release.set()
    first.join(10)
    second.join(10)
    with session_scope() as session:
        assert service.get_run(session, run_id).status == RunStatus.succeeded
