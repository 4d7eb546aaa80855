"""`preheat watch-workers`: a worker coming online (new or restarted) gets one warmup run with
trigger worker_online; templates its start-up warmup made warm are `skipped`, not pre-filled again."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from preheat.core import processes
from preheat.history.db import session_scope
from preheat.history.models import JobStatus, TriggerKind, WarmupRun
from tests.conftest import PREHEAT_CLI

pytestmark = pytest.mark.slow

WORKER = "gpu0@online-test"


def online_runs() -> list[WarmupRun]:
    from preheat.history import service

    with session_scope() as session:
        ids = session.scalars(
            select(WarmupRun.id).where(WarmupRun.trigger == TriggerKind.worker_online).order_by(WarmupRun.created_at)
        ).all()
        return [service.get_run(session, run_id) for run_id in ids]


def settled_runs(count: int):
    runs = online_runs()
    return runs if len(runs) >= count and all(j.status.is_final for r in runs for j in r.jobs) else None


def test_a_worker_coming_online_is_warmed_once_per_start_even_with_two_watchers(services_stack, tmp_path):
    stack = services_stack
    watchers = [
        processes.start(
            f"watch-workers-{i}", [PREHEAT_CLI, "watch-workers"], stack.env, tmp_path / "logs", cwd=stack.home
        )
        for i in (1, 2)
    ]
    with processes.running(*watchers):
        for watcher in watchers:
            processes.wait_for_log(watcher, "watching for workers coming online")
        worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
        with processes.running(worker):
            processes.wait_for_log(worker, f"{WORKER} ready.", 90)
            [first] = processes.poll(lambda: settled_runs(1), 60, what="the worker_online run")
        # Restarted under the same name: a new start, a new run.
        worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs/again", cwd=stack.home)
        with processes.running(worker):
            processes.wait_for_log(worker, f"{WORKER} ready.", 90)
            runs = processes.poll(lambda: settled_runs(2), 60, what="the second worker_online run")
        logs = "".join(watcher.log() for watcher in watchers)
    assert len(runs) == 2 and runs[0].id == first.id  # two watchers, two starts: two runs
    for run in runs:
        assert run.trigger_detail["worker"] == WORKER and run.requested_by == "watch-workers"
        [job] = run.jobs
        # The start-up warmup had pre-filled the template: checked, not done twice.
        assert (job.target, job.template, job.status) == (WORKER, "support", JobStatus.skipped), job.error
    assert runs[0].trigger_detail["pid"] != runs[1].trigger_detail["pid"]
    assert "warmed already by run" in logs  # the second watcher found the first one's run
    assert "Traceback" not in logs, logs[-3000:]


def test_a_worker_started_while_the_watcher_is_down_is_warmed_once_when_it_comes_back(services_stack, tmp_path):
    stack = services_stack
    worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)  # its worker-online event went unheard
        sweeping = [PREHEAT_CLI, "watch-workers", "--sweep-s", "1"]
        watcher = processes.start("watch-workers", sweeping, stack.env, tmp_path / "logs", cwd=stack.home)
        with processes.running(watcher):
            [run] = processes.poll(lambda: settled_runs(1), 60, what="the swept worker's run")
            processes.wait_for_log(watcher, "watching for workers coming online")
            time.sleep(3)  # three more sweeps: the start has its run, nothing more is sent
        # The watcher restarted: its first sweep finds the run of this start, and sends nothing.
        again = processes.start("watch-workers-again", sweeping, stack.env, tmp_path / "logs/again", cwd=stack.home)
        with processes.running(again):
            processes.wait_for_log(again, "watching for workers coming online")
            time.sleep(2)
        logs = watcher.log() + again.log()
    assert [r.id for r in online_runs()] == [run.id]
    assert run.trigger_detail["seen_by"] == "sweep" and run.trigger_detail["worker"] == WORKER
    assert run.trigger_key.startswith(f"worker_online:{WORKER}:")
    [job] = run.jobs
    assert (job.target, job.status) == (WORKER, JobStatus.skipped), job.error  # warm from its own start
    assert "Traceback" not in logs, logs[-3000:]
