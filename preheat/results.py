"""Where `preheat.infer` results wait for their callers on the embedded default: Celery's
filesystem result backend, read back promptly.

A caller's `AsyncResult.get()` polls a backend without push every half second (Celery's
default interval): an 8 ms answer reached its caller after about 500 ms. Here a poll is a
stat and a small read of one file, so the caller looks every few milliseconds instead. (The
Redis backend pushes results over pub/sub and needs none of this.)

Celery writes the result file in place, so a reader can find it half written (a long
answer's JSON cut at 8,192 bytes: `DecodeError`, seen here once callers polled often). It
is written under a hidden name and renamed into place, which is atomic within a folder.
"""

from __future__ import annotations

import os
import uuid

from celery.backends.filesystem import FilesystemBackend
from kombu.utils.encoding import ensure_bytes

POLL_S = 0.005


class PromptFilesystemBackend(FilesystemBackend):
    def wait_for(self, task_id, timeout=None, interval=0.5, no_ack=True, on_interval=None):
        return super().wait_for(task_id, timeout, min(interval, POLL_S), no_ack, on_interval)

    def set(self, key, value):
        final = os.fsencode(self._filename(key))  # Celery's keys and path are bytes
        folder, name = os.path.split(final)
        partial = os.path.join(folder, b"." + name + f".{uuid.uuid4().hex}.part".encode())
        with self.open(partial, "wb") as outfile:
            outfile.write(ensure_bytes(value))
        os.replace(partial, final)


# The backend as a result_backend URL names it: Celery resolves "<class>+<url>".
URL_PREFIX = f"{__name__}:{PromptFilesystemBackend.__name__}+"
