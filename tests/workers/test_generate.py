"""Cached-prefix generation on two real architectures: token-identical to no cache at all."""

import pytest
import torch

from tests.conftest import SUPPORT_PROMPT, load_resident, support_request
from workers.generate import PrefixEngine
from workers.kvcache import CacheBudget, KVCacheManager
from workers.prefix import encode

USER_INPUTS = ["Where is my parcel? It was due on Monday.", "", "x" * 300, "Ünïcødé ✓ 包裹"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def resident(request):
    model_dir = request.getfixturevalue("tiny_model" if request.param == "llama" else "tiny_qwen2")
    return load_resident(model_dir, name=request.param)


@pytest.fixture
def engine():
    return PrefixEngine(KVCacheManager(CacheBudget(max_entries=4, max_bytes=64 * 1024**2)))


def reference_generate(resident, prompt_ids, max_new_tokens):
    """transformers' own greedy generate, from scratch, with no prefix anywhere."""
    with torch.inference_mode():
        out = resident.model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=resident.tokenizer.eos_token_id,
        )
    return out[0, prompt_ids.shape[-1] :].tolist()


@pytest.mark.parametrize("user_input", USER_INPUTS)
def test_greedy_output_from_the_cached_prefix_is_token_identical(resident, engine, user_input):
    prefix_ids, prompt_ids = support_request(resident, user_input)
    engine.prefill(resident, prefix_ids, label="support")

    warm = engine.generate(resident, prompt_ids, max_new_tokens=24).collect()
    cold = engine.generate(resident, prompt_ids, max_new_tokens=24, use_cache=False).collect()

    assert warm.cached_tokens == prefix_ids.shape[-1] - (1 if not user_input else 0)
    assert cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids == reference_generate(resident, prompt_ids, 24)
    assert warm.text == cold.text == resident.tokenizer.decode(warm.token_ids, skip_special_tokens=True)


def test_the_prefix_tensors_are_unchanged_after_generating_from_them(resident, engine):
    prefix_ids, prompt_ids = support_request(resident, "Hello")
    entry, _ = engine.prefill(resident, prefix_ids)
    before = [(layer.keys.data_ptr(), layer.keys.clone(), layer.values.clone()) for layer in entry.payload.layers]
    engine.generate(resident, prompt_ids, max_new_tokens=16).collect()
    engine.generate(resident, prefix_ids, max_new_tokens=4).collect()  # the crop path
    for layer, (ptr, keys, values) in zip(entry.payload.layers, before, strict=True):
        assert layer.keys.data_ptr() == ptr
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert entry.payload.get_seq_length() == prefix_ids.shape[-1]


def test_streaming_yields_the_text_in_pieces_and_holds_the_entry_until_done(resident, engine):
    prefix_ids, prompt_ids = support_request(resident, "Tell me more.")
    entry, _ = engine.prefill(resident, prefix_ids)
    stream = engine.generate(resident, prompt_ids, max_new_tokens=12)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        assert entry.ref_count == 1  # in use: cannot be evicted mid-request
    assert entry.ref_count == 0
    assert "".join(pieces) == stream.completion.text
    assert stream.completion.ttft_ms > 0 and stream.completion.total_ms >= stream.completion.ttft_ms
    assert stream.completion.finish_reason in ("stop", "length")


def test_a_prompt_whose_ids_differ_from_the_prefix_falls_back_to_full_prefill(resident, engine):
    prefix_ids, _ = support_request(resident, "")
    engine.prefill(resident, prefix_ids)
    # The same text tokenized whole: BPE may merge across the boundary, and even when it
    # does not, a different first token (no BOS) must never reuse the prefix.
    other = encode(resident, SUPPORT_PROMPT + "\n\nHi", with_bos=False)
    completion = engine.generate(resident, other, max_new_tokens=8).collect()
    assert completion.cached_tokens == 0
    assert completion.token_ids == reference_generate(resident, other, 8)
    assert engine.cache.stats().misses == 1


def test_bad_requests_are_refused_before_any_work(resident, engine):
    _prefix_ids, prompt_ids = support_request(resident, "Hi")
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        engine.generate(resident, prompt_ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="has a context of"):
        engine.generate(resident, prompt_ids, max_new_tokens=resident.max_context)
    assert engine.cache.stats().queries == 0
