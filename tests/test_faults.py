"""Faults and security across processes: a Redis of our own (TLS, a password with URL
characters in it) restarted while a worker and beat run; a pickled message sent to a worker;
the password never written where people read."""

from __future__ import annotations

import datetime as dt
import socket
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from sqlalchemy import select

from preheat import procs
from preheat.cli.beatbench import minutely_lead_for
from preheat.db import session_scope, utcnow
from preheat.models import JobStatus, ScheduleSlot, SlotStatus, WarmupJob, WarmupRun

pytestmark = pytest.mark.slow

WORKER = "gpu0@faults-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TlsRedis:
    """redis-server on a free port, TLS only, with a password; stopped and started at will."""

    def __init__(self, folder: Path) -> None:
        from preheat.cli.connectbench import make_tls

        self.folder, self.tls, self.port = folder, make_tls(folder / "tls"), free_port()
        self.password = f"p@ss:w/rd%{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (f"rediss://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"
                f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(self.tls['ca']), safe='')}")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(self.tls["cert"]), "--tls-key-file", str(self.tls["key"]),
             "--tls-ca-cert-file", str(self.tls["ca"]), "--tls-auth-clients", "no", "--requirepass", self.password,
             "--save", "", "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, ssl=True,
                             ssl_ca_certs=str(self.tls["ca"]))
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


def test_redis_restarted_under_a_worker_and_beat_loses_no_slot_and_leaks_no_password(services_stack, tls_redis,
                                                                                     tmp_path):
    from schedules import store

    stack = services_stack
    stack.env.update(PREHEAT_BROKER_URL=tls_redis.url, PREHEAT_BEAT_TICK_S="0.5", PREHEAT_BEAT_LEASE_S="3")
    worker = procs.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    beat = procs.start("beat", procs.celery_command("beat", "--loglevel=INFO"), stack.env, tmp_path / "logs",
                       cwd=stack.home)
    with procs.running(worker, beat):
        procs.wait_for_log(worker, f"{WORKER} ready.", 90)
        # TLS and a password with URL characters, end to end.
        warmed = stack.cli("warm", "--wait", "--json", "--timeout", "60")
        assert warmed.returncode == 0, warmed.stderr

        # A pickled message on the worker's own queue is refused, said so, and never run.
        from preheat.celery import create_app, worker_queue
        from preheat.settings import load_settings

        sender = create_app(load_settings(broker_url=tls_redis.url))
        pickled = sender.send_task("preheat.warm_worker", kwargs={"run_id": str(uuid.uuid4()), "worker": WORKER,
                                                                  "templates": ["support"]},
                                   queue=worker_queue(WORKER), serializer="pickle")
        procs.wait_for_log(worker, "Refusing to deserialize untrusted content of type pickle", 30)

        # Arguments that do not fit the task's schema: its job fails with the reason, nothing runs.
        from preheat import history
        from preheat.models import TriggerKind

        task_id = str(uuid.uuid4())
        with session_scope() as session:
            run = history.create_run(session, trigger=TriggerKind.manual, requested_by="test")
            history.add_jobs(session, run, target=WORKER, model_templates=[("tiny", "support")], task_id=task_id)
            bad_run = run.id
        sender.send_task("preheat.warm_worker", task_id=task_id, queue=worker_queue(WORKER),
                         kwargs={"run_id": str(bad_run), "worker": WORKER, "templates": ["support"],
                                 "only_if_cold": "yes"})

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
            store.add(session, name="through-outage", cron="* * * * *", timezone="UTC",
                      targets={"templates": ["support"], "workers": [WORKER]}, lead_time_s=minutely_lead_for(fire_at))
        tls_redis.stop()
        unsent = procs.poll(lambda: (row := _slot("through-outage")) and row.status == SlotStatus.unsent and row,
                            30, what="the slot recorded unsent")
        assert "broker unreachable" in unsent.error
        time.sleep(1.5)  # a few more ticks with the broker away: still one slot, still unsent
        tls_redis.start()
        sent = procs.poll(lambda: (row := _slot("through-outage")) and row.status == SlotStatus.sent and row,
                          60, what="the slot sent after the restart")
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
        for where, text in (("worker log", worker_log), ("beat log", beat_log), ("history", recorded),
                            ("CLI", warmed.stdout + warmed.stderr)):
            assert secret not in text, f"the Redis password appears in the {where}"
