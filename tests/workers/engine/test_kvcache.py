"""The KV cache manager as bookkeeping: exact eviction order, ref counts, pins, budgets.

No model here: payloads are plain objects and sizes are chosen, so every rule is exact.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preheat.workers.engine.kvcache import (
    MIN_PARTIAL_TOKENS,
    CacheBudget,
    CacheBudgetError,
    CacheFullError,
    CacheKey,
    KVCacheManager,
)


def ids(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def fill(cache: KVCacheManager, *specs: tuple[str, int, int]) -> dict[str, CacheKey]:
    """Insert (label, first token id, nbytes) entries of 4 tokens each, in order."""
    return {
        label: cache.insert("m", ids(4, start), object(), nbytes, label=label).key for label, start, nbytes in specs
    }


def labels(cache: KVCacheManager) -> list[str]:
    return [entry.label for entry in cache.entries()]


def test_the_entry_budget_evicts_the_least_recently_used_first():
    cache = KVCacheManager(CacheBudget(max_entries=3, max_bytes=10_000))
    fill(cache, ("a", 100, 10), ("b", 200, 10), ("c", 300, 10))
    cache.release(cache.acquire_longest("m", [*ids(4, 100), 7]).entry)  # a is now the most recent
    fill(cache, ("d", 400, 10))
    assert labels(cache) == ["c", "a", "d"]
    fill(cache, ("e", 500, 10))
    assert labels(cache) == ["a", "d", "e"]
    assert cache.stats().evictions == 2


def test_the_byte_budget_evicts_as_many_as_needed_and_no_more():
    evicted = []
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=100), on_evict=lambda e: evicted.append(e.label))
    fill(cache, ("a", 100, 40), ("b", 200, 30), ("c", 300, 20))  # 90 bytes
    fill(cache, ("d", 400, 50))  # needs 40 more: a alone frees 40
    assert evicted == ["a"] and labels(cache) == ["b", "c", "d"]
    fill(cache, ("e", 500, 55))  # 100 + 55 - 100 = 55 over: b (30) and c (20) are not enough, d goes too
    assert evicted == ["a", "b", "c", "d"] and labels(cache) == ["e"]
    assert cache.stats().bytes == 55


def test_an_entry_in_use_is_never_evicted():
    cache = KVCacheManager(CacheBudget(max_entries=2, max_bytes=1_000))
    fill(cache, ("a", 100, 10), ("b", 200, 10))
    held = cache.acquire_longest("m", ids(4, 100)).entry
    fill(cache, ("c", 300, 10))  # a is the oldest but held: b goes
    assert labels(cache) == ["a", "c"] and held.ref_count == 1
    cache.release(held)
    fill(cache, ("d", 400, 10))
    assert labels(cache) == ["c", "d"]


def test_pinned_entries_stay_and_pins_are_capped_at_their_share():
    cache = KVCacheManager(CacheBudget(max_entries=4, max_bytes=1_000, pinned_share=0.5))
    keys = fill(cache, ("a", 100, 10), ("b", 200, 10), ("c", 300, 10))
    assert cache.pin(keys["a"]) and cache.pin(keys["b"])
    assert not cache.pin(keys["c"])  # a third pin is over half of 4 entries
    fill(cache, ("d", 400, 10), ("e", 500, 10), ("f", 600, 10))
    assert labels(cache) == ["a", "b", "e", "f"]
    cache.unpin(keys["a"])
    assert cache.pin(cache.entries()[2].key)
    stats = cache.stats()
    assert (stats.pinned_entries, stats.pinned_bytes) == (2, 20)


def test_the_pin_cap_counts_bytes_too():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=100, pinned_share=0.5))
    big = cache.insert("m", ids(4, 1), object(), 45, pin=True)
    other = cache.insert("m", ids(4, 10), object(), 10, pin=True)
    assert big.pinned and not other.pinned  # 45 + 10 > 50


def test_a_prefix_larger_than_the_whole_budget_is_refused_and_nothing_changes():
    cache = KVCacheManager(CacheBudget(max_entries=4, max_bytes=100))
    fill(cache, ("a", 100, 60))
    before = (labels(cache), cache.stats())
    with pytest.raises(
        CacheBudgetError, match=r"prefix huge needs 101 bytes of KV cache; the whole cache budget is 100"
    ):
        cache.insert("m", ids(4, 900), object(), 101, label="huge")
    assert (labels(cache), cache.stats()) == before


def test_no_room_because_everything_is_held_raises_without_evicting_anything():
    cache = KVCacheManager(CacheBudget(max_entries=3, max_bytes=100, pinned_share=1.0))
    keys = fill(cache, ("a", 100, 40), ("b", 200, 40), ("c", 300, 10))
    cache.pin(keys["a"])
    held = cache.acquire_longest("m", ids(4, 200)).entry
    with pytest.raises(CacheFullError, match=r"no room for prefix d \(60 bytes\): 2 entries \(80 bytes\) are in use"):
        fill(cache, ("d", 400, 60))  # c (10 bytes) alone cannot make room: it must not be evicted either
    assert labels(cache) == ["a", "c", "b"] and cache.stats().evictions == 0  # b was touched by its lookup
    cache.release(held)
    fill(cache, ("d", 400, 60))
    assert labels(cache) == ["a", "d"]


def test_lookup_finds_the_entry_sharing_the_most_leading_ids():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    b = MIN_PARTIAL_TOKENS
    short = cache.insert("m", ids(b + 3), object(), 1, label="short")
    long = cache.insert("m", ids(b + 5), object(), 1, label="long")
    cache.insert("other", ids(b + 6), object(), 1)
    with cache.using("m", ids(b + 7)) as hit:
        assert (hit.entry, hit.tokens) == (long, b + 5) and long.ref_count == 1
    assert long.ref_count == 0
    with cache.using("m", [*ids(b + 3), 0]) as hit:  # a tie: the whole entry wins (nothing to cut)
        assert (hit.entry, hit.tokens) == (short, b + 3)
    with cache.using("m", [*ids(b + 1), 0]) as hit:  # the head of both: the most recently used
        assert (hit.entry, hit.tokens) == (short, b + 1)
    with cache.using("m", ids(b + 5)) as hit:  # exactly the entry
        assert (hit.entry, hit.tokens) == (long, b + 5)
    with cache.using("m", [*ids(b - 1), 0]) as hit:  # a head shorter than a block is no hit
        assert hit is None
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.misses) == (5, 4, 1)
    assert (stats.tokens_queried, stats.tokens_hit) == (5 * b + 7 + 4 + 2 + 5 + 0, 4 * b + 5 + 3 + 1 + 5)


def test_an_entry_that_cannot_be_cut_is_used_whole_or_not_at_all():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    b = MIN_PARTIAL_TOKENS
    window = cache.insert("m", ids(b + 4), object(), 1, truncatable=False)
    assert cache.acquire_longest("m", [*ids(b + 3), 0]) is None  # its head would need a cut
    whole = cache.acquire_longest("m", [*ids(b + 4), 0])
    assert (whole.entry, whole.tokens) == (window, b + 4)
    cache.release(whole.entry)
    head = cache.insert("m", ids(2), object(), 1)
    assert cache.acquire_longest("m", [*ids(b + 3), 0]).entry is head  # the next best that fits


def test_the_ids_are_compared_not_their_hashes(monkeypatch):
    import preheat.workers.engine.kvcache as kvcache

    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    cache.insert("m", [1, 2, 3], object(), 1)
    monkeypatch.setattr(kvcache, "digest_tokens", lambda _: "same")
    with cache.using("m", [7, 8, 9, 10]) as hit:
        assert hit is None


def test_inserting_an_existing_prefix_returns_it_without_a_second_copy():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    first = cache.insert("m", [1, 2], "payload", 10)
    again = cache.insert("m", [1, 2], "other", 10)
    assert again is first and again.payload == "payload"
    assert cache.stats().bytes == 10 and len(cache) == 1


def test_records_without_stats_for_warmups():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    cache.insert("m", [1, 2], object(), 10)
    cache.release(cache.acquire_longest("m", [1, 2, 3], record=False).entry)
    assert cache.stats().queries == 0


@pytest.mark.parametrize(
    ("entries", "nbytes", "share", "message"),
    [
        (0, 10, 0.5, "at least 1 entry"),
        (1, 0, 0.5, "positive byte budget"),
        (1, 10, 1.5, "between 0 and 1"),
    ],
)
def test_a_budget_that_cannot_hold_anything_is_refused(entries, nbytes, share, message):
    with pytest.raises(CacheBudgetError, match=message):
        CacheBudget(entries, nbytes, share)


def test_releasing_more_than_acquired_is_a_bug_reported_loudly():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    entry = cache.insert("m", [1, 2], object(), 10)
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        cache.release(entry)


def test_removing_an_entry_in_use_is_refused():
    cache = KVCacheManager(CacheBudget(max_entries=10, max_bytes=1_000))
    entry = cache.insert("m", [1, 2], object(), 10)
    with cache.using("m", [1, 2]), pytest.raises(CacheFullError, match="in use by 1 request"):
        cache.remove(entry.key)
    cache.remove(entry.key)
    assert len(cache) == 0 and cache.stats().bytes == 0


class CacheWorkload(RuleBasedStateMachine):
    """Random inserts, lookups, releases, pins and removals: the budgets always hold,
    held and pinned entries are never evicted, and the counters add up."""

    def __init__(self):
        super().__init__()
        self.evicted = []
        self.cache = KVCacheManager(
            CacheBudget(max_entries=5, max_bytes=1_000, pinned_share=0.4), on_evict=self.evicted.append
        )
        self.held = []

    @rule(first=st.integers(0, 20), length=st.integers(1, 6), nbytes=st.integers(0, 1_200), pin=st.booleans())
    def insert(self, first, length, nbytes, pin):
        before = self.cache.entries()
        try:
            self.cache.insert("m", ids(length, first), object(), nbytes, pin=pin)
        except (CacheBudgetError, CacheFullError):
            assert self.cache.entries() == before  # refused inserts change nothing

    @rule(first=st.integers(0, 20), length=st.integers(1, 8))
    def acquire(self, first, length):
        match = self.cache.acquire_longest("m", ids(length, first))
        if match is not None:
            assert list(match.entry.token_ids[: match.tokens]) == ids(length, first)[: match.tokens]
            self.held.append(match.entry)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        self.cache.release(self.held.pop(index % len(self.held)))

    @precondition(lambda self: len(self.cache))
    @rule(index=st.integers(0, 100), pin=st.booleans())
    def toggle_pin(self, index, pin):
        entries = self.cache.entries()
        key = entries[index % len(entries)].key
        self.cache.pin(key) if pin else self.cache.unpin(key)

    @precondition(lambda self: len(self.cache))
    @rule(index=st.integers(0, 100))
    def remove(self, index):
        entries = self.cache.entries()
        entry = entries[index % len(entries)]
        try:
            self.cache.remove(entry.key)
        except CacheFullError:
            assert entry.ref_count > 0

    @invariant()
    def budgets_hold(self):
        entries, stats, budget = self.cache.entries(), self.cache.stats(), self.cache.budget
        assert stats.entries == len(entries) <= budget.max_entries
        assert stats.bytes == sum(e.nbytes for e in entries) <= budget.max_bytes
        assert stats.pinned_entries <= budget.max_pinned_entries
        assert stats.pinned_bytes <= budget.max_pinned_bytes
        assert stats.hits + stats.misses == stats.queries
        assert stats.tokens_hit <= stats.tokens_queried

    @invariant()
    def nothing_held_or_pinned_was_evicted(self):
        assert all(e.ref_count == 0 and not e.pinned for e in self.evicted)
        assert all(entry.key in self.cache for entry in self.held)
        assert sum(e.ref_count for e in self.cache.entries()) == len(self.held)


TestCacheWorkload = CacheWorkload.TestCase
TestCacheWorkload.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_insert_takes_the_key_it_is_given(monkeypatch):
    import preheat.workers.engine.kvcache as kvcache

    cache = KVCacheManager(CacheBudget(max_entries=4, max_bytes=1_000))
    key = CacheKey.of("m", [1, 2, 3])
    monkeypatch.setattr(kvcache, "digest_tokens", lambda ids: pytest.fail("the key was given: nothing to hash"))
    entry = cache.insert("m", [1, 2, 3], object(), 10, key=key)
    assert entry.key is key and cache.peek(key) is entry
    with pytest.raises(ValueError, match="not of model 'other'"):
        cache.insert("other", [1, 2, 3], object(), 10, key=key)
    assert len(cache) == 1 and cache.stats().bytes == 10
