"""Redis restarted under workers, beat and the pod watcher: a Redis of our own (TLS, a password
with URL characters in it) stopped and started at will; nothing lost, nothing sent twice, the
password never written where people read."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from sqlalchemy import select

from preheat.cli.bench.beat import minutely_lead_for
from preheat.core import processes
from preheat.history.db import session_scope, utcnow
from preheat.history.models import JobStatus, ScheduleSlot, SlotStatus, WarmupJob, WarmupRun
from tests.conftest import PREHEAT_CLI
from tests.faults.common import HANDBOOK, WORKER

pytestmark = pytest.mark.slow


class TlsRedis:
    """redis-server on a free port, TLS only, with a password; stopped and started at will."""

    def __init__(self, folder: Path) -> None:
        from preheat.cli.bench.connect import make_tls

        self.folder, self.tls, self.port = folder, make_tls(folder / "tls"), processes.free_port()
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
        processes.poll(lambda: _pings(client), 10, every_s=0.05, what="redis-server up")

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
    from preheat.schedules import store

    stack = services_stack
    stack.env.update(PREHEAT_BROKER_URL=tls_redis.url, PREHEAT_BEAT_TICK_S="0.5", PREHEAT_BEAT_LEASE_S="3")
    worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    beat = processes.start(
        "beat", processes.celery_command("beat", "--loglevel=INFO"), stack.env, tmp_path / "logs", cwd=stack.home
    )
    with processes.running(worker, beat):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        # TLS and a password with URL characters, end to end.
        warmed = stack.cli("warm", "--wait", "--json", "--timeout", "60")
        assert warmed.returncode == 0, warmed.stderr

        # A pickled message on the worker's own queue is refused, said so, and never run.
        from preheat.celery.app import create_app
        from preheat.celery.queues import worker_queue
        from preheat.core.settings import load_settings

        sender = create_app(load_settings(broker_url=tls_redis.url))
        pickled = sender.send_task(
            "preheat.warm_worker",
            kwargs={"run_id": str(uuid.uuid4()), "worker": WORKER, "templates": ["support"]},
            queue=worker_queue(WORKER),
            serializer="pickle",
        )
        processes.wait_for_log(worker, "Refusing to deserialize untrusted content of type pickle", 30)

        # Arguments that do not fit the task's schema: its job fails with the reason, nothing runs.
        from preheat.history import service
        from preheat.history.models import TriggerKind

        task_id = str(uuid.uuid4())
        with session_scope() as session:
            run = service.create_run(session, trigger=TriggerKind.manual, requested_by="test")
            service.add_jobs(session, run, target=WORKER, model_templates=[("tiny", "support")], task_id=task_id)
            bad_run = run.id
        sender.send_task(
            "preheat.warm_worker",
            task_id=task_id,
            queue=worker_queue(WORKER),
            kwargs={"run_id": str(bad_run), "worker": WORKER, "templates": ["support"], "only_if_cold": "yes"},
        )

        def refused():
            with session_scope() as session:
                [job] = service.get_run(session, bad_run).jobs
                return job if job.status == JobStatus.failed else None

        refused_job = processes.poll(refused, 30, what="the job of the bad message failed")
        assert "only_if_cold" in refused_job.error and refused_job.started_at is None

        # A slot comes due while Redis is down: recorded `unsent` with why, sent once it is back.
        processes.wait_for_log(beat, "leads")
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
        unsent = processes.poll(
            lambda: (row := _slot("through-outage")) and row.status == SlotStatus.unsent and row,
            30,
            what="the slot recorded unsent",
        )
        assert "broker unreachable" in unsent.error
        time.sleep(1.5)  # a few more ticks with the broker away: still one slot, still unsent
        tls_redis.start()
        sent = processes.poll(
            lambda: (row := _slot("through-outage")) and row.status == SlotStatus.sent and row,
            60,
            what="the slot sent after the restart",
        )
        assert sent.attempts >= 2 and sent.run_id is not None

        def run_done():
            with session_scope() as session:
                jobs = session.scalars(select(WarmupJob).where(WarmupJob.run_id == sent.run_id)).all()
                return jobs if jobs and all(job.status.is_final for job in jobs) else None

        [job] = processes.poll(run_done, 60, what="the worker, reconnected, running the slot's warmup")
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
    from preheat.history.models import TriggerKind
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
    watcher = processes.start("watch-workers", [PREHEAT_CLI, "watch-workers"], stack.env, logs, cwd=stack.home)
    worker = processes.start_worker(WORKER, stack.env, logs, cwd=stack.home)
    with processes.running(watcher, worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        processes.poll(
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
        processes.poll(
            lambda: (job := _job_of(run_id, "handbook")) and job.status == JobStatus.running,
            60,
            every_s=0.05,
            what="the warmup running",
        )
        tls_redis.stop()
        redis_gone_at = utcnow()
        time.sleep(2)
        tls_redis.start()
        job = processes.poll(
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
        processes.poll(
            lambda: watcher.log().count("watching for workers coming online") >= 2, 60, what="the watcher reconnected"
        )
        second = processes.start_worker("gpu1@faults-test", stack.env, logs / "second", cwd=stack.home)
        with processes.running(second):
            [_late] = processes.poll(
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
    from preheat.history.models import TriggerKind
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
    watcher = processes.start(
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
        with processes.running(watcher):
            processes.wait_for_log(watcher, "listed 0 pod(s)", 60)
            tls_redis.stop()
            kube.apply(pod("pod-a", "uid-a", ready=True, since="2026-11-30T08:00:00Z"))
            processes.wait_for_log(watcher, "its warmup could not be sent", 60)
            time.sleep(1.5)  # a retry or two with the broker still away
            tls_redis.start()

            def pod_runs():
                with session_scope() as session:
                    return session.scalars(select(WarmupRun).where(WarmupRun.trigger == TriggerKind.pod_event)).all()

            [run] = processes.poll(pod_runs, 60, what="the pod's warmup sent after the restart")
            time.sleep(2)  # and nothing more
            assert len(pod_runs()) == 1
        assert run.trigger_key == "pod:uid-a:2026-11-30T08:00:00Z"
        assert "retrying in" in watcher.log()
    finally:
        kube.stop()
