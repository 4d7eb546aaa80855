"""Tensor-level pieces of prefix reuse: token ids, forward passes, cache bytes and clones.

A prefix is the KV cache of a system prompt, computed once with no decoding. A request
starts from a *clone* of it. For a transformers ``DynamicCache`` the clone is shallow (new
layer objects pointing at the same key/value tensors): its layers grow by ``torch.cat``, a
new tensor per step, so the shared prefix tensors are never written. Layer types that
write in place (``StaticCache`` and friends) get a deep copy instead.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from workers.device import out_of_memory_as_error
from workers.kvcache import CacheKey
from workers.resident import ResidentModel

# Between the system prompt and the user's text. The two are tokenized separately and
# concatenated, so a template request's first ids are exactly the cached prefix: BPE never
# merges across the boundary (tokenizing the joined text can, and would miss the cache).
SEPARATOR = "\n\n"


def cache_nbytes(cache) -> int:
    """Exact bytes held by a cache: the storage behind every key and value tensor."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.untyped_storage().nbytes()
    return total


@functools.cache
def _layers_that_grow_by_concatenation() -> tuple[type, ...]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    # Exact types: subclasses (quantized, linear-attention) keep state they update in place.
    return DynamicLayer, DynamicSlidingWindowLayer


def _shallow(obj):
    # What copy.copy does for a plain object, without its reduce protocol (~10x faster;
    # this is on every request's critical path).
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def clone_for_request(cache):
    """A cache a request may extend without touching the prefix it came from."""
    safe = _layers_that_grow_by_concatenation()
    if not all(type(layer) in safe for layer in cache.layers):
        return copy.deepcopy(cache)
    clone = _shallow(cache)
    clone.layers = [_shallow(layer) for layer in cache.layers]
    return clone


def encode(resident: ResidentModel, text: str, *, with_bos: bool) -> torch.Tensor:
    """Token ids of `text`, shape [1, n], on the CPU: ids are hashed and compared there, and
    `forward` moves what it feeds to the model's device."""
    return resident.tokenizer(text, add_special_tokens=with_bos, return_tensors="pt")["input_ids"]


@dataclass(frozen=True)
class TemplatePrefix:
    """A system prompt tokenized once: its ids and its cache key."""

    model: str
    system_prompt: str
    ids: torch.Tensor  # [1, n], CPU
    key: CacheKey

    @classmethod
    def of(cls, resident: ResidentModel, system_prompt: str) -> TemplatePrefix:
        ids = encode(resident, system_prompt, with_bos=True)
        return cls(resident.name, system_prompt, ids, CacheKey.of(resident.name, ids[0].numpy()))

    def prompt_ids(self, resident: ResidentModel, user_input: str) -> torch.Tensor:
        """The request's ids: the prefix, then the user's turn. Empty input is the prefix alone."""
        if not user_input:
            return self.ids
        return torch.cat([self.ids, encode(resident, SEPARATOR + user_input, with_bos=False)], dim=-1)


def check_context(resident: ResidentModel, num_tokens: int, what: str, new_tokens: int = 1) -> None:
    """A prompt plus the tokens it will generate must fit the model's context."""
    if resident.max_context and num_tokens + new_tokens > resident.max_context:
        raise ValueError(
            f"{what} is {num_tokens} tokens (+{new_tokens} to generate); model {resident.name!r} has a context "
            f"of {resident.max_context}"
        )


def forward(resident: ResidentModel, input_ids: torch.Tensor, cache=None):
    """One forward pass extending `cache` (a new DynamicCache when None); last logits only."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=resident.model.config)
    device = resident.placement.device
    doing = f"running {input_ids.shape[-1]} tokens through {resident.name} (after {cache.get_seq_length()} cached)"

    def run():
        with torch.inference_mode():
            return resident.model(
                input_ids=input_ids.to(device, non_blocking=True),
                use_cache=True,
                logits_to_keep=1,
                **{resident.cache_kwarg: cache},
            ).logits[0, -1]

    return out_of_memory_as_error(device, doing, run), cache
