"""Task arguments are untrusted input: every task parses them with its schema before its body
runs (and hands the body what was parsed), at send as at run; anything else is one clear
BadTaskArguments, never a crash (hypothesis)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import preheat.tasks.endpoints
import preheat.tasks.infer
import preheat.tasks.warmup  # noqa: F401
from preheat.celery.app import app
from preheat.celery.task import BadTaskArguments
from preheat.core.text import not_text_at

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
    "preheat.infer": {"template": "support", "user_input": "Where is my parcel?", "max_tokens": 8},
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
        parsed = task.parse(VALID[name])
        for key, value in VALID[name].items():  # what was sent is what the body is handed
            if key != "max_tokens":
                assert getattr(parsed, key) == value
    assert app.tasks["preheat.infer"].parse(VALID["preheat.infer"]).sampling.max_tokens == 8


def test_a_call_that_does_not_fit_is_refused_before_it_is_sent():
    with pytest.raises(BadTaskArguments, match="templates"):
        app.tasks["preheat.warm_worker"].apply_async(kwargs={**VALID["preheat.warm_worker"], "templates": []})
    with pytest.raises(BadTaskArguments, match="keyword arguments only"):
        app.tasks["preheat.keep_alive_endpoint"].apply_async(args=["vllm"])


@pytest.mark.parametrize("name", TASKS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_garbage_arguments_are_one_clear_error(name, data):
    task = app.tasks[name]
    parameters = list(VALID[name])
    # Valid arguments with some replaced or added, or arguments made up from nothing.
    mutated = dict(VALID[name])
    for key in data.draw(st.lists(st.sampled_from([*parameters, "surprise"]), max_size=3)):
        mutated[key] = data.draw(json_values)
    kwargs = data.draw(
        st.sampled_from([mutated, data.draw(st.dictionaries(st.sampled_from(parameters), json_values, max_size=5))])
    )
    try:
        task.parse(kwargs)
    except BadTaskArguments as exc:
        assert str(exc).startswith(f"{name}: ") and len(str(exc)) < 400
    else:  # accepted: every string is text
        assert not_text_at(kwargs) is None


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("preheat.warm_worker", {"run_id": "'; DROP TABLE warmup_runs; --"}, "run_id"),
        ("preheat.warm_worker", {"templates": []}, "templates"),
        ("preheat.warm_worker", {"only_if_cold": "yes"}, "only_if_cold"),
        ("preheat.warm_worker", {"templates": ["../../etc/passwd"]}, "templates.0"),
        ("preheat.infer", {"max_tokens": 0}, "max_tokens"),
        ("preheat.infer", {"max_tokens": -5}, "max_tokens"),
        ("preheat.infer", {"max_new_tokens": 8}, "max_new_tokens: renamed max_tokens"),
        ("preheat.infer", {"n": 2}, "n: not an argument of the template form"),
        ("preheat.infer", {"logprobs": True, "logit_bias": {"5": -100}}, None),
        ("preheat.infer", {"user_input": "x" * 200_001}, "user_input"),
        ("preheat.infer", {"user_input": b"\xff\xfe".decode("latin-1") * 2}, None),  # odd text is still text
        ("preheat.infer", {"user_input": "parcel \ud800 late"}, "user_input is not valid text"),
        ("preheat.infer", {"temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"]}, None),
        ("preheat.infer", {"temperature": 5.0}, "temperature: must be in"),
        ("preheat.infer", {"top_k": "20"}, "top_k"),
        ("preheat.infer", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("preheat.infer", {"logprobs": 2}, "logprobs: must be true or false"),
        ("preheat.infer", {"frobnicate": 2}, "frobnicate: not an argument of the template form"),
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
        task.parse({**VALID[name], **change})
        return
    with pytest.raises(BadTaskArguments, match=message):
        task.parse({**VALID[name], **change})


ABSENT = object()
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Where is my parcel?"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, None),
        # The fields of /v1/chat/completions, in the types clients send (integer temperature).
        ({"temperature": 0, "max_tokens": 16, "n": 2, "seed": 3, "stop": "\n", "logprobs": True}, None),
        ({"top_logprobs": 2, "logprobs": True, "logit_bias": {"5": -100}, "max_completion_tokens": 8}, None),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, None),
        ({"template": "support", "model": ABSENT}, None),  # the template's model is the request's
        ({"template": "support"}, None),
        # Refused by name, in the route's own words.
        ({"tools": [{"type": "function"}]}, "tools: tool calls are not served"),
        ({"stream": True}, "stream: a task returns the whole answer"),
        ({"max_new_tokens": 8}, "max_new_tokens: the template form's field"),
        ({"user_input": "x"}, "user_input: the template form's field"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": None}, "messages must be a non-empty list"),
        ({"messages": 7}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role must be one of"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, r"content\[0\].text: must be"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "the last message must be the user's"),
        ({"temperature": 5}, "temperature: must be in"),
        ({"max_tokens": "16"}, "max_tokens: must be an integer"),
        ({"frobnicate": 1}, "frobnicate: not a parameter of /v1/chat/completions"),
        ({"model": "nope"}, None),  # which models exist is the worker's to say (a 404 there)
        ({"template": "../x"}, "template: '../x' is not a catalog name"),
        ({"messages": [{"role": "user", "content": "parcel \ud800"}]}, "messages.0.content is not valid text"),
    ],
)
def test_the_chat_form_is_parsed_as_the_http_route_parses_its_body(change, message):
    """preheat.infer's chat form: one schema with /v1/chat/completions, its refusals by name."""
    task = app.tasks["preheat.infer"]
    kwargs = {key: value for key, value in {**CHAT, **change}.items() if value is not ABSENT}
    if message is None:
        parsed = task.parse(kwargs)
        assert parsed.template == kwargs.get("template")
        assert parsed.ask.model == kwargs.get("model", "")
        return
    with pytest.raises(BadTaskArguments, match=message):
        task.parse(kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"template": "support", "model": "other"}, "model: template 'support' is for model 'tiny'"),
        (
            {"template": "support", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]},
            r"messages\[0\].role: template 'support' gives the system prompt",
        ),
    ],
)
def test_a_template_leads_the_messages_and_names_the_model(change, message):
    """The domain rule of preheat's template field, applied where the template is known."""
    from preheat.api.requests import ApiError, with_template

    parsed = app.tasks["preheat.infer"].parse({**CHAT, **change})
    with pytest.raises(ApiError, match=message):
        with_template(parsed.ask, "support", "tiny", "Be brief.")
    ask = with_template(app.tasks["preheat.infer"].parse({**CHAT, "template": "support"}).ask, "support", "tiny", "Hi")
    assert ask.model == "tiny" and ask.messages[0] == {"role": "system", "content": "Hi"}
