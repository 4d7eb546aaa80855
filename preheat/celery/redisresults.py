"""Redis results that reach their caller even when pub/sub lost the message.

On Redis a caller reads its result's key once when it starts waiting and then only listens
on pub/sub. A result published while the subscription was down (Redis cut under 16 running
requests, its callers' reconnect racing the worker's store) never reached its caller, which
waited out its timeout though the answer sat in Redis. While callers wait, their keys are
read again once a second (one MGET for all of them) and any answer found is delivered.

Celery imports this module only where a result backend URL names it
(preheat.celery.results.REDIS_URL_PREFIX): redis-py's import is a worker's to pay only when
its results go to Redis.
"""

from __future__ import annotations

import time

from celery.backends.redis import RedisBackend
from celery.backends.redis import ResultConsumer as RedisResultConsumer

RESYNC_S = 1.0


class ResyncingResultConsumer(RedisResultConsumer):
    """Celery's Redis result consumer, and once a second the waiting keys read directly."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resynced = time.monotonic()

    def drain_events(self, timeout=None):
        super().drain_events(timeout)
        if time.monotonic() - self._resynced >= RESYNC_S:
            self._resynced = time.monotonic()
            self._resync()

    def _resync(self) -> None:
        with self._locked():
            keys = list(self.subscribed_to)
            if not keys:
                return
            try:
                found = self.backend.client.mget(keys)
            except self._connection_errors:
                return  # still away: pub/sub's own reconnect is under way
            for meta in found:
                if meta:
                    self.on_state_change(self._decode_result(meta), None)


class ResyncingRedisBackend(RedisBackend):
    ResultConsumer = ResyncingResultConsumer
