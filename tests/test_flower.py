"""Flower runs on the preheat app, with basic auth from the environment, and never without."""

import socket
import subprocess
import sys

import httpx
import pytest

from preheat import procs

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_flower_serves_with_basic_auth_only(services_stack, tmp_path):
    port = free_port()
    env = {**services_stack.env, "FLOWER_BASIC_AUTH": "admin:correct-horse"}
    flower = procs.start("flower", procs.celery_command("flower", f"--port={port}", "--address=127.0.0.1"),
                         env, tmp_path / "logs")
    with procs.running(flower):
        procs.wait_for_log(flower, "Visit me at", timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthcheck", timeout=10).status_code == 200
        assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", auth=("admin", "wrong"), timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", auth=("admin", "correct-horse"), timeout=10).status_code == 200
    assert "correct-horse" not in flower.log()


def test_flower_without_auth_refuses_to_start(services_stack):
    env = {k: v for k, v in services_stack.env.items() if not k.startswith("FLOWER_")}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "preheat", "flower", "--port=1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Flower needs auth: set FLOWER_BASIC_AUTH" in done.stderr
