"""A failure inside a request, after the answer began: the stream ends with an error event
and [DONE] (never a silent cut), a whole answer is a 5xx with the reason, and the server
serves the next request. The server runs in this process so the fault can be injected
into its forward pass."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from preheat.core import processes
from preheat.core.catalog import load_catalog
from preheat.workers.engine.runner import ModelRunner
from preheat.workers.engine.scheduler import BatchLimits
from preheat.workers.runtime import RuntimeConfig, WorkerRuntime
from preheat.workers.serve import ServeConfig, Server, listen
from tests.conftest import SUPPORT_PROMPT, write_catalog

BODY = {
    "model": "tiny",
    "max_tokens": 8,
    "temperature": 0,
    "messages": [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": "Where is it?"}],
}


@pytest.fixture
def served(tmp_path, tiny_model):
    yield from _serve(tmp_path, tiny_model)


@pytest.fixture
def served_one_row(tmp_path, tiny_model):
    """A server whose engine runs one request and queues one more."""
    yield from _serve(tmp_path, tiny_model, BatchLimits(max_running=1, max_queued=1))


def _serve(tmp_path, tiny_model, limits: BatchLimits = BatchLimits()):
    catalog = load_catalog(write_catalog(tmp_path, tiny_model))
    runtime = WorkerRuntime(catalog, RuntimeConfig(device="cpu", probe_repeats=1, batch_limits=limits))
    server = Server(runtime, ServeConfig())
    runtime.preload()
    bound, started = {}, threading.Event()

    def run() -> None:
        import tornado.ioloop

        asyncio.set_event_loop(asyncio.new_event_loop())
        http, port = listen(server, "127.0.0.1", 0)
        bound.update(loop=tornado.ioloop.IOLoop.current(), port=port, http=http)
        started.set()
        bound["loop"].start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    url = f"http://127.0.0.1:{bound['port']}"
    processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 30, what="ready")
    yield url
    bound["loop"].add_callback(bound["loop"].stop)
    thread.join(5)
    server.executor.shutdown(wait=False)


def fail_after(monkeypatch, calls: int) -> None:
    """Every forward pass after the first `calls` (a request's pre-fill, a batch's decode
    step) raises."""
    seen = {"n": 0}

    def failing(real):
        def run(*args, **kwargs):
            seen["n"] += 1
            if seen["n"] > calls:
                raise RuntimeError("injected: the device fell over")
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(ModelRunner, "forward", failing(ModelRunner.forward))
    monkeypatch.setattr(ModelRunner, "step", failing(ModelRunner.step))


def test_a_failure_mid_stream_ends_it_with_an_error_event_and_done(served, monkeypatch):
    fail_after(monkeypatch, 3)
    with httpx.stream("POST", f"{served}/v1/chat/completions", json={**BODY, "stream": True}, timeout=30) as answer:
        assert answer.status_code == 200
        events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected: the device fell over" in error["message"] and error["code"] == "internal_error"
    pieces = [json.loads(e) for e in events[:-2]]
    assert pieces[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(pieces) >= 3  # the answer had begun
    assert not any(p["choices"][0]["finish_reason"] for p in pieces)  # it never claims to be complete

    whole = httpx.post(f"{served}/v1/chat/completions", json=BODY, timeout=30)
    assert whole.status_code == 500 and "injected" in whole.json()["error"]["message"]

    monkeypatch.undo()
    assert httpx.post(f"{served}/v1/chat/completions", json=BODY, timeout=30).status_code == 200


LONG = {**BODY, "max_tokens": 3000, "temperature": 1.0, "seed": 5, "stream": True}


def _running(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return float(
        next(line.split()[-1] for line in metrics.splitlines() if line.startswith("preheat_requests_running "))
    )


def test_a_full_queue_is_429_with_retry_after_and_a_gone_client_frees_its_row(served_one_row):
    url = served_one_row
    queued: dict = {}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=LONG) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)  # decoding now

        def second() -> None:
            queued["answer"] = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=60)

        waiting = threading.Thread(target=second)
        waiting.start()
        processes.poll(lambda: "preheat_requests_waiting 1.0" in httpx.get(f"{url}/metrics").text, 10, 0.02, "queued")
        refused = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=10)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert waiting.is_alive()  # the row is still the first client's
    # The first client hung up mid-answer: its row goes to the one waiting.
    waiting.join(60)
    assert queued["answer"].status_code == 200
    assert queued["answer"].json()["choices"][0]["message"]["content"]
    processes.poll(lambda: _running(url) == 0, 10, 0.05, "no request running")
