"""`preheat serve`: an OpenAI-compatible HTTP model server on the worker runtime.

- ``POST /v1/chat/completions`` (rendered with the model's chat template) and
  ``POST /v1/completions`` (raw prompts): requests from many clients decoded together by
  the runtime's scheduler, each from its longest cached prefix, with its own sampling
  parameters, stop strings, n choices and log probabilities, streamed as server-sent
  events with ``"stream": true``; usage reports ``prompt_tokens_details.cached_tokens``.
  ``GET /v1/models`` lists the catalog's models.
- ``GET /health/live``, ``GET /health/ready`` (200 only after preload and prefill),
  ``GET /metrics``: the same answers as a Celery worker's health server.
- ``POST /internal/warmup`` (bearer token): pre-fill and probe templates, run a batch of
  warm requests through each, return the measurements.

This module is the transport: Tornado (Flower's server, already installed) serves HTTP/1.1
with keep-alive and chunked streaming on one thread; each request waits on its stream in a
thread of its own. What a request may say and how an answer looks is the protocol's
(``workers.protocol``); the forward passes are the scheduler's (``workers.scheduler``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import statistics
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus

import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST, Counter

from preheat.api.answers import LogprobShapes, stream_event, usage_chunk, whole_answer
from preheat.api.requests import MAX_TOKENS_LIMIT, ApiError, Ask, int_field, parse_body, parse_chat, parse_completion
from preheat.api.sampling import SamplingError, SamplingParams
from preheat.core.errors import UnknownNameError
from preheat.workers.engine.request import Completion, TextStream
from preheat.workers.health import readiness_answer
from preheat.workers.protocol import api_error
from preheat.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    token: str | None = None  # /internal/*; refused while None
    api_key: str | None = None  # /v1/*; open while None
    max_body_bytes: int = 1024**2


class ServeMetrics:
    def __init__(self, runtime: WorkerRuntime) -> None:
        collectors = runtime.metrics.collectors
        self.connections = Counter(
            "preheat_http_connections_opened", "TCP connections accepted by preheat serve", registry=collectors
        )
        self.requests = Counter(
            "preheat_http_requests", "HTTP requests answered by preheat serve", ["path", "code"], registry=collectors
        )


class Server:
    """The runtime, the threads requests wait in, and the settings of the routes."""

    def __init__(self, runtime: WorkerRuntime, config: ServeConfig) -> None:
        self.runtime, self.config = runtime, config
        # Each request's thread waits on its own stream; the forward passes run on the
        # scheduler's one thread. A thread per request the scheduler can hold, so a request
        # past that is refused by its queue (429), not parked unseen in this pool's.
        limits = runtime.config.batch_limits
        threads = limits.max_running + limits.max_queued + 1
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="preheat-serve-request")
        self.metrics = ServeMetrics(runtime)
        runtime.announce_to(lambda model: self.executor.submit(self._open_model, model))

    def _open_model(self, model: str) -> None:
        # The scheduler's thread pays its first-call costs before the first request does
        # (see WorkerRuntime.exercise), then the model takes traffic.
        self.runtime.exercise(model)
        self.runtime.taking_requests(model)

    def model_readiness(self, model: str) -> list[str]:
        return self.runtime.model_readiness(model)

    def readiness(self) -> list[str]:
        return self.runtime.readiness()

    async def run(self, work: Callable[[], object]):
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)


# Handlers -----------------------------------------------------------------------------


class BaseHandler(tornado.web.RequestHandler):
    server: Server

    def initialize(self, server: Server) -> None:
        self.server = server

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Server", "preheat")

    def on_finish(self) -> None:
        self.server.metrics.requests.labels(path=self.request.path, code=str(self.get_status())).inc()

    def reply(self, status: HTTPStatus, body: dict) -> None:
        self.set_status(status)
        self.finish(json.dumps(body) + "\n")

    def fail(self, error: ApiError) -> None:
        if error.retry_after_s is not None:
            self.set_header("Retry-After", str(error.retry_after_s))
        self.reply(error.status, error.body())

    def write_error(self, status_code: int, **kwargs) -> None:
        reason = HTTPStatus(status_code)
        self.finish(json.dumps({"error": {"message": reason.phrase, "type": "http_error", "code": None}}) + "\n")

    def require_bearer(self, expected: str | None, missing_reason: str | None) -> None:
        """Constant-time comparison; the same 401 for a missing and a wrong token."""
        if expected is None:
            if missing_reason is None:
                return
            raise ApiError(HTTPStatus.UNAUTHORIZED, missing_reason, "unauthorized")
        given = self.request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
            self.set_header("WWW-Authenticate", 'Bearer realm="preheat"')
            raise ApiError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required", "unauthorized")

    def json_body(self) -> dict:
        return parse_body(self.request.body, self.server.config.max_body_bytes)


class LiveHandler(BaseHandler):
    def get(self) -> None:
        self.reply(HTTPStatus.OK, {"status": "live"})


class ReadyHandler(BaseHandler):
    def get(self) -> None:
        self.reply(*readiness_answer(self.server.readiness()))


class MetricsHandler(BaseHandler):
    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(self.server.runtime.render_metrics())


class ModelsHandler(BaseHandler):
    def get(self) -> None:
        try:
            self.require_bearer(self.server.config.api_key, None)
        except ApiError as exc:
            return self.fail(exc)
        runtime = self.server.runtime
        resident, catalog = runtime.resident_models.resident, runtime.catalog
        models = [
            {"id": name, "object": "model", "owned_by": "preheat", "ready": name in resident} for name in catalog.models
        ]
        # Its adapters as vLLM lists them: `parent` the base model, `root` the adapter's folder.
        adapters = [
            {
                "id": adapter,
                "object": "model",
                "owned_by": "preheat",
                "parent": model,
                "root": catalog.adapter_path(adapter),
                "ready": adapter in runtime.adapters.slots[model].resident,
            }
            for model, spec in catalog.models.items()
            for adapter in spec.adapters
        ]
        self.reply(HTTPStatus.OK, {"object": "list", "data": models + adapters})


class GenerateHandler(BaseHandler):
    """What /v1/completions and /v1/chat/completions share: auth, gating, n choices, streaming."""

    chat = True

    def initialize(self, server: Server) -> None:
        super().initialize(server)
        self.cancelled = threading.Event()

    def on_connection_close(self) -> None:
        self.cancelled.set()  # the client went away: stop decoding for it

    async def post(self) -> None:
        try:
            self.require_bearer(self.server.config.api_key, None)
            ask = parse_chat(self.json_body()) if self.chat else parse_completion(self.json_body())
            self._check_model_ready(ask.model)
            first = await self.server.run(lambda: self._open(ask, 0))
        except ApiError as exc:
            return self.fail(exc)
        request_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        base, _ = self.server.runtime.catalog.base_and_adapter(ask.model)
        shapes = LogprobShapes(self.server.runtime.resident_models.get(base).tokenizer)
        if ask.stream:
            await self._stream(ask, request_id, first, shapes)
            return
        try:
            completions = await self.server.run(lambda: self._collect(ask, first))
        except ApiError as exc:
            return self.fail(exc)
        if not self.cancelled.is_set():
            self.reply(HTTPStatus.OK, whole_answer(ask, request_id, completions, shapes))

    def _check_model_ready(self, model: str) -> None:
        runtime = self.server.runtime
        try:
            base, _ = runtime.catalog.base_and_adapter(model)  # a model, or one of its adapters
        except UnknownNameError:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"model {model!r} does not exist here (catalog has: {', '.join(runtime.catalog.models)})",
                "model_not_found",
            ) from None
        reasons = self.server.model_readiness(base)
        if reasons:
            raise ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"model {model!r} is not warm yet: {'; '.join(reasons)}",
                "warming_up",
                retry_after_s=5,
            )

    def _open(self, ask: Ask, index: int) -> TextStream:
        """Choice `index`'s stream; on the forward thread, after the choices before it (each
        later choice starts from what the ones before left cached)."""
        try:
            return self.server.runtime.open_choice(ask, index)
        except Exception as exc:
            raise self._api_error(exc) from None

    @staticmethod
    def _api_error(exc: Exception) -> ApiError:
        if (error := api_error(exc)) is not None:
            return error
        log.exception("request failed")
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}", "internal_error")

    def _collect(self, ask: Ask, first: TextStream) -> list[Completion]:
        completions = []
        for index in range(ask.sampling.n):
            stream = first if index == 0 else self._open(ask, index)
            try:
                for _ in stream:
                    if self.cancelled.is_set():  # the client went away: its row is freed now
                        stream.close()
                        return completions
                completions.append(stream.completion)
            except Exception as exc:
                raise self._api_error(exc) from None
        return completions

    async def _stream(self, ask: Ask, request_id: str, first: TextStream, shapes: LogprobShapes) -> None:
        """Server-sent events, choice after choice. A failure after the first byte ends the
        stream with an error event and [DONE], never a silent cut."""
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def produce() -> None:
            try:
                for index in range(ask.sampling.n):
                    stream = first if index == 0 else self._open(ask, index)
                    loop.call_soon_threadsafe(events.put_nowait, ("start", index, None))
                    for piece in stream:
                        loop.call_soon_threadsafe(events.put_nowait, ("piece", index, piece))
                        if self.cancelled.is_set():
                            stream.close()  # its row is freed at the next step
                            return
                    loop.call_soon_threadsafe(events.put_nowait, ("end", index, stream.completion))
            except Exception as exc:
                loop.call_soon_threadsafe(events.put_nowait, ("error", None, self._api_error(exc)))
            finally:
                loop.call_soon_threadsafe(events.put_nowait, None)

        producing = loop.run_in_executor(self.server.executor, produce)
        completions: list[Completion] = []
        while (event := await events.get()) is not None:
            kind, index, value = event
            if kind == "error":
                await self._send({"error": {"message": value.message, "type": "server_error", "code": value.code}})
                break
            if kind == "end":
                completions.append(value)
            await self._send_event(ask, request_id, shapes, kind, index, value)
        await producing
        if completions and len(completions) == ask.sampling.n and ask.include_usage:
            await self._send(usage_chunk(ask, request_id, completions))
        await self._send_raw("data: [DONE]\n\n")
        self.finish()

    async def _send_event(self, ask: Ask, request_id: str, shapes: LogprobShapes, kind: str, index: int, value):
        if (chunk := stream_event(ask, request_id, shapes, kind, index, value)) is not None:
            await self._send(chunk)

    async def _send(self, payload: dict) -> None:
        await self._send_raw(f"data: {json.dumps(payload)}\n\n")

    async def _send_raw(self, text: str) -> None:
        if self.cancelled.is_set():
            return
        self.write(text)
        try:
            await self.flush()
        except tornado.iostream.StreamClosedError:
            self.cancelled.set()


class ChatHandler(GenerateHandler):
    chat = True


class CompletionsHandler(GenerateHandler):
    chat = False


class WarmupHandler(BaseHandler):
    """Pre-fill and probe templates, then a batch of warm requests through each."""

    async def post(self) -> None:
        try:
            self.require_bearer(
                self.server.config.token, "internal endpoints are disabled: this server has no PREHEAT_SERVE_TOKEN"
            )
            templates, batch_size, max_tokens = self._parse(self.json_body())
        except (ApiError, SamplingError) as exc:
            return self.fail(api_error(exc))
        results = {}
        for template in templates:
            results[template] = await self.server.run(lambda t=template: self._warm(t, batch_size, max_tokens))
        self.reply(HTTPStatus.OK, {"templates": results, "ready": not self.server.readiness()})

    def _parse(self, body: dict) -> tuple[list[str], int, int]:
        catalog = self.server.runtime.catalog
        templates = body.get("templates") or list(catalog.templates)
        if not isinstance(templates, list) or not all(isinstance(t, str) for t in templates):
            raise ApiError(HTTPStatus.BAD_REQUEST, "templates must be a list of template names", "invalid_value")
        unknown = [t for t in templates if t not in catalog.templates]
        if unknown:  # nothing runs when one name is wrong
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"unknown template(s): {', '.join(unknown)} (catalog has: {', '.join(catalog.templates)})",
                "template_not_found",
            )
        return (
            list(dict.fromkeys(templates)),
            int_field(body, "batch_size", 4, 1, 64),
            int_field(body, "max_tokens", 20, 1, MAX_TOKENS_LIMIT),
        )

    def _warm(self, template: str, batch_size: int, max_tokens: int) -> dict:
        runtime = self.server.runtime
        result = runtime.warm_template(template)
        record = {"status": result.status, **result.as_record()}
        if result.status == "failed":
            return record
        probe, sampling = runtime.catalog.template(template).probe, SamplingParams(max_tokens=max_tokens)
        done = [runtime.generate(template, probe, sampling).collect() for _ in range(batch_size)]
        record["requests"] = {
            "count": len(done),
            "ttft_ms": statistics.median(c.ttft_ms for c in done),
            "total_ms": statistics.median(c.total_ms for c in done),
            "cached_tokens": min(c.cached_tokens for c in done),
        }
        return record


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        self.fail(ApiError(HTTPStatus.NOT_FOUND, f"no route {self.request.method} {self.request.path}", "not_found"))


class _CountingHTTPServer(tornado.httpserver.HTTPServer):
    def initialize(self, *args, metrics: ServeMetrics, **kwargs) -> None:
        super().initialize(*args, **kwargs)
        self._metrics = metrics

    def handle_stream(self, stream, address) -> None:
        self._metrics.connections.inc()
        # Small SSE writes must not wait on Nagle for the client's delayed ACK.
        stream.set_nodelay(True)
        super().handle_stream(stream, address)


def make_app(server: Server) -> tornado.web.Application:
    routes = [
        ("/health/live", LiveHandler),
        ("/health/ready", ReadyHandler),
        ("/metrics", MetricsHandler),
        ("/v1/models", ModelsHandler),
        ("/v1/chat/completions", ChatHandler),
        ("/v1/completions", CompletionsHandler),
        ("/internal/warmup", WarmupHandler),
    ]
    return tornado.web.Application(
        [(path, handler, {"server": server}) for path, handler in routes],
        default_handler_class=NotFoundHandler,
        default_handler_args={"server": server},
    )


def listen(server: Server, host: str, port: int, ssl_context=None) -> tuple[tornado.httpserver.HTTPServer, int]:
    """Bind (port 0 picks a free one) on the current IOLoop; returns the server and its port."""
    http = _CountingHTTPServer(
        make_app(server),
        ssl_options=ssl_context,
        metrics=server.metrics,
        # Bodies over our limit get a 413 with the reason; Tornado's own cap,
        # well above, drops absurd ones before reading them.
        max_body_size=max(4 * server.config.max_body_bytes, 8 * 1024**2),
        idle_connection_timeout=300,
    )
    sockets = tornado.netutil.bind_sockets(port, address=host)
    http.add_sockets(sockets)
    return http, sockets[0].getsockname()[1]
