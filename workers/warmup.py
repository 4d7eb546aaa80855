"""What a warmup measures for one template: the history job's columns, and the probes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from workers.kvcache import CacheKey
from workers.generate import FirstToken, PrefixEngine, median_first_token
from workers.models import ResidentModel


@dataclass
class TemplateWarmup:
    """What one warmup of one template measured; the fields are the history job's columns."""

    model: str
    template: str
    status: str  # warm | degraded | failed
    device: str | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    ttft_cold_ms: float | None = None
    ttft_warm_ms: float | None = None
    ttft_bare_ms: float | None = None
    cached_tokens: int | None = None
    cache_bytes: int | None = None
    error: str | None = None

    def as_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("model", "template")}


@dataclass(frozen=True)
class Probe:
    bare: FirstToken  # the user's text with no system prompt: the floor a cache can approach
    cold: FirstToken  # full prompt, full prefill: what a cold server does
    warm: FirstToken  # full prompt from the cached prefix


def probe(engine: PrefixEngine, resident: ResidentModel, prompt_ids: torch.Tensor, bare_ids: torch.Tensor,
          repeats: int, prefix_key: CacheKey) -> Probe:
    """Median TTFT of the three ways to answer, measured side by side; probes are not
    counted as cache traffic."""
    return Probe(
        bare=median_first_token(lambda: engine.first_token(resident, bare_ids, use_cache=False), repeats),
        cold=median_first_token(lambda: engine.first_token(resident, prompt_ids, use_cache=False), repeats),
        warm=median_first_token(lambda: engine.first_token(resident, prompt_ids, prefix_key=prefix_key), repeats),
    )


def verdict(result: TemplateWarmup, measured: Probe, prefix_tokens: int) -> None:
    """Warm only when verified: the cached prefix was used and gives full prefill's token."""
    result.ttft_bare_ms, result.ttft_cold_ms, result.ttft_warm_ms = measured.bare.ms, measured.cold.ms, measured.warm.ms
    # A prompt equal to the prefix recomputes its last token, hence the - 1.
    if measured.warm.cached_tokens < prefix_tokens - 1:
        result.status, result.error = "degraded", "the probe did not start from the cached prefix"
    elif measured.warm.token_id != measured.cold.token_id:
        result.status = "degraded"
        result.error = (f"cached-prefix first token {measured.warm.token_id} differs from full prefill's "
                        f"{measured.cold.token_id}")
    else:
        result.status = "warm"
