"""`preheat serve`: an OpenAI-compatible HTTP model server on the worker runtime.

- ``POST /v1/chat/completions`` (rendered with the model's chat template) and
  ``POST /v1/completions`` (raw prompts): decoding from the longest cached prefix with the
  request's sampling parameters (``workers.sampling``), stop strings, n choices and log
  probabilities, streamed as server-sent events with ``"stream": true``; usage reports
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
from workers.batch import QueueFullError
from workers.chat import ChatTemplateError
from workers.generate import Completion, TextStream
from workers.health import readiness_answer
from workers.runtime import WorkerRuntime
from workers.sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 4096
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ServeConfig:
    token: str | None = None  # /internal/*; refused while None
    api_key: str | None = None  # /v1/*; open while None
    max_body_bytes: int = 1024**2


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "code"}}."""

    def __init__(
        self, status: HTTPStatus, message: str, code: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after_s = status, message, code, retry_after_s


@dataclass(frozen=True)
class Ask:
    """One generation request, parsed and checked."""

    model: str
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...] = ()  # /v1/chat/completions
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
        # Each request's thread waits on its own stream; the forward passes run on the
        # scheduler's one thread (workers/batch.py), or on this pool's one thread when the
        # engine is sequential. A thread per request the scheduler can hold, so a request
        # past that is refused by its queue (429), not parked unseen in this pool's.
        limits = runtime.batch_limits
        threads = limits.max_running + limits.max_queued + 1 if runtime.scheduler is not None else 1
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="preheat-serve-request")
        self.metrics = ServeMetrics(runtime)
        runtime.gate_requests = True
        runtime.on_model_warm = lambda model: self.executor.submit(self._open_model, model)

    def _open_model(self, model: str) -> None:
        # On the thread that runs requests: it pays its own first-call costs before the
        # first request does (see WorkerRuntime.exercise), then the model takes traffic.
        self.runtime.exercise(model)
        self.runtime.taking_requests(model)

    def model_readiness(self, model: str) -> list[str]:
        return self.runtime.model_readiness(model)

    def readiness(self) -> list[str]:
        return self.runtime.readiness()

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


# Honour or refuse, never ignore: the request fields each route reads. A field of the OpenAI
# API not honoured here is a 400 naming it, and so is a field the API does not have (a typo
# would otherwise change nothing, silently). top_k, min_p and repetition_penalty are the
# extras vLLM serves.
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "logprobs",
    "logit_bias",
}
ROUTE_FIELDS = {
    "chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format"},
    "completions": COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"},
}
# Fields of the API preheat does not serve: refused by name, with why.
NOT_SERVED = {
    "tools": "tool calls are not served",
    "tool_choice": "tool calls are not served",
    "parallel_tool_calls": "tool calls are not served",
    "functions": "function calls are not served",
    "function_call": "function calls are not served",
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
MAX_COMPLETION_LOGPROBS = 5  # the completions API's own limit


def _refuse(name: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{name}: {why}", "unsupported_parameter")


def _invalid(name: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{name}: {why}", "invalid_value")


def check_fields(body: dict, route: str) -> None:
    """Every field is one this route reads, and one it can honour; else a 400 naming it."""
    for name in body:
        if name in NOT_SERVED:
            raise _refuse(name, NOT_SERVED[name])
        if name not in ROUTE_FIELDS[route]:
            raise _refuse(name, f"not a parameter of /v1/{'chat/completions' if route == 'chat' else 'completions'}")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _refuse("response_format", 'only {"type": "text"} is served')
    for name, default in (("echo", False), ("suffix", None)):
        if name in body and body[name] not in (default, None):
            raise _refuse(name, f"only {default!r} is served")
    if body.get("best_of") not in (None, 1, body.get("n") or 1):
        raise _refuse("best_of", "only best_of equal to n is served (no ranking of extra candidates)")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "must be an object")
    if options and (extra := set(options) - STREAM_OPTIONS):
        raise _refuse(f"stream_options.{sorted(extra)[0]}", "only include_usage is served")


def _stop_of(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _invalid("stop", "must be a string or a list of strings")
    return tuple(s for s in stop if s)


def _logit_bias_of(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise _invalid("logit_bias", "must map token ids (as strings) to numbers")
    return tuple((int(token), value) for token, value in bias.items())


def _logprobs_of(body: dict, route: str) -> int | None:
    logprobs = body.get("logprobs")
    if route == "completions":  # an integer: how many alternatives per token
        if logprobs is None:
            return None
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _invalid("logprobs", f"must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} (got {logprobs!r})")
        return logprobs
    top = body.get("top_logprobs")
    if logprobs not in (None, True, False):
        raise _invalid("logprobs", f"must be true or false (got {logprobs!r})")
    if top is not None and not logprobs:
        raise _invalid("top_logprobs", "needs logprobs: true")
    if not logprobs:
        return None
    if top is None:
        return 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _invalid("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS} (got {top!r})")
    return top


def sampling_of(body: dict, route: str) -> SamplingParams:
    """The request's decoding, every value checked (a SamplingError names its parameter)."""
    max_tokens = _int_field(body, "max_completion_tokens", 0, 0, MAX_TOKENS_LIMIT) or _int_field(
        body, "max_tokens", 64, 1, MAX_TOKENS_LIMIT
    )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            top_k=_top_k_of(body),
            min_p=body.get("min_p"),
            repetition_penalty=body.get("repetition_penalty"),
            presence_penalty=_or_zero(body, "presence_penalty"),
            frequency_penalty=_or_zero(body, "frequency_penalty"),
            seed=body.get("seed"),
            stop=_stop_of(body),
            n=body.get("n") if body.get("n") is not None else 1,
            logprobs=_logprobs_of(body, route),
            logit_bias=_logit_bias_of(body),
        )
    except SamplingError as exc:
        raise _invalid(exc.parameter, str(exc).removeprefix(f"{exc.parameter}: ")) from None


def _top_k_of(body: dict):
    top_k = body.get("top_k")
    return None if top_k == -1 else top_k  # -1: vLLM's "off"


def _or_zero(body: dict, name: str):
    value = body.get(name)
    return 0.0 if value is None else value


def _common(body: dict, route: str) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(HTTPStatus.BAD_REQUEST, "model is required (a catalog model name)", "invalid_value")
    check_fields(body, route)
    options = body.get("stream_options") or {}
    return {
        "model": model,
        "sampling": sampling_of(body, route),
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
        if extra := sorted(set(message) - {"role", "content", "name"}):
            raise _refuse(f"messages[{i}].{extra[0]}", "not served (text messages only)")
        text = _text_of(message.get("content"), f"messages[{i}]")
        if role in ("system", "developer"):
            if turns:
                raise ApiError(HTTPStatus.BAD_REQUEST, "system messages must come first", "invalid_value")
            system.append(text)
        else:
            turns.append({"role": role, "content": text})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(HTTPStatus.BAD_REQUEST, "the last message must be the user's", "invalid_value")
    # Leading system (and developer) messages are one system turn: every template knows that.
    head = [{"role": "system", "content": "\n".join(system)}] if system else []
    return Ask(messages=(*head, *turns), **_common(body, "chat"))


def parse_completion(body: dict) -> Ask:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty string", "invalid_value")
    return Ask(prompt=prompt, **_common(body, "completions"))


# Responses ----------------------------------------------------------------------------


def usage_of(completions: list[Completion]) -> dict:
    """One prompt, n answers: the prompt and its reuse counted once, the answers summed."""
    first, generated = completions[0], sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


class LogprobShapes:
    """Log probabilities in the two shapes of the API, token texts decoded one by one."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict:
        return {
            "content": [
                {
                    **self._chat_entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._chat_entry(t, v) for t, v in lp.top],
                }
                for lp in logprobs
            ]
        }

    def completion(self, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0) -> dict:
        tokens = [self._text(lp.token_id) for lp in logprobs]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None, **choice) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **choice}],
    }


def text_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None, **choice) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, **choice}],
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
        if error.retry_after_s is not None:
            self.set_header("Retry-After", str(error.retry_after_s))
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
        shapes = LogprobShapes(self.server.runtime.resident_models.get(ask.model).tokenizer)
        if ask.stream:
            await self._stream(ask, request_id, first, shapes)
            return
        try:
            completions = await self.server.run(lambda: self._collect(ask, first))
        except ApiError as exc:
            return self.fail(exc)
        if not self.cancelled.is_set():
            self.reply(HTTPStatus.OK, self._whole(ask, request_id, completions, shapes))

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
            raise ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"model {model!r} is not warm yet: {'; '.join(reasons)}",
                "warming_up",
                retry_after_s=5,
            )

    def _open(self, ask: Ask, index: int) -> TextStream:
        """Choice `index`'s stream; on the forward thread, after the choices before it (each
        later choice starts from what the ones before left cached)."""
        runtime, sampling = self.server.runtime, ask.sampling.for_choice(index)
        try:
            if ask.prompt is not None:
                return runtime.generate_text(ask.model, ask.prompt, sampling)
            return runtime.generate_chat(ask.model, ask.messages, sampling)
        except Exception as exc:
            raise self._api_error(exc) from None

    def _api_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, UnknownNameError):
            return ApiError(HTTPStatus.NOT_FOUND, str(exc), "model_not_found")
        if isinstance(exc, ChatTemplateError):
            return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "invalid_value")
        if isinstance(exc, ValueError):  # longer than the context, …
            return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "context_length_exceeded")
        if isinstance(exc, QueueFullError):
            return ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), "queue_full", retry_after_s=exc.retry_after_s)
        if isinstance(exc, DeviceOutOfMemory):
            return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "out_of_memory", retry_after_s=5)
        if isinstance(exc, PreheatError):
            return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "model_unavailable")
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
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            await self._send(
                {
                    "id": request_id,
                    "object": kind,
                    "created": int(time.time()),
                    "model": ask.model,
                    "choices": [],
                    "usage": usage_of(completions),
                }
            )
        await self._send_raw("data: [DONE]\n\n")
        self.finish()

    async def _send_event(self, ask: Ask, request_id: str, shapes: LogprobShapes, kind: str, index: int, value):
        if kind == "start":
            if self.chat:
                await self._send(chat_chunk(request_id, ask.model, {"role": "assistant", "content": ""}, index=index))
            return
        if kind == "end":
            chunk = chat_chunk if self.chat else text_chunk
            await self._send(chunk(request_id, ask.model, {} if self.chat else "", value.finish_reason, index=index))
            return
        logprobs = None
        if ask.sampling.logprobs is not None:
            logprobs = shapes.chat(value.logprobs) if self.chat else shapes.completion(value.logprobs)
        if self.chat:
            await self._send(chat_chunk(request_id, ask.model, {"content": value.text}, index=index, logprobs=logprobs))
        else:
            await self._send(text_chunk(request_id, ask.model, value.text, index=index, logprobs=logprobs))

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

    def _whole(self, ask: Ask, request_id: str, completions: list[Completion], shapes: LogprobShapes) -> dict:
        choices = []
        for index, completion in enumerate(completions):
            logprobs = None
            if ask.sampling.logprobs is not None:
                logprobs = shapes.chat(completion.logprobs) if self.chat else shapes.completion(completion.logprobs)
            if self.chat:
                message = {"role": "assistant", "content": completion.text}
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": completion.text,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                    }
                )
        first = completions[0]
        return {
            "id": request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": ask.model,
            "choices": choices,
            "usage": usage_of(completions),
            "preheat": {"ttft_ms": first.ttft_ms, "total_ms": first.total_ms},
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
