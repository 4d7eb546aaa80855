"""Tensor-level pieces of prefix reuse: token ids, forward passes, cache bytes and clones.

A prefix is the KV cache of a system prompt, computed once with no decoding. A request
starts from a *clone* of it: shallow (new layer objects, the same key/value tensors) for
layers that never write the tensors they were given — transformers' ``DynamicLayer`` grows by
``torch.cat``, and ``HeadroomLayer`` appends only after the prefix, into room kept for it —
and a deep copy for layer types that write in place (``StaticCache`` and friends).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from workers.kvcache import CacheKey
from workers.models import ResidentModel

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


class HeadroomLayer(DynamicLayer):
    """A pre-filled layer whose keys and values are views into a buffer with room after the
    prefix. A request holding the buffer's write lease appends its tokens there, in place,
    instead of `torch.cat` copying the whole prefix into a new tensor on its first forward
    (per layer, per request: at long contexts the largest cost of a warm request). Positions
    before `frozen` are the shared prefix and are never written; a request without the lease,
    or past the room, or cropped into the prefix, falls back to `torch.cat` as DynamicLayer does.
    """

    frozen: int = 0
    writable: bool = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if self.writable and start >= self.frozen and end <= self._room_keys.shape[-2]:
            self._room_keys[..., start:end, :].copy_(key_states)
            self._room_values[..., start:end, :].copy_(value_states)
            self.keys, self.values = self._room_keys[..., :end, :], self._room_values[..., :end, :]
            return self.keys, self.values
        self.writable = False  # from here on this request's tensors are its own
        return super().update(key_states, value_states, *args, **kwargs)

    @classmethod
    def around(cls, layer: DynamicLayer, room_tokens: int) -> HeadroomLayer:
        """The layer's keys and values moved into a buffer `room_tokens` longer (one copy, at pre-fill)."""
        new = _shallow(layer)
        new.__class__ = cls
        length = layer.keys.shape[-2]
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            room = tensor.new_empty((*tensor.shape[:-2], length + room_tokens, tensor.shape[-1]))
            room[..., :length, :].copy_(tensor)
            setattr(new, f"_room_{name}", room)
            setattr(new, name, room[..., :length, :])
        new.frozen, new.writable = length, False
        return new


def with_headroom(cache, room_tokens: int):
    """A freshly pre-filled cache whose plain layers get `room_tokens` of in-place room."""
    if room_tokens > 0:
        cache.layers = [HeadroomLayer.around(layer, room_tokens) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    return cache


# Layer types a request may extend from a shallow clone: they replace their tensors (cat,
# slicing) or write only after the shared prefix. Exact types: subclasses (quantized,
# linear-attention) keep state they update in place.
_SHARE_SAFE = (DynamicLayer, DynamicSlidingWindowLayer, HeadroomLayer)


def _shallow(obj):
    # What copy.copy does for a plain object, without its reduce protocol (~10x faster;
    # this is on every request's critical path).
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def clone_for_request(cache, *, writable: bool = False):
    """A cache a request may extend without touching the prefix it came from. `writable`:
    this request holds the prefix's write lease and may append into its headroom."""
    if not all(type(layer) in _SHARE_SAFE for layer in cache.layers):
        return copy.deepcopy(cache)
    clone = _shallow(cache)
    clone.layers = [_shallow(layer) for layer in cache.layers]
    if writable:
        for layer in clone.layers:
            if type(layer) is HeadroomLayer:
                layer.writable = True
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
    input_ids = input_ids.to(resident.placement.device, non_blocking=True)
    with torch.inference_mode():
        out = resident.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                             **{resident.cache_kwarg: cache})
    return out.logits[0, -1], cache
