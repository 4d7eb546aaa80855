"""The OpenAI protocol on a worker: what a request's failure is for the client, and a request's
whole answer from the runtime.

The protocol itself (requests checked, answers shaped) is `preheat.api`; this is the part that
knows the engine's errors and the runtime that answers.
"""

from __future__ import annotations

from http import HTTPStatus

from preheat.api.answers import LogprobShapes, whole_answer
from preheat.api.requests import ApiError, Ask, invalid
from preheat.api.sampling import SamplingError
from preheat.core.errors import DeviceOutOfMemory, PreheatError, UnknownNameError


def api_error(exc: Exception) -> ApiError | None:
    """What a request's failure is for the client; None: a fault of the server's own."""
    from preheat.workers.engine.chat import ChatTemplateError
    from preheat.workers.engine.resident import ContextLengthError
    from preheat.workers.engine.scheduler import QueueFullError

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnknownNameError):
        return ApiError(HTTPStatus.NOT_FOUND, str(exc), "model_not_found")
    if isinstance(exc, ContextLengthError):
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "context_length_exceeded")
    if isinstance(exc, SamplingError):
        return invalid(exc.parameter, str(exc).removeprefix(f"{exc.parameter}: "))
    if isinstance(exc, ChatTemplateError):
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "invalid_value")
    if isinstance(exc, QueueFullError):
        return ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), "queue_full", retry_after_s=exc.retry_after_s)
    if isinstance(exc, DeviceOutOfMemory):
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "out_of_memory", retry_after_s=5)
    if isinstance(exc, PreheatError):
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "model_unavailable")
    if isinstance(exc, ValueError):  # what the request asked could not be done
        return ApiError(HTTPStatus.BAD_REQUEST, str(exc), "invalid_value")
    return None


def answer(runtime, ask: Ask, request_id: str) -> dict:
    """The whole answer to a parsed request, every choice, in the route's own shape
    (`chat.completion`, usage with cached_tokens): `preheat.infer`'s chat form."""
    completions = [runtime.open_choice(ask, index).collect() for index in range(ask.sampling.n)]
    shapes = LogprobShapes(runtime.resident_models.get(runtime.catalog.base_and_adapter(ask.model)[0]).tokenizer)
    return whole_answer(ask, request_id, completions, shapes)
