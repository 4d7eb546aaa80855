"""`preheat.infer`: a request answered by a warm worker, from the longest prefix it holds.

Two forms. The chat form takes `messages` (for a `model`, or after a `template`'s system
prompt) and every field of `/v1/chat/completions`, checked and answered by the route's own
code (workers.protocol). The template form takes a template and one user input. Each answer
names the worker that gave it, which holds the conversation's turn now (preheat.routing).
"""

from __future__ import annotations

import uuid

from preheat.catalog import current_catalog
from preheat.celery import app
from preheat.errors import PreheatError, RequestRefused
from preheat.settings import get_settings
from preheat.traffic import TRAFFIC
from tasks.arguments import InferArguments, TemplateInferArguments, chat_ask
from tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.infer", ignore_result=False, track_started=True, arguments=InferArguments)
def infer(self, template: str | None = None, user_input: str | None = None, max_new_tokens: int = 64, **fields) -> dict:
    """Messages (or template + user input) -> the answer, with its TTFT and how many prompt
    tokens came from the cache. `fields`: the chat form's or the decoding fields."""
    _count_taken(self.request, template, fields.get("model"))
    if "messages" in fields:
        return {
            **_answer_chat({**fields, **({"template": template} if template else {})}),
            "worker": self.request.hostname,
        }
    arguments = TemplateInferArguments(
        template=template, user_input=user_input, max_new_tokens=max_new_tokens, **fields
    )
    completion = get_runtime().infer(template, user_input, arguments.sampling())
    # Counted for the peak learner and `preheat templates rank`; written with the heartbeat.
    TRAFFIC.count(completion.model, template, completion.prompt_tokens, completion.cached_tokens or None)
    return {**completion.as_dict(), "worker": self.request.hostname}


def _answer_chat(fields: dict) -> dict:
    from workers.chat import system_prompt_of
    from workers.protocol import api_error

    runtime = get_runtime()
    try:
        prompt_of = lambda name: runtime.templates.resolve(name).prefix.system_prompt  # noqa: E731 (as resolved)
        ask, template = chat_ask(fields, current_catalog(get_settings().catalog), prompt_of)
        answer = runtime.answer(ask, f"chatcmpl-{uuid.uuid4().hex}")
    except Exception as exc:
        error = api_error(exc)
        if error is None:
            raise
        raise RequestRefused(error.message, int(error.status), error.code) from None
    template = template or runtime.templates.named_by(ask.model, system_prompt_of(ask.messages))
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    TRAFFIC.count(ask.model, template, usage["prompt_tokens"], cached or None)
    return answer


def _count_taken(request, template: str | None, model: str | None) -> None:
    """Which queue the request came from: this worker's own (routed here) or the shared one."""
    from preheat.celery import model_of_request, worker_queue

    routing_key = (request.delivery_info or {}).get("routing_key")
    queue = "own" if routing_key == worker_queue(request.hostname or "") else "shared"
    try:
        model = model_of_request({"template": template, "model": model})
    except PreheatError:
        return  # refused below, by name
    get_runtime().metrics.requests_taken.labels(model=model, queue=queue).inc()
