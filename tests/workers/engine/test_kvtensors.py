"""Tensor pieces of prefix reuse on the real small model: exact bytes, shared tensors."""

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from preheat.workers.engine.kvtensors import cache_nbytes, clone_for_request, settle
from preheat.workers.engine.resident import check_context, encode
from tests.conftest import SUPPORT_PROMPT, load_resident


@pytest.fixture(scope="module")
def resident(tiny_model):
    return load_resident(tiny_model)


def test_cache_bytes_are_the_exact_storage_of_keys_and_values(resident):
    ids = encode(resident, SUPPORT_PROMPT, with_bos=True)
    _, kv = resident.runner.forward(ids)
    config = resident.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * ids.shape[-1] * head_dim * 4  # k+v, float32
    assert cache_nbytes(kv) == config.num_hidden_layers * per_layer
    assert kv.get_seq_length() == ids.shape[-1] > 20


def test_a_settled_entry_is_one_slab_of_its_exact_bytes_outside_the_heap(resident):
    """Its tensors are views into one storage (an anonymous mapping, freed with the last
    view), counted once, holding the same numbers; a request from it computes the same."""
    ids = encode(resident, SUPPORT_PROMPT, with_bos=True)
    _, kv = resident.runner.forward(ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]
    exact = cache_nbytes(kv)
    settle(kv)
    storages = {t.untyped_storage().data_ptr() for layer in kv.layers for t in (layer.keys, layer.values)}
    assert len(storages) == 1 and cache_nbytes(kv) == exact
    for layer, (keys, values) in zip(kv.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    follow = encode(resident, "\n\nHello", with_bos=False)
    settled_logits, _ = resident.runner.forward(follow, clone_for_request(kv))
    _, fresh = resident.runner.forward(ids)
    fresh_logits, _ = resident.runner.forward(follow, fresh)
    assert torch.equal(settled_logits, fresh_logits)


def test_a_request_shares_the_prefix_tensors_and_never_writes_them(resident):
    _, prefix = resident.runner.forward(encode(resident, SUPPORT_PROMPT, with_bos=True))
    before = [(layer.keys.clone(), layer.keys.data_ptr()) for layer in prefix.layers]
    clone = clone_for_request(prefix)
    assert [layer.keys.data_ptr() for layer in clone.layers] == [ptr for _, ptr in before]  # no copy
    resident.runner.forward(encode(resident, "\n\nHello", with_bos=False), clone)
    clone.crop(-3)  # a crop on the clone is a view on the clone's layer, not a write
    assert clone.get_seq_length() > prefix.get_seq_length() - 3
    for layer, (keys, ptr) in zip(prefix.layers, before, strict=True):
        assert layer.keys.data_ptr() == ptr and torch.equal(layer.keys, keys)


def test_a_cache_that_writes_in_place_is_deep_copied(resident):
    static = StaticCache(config=resident.model.config, max_cache_len=64)
    resident.runner.forward(encode(resident, "Hello there", with_bos=True), static)
    clone = clone_for_request(static)
    assert clone.layers[0].keys.data_ptr() != static.layers[0].keys.data_ptr()
    dynamic = DynamicCache(config=resident.model.config)
    assert type(clone_for_request(dynamic)) is type(copy.copy(dynamic))


def test_a_prompt_that_leaves_no_room_to_generate_is_refused(resident):
    with pytest.raises(
        ValueError,
        match=rf"prompt is {resident.max_context} tokens \(\+1 to generate\); "
        rf"model 'tiny' has a context of {resident.max_context}",
    ):
        check_context(resident, resident.max_context, "prompt")
    check_context(resident, resident.max_context - 8, "prompt", new_tokens=8)
