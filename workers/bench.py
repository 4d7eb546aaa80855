"""Side-by-side TTFT measurements: cold (full prefill), warm (cached prefix), bare (no
system prompt at all), for system prompts of chosen lengths, in one run.

The three are measured side by side (`workers.warmup.side_by_side`: interleaved, each
timed call after an untimed one of its kind), as a warmup job probes. Each figure is a
median. What reuse costs (lookup, id check, clone) is timed inside the warm path and
reported against the warm TTFT.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from workers.generate import PrefixEngine
from workers.kvcache import CacheBudget, CacheKey, KVCacheManager
from workers.prefix import TemplatePrefix, encode
from workers.resident import ResidentModel
from workers.warmup import side_by_side

USER_INPUT = "My parcel was due on Tuesday and it still has not arrived. What can I do?"


@dataclass(frozen=True)
class TTFTRow:
    system_tokens: int
    user_tokens: int
    prefill_ms: float
    ttft_cold_ms: float
    ttft_warm_ms: float
    ttft_bare_ms: float
    reuse_ms: float
    cache_bytes: int
    same_first_token: bool

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
            "reuse_overhead_pct": self.reuse_overhead_pct,
            "warm_over_bare": self.warm_over_bare,
        }


def system_prompt_ids(resident: ResidentModel, num_tokens: int, text: str) -> torch.Tensor:
    """Exactly `num_tokens` ids: BOS and the start of `text` (which must be long enough)."""
    ids = encode(resident, text, with_bos=True)
    if ids.shape[-1] < num_tokens:
        raise ValueError(f"the source text has {ids.shape[-1]} tokens; {num_tokens} were asked for")
    return ids[:, :num_tokens]


def measure_ttft(
    resident: ResidentModel, system_ids: torch.Tensor, repeats: int, user_input: str = USER_INPUT
) -> TTFTRow:
    engine = PrefixEngine(KVCacheManager(CacheBudget(max_entries=1, max_bytes=2**62)))
    prefix = TemplatePrefix(resident.name, "", system_ids, CacheKey.of(resident.name, system_ids[0].numpy()))
    prompt_ids = prefix.prompt_ids(resident, user_input)
    bare_ids = encode(resident, user_input, with_bos=True)
    entry, prefill_ms = engine.prefill(resident, system_ids, label=f"{system_ids.shape[-1]} tokens")

    ways = {
        "cold": lambda: engine.first_token(resident, prompt_ids, use_cache=False),
        "warm": lambda: engine.first_token(resident, prompt_ids, prefix_key=entry.key),
        "bare": lambda: engine.first_token(resident, bare_ids, use_cache=False),
    }
    runs = side_by_side(ways, repeats)

    def median_ms(name: str) -> float:
        return statistics.median(run.ms for run in runs[name])

    if any(run.cached_tokens != entry.num_tokens for run in runs["warm"]):
        raise RuntimeError("the warm path did not start from the cached prefix")
    return TTFTRow(
        system_tokens=int(system_ids.shape[-1]),
        user_tokens=int(prompt_ids.shape[-1] - system_ids.shape[-1]),
        prefill_ms=prefill_ms,
        ttft_cold_ms=median_ms("cold"),
        ttft_warm_ms=median_ms("warm"),
        ttft_bare_ms=median_ms("bare"),
        reuse_ms=statistics.median(run.reuse_ms for run in runs["warm"]),
        cache_bytes=entry.nbytes,
        same_first_token={run.token_id for run in runs["warm"]} == {run.token_id for run in runs["cold"]},
    )
