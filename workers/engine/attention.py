"""Attention for the cached-prefix path on the CPU: SDPA over grouped KV heads, uncopied.

A request that starts from a cached prefix feeds several tokens against a long cache, so
transformers' SDPA integration needs a mask, and with a mask it expands the grouped key/value
heads (`repeat_kv`) into a full copy of the whole cache, every layer, every request. torch's
SDPA takes the grouped heads directly (`enable_gqa`) on the CPU, so that copy is pure cost.
Every other case (no mask, no grouping, another device, extras like position bias) goes to
transformers' own SDPA unchanged.
"""

from __future__ import annotations

import torch

NAME = "preheat_sdpa"


def sdpa_grouped(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (layout := kwargs.get("preheat_layout")) is not None:
        return _ragged(module, query, key, value, layout, scaling, kwargs), None
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if groups == 1 or attention_mask is None or query.device.type != "cpu" or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


# What a layer may pass that the rows' attention does not compute: refused, never ignored.
UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def _ragged(module, query, keys, values, layout, scaling, kwargs):
    """The running rows' attention (preheat.workers.engine.raggedkv.Layout.attend): the layout came with the pass."""
    if extra := [name for name in UNSUPPORTED if kwargs.get(name) is not None]:
        raise TypeError(f"running requests together does not compute attention with {', '.join(extra)}")
    return layout.attend(query, keys, values, scaling, kwargs.get("sliding_window"))


def register() -> str:
    """Make the implementation known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_grouped)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
