"""The pod watcher: exactly one warmup per Ready transition, against a local API server that
speaks the list / watch protocol, with the real `kubernetes` client in a real
`preheat watch-pods` process, and real Redis, Postgres, worker and model server."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import select

from preheat.core import processes
from preheat.core.errors import ConfigError
from preheat.history.db import session_scope, utcnow
from preheat.history.models import JobStatus, TriggerKind, WarmupRun
from preheat.schedules.pods import PodTarget, ReadyTracker, transition_of
from tests.conftest import PREHEAT_CLI, write_catalog
from tests.schedules.fake_kube import FakeKube, pod

T1, T2, T3 = "2026-11-30T08:00:00Z", "2026-11-30T08:05:00Z", "2026-11-30T08:09:00Z"


# The bookkeeping, without a cluster -------------------------------------------------------


def test_a_transition_is_a_ready_condition_turning_true_or_first_seen_true():
    tracker = ReadyTracker()
    tracker.observe(pod("a", "uid-a", ready=True, since=T1), now=0)
    tracker.observe(pod("b", "uid-b", ready=False, since=T1), now=0)
    assert [t.pod for t in tracker.due(0)] == ["a"]
    for note in range(20):  # a storm of MODIFIED events of one transition
        tracker.observe(pod("a", "uid-a", ready=True, since=T1, note=str(note)), now=1)
    tracker.observe(pod("b", "uid-b", ready=True, since=T2), now=1)
    assert [(t.pod, t.ready_since) for t in tracker.due(1)] == [("b", T2)]
    tracker.observe(pod("b", "uid-b", ready=False, since=T3), now=2)
    tracker.observe(pod("b", "uid-b", ready=True, since=T3), now=2)
    assert [t.trigger_key for t in tracker.due(2)] == [f"pod:uid-b:{T3}"]


def test_a_flapping_pod_within_the_settle_time_is_warmed_once_and_a_deleted_one_not_at_all():
    tracker = ReadyTracker(settle_s=5)
    tracker.observe(pod("a", "uid-a", ready=True, since=T1), now=0)
    tracker.observe(pod("a", "uid-a", ready=False, since=T2), now=1)
    tracker.observe(pod("a", "uid-a", ready=True, since=T3), now=2)
    tracker.observe(pod("gone", "uid-g", ready=True, since=T1), now=2)
    tracker.forget(pod("gone", "uid-g", ready=True, since=T1))
    assert tracker.due(6) == []  # settles at 7
    assert [t.ready_since for t in tracker.due(7)] == [T3]


def test_the_target_is_the_pods_ip_and_named_port():
    transition = transition_of(pod("a", "uid-a", ready=True, since=T1, ip="10.1.2.3", port=8000))
    assert PodTarget(endpoint="vllm", port_name="http").replica(transition) == "10.1.2.3:8000"
    assert PodTarget(endpoint="vllm", port=9000).replica(transition) == "10.1.2.3:9000"
    assert PodTarget(endpoint="vllm", port_name="nope").replica(transition) == "10.1.2.3:9090"  # its first
    with pytest.raises(ConfigError, match=r"--endpoint .* or --worker-name"):
        PodTarget()
    with pytest.raises(ConfigError, match="must contain"):
        PodTarget(worker_name="gpu0@node")


# The watcher, end to end ------------------------------------------------------------------


def pod_runs() -> dict[str, list[WarmupRun]]:
    with session_scope() as session:
        runs = session.scalars(select(WarmupRun).where(WarmupRun.trigger == TriggerKind.pod_event)).all()
        found: dict[str, list[WarmupRun]] = {}
        for run in runs:
            found.setdefault(run.trigger_detail["pod"] + "@" + run.trigger_detail["ready_since"], []).append(run)
        return found


def runs_for(*keys: str):
    runs = pod_runs()
    return runs if all(key in runs for key in keys) else None


@pytest.fixture
def kube():
    server = FakeKube().start()
    yield server
    server.stop()


@pytest.mark.slow
def test_watch_pods_warms_once_per_transition_through_list_watch_bookmark_410_and_reconnect(
    services_stack, kube, tmp_path, tiny_model
):
    stack = services_stack
    serve = processes.start_serve(stack.env, tmp_path / "logs")
    worker = processes.start_worker("io@pods-test", stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(serve, worker):
        url = processes.serve_url(serve)
        port = int(url.rsplit(":", 1)[1])
        # The pods say Ready only once the server is (their readiness probe is /health/ready).
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 60, what="serve ready")
        # The catalog's address is the Service's; each pod is warmed at its own IP and port.
        write_catalog(
            tmp_path,
            tiny_model,
            '\n[endpoints.vllm]\nbase_url = "http://vllm.serving.svc:8000/v1"\n'
            'model = "tiny"\ntemplates = ["support"]\nkeepalive_interval_s = 60\n',
        )
        kube.apply(pod("pod-a", "uid-a", ready=True, since=T1, port=port))
        kube.apply(pod("pod-b", "uid-b", ready=False, since=T1, port=port))
        kube.apply(pod("other", "uid-o", ready=True, since=T1, labels={"app": "redis"}))
        processes.wait_for_log(worker, "io@pods-test ready.", 90)
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
        with processes.running(watcher):
            # Initial list: pod-a is first seen Ready; pod-b is not Ready; `other` is not selected.
            processes.poll(lambda: runs_for(f"pod-a@{T1}"), 30, what="pod-a's warmup")
            # ADDED ready, and MODIFIED not ready -> ready followed by a storm of the same transition.
            kube.apply(pod("pod-c", "uid-c", ready=True, since=T2, port=port))
            kube.apply(pod("pod-b", "uid-b", ready=True, since=T2, port=port))
            for note in range(15):
                kube.apply(pod("pod-b", "uid-b", ready=True, since=T2, port=port, note=str(note)))
            kube.delete("pod-a")
            bookmark = kube.bookmark()
            processes.poll(lambda: runs_for(f"pod-c@{T2}", f"pod-b@{T2}"), 30, what="pod-b and pod-c")
            # A dropped connection: watched again from the bookmark, not listed again.
            kube.drop()
            processes.poll(
                lambda: any(w["resourceVersion"] == bookmark for w in kube.watches()),
                30,
                what="a watch from the bookmark",
            )
            assert len(kube.lists()) == 1
            # 410 Gone: listed again; pod-d became Ready meanwhile; b and c are not warmed again.
            kube.compact()
            kube.apply(pod("pod-d", "uid-d", ready=True, since=T3, port=port))
            processes.poll(lambda: len(kube.lists()) == 2 and runs_for(f"pod-d@{T3}"), 30, what="re-list after 410")
            # pod-b flaps: not ready, then ready again: a new transition.
            kube.apply(pod("pod-b", "uid-b", ready=False, since=T3, port=port))
            kube.apply(pod("pod-b", "uid-b", ready=True, since="2026-11-30T08:10:00Z", port=port))
            processes.poll(lambda: runs_for("pod-b@2026-11-30T08:10:00Z"), 30, what="pod-b's second transition")
            # Settle: every run is recorded; the first one ran to the end against pod-a's address.
            processes.poll(lambda: _finished(pod_runs()[f"pod-a@{T1}"][0].id), 60, what="pod-a's warmup finishing")
        log = watcher.log()
    runs = pod_runs()
    assert sorted(runs) == sorted(
        [f"pod-a@{T1}", f"pod-c@{T2}", f"pod-b@{T2}", f"pod-d@{T3}", "pod-b@2026-11-30T08:10:00Z"]
    )
    assert all(len(found) == 1 for found in runs.values()), {k: len(v) for k, v in runs.items()}
    first = runs[f"pod-a@{T1}"][0]
    assert first.trigger_detail["replica"] == f"127.0.0.1:{port}" and first.trigger_detail["uid"] == "uid-a"
    [job] = _jobs(first.id)
    assert (job.target, job.status) == (f"vllm@127.0.0.1:{port}", JobStatus.warm), job.error
    assert job.cached_tokens > 0  # the pod's own prefix cache now holds the system prompt
    assert "pod watch interrupted" in log and "listing again" in log
    assert "Traceback" not in log, log[-3000:]
    assert all(w["bookmarks"] == "true" for w in kube.watches())
    assert json.dumps(kube.requests)  # what the watcher asked, kept for a failing run's report


def _jobs(run_id):
    from preheat.history import service

    with session_scope() as session:
        return service.get_run(session, run_id).jobs


def _finished(run_id) -> bool:
    return all(job.status.is_final for job in _jobs(run_id))


@pytest.mark.parametrize("stack", ["services"], indirect=True)
def test_a_ready_worker_pod_is_warmed_on_its_own_queue_once(stack, stack_app, redis_client):
    from preheat.fleet import registry
    from preheat.schedules.pods import send_warmup

    with session_scope() as session:
        registry.beat(session, "gpu0@preheat-gpu-worker-1", started_at=utcnow(), ready=True, state={})
    target = PodTarget(worker_name="gpu0@{pod}")
    transition = transition_of(pod("preheat-gpu-worker-1", "uid-w1", ready=True, since=T1))
    first = send_warmup(target, transition)
    again = send_warmup(target, transition)  # a second watcher, or this one restarted
    assert first == again
    [run] = pod_runs()[f"preheat-gpu-worker-1@{T1}"]
    assert run.trigger_detail["worker"] == "gpu0@preheat-gpu-worker-1" and run.trigger_key == f"pod:uid-w1:{T1}"
    assert redis_client.llen("preheat.w.gpu0_preheat-gpu-worker-1") == 1  # sent once
    gone = transition_of(pod("preheat-gpu-worker-2", "uid-w2", ready=True, since=T1))
    assert send_warmup(target, gone) is None  # not a live worker: logged, nothing recorded
