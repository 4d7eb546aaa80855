"""deploy/k8s: the manifests parse, every probe asks a path the health server really
answers on the port the container really sets, and the shapes a GPU fleet relies on hold."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import yaml

from tests.conftest import PREHEAT_CLI, REPO

K8S = REPO / "deploy" / "k8s"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def _env(container: dict) -> dict:
    return {item["name"]: item for item in container.get("env", [])}


def test_the_kustomization_lists_every_manifest(manifests):
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert {("StatefulSet", "preheat-gpu-worker"), ("Deployment", "preheat-beat"), ("Deployment", "preheat-flower"),
            ("Job", "preheat-migrate")} <= set(manifests)


class _Runtime:
    """What the health server observes; a ready worker."""

    def readiness(self) -> list[str]:
        return []

    def render_metrics(self) -> bytes:
        return b"preheat_worker_ready 1\n"


def test_every_worker_probe_is_answered_by_the_health_server_on_the_container_port(manifests):
    from preheat.settings import Settings
    from workers.health import HealthServer

    [worker] = _containers(manifests[("StatefulSet", "preheat-gpu-worker")])
    ports = {port["name"]: port["containerPort"] for port in worker["ports"]}
    configured = int(_env(worker)["PREHEAT_HEALTH_PORT"]["value"])
    assert ports["health"] == configured == Settings.model_fields["health_port"].default
    server = HealthServer(_Runtime(), "127.0.0.1", 0).start()
    try:
        for kind in PROBES:
            get = worker[kind]["httpGet"]
            assert get["port"] in ("health", configured), kind
            answer = httpx.get(f"http://127.0.0.1:{server.port}{get['path']}", timeout=5)
            assert answer.status_code == 200, (kind, get["path"], answer.text)
        assert worker["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    finally:
        server.stop()
    [service] = [doc for (kind, name), doc in manifests.items() if kind == "Service" and name == "preheat-gpu-worker"]
    assert service["spec"]["ports"][0]["targetPort"] == "health"


def test_the_gpu_worker_is_one_solo_process_per_gpu(manifests):
    statefulset = manifests[("StatefulSet", "preheat-gpu-worker")]
    [worker] = _containers(statefulset)
    assert "--pool=solo" in worker["command"] and "--concurrency=1" in worker["command"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The nodename follows the pod's stable name, so its own warmup queue survives restarts.
    assert "$(POD_NAME)" in worker["command"][worker["command"].index("-n") + 1]
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 1800


def test_beat_runs_exactly_once_and_flower_only_with_auth_from_a_secret(manifests):
    beat = manifests[("Deployment", "preheat-beat")]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    [flower] = _containers(manifests[("Deployment", "preheat-flower")])
    assert "secretKeyRef" in _env(flower)["FLOWER_BASIC_AUTH"]["valueFrom"]
    for (kind, _), doc in manifests.items():
        if kind in {"Deployment", "StatefulSet", "Job"}:
            for container in _containers(doc):
                for name, item in _env(container).items():
                    if name.endswith(("_URL", "_AUTH")):
                        assert "value" not in item, f"{name} must come from a secret"


@pytest.mark.parametrize("component", ["preheat-gpu-worker", "preheat-beat", "preheat-flower", "preheat-migrate"])
def test_each_command_is_a_real_command_with_real_options(manifests, component, embedded_stack):
    [doc] = [doc for (kind, name), doc in manifests.items() if name == component and kind != "Service"]
    argv = [arg.replace("$(POD_NAME)", "pod-0") for arg in _containers(doc)[0]["command"]]
    full = [sys.executable, "-m", "celery", *argv[1:]] if argv[0] == "celery" else [PREHEAT_CLI, *argv[1:]]
    env = {**embedded_stack.env, "FLOWER_BASIC_AUTH": "ci:ci"}
    done = subprocess.run([*full, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
