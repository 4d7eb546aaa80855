"""Where `preheat.infer` results wait for their callers: on the embedded default Celery's
filesystem result backend, read back promptly; on Redis Celery's, with a caller that never
misses a result its pub/sub subscription did not deliver.

A caller's `AsyncResult.get()` polls a backend without push every half second (Celery's
default interval): an 8 ms answer reached its caller after about 500 ms. Here the files are
looked at every few milliseconds instead, by one watcher thread per process for all its
waiting callers: a `stat` each, and a caller is woken only when its file changed. (Each
caller reading its file every 5 ms took 0.41-0.44 of 2 cores with 16 callers.) The Redis
backend pushes results over pub/sub and needs none of this.

Celery writes the result file in place, so a reader can find it half written (a long
answer's JSON cut at 8,192 bytes: `DecodeError`, seen here once callers polled often). It
is written under a hidden name and renamed into place, which is atomic within a folder.

The Redis backend lives in preheat.celery.redisresults and is named here only by its path:
importing redis-py takes 0.17-0.4 s, which a worker on the embedded broker, and every CLI
command, paid at each start for a backend it never used.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

from celery import states
from celery.backends.filesystem import FilesystemBackend
from celery.exceptions import TimeoutError as ResultTimeout
from kombu.utils.encoding import ensure_bytes

POLL_S = 0.005


class FileWatcher:
    """One thread that stats every awaited file each POLL_S and wakes the caller whose file
    appeared or changed; it sleeps while nobody waits."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[threading.Event, int | None]] = {}
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def wait(self, path: str, seen: int | None, timeout: float | None) -> int | None:
        """Block until `path`'s modification time differs from `seen` (None: absent) or
        `timeout` passes; returns the time it has now."""
        changed = threading.Event()
        with self._lock:
            self._waiting[path] = (changed, seen)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="preheat-result-watcher", daemon=True)
                self._thread.start()
            self._lock.notify()
        try:
            changed.wait(timeout)
        finally:
            with self._lock:
                self._waiting.pop(path, None)
        return _mtime(path)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting:
                    self._lock.wait()
                waiting = list(self._waiting.items())
            for path, (changed, seen) in waiting:
                if _mtime(path) != seen:
                    changed.set()
            time.sleep(POLL_S)


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


class PromptFilesystemBackend(FilesystemBackend):
    _watcher = FileWatcher()  # one per process: every caller's wait, one thread

    def wait_for(self, task_id, timeout=None, interval=0.5, no_ack=True, on_interval=None):
        path = os.fsdecode(self._filename(self.get_key_for_task(task_id)))
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = _mtime(path)
        while True:
            meta = self.get_task_meta(task_id, cache=False)
            if meta["status"] in states.READY_STATES:
                return meta
            if on_interval:
                on_interval()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ResultTimeout("The operation timed out.")
            seen = self._watcher.wait(path, seen, left)

    def set(self, key, value):
        final = os.fsencode(self._filename(key))  # Celery's keys and path are bytes
        folder, name = os.path.split(final)
        partial = os.path.join(folder, b"." + name + f".{uuid.uuid4().hex}.part".encode())
        with self.open(partial, "wb") as outfile:
            outfile.write(ensure_bytes(value))
        os.replace(partial, final)


# The backends as a result_backend URL names them: Celery resolves "<class>+<url>".
URL_PREFIX = f"{__name__}:{PromptFilesystemBackend.__name__}+"
REDIS_URL_PREFIX = "preheat.celery.redisresults:ResyncingRedisBackend+"  # imported by Celery when named
