"""The OpenAI protocol's requests, apart from any transport: bodies checked, fields read.

A field is honoured or refused by name, never ignored: one the API does not have (a typo)
and one preheat does not serve are each a 400 naming it. `preheat serve` reads its bodies
here, `preheat.infer` its arguments and the router (preheat.fleet.routing) what it sends;
nothing here imports Tornado, Celery or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus

from preheat.api.sampling import DECODING_FIELDS, MAX_TOP_LOGPROBS, SamplingError, SamplingParams
from preheat.core.text import not_text_at, shown

MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 64
ROLES = ("system", "developer", "user", "assistant")
# A body nested deeper than this is refused before Python's own recursion limit is met.
MAX_NESTING = 64


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "code"}}."""

    def __init__(
        self, status: HTTPStatus, message: str, code: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after_s = status, message, code, retry_after_s

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.status.phrase.lower().replace(" ", "_"), "code": self.code}
        }


@dataclass(frozen=True)
class Ask:
    """One generation request, parsed and checked."""

    model: str
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...] = ()  # /v1/chat/completions
    prompt: str | None = None  # /v1/completions

    @property
    def chat(self) -> bool:
        return self.prompt is None


# Honour or refuse, never ignore: the request fields each route reads.
COMMON_FIELDS = {"model", "stream", "stream_options"} | DECODING_FIELDS
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


def refuse(name: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{name}: {why}", "unsupported_parameter")


def invalid(name: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{name}: {why}", "invalid_value")


# The body ------------------------------------------------------------------------------


def parse_body(raw: bytes, max_bytes: int) -> dict:
    """A request body as the API takes it: at most `max_bytes`, UTF-8, a JSON object of
    text (JSON may escape half a UTF-16 pair, "\\ud800": valid JSON, but no text a tokenizer
    or a UTF-8 database column can take), nested no deeper than MAX_NESTING."""
    if len(raw) > max_bytes:
        raise ApiError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body is {len(raw)} bytes; the limit is {max_bytes}", "body_too_large"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "body is not UTF-8", "invalid_json") from None
    if _nesting(text) > MAX_NESTING:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"body is nested deeper than {MAX_NESTING} levels", "invalid_json")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc.msg} at {exc.pos}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object", "invalid_json")
    if (where := not_text_at(body)) is not None:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, f"body is not valid text: a lone surrogate in {where or 'it'}", "invalid_json"
        )
    return body


def _nesting(text: str) -> int:
    """How deep the brackets of a JSON text go (those inside strings too: an over-count is
    a refusal of a body no client sends, never a crash)."""
    deepest = depth = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


# Decoding fields -----------------------------------------------------------------------


def int_field(fields: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = fields.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SamplingError(name, f"must be an integer from {low} to {high} (got {shown(value)})")
    return value


def _bool_field(fields: dict, name: str) -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SamplingError(name, f"must be true or false (got {shown(value)})")
    return value


def _stop_of(fields: dict) -> tuple[str, ...]:
    stop = fields.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)  # an empty one is refused by SamplingParams: it would end every answer at once
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise SamplingError("stop", "must be a string or a list of strings")
    return tuple(stop)


def _logit_bias_of(fields: dict) -> tuple[tuple[int, float], ...]:
    bias = fields.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise SamplingError("logit_bias", "must map token ids (as strings) to numbers")
    return tuple((int(token), value) for token, value in bias.items())


def _logprobs_of(fields: dict, route: str) -> int | None:
    if route == "completions":  # an integer: how many alternatives per token
        return int_field(fields, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    top = fields.get("top_logprobs")
    if not _bool_field(fields, "logprobs"):
        if top is not None:
            raise SamplingError("top_logprobs", "needs logprobs: true")
        return None
    return 0 if top is None else int_field(fields, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)


def _max_tokens_of(fields: dict) -> int:
    newer = int_field(fields, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    return newer or int_field(fields, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS_LIMIT)


def sampling_of(fields: dict, route: str = "chat") -> SamplingParams:
    """The one mapping of decoding fields to `SamplingParams`, for every path (a body of
    /v1/*, preheat.infer's arguments, preheat infer's options); a value that cannot be
    honoured is a SamplingError naming its field. `route` says which shape logprobs has
    (chat: a boolean and top_logprobs; completions: an integer)."""
    top_k = fields.get("top_k")
    return SamplingParams(
        max_tokens=_max_tokens_of(fields),
        temperature=fields.get("temperature"),
        top_p=fields.get("top_p"),
        top_k=None if top_k == -1 else top_k,  # -1: vLLM's "off"
        min_p=fields.get("min_p"),
        repetition_penalty=fields.get("repetition_penalty"),
        presence_penalty=_or_zero(fields, "presence_penalty"),
        frequency_penalty=_or_zero(fields, "frequency_penalty"),
        seed=fields.get("seed"),
        stop=_stop_of(fields),
        n=fields.get("n") if fields.get("n") is not None else 1,
        logprobs=_logprobs_of(fields, route),
        logit_bias=_logit_bias_of(fields),
    )


def _or_zero(fields: dict, name: str):
    value = fields.get(name)
    return 0.0 if value is None else value


# Routes --------------------------------------------------------------------------------


def check_fields(body: dict, route: str) -> None:
    """Every field is one this route reads, and one it can honour; else a 400 naming it."""
    for name in body:
        if name in NOT_SERVED:
            raise refuse(name, NOT_SERVED[name])
        if name not in ROUTE_FIELDS[route]:
            raise refuse(name, f"not a parameter of /v1/{'chat/completions' if route == 'chat' else 'completions'}")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise refuse("response_format", 'only {"type": "text"} is served')
    for name, default in (("echo", False), ("suffix", None)):
        if name in body and body[name] not in (default, None):
            raise refuse(name, f"only {default!r} is served")
    if body.get("best_of") not in (None, 1, body.get("n") or 1):
        raise refuse("best_of", "only best_of equal to n is served (no ranking of extra candidates)")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    if options and (extra := set(options) - STREAM_OPTIONS):
        raise refuse(f"stream_options.{sorted(extra)[0]}", "only include_usage is served")


def _common(body: dict, route: str, *, model_optional: bool = False) -> dict:
    model = body.get("model", "" if model_optional else None)
    if not isinstance(model, str) or not (model or model_optional):
        raise ApiError(HTTPStatus.BAD_REQUEST, "model is required (a catalog model name)", "invalid_value")
    check_fields(body, route)
    try:
        return {
            "model": model,
            "sampling": sampling_of(body, route),
            "stream": _bool_field(body, "stream"),
            "include_usage": _bool_field(body.get("stream_options") or {}, "include_usage"),
        }
    except SamplingError as exc:
        name = f"stream_options.{exc.parameter}" if exc.parameter == "include_usage" else exc.parameter
        raise invalid(name, str(exc).removeprefix(f"{exc.parameter}: ")) from None


def _text_of(content, where: str) -> str:
    """A message's content as text: a string, or the text parts of a list joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}.content[{j}]", "must be a content part (an object)")
        if part.get("type") != "text":
            raise refuse(f"{where}.content[{j}].type", f"only text parts are served (got {shown(part.get('type'))})")
        if extra := sorted(set(part) - {"type", "text"}):
            raise refuse(f"{where}.content[{j}].{extra[0]}", "not served (text parts only)")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{j}].text", f"must be a string (got {shown(part.get('text'))})")
    return "".join(part["text"] for part in content)


def parse_chat(body: dict, *, model_optional: bool = False) -> Ask:
    """The messages as the chat template takes them: each role and name as the client sent
    it (two system messages stay two: the template decides how they read), text content.
    `model_optional`: a template names the model (`with_template`); the Ask's model is then
    the body's or ''."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", "invalid_value")
    parsed = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].role must be one of {list(ROLES)}", "invalid_value")
        if extra := sorted(set(message) - {"role", "content", "name"}):
            raise refuse(f"messages[{i}].{extra[0]}", "not served (text messages only)")
        turn = {"role": role, "content": _text_of(message.get("content"), f"messages[{i}]")}
        if "name" in message:
            if not isinstance(message["name"], str) or not message["name"]:
                raise invalid(f"messages[{i}].name", f"must be a non-empty string (got {shown(message['name'])})")
            turn["name"] = message["name"]
        parsed.append(turn)
    if parsed[-1]["role"] != "user":
        raise ApiError(HTTPStatus.BAD_REQUEST, "the last message must be the user's", "invalid_value")
    return Ask(messages=tuple(parsed), **_common(body, "chat", model_optional=model_optional))


def with_template(ask: Ask, template: str, model: str, system_prompt: str) -> Ask:
    """preheat's addition to the chat form: a template's system prompt leads the messages and
    its model is the request's. Another model, or a system or developer message beside it,
    is refused by name."""
    from dataclasses import replace

    if ask.model not in ("", model):
        raise invalid("model", f"template {template!r} is for model {model!r}, not {ask.model!r}")
    for i, message in enumerate(ask.messages):
        if message["role"] in ("system", "developer"):
            raise invalid(f"messages[{i}].role", f"template {template!r} gives the system prompt; send none beside it")
    system = {"role": "system", "content": system_prompt}
    return replace(ask, model=model, messages=(system, *ask.messages))


def parse_completion(body: dict) -> Ask:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty string", "invalid_value")
    return Ask(prompt=prompt, **_common(body, "completions"))
