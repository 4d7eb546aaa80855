"""The OpenAI parameters `preheat serve` reads: honoured or refused by name, never ignored.
Pure parsing, no model: tests/workers/test_serve.py sends a few of these to a real server."""

from __future__ import annotations

import pytest

from workers.serve import ApiError, parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Once", **fields}


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0},
        {"top_p": 1},
        {"top_p": 0.9},  # greedy's argmax is in every nucleus: the answer is exactly as asked
        {"seed": 7},  # greedy gives the same answer for every seed
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"stop": None},
        {"stop": []},
        {"logprobs": False},
        {"response_format": {"type": "text"}},
        {"n": 1, "stream": True, "stream_options": {"include_usage": True}},
        {"max_completion_tokens": 8},
    ],
)
def test_what_greedy_decoding_honours_is_accepted(fields):
    assert parse_chat(chat(**fields)).model == "tiny"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stop": ["\n"]}, "stop: stop sequences are not served yet"),
        ({"stop": "\n"}, "stop: stop sequences are not served yet"),
        ({"logprobs": True}, "logprobs: log probabilities are not served yet"),
        ({"top_logprobs": 3}, "logprobs: log probabilities are not served yet"),
        ({"response_format": {"type": "json_object"}}, 'response_format: only {"type": "text"} is served'),
        ({"presence_penalty": 0.5}, "presence_penalty: penalties are not served yet"),
        ({"frequency_penalty": -1}, "frequency_penalty: penalties are not served yet"),
        ({"top_p": 0}, "top_p: must be a number in (0, 1]"),
        ({"top_p": "high"}, "top_p: must be a number in (0, 1]"),
        ({"seed": 1.5}, "seed: must be an integer"),
        ({"tools": [{"type": "function"}]}, "tools: tool calls are not served"),
        ({"tool_choice": "auto"}, "tool_choice: tool calls are not served"),
        ({"logit_bias": {"50256": -100}}, "logit_bias: logit_bias is not served"),
        ({"user": "u-1"}, "user: per-user attribution is not recorded"),
        ({"store": True}, "store: stored completions are not served"),
        ({"modalities": ["audio"]}, "modalities: only text is served"),
        ({"temprature": 0}, "temprature: not a parameter of /v1/chat/completions"),
        ({"prompt": "x"}, "prompt: not a parameter of /v1/chat/completions"),
        ({"stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk: only include_usage"),
    ],
)
def test_a_chat_parameter_not_honoured_is_a_400_naming_it(fields, named):
    with pytest.raises(ApiError) as refused:
        parse_chat(chat(**fields))
    assert refused.value.status == 400 and refused.value.message.startswith(named), refused.value.message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"echo": True}, "echo: only False is served"),
        ({"best_of": 3}, "best_of: only 1 is served"),
        ({"suffix": "end"}, "suffix: only None is served"),
        ({"messages": USER}, "messages: not a parameter of /v1/completions"),
        ({"response_format": {"type": "text"}}, "response_format: not a parameter of /v1/completions"),
        ({"stop": ["."]}, "stop: stop sequences are not served yet"),
    ],
)
def test_a_completions_parameter_not_honoured_is_a_400_naming_it(fields, named):
    with pytest.raises(ApiError) as refused:
        parse_completion(completion(**fields))
    assert refused.value.message.startswith(named), refused.value.message
    assert parse_completion(completion(echo=False, best_of=1, suffix=None)).prompt == "Once"
