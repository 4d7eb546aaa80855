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

import workers.generate as generate
from preheat import procs
from preheat.catalog import load_catalog
from tests.conftest import SUPPORT_PROMPT, write_catalog
from workers.runtime import WorkerRuntime
from workers.serve import ServeConfig, Server, listen

BODY = {
    "model": "tiny",
    "max_tokens": 8,
    "temperature": 0,
    "messages": [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": "Where is it?"}],
}


@pytest.fixture
def served(tmp_path, tiny_model):
    runtime = WorkerRuntime(load_catalog(write_catalog(tmp_path, tiny_model)), device_preference="cpu", probe_repeats=1)
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
    procs.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 30, what="ready")
    yield url
    bound["loop"].add_callback(bound["loop"].stop)
    thread.join(5)
    server.executor.shutdown(wait=False)


def fail_after(monkeypatch, calls: int) -> None:
    real, seen = generate.forward, {"n": 0}

    def failing(*args, **kwargs):
        seen["n"] += 1
        if seen["n"] > calls:
            raise RuntimeError("injected: the device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "forward", failing)


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
