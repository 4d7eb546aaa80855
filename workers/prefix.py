"""Tensor-level pieces of prefix reuse: token ids, forward passes, cache bytes and clones.

A prefix is the KV cache of some leading ids (a system prompt, a conversation so far) and
the logits at its last position, so a prompt that *is* the prefix needs no forward pass
(and no cut: a sliding-window layer past its window cannot be cut). A request starts from
a *clone* of it. For a transformers ``DynamicCache`` the clone is shallow (new layer
objects pointing at the same key/value tensors): its layers grow by ``torch.cat``, a new
tensor per step, so the shared prefix tensors are never written. Layer types that write in
place (``StaticCache`` and friends) get a deep copy instead.

A sliding-window layer keeps only its last ``window - 1`` positions, as a view into the
whole pre-fill's tensor; ``compact`` copies that window out so the entry holds (and is
charged) only what the window needs.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from workers.device import out_of_memory_as_error
from workers.resident import ResidentModel


@dataclass
class Prefix:
    """A cache entry's payload: the KV of its ids and the logits after the last of them."""

    cache: object  # a transformers Cache
    logits: torch.Tensor  # [vocab]

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self.cache) + self.logits.untyped_storage().nbytes()


def cache_nbytes(cache) -> int:
    """Exact bytes held by a cache: the storage behind every key and value tensor."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.untyped_storage().nbytes()
    return total


@functools.cache
def layers_that_grow_by_concatenation() -> tuple[type, ...]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    # Exact types: subclasses (quantized, linear-attention) keep state they update in place.
    return DynamicLayer, DynamicSlidingWindowLayer


def compact(cache) -> None:
    """Give every key/value tensor storage of its own size (a window sliced out of a long
    pre-fill otherwise keeps the whole pre-fill alive)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                setattr(layer, name, tensor.clone())


def truncatable(cache) -> bool:
    """Whether the cache can be cut back to fewer positions (its head reused alone)."""
    full, sliding = layers_that_grow_by_concatenation()
    for layer in cache.layers:
        if type(layer) is sliding:
            if layer.get_seq_length() >= layer.sliding_window:
                return False  # it has dropped positions before its window
        elif type(layer) is not full:
            return False
    return True


def has_window(cache) -> bool:
    """Whether a layer of the cache keeps a sliding window: once it has slid, the cache can
    no longer be cut back (see truncatable)."""
    return any(getattr(layer, "sliding_window", None) for layer in cache.layers)


def _shallow(obj):
    # What copy.copy does for a plain object, without its reduce protocol (~10x faster;
    # this is on every request's critical path).
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def clone_for_request(cache):
    """A cache a request may extend without touching the prefix it came from."""
    safe = layers_that_grow_by_concatenation()
    if not all(type(layer) in safe for layer in cache.layers):
        return copy.deepcopy(cache)
    clone = _shallow(cache)
    clone.layers = [_shallow(layer) for layer in cache.layers]
    return clone


def encode(resident: ResidentModel, text: str, *, with_bos: bool) -> torch.Tensor:
    """Token ids of `text`, shape [1, n], on the CPU: ids are hashed and compared there, and
    `forward` moves what it feeds to the model's device."""
    return resident.tokenizer(text, add_special_tokens=with_bos, return_tensors="pt")["input_ids"]


class ContextLengthError(ValueError):
    """A prompt and the tokens it asks for do not fit the model's context."""


def check_context(resident: ResidentModel, num_tokens: int, what: str, new_tokens: int = 1) -> None:
    """A prompt plus the tokens it will generate must fit the model's context."""
    if resident.max_context and num_tokens + new_tokens > resident.max_context:
        raise ContextLengthError(
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
