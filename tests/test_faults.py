"""Faults and security across processes: a Redis of our own (TLS, a password with URL
characters in it) restarted while a worker and beat run; a pickled message sent to a worker;
the password never written where people read."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import redis
from sqlalchemy import func, select

from preheat import procs
from preheat.cli.bench.beat import minutely_lead_for
from preheat.db import session_scope, utcnow
from preheat.models import JobStatus, ScheduleSlot, SlotStatus, WarmupJob, WarmupRun
from tests.conftest import PREHEAT_CLI

pytestmark = pytest.mark.slow

WORKER = "gpu0@faults-test"
# A system prompt of about 3,000 tokens: a long prefill for the tiny model.
HANDBOOK = " ".join(
    f"Rule {n}: a parcel late by {n % 7 + 2} working days is investigated, and the customer is "
    f"told the outcome within {n % 5 + 1} days."
    for n in range(85)
)


class TlsRedis:
    """redis-server on a free port, TLS only, with a password; stopped and started at will."""

    def __init__(self, folder: Path) -> None:
        from preheat.cli.bench.connect import make_tls

        self.folder, self.tls, self.port = folder, make_tls(folder / "tls"), procs.free_port()
        self.password = f"p@ss:w/rd%{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (
            f"rediss://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(self.tls['ca']), safe='')}"
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(self.tls["cert"]),
                "--tls-key-file",
                str(self.tls["key"]),
                "--tls-ca-cert-file",
                str(self.tls["ca"]),
                "--tls-auth-clients",
                "no",
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, ssl=True, ssl_ca_certs=str(self.tls["ca"])
        )
        procs.poll(lambda: _pings(client), 10, every_s=0.05, what="redis-server up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False


@pytest.fixture
def tls_redis(tmp_path):
    server = TlsRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def _slot(name: str) -> ScheduleSlot | None:
    with session_scope() as session:
        return session.scalars(select(ScheduleSlot).where(ScheduleSlot.schedule_name == name)).first()


def test_redis_restarted_under_a_worker_and_beat_loses_no_slot_and_leaks_no_password(
    services_stack, tls_redis, tmp_path
):
    from schedules import store

    stack = services_stack
    stack.env.update(PREHEAT_BROKER_URL=tls_redis.url, PREHEAT_BEAT_TICK_S="0.5", PREHEAT_BEAT_LEASE_S="3")
    worker = procs.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    beat = procs.start(
        "beat", procs.celery_command("beat", "--loglevel=INFO"), stack.env, tmp_path / "logs", cwd=stack.home
    )
    with procs.running(worker, beat):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        # TLS and a password with URL characters, end to end.
        warmed = stack.cli("warm", "--wait", "--json", "--timeout", "60")
        assert warmed.returncode == 0, warmed.stderr

        # A pickled message on the worker's own queue is refused, said so, and never run.
        from preheat.celery import create_app, worker_queue
        from preheat.settings import load_settings

        sender = create_app(load_settings(broker_url=tls_redis.url))
        pickled = sender.send_task(
            "preheat.warm_worker",
            kwargs={"run_id": str(uuid.uuid4()), "worker": WORKER, "templates": ["support"]},
            queue=worker_queue(WORKER),
            serializer="pickle",
        )
        procs.wait_for_log(worker, "Refusing to deserialize untrusted content of type pickle", 30)

        # Arguments that do not fit the task's schema: its job fails with the reason, nothing runs.
        from preheat import history
        from preheat.models import TriggerKind

        task_id = str(uuid.uuid4())
        with session_scope() as session:
            run = history.create_run(session, trigger=TriggerKind.manual, requested_by="test")
            history.add_jobs(session, run, target=WORKER, model_templates=[("tiny", "support")], task_id=task_id)
            bad_run = run.id
        sender.send_task(
            "preheat.warm_worker",
            task_id=task_id,
            queue=worker_queue(WORKER),
            kwargs={"run_id": str(bad_run), "worker": WORKER, "templates": ["support"], "only_if_cold": "yes"},
        )

        def refused():
            with session_scope() as session:
                [job] = history.get_run(session, bad_run).jobs
                return job if job.status == JobStatus.failed else None

        refused_job = procs.poll(refused, 30, what="the job of the bad message failed")
        assert "only_if_cold" in refused_job.error and refused_job.started_at is None

        # A slot comes due while Redis is down: recorded `unsent` with why, sent once it is back.
        procs.wait_for_log(beat, "leads")
        fire_at = utcnow() + dt.timedelta(seconds=6)
        with session_scope() as session:
            store.add(
                session,
                name="through-outage",
                cron="* * * * *",
                timezone="UTC",
                targets={"templates": ["support"], "workers": [WORKER]},
                lead_time_s=minutely_lead_for(fire_at),
            )
        tls_redis.stop()
        unsent = procs.poll(
            lambda: (row := _slot("through-outage")) and row.status == SlotStatus.unsent and row,
            30,
            what="the slot recorded unsent",
        )
        assert "broker unreachable" in unsent.error
        time.sleep(1.5)  # a few more ticks with the broker away: still one slot, still unsent
        tls_redis.start()
        sent = procs.poll(
            lambda: (row := _slot("through-outage")) and row.status == SlotStatus.sent and row,
            60,
            what="the slot sent after the restart",
        )
        assert sent.attempts >= 2 and sent.run_id is not None

        def run_done():
            with session_scope() as session:
                jobs = session.scalars(select(WarmupJob).where(WarmupJob.run_id == sent.run_id)).all()
                return jobs if jobs and all(job.status.is_final for job in jobs) else None

        [job] = procs.poll(run_done, 60, what="the worker, reconnected, running the slot's warmup")
        assert job.status in (JobStatus.warm, JobStatus.skipped), job.error
        worker_log, beat_log = worker.log(), beat.log()
    assert f"preheat.warm_worker[{pickled.id}] received" not in worker_log
    with session_scope() as session:
        runs = session.scalars(select(WarmupRun)).all()
        assert [r.trigger_detail.get("schedule") for r in runs].count("through-outage") == 1
        recorded = " ".join(f"{r.trigger_detail} {r.requested_by} {r.trigger_key}" for r in runs)
        recorded += " ".join(str(j.error) for j in session.scalars(select(WarmupJob)))
        recorded += " ".join(str(s.error) for s in session.scalars(select(ScheduleSlot)))
    for secret in (tls_redis.password, quote(tls_redis.password, safe="")):
        for where, text in (
            ("worker log", worker_log),
            ("beat log", beat_log),
            ("history", recorded),
            ("CLI", warmed.stdout + warmed.stderr),
        ):
            assert secret not in text, f"the Redis password appears in the {where}"


def _job_of(run_id: uuid.UUID, template: str) -> WarmupJob | None:
    with session_scope() as session:
        return session.scalars(
            select(WarmupJob).where(WarmupJob.run_id == run_id, WarmupJob.template == template)
        ).first()


def _runs_for(trigger, worker: str) -> list[WarmupRun]:
    from sqlalchemy.orm import selectinload

    with session_scope() as session:
        runs = session.scalars(
            select(WarmupRun).where(WarmupRun.trigger == trigger).options(selectinload(WarmupRun.jobs))
        )
        return [run for run in runs if run.trigger_detail.get("worker") == worker]


def test_redis_restarted_mid_warmup_the_run_finishes_and_worker_and_watcher_reconnect(
    services_stack, tls_redis, tiny_model, tmp_path
):
    """Redis (no persistence, as the tests' own) goes away while a warmup runs: the warmup
    finishes and is recorded (history is in Postgres), the worker takes new warmups once
    Redis is back, and `preheat watch-workers` reconnects and sees the next worker start."""
    from preheat.models import TriggerKind
    from tests.conftest import write_catalog

    stack = services_stack
    (stack.catalog.parent / "handbook.txt").write_text(HANDBOOK)
    write_catalog(
        stack.catalog.parent,
        tiny_model,
        '\n[templates.handbook]\nmodel = "tiny"\nsystem_prompt_file = "handbook.txt"\n',
    )
    # A 3,000-token prompt: its prefill and probes take seconds, long enough to pull Redis out
    # from under the warmup (the test stops Redis within 50 ms of seeing the job running).
    stack.env.update(PREHEAT_BROKER_URL=tls_redis.url)
    logs = tmp_path / "logs"
    watcher = procs.start("watch-workers", [PREHEAT_CLI, "watch-workers"], stack.env, logs, cwd=stack.home)
    worker = procs.start_worker(WORKER, stack.env, logs, cwd=stack.home)
    with procs.running(watcher, worker):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        procs.poll(
            lambda: (
                (runs := _runs_for(TriggerKind.worker_online, WORKER))
                and all(job.status.is_final for run in runs for job in run.jobs)
            ),
            90,
            what="the start-up run",
        )

        dispatched = stack.cli("warm", "-t", "handbook", "--json")
        assert dispatched.returncode == 0, dispatched.stderr
        run_id = uuid.UUID(json.loads(dispatched.stdout)["id"])
        procs.poll(
            lambda: (job := _job_of(run_id, "handbook")) and job.status == JobStatus.running,
            60,
            every_s=0.05,
            what="the warmup running",
        )
        tls_redis.stop()
        redis_gone_at = utcnow()
        time.sleep(2)
        tls_redis.start()
        job = procs.poll(
            lambda: (job := _job_of(run_id, "handbook")) and job.status.is_final and job,
            90,
            what="the warmup finished and recorded",
        )
        assert job.finished_at > redis_gone_at  # it was still running when Redis went
        # Finished and recorded with what it measured (warm or, on a busy CPU, degraded against
        # the no-system-prompt floor: a 3,000-token prefix is not free to attend over).
        assert job.status in (JobStatus.warm, JobStatus.degraded) and job.cached_tokens > 2000, job.error

        # The worker is back on its queue: a warmup sent after the restart is done.
        again = stack.cli("warm", "-t", "support", "--wait", "--json", "--timeout", "90")
        assert again.returncode == 0, again.stdout + again.stderr
        # The watcher reconnected, and warms a worker that starts now.
        procs.poll(
            lambda: watcher.log().count("watching for workers coming online") >= 2, 60, what="the watcher reconnected"
        )
        second = procs.start_worker("gpu1@faults-test", stack.env, logs / "second", cwd=stack.home)
        with procs.running(second):
            [_late] = procs.poll(
                lambda: _runs_for(TriggerKind.worker_online, "gpu1@faults-test"),
                90,
                what="the new worker warmed by the reconnected watcher",
            )
        assert "reconnecting in" in watcher.log()
    with session_scope() as session:
        assert not session.scalars(select(WarmupJob).where(WarmupJob.status == JobStatus.running)).all()


def test_a_pod_ready_while_redis_is_down_is_warmed_once_redis_is_back(services_stack, tls_redis, tiny_model, tmp_path):
    """`preheat watch-pods` sees a pod turn Ready while the broker is away: the warmup is
    retried with backoff, and sent once (one run) when Redis is back."""
    from preheat.models import TriggerKind
    from tests.conftest import write_catalog
    from tests.schedules.fake_kube import FakeKube, pod

    stack = services_stack
    stack.env.update(PREHEAT_BROKER_URL=tls_redis.url)
    write_catalog(
        stack.catalog.parent,
        tiny_model,
        '\n[endpoints.vllm]\nbase_url = "http://vllm.serving.svc:8000/v1"\nmodel = "tiny"\ntemplates = ["support"]\n',
    )
    kube = FakeKube().start()
    watcher = procs.start(
        "watch-pods",
        [
            PREHEAT_CLI,
            "watch-pods",
            "--namespace",
            "serving",
            "--selector",
            "app=vllm",
            "--endpoint",
            "vllm",
            "--settle-s",
            "0",
            "--kubeconfig",
            kube.kubeconfig(tmp_path / "kubeconfig"),
        ],
        stack.env,
        tmp_path / "logs",
        cwd=stack.home,
    )
    try:
        with procs.running(watcher):
            procs.wait_for_log(watcher, "listed 0 pod(s)", 60)
            tls_redis.stop()
            kube.apply(pod("pod-a", "uid-a", ready=True, since="2026-11-30T08:00:00Z"))
            procs.wait_for_log(watcher, "its warmup could not be sent", 60)
            time.sleep(1.5)  # a retry or two with the broker still away
            tls_redis.start()

            def pod_runs():
                with session_scope() as session:
                    return session.scalars(select(WarmupRun).where(WarmupRun.trigger == TriggerKind.pod_event)).all()

            [run] = procs.poll(pod_runs, 60, what="the pod's warmup sent after the restart")
            time.sleep(2)  # and nothing more
            assert len(pod_runs()) == 1
        assert run.trigger_key == "pod:uid-a:2026-11-30T08:00:00Z"
        assert "retrying in" in watcher.log()
    finally:
        kube.stop()


# Postgres away ------------------------------------------------------------------------

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
    from preheat import history
    from preheat.celery import create_app
    from preheat.models import AppliedWrite, RunStatus, TrafficCount
    from preheat.settings import load_settings
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
    worker = procs.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    outbox_path = stack.home / "outbox" / "gpu0_faults-test.sqlite3"
    client = create_app(load_settings(broker_url=stack.env["PREHEAT_BROKER_URL"]))
    with procs.running(worker):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        procs.poll(lambda: _worker_ready(), 60, what="the worker registered ready")

        proxy.cut()
        cut_at = utcnow()
        runs = []
        for _ in range(3):
            dispatched = stack.cli("warm", "--json")
            assert dispatched.returncode == 0, dispatched.stderr
            runs.append(uuid.UUID(json.loads(dispatched.stdout)["id"]))
        answers = [
            client.send_task(
                "preheat.infer", kwargs={"template": "support", "user_input": f"parcel {n}", "max_new_tokens": 2}
            )
            for n in range(5)
        ]
        assert all(answer.get(timeout=60)["cached_tokens"] > 0 for answer in answers)  # served meanwhile
        # 3 runs x (a start + 2 finishes), and the 5 requests' counts, wait on the worker's disk.
        kept = procs.poll(
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
            statuses = {job.status for run_id in runs for job in history.get_run(session, run_id).jobs}
        assert statuses == {JobStatus.queued}, "nothing reached the database while it was away"
        metrics = httpx.get(f"{procs.health_url(worker)}/metrics", timeout=10).text
        pending = float(re.search(r"^preheat_outbox_pending (\S+)$", metrics, re.MULTILINE).group(1))
        assert pending >= 9  # the worker's /metrics says what waits (and traffic counts may be adding)
        time.sleep(max(0.0, OUTAGE_S - (utcnow() - cut_at).total_seconds()))
        kept = _outbox_entries(outbox_path)  # everything the outage left, to be counted
        proxy.restore()
        back_at = utcnow()

        def all_written():
            with session_scope() as session:
                done = [history.get_run(session, run_id) for run_id in runs]
                return done if all(run.status == RunStatus.succeeded for run in done) else None

        done = procs.poll(all_written, 60, what="the runs written once Postgres was back")
        procs.poll(lambda: not _outbox_entries(outbox_path), 30, what="the outbox emptied")
        # The worker's heartbeat says so too (`preheat workers` shows the outbox).
        procs.poll(
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
    from preheat import history
    from preheat.celery import create_app
    from preheat.models import RunStatus
    from preheat.settings import load_settings
    from tests.tcp_proxy import TcpProxy

    stack = services_stack
    proxy = TcpProxy("127.0.0.1", 5432).start()
    worker_env = {
        **stack.env,
        "PREHEAT_DATABASE_URL": stack.env["PREHEAT_DATABASE_URL"].replace(":5432/", f":{proxy.port}/"),
        "PREHEAT_DB_TIMEOUT_S": "3",
    }
    worker = procs.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    outbox_path = stack.home / "outbox" / "gpu0_faults-test.sqlite3"
    client = create_app(load_settings(broker_url=stack.env["PREHEAT_BROKER_URL"]))
    try:
        with procs.running(worker):
            procs.wait_for_log(worker, f"{WORKER} ready.", 90)
            procs.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
            proxy.stall()
            stalled_at = time.monotonic()
            # Waits and reaps while the worker's database stalls for longer than the dead-after
            # bound (5 s here): the worker's pulse through Redis keeps its jobs from being lost.
            waiting = _warm_and_wait(stack)
            run_id = procs.poll(lambda: _latest_run_id(), 30, what="the run recorded")
            answer = client.send_task(
                "preheat.infer", kwargs={"template": "support", "user_input": "parcel", "max_new_tokens": 2}
            )
            assert answer.get(timeout=60)["cached_tokens"] > 0  # served during the stall
            # The whole warmup is done, its start and finish kept on disk, while Postgres still stalls.
            procs.poll(
                lambda: (
                    [kind for _, kind in _outbox_entries(outbox_path) if kind.startswith("job.")]
                    == ["job.start", "job.finish"]
                ),
                90,
                what="the warmup finished and recorded in the outbox during the stall",
            )
            with session_scope() as session:
                assert {job.status for job in history.get_run(session, run_id).jobs} == {JobStatus.queued}
            time.sleep(max(0.0, 15.0 - (time.monotonic() - stalled_at)))  # 3x the dead-after bound
            assert waiting.poll() is None, "the wait ended while the worker's writes were still away"
            proxy.unstall()
            out, err = waiting.communicate(timeout=180)
            assert waiting.returncode == 0, out + err
            reported = json.loads(out)
            assert [job["status"] for job in reported["jobs"]] == ["warm"] and reported["status_changes"] == []

            def written():
                with session_scope() as session:
                    run = history.get_run(session, run_id)
                    return run if run.status == RunStatus.succeeded else None

            run = procs.poll(written, 60, what="the run written once Postgres moved again")
            procs.poll(lambda: not _outbox_entries(outbox_path), 30, what="the outbox emptied")
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
    worker = procs.start_worker(WORKER, worker_env, tmp_path / "logs", cwd=stack.home)
    try:
        with procs.running(worker):
            procs.wait_for_log(worker, f"{WORKER} ready.", 90)
            procs.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
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
    from preheat import history
    from preheat.models import RunStatus, TriggerKind

    stack = services_stack
    env = {**stack.env, "PREHEAT_LOST_MESSAGE_AFTER_S": "3"}
    worker = procs.start_worker(WORKER, env, tmp_path / "logs", cwd=stack.home)
    with procs.running(worker):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        procs.poll(lambda: _worker_ready(), 60, what="the worker registered ready")
        with session_scope() as session:  # what dispatch records; its message is the one lost
            run = history.create_run(session, trigger=TriggerKind.manual, requested_by="test")
            history.add_jobs(session, run, target=WORKER, model_templates=[("tiny", "support")], task_id="lost-msg")
            run_id = run.id

        def settled():
            with session_scope() as session:
                found = history.get_run(session, run_id)
                return found if found.status != RunStatus.queued else None

        run = procs.poll(settled, 60, what="the job with the lost message settled")
    [job] = run.jobs
    assert (run.status, job.status) == (RunStatus.failed, JobStatus.lost)
    assert job.error.startswith(f"message lost: worker {WORKER} was live and idle for ")


def _warm_and_wait(stack) -> subprocess.Popen:
    """`preheat warm --wait --json` in the background: it dispatches, then waits and reaps."""
    return subprocess.Popen(
        [PREHEAT_CLI, "warm", "--wait", "--json", "--timeout", "180"],
        env=stack.env,
        cwd=stack.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _latest_run_id():
    with session_scope() as session:
        return session.scalar(select(WarmupRun.id).order_by(WarmupRun.created_at.desc()).limit(1))


def _worker_ready() -> bool:
    return _worker_state().get("ready", False)


def _worker_state() -> dict:
    from preheat import registry

    with session_scope() as session:
        return next((record.state for record in registry.workers(session) if record.nodename == WORKER), {})


# Verified warm on long prompts ----------------------------------------------------------


def test_a_long_template_is_warm_on_a_healthy_worker(services_stack, tiny_model, tmp_path):
    """A ~3,000-token template on a healthy, idle worker is `warm` and `preheat warm --wait`
    exits 0 (it came out `degraded` every time, held to the no-system-prompt TTFT: attention
    over 3,000 cached tokens is real work, not coldness). That a worker slowed since its best
    is `degraded` is tested with exact numbers in tests/workers/test_warmup.py: end to end,
    a throttled worker's verdict moved with whatever else the 2-core machine ran."""
    from tests.conftest import write_catalog

    stack = services_stack
    (stack.catalog.parent / "handbook.txt").write_text(HANDBOOK)
    handbook = '\n[templates.handbook]\nmodel = "tiny"\nsystem_prompt_file = "handbook.txt"\n'
    write_catalog(stack.catalog.parent, tiny_model, handbook)
    # Factor 8, not production's 1.5: on a quiet machine a healthy warm probe is within 1.2x
    # of its fastest run, but three test processes on two cores were seen to make it 2.5x.
    env = {**stack.env, "PREHEAT_WARM_FACTOR": "8", "PREHEAT_PROBE_REPEATS": "3"}
    worker = procs.start_worker(WORKER, env, tmp_path / "logs", cwd=stack.home)
    with procs.running(worker):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        # Up to three warmups: a neighbour test's burst on the shared cores can make one
        # probe run 30x its fastest (seen in CI); on an idle machine the first is warm.
        for _ in range(3):
            healthy = stack.cli("warm", "--template", "handbook", "--wait", "--json")
            [job] = json.loads(healthy.stdout)["jobs"]
            assert job["cached_tokens"] > 2500 and job["status"] in ("warm", "degraded"), job
            if job["status"] == "warm":
                break
            assert "factor" in job["error"], job  # only timing may stand in its way
    assert healthy.returncode == 0 and job["status"] == "warm", healthy.stdout + healthy.stderr


# Out of memory -------------------------------------------------------------------------


def _vm_data_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) * 1024


def test_out_of_memory_during_prefill_is_recorded_and_the_worker_goes_on(embedded_stack, tiny_model, tmp_path):
    """A real allocator failure: the worker's data segment is capped (RLIMIT_DATA, what a
    container memory limit does to malloc) a little above what it uses, and a template's
    system prompt grows to thousands of tokens, whose prefill needs more than that."""
    import resource

    from tests.conftest import write_catalog

    stack = embedded_stack
    prompt = stack.catalog.parent / "handbook.txt"
    prompt.write_text("You answer questions about the parcel handbook.")
    write_catalog(
        stack.catalog.parent,
        tiny_model,
        '\n[templates.handbook]\nmodel = "tiny"\nsystem_prompt_file = "handbook.txt"\n',
    )
    worker = procs.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with procs.running(worker):
        procs.wait_for_log(worker, "Started consuming from preheat.infer.tiny", 90)
        prompt.write_text(HANDBOOK)  # edited: about 3,000 tokens now
        pid, unlimited = worker.popen.pid, resource.prlimit(worker.popen.pid, resource.RLIMIT_DATA)
        resource.prlimit(pid, resource.RLIMIT_DATA, (_vm_data_bytes(pid) + 48 * 2**20, unlimited[1]))

        capped = stack.cli("warm", "-t", "handbook", "-t", "support", "--wait", "--json", "--timeout", "120")
        assert capped.returncode == 1, capped.stderr
        jobs = {job["template"]: job for job in json.loads(capped.stdout)["jobs"]}
        assert jobs["handbook"]["status"] == "failed"
        assert "out of memory on cpu while running" in jobs["handbook"]["error"]
        assert "can't allocate memory" in jobs["handbook"]["error"]
        assert jobs["support"]["status"] == "warm"  # the other template, same task, after the failure

        # Still up, under the same cap: it answers a request, and says what is not ready.
        answered = stack.cli("infer", "support", "Where is my parcel?", "--max-tokens", "2", "--json")
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["cached_tokens"] > 0
        procs.poll(
            lambda: "out of memory" in " ".join(_worker_json(stack)["reasons"]),
            30,
            what="the worker's readiness naming the failed template",
        )

        # Memory back: the same warmup succeeds on the same process.
        resource.prlimit(pid, resource.RLIMIT_DATA, unlimited)
        recovered = stack.cli("warm", "-t", "handbook", "--wait", "--json", "--timeout", "120")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert json.loads(recovered.stdout)["jobs"][0]["cached_tokens"] > 2000
        assert worker.alive()
        assert _worker_json(stack)["reasons"] == []


def _worker_json(stack) -> dict:
    [worker] = json.loads(stack.cli("workers", "--json").stdout)
    return worker


# Secrets -------------------------------------------------------------------------------


def test_a_password_protected_postgres_url_works_from_the_environment_or_a_file(embedded_stack, tmp_path):
    """A cluster of our own that checks passwords (scram-sha-256); the password has URL
    characters in it, and '%', which Alembic's config would read as interpolation."""
    from tests.pg_cluster import PrivatePostgres

    stack = embedded_stack
    password = f"p@ss:w/rd%{uuid.uuid4().hex[:8]}"
    server = PrivatePostgres(password).start()
    try:
        by_env = {**stack.env, "PREHEAT_DATABASE_URL": server.url()}
        upgraded = subprocess.run(
            [PREHEAT_CLI, "db", "upgrade"], env=by_env, capture_output=True, text=True, timeout=120
        )
        assert upgraded.returncode == 0, upgraded.stderr

        # The same URL from a file (a mounted Kubernetes Secret), not the environment.
        secrets = tmp_path / "secrets"
        secrets.mkdir()
        (secrets / "preheat_database_url").write_text(server.url() + "\n")
        by_file = {**stack.env, "PREHEAT_SECRETS_DIR": str(secrets)}
        current = subprocess.run([PREHEAT_CLI, "db", "check"], env=by_file, capture_output=True, text=True, timeout=120)
        assert current.returncode == 0, current.stdout + current.stderr  # connected, migrated, no drift
        listed = subprocess.run([PREHEAT_CLI, "history"], env=by_file, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr

        # A wrong password: one line, the services' exit code, and no password shown.
        wrong = subprocess.run(
            [PREHEAT_CLI, "history"],
            env={**stack.env, "PREHEAT_DATABASE_URL": server.url(password + "x")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = wrong.stdout + wrong.stderr
        assert wrong.returncode == 5 and "password authentication failed" in said, said
        assert len(said.strip().splitlines()) == 1
        for shown in (upgraded, current, listed, wrong):
            assert password not in shown.stdout + shown.stderr
            assert quote(password, safe="") not in shown.stdout + shown.stderr
        missing = subprocess.run(
            [PREHEAT_CLI, "history"],
            env={**stack.env, "PREHEAT_SECRETS_DIR": "/nonexistent"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert missing.returncode == 2 and "PREHEAT_SECRETS_DIR" in missing.stdout + missing.stderr
    finally:
        server.stop()
