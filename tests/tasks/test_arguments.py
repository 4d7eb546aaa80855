"""Task arguments are untrusted input: every task checks them against its schema before its
body runs, and anything else is one clear BadTaskArguments, never a crash (hypothesis)."""

from __future__ import annotations

import inspect
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tasks.endpoints
import tasks.infer
import tasks.warmup  # noqa: F401
from preheat.celery import BadTaskArguments, app
from preheat.text import not_text_at

# Any code point, lone surrogates included: what a message's JSON can carry ("\ud800").
any_text = st.text(st.characters(exclude_categories=()), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)

VALID = {
    "preheat.warm_worker": {
        "run_id": str(uuid.uuid4()),
        "worker": "gpu0@node-1",
        "templates": ["support"],
        "only_if_cold": True,
    },
    "preheat.warm_endpoint": {
        "run_id": str(uuid.uuid4()),
        "endpoint": "vllm",
        "templates": ["support"],
        "base_url": "http://10.0.0.5:8000/v1",
        "target": "vllm@10.0.0.5:8000",
    },
    "preheat.keep_alive_endpoint": {"endpoint": "vllm"},
    "preheat.sleep_worker": {"run_id": str(uuid.uuid4()), "worker": "gpu0@node-1", "models": ["llama"], "level": 2},
    "preheat.wake_worker": {
        "run_id": str(uuid.uuid4()),
        "worker": "gpu0@node-1",
        "models": ["llama"],
        "templates": ["support"],
    },
    "preheat.sleep_endpoint": {"run_id": str(uuid.uuid4()), "endpoint": "vllm", "level": 1},
    "preheat.wake_endpoint": {"run_id": str(uuid.uuid4()), "endpoint": "vllm", "templates": ["support"]},
    "preheat.infer": {"template": "support", "user_input": "Where is my parcel?", "max_new_tokens": 8},
    "preheat.warm_fleet": {
        "templates": ["support"],
        "trigger": "peak",
        "detail": {"schedule": "x"},
        "requested_by": "beat",
        "workers": ["gpu0@node-1"],
        "only_if_cold": False,
    },
}
TASKS = sorted(VALID)


def test_every_task_has_a_schema_and_accepts_what_preheat_sends():
    assert sorted(name for name in app.tasks if name.startswith("preheat.")) == TASKS
    for name in TASKS:
        task = app.tasks[name]
        assert task.arguments is not None, f"{name} checks nothing"
        assert task.checked((), VALID[name]) == VALID[name]


@pytest.mark.parametrize("name", TASKS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_garbage_arguments_are_one_clear_error(name, data):
    task = app.tasks[name]
    parameters = list(inspect.signature(task.run).parameters)
    # Valid arguments with some replaced or added, or arguments made up from nothing.
    mutated = dict(VALID[name])
    for key in data.draw(st.lists(st.sampled_from([*parameters, "surprise"]), max_size=3)):
        mutated[key] = data.draw(json_values)
    kwargs = data.draw(
        st.sampled_from([mutated, data.draw(st.dictionaries(st.sampled_from(parameters), json_values, max_size=5))])
    )
    try:
        task.checked((), kwargs)
    except BadTaskArguments as exc:
        assert str(exc).startswith(f"{name}: ") and len(str(exc)) < 400
    else:  # accepted: then every value has the schema's type, and every string is text
        task.arguments.model_validate({**kwargs})
        assert not_text_at(kwargs) is None


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("preheat.warm_worker", {"run_id": "'; DROP TABLE warmup_runs; --"}, "run_id"),
        ("preheat.warm_worker", {"templates": []}, "templates"),
        ("preheat.warm_worker", {"only_if_cold": "yes"}, "only_if_cold"),
        ("preheat.warm_worker", {"templates": ["../../etc/passwd"]}, "templates.0"),
        ("preheat.infer", {"max_new_tokens": 0}, "max_new_tokens"),
        ("preheat.infer", {"max_new_tokens": -5}, "max_new_tokens"),
        ("preheat.infer", {"user_input": "x" * 200_001}, "user_input"),
        ("preheat.infer", {"user_input": b"\xff\xfe".decode("latin-1") * 2}, None),  # odd text is still text
        ("preheat.infer", {"user_input": "parcel \ud800 late"}, "user_input is not valid text"),
        ("preheat.infer", {"temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"]}, None),
        ("preheat.infer", {"temperature": 5.0}, "temperature: must be in"),
        ("preheat.infer", {"top_k": "20"}, "top_k"),
        ("preheat.infer", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("preheat.infer", {"logprobs": 2}, "logprobs: Extra inputs"),  # not a parameter of this task
        ("preheat.warm_worker", {"worker": "gpu0@node\udcff"}, "worker is not valid text"),
        ("preheat.warm_fleet", {"detail": {"note": "\udcfe"}}, "detail.note is not valid text"),
        ("preheat.warm_endpoint", {"base_url": "file:///etc/passwd"}, "base_url"),
        ("preheat.warm_fleet", {"trigger": "cron"}, "trigger"),
        ("preheat.sleep_worker", {"level": 3}, "level"),
        ("preheat.sleep_worker", {"models": []}, "models"),
        ("preheat.sleep_endpoint", {"level": 0}, "level"),
        ("preheat.wake_endpoint", {"templates": []}, "templates"),
    ],
)
def test_bad_values_name_the_argument(name, change, message):
    task = app.tasks[name]
    if message is None:
        task.checked((), {**VALID[name], **change})
        return
    with pytest.raises(BadTaskArguments, match=message):
        task.checked((), {**VALID[name], **change})


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Where is my parcel?"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, None),
        # The fields of /v1/chat/completions, in the types clients send (integer temperature).
        ({"temperature": 0, "max_tokens": 16, "n": 2, "seed": 3, "stop": "\n", "logprobs": True}, None),
        ({"top_logprobs": 2, "logprobs": True, "logit_bias": {"5": -100}, "max_completion_tokens": 8}, None),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, None),
        ({"template": "support", "model": None}, None),  # the template's model is the request's
        ({"template": "support"}, None),
        # Refused by name, in the route's own words.
        ({"tools": [{"type": "function"}]}, "tools: tool calls are not served"),
        ({"stream": True}, "stream: a task returns the whole answer"),
        ({"max_new_tokens": 8}, "max_new_tokens: the template form's field"),
        ({"user_input": "x"}, "user_input: the template form's field"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role must be one of"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "the last message must be the user's"),
        ({"temperature": 5}, "temperature: must be in"),
        ({"max_tokens": "16"}, "max_tokens: must be an integer"),
        ({"frobnicate": 1}, "frobnicate: not a parameter of /v1/chat/completions"),
        ({"model": "nope"}, None),  # which models exist is the worker's to say (a 404 there)
        ({"template": "nope"}, "unknown template 'nope'"),
        ({"template": "support", "model": "other"}, "model: template 'support' is for model 'tiny'"),
        (
            {"template": "support", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]},
            r"messages\[0\].role: template 'support' gives the system prompt",
        ),
        ({"messages": [{"role": "user", "content": "parcel \ud800"}]}, "messages.0.content is not valid text"),
    ],
)
def test_the_chat_form_is_checked_as_the_http_route_checks_its_body(embedded_stack, change, message):
    """preheat.infer's chat form: one schema with /v1/chat/completions, its refusals by name."""
    task = app.tasks["preheat.infer"]
    kwargs = {key: value for key, value in {**CHAT, **change}.items() if value is not None}
    if message is None:
        assert task.checked((), kwargs) == kwargs
        return
    with pytest.raises(BadTaskArguments, match=message):
        task.checked((), kwargs)
