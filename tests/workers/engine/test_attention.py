"""The grouped-KV SDPA gives transformers' own SDPA results on the cached-prefix path."""

import torch

from preheat.workers.engine import attention
from preheat.workers.engine.kvtensors import clone_for_request
from tests.conftest import load_resident, support_request


def test_cached_prefix_logits_match_stock_sdpa_and_the_model_uses_it(tiny_model):
    resident = load_resident(tiny_model)
    assert resident.model.config._attn_implementation == attention.NAME
    assert resident.model.config.num_key_value_heads < resident.model.config.num_attention_heads  # grouped
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel? It is late.")
    _, prefix = resident.runner.forward(prefix_ids)
    suffix = prompt_ids[:, prefix_ids.shape[-1] :]

    grouped, _ = resident.runner.forward(suffix, clone_for_request(prefix))
    resident.model.set_attn_implementation("sdpa")
    try:
        stock, _ = resident.runner.forward(suffix, clone_for_request(prefix))
    finally:
        resident.model.set_attn_implementation(attention.NAME)
    torch.testing.assert_close(grouped, stock, rtol=1e-5, atol=1e-5)
