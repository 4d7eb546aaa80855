"""`preheat serve`: an OpenAI-compatible HTTP model server on the worker runtime.

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: greedy decoding from the
  cached prefix, streamed as server-sent events with ``"stream": true``; usage reports
  ``prompt_tokens_details.cached_tokens``. ``GET /v1/models`` lists the catalog's models.
- ``GET /health/live``, ``GET /health/ready`` (200 only after preload and prefill),
  ``GET /metrics``: the same answers as a Celery worker's health server.
- ``POST /internal/warmup`` (bearer token): pre-fill and probe templates, run a batch of
  warm requests through each, return the measurements.

Tornado (Flower's server, already installed) serves HTTP/1.1 with keep-alive and chunked
streaming on one thread; the forward passes run on one executor thread, one at a time: a
device computes one request at a time here (batching is not this server's job).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import statistics
import threading
import time
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

from preheat.errors import DeviceOutOfMemory, PreheatError, UnknownNameError
from preheat.text import not_text_at
from workers.generate import Completion, TextStream
from workers.health import readiness_answer
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 4096
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ServeConfig:
    token: str | None = None  # /internal/*; refused while None
    api_key: str | None = None  # /v1/*; open while None
    max_body_bytes: int = 1024**2


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: HTTPStatus, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Ask:
    """One generation request, parsed and checked."""

    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    system_prompt: str | None = None
    user_input: str = ""
    prompt: str | None = None  # /v1/completions


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
    """The runtime, the one thread that runs forward passes, and the settings of the routes."""

    def __init__(self, runtime: WorkerRuntime, config: ServeConfig) -> None:
        self.runtime, self.config = runtime, config
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="preheat-serve-forward")
        self.metrics = ServeMetrics(runtime)
        self._serving: set[str] = set()
        runtime.on_model_warm = lambda model: self.executor.submit(self._open_model, model)

    def _open_model(self, model: str) -> None:
        # On the thread that runs requests: it pays its own first-call costs before the
        # first request does (see WorkerRuntime.exercise), then the model takes traffic.
        self.runtime.exercise(model)
        self._serving.add(model)
        log.info("model %s takes requests", model)

    def model_readiness(self, model: str) -> list[str]:
        reasons = self.runtime.model_readiness(model)
        if not reasons and model not in self._serving:
            reasons.append(f"model {model}: the serving thread is not warmed yet")
        return reasons

    def readiness(self) -> list[str]:
        return [reason for model in self.runtime.catalog.models for reason in self.model_readiness(model)]

    async def run(self, work: Callable[[], object]):
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)


# Parsing ------------------------------------------------------------------------------


def _int_field(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, f"{name} must be an integer from {low} to {high} (got {value!r})", "invalid_value"
        )
    return value


# Honour or refuse, never ignore: the request fields each route reads, and what each may hold
# while decoding is greedy. A field of the OpenAI API not honoured here is a 400 naming it,
# and so is a field the API does not have (a typo would otherwise change nothing, silently).
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logprobs",
}
ROUTE_FIELDS = {
    "chat": COMMON_FIELDS | {"messages", "top_logprobs", "response_format"},
    "completions": COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"},
}
# Fields of the API preheat does not serve yet: refused by name, with why.
NOT_SERVED = {
    "tools": "tool calls are not served",
    "tool_choice": "tool calls are not served",
    "parallel_tool_calls": "tool calls are not served",
    "functions": "function calls are not served",
    "function_call": "function calls are not served",
    "logit_bias": "logit_bias is not served",
    "user": "per-user attribution is not recorded",
    "metadata": "stored completions are not served",
    "store": "stored completions are not served",
    "service_tier": "service tiers are not served",
    "modalities": "only text is served",
    "audio": "only text is served",
    "prediction": "predicted outputs are not served",
    "reasoning_effort": "reasoning effort is not served",
    "web_search_options": "web search is not served",
}
STREAM_OPTIONS = {"include_usage"}


def _refuse(name: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{name}: {why}", "unsupported_parameter")


def check_fields(body: dict, route: str) -> None:
    """Every field is one this route honours, with a value it can honour; else a 400 naming it."""
    for name in body:
        if name in NOT_SERVED:
            raise _refuse(name, NOT_SERVED[name])
        if name not in ROUTE_FIELDS[route]:
            raise _refuse(name, f"not a parameter of /v1/{'chat/completions' if route == 'chat' else 'completions'}")
    # Under greedy decoding these hold exactly as asked: the argmax is inside any nucleus, and
    # the answer is the same for every seed. Anything else changes the answer: refused.
    if (top_p := body.get("top_p")) is not None and not (_number(top_p) and 0 < top_p <= 1):
        raise _refuse("top_p", f"must be a number in (0, 1] (got {top_p!r})")
    if (seed := body.get("seed")) is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _refuse("seed", f"must be an integer (got {seed!r})")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if body.get(penalty) not in (None, 0, 0.0):
            raise _refuse(penalty, "penalties are not served yet: only 0 (greedy decoding)")
    if body.get("stop") not in (None, [], ""):
        raise _refuse("stop", "stop sequences are not served yet; the answer ends at end-of-sequence or max_tokens")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _refuse("logprobs", "log probabilities are not served yet")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _refuse("response_format", 'only {"type": "text"} is served')
    for name, default in (("echo", False), ("best_of", 1), ("suffix", None)):
        if name in body and body[name] not in (default, None):
            raise _refuse(name, f"only {default!r} is served")
    options = body.get("stream_options") or {}
    if isinstance(options, dict) and (extra := set(options) - STREAM_OPTIONS):
        raise _refuse(f"stream_options.{sorted(extra)[0]}", "only include_usage is served")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _common(body: dict) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(HTTPStatus.BAD_REQUEST, "model is required (a catalog model name)", "invalid_value")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "only greedy decoding is served: temperature must be 0 or absent",
            "unsupported_value",
        )
    if body.get("n") not in (None, 1):
        raise ApiError(HTTPStatus.BAD_REQUEST, "n must be 1", "unsupported_value")
    max_tokens = _int_field(body, "max_completion_tokens", 0, 0, MAX_TOKENS_LIMIT) or _int_field(
        body, "max_tokens", 64, 1, MAX_TOKENS_LIMIT
    )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "stream_options must be an object", "invalid_value")
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": bool(body.get("stream", False)),
        "include_usage": bool(options.get("include_usage", False)),
    }


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ApiError(
        HTTPStatus.BAD_REQUEST, f"{where}: content must be a string or a list of text parts", "invalid_value"
    )


def parse_chat(body: dict) -> Ask:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", "invalid_value")
    system, turns = [], []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].role must be one of {list(ROLES)}", "invalid_value")
        text = _text_of(message.get("content"), f"messages[{i}]")
        if role == "system":
            if turns:
                raise ApiError(HTTPStatus.BAD_REQUEST, "system messages must come first", "invalid_value")
            system.append(text)
        else:
            turns.append((role, text))
    if not turns or turns[-1][0] != "user":
        raise ApiError(HTTPStatus.BAD_REQUEST, "the last message must be the user's", "invalid_value")
    # One user turn is the user's text as a template request has it; a conversation is
    # rendered turn by turn after the system prompt.
    user_input = (
        turns[0][1] if len(turns) == 1 else "\n\n".join(f"{r.title()}: {t}" for r, t in turns) + "\n\nAssistant:"
    )
    check_fields(body, "chat")
    return Ask(system_prompt="\n".join(system) or None, user_input=user_input, **_common(body))


def parse_completion(body: dict) -> Ask:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty string", "invalid_value")
    check_fields(body, "completions")
    return Ask(prompt=prompt, **_common(body))


# Responses ----------------------------------------------------------------------------


def usage_of(completion: Completion) -> dict:
    generated = len(completion.token_ids)
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": completion.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
    }


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def text_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


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
        self.reply(
            error.status,
            {
                "error": {
                    "message": error.message,
                    "type": error.status.phrase.lower().replace(" ", "_"),
                    "code": error.code,
                }
            },
        )

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
        if len(self.request.body) > self.server.config.max_body_bytes:
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body is {len(self.request.body)} bytes; the limit is {self.server.config.max_body_bytes}",
                "body_too_large",
            )
        try:
            body = json.loads(self.request.body.decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "body is not UTF-8", "invalid_json") from None
        except json.JSONDecodeError as exc:
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc.msg} at {exc.pos}", "invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object", "invalid_json")
        if (where := not_text_at(body)) is not None:
            # JSON may escape half a UTF-16 pair ("\ud800"): valid JSON, but no text a
            # tokenizer (or a UTF-8 database column) can take.
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"body is not valid text: a lone surrogate in {where or 'it'}", "invalid_json"
            )
        return body


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
        resident = self.server.runtime.resident_models.resident
        self.reply(
            HTTPStatus.OK,
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "owned_by": "preheat", "ready": name in resident}
                    for name in self.server.runtime.catalog.models
                ],
            },
        )


class GenerateHandler(BaseHandler):
    """What /v1/completions and /v1/chat/completions share: auth, gating, streaming."""

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
            stream = await self.server.run(lambda: self._open(ask))
        except ApiError as exc:
            return self.fail(exc)
        request_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        if ask.stream:
            await self._stream(ask, request_id, stream)
        else:
            completion = await self.server.run(stream.collect)
            self.reply(HTTPStatus.OK, self._whole(ask, request_id, completion))

    def _check_model_ready(self, model: str) -> None:
        runtime = self.server.runtime
        if model not in runtime.catalog.models:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"model {model!r} does not exist here (catalog has: {', '.join(runtime.catalog.models)})",
                "model_not_found",
            )
        reasons = self.server.model_readiness(model)
        if reasons:
            self.set_header("Retry-After", "5")
            raise ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"model {model!r} is not warm yet: {'; '.join(reasons)}", "warming_up"
            )

    def _open(self, ask: Ask) -> TextStream:
        runtime = self.server.runtime
        try:
            if ask.prompt is not None:
                return runtime.generate_text(ask.model, ask.prompt, ask.max_tokens)
            return runtime.generate_chat(ask.model, ask.system_prompt, ask.user_input, ask.max_tokens)
        except UnknownNameError as exc:
            raise ApiError(HTTPStatus.NOT_FOUND, str(exc), "model_not_found") from None
        except ValueError as exc:  # longer than the context, …
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), "context_length_exceeded") from None
        except DeviceOutOfMemory as exc:
            self.set_header("Retry-After", "5")
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "out_of_memory") from None
        except PreheatError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "model_unavailable") from None

    async def _stream(self, ask: Ask, request_id: str, stream: TextStream) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def produce() -> None:
            try:
                for delta in stream:
                    loop.call_soon_threadsafe(events.put_nowait, delta)
                    if self.cancelled.is_set():
                        break
            finally:
                loop.call_soon_threadsafe(events.put_nowait, None)

        producing = loop.run_in_executor(self.server.executor, produce)
        if self.chat:
            await self._send(chat_chunk(request_id, ask.model, {"role": "assistant", "content": ""}))
        while (delta := await events.get()) is not None:
            piece = (
                chat_chunk(request_id, ask.model, {"content": delta})
                if self.chat
                else text_chunk(request_id, ask.model, delta)
            )
            await self._send(piece)
        await producing
        completion = stream.completion
        last = (
            chat_chunk(request_id, ask.model, {}, completion.finish_reason)
            if self.chat
            else text_chunk(request_id, ask.model, "", completion.finish_reason)
        )
        await self._send(last)
        if ask.include_usage:
            await self._send({**last, "choices": [], "usage": usage_of(completion)})
        await self._send_raw("data: [DONE]\n\n")
        self.finish()

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

    def _whole(self, ask: Ask, request_id: str, completion: Completion) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": completion.text},
                "finish_reason": completion.finish_reason,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": completion.finish_reason}
            kind = "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": ask.model,
            "choices": [choice],
            "usage": usage_of(completion),
            "preheat": {"ttft_ms": completion.ttft_ms, "total_ms": completion.total_ms},
        }


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
        except ApiError as exc:
            return self.fail(exc)
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
            _int_field(body, "batch_size", 4, 1, 64),
            _int_field(body, "max_tokens", 20, 1, MAX_TOKENS_LIMIT),
        )

    def _warm(self, template: str, batch_size: int, max_tokens: int) -> dict:
        runtime = self.server.runtime
        result = runtime.warm_template(template)
        record = {"status": result.status, **result.as_record()}
        if result.status == "failed":
            return record
        probe = runtime.catalog.template(template).probe
        done = [runtime.generate(template, probe, max_tokens).collect() for _ in range(batch_size)]
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
