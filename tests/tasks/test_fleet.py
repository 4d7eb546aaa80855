"""The fleet on real processes, Redis and Postgres: one warmup reaches every worker, the
registry shows them, and a worker killed mid-warmup leaves no job running."""

from __future__ import annotations

import json
import time

import pytest

from preheat.core import processes
from preheat.history import service
from preheat.history.db import session_scope
from preheat.history.models import JobStatus, RunStatus, WarmupJob
from tests.conftest import write_catalog

pytestmark = pytest.mark.slow

W1, W2 = "w1@fleet-test", "w2@fleet-test"
# A long system prompt, so a warmup with many probe rounds lasts long enough to be killed.
LONG_PROMPT = " ".join(f"Rule {i}: answer parcel question {i} with the tracking record." for i in range(120))


def one_core_each(env: dict[str, str]) -> dict[str, str]:
    """Two workers on a 2-core machine, each with its share: with an OpenMP pool of 2 threads
    each they oversubscribe the cores, and a probe can take 10x its steady time (`degraded`)."""
    return {**env, "OMP_NUM_THREADS": "1"}


def _workers(stack) -> dict[str, dict]:
    listed = stack.cli("workers", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    return {worker["nodename"]: worker for worker in json.loads(listed.stdout)}


def _all_ready(stack, *names):
    workers = _workers(stack)
    return all(workers.get(name, {}).get("state") == "ready" for name in names) and workers


def test_one_warm_reaches_both_workers_and_history_matches_what_each_measured(services_stack, tmp_path):
    stack = services_stack
    env = one_core_each(stack.env)
    w1 = processes.start_worker(W1, env, tmp_path / "logs", cwd=stack.home)
    w2 = processes.start_worker(W2, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(w1, w2):
        processes.wait_for_log(w1, f"{W1} ready.")
        processes.wait_for_log(w2, f"{W2} ready.")
        workers = processes.poll(lambda: _all_ready(stack, W1, W2), 90, what="both workers ready")
        for name in (W1, W2):
            assert workers[name]["models"]["tiny"]["device"] == "cpu/float32"
            assert workers[name]["models"]["tiny"]["weight_loader"] == "safetensors"  # auto, on the CPU
            assert workers[name]["cache"]["entries"] == 1 and workers[name]["cache"]["bytes"] > 0
        table = stack.cli("workers")
        assert W1 in table.stdout and W2 in table.stdout and "ready" in table.stdout
        assert "tiny (cpu/float32, safetensors)" in table.stdout

        done = stack.cli("warm", "--wait", "--json", "--timeout", "120")
        assert done.returncode == 0, done.stderr + w1.log()[-2000:] + w2.log()[-2000:]
        run_id = json.loads(done.stdout)["id"]

        # Each worker reports, in its next heartbeats, what it measured at that warmup.
        def reported():
            listed = _workers(stack)
            return all("support" in listed[name]["last_warmup"] for name in (W1, W2)) and listed

        reported_by = processes.poll(reported, 10, what="workers reporting their warmup")

    with session_scope() as session:
        run = service.find_run(session, run_id)
        assert run.status == RunStatus.succeeded
        jobs = {job.target: job for job in run.jobs}
    assert sorted(jobs) == [W1, W2]
    for name, job in jobs.items():
        measured = reported_by[name]["last_warmup"]["support"]
        assert job.status == JobStatus.warm == measured["status"]
        for column in (
            "load_ms",
            "prefill_ms",
            "ttft_cold_ms",
            "ttft_warm_ms",
            "ttft_bare_ms",
            "cached_tokens",
            "cache_bytes",
        ):
            assert getattr(job, column) == pytest.approx(measured[column]), (name, column)
    # Two processes, two measurements: the rows are each worker's own, not one copied.
    assert jobs[W1].ttft_cold_ms != jobs[W2].ttft_cold_ms


def _job_of(run_id: str, target: str) -> WarmupJob:
    with session_scope() as session:
        return next(job for job in service.find_run(session, run_id).jobs if job.target == target)


def test_a_worker_killed_mid_warmup_leaves_no_job_running_and_its_replacement_warms_itself(
    services_stack, tmp_path, tiny_model
):
    write_catalog(
        tmp_path,
        tiny_model,
        f'\n[templates.long]\nmodel = "tiny"\nsystem_prompt = "{LONG_PROMPT}"\nprobe = "Where is it?"\n',
    )
    env = one_core_each({**services_stack.env, "PREHEAT_PROBE_REPEATS": "40"})
    stack = services_stack
    victim = processes.start_worker(W1, env, tmp_path / "logs", cwd=stack.home)
    witness = processes.start_worker(W2, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(victim, witness):
        processes.poll(lambda: _all_ready(stack, W1, W2), 120, what="both workers ready")
        queued = stack.cli("warm", "--worker", W1, "--template", "long", "--json")
        assert queued.returncode == 0, queued.stderr
        run_id = json.loads(queued.stdout)["id"]
        processes.poll(lambda: _job_of(run_id, W1).status == JobStatus.running, 60, what="the job running")

        processes.kill(victim)
        killed_at = time.monotonic()
        # Bound: the worker is dead after 5 s without a heartbeat; the witness reaps every 1 s.
        job = processes.poll(lambda: (j := _job_of(run_id, W1)).status.is_final and j, 30, what="the job settled")
        settled_after = time.monotonic() - killed_at
        assert job.status == JobStatus.lost and f"worker {W1} sent no heartbeat" in job.error
        assert settled_after < 5 + 1 + 5  # dead-after, one heartbeat, slack for a loaded machine
        with session_scope() as session:
            assert session.query(WarmupJob).filter(WarmupJob.status == JobStatus.running).count() == 0
            assert service.find_run(session, run_id).status == RunStatus.failed
        assert _workers(stack)[W1]["state"] == "dead"

        replacement = processes.start_worker(W1, env, tmp_path / "logs2", cwd=stack.home)
        with processes.running(replacement):
            workers = processes.poll(lambda: _all_ready(stack, W1), 120, what="the replacement ready")
            assert workers[W1]["cache"]["entries"] == 2  # both templates pre-filled at start
            assert workers[W1]["pid"] == replacement.popen.pid
