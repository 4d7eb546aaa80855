"""Requests that start from a cached prefix: pre-fill, first token, decoding.

The engine joins the KV cache manager (which prefix to use, held while in use), the
tensor pieces in ``workers.prefix`` (clone, cut, forward) and the sampler in
``workers.sampling``. A request looks up the cached entry sharing the most leading ids
with its prompt (the ids are compared, not hashed), computes only the rest, and decodes
from there; with no match it pre-fills the whole prompt. Greedy output is the same either
way, token for token. A request may leave its own prompt and answer cached (``remember``:
unpinned, LRU), so a conversation's next turn computes only its new tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from workers.device import synchronize
from workers.kvcache import CacheBudgetError, CacheEntry, CacheFullError, CacheKey, KVCacheManager, Match
from workers.prefix import Prefix, check_context, clone_for_request, compact, forward, truncatable
from workers.prefixstore import PrefixStore
from workers.resident import ResidentModel
from workers.sampling import ModelDefaults, SamplingParams, TokenLogprob, sampler_for

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Start:
    """Where a request begins: the cache it extends and the ids it still has to compute."""

    cache: object | None
    feed_ids: torch.Tensor  # [1, 0] when `logits` already answers the prompt
    logits: torch.Tensor | None  # the next-token logits, when the prompt is a cached entry
    cached_tokens: int
    reuse_ms: float  # lookup + id check + clone: the price of using the cache


@dataclass(frozen=True)
class Prefilled:
    """A prefix made ready: computed, restored from the prefix store, or already cached."""

    entry: CacheEntry
    source: str  # computed | restored | cached
    prefill_ms: float = 0.0
    restore_ms: float = 0.0


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
    finish_reason: str = "length"  # stop (end of sequence or a stop string) | length (max_tokens)
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Piece:
    """A part of the answer as it is released: its text and the tokens' log probabilities."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class TextStream:
    """Iterates over the answer's pieces as tokens are decoded; `.completion` is final once
    exhausted. Stop strings are matched on the decoded text, across token boundaries: text
    that may be the start of one is held back, and a stop string is never released."""

    def __init__(
        self,
        resident: ResidentModel,
        completion: Completion,
        tokens: Iterator[tuple[int, TokenLogprob | None]],
        stop: tuple[str, ...] = (),
    ) -> None:
        self.completion = completion
        self._resident = resident
        self._tokens = tokens
        self._stop = stop

    def __iter__(self) -> Iterator[Piece]:
        text, released, pending = "", 0, []
        for token_id, logprob in self._tokens:
            self.completion.token_ids.append(token_id)
            if logprob is not None:
                pending.append(logprob)
                self.completion.logprobs.append(logprob)
            text = self._resident.tokenizer.decode(self.completion.token_ids, skip_special_tokens=True)
            # A multi-byte character split across tokens decodes to U+FFFD until complete.
            if text.endswith("\ufffd"):
                continue
            if (cut := find_stop(text, self._stop, released)) is not None:
                text = text[:cut]
                self.completion.finish_reason = "stop"
                self._tokens.close()  # ends decoding now; the prefix it held is released
                break
            safe = len(text) - held_back(text, self._stop)
            if safe > released:
                yield Piece(text[released:safe], tuple(pending))
                released, pending = safe, []
        if len(text) > released or pending:
            yield Piece(text[released:], tuple(pending))
        self.completion.text = text

    def collect(self) -> Completion:
        for _ in self:
            pass
        return self.completion

    def close(self) -> None:
        """Stop decoding now (the reader went away): what the request held is released."""
        self._tokens.close()


def find_stop(text: str, stops: tuple[str, ...], released: int) -> int | None:
    """Where the first stop string in `text` starts; only text not yet released can hold one."""
    start = max(0, released - max((len(s) for s in stops), default=0))
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def stop_token_ids(resident: ResidentModel) -> frozenset[int]:
    """Every end-of-sequence id: the tokenizer's and all of generation_config.json's."""
    ids = {resident.tokenizer.eos_token_id}
    generation_eos = getattr(getattr(resident.model, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class _Request:
    prompt_ids: torch.Tensor
    sampling: SamplingParams
    use_cache: bool
    record: bool
    remember: bool
    started: float


class PrefixEngine:
    def __init__(self, cache: KVCacheManager, store: PrefixStore | None = None) -> None:
        self.cache, self.store = cache, store
        # One request decodes at a time on this path (PREHEAT_ENGINE=sequential, and the
        # scheduler's own exercises); the batching scheduler (workers.batch) runs many.
        self._one_at_a_time = threading.Lock()

    # Pre-fill -----------------------------------------------------------------------

    def prefill(
        self,
        resident: ResidentModel,
        token_ids: torch.Tensor,
        *,
        key: CacheKey | None = None,
        label: str = "",
        pin: bool = False,
    ) -> Prefilled:
        """Make the KV of `token_ids` cached (no decoding): already there, restored from the
        prefix store, or computed (and then stored). A caller that has the ids' key (a
        template's prefix) passes it: the ids are then hashed by nobody."""
        key = key or CacheKey.of(resident.name, token_ids[0].numpy())
        if (existing := self.cache.peek(key)) is not None:
            entry = self.cache.insert(
                resident.name, existing.token_ids, existing.payload, existing.nbytes, key=key, label=label, pin=pin
            )
            return Prefilled(entry, "cached")
        check_context(resident, token_ids.shape[-1], f"template {label!r}" if label else "prefix", new_tokens=1)
        ids = token_ids[0].numpy()
        if self.store is not None and (restored := self.store.restore(resident, ids)) is not None:
            entry = self._insert(resident, ids, restored.prefix, key=key, label=label, pin=pin)
            return Prefilled(entry, "restored", restore_ms=restored.ms)
        synchronize(resident.placement.device)
        started = time.perf_counter()
        logits, kv = forward(resident, token_ids)
        compact(kv)
        synchronize(resident.placement.device)
        prefill_ms = (time.perf_counter() - started) * 1000
        entry = self._insert(resident, ids, Prefix(kv, logits), key=key, label=label, pin=pin)
        if self.store is not None:
            self.store.save_later(resident, ids, entry.payload)
        return Prefilled(entry, "computed", prefill_ms=prefill_ms)

    def _insert(self, resident: ResidentModel, ids, prefix: Prefix, **how) -> CacheEntry:
        return self.cache.insert(
            resident.name, ids, prefix, prefix.nbytes, truncatable=truncatable(prefix.cache), **how
        )

    # Requests -----------------------------------------------------------------------

    @contextmanager
    def start(
        self, resident: ResidentModel, prompt_ids: torch.Tensor, *, use_cache: bool = True, record: bool = True
    ) -> Iterator[Start]:
        """The request's starting point; the cached entry it uses is held until exit."""
        started = time.perf_counter()
        match = self.cache.acquire_longest(resident.name, prompt_ids[0].numpy(), record=record) if use_cache else None
        try:
            yield self._start_from(match, prompt_ids, started)
        finally:
            if match is not None:
                self.cache.release(match.entry)

    @staticmethod
    def _start_from(match: Match | None, prompt_ids: torch.Tensor, started: float) -> Start:
        num_tokens = prompt_ids.shape[-1]
        if match is None:
            return Start(None, prompt_ids, None, 0, ms_since(started))
        entry, prefix = match.entry, match.entry.payload
        if match.tokens == entry.num_tokens == num_tokens:
            # The prompt is the entry: its stored logits answer, nothing is computed or cut.
            kv = clone_for_request(prefix.cache)
            return Start(kv, prompt_ids[:, num_tokens:], prefix.logits, num_tokens, ms_since(started))
        # At least the prompt's last id is computed: it yields the logits to decode from.
        use = min(match.tokens, num_tokens - 1)
        if use < 1:
            return Start(None, prompt_ids, None, 0, ms_since(started))
        kv = clone_for_request(prefix.cache)
        if use < entry.num_tokens:
            kv.crop(use - entry.num_tokens)  # a truncatable entry (see KVCacheManager)
        return Start(kv, prompt_ids[:, use:], None, use, ms_since(started))

    def first_token(
        self, resident: ResidentModel, prompt_ids: torch.Tensor, *, use_cache: bool = True, record: bool = False
    ) -> FirstToken:
        """Time to the first greedy token, from the longest cached prefix or (use_cache=False) cold."""
        check_context(resident, prompt_ids.shape[-1], "prompt")
        started = time.perf_counter()
        with self.start(resident, prompt_ids, use_cache=use_cache, record=record) as start:
            logits = start.logits
            if logits is None:
                logits, _ = forward(resident, start.feed_ids, start.cache)
            token = int(logits.argmax())  # int() waits for the device
        return FirstToken(token, (time.perf_counter() - started) * 1000, start.cached_tokens, start.reuse_ms)

    def generate(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        *,
        use_cache: bool = True,
        record: bool = True,
        remember: bool = False,
        started: float | None = None,
        on_first_token: Callable[[Completion], None] | None = None,
    ) -> TextStream:
        """Decoding from the longest cached prefix; iterate the stream for the answer's
        pieces. `started` (perf_counter) is when the request arrived, so TTFT includes what
        the caller did first (rendering, tokenizing). With `remember`, the prompt and the
        answer stay cached for a follow-up (a conversation's next turn, another choice)."""
        check_context(resident, prompt_ids.shape[-1], "prompt", new_tokens=sampling.max_tokens)
        completion = Completion(resident.name, int(prompt_ids.shape[-1]), 0)
        request = _Request(
            prompt_ids,
            sampling,
            use_cache,
            record,
            remember,
            started if started is not None else time.perf_counter(),
        )
        tokens = self._decode(resident, request, completion, on_first_token)
        return TextStream(resident, completion, tokens, sampling.stop)

    def _decode(
        self,
        resident: ResidentModel,
        request: _Request,
        completion: Completion,
        on_first_token: Callable[[Completion], None] | None,
    ) -> Iterator[tuple[int, TokenLogprob | None]]:
        ids = request.prompt_ids[0].tolist()
        prompt_length = len(ids)
        sampler = sampler_for(
            request.sampling, ModelDefaults.of(resident.model), prompt_length, resident.placement.device
        )
        stops, kv, last_logits, prompt_only = stop_token_ids(resident), None, None, None
        try:
            with (
                self._one_at_a_time,
                self.start(resident, request.prompt_ids, use_cache=request.use_cache, record=request.record) as start,
            ):
                completion.cached_tokens = start.cached_tokens
                feed, kv, logits = start.feed_ids, start.cache, start.logits
                for step in range(request.sampling.max_tokens):
                    if logits is None:
                        logits, kv = forward(resident, feed, kv)
                        if step == 0 and request.remember and not truncatable(kv):
                            # Its answer's KV could not be cut back to the prompt: keep the
                            # prompt's own (a shallow clone; decoding replaces, never writes).
                            prompt_only = Prefix(clone_for_request(kv), logits)
                    token, logprob = sampler.choose(logits, ids)
                    last_logits, logits = logits, None
                    ids.append(token)
                    if step == 0:
                        completion.ttft_ms = ms_since(request.started)
                        if on_first_token is not None:
                            on_first_token(completion)
                    yield token, logprob
                    if token in stops:
                        completion.finish_reason = "stop"
                        break
                    feed = torch.tensor([[token]])
        except GeneratorExit:
            pass  # the stream stopped early (a stop string, a client gone): what ran is kept
        finally:
            completion.total_ms = ms_since(request.started)
        if prompt_only is not None:
            self.remember(resident, ids[:prompt_length], prompt_only)
        elif request.remember and kv is not None:
            self.remember(resident, ids[:-1], Prefix(kv, last_logits))

    def remember(self, resident: ResidentModel, ids: list[int], prefix: Prefix) -> None:
        """Keep a finished request's KV for the next turn: its prompt and all but the last
        answer token (the one never fed), or its prompt alone where the cache cannot be cut
        (see _decode). Best effort, never at a pinned prefix's expense."""
        if prefix.cache.get_seq_length() != len(ids):
            return
        compact(prefix.cache)
        try:
            self._insert(resident, ids, prefix, label="conversation")
        except (CacheBudgetError, CacheFullError) as exc:
            log.debug("conversation not cached: %s", exc)


def ms_since(started: float) -> float:
    """Milliseconds from a time.perf_counter() reading to now."""
    return (time.perf_counter() - started) * 1000
