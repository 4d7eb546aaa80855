"""Requests that start from a cached prefix: pre-fill, first token, greedy generation.

The engine joins the KV cache manager (which prefix to use, held while in use) and the
tensor pieces in ``workers.prefix`` (clone, forward). A request looks up the longest cached
prefix of its token ids (the ids are compared, not just hashed), computes only the rest,
and decodes from there; with no match it pre-fills the whole prompt. Greedy output is the
same either way, token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from workers.device import synchronize
from workers.kvcache import CacheEntry, CacheKey, KVCacheManager
from workers.prefix import cache_nbytes, check_context, clone_for_request, forward
from workers.resident import ResidentModel


@dataclass(slots=True)
class Start:
    """Where a request begins: the cache it extends and the ids it still has to compute."""

    cache: object | None
    feed_ids: torch.Tensor
    cached_tokens: int
    reuse_ms: float  # lookup + id check + clone: the price of using the cache


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    ms: float
    cached_tokens: int = 0
    reuse_ms: float = 0.0


@dataclass
class Completion:
    model: str
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # stop (an end-of-sequence token) | length (max_new_tokens)
    ttft_ms: float = 0.0
    total_ms: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Request:
    prompt_ids: torch.Tensor
    max_new_tokens: int
    use_cache: bool
    record: bool
    prefix_key: CacheKey | None
    started: float


class TextStream:
    """Iterates over text deltas as tokens are decoded; `.completion` is final once exhausted."""

    def __init__(self, resident: ResidentModel, completion: Completion, tokens: Iterator[int]) -> None:
        self.completion = completion
        self._resident = resident
        self._tokens = tokens

    def __iter__(self) -> Iterator[str]:
        emitted = ""
        for token_id in self._tokens:
            self.completion.token_ids.append(token_id)
            text = self._resident.tokenizer.decode(self.completion.token_ids, skip_special_tokens=True)
            # A multi-byte character split across tokens decodes to U+FFFD until complete.
            if text.endswith("\ufffd"):
                continue
            delta, emitted = text[len(emitted) :], text
            if delta:
                yield delta
        self.completion.text = self._resident.tokenizer.decode(self.completion.token_ids, skip_special_tokens=True)

    def collect(self) -> Completion:
        for _ in self:
            pass
        return self.completion


def stop_token_ids(resident: ResidentModel) -> frozenset[int]:
    ids = {resident.tokenizer.eos_token_id}
    generation_eos = getattr(getattr(resident.model, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return frozenset(i for i in ids if i is not None)


class PrefixEngine:
    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache

    # Pre-fill -----------------------------------------------------------------------

    def prefill(
        self,
        resident: ResidentModel,
        token_ids: torch.Tensor,
        *,
        key: CacheKey | None = None,
        label: str = "",
        pin: bool = False,
    ) -> tuple[CacheEntry, float]:
        """Compute and cache the KV of `token_ids` (no decoding). Returns the entry and the
        milliseconds spent (0 when it was already cached). A caller that has the ids' key
        (a template's prefix) passes it: the ids are then hashed by nobody."""
        key = key or CacheKey.of(resident.name, token_ids[0].numpy())
        if (existing := self.cache.peek(key)) is not None:
            return self.cache.insert(
                resident.name, existing.token_ids, existing.payload, existing.nbytes, key=key, label=label, pin=pin
            ), 0.0
        check_context(resident, token_ids.shape[-1], f"template {label!r}" if label else "prefix", new_tokens=1)
        synchronize(resident.placement.device)
        started = time.perf_counter()
        _, kv = forward(resident, token_ids)
        synchronize(resident.placement.device)
        prefill_ms = (time.perf_counter() - started) * 1000
        entry = self.cache.insert(
            resident.name, token_ids[0].numpy(), kv, cache_nbytes(kv), key=key, label=label, pin=pin
        )
        return entry, prefill_ms

    # Requests -----------------------------------------------------------------------

    @contextmanager
    def start(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        *,
        use_cache: bool = True,
        record: bool = True,
        prefix_key: CacheKey | None = None,
    ) -> Iterator[Start]:
        """The request's starting point; the cached prefix it uses is held until exit. With
        `prefix_key` (a template request) the lookup is by key, else the longest match."""
        started = time.perf_counter()
        entry = kv = None
        if use_cache and prefix_key is not None:
            entry = self.cache.acquire(prefix_key, prompt_ids[0].numpy(), record=record)
        elif use_cache:
            entry = self.cache.acquire_longest(resident.name, prompt_ids[0].numpy(), record=record)
        try:
            if entry is not None:
                kv = clone_for_request(entry.payload)
            reuse_ms = (time.perf_counter() - started) * 1000
            yield self._start_from(entry, kv, prompt_ids, reuse_ms)
        finally:
            if entry is not None:
                self.cache.release(entry)

    @staticmethod
    def _start_from(entry: CacheEntry | None, kv, prompt_ids: torch.Tensor, reuse_ms: float) -> Start:
        num_tokens = prompt_ids.shape[-1]
        if entry is None or (entry.num_tokens == num_tokens == 1):
            return Start(None, prompt_ids, 0, reuse_ms)
        cached = entry.num_tokens
        if cached == num_tokens:
            # The prompt is the prefix: recompute its last token, which yields the logits we need.
            kv.crop(-1)
            cached -= 1
        return Start(kv, prompt_ids[:, cached:], cached, reuse_ms)

    def first_token(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        *,
        use_cache: bool = True,
        record: bool = False,
        prefix_key: CacheKey | None = None,
    ) -> FirstToken:
        """Time to the first greedy token, from the cached prefix or (use_cache=False) cold."""
        check_context(resident, prompt_ids.shape[-1], "prompt")
        started = time.perf_counter()
        with self.start(resident, prompt_ids, use_cache=use_cache, record=record, prefix_key=prefix_key) as start:
            logits, _ = forward(resident, start.feed_ids, start.cache)
            token = int(logits.argmax())  # int() waits for the device
        return FirstToken(token, (time.perf_counter() - started) * 1000, start.cached_tokens, start.reuse_ms)

    def generate(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        record: bool = True,
        prefix_key: CacheKey | None = None,
        started: float | None = None,
        on_first_token: Callable[[Completion], None] | None = None,
    ) -> TextStream:
        """Greedy decoding from the cached prefix (by key, else the longest match); iterate the
        stream for text deltas. `started` (perf_counter) is when the request arrived, so TTFT
        includes what the caller did first (tokenizing)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        check_context(resident, prompt_ids.shape[-1], "prompt", new_tokens=max_new_tokens)
        completion = Completion(resident.name, int(prompt_ids.shape[-1]), 0)
        request = _Request(
            prompt_ids,
            max_new_tokens,
            use_cache,
            record,
            prefix_key,
            started if started is not None else time.perf_counter(),
        )
        return TextStream(resident, completion, self._decode(resident, request, completion, on_first_token))

    def _decode(
        self,
        resident: ResidentModel,
        request: _Request,
        completion: Completion,
        on_first_token: Callable[[Completion], None] | None,
    ) -> Iterator[int]:
        started, stops = request.started, stop_token_ids(resident)
        with self.start(
            resident,
            request.prompt_ids,
            use_cache=request.use_cache,
            record=request.record,
            prefix_key=request.prefix_key,
        ) as start:
            completion.cached_tokens = start.cached_tokens
            feed, kv = start.feed_ids, start.cache
            for step in range(request.max_new_tokens):
                logits, kv = forward(resident, feed, kv)
                token = int(logits.argmax())
                if step == 0:
                    completion.ttft_ms = (time.perf_counter() - started) * 1000
                    if on_first_token is not None:
                        on_first_token(completion)
                yield token
                if token in stops:
                    completion.finish_reason = "stop"
                    break
                feed = torch.tensor([[token]])
        completion.total_ms = (time.perf_counter() - started) * 1000
