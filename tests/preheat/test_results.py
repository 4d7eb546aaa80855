"""The embedded result backend: a caller never reads a result half written (Celery writes
the file in place; a 1,500-token answer was read cut at 8,192 bytes), and every waiting
caller of a process is woken by one watcher thread when its own result lands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from celery import Celery, states
from celery.exceptions import TimeoutError as ResultTimeout

from preheat.celery.results import POLL_S, PromptFilesystemBackend


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


def _backend(folder) -> PromptFilesystemBackend:
    return PromptFilesystemBackend(app=Celery(set_as_current=False), url=f"file://{folder}")


def test_sixteen_waiting_callers_each_get_their_own_result_through_one_watcher(tmp_path):
    backend = _backend(tmp_path)
    got: dict[int, object] = {}

    def caller(n: int) -> None:
        got[n] = backend.wait_for(f"task-{n}", timeout=30)["result"]

    callers = [threading.Thread(target=caller, args=(n,)) for n in range(16)]
    for thread in callers:
        thread.start()
    for n in reversed(range(16)):  # in another order than they wait
        backend.store_result(f"task-{n}", {"answer": n}, states.SUCCESS)
    for thread in callers:
        thread.join(30)
    assert got == {n: {"answer": n} for n in range(16)}
    watchers = [t for t in threading.enumerate() if t.name == "preheat-result-watcher"]
    assert len(watchers) == 1  # not a poll loop per caller


def test_a_state_that_is_not_final_keeps_the_caller_waiting_for_the_next_change(tmp_path):
    backend = _backend(tmp_path)
    backend.store_result("task", None, states.STARTED)
    waited: dict[str, object] = {}
    caller = threading.Thread(target=lambda: waited.update(backend.wait_for("task", timeout=30)))
    caller.start()
    caller.join(POLL_S * 20)
    assert caller.is_alive()  # STARTED is not an answer
    backend.store_result("task", {"answer": 1}, states.SUCCESS)
    caller.join(30)
    assert waited["status"] == states.SUCCESS and waited["result"] == {"answer": 1}


def test_no_result_within_the_timeout_raises_celery_s_timeout(tmp_path):
    with pytest.raises(ResultTimeout):
        _backend(tmp_path).wait_for("never", timeout=0.05)


def test_a_redis_result_whose_message_never_came_still_reaches_its_caller(redis_client):
    """The answer is in Redis but its pub/sub message was lost (published while the caller's
    subscription was down): the caller reads its key again within a second and has it."""
    from preheat.celery.app import celery_config
    from preheat.core.settings import Settings
    from tests.conftest import REDIS_URL

    app = Celery(set_as_current=False)
    app.conf.update(celery_config(Settings(broker_url=REDIS_URL)))
    backend = app.backend
    assert type(backend).__name__ == "ResyncingRedisBackend"
    pending = app.AsyncResult("lost-message")
    backend.result_consumer.consume_from(pending.id)  # subscribed, as send_task does
    meta = backend.encode(
        {"status": states.SUCCESS, "result": {"answer": 42}, "traceback": None, "children": [], "task_id": pending.id}
    )
    key = backend.get_key_for_task(pending.id)
    threading.Timer(0.3, lambda: redis_client.set(key, meta)).start()  # stored, never published
    try:
        assert pending.get(timeout=10) == {"answer": 42}
    finally:
        redis_client.delete(key)


def test_a_process_on_the_embedded_broker_never_imports_redis_py(tmp_path):
    """A worker's start and every CLI command import the app: with files for results, the
    Redis backend (0.17-0.4 s of redis-py's import) is never paid for."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    env["PREHEAT_HOME"] = str(tmp_path)
    probe = (
        "import sys\n"
        "from preheat.celery.app import app\n"
        "import preheat.tasks.worker, preheat.tasks.infer, preheat.tasks.warmup, preheat.tasks.endpoints\n"
        "print(type(app.backend).__name__, 'redis' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["PromptFilesystemBackend", "False"]
