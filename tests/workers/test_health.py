"""The health server over real HTTP, in front of a real runtime."""

import httpx
import pytest

from preheat.api.sampling import SamplingParams
from preheat.core.catalog import load_catalog
from preheat.workers.health import PATHS, HealthServer
from preheat.workers.runtime import RuntimeConfig, WorkerRuntime
from tests.conftest import write_catalog


@pytest.fixture
def served(tmp_path, tiny_model):
    runtime = WorkerRuntime(load_catalog(write_catalog(tmp_path, tiny_model)), RuntimeConfig("cpu", probe_repeats=1))
    server = HealthServer(runtime, "127.0.0.1", 0).start()
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
        yield runtime, client
    server.stop()


def test_ready_is_503_with_reasons_until_preloaded_then_200(served):
    runtime, client = served
    assert client.get("/health/live").json() == {"status": "live"}
    before = client.get("/health/ready")
    assert before.status_code == 503
    assert before.json() == {
        "status": "not ready",
        "reasons": ["model tiny not loaded yet", "template support: not pre-filled yet"],
    }
    runtime.preload()
    after = client.get("/health/ready")
    assert (after.status_code, after.json()) == (200, {"status": "ready"})


def test_metrics_expose_cache_models_and_ttft(served):
    runtime, client = served
    runtime.preload()
    runtime.infer("support", "Where is my parcel?", SamplingParams(max_tokens=2))
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    lines = set(response.text.splitlines())
    stats = runtime.cache.stats()
    assert "preheat_kv_cache_hits_total 1.0" in lines and "preheat_kv_cache_misses_total 0.0" in lines
    assert f"preheat_kv_cache_bytes {float(stats.bytes)}" in lines and "preheat_kv_cache_entries 1.0" in lines
    assert "preheat_kv_cache_evictions_total 0.0" in lines and "preheat_worker_ready 1.0" in lines
    assert 'preheat_model_resident{model="tiny"} 1.0' in lines
    assert any(line.startswith('preheat_model_load_seconds{model="tiny"} ') for line in lines)
    assert 'preheat_ttft_seconds_count{cache="hit",model="tiny"} 1.0' in lines
    assert 'preheat_prefills_total{model="tiny"} 1.0' in lines


def test_unknown_paths_and_methods_are_refused_with_a_reason(served):
    _, client = served
    missing = client.get("/healthz")
    assert missing.status_code == 404 and str(list(PATHS)) in missing.json()["error"]
    post = client.post("/health/ready")
    assert post.status_code == 405 and post.headers["allow"] == "GET"


def test_fifteen_hundred_idle_connections_cost_no_thread_and_probes_still_answer(served):
    """Anyone on the cluster network may open connections and send nothing: they cost a
    socket each, not a thread, and the kubelet's probes are answered meanwhile; a slow
    readiness (a warmup holding a lock) never holds up /health/live."""
    import socket
    import threading

    runtime, client = served
    port = client.base_url.port
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(1500):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        half = idle[0]
        half.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert client.get("/health/live").status_code == 200
        assert client.get("/health/ready").status_code == 503
        assert threading.active_count() <= threads_before + 4  # the answer pool at most
    finally:
        for sock in idle:
            sock.close()

    slow, asked = threading.Event(), threading.Event()
    runtime.readiness = lambda: asked.set() or (slow.wait(60) and [])
    waiting = threading.Thread(target=lambda: client.get("/health/ready"))
    waiting.start()
    assert asked.wait(10)
    with httpx.Client(base_url=str(client.base_url), timeout=10) as other:
        assert other.get("/health/live").status_code == 200
    assert waiting.is_alive()  # answered while the readiness still waits, not behind it
    slow.set()
    waiting.join(10)


def test_a_client_that_never_finishes_its_headers_is_closed(served):
    import socket

    import preheat.workers.health as health

    _, client = served
    with socket.create_connection(("127.0.0.1", client.base_url.port)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")
        sock.settimeout(health.HEADER_TIMEOUT_S + 10)
        assert sock.recv(1024) == b""  # closed by the server after its header timeout
