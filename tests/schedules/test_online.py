"""`preheat watch-workers`: a worker coming online (new or restarted) gets one warmup run with
trigger worker_online; templates its start-up warmup made warm are `skipped`, not pre-filled again."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from preheat import procs
from preheat.db import session_scope
from preheat.models import JobStatus, TriggerKind, WarmupRun
from tests.conftest import PREHEAT_CLI

pytestmark = pytest.mark.slow

WORKER = "gpu0@online-test"


def online_runs() -> list[WarmupRun]:
    from preheat import history

    with session_scope() as session:
        ids = session.scalars(
            select(WarmupRun.id).where(WarmupRun.trigger == TriggerKind.worker_online).order_by(WarmupRun.created_at)
        ).all()
        return [history.get_run(session, run_id) for run_id in ids]


def settled_runs(count: int):
    runs = online_runs()
    return runs if len(runs) >= count and all(j.status.is_final for r in runs for j in r.jobs) else None


def test_a_worker_coming_online_is_warmed_once_per_start_even_with_two_watchers(services_stack, tmp_path):
    stack = services_stack
    watchers = [
        procs.start(f"watch-workers-{i}", [PREHEAT_CLI, "watch-workers"], stack.env, tmp_path / "logs", cwd=stack.home)
        for i in (1, 2)
    ]
    with procs.running(*watchers):
        for watcher in watchers:
            procs.wait_for_log(watcher, "watching for workers coming online")
        worker = procs.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
        with procs.running(worker):
            procs.wait_for_log(worker, f"{WORKER} ready.", 90)
            [first] = procs.poll(lambda: settled_runs(1), 60, what="the worker_online run")
        # Restarted under the same name: a new start, a new run.
        worker = procs.start_worker(WORKER, stack.env, tmp_path / "logs/again", cwd=stack.home)
        with procs.running(worker):
            procs.wait_for_log(worker, f"{WORKER} ready.", 90)
            runs = procs.poll(lambda: settled_runs(2), 60, what="the second worker_online run")
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
