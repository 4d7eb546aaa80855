"""Prefixes as tensors, through the production scheduler on every dev architecture: a
prompt that is an entry answered from its stored logits, the prefix never written by the
requests from it, an entry charged exactly what its layers hold, no reuse of ids that
differ."""

from __future__ import annotations

import pytest
import torch

from preheat.api.sampling import SamplingParams
from preheat.cli.devmodel import ARCHITECTURES
from preheat.workers.engine.resident import encode
from tests.conftest import SUPPORT_PROMPT, greedy, load_resident, reference_generate, support_request

SLIDING = ("mistral", "phi3", "gemma3")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def resident(request, dev_model):
    return load_resident(dev_model(request.param), name=request.param)


def test_a_prompt_that_is_the_prefix_is_answered_from_its_stored_logits(resident, scheduler):
    """No forward pass and no cut: a sliding-window layer past its window cannot be cut."""
    prefix_ids, _ = support_request(resident, "")
    entry = scheduler.prefill(resident, prefix_ids).entry
    for streamed in (True, False):
        stream = scheduler.submit(resident, prefix_ids, greedy(6))
        pieces = [piece.text for piece in stream] if streamed else [stream.collect().text]
        assert "".join(pieces) == stream.completion.text
        assert stream.completion.cached_tokens == entry.num_tokens
        assert stream.completion.token_ids == reference_generate(resident, prefix_ids, 6)


def test_the_prefix_tensors_and_logits_are_unchanged_by_the_requests_from_them(resident, scheduler):
    prefix_ids, prompt_ids = support_request(resident, "Hello")
    entry = scheduler.prefill(resident, prefix_ids).entry
    layers = entry.payload.cache.layers
    before = [(layer.keys.data_ptr(), layer.keys.clone(), layer.values.clone()) for layer in layers]
    logits = entry.payload.logits.clone()
    scheduler.submit(resident, prompt_ids, greedy(16)).collect()
    scheduler.submit(resident, prefix_ids, SamplingParams(max_tokens=4, temperature=1.5, seed=3)).collect()
    scheduler.submit(resident, prefix_ids, greedy(4, repetition_penalty=1.5, presence_penalty=1.0)).collect()
    for layer, (ptr, keys, values) in zip(layers, before, strict=True):
        assert layer.keys.data_ptr() == ptr
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert torch.equal(entry.payload.logits, logits)
    assert entry.payload.cache.get_seq_length() == prefix_ids.shape[-1]


def test_an_entry_holds_and_is_charged_exactly_what_its_layers_need(resident, scheduler):
    prefix_ids, _ = support_request(resident, "")
    entry = scheduler.prefill(resident, prefix_ids).entry
    config = resident.model.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if resident.name in ("mistral", "phi3"):
        kinds = ["sliding_attention"] * config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n = prefix_ids.shape[-1]
    positions = [min(n, window - 1) if kind == "sliding_attention" else n for kind in kinds]
    expected = sum(2 * heads * p * head_dim * 4 for p in positions) + config.vocab_size * 4
    assert entry.nbytes == expected
    assert entry.truncatable == (resident.name not in SLIDING)
    if resident.name in SLIDING:
        assert n > window  # the case that matters: a prefix longer than the window


def test_a_prompt_whose_ids_differ_from_the_prefix_falls_back_to_full_prefill(tiny_model, scheduler):
    llama = load_resident(tiny_model, name="llama")
    prefix_ids, _ = support_request(llama, "")
    scheduler.prefill(llama, prefix_ids)
    other = encode(llama, "Hi. " + SUPPORT_PROMPT, with_bos=False)  # no BOS, other text: nothing shared
    completion = scheduler.submit(llama, other, greedy(8)).collect()
    assert completion.cached_tokens == 0
    assert completion.token_ids == reference_generate(llama, other, 8)
    assert scheduler.prefixes.cache.stats().misses == 1
