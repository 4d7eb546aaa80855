"""Postgres away, stalled or cut: warmups go on, no record is lost, no false verdict, and a
lost message is settled within its bound."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from preheat.core import processes
from preheat.history.db import session_scope, utcnow
from preheat.history.models import JobStatus
from tests.faults.common import WORKER, _latest_run_id, _warm_and_wait, _worker_ready, _worker_state

pytestmark = pytest.mark.slow


OUTAGE_S = 30.0


def _outbox_entries(path: Path) -> list[tuple[str, str]]:
    import sqlite3

    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return db.execute("SELECT id, kind FROM entries ORDER BY seq").fetchall()


def test_postgres_away_for_30_s_warmups_go_on_and_no_record_is_lost(services_stack, tiny_model, tmp_path):
    """The worker reaches Postgres through a proxy the test cuts for 30 s; the CLI and the
    test reach it directly, so runs can be dispatched meanwhile (a partition between the
    worker and the database)."""
    from preheat.celery.app import create_app
    from preheat.core.settings import load_settings
    from preheat.history import service
    from preheat.history.models import AppliedWrite, RunStatus, TrafficCount
    from tests.conftest import write_catalog
    from tests.tcp_proxy import TcpProxy

    stack = services_stack
    write_catalog(
        stack.catalog.parent,
        tiny_model,
        '\n[templates.summarise]\nmodel = "tiny"\nsystem_prompt = "Summarise the text in one sentence."\n',
    )
    proxy = TcpProxy("127.0.0.1", 5432).start()
    real_url = stack.env["PREHEAT_DATABASE_URL"]
    # Dead after 60 s, heartbeats each second: as in production (45 s, 10 s), the outage
    # is shorter than the bound, so no reaper calls the worker's jobs lost meanwhile.
    stack.env.update(PREHEAT_WORKER_DEAD_AFTER_S="60")
    worker_env = {**stack.env, "PREHEAT_DATABASE_URL": real_url.replace(":5432/", f":{proxy.port}/")}
    worker = processes.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    outbox_path = stack.home / "outbox" / "gpu0_faults-test.sqlite3"
    client = create_app(load_settings(broker_url=stack.env["PREHEAT_BROKER_URL"]))
    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        processes.poll(lambda: _worker_ready(), 60, what="the worker registered ready")

        proxy.cut()
        cut_at = utcnow()
        runs = []
        for _ in range(3):
            dispatched = stack.cli("warm", "--json")
            assert dispatched.returncode == 0, dispatched.stderr
            runs.append(uuid.UUID(json.loads(dispatched.stdout)["id"]))
        answers = [
            client.send_task(
                "preheat.infer", kwargs={"template": "support", "user_input": f"parcel {n}", "max_tokens": 2}
            )
            for n in range(5)
        ]
        assert all(answer.get(timeout=60)["cached_tokens"] > 0 for answer in answers)  # served meanwhile
        # 3 runs x (a start + 2 finishes), and the 5 requests' counts, wait on the worker's disk.
        kept = processes.poll(
            lambda: (
                (e := _outbox_entries(outbox_path))
                and sum(kind.startswith("job.") for _, kind in e) == 9
                and "traffic" in {k for _, k in e}
                and e
            ),
            60,
            what="the worker's writes kept in its outbox",
        )
        with session_scope() as session:
            statuses = {job.status for run_id in runs for job in service.get_run(session, run_id).jobs}
        assert statuses == {JobStatus.queued}, "nothing reached the database while it was away"
        metrics = httpx.get(f"{processes.health_url(worker)}/metrics", timeout=10).text
        pending = float(re.search(r"^preheat_outbox_pending (\S+)$", metrics, re.MULTILINE).group(1))
        assert pending >= 9  # the worker's /metrics says what waits (and traffic counts may be adding)
        time.sleep(max(0.0, OUTAGE_S - (utcnow() - cut_at).total_seconds()))
        kept = _outbox_entries(outbox_path)  # everything the outage left, to be counted
        proxy.restore()
        back_at = utcnow()

        def all_written():
            with session_scope() as session:
                done = [service.get_run(session, run_id) for run_id in runs]
                return done if all(run.status == RunStatus.succeeded for run in done) else None

        done = processes.poll(all_written, 60, what="the runs written once Postgres was back")
        processes.poll(lambda: not _outbox_entries(outbox_path), 30, what="the outbox emptied")
        # The worker's heartbeat says so too (`preheat workers` shows the outbox).
        processes.poll(
            lambda: _worker_state().get("outbox") == {"pending": 0, "dead": 0},
            30,
            what="the heartbeat showing an empty outbox",
        )
    proxy.close()
    jobs = [job for run in done for job in run.jobs]
    assert len(jobs) == 6 and {job.status for job in jobs} == {JobStatus.warm}
    # Written with the times they happened, during the outage, and what they measured.
    assert all(cut_at <= job.started_at <= job.finished_at < back_at for job in jobs)
    assert all(
        job.prefill_ms is not None and job.ttft_cold_ms and job.ttft_warm_ms and job.cached_tokens for job in jobs
    )
    with session_scope() as session:
        applied = set(session.scalars(select(AppliedWrite.id)))
        assert {uuid.UUID(entry_id) for entry_id, _ in kept} <= applied, "an outbox entry was lost"
        assert session.scalar(select(func.sum(TrafficCount.requests))) == 5


def test_a_stalled_postgres_never_blocks_a_worker(services_stack, tmp_path):
    """The worker's Postgres connections stay open and no byte moves (a frozen server, a
    partition that keeps TCP up), the same for new ones; the CLI reaches Postgres directly.
    Before, a warmup hung on its first history write for the whole stall. Now each write is
    bounded (PREHEAT_DB_TIMEOUT_S): it waits in the outbox and the warmup goes on."""
    from preheat.celery.app import create_app
    from preheat.core.settings import load_settings
    from preheat.history import service
    from preheat.history.models import RunStatus
    from tests.tcp_proxy import TcpProxy

    stack = services_stack
    proxy = TcpProxy("127.0.0.1", 5432).start()
    worker_env = {
        **stack.env,
        "PREHEAT_DATABASE_URL": stack.env["PREHEAT_DATABASE_URL"].replace(":5432/", f":{proxy.port}/"),
        "PREHEAT_DB_TIMEOUT_S": "3",
    }
    worker = processes.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    outbox_path = stack.home / "outbox" / "gpu0_faults-test.sqlite3"
    client = create_app(load_settings(broker_url=stack.env["PREHEAT_BROKER_URL"]))
    try:
        with processes.running(worker):
            processes.wait_for_log(worker, f"{WORKER} ready.", 90)
            processes.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
            proxy.stall()
            stalled_at = time.monotonic()
            # Waits and reaps while the worker's database stalls for longer than the dead-after
            # bound (5 s here): the worker's pulse through Redis keeps its jobs from being lost.
            waiting = _warm_and_wait(stack)
            # The CLI's own start under a full suite's load (compiles beside it) took over 30 s once.
            run_id = processes.poll(lambda: _latest_run_id(), 90, what="the run recorded")
            answer = client.send_task(
                "preheat.infer", kwargs={"template": "support", "user_input": "parcel", "max_tokens": 2}
            )
            assert answer.get(timeout=60)["cached_tokens"] > 0  # served during the stall
            # The whole warmup is done, its start and finish kept on disk, while Postgres still stalls.
            processes.poll(
                lambda: (
                    [kind for _, kind in _outbox_entries(outbox_path) if kind.startswith("job.")]
                    == ["job.start", "job.finish"]
                ),
                90,
                what="the warmup finished and recorded in the outbox during the stall",
            )
            with session_scope() as session:
                assert {job.status for job in service.get_run(session, run_id).jobs} == {JobStatus.queued}
            time.sleep(max(0.0, 15.0 - (time.monotonic() - stalled_at)))  # 3x the dead-after bound
            assert waiting.poll() is None, "the wait ended while the worker's writes were still away"
            proxy.unstall()
            out, err = waiting.communicate(timeout=180)
            assert waiting.returncode == 0, out + err
            reported = json.loads(out)
            assert [job["status"] for job in reported["jobs"]] == ["warm"] and reported["status_changes"] == []

            def written():
                with session_scope() as session:
                    run = service.get_run(session, run_id)
                    return run if run.status == RunStatus.succeeded else None

            run = processes.poll(written, 60, what="the run written once Postgres moved again")
            processes.poll(lambda: not _outbox_entries(outbox_path), 30, what="the outbox emptied")
        log = worker.log()
    finally:
        proxy.close()
    assert {job.status for job in run.jobs} == {JobStatus.warm}
    assert "kept in the outbox" in log


def test_a_postgres_cut_longer_than_dead_after_gives_no_verdict(services_stack, tmp_path):
    """The worker's database is cut for three times the dead-after bound while `preheat warm
    --wait` (which reaches Postgres directly) waits and reaps. The worker's heartbeat row goes
    stale, but its pulse through Redis does not: nothing is called lost, and the command
    reports what the worker measured once its outbox is written (before: 9 finished jobs
    `lost`, exit 1, the runs' finished_at the reaper's time)."""
    from tests.tcp_proxy import TcpProxy

    stack = services_stack
    proxy = TcpProxy("127.0.0.1", 5432).start()
    worker_env = {
        **stack.env,
        "PREHEAT_DATABASE_URL": stack.env["PREHEAT_DATABASE_URL"].replace(":5432/", f":{proxy.port}/"),
    }
    worker = processes.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    try:
        with processes.running(worker):
            processes.wait_for_log(worker, f"{WORKER} ready.", 90)
            processes.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
            proxy.cut()
            waiting = _warm_and_wait(stack)
            time.sleep(3 * 5.0)  # three times PREHEAT_WORKER_DEAD_AFTER_S: its row is stale by then
            assert waiting.poll() is None, "the wait ended while the worker's writes were still away"
            proxy.restore()
            out, err = waiting.communicate(timeout=180)
    finally:
        proxy.close()
    assert waiting.returncode == 0, out + err
    run = json.loads(out)
    assert run["status"] == "succeeded" and run["status_changes"] == []
    assert all(job["status"] == "warm" and job["superseded"] == [] for job in run["jobs"]), run["jobs"]
    assert run["finished_at"] == max(job["finished_at"] for job in run["jobs"])  # its last job's, not a reaper's


def test_a_job_whose_message_was_lost_is_settled_within_the_bound(services_stack, tmp_path):
    """A run recorded whose message never reaches the worker (lost in a Redis restart
    without persistence): the worker is live, beating and idle, so the job is `lost`, with
    the reason, within PREHEAT_LOST_MESSAGE_AFTER_S, and `preheat warm --wait` would not wait
    for ever."""
    from preheat.history import service
    from preheat.history.models import RunStatus, TriggerKind

    stack = services_stack
    env = {**stack.env, "PREHEAT_LOST_MESSAGE_AFTER_S": "3"}
    worker = processes.start_worker(WORKER, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        processes.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
        with session_scope() as session:  # what dispatch records; its message is the one lost
            run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
            service.add_jobs(session, run, target=WORKER, model_templates=[("tiny", "support")], task_id="lost-msg")
            run_id = run.id

        def settled():
            with session_scope() as session:
                found = service.get_run(session, run_id)
                return found if found.status != RunStatus.queued else None

        run = processes.poll(settled, 60, what="the job with the lost message settled")
    [job] = run.jobs
    assert (run.status, job.status) == (RunStatus.failed, JobStatus.lost)
    assert job.error.startswith(f"message lost: worker {WORKER} was live and idle for ")
