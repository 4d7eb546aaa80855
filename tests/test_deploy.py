"""deploy/k8s: the manifests parse, every probe asks a path the health server really
answers on the port the container really sets, and the shapes a GPU fleet relies on hold."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import yaml

from tests.conftest import PREHEAT_CLI, PREHEAT_WORKER_CLI, REPO

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
    assert {
        ("StatefulSet", "preheat-gpu-worker"),
        ("Deployment", "preheat-beat"),
        ("Deployment", "preheat-flower"),
        ("Job", "preheat-migrate"),
    } <= set(manifests)


class _Runtime:
    """What the health server observes; a ready worker."""

    def readiness(self) -> list[str]:
        return []

    def render_metrics(self) -> bytes:
        return b"preheat_worker_ready 1\n"


def test_every_worker_probe_is_answered_by_the_health_server_on_the_container_port(manifests):
    from preheat.core.settings import Settings
    from preheat.workers.health import HealthServer

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
    assert "--pool=threads" in worker["command"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The nodename follows the pod's stable name, so its own warmup queue survives restarts.
    assert "$(POD_NAME)" in worker["command"][worker["command"].index("-n") + 1]
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 1800


def test_the_worker_outbox_is_on_a_claim_of_its_own_that_outlives_the_pod(manifests):
    statefulset = manifests[("StatefulSet", "preheat-gpu-worker")]
    [worker] = _containers(statefulset)
    folder = next(e["value"] for e in worker["env"] if e["name"] == "PREHEAT_OUTBOX_DIR")
    [mount] = [m for m in worker["volumeMounts"] if m["mountPath"] == folder]
    assert not mount.get("readOnly")
    assert mount["name"] in {claim["metadata"]["name"] for claim in statefulset["spec"]["volumeClaimTemplates"]}


def test_beat_runs_as_leader_and_standby_and_flower_only_with_auth_from_a_secret(manifests):
    beat = manifests[("Deployment", "preheat-beat")]
    assert beat["spec"]["replicas"] == 2  # a leader lease in the database; slots unique per schedule
    [flower] = _containers(manifests[("Deployment", "preheat-flower")])
    assert "secretKeyRef" in _env(flower)["FLOWER_BASIC_AUTH"]["valueFrom"]
    for (kind, _), doc in manifests.items():
        if kind in {"Deployment", "StatefulSet", "Job"}:
            for container in _containers(doc):
                for name, item in _env(container).items():
                    if name.endswith(("_URL", "_AUTH")):
                        assert "value" not in item, f"{name} must come from a secret"


def test_the_pod_watcher_may_only_read_pods_and_watches_the_workers_by_their_names(manifests):
    role = manifests[("Role", "preheat-pod-watcher")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = manifests[("RoleBinding", "preheat-pod-watcher")]
    assert binding["roleRef"]["name"] == "preheat-pod-watcher"
    assert binding["subjects"][0]["name"] == "preheat-pod-watcher"
    watcher = manifests[("Deployment", "preheat-watch-pods")]
    assert watcher["spec"]["template"]["spec"]["serviceAccountName"] == "preheat-pod-watcher"
    command = _containers(watcher)[0]["command"]
    worker = manifests[("StatefulSet", "preheat-gpu-worker")]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    selector = command[command.index("--selector") + 1]
    assert all(labels.get(key) == value for key, value in (term.split("=") for term in selector.split(",")))
    worker_name = _containers(worker)[0]["command"][_containers(worker)[0]["command"].index("-n") + 1]
    assert command[command.index("--worker-name") + 1] == worker_name.replace("$(POD_NAME)", "{pod}")


@pytest.mark.parametrize(
    "component",
    [
        "preheat-gpu-worker",
        "preheat-beat",
        "preheat-flower",
        "preheat-migrate",
        "preheat-watch-pods",
        "preheat-watch-workers",
        "preheat-exporter",
    ],
)
def test_each_command_is_a_real_command_with_real_options(manifests, component, embedded_stack):
    [doc] = [doc for (kind, name), doc in manifests.items() if name == component and kind != "Service"]
    argv = [
        arg.replace("$(POD_NAME)", "pod-0").replace("$(POD_NAMESPACE)", "preheat")
        for arg in _containers(doc)[0]["command"]
    ]
    full = {
        "celery": [sys.executable, "-m", "celery", *argv[1:]],
        "preheat-worker": [PREHEAT_WORKER_CLI, *argv[1:]],
    }.get(argv[0], [PREHEAT_CLI, *argv[1:]])
    env = {**embedded_stack.env, "FLOWER_BASIC_AUTH": "ci:long-enough"}
    done = subprocess.run([*full, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_cluster_wide_pod_watcher_may_only_read_pods():
    docs = list(yaml.safe_load_all((K8S / "cluster-wide" / "pod-watcher-clusterrole.yaml").read_text()))
    by_kind = {doc["kind"]: doc for doc in docs}
    assert sorted(by_kind) == ["ClusterRole", "ClusterRoleBinding"]
    assert by_kind["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = by_kind["ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "preheat-pod-watcher",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "preheat-pod-watcher", "namespace": "preheat"}]
