"""The real model tier: SmolLM2-135M-Instruct (its PyPI wheel, converted here) behind `preheat serve`,
driven by the official `openai` client, every answer compared token for token with transformers
on the same ids in float32. On near-uniform random logits a sampling or stop bug hides and an
answer never re-tokenizes to its ids; on a real instruct model neither is true."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from openai import OpenAI

from preheat.core import processes
from tests.conftest import _base_env

pytestmark = pytest.mark.slow

SYSTEM = "You are a concise assistant of Acme Parcel. Answer in one or two sentences."


@pytest.fixture(scope="module")
def reference(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    from preheat.workers.engine.resident import LOADING

    with LOADING:  # the server in this process may be loading its copy now (resident.LOADING)
        model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    return tokenizer, model


def ids_of(tokenizer, messages) -> torch.Tensor:
    return torch.tensor(
        [tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]]
    )


def generate(reference, messages, max_new_tokens: int, **options):
    tokenizer, model = reference
    ids = ids_of(tokenizer, messages)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            **{"do_sample": False, **options},
        )
    return out.sequences[0, ids.shape[-1] :].tolist(), out.logits


@pytest.fixture(scope="module")
def client(real_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("real")
    (folder / "home").mkdir()
    catalog = folder / "preheat.toml"
    catalog.write_text(
        f'[models.smollm2]\npath = "{real_model}"\n\n'
        f'[templates.support]\nmodel = "smollm2"\nsystem_prompt = "{SYSTEM}"\n'
    )
    proc = processes.start_serve(_base_env(folder / "home", catalog), folder / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 300, what="ready")
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def answer_ids(reference, text: str) -> list[int]:
    return reference[0](text, add_special_tokens=False)["input_ids"]


def test_several_system_and_developer_messages_are_the_templates_own_and_answered_as_transformers(client, reference):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "developer", "content": "Never mention prices."},
        {"role": "system", "content": "The customer's name is Ada."},
        {"role": "user", "content": "Hi! What is the capital of France?"},
    ]
    want, _ = generate(reference, messages, 24)
    got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert (
        answer_ids(reference, got.choices[0].message.content)
        == want[: len(answer_ids(reference, got.choices[0].message.content))]
    )
    assert got.choices[0].message.content == reference[0].decode(want, skip_special_tokens=True)


def test_turn_two_reuses_all_of_turn_one_where_its_answer_re_tokenizes_to_its_ids(client, reference):
    tokenizer = reference[0]
    turn_one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="smollm2", messages=turn_one, max_tokens=24, temperature=0)
    want, _ = generate(reference, turn_one, 24)
    text = first.choices[0].message.content
    assert text == tokenizer.decode(want, skip_special_tokens=True)
    turn_two = [*turn_one, {"role": "assistant", "content": text}, {"role": "user", "content": "And of Germany?"}]
    second = client.chat.completions.create(model="smollm2", messages=turn_two, max_tokens=16, temperature=0)
    # What turn two can reuse: turn one's prompt and answer ids, as far as they are the leading
    # ids of turn two's prompt (the answer re-tokenized by the chat template).
    kept = ids_of(tokenizer, turn_one)[0].tolist() + want[:-1]
    prompt = ids_of(tokenizer, turn_two)[0].tolist()
    shared = next(
        (i for i, (a, b) in enumerate(zip(kept, prompt, strict=False)) if a != b), min(len(kept), len(prompt))
    )
    re_tokenizes = shared == len(kept)
    assert re_tokenizes, f"turn one's answer re-tokenizes differently from position {shared} of {len(kept)}"
    assert second.usage.prompt_tokens_details.cached_tokens == len(kept)  # all of turn one, nothing computed twice
    assert second.usage.prompt_tokens == len(prompt)
    assert second.choices[0].message.content == tokenizer.decode(
        generate(reference, turn_two, 16)[0], skip_special_tokens=True
    )


@pytest.mark.parametrize(
    "decoding",
    [
        {"temperature": 0.7, "top_p": 0.9, "seed": 11},
        {"temperature": 1.0, "top_k": 20, "seed": 12},
        {"temperature": 0.9, "min_p": 0.05, "seed": 13},
    ],
)
def test_seeded_sampling_is_transformers_sampling_with_the_same_seed(client, reference, decoding):
    """A peaked distribution (a real model's), each warper as transformers applies it, the draw
    from a generator seeded as transformers' global one is: the same tokens."""
    messages = [{"role": "user", "content": "Write one sentence about parcels."}]
    seed = decoding["seed"]
    options = {k: v for k, v in decoding.items() if k != "seed"}
    torch.manual_seed(seed)
    want, _ = generate(reference, messages, 20, do_sample=True, **options)
    extra = {k: options.pop(k) for k in ("top_k", "min_p") if k in options}
    asked = {"model": "smollm2", "messages": messages, "max_tokens": 20, "seed": seed, "extra_body": extra, **options}
    got = client.chat.completions.create(**asked)
    assert got.choices[0].message.content == reference[0].decode(want, skip_special_tokens=True)
    again = client.chat.completions.create(**asked)
    assert again.choices[0].message.content == got.choices[0].message.content


def test_stop_strings_cut_the_answer_and_logprobs_are_transformers_own(client, reference):
    tokenizer = reference[0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    want, logits = generate(reference, messages, 16)
    whole = tokenizer.decode(want, skip_special_tokens=True)
    stop = whole.split()[2]  # a word inside the answer: it ends there, the stop itself unsaid
    stopped = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=16, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == whole[: whole.index(stop)]
    scored = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    for position, entry in enumerate(scored.choices[0].logprobs.content):
        expected = torch.log_softmax(logits[position][0].float(), dim=-1)
        assert entry.token == tokenizer.decode([want[position]])
        assert math.isclose(entry.logprob, float(expected[want[position]]), abs_tol=1e-4)
        best = torch.topk(expected, 3)
        assert [tokenizer.decode([i]) for i in best.indices.tolist()] == [t.token for t in entry.top_logprobs]
