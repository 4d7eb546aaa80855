"""`preheat.infer`: a request answered from the template's cached prefix."""

from __future__ import annotations

from preheat.celery import app
from preheat.traffic import TRAFFIC
from tasks.arguments import InferArguments
from tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.infer", ignore_result=False, arguments=InferArguments)
def infer(self, template: str, user_input: str, max_new_tokens: int = 64, **decoding) -> dict:
    """Template + user input -> completion, with its TTFT and how many tokens came from the
    cache. `decoding`: the sampling fields of InferArguments (temperature, top_p, seed, stop, …)."""
    arguments = InferArguments(template=template, user_input=user_input, max_new_tokens=max_new_tokens, **decoding)
    completion = get_runtime().infer(template, user_input, arguments.sampling())
    # Counted for the peak learner and `preheat templates rank`; written with the heartbeat.
    TRAFFIC.count(completion.model, template, completion.prompt_tokens, completion.cached_tokens or None)
    return completion.as_dict()
