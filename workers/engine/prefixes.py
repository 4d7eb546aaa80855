"""The prefixes a worker keeps as tensors: pre-filled, started from, remembered.

``KVCacheManager`` (workers/kvcache.py) is the bookkeeping: which prefixes are kept, which
go. This is what it keeps: the KV of a prefix's ids and the logits after its last id
(``workers.prefix``), computed by a pre-fill or restored from the prefix store on disk. A
request starts from the cached entry sharing the most leading ids with its prompt (the ids
are compared, not hashed) and computes only the rest; with no match it computes its whole
prompt; greedy output is the same either way, token for token. A finished request may
leave its own prompt and answer cached (``remember``: unpinned, LRU), so a conversation's
next turn computes only its new tokens.

Only the scheduler (workers/scheduler.py) calls these, on its thread: a pre-fill is a
forward pass, and every forward pass is the scheduler's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from preheat.workers.engine.device import synchronize
from preheat.workers.engine.kvcache import CacheBudgetError, CacheEntry, CacheFullError, CacheKey, KVCacheManager, Match
from preheat.workers.engine.kvtensors import Prefix, clone_for_request, settle, truncatable
from preheat.workers.engine.lora import namespace
from preheat.workers.engine.prefixstore import PrefixStore
from preheat.workers.engine.request import ms_since
from preheat.workers.engine.resident import ResidentModel, check_context

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


# A remembered conversation is settled after each request; its heap pages are given back at
# most this often (a template's pre-fill gives them back every time).
REMEMBER_TRIM_EVERY_S = 1.0


class Prefixes:
    def __init__(self, cache: KVCacheManager, store: PrefixStore | None = None) -> None:
        self.cache, self.store = cache, store

    # Pre-fill -----------------------------------------------------------------------

    def prefill(
        self,
        resident: ResidentModel,
        token_ids: torch.Tensor,
        *,
        key: CacheKey | None = None,
        label: str = "",
        pin: bool = False,
        adapter=None,
    ) -> Prefilled:
        """Make the KV of `token_ids` cached (no decoding): already there, restored from the
        prefix store, or computed (and then stored). A caller that has the ids' key (a
        template's prefix) passes it: the ids are then hashed by nobody. Under `adapter` (a
        LoraWeights) the prefix is its adapter's: computed under it, cached in its namespace,
        never the base's nor another adapter's, and not written to the prefix store."""
        space = namespace(resident.name, adapter and adapter.name)
        key = key or CacheKey.of(space, token_ids[0].numpy())
        if (existing := self.cache.peek(key)) is not None:
            entry = self.cache.insert(
                space, existing.token_ids, existing.payload, existing.nbytes, key=key, label=label, pin=pin
            )
            return Prefilled(entry, "cached")
        check_context(resident, token_ids.shape[-1], f"template {label!r}" if label else "prefix", new_tokens=1)
        ids = token_ids[0].numpy()
        store = self.store if adapter is None else None
        if store is not None and (restored := store.restore(resident, ids)) is not None:
            settle(restored.prefix.cache)
            entry = self._insert(space, ids, restored.prefix, key=key, label=label, pin=pin)
            return Prefilled(entry, "restored", restore_ms=restored.ms)
        synchronize(resident.placement.device)
        started = time.perf_counter()
        logits, kv = resident.runner.forward(token_ids, adapter=adapter)
        settle(kv)
        synchronize(resident.placement.device)
        prefill_ms = (time.perf_counter() - started) * 1000
        entry = self._insert(space, ids, Prefix(kv, logits), key=key, label=label, pin=pin)
        if store is not None:
            store.save_later(resident, ids, entry.payload)
        return Prefilled(entry, "computed", prefill_ms=prefill_ms)

    def _insert(self, space: str, ids, prefix: Prefix, **how) -> CacheEntry:
        """Cached under `space`: the model's name, or its adapter's namespace (lora.namespace)."""
        return self.cache.insert(space, ids, prefix, prefix.nbytes, truncatable=truncatable(prefix.cache), **how)

    # Requests -----------------------------------------------------------------------

    def start(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        *,
        use_cache: bool = True,
        record: bool = True,
        adapter=None,
    ) -> Start:
        """The request's starting point: a clone of the cached entry sharing the most leading
        ids with its prompt. The entry is held (never evicted) while it is cloned; from then
        on the request reads only its clone, whose tensors the entry's eviction never frees
        or writes."""
        started = time.perf_counter()
        if not use_cache:
            return self._start_from(None, prompt_ids, started)
        space = namespace(resident.name, adapter and adapter.name)
        with self.cache.using(space, prompt_ids[0].numpy(), record=record) as match:
            return self._start_from(match, prompt_ids, started)

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

    def withdraw(self, resident: ResidentModel, token_ids: torch.Tensor, key: CacheKey) -> None:
        """A prefix proven wrong (a probe's first token from it is not full prefill's): out
        of the cache and the prefix store, so nothing is served from it; its next use
        computes it again."""
        if self.cache.peek(key) is not None:
            try:
                self.cache.remove(key)
            except CacheFullError:  # a request runs from it now: unpinned, it goes once released
                self.cache.unpin(key)
        if self.store is not None:
            self.store.discard(resident, token_ids.reshape(-1).cpu().numpy())

    def remember(self, resident: ResidentModel, ids: list[int], prefix: Prefix, *, adapter=None) -> None:
        """Keep a finished request's KV for the next turn (what `Request.to_remember` says);
        best effort, never at a pinned prefix's expense."""
        if prefix.cache.get_seq_length() != len(ids):
            return
        settle(prefix.cache, trim_every_s=REMEMBER_TRIM_EVERY_S)
        try:
            self._insert(namespace(resident.name, adapter and adapter.name), ids, prefix, label="conversation")
        except (CacheBudgetError, CacheFullError) as exc:
            log.debug("conversation not cached: %s", exc)
