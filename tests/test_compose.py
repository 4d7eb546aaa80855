"""docker-compose.yml and the Dockerfile describe the services a user deploys: every command
in them must be a real preheat or celery command with options that exist."""

import subprocess
import sys

import pytest
import yaml

from tests.conftest import PREHEAT_CLI, PREHEAT_WORKER_CLI, REPO

SERVICES = {"redis", "postgres", "migrate", "gpu-worker", "beat", "watch-workers", "exporter", "flower"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def preheat_commands(compose) -> dict[str, list[str]]:
    return {
        name: service["command"]
        for name, service in compose["services"].items()
        if service.get("image", "").startswith("preheat")
    }


def test_the_services_are_all_there(compose):
    assert set(compose["services"]) == SERVICES
    assert set(preheat_commands(compose)) == {"migrate", "gpu-worker", "beat", "watch-workers", "exporter", "flower"}


@pytest.mark.parametrize("service", ["migrate", "gpu-worker", "beat", "watch-workers", "exporter", "flower"])
def test_each_command_is_a_real_command_with_real_options(compose, service, embedded_stack):
    argv = compose["services"][service]["command"]
    assert argv[0] in {"celery", "preheat", "preheat-worker"}
    if argv[0] == "celery":
        assert argv[1:3] == ["-A", "preheat"] and argv[3] in {"beat", "flower"}
        full = [sys.executable, "-m", "celery", *argv[1:]]
    elif argv[0] == "preheat-worker":
        full = [PREHEAT_WORKER_CLI, *argv[1:]]
    else:
        full = [PREHEAT_CLI, *argv[1:]]
    # The variables compose requires, with stand-in values.
    env = {**embedded_stack.env, "FLOWER_BASIC_AUTH": "ci:long-enough"}
    # --help is answered only once every other option on the line has parsed.
    done = subprocess.run([*full, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout


def test_gpu_worker_runs_the_threads_pool_with_an_nvidia_reservation(compose):
    worker = compose["services"]["gpu-worker"]
    outbox = worker["environment"]["PREHEAT_OUTBOX_DIR"]
    assert f"outbox:{outbox}" in worker["volumes"] and "outbox" in compose["volumes"]
    assert "--pool=threads" in worker["command"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_no_default_passwords_and_flower_requires_auth(compose):
    text = (REPO / "docker-compose.yml").read_text()
    for variable in ("REDIS_PASSWORD", "POSTGRES_PASSWORD", "FLOWER_BASIC_AUTH"):
        assert f"${{{variable}:?" in text and f"${{{variable}:-" not in text
    flower = compose["services"]["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert all(port.startswith("127.0.0.1:") for port in flower["ports"])
    assert compose["services"]["beat"]["deploy"]["replicas"] == 1


def test_the_dockerfile_copies_every_package():
    dockerfile = (REPO / "Dockerfile").read_text()
    for package in ("preheat", "tasks", "workers", "schedules", "migrations"):
        assert f"COPY {package} ./{package}" in dockerfile
        assert (REPO / package / "__init__.py").exists()


def test_gpu_worker_healthcheck_asks_the_health_server_on_its_port(compose):
    from preheat.core.settings import Settings
    from preheat.workers.health import PATHS

    worker = compose["services"]["gpu-worker"]
    port = worker["environment"]["PREHEAT_HEALTH_PORT"]
    assert int(port) == Settings.model_fields["health_port"].default and worker["expose"] == [port]
    probe = " ".join(worker["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/health/ready" in probe and "/health/ready" in PATHS
    assert worker["healthcheck"]["start_period"] == "300s"  # models load and prefill before ready
    assert f"EXPOSE {port}" in (REPO / "Dockerfile").read_text()
