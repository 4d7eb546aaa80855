"""Side-by-side TTFT measurements: cold (full prefill), warm (cached prefix), bare (no
system prompt at all), for system prompts of chosen lengths, in one run; and a
conversation's second turn with and without its first turn cached. Every prompt is
rendered with the model's chat template, as a real request is.

The three are measured side by side (`preheat.workers.warmup.side_by_side`: interleaved, each
timed call after an untimed one of its kind), as a warmup job probes: each is a request
through the scheduler, the path a served request takes. Each figure is a median. What
reuse costs (lookup, id check, clone) is timed inside the warm path and reported against
the warm TTFT.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.chat import TemplatePrefix, conversation, render
from preheat.workers.engine.kvcache import CacheBudget, KVCacheManager
from preheat.workers.engine.prefixes import Prefixes
from preheat.workers.engine.prefixstore import PrefixStore
from preheat.workers.engine.resident import ResidentModel, encode
from preheat.workers.engine.scheduler import Scheduler
from preheat.workers.warmup import first_token, side_by_side

USER_INPUT = "My parcel was due on Tuesday and it still has not arrived. What can I do?"


@dataclass(frozen=True)
class TTFTRow:
    system_tokens: int  # the system prompt's own
    prefix_tokens: int  # as the chat template renders it: what is cached
    user_tokens: int
    prefill_ms: float
    restore_ms: float  # the same prefix read back from a prefix store (workers/prefixstore.py)
    ttft_cold_ms: float
    ttft_warm_ms: float
    ttft_bare_ms: float
    reuse_ms: float
    cache_bytes: int
    same_first_token: bool

    @property
    def restore_over_prefill(self) -> float:
        return self.restore_ms / self.prefill_ms

    @property
    def saved_pct(self) -> float:
        return 100 * (1 - self.ttft_warm_ms / self.ttft_cold_ms)

    @property
    def reuse_overhead_pct(self) -> float:
        return 100 * self.reuse_ms / self.ttft_warm_ms

    @property
    def warm_over_bare(self) -> float:
        """1.0 is the limit: the system prompt costs nothing at all."""
        return self.ttft_warm_ms / self.ttft_bare_ms

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "saved_pct": self.saved_pct,
            "restore_over_prefill": self.restore_over_prefill,
            "reuse_overhead_pct": self.reuse_overhead_pct,
            "warm_over_bare": self.warm_over_bare,
        }


def system_prompt_text(resident: ResidentModel, num_tokens: int, text: str) -> str:
    """The start of `text` that is `num_tokens` tokens long (the template adds its own)."""
    ids = encode(resident, text, with_bos=False)
    if ids.shape[-1] < num_tokens:
        raise ValueError(f"the source text has {ids.shape[-1]} tokens; {num_tokens} were asked for")
    return resident.tokenizer.decode(ids[0, :num_tokens])


@contextmanager
def _scheduler() -> Iterator[Scheduler]:
    """A scheduler over a cache of its own, for one measurement."""
    scheduler = Scheduler(Prefixes(KVCacheManager(CacheBudget(max_entries=4, max_bytes=2**62))))
    try:
        yield scheduler
    finally:
        scheduler.close()


def measure_ttft(
    resident: ResidentModel, system_prompt: str, repeats: int, user_input: str = USER_INPUT, system_tokens: int = 0
) -> TTFTRow:
    prefix = TemplatePrefix.of(resident, system_prompt)
    prompt_ids = prefix.prompt_ids(resident, user_input)
    bare_ids = render(resident, conversation(None, user_input))
    with _scheduler() as scheduler:
        prefilled = scheduler.prefill(resident, prefix.ids, key=prefix.key, label=f"{prefix.ids.shape[-1]} tokens")
        entry, prefill_ms = prefilled.entry, prefilled.prefill_ms
        ways = {
            "cold": lambda: first_token(scheduler, resident, prompt_ids, use_cache=False),
            "warm": lambda: first_token(scheduler, resident, prompt_ids),
            "bare": lambda: first_token(scheduler, resident, bare_ids, use_cache=False),
        }
        runs = side_by_side(ways, repeats)

    def median_ms(name: str) -> float:
        return statistics.median(run.ms for run in runs[name])

    restore_ms = measure_restore(resident, entry, repeats)
    if any(run.cached_tokens != entry.num_tokens for run in runs["warm"]):
        raise RuntimeError("the warm path did not start from the cached prefix")
    return TTFTRow(
        system_tokens=system_tokens or len(encode(resident, system_prompt, with_bos=False)[0]),
        prefix_tokens=int(prefix.ids.shape[-1]),
        user_tokens=int(prompt_ids.shape[-1] - prefix.ids.shape[-1]),
        prefill_ms=prefill_ms,
        restore_ms=restore_ms,
        ttft_cold_ms=median_ms("cold"),
        ttft_warm_ms=median_ms("warm"),
        ttft_bare_ms=median_ms("bare"),
        reuse_ms=statistics.median(run.reuse_ms for run in runs["warm"]),
        cache_bytes=entry.nbytes,
        same_first_token={run.token_id for run in runs["warm"]} == {run.token_id for run in runs["cold"]},
    )


def measure_restore(resident: ResidentModel, entry, repeats: int) -> float:
    """Median milliseconds to restore `entry`'s prefix from a prefix store on this disk
    (written once; read as a restarted worker reads it: file to tensors on the device)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="preheat-bench-store-") as folder:
        store = PrefixStore(Path(folder), 2**62)
        if store.save(resident, entry.token_ids, entry.payload) is None:
            return float("nan")
        return statistics.median(store.restore(resident, entry.token_ids).ms for _ in range(max(repeats, 3)))


@dataclass(frozen=True)
class TurnTwoRow:
    """A conversation's second turn: TTFT with turn one remembered, and with only the
    system prompt's prefix cached (what a cache of system prompts alone gives)."""

    system_tokens: int
    turn_one_tokens: int  # the whole first turn's prompt, the system turn included
    turn_two_tokens: int
    cached_with_turn_one: int
    cached_prefix_only: int
    ttft_with_turn_one_ms: float
    ttft_prefix_only_ms: float
    same_first_token: bool

    @property
    def speedup(self) -> float:
        return self.ttft_prefix_only_ms / self.ttft_with_turn_one_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


TURN_TWO = "I still have not got it. Can you open an investigation? The tracking number is AB123456789."


def measure_turn_two(
    resident: ResidentModel, system_prompt: str, repeats: int, turn_one_input: str, answer_tokens: int = 64
) -> TurnTwoRow:
    """Turn one is `turn_one_input` (a pasted document, say) answered with `answer_tokens`;
    turn two a short follow-up. The remembered turn spares turn two its first turn's tokens."""
    prefix = TemplatePrefix.of(resident, system_prompt)
    turn_one = conversation(system_prompt, turn_one_input)
    # One scheduler, as a worker has: two threads taking turns at forward passes would each
    # keep a team of OpenMP threads spinning, and slow both (1.7x measured).
    with _scheduler() as scheduler:
        cache = scheduler.prefixes.cache
        scheduler.prefill(resident, prefix.ids, key=prefix.key, pin=True)
        greedy = SamplingParams(max_tokens=answer_tokens, temperature=0.0)
        answer = scheduler.submit(resident, render(resident, turn_one), greedy, remember=True).collect()
        [remembered] = [entry for entry in cache.entries() if entry.label == "conversation"]
        turn_two = [*turn_one, {"role": "assistant", "content": answer.text}, {"role": "user", "content": TURN_TWO}]
        ids = render(resident, turn_two)

        def with_turn_one(cached: bool):
            """Turn two's first token with turn one cached or not (the entry put back or taken out)."""
            if cached and remembered.key not in cache:
                cache.insert(resident.name, remembered.token_ids, remembered.payload, remembered.nbytes)
            elif not cached and remembered.key in cache:
                cache.remove(remembered.key)
            return first_token(scheduler, resident, ids)

        runs = side_by_side(
            {"remembered": lambda: with_turn_one(True), "prefix_only": lambda: with_turn_one(False)}, repeats
        )
    return TurnTwoRow(
        system_tokens=int(prefix.ids.shape[-1]),
        turn_one_tokens=int(render(resident, turn_one).shape[-1]),
        turn_two_tokens=int(ids.shape[-1]),
        cached_with_turn_one=min(run.cached_tokens for run in runs["remembered"]),
        cached_prefix_only=min(run.cached_tokens for run in runs["prefix_only"]),
        ttft_with_turn_one_ms=statistics.median(run.ms for run in runs["remembered"]),
        ttft_prefix_only_ms=statistics.median(run.ms for run in runs["prefix_only"]),
        same_first_token={r.token_id for r in runs["remembered"]} == {r.token_id for r in runs["prefix_only"]},
    )
