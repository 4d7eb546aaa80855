"""preheat's attention implementation: the running rows' ragged attention, and SDPA over grouped
KV heads, uncopied, for a lone pass.

**The running rows** (a step of the batch, workers/engine/raggedkv.py): every layer writes its
new keys and values into the rows' slots and attends per row. That work depends on the step's
layout (which row each fed position belongs to), which is no tensor: it runs as one custom op,
`preheat::ragged_attention`, whose implementation reads the step the runner is running
(`running`). A compiled step (preheat.workers.engine.compiled) sees the op as one opaque node,
as vLLM's compiled models see its attention; an eager step calls the same op. So a step
attends the same way compiled or eager.

**A lone pass** (a prefix's pre-fill, a request that runs alone) starts from a cached prefix
and feeds several tokens against a long cache, so transformers' SDPA integration needs a
mask, and with a mask it expands the grouped key/value heads (`repeat_kv`) into a full copy of
the whole cache, every layer, every request. torch's SDPA takes the grouped heads directly
(`enable_gqa`) on the CPU, so that copy is pure cost. Every other case (no mask, no grouping,
another device, extras like position bias) goes to transformers' own SDPA unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

NAME = "preheat_sdpa"
# What a layer may pass that the rows' attention does not compute: refused, never ignored.
UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")

_STEP = threading.local()  # the RaggedKV of the step this thread runs (only the scheduler's thread steps)


@contextlib.contextmanager
def running(kv) -> Iterator[None]:
    """The step `kv` (its layout set by `step_inputs`) is what every layer's attention reads."""
    _STEP.kv = kv
    try:
        yield
    finally:
        _STEP.kv = None


@torch.library.custom_op("preheat::ragged_attention", mutates_args=())
def ragged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float, window: int
) -> torch.Tensor:
    """One layer of the running step: the new keys and values written into the rows' slots,
    each fed position attending to its own row. [1, tokens, heads, head_dim]."""
    kv = getattr(_STEP, "kv", None)
    if kv is None:
        raise RuntimeError("preheat::ragged_attention ran outside a step (attention.running)")
    keys, values = kv.update(key, value, layer)
    return kv.layout.attend(query, keys, values, scaling, window or None)


@ragged_attention.register_fake
def _(query, key, value, layer, scaling, window):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def sdpa_grouped(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("preheat_rows"):
        if extra := [name for name in UNSUPPORTED if kwargs.get(name) is not None]:
            raise TypeError(f"running requests together does not compute attention with {', '.join(extra)}")
        window = int(kwargs.get("sliding_window") or 0)
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.preheat.ragged_attention(query, key, value, module.layer_idx, scale, window), None
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


def register() -> str:
    """Make the implementation known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_grouped)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
