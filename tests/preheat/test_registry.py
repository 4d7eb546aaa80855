"""The worker registry and the reaper, on both databases, with explicit clocks."""

import datetime as dt

import pytest

from preheat.fleet import registry
from preheat.history import service
from preheat.history.db import aware, session_scope, utcnow
from preheat.history.models import JobStatus, RunStatus, TriggerKind

DEAD_AFTER, TIME_LIMIT = 30.0, 600.0
T0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def db(stack):
    return stack


def _beat(nodename, *, at, started_at=T0, ready=True):
    with session_scope() as session:
        registry.beat(session, nodename, started_at=started_at, ready=ready, state={"ready": ready}, now=at)


def _run_on(*targets, created_at=T0):
    with session_scope() as session:
        run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
        run.created_at = created_at
        for target in targets:
            service.add_jobs(
                session, run, target=target, model_templates=[("tiny", "support")], task_id=f"task-{target}"
            )
        return run.id


def _start(run_id, target, at):
    with session_scope() as session:
        [job] = service.start_jobs(session, run_id, target=target, templates=["support"], task_id=f"task-{target}")
        job.started_at = at


def _reap(now):
    with session_scope() as session:
        return registry.reap(session, dead_after_s=DEAD_AFTER, time_limit_s=TIME_LIMIT, now=now)


def _jobs(run_id):
    with session_scope() as session:
        run = service.get_run(session, run_id)
        return run.status, {job.target: (job.status, job.error) for job in run.jobs}


def test_live_workers_are_those_with_a_fresh_heartbeat_and_no_stop(db):
    _beat("a@h", at=T0)
    _beat("b@h", at=T0 - dt.timedelta(seconds=31))
    _beat("c@h", at=T0)
    with session_scope() as session:
        registry.mark_stopped(session, "c@h")
        assert [w.nodename for w in registry.live_workers(session, DEAD_AFTER, now=T0)] == ["a@h"]
        assert [w.nodename for w in registry.workers(session)] == ["a@h", "b@h", "c@h"]


def test_a_heartbeat_updates_one_row_per_worker(db):
    _beat("a@h", at=T0, ready=False)
    _beat("a@h", at=T0 + dt.timedelta(seconds=10), ready=True)
    with session_scope() as session:
        [record] = registry.workers(session)
        assert record.ready and aware(record.heartbeat_at) == T0 + dt.timedelta(seconds=10)


def test_jobs_of_a_silent_worker_are_lost_after_the_bound_and_the_run_fails(db):
    _beat("a@h", at=T0)
    _beat("b@h", at=T0)
    run_id = _run_on("a@h", "b@h")
    _start(run_id, "a@h", T0)

    _beat("b@h", at=T0 + dt.timedelta(seconds=30))
    assert _reap(T0 + dt.timedelta(seconds=30)) == 0  # a's heartbeat is 30 s old: not yet dead
    _beat("b@h", at=T0 + dt.timedelta(seconds=31))
    assert _reap(T0 + dt.timedelta(seconds=31)) == 1

    status, jobs = _jobs(run_id)
    assert jobs["a@h"][0] == JobStatus.lost and "sent no heartbeat since 12:00:00 UTC" in jobs["a@h"][1]
    assert jobs["b@h"] == (JobStatus.queued, None)  # b is alive: its job waits in its queue
    assert status == RunStatus.running
    with session_scope() as session:
        service.start_jobs(session, run_id, target="b@h", templates=["support"], task_id="task-b@h")
        service.finish_job(session, run_id, target="b@h", template="support", status=JobStatus.warm, measured={})
    assert _jobs(run_id)[0] == RunStatus.failed


def test_a_restarted_worker_loses_the_job_its_previous_life_was_running(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0 + dt.timedelta(seconds=1))
    restarted = T0 + dt.timedelta(seconds=5)
    _beat("a@h", at=restarted, started_at=restarted)
    assert _reap(restarted) == 1
    assert _jobs(run_id)[1]["a@h"][0] == JobStatus.lost
    assert "restarted while running" in _jobs(run_id)[1]["a@h"][1]


def test_a_queued_job_waits_for_a_restarting_worker_until_the_bound(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    with session_scope() as session:
        registry.mark_stopped(session, "a@h")
    assert _reap(utcnow()) == 0  # the message waits in the worker's own queue
    assert _reap(utcnow() + dt.timedelta(seconds=DEAD_AFTER + 1)) == 1
    assert _jobs(run_id)[1]["a@h"][0] == JobStatus.lost


def test_a_job_for_a_worker_that_never_registered_is_lost_after_the_bound(db):
    run_id = _run_on("ghost@h")
    assert _reap(T0 + dt.timedelta(seconds=DEAD_AFTER)) == 0
    assert _reap(T0 + dt.timedelta(seconds=DEAD_AFTER + 1)) == 1
    assert "never registered" in _jobs(run_id)[1]["ghost@h"][1]


def test_a_job_running_past_the_time_limit_fails_even_on_a_live_worker(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0)
    late = T0 + dt.timedelta(seconds=TIME_LIMIT + 1)
    _beat("a@h", at=late)
    assert _reap(late) == 1
    assert _jobs(run_id)[1]["a@h"][0] == JobStatus.failed


def test_a_lost_job_redelivered_later_updates_its_own_row(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0)
    _reap(T0 + dt.timedelta(seconds=DEAD_AFTER + 1))
    with session_scope() as session:
        [_job] = service.start_jobs(session, run_id, target="a@h", templates=["support"], task_id="task-a@h")
        service.finish_job(
            session, run_id, target="a@h", template="support", status=JobStatus.warm, measured={"ttft_warm_ms": 3.0}
        )
    status, jobs = _jobs(run_id)
    assert status == RunStatus.succeeded and jobs == {"a@h": (JobStatus.warm, None)}


def test_finished_and_endpoint_jobs_are_never_reaped(db):
    run_id = _run_on("ghost@h")
    with session_scope() as session:
        service.start_jobs(session, run_id, target="ghost@h", templates=["support"], task_id="t")
        service.finish_job(session, run_id, target="ghost@h", template="support", status=JobStatus.warm, measured={})
    assert _reap(T0 + dt.timedelta(days=1)) == 0


class Pulses:
    """Pulses as the broker holds them (the Redis and file kinds are tested in test_liveness)."""

    def __init__(self, **pulses) -> None:
        self.pulses = pulses

    def read(self, nodename):
        return self.pulses.get(nodename)


def _reap_with(now, pulses, lost_message_after_s=None):
    with session_scope() as session:
        return registry.reap(
            session,
            dead_after_s=DEAD_AFTER,
            time_limit_s=TIME_LIMIT,
            now=now,
            pulses=pulses,
            lost_message_after_s=lost_message_after_s,
        )


def test_a_worker_whose_database_heartbeat_is_stale_but_whose_pulse_is_fresh_is_alive(db):
    from preheat.fleet.liveness import Pulse

    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0)
    later = T0 + dt.timedelta(seconds=DEAD_AFTER + 10)  # its database was away: the row is stale
    assert _reap_with(later, Pulses(**{"a@h": Pulse(later - dt.timedelta(seconds=1), None)})) == 0
    assert _jobs(run_id)[1]["a@h"][0] == JobStatus.running
    stale = Pulses(**{"a@h": Pulse(T0, None)})  # silent on the broker too: dead
    assert _reap_with(later, stale) == 1 and _jobs(run_id)[1]["a@h"][0] == JobStatus.lost


def test_a_job_queued_for_a_live_idle_worker_is_lost_after_the_bound_a_busy_ones_waits(db):
    from preheat.fleet.liveness import Pulse

    _beat("idle@h", at=T0)
    _beat("busy@h", at=T0)
    run_id = _run_on("idle@h", "busy@h")
    now = T0 + dt.timedelta(seconds=25)
    pulses = Pulses(**{"idle@h": Pulse(now, T0 - dt.timedelta(seconds=5)), "busy@h": Pulse(now, None)})
    with session_scope() as session:  # both still beat
        for name in ("idle@h", "busy@h"):
            registry.beat(session, name, started_at=T0, ready=True, state={}, now=now)
    assert _reap_with(now, pulses, lost_message_after_s=30) == 0  # idle 25 s since queued: within the bound
    later = T0 + dt.timedelta(seconds=31)
    pulses.pulses = {"idle@h": Pulse(later, T0 - dt.timedelta(seconds=5)), "busy@h": Pulse(later, None)}
    with session_scope() as session:
        for name in ("idle@h", "busy@h"):
            registry.beat(session, name, started_at=T0, ready=True, state={}, now=later)
    assert _reap_with(later, pulses, lost_message_after_s=30) == 1
    _status, jobs = _jobs(run_id)
    assert jobs["idle@h"][0] == JobStatus.lost
    assert jobs["idle@h"][1] == (
        "message lost: worker idle@h was live and idle for 31 s after this job was queued and never took it "
        "(bound 30 s, PREHEAT_LOST_MESSAGE_AFTER_S)"
    )
    assert jobs["busy@h"][0] == JobStatus.queued  # behind the task it runs


def test_a_result_that_arrives_after_lost_replaces_it_and_the_record_says_so(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0)
    reaped_at = T0 + dt.timedelta(seconds=DEAD_AFTER + 1)
    _reap(reaped_at)
    assert _jobs(run_id)[0] == RunStatus.failed
    finished_at = T0 + dt.timedelta(seconds=5)  # the worker had finished; its write waited in its outbox
    with session_scope() as session:
        service.finish_job(
            session, run_id, target="a@h", template="support", status=JobStatus.warm, measured={}, at=finished_at
        )
    with session_scope() as session:
        run = service.get_run(session, run_id)
        [job] = run.jobs
        assert (run.status, aware(run.finished_at)) == (RunStatus.succeeded, finished_at)  # its last job's time
        assert [(c["from"], c["to"]) for c in run.status_changes] == [("failed", "succeeded")]
        assert job.status == JobStatus.warm
        [earlier] = job.superseded
        assert earlier["status"] == "lost" and "sent no heartbeat since 12:00:00 UTC" in earlier["error"]
        assert dt.datetime.fromisoformat(earlier["at"]).replace(tzinfo=dt.UTC) == reaped_at
        # `preheat history RUN` says it too, under the table.
        from rich.console import Console

        from preheat.cli import render

        shown = Console(record=True, width=300)
        render.print_reasons(shown, run)
        text = shown.export_text()
        assert "a@h · support · was lost at " in text and "sent no heartbeat since 12:00:00 UTC" in text
        assert "run status failed → succeeded at " in text


def test_a_redelivery_over_a_final_run_is_recorded(db):
    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    _start(run_id, "a@h", T0)
    _reap(T0 + dt.timedelta(seconds=DEAD_AFTER + 1))
    _start(run_id, "a@h", T0 + dt.timedelta(seconds=60))  # the message re-delivered
    with session_scope() as session:
        run = service.get_run(session, run_id)
        assert run.status == RunStatus.running
        assert [(c["from"], c["to"]) for c in run.status_changes] == [("failed", "running")]
        assert run.jobs[0].superseded[0]["status"] == "lost"


def test_a_queued_job_is_not_called_lost_while_the_workers_outbox_holds_writes(db):
    # The worker ran the job while its database was away: start and finish wait in its outbox,
    # the row still says queued, and the worker sits idle. Not a lost message.
    from preheat.fleet.liveness import Pulse

    _beat("a@h", at=T0)
    run_id = _run_on("a@h")
    later = T0 + dt.timedelta(seconds=300)
    with session_scope() as session:
        registry.beat(session, "a@h", started_at=T0, ready=True, state={}, now=later)
    waiting = Pulses(**{"a@h": Pulse(later, T0, pending=2)})
    assert _reap_with(later, waiting, lost_message_after_s=30) == 0
    assert _jobs(run_id)[1]["a@h"][0] == JobStatus.queued
    drained = Pulses(**{"a@h": Pulse(later, T0, pending=0)})
    assert _reap_with(later, drained, lost_message_after_s=30) == 1
