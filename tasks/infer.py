"""`preheat.infer`: a request answered from the template's cached prefix."""

from __future__ import annotations

from preheat.celery import app
from tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.infer", ignore_result=False)
def infer(self, template: str, user_input: str, max_new_tokens: int = 64) -> dict:
    """Template + user input -> completion, with its TTFT and how many tokens came from the cache."""
    return get_runtime().infer(template, user_input, max_new_tokens).as_dict()
