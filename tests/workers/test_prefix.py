"""Pre-filled prefixes on the real small model: exact bytes, shared tensors, same answer."""

import pytest
import torch

from tests.conftest import SUPPORT_PROMPT
from workers.models import ModelRegistry
from workers.prefix import (
    cache_nbytes,
    encode,
    first_token_cold,
    first_token_warm,
    prefill,
    prefix_key,
    shallow_clone,
    _forward,
)


@pytest.fixture(scope="module")
def resident(tiny_model):
    model, _ = ModelRegistry("cpu").ensure("tiny", str(tiny_model))
    return model


def test_prefill_bytes_are_the_exact_storage_of_keys_and_values(resident):
    prefix = prefill(resident, "support", SUPPORT_PROMPT)
    config = resident.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * prefix.num_tokens * head_dim * 4  # k+v, float32
    assert prefix.nbytes == cache_nbytes(prefix.cache) == config.num_hidden_layers * per_layer
    assert prefix.cache.get_seq_length() == prefix.num_tokens > 20
    assert prefix.key == prefix_key("tiny", encode(resident, SUPPORT_PROMPT, with_bos=True))


def test_a_request_shares_the_prefix_tensors_and_never_writes_them(resident):
    prefix = prefill(resident, "support", SUPPORT_PROMPT)
    before = [(layer.keys.clone(), layer.keys.data_ptr()) for layer in prefix.cache.layers]
    clone = shallow_clone(prefix.cache)
    assert [layer.keys.data_ptr() for layer in clone.layers] == [ptr for _, ptr in before]  # no copy
    _forward(resident, encode(resident, "\n\nHello", with_bos=False), clone)
    assert clone.get_seq_length() > prefix.num_tokens
    assert prefix.cache.get_seq_length() == prefix.num_tokens
    for layer, (keys, ptr) in zip(prefix.cache.layers, before, strict=True):
        assert layer.keys.data_ptr() == ptr and torch.equal(layer.keys, keys)


@pytest.mark.parametrize("user_input", ["Where is my parcel?", "", "x" * 300])
def test_cached_prefix_gives_the_same_first_token_and_logits_as_full_prefill(resident, user_input):
    prefix = prefill(resident, "support", SUPPORT_PROMPT)
    warm = first_token_warm(resident, prefix, user_input)
    cold = first_token_cold(resident, SUPPORT_PROMPT, user_input)
    assert warm.token_id == cold.token_id

    suffix = encode(resident, "\n\n" + user_input, with_bos=False)
    full = torch.cat([prefix.token_ids, suffix], dim=-1)
    warm_logits, _ = _forward(resident, suffix, shallow_clone(prefix.cache))
    cold_logits, _ = _forward(resident, full)
    torch.testing.assert_close(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)


def test_a_prompt_longer_than_the_context_is_refused(resident):
    long_prompt = "word " * (resident.max_context + 10)
    with pytest.raises(ValueError, match=f"model 'tiny' has a context of {resident.max_context}"):
        prefill(resident, "huge", long_prompt)
