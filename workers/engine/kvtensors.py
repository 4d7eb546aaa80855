"""Tensor-level pieces of prefix reuse: token ids, cache bytes and clones.

A prefix is the KV cache of some leading ids (a system prompt, a conversation so far) and
the logits at its last position, so a prompt that *is* the prefix needs no forward pass
(and no cut: a sliding-window layer past its window cannot be cut). A request starts from
a *clone* of it. For a transformers ``DynamicCache`` the clone is shallow (new layer
objects pointing at the same key/value tensors): its layers grow by ``torch.cat``, a new
tensor per step, so the shared prefix tensors are never written. Layer types that write in
place (``StaticCache`` and friends) get a deep copy instead.

A sliding-window layer keeps only its last ``window - 1`` positions, as a view into the
whole pre-fill's tensor; ``settle`` copies what each layer holds out, so the entry holds
(and is charged) only what the window needs.

On the CPU an entry's tensors are settled into one slab of anonymous memory of their exact
size, outside the allocator's heap: a pre-fill's key/value tensors are allocated between
its temporaries, and kept there they fragment the heap of the scheduler thread's arena, so
the process grew 1.61-1.81x the KV bytes per cached template (`preheat bench memory`: 10
prefixes of 500 tokens, 135M shape, through the scheduler's thread). Settled, with the
heap's free pages given back after each pre-fill, it grows 1.01x. The slab is unmapped when
the last tensor viewing it goes (an evicted entry, the last request cloned from it), so an
eviction returns its memory at once.
"""

from __future__ import annotations

import copy
import functools
import mmap
import time
from dataclasses import dataclass

import torch


@dataclass
class Prefix:
    """A cache entry's payload: the KV of its ids and the logits after the last of them."""

    cache: object  # a transformers Cache
    logits: torch.Tensor  # [vocab]

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self.cache) + self.logits.untyped_storage().nbytes()


def cache_nbytes(cache) -> int:
    """Exact bytes held by a cache: each storage behind its key and value tensors, once."""
    held = {}
    for _, _, tensor in kv_tensors(cache):
        storage = tensor.untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def kv_tensors(cache) -> list[tuple[object, str, torch.Tensor]]:
    """(layer, "keys" | "values", tensor) for every key/value tensor a cache holds."""
    return [
        (layer, name, tensor)
        for layer in cache.layers
        for name in ("keys", "values")
        if (tensor := getattr(layer, name, None)) is not None
    ]


@functools.cache
def layers_that_grow_by_concatenation() -> tuple[type, ...]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    # Exact types: subclasses (quantized, linear-attention) keep state they update in place.
    return DynamicLayer, DynamicSlidingWindowLayer


def settle(cache, *, trim_every_s: float = 0.0) -> None:
    """Give a cache entry's key/value tensors storage of their own exact size: on the CPU
    one slab outside the heap for all of them, elsewhere a copy of any tensor that is a
    view into something larger (a window sliced out of a long pre-fill). Then the heap's
    free pages are given back, unless that was done less than `trim_every_s` ago (a
    conversation remembered after every request must not pay 4-7 ms each time)."""
    tensors = kv_tensors(cache)
    if not tensors:
        return
    if any(tensor.device.type != "cpu" for _, _, tensor in tensors):
        for layer, name, tensor in tensors:
            if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                setattr(layer, name, tensor.clone())
        return
    sizes = [tensor.numel() * tensor.element_size() for _, _, tensor in tensors]
    if not sum(sizes):
        return
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // SLAB_ALIGN) * SLAB_ALIGN)
    slab = torch.frombuffer(mmap.mmap(-1, offsets[-1]), dtype=torch.uint8)  # keeps the mapping alive
    for (layer, name, tensor), offset, size in zip(tensors, offsets, sizes, strict=False):
        view = slab[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        setattr(layer, name, view)
    del tensors  # the last references to the pre-fill's own tensors: freed before the trim
    release_free_heap(trim_every_s)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        return None


_last_trim = [0.0]  # monotonic seconds; settle runs on the scheduler's one thread


def release_free_heap(at_most_every_s: float = 0.0) -> None:
    """Give the heap's free pages back (the pre-fill's own tensors, just copied out, and the
    pass's temporaries): glibc keeps them resident otherwise."""
    now = time.monotonic()
    if (trim := _malloc_trim()) is not None and now - _last_trim[0] >= at_most_every_s:
        _last_trim[0] = now
        trim(0)


SLAB_ALIGN = 64  # bytes: each tensor in a slab starts where a cache line does


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
