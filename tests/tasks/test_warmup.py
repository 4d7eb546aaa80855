"""End to end on real processes: a `celery worker` subprocess, the `preheat` CLI, and the
history database, on the embedded default and on Redis + Postgres."""

import json

import pytest

from preheat.core import processes
from preheat.history import service
from preheat.history.db import session_scope
from preheat.history.models import JobStatus, RunStatus, TriggerKind
from tests.throttle import cpu_share

pytestmark = pytest.mark.slow

WORKER = "w1@preheat-test"


@pytest.fixture
def worker(stack, tmp_path):
    proc = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(proc):
        processes.wait_for_log(proc, f"{WORKER} ready.")
        yield proc


def test_warm_wait_records_what_the_worker_measured_and_the_model_stays_resident(stack, worker):
    done = stack.cli("warm", "--wait", "--json", "--timeout", "120")
    assert done.returncode == 0, done.stderr + worker.log()[-3000:]
    printed = json.loads(done.stdout)
    assert printed["status"] == "succeeded" and printed["trigger"] == "manual"

    with session_scope() as session:
        run = service.find_run(session, printed["id"])
        assert run.status == RunStatus.succeeded and run.trigger == TriggerKind.manual
        assert run.requested_by and run.finished_at is not None
        [job] = run.jobs
    assert (job.target, job.model, job.template, job.status) == (WORKER, "tiny", "support", JobStatus.warm)
    assert job.device == "cpu/float32" and job.celery_task_id
    for column in ("load_ms", "prefill_ms", "ttft_cold_ms", "ttft_warm_ms", "ttft_bare_ms"):
        assert getattr(job, column) > 0, column
        assert printed["jobs"][0][column] == pytest.approx(getattr(job, column))  # the CLI shows the DB
    assert job.cached_tokens > 20 and job.cache_bytes > 0
    assert f"preheat.warm_worker[{job.celery_task_id}]" in worker.log()

    # The second warmup, of one template on one worker, finds the model resident and its prefix cached.
    second = stack.cli("warm", "--wait", "--json", "--template", "support", "--worker", WORKER)
    assert second.returncode == 0, second.stderr
    first_job, second_job = printed["jobs"][0], json.loads(second.stdout)["jobs"][0]
    assert second_job["load_ms"] == 0.0 and second_job["prefill_ms"] == 0.0
    assert second_job["cache_bytes"] == first_job["cache_bytes"]

    listing = stack.cli("history", "--json")
    assert [run["status"] for run in json.loads(listing.stdout)] == ["succeeded", "succeeded"]
    shown = stack.cli("history", json.loads(second.stdout)["id"][:8])
    assert shown.returncode == 0 and "support" in shown.stdout and "warm" in shown.stdout


def test_warm_fleet_reaches_the_worker_that_runs_it(stack, worker):
    """What beat sends: the dispatcher runs on a (solo) worker that cannot answer its own ping."""
    from preheat.celery.app import create_app
    from preheat.core.settings import get_settings

    app = create_app(get_settings())
    app.send_task(
        "preheat.warm_fleet",
        kwargs={
            "templates": ["support"],
            "trigger": "schedule",
            "detail": {"schedule": "morning"},
            "requested_by": "beat",
        },
    )
    processes.wait_for_log(worker, "preheat.warm_worker[", timeout_s=60)
    processes.wait_for_log(worker, "succeeded in", timeout_s=60)
    listing = stack.cli("history", "--trigger", "schedule", "--json")
    deadline_runs = json.loads(listing.stdout)
    assert len(deadline_runs) == 1
    run = deadline_runs[0]
    assert run["trigger_detail"] == {"schedule": "morning"} and run["requested_by"] == "beat"
    assert [job["target"] for job in run["jobs"]] == [WORKER]


def test_verdicts_hold_under_a_neighbours_load_and_catch_a_throttled_worker(embedded_stack, tmp_path, monkeypatch):
    """Twenty warmups with a CPU hog beside the worker half of the time, production's factor:
    none degraded (it was 172 of 200 runs, judged against an all-time best). Then the worker
    held to a fifth of one core by a CPU quota, as a container's limit holds it: degraded,
    saying so."""
    import subprocess
    import sys

    import preheat.fleet.dispatch
    from preheat.celery.app import create_app
    from preheat.cli.warm import wait_for_run
    from preheat.core.settings import get_settings

    # This stack's broker: the process-wide app may be an earlier test's (another home).
    monkeypatch.setattr(preheat.fleet.dispatch, "app", create_app(get_settings()))

    env = {
        **embedded_stack.env,
        "PREHEAT_WARM_FACTOR": "3",
        "PREHEAT_PROBE_REPEATS": "3",
        "PREHEAT_WORKER_DEAD_AFTER_S": "120",  # a throttled worker beats slowly, and is not dead
    }
    worker = processes.start_worker(WORKER, env, tmp_path / "logs", cwd=embedded_stack.home)

    def warm():
        dispatched = preheat.fleet.dispatch.dispatch_warmup(
            templates=["support"], workers=[WORKER], requested_by="verdict"
        )
        [job] = wait_for_run(dispatched.run_id, 90, show_progress=False).jobs
        return job

    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        hog, seen = None, []
        try:
            for i in range(20):
                if i % 2 and hog is None:
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                elif i % 2 == 0 and hog is not None:
                    hog.kill()
                    hog.wait()
                    hog = None
                job = warm()
                seen.append((i % 2 == 1, job.status, job.error, job.ttft_bare_ms))
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        assert [entry for entry in seen if entry[1] != JobStatus.warm] == [], seen

        with cpu_share(worker.popen.pid, 0.2):  # a fifth of one core: 5x slower at the least
            throttled = warm()
        recent = sorted(entry[3] for entry in seen)
        assert throttled.status == JobStatus.degraded, (throttled.ttft_bare_ms, recent)
        assert "this worker's recent self" in throttled.error and "over the warm factor 3" in throttled.error
