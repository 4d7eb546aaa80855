"""The embedded result backend: a caller polling every few milliseconds never reads a
result half written (Celery writes the file in place; a 1,500-token answer was read cut at
8,192 bytes)."""

from __future__ import annotations

import json
import threading

from celery import Celery

from preheat.results import POLL_S, PromptFilesystemBackend


def test_a_reader_racing_the_writer_sees_a_whole_result_or_none(tmp_path):
    backend = PromptFilesystemBackend(app=Celery(set_as_current=False), url=f"file://{tmp_path}")
    key = backend.get_key_for_task("race")
    bodies = [json.dumps({"n": n, "tokens": list(range(3000 + n))}).encode() for n in range(40)]
    done = threading.Event()

    def write() -> None:
        for body in bodies:
            backend.set(key, body)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen = 0
    while not done.is_set():
        raw = backend.get(key)
        if raw is not None:
            json.loads(raw)  # a partial file would fail here
            seen += 1
    writer.join()
    assert json.loads(backend.get(key))["n"] == 39 and seen > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left


def test_a_caller_polls_every_few_milliseconds():
    assert POLL_S <= 0.01
