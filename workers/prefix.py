"""Pre-filled system prompts and requests that start from them.

A prefix is the KV cache of a system prompt, computed once with no decoding. A request
with that system prompt starts from a *shallow clone* of it: new layer objects pointing
at the same key/value tensors. That is safe for a transformers ``DynamicCache`` because it
grows by ``torch.cat`` (a new tensor per step), so the shared prefix tensors are never
written; it costs no tensor copy, unlike ``copy.deepcopy``.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.device import synchronize
from workers.models import ResidentModel

# Between the system prompt and the user's text; tokenized separately and appended, so the
# prompt's first tokens are exactly the cached prefix ids.
SEPARATOR = "\n\n"


@dataclass
class Prefix:
    model: str
    template: str
    key: str  # model + sha256 of the token ids
    token_ids: torch.Tensor  # shape [1, n]
    cache: object  # transformers DynamicCache
    nbytes: int
    prefill_ms: float

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[-1])


def prefix_key(model: str, token_ids: torch.Tensor) -> str:
    digest = hashlib.sha256(token_ids.to("cpu", torch.int64).numpy().tobytes()).hexdigest()
    return f"{model}:{digest[:32]}"


def cache_nbytes(cache) -> int:
    """Exact bytes held by a cache: the storage behind every key and value tensor."""
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.untyped_storage().nbytes()
    return total


def shallow_clone(cache):
    """A cache that shares the prefix tensors but appends to its own layer objects."""
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    return clone


def encode(resident: ResidentModel, text: str, *, with_bos: bool) -> torch.Tensor:
    ids = resident.tokenizer(text, add_special_tokens=with_bos, return_tensors="pt")["input_ids"]
    return ids.to(resident.placement.device)


def check_context(resident: ResidentModel, num_tokens: int, what: str) -> None:
    # `>=`: a prompt that fills the whole context leaves no position for the first new token.
    if resident.max_context and num_tokens >= resident.max_context:
        raise ValueError(
            f"{what} is {num_tokens} tokens; model {resident.name!r} has a context of {resident.max_context}"
        )


def _forward(resident: ResidentModel, input_ids: torch.Tensor, cache=None):
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=resident.model.config)
    with torch.inference_mode():
        out = resident.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                             **{resident.cache_kwarg: cache})
    return out.logits[0, -1], cache


def prefill(resident: ResidentModel, template: str, system_prompt: str) -> Prefix:
    """Compute the system prompt's KV cache (no decoding) and time it."""
    token_ids = encode(resident, system_prompt, with_bos=True)
    check_context(resident, token_ids.shape[-1], f"template {template!r}")
    synchronize(resident.placement.device)
    started = time.perf_counter()
    _, cache = _forward(resident, token_ids)
    synchronize(resident.placement.device)
    prefill_ms = (time.perf_counter() - started) * 1000
    return Prefix(resident.name, template, prefix_key(resident.name, token_ids), token_ids, cache,
                  cache_nbytes(cache), prefill_ms)


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    ms: float


def first_token_cold(resident: ResidentModel, system_prompt: str | None, user_input: str) -> FirstToken:
    """What a cold server does: tokenize the whole prompt and prefill all of it."""
    started = time.perf_counter()
    if system_prompt is None:
        ids = encode(resident, user_input, with_bos=True)
    else:
        ids = torch.cat([encode(resident, system_prompt, with_bos=True),
                         encode(resident, SEPARATOR + user_input, with_bos=False)], dim=-1)
    check_context(resident, ids.shape[-1], "prompt")
    logits, _ = _forward(resident, ids)
    token = int(logits.argmax())  # .item() waits for the device
    return FirstToken(token, (time.perf_counter() - started) * 1000)


def first_token_warm(resident: ResidentModel, prefix: Prefix, user_input: str) -> FirstToken:
    """Start from the cached prefix: only the user's tokens are computed."""
    started = time.perf_counter()
    suffix = encode(resident, SEPARATOR + user_input, with_bos=False)
    check_context(resident, prefix.num_tokens + suffix.shape[-1], "prompt")
    logits, _ = _forward(resident, suffix, shallow_clone(prefix.cache))
    token = int(logits.argmax())
    return FirstToken(token, (time.perf_counter() - started) * 1000)


def median_first_token(measure: Callable[[], FirstToken], repeats: int) -> FirstToken:
    """Median time over `repeats` runs; the token must be the same every time (greedy)."""
    runs = [measure() for _ in range(repeats)]
    if len({run.token_id for run in runs}) != 1:
        raise RuntimeError(f"greedy first token changed between identical runs: {[r.token_id for r in runs]}")
    return FirstToken(runs[0].token_id, statistics.median(run.ms for run in runs))
