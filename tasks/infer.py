"""`preheat.infer`: a request answered by a warm worker, from the longest prefix it holds.

Two forms. The chat form takes `messages` (for a `model`, or after a `template`'s system
prompt) and every field of `/v1/chat/completions`, parsed and answered by the route's own code
(preheat.api). The template form takes a template and one user input. Each answer names the
worker that gave it, which holds the conversation's turn now (preheat.fleet.routing).
"""

from __future__ import annotations

import uuid

from preheat.api.infer import ChatInferArguments, InferArguments, TemplateInferArguments
from preheat.api.requests import with_template
from preheat.celery.app import app
from preheat.celery.queues import worker_queue
from preheat.core.errors import RequestRefused
from preheat.fleet.traffic import TRAFFIC
from preheat.tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.infer", ignore_result=False, track_started=True, arguments=InferArguments)
def infer(self, call: ChatInferArguments | TemplateInferArguments) -> dict:
    """Messages (or template + user input) -> the answer, with its TTFT and how many prompt
    tokens came from the cache."""
    if isinstance(call, ChatInferArguments):
        return {**_answer_chat(call, self.request), "worker": self.request.hostname}
    runtime = get_runtime()
    spec = runtime.catalog.template(call.template)
    _count_taken(self.request, spec.model)
    completion = runtime.infer(call.template, call.user_input, call.sampling)
    # Counted for the peak learner and `preheat templates rank` (under its adapter, if any, as
    # the chat form counts it); written with the heartbeat.
    named = spec.adapter or spec.model
    TRAFFIC.count(named, call.template, completion.prompt_tokens, completion.cached_tokens or None)
    return {**completion.as_dict(), "model": named, "worker": self.request.hostname}


def _answer_chat(call: ChatInferArguments, request) -> dict:
    from preheat.workers.engine.chat import system_prompt_of
    from preheat.workers.protocol import answer, api_error

    runtime = get_runtime()
    try:
        ask, template = call.ask, call.template
        if template is not None:
            resolved = runtime.templates.resolve(template)
            # Its adapter's name is the request's model (vLLM's way), else the base's.
            named = resolved.spec.adapter or resolved.spec.model
            ask = with_template(ask, template, named, resolved.prefix.system_prompt)
        base, adapter = runtime.catalog.base_and_adapter(ask.model)  # an adapter is named as its model
        _count_taken(request, base)
        answered = answer(runtime, ask, f"chatcmpl-{uuid.uuid4().hex}")
    except Exception as exc:
        error = api_error(exc)
        if error is None:
            raise
        raise RequestRefused(error.message, int(error.status), error.code) from None
    template = template or runtime.templates.named_by(base, system_prompt_of(ask.messages), adapter)
    usage = answered["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    TRAFFIC.count(ask.model, template, usage["prompt_tokens"], cached or None)
    return answered


def _count_taken(request, model: str) -> None:
    """Which queue the request came from: this worker's own (routed here) or the shared one."""
    routing_key = (request.delivery_info or {}).get("routing_key")
    queue = "own" if routing_key == worker_queue(request.hostname or "") else "shared"
    get_runtime().metrics.requests_taken.labels(model=model, queue=queue).inc()
