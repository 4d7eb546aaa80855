"""The worker's health server: what Kubernetes probes and Prometheus scrapes.

- ``GET /health/live``: 200 while the process serves at all (livenessProbe).
- ``GET /health/ready``: 200 only once every catalog model is resident and every template
  pre-filled; 503 with the reasons before (readinessProbe; see deploy/k8s).
- ``GET /metrics``: Prometheus text format.

Read-only by design: nothing here takes a command, so it needs no auth. It listens on
0.0.0.0 (the kubelet's probes), so it is bounded against anyone else on the network: one
event loop (Tornado's, as `preheat serve`) in a daemon thread holds the connections, with a
header timeout, and a pool of four threads computes the answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

PATHS = ("/health/live", "/health/ready", "/metrics")


class Observable(Protocol):
    def readiness(self) -> list[str]: ...

    def render_metrics(self) -> bytes: ...


def readiness_answer(reasons: list[str]) -> tuple[HTTPStatus, dict]:
    """What /health/ready answers, here and on `preheat serve`: a probe contract, kept once."""
    if reasons:
        return HTTPStatus.SERVICE_UNAVAILABLE, {"status": "not ready", "reasons": reasons}
    return HTTPStatus.OK, {"status": "ready"}


# An event loop holds every connection (an idle or half-open one costs a socket, never a
# thread); answers are computed on a small pool, so a slow readiness (a lock held by a
# warmup) never keeps /health/live waiting. A client gets HEADER_TIMEOUT_S to send its
# request and BODY_TIMEOUT_S for a body (there is none to send: GET only).
ANSWER_THREADS = 4
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 * 1024


def _application(target: Observable, pool: ThreadPoolExecutor):
    import tornado.web

    class Handler(tornado.web.RequestHandler):
        async def get(self) -> None:
            path = self.request.path
            if path == "/health/live":
                self._json(HTTPStatus.OK, {"status": "live"})
            elif path == "/health/ready":
                reasons = await asyncio.get_running_loop().run_in_executor(pool, target.readiness)
                self._json(*readiness_answer(reasons))
            elif path == "/metrics":
                body = await asyncio.get_running_loop().run_in_executor(pool, target.render_metrics)
                self.set_header("Content-Type", CONTENT_TYPE_LATEST)
                self.finish(body)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {path!r}; try one of {list(PATHS)}"})

        def _refuse(self, *_) -> None:
            self.set_header("Allow", "GET")
            self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{self.request.method} is not allowed; use GET"})

        post = put = delete = patch = _refuse

        def _json(self, status: HTTPStatus, body: dict) -> None:
            self.set_status(status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(body).encode() + b"\n")

    def log_request(handler) -> None:
        log.debug("health %s %s %d", handler.request.remote_ip, handler.request.path, handler.get_status())

    return tornado.web.Application([(r"/.*", Handler)], log_function=log_request, server_header=False)


class HealthServer:
    """The health server on an event loop of its own, in a daemon thread. Binds at once (a
    port in use raises OSError here, for the caller to say so)."""

    def __init__(self, target: Observable, host: str = "0.0.0.0", port: int = 0) -> None:
        import tornado.netutil

        self._sockets = tornado.netutil.bind_sockets(port, host, reuse_port=False)
        self._target, self._host = target, host
        self._pool = ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="preheat-health-answer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="preheat-health", daemon=True)

    @property
    def port(self) -> int:
        return self._sockets[0].getsockname()[1]

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import tornado.httpserver

        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        server = tornado.httpserver.HTTPServer(
            _application(self._target, self._pool),
            idle_connection_timeout=HEADER_TIMEOUT_S,
            body_timeout=BODY_TIMEOUT_S,
            max_body_size=MAX_BODY_BYTES,
            max_buffer_size=MAX_BODY_BYTES,
        )
        server.add_sockets(self._sockets)
        self._ready.set()
        await self._stopped.wait()
        server.stop()
        await server.close_all_connections()

    def start(self) -> HealthServer:
        self._thread.start()
        self._ready.wait(10)
        log.info("health server on http://%s:%d (/health/live, /health/ready, /metrics)", self._host, self.port)
        return self

    def stop(self) -> None:
        """Every step runs, whatever one raises: the loop told to stop, the thread joined,
        the sockets and the pool let go."""
        try:
            if self._loop is not None and self._stopped is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._stopped.set)
                self._thread.join(5)
        except RuntimeError as exc:  # the loop already gone
            log.debug("health server loop: %s", exc)
        finally:
            for sock in self._sockets:
                sock.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
