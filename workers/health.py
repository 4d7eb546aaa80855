"""The worker's health server: what Kubernetes probes and Prometheus scrapes.

- ``GET /health/live``: 200 while the process serves at all (livenessProbe).
- ``GET /health/ready``: 200 only once every catalog model is resident and every template
  pre-filled; 503 with the reasons before (readinessProbe; see deploy/k8s).
- ``GET /metrics``: Prometheus text format.

Read-only by design: nothing here takes a command, so it needs no auth. A stdlib threaded
server in a daemon thread, so it answers while the worker's main thread runs a forward pass.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


def _handler_for(target: Observable) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "preheat-health"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health/live":
                self._json(HTTPStatus.OK, {"status": "live"})
            elif path == "/health/ready":
                self._json(*readiness_answer(target.readiness()))
            elif path == "/metrics":
                self._send(HTTPStatus.OK, target.render_metrics(), CONTENT_TYPE_LATEST)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {path!r}; try one of {list(PATHS)}"})

        def _refuse(self) -> None:
            self._json(
                HTTPStatus.METHOD_NOT_ALLOWED,
                {"error": f"{self.command} is not allowed; use GET"},
                extra={"Allow": "GET"},
            )

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        def _json(self, status: HTTPStatus, body: dict, extra: dict | None = None) -> None:
            self._send(status, json.dumps(body).encode() + b"\n", "application/json", extra)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str, extra: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("health %s - " + fmt, self.address_string(), *args)

    return Handler


class HealthServer:
    def __init__(self, target: Observable, host: str = "0.0.0.0", port: int = 0) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler_for(target))
        self._server.daemon_threads = True
        # shutdown() waits for the serving loop to see it, once per poll interval: at the
        # default 0.5 s that was half of the 1 s an idle worker has to stop after SIGTERM.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="preheat-health", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> HealthServer:
        self._thread.start()
        log.info(
            "health server on http://%s:%d (/health/live, /health/ready, /metrics)",
            self._server.server_address[0],
            self.port,
        )
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
