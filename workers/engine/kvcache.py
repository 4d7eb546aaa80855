"""The KV prefix cache manager: which pre-filled prefixes a worker keeps, and which it drops.

Pure bookkeeping in the spirit of vLLM's block pool: entries keyed by model + hash of the
prefix token ids, bounded by an entry count *and* exact bytes, LRU among entries that are
neither in use (ref count > 0) nor pinned, pins capped at a share of both budgets. The
payload (a transformers cache) is opaque here, so every rule is testable without a model.

A lookup finds the entry sharing the most leading ids with the prompt, as automatic prefix
caching does: a whole entry, or the head of a *truncatable* one (a conversation's earlier
turn, whose answer the next turn's ids re-tokenize differently). An entry whose payload
cannot be cut (a sliding-window layer past its window) is used whole or not at all, and a
head shorter than ``MIN_PARTIAL_TOKENS`` (one vLLM block) is not worth the cut: sharing a
BOS or a chat template's opening with every entry is not a hit.

Every operation either completes or raises before changing anything: an insert that cannot
fit evicts nothing.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from preheat.core.errors import PreheatError

MIN_PARTIAL_TOKENS = 16


class CacheBudgetError(PreheatError):
    """An entry that can never fit the configured budget (or the pin cap)."""

    exit_code = 2


class CacheFullError(PreheatError):
    """Room exists in the budget, but every entry that would have to go is in use or pinned."""


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a flat int64 array: the one form that is hashed and compared."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int64 and token_ids.ndim == 1:
        return token_ids  # the request path's common case: nothing to convert
    array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    return np.ascontiguousarray(array)


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids `a` and `b` have in common."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))


def digest_tokens(token_ids: np.ndarray) -> str:
    # A memoryview of the (contiguous) ids: no copy on the request path.
    return hashlib.sha256(memoryview(np.ascontiguousarray(token_ids))).hexdigest()


@dataclass(frozen=True, order=True)
class CacheKey:
    model: str
    digest: str  # sha256 of the prefix's int64 token ids

    @classmethod
    def of(cls, model: str, token_ids: Sequence[int] | np.ndarray) -> CacheKey:
        return cls(model, digest_tokens(as_token_array(token_ids)))

    def __str__(self) -> str:
        return f"{self.model}:{self.digest[:12]}"


@dataclass(frozen=True)
class CacheBudget:
    max_entries: int
    max_bytes: int
    # Pinned entries may hold at most this share of either budget, so pins can never
    # starve the LRU part of the cache (vLLM's pinning RFC used 0.2).
    pinned_share: float = 0.5

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise CacheBudgetError(f"the KV cache needs room for at least 1 entry (got {self.max_entries})")
        if self.max_bytes < 1:
            raise CacheBudgetError(f"the KV cache needs a positive byte budget (got {self.max_bytes})")
        if not 0.0 <= self.pinned_share <= 1.0:
            raise CacheBudgetError(f"the pinned share must be between 0 and 1 (got {self.pinned_share})")

    @property
    def max_pinned_entries(self) -> int:
        return math.floor(self.max_entries * self.pinned_share)

    @property
    def max_pinned_bytes(self) -> int:
        return math.floor(self.max_bytes * self.pinned_share)


@dataclass
class CacheEntry:
    key: CacheKey
    token_ids: np.ndarray
    nbytes: int
    payload: object
    label: str = ""  # what it is for people: a template name
    # Its head may serve a prompt that shares only part of its ids (see the module doc).
    truncatable: bool = True
    ref_count: int = 0
    pinned: bool = False
    access_count: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and not self.pinned

    def describe(self) -> dict:
        return {
            "key": str(self.key),
            "label": self.label,
            "tokens": self.num_tokens,
            "bytes": self.nbytes,
            "pinned": self.pinned,
            "in_use": self.ref_count,
            "accesses": self.access_count,
        }


@dataclass(frozen=True)
class Match:
    """A lookup's hit: the entry, and how many leading ids of the prompt it holds."""

    entry: CacheEntry
    tokens: int


@dataclass(frozen=True)
class CacheStats:
    queries: int = 0
    hits: int = 0
    misses: int = 0
    tokens_queried: int = 0
    tokens_hit: int = 0
    inserts: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    pinned_entries: int = 0
    pinned_bytes: int = 0


class KVCacheManager:
    """Thread-safe: the health server reads stats while a task uses the cache."""

    def __init__(
        self,
        budget: CacheBudget,
        *,
        on_evict: Callable[[CacheEntry], None] | None = None,
    ) -> None:
        self.budget = budget
        self._on_evict = on_evict
        self._lock = threading.RLock()
        self._entries: OrderedDict[CacheKey, CacheEntry] = OrderedDict()  # least recently used first
        self._counts = dict.fromkeys(
            ("queries", "hits", "misses", "tokens_queried", "tokens_hit", "inserts", "evictions"), 0
        )
        self._bytes = 0

    # Reading ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def peek(self, key: CacheKey) -> CacheEntry | None:
        """The entry, without touching LRU order or stats (for warmups and health)."""
        return self._entries.get(key)

    def entries(self) -> list[CacheEntry]:
        """Snapshot, least recently used first: the order eviction would take."""
        with self._lock:
            return list(self._entries.values())

    def stats(self) -> CacheStats:
        with self._lock:
            pinned = [e for e in self._entries.values() if e.pinned]
            return CacheStats(
                **self._counts,
                entries=len(self._entries),
                bytes=self._bytes,
                pinned_entries=len(pinned),
                pinned_bytes=sum(e.nbytes for e in pinned),
            )

    # Using --------------------------------------------------------------------------

    def acquire_longest(
        self, model: str, prompt_ids: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> Match | None:
        """The cached entry of `model` sharing the most leading ids with `prompt_ids`, held
        (ref count + 1) until `release`. The ids themselves are compared, not their hashes."""
        prompt = as_token_array(prompt_ids)
        with self._lock:
            match = self._longest_match(model, prompt)
            if record:
                self._record_query(len(prompt), match.tokens if match else 0)
            if match is not None:
                self._touch(match.entry)
                match.entry.ref_count += 1
            return match

    def release(self, entry: CacheEntry) -> None:
        with self._lock:
            if entry.ref_count <= 0:
                raise RuntimeError(f"cache entry {entry.key} released more often than acquired")
            entry.ref_count -= 1

    @contextmanager
    def using(
        self, model: str, prompt_ids: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> Iterator[Match | None]:
        match = self.acquire_longest(model, prompt_ids, record=record)
        try:
            yield match
        finally:
            if match is not None:
                self.release(match.entry)

    def _longest_match(self, model: str, prompt: np.ndarray) -> Match | None:
        """Most shared ids wins; on a tie a whole entry (nothing to cut), then the most recent."""
        best, best_rank = None, (0, False)
        for entry in reversed(self._entries.values()):
            if entry.key.model != model:
                continue
            tokens = shared_length(prompt, entry.token_ids)
            whole = tokens == entry.num_tokens
            if not whole and (not entry.truncatable or tokens < MIN_PARTIAL_TOKENS):
                continue
            if tokens and (tokens, whole) > best_rank:
                best, best_rank = Match(entry, tokens), (tokens, whole)
        return best

    def _record_query(self, tokens_queried: int, tokens_hit: int) -> None:
        self._counts["queries"] += 1
        self._counts["hits" if tokens_hit else "misses"] += 1
        self._counts["tokens_queried"] += tokens_queried
        self._counts["tokens_hit"] += tokens_hit

    def _touch(self, entry: CacheEntry) -> None:
        entry.access_count += 1
        self._entries.move_to_end(entry.key)

    # Changing -----------------------------------------------------------------------

    def insert(
        self,
        model: str,
        token_ids: Sequence[int] | np.ndarray,
        payload: object,
        nbytes: int,
        *,
        key: CacheKey | None = None,
        label: str = "",
        pin: bool = False,
        truncatable: bool = True,
    ) -> CacheEntry:
        """Add a prefix, evicting least recently used entries as needed. An existing key is
        returned as it is (touched, and pinned if asked and allowed). `key`, when given, is
        `CacheKey.of(model, token_ids)` as the caller computed it: taken, not computed again."""
        ids = as_token_array(token_ids)
        if len(ids) == 0:
            raise ValueError("a cached prefix needs at least one token")
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative (got {nbytes})")
        if key is None:
            key = CacheKey(model, digest_tokens(ids))
        elif key.model != model:
            raise ValueError(f"key {key} is not of model {model!r}")
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                self._touch(existing)
                if pin:
                    self._pin(existing)
                return existing
            self._check_fits_budget(key, nbytes, label)
            for victim in self._victims_for(nbytes, key, label):
                self._drop(victim, evicted=True)
            entry = CacheEntry(key, ids, nbytes, payload, label, truncatable)
            self._entries[key] = entry
            self._bytes += nbytes
            self._counts["inserts"] += 1
            if pin:
                self._pin(entry)
            return entry

    def pin(self, key: CacheKey) -> bool:
        """Keep an entry out of eviction. False when the pin cap would be exceeded."""
        with self._lock:
            return self._pin(self._require(key))

    def unpin(self, key: CacheKey) -> None:
        with self._lock:
            self._require(key).pinned = False

    def remove(self, key: CacheKey) -> None:
        with self._lock:
            entry = self._require(key)
            if entry.ref_count:
                raise CacheFullError(f"cache entry {key} is in use by {entry.ref_count} request(s)")
            self._drop(entry, evicted=False)

    def clear(self) -> int:
        """Drop every entry not in use (pinned ones included); returns how many went."""
        with self._lock:
            idle = [e for e in self._entries.values() if e.ref_count == 0]
            for entry in idle:
                self._drop(entry, evicted=False)
            return len(idle)

    def drop_model(self, model: str) -> int:
        """Drop every entry of `model` not in use, pinned ones included (the model goes to
        sleep); returns the bytes freed."""
        with self._lock:
            # Its adapters' prefixes too (their namespaces are `model+adapter`, engine/lora.py).
            idle = [
                e
                for e in self._entries.values()
                if (e.key.model == model or e.key.model.startswith(f"{model}+")) and e.ref_count == 0
            ]
            for entry in idle:
                self._drop(entry, evicted=False)
            return sum(entry.nbytes for entry in idle)

    def _require(self, key: CacheKey) -> CacheEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"no cache entry {key}")
        return entry

    def _pin(self, entry: CacheEntry) -> bool:
        if entry.pinned:
            return True
        pinned = [e for e in self._entries.values() if e.pinned]
        if (
            len(pinned) + 1 > self.budget.max_pinned_entries
            or sum(e.nbytes for e in pinned) + entry.nbytes > self.budget.max_pinned_bytes
        ):
            return False
        entry.pinned = True
        return True

    def _check_fits_budget(self, key: CacheKey, nbytes: int, label: str) -> None:
        if nbytes > self.budget.max_bytes:
            raise CacheBudgetError(
                f"prefix {label or key} needs {nbytes:,} bytes of KV cache; the whole cache budget is "
                f"{self.budget.max_bytes:,} bytes"
            )

    def _victims_for(self, nbytes: int, key: CacheKey, label: str) -> list[CacheEntry]:
        """Least recently used evictable entries whose removal makes room; raises (having
        changed nothing) when the entries in use or pinned leave too little."""
        entries_over = len(self._entries) + 1 - self.budget.max_entries
        bytes_over = self._bytes + nbytes - self.budget.max_bytes
        victims = []
        for entry in self._entries.values():
            if entries_over <= 0 and bytes_over <= 0:
                break
            if entry.evictable:
                victims.append(entry)
                entries_over -= 1
                bytes_over -= entry.nbytes
        if entries_over > 0 or bytes_over > 0:
            held = [e for e in self._entries.values() if not e.evictable]
            raise CacheFullError(
                f"no room for prefix {label or key} ({nbytes:,} bytes): {len(held)} entries "
                f"({sum(e.nbytes for e in held):,} bytes) are in use or pinned"
            )
        return victims

    def _drop(self, entry: CacheEntry, *, evicted: bool) -> None:
        del self._entries[entry.key]
        self._bytes -= entry.nbytes
        if evicted:
            self._counts["evictions"] += 1
            if self._on_evict is not None:
                self._on_evict(entry)
