"""The OpenAI protocol: every parameter honoured (it reaches the sampling parameters with
its value) or refused by name, never ignored. Pure parsing, no model:
tests/workers/test_serve.py sends them to a real server."""

from __future__ import annotations

import pytest

from preheat.api.requests import ApiError, parse_body, parse_chat, parse_completion
from preheat.api.sampling import SamplingParams

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Once", **fields}


@pytest.mark.parametrize(
    ("fields", "honoured"),
    [
        ({}, SamplingParams()),
        (
            {"temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"]},
            SamplingParams(temperature=0.7, top_p=0.9, seed=1, stop=("\n",)),
        ),
        ({"temperature": 1, "top_k": 20, "min_p": 0.05}, SamplingParams(temperature=1, top_k=20, min_p=0.05)),
        ({"top_k": -1}, SamplingParams()),  # vLLM's "off"
        (
            {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2},
            SamplingParams(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2),
        ),
        ({"stop": "END"}, SamplingParams(stop=("END",))),
        ({"stop": None}, SamplingParams()),
        ({"max_completion_tokens": 8}, SamplingParams(max_tokens=8)),
        ({"max_tokens": 9}, SamplingParams(max_tokens=9)),
        ({"n": 3}, SamplingParams(n=3)),
        ({"logprobs": True}, SamplingParams(logprobs=0)),
        ({"logprobs": True, "top_logprobs": 5}, SamplingParams(logprobs=5)),
        ({"logprobs": False}, SamplingParams()),
        ({"logit_bias": {"42": -100, "7": 3.5}}, SamplingParams(logit_bias=((42, -100), (7, 3.5)))),
        ({"response_format": {"type": "text"}}, SamplingParams()),
        ({"stream": True, "stream_options": {"include_usage": True}}, SamplingParams()),
    ],
)
def test_every_chat_parameter_honoured_reaches_the_sampling(fields, honoured):
    assert parse_chat(chat(**fields)).sampling == honoured


def test_the_messages_are_passed_as_the_template_takes_them():
    asked = parse_chat(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye", "name": "ann"},
            ]
        )
    )
    assert asked.messages == (  # as sent: the chat template decides how two system messages read
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye", "name": "ann"},
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": 2.5}, "temperature: must be in [0, 2]"),
        ({"temperature": "hot"}, "temperature: must be a number"),
        ({"top_p": 0}, "top_p: must be in (0, 1]"),
        ({"top_p": "high"}, "top_p: must be a number"),
        ({"top_k": 1.5}, "top_k: must be an integer"),
        ({"min_p": 2}, "min_p: must be in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty: must be in (0, 2]"),
        ({"presence_penalty": 3}, "presence_penalty: must be in [-2, 2]"),
        ({"seed": 1.5}, "seed: must be an integer"),
        ({"n": 0}, "n: must be an integer from 1 to 16"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop: at most 4 sequences"),
        ({"stop": [1]}, "stop: must be a string or a list of strings"),
        ({"stop": ""}, "stop: must be a string or a list of non-empty strings"),
        ({"stop": ["x", ""]}, "stop: must be a string or a list of non-empty strings"),
        ({"logprobs": 3}, "logprobs: must be true or false"),
        ({"top_logprobs": 3}, "top_logprobs: needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be an integer from 0 to 20"),
        ({"logit_bias": {"x": 1}}, "logit_bias: must map token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias: must be in [-100, 100]"),
        ({"max_tokens": 0}, "max_tokens: must be an integer from 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens: must be an integer from 1"),
        ({"stream": "false"}, "stream: must be true or false (got 'false')"),
        ({"stream": 1}, "stream: must be true or false (got 1)"),
        ({"stream_options": {"include_usage": "no"}}, "stream_options.include_usage: must be true or false"),
        ({"logit_bias": {"5": "up"}}, "logit_bias: must be a number"),
        ({"response_format": {"type": "json_object"}}, 'response_format: only {"type": "text"} is served'),
        ({"tools": [{"type": "function"}]}, "tools: tool calls are not served"),
        ({"tool_choice": "auto"}, "tool_choice: tool calls are not served"),
        ({"user": "u-1"}, "user: per-user attribution is not recorded"),
        ({"store": True}, "store: stored completions are not served"),
        ({"modalities": ["audio"]}, "modalities: only text is served"),
        ({"temprature": 0}, "temprature: not a parameter of /v1/chat/completions"),
        ({"prompt": "x"}, "prompt: not a parameter of /v1/chat/completions"),
        ({"stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk: only include_usage"),
        ({"stream_options": "yes"}, "stream_options: must be an object"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls: not served"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text: must be a"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type: only"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name: must be a non-empty"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content: must be a string"),
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
        ({"best_of": 3}, "best_of: only best_of equal to n is served"),
        ({"suffix": "end"}, "suffix: only None is served"),
        ({"messages": USER}, "messages: not a parameter of /v1/completions"),
        ({"response_format": {"type": "text"}}, "response_format: not a parameter of /v1/completions"),
        ({"max_completion_tokens": 4}, "max_completion_tokens: not a parameter of /v1/completions"),
        ({"top_logprobs": 2}, "top_logprobs: not a parameter of /v1/completions"),
        ({"logprobs": 6}, "logprobs: must be an integer from 0 to 5"),
        ({"logprobs": True}, "logprobs: must be an integer from 0 to 5"),
    ],
)
def test_a_completions_parameter_not_honoured_is_a_400_naming_it(fields, named):
    with pytest.raises(ApiError) as refused:
        parse_completion(completion(**fields))
    assert refused.value.message.startswith(named), refused.value.message


def test_the_completions_parameters_honoured():
    asked = parse_completion(completion(echo=False, best_of=2, n=2, suffix=None, logprobs=2, stop="."))
    assert asked.prompt == "Once" and asked.sampling == SamplingParams(n=2, logprobs=2, stop=(".",))


@pytest.mark.parametrize(
    ("raw", "status", "named"),
    [
        (b"[" * 100_000, 400, "body is nested deeper than 64 levels"),
        (b'{"a": ' + b"[" * 990 + b"]" * 990 + b"}", 400, "body is nested deeper than 64 levels"),
        (b"{nope", 400, "body is not JSON"),
        (b"[1]", 400, "body must be a JSON object"),
        (b'{"x": "\\ud800"}', 400, "body is not valid text"),
        (b" " * (1024**2 + 1), 413, "the limit is 1048576"),
    ],
)
def test_a_body_the_api_cannot_take_is_a_4xx_naming_why(raw, status, named):
    with pytest.raises(ApiError) as refused:
        parse_body(raw, 1024**2)
    assert refused.value.status == status and named in refused.value.message, refused.value.message


def test_logprob_bytes_are_each_tokens_own_bytes_even_half_a_character(tiny_model):
    """A token that holds part of a UTF-8 character decodes to U+FFFD alone; its bytes are
    still its own, so the bytes of an answer's tokens join into the answer's UTF-8."""
    from transformers import AutoTokenizer

    from preheat.api.answers import LogprobShapes

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    shapes = LogprobShapes(tokenizer)
    text = "Ünïcødé ✓ 包裹 🙂 and plain words"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # some token is half a character
    assert b"".join(shapes.token_bytes(i) for i in ids) == text.encode("utf-8")
    entries = [shapes._chat_entry(i, -1.0) for i in ids]
    assert all(bytes(entry["bytes"]) == shapes.token_bytes(i) for entry, i in zip(entries, ids, strict=True))
