"""What a warmup measures for one template: the history job's columns, and the probes."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from workers.generate import FirstToken, PrefixEngine
from workers.resident import ResidentModel


@dataclass
class TemplateWarmup:
    """What one warmup of one template measured; the fields are the history job's columns."""

    model: str
    template: str
    status: str  # warm | degraded | failed | skipped
    device: str | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    prefix_source: str | None = None  # computed | restored (from the prefix store) | cached
    restore_ms: float | None = None
    ttft_cold_ms: float | None = None
    ttft_warm_ms: float | None = None
    ttft_bare_ms: float | None = None
    ttft_steady_ms: float | None = None
    cached_tokens: int | None = None
    cache_bytes: int | None = None
    error: str | None = None

    def as_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("model", "template")}


def side_by_side(ways: dict[str, Callable[[], FirstToken]], repeats: int) -> dict[str, list[FirstToken]]:
    """Each way timed `repeats` times, interleaved round after round so drift on a shared
    machine hits them alike. Each timed call follows an untimed call of the same kind:
    otherwise a short request would be timed right after a long prefill that evicted the
    CPU caches, and carry a cost a worker serving a stream of requests does not pay."""
    runs: dict[str, list[FirstToken]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, measure in ways.items():
            measure()
            runs[name].append(measure())
    return runs


def median_of(runs: list[FirstToken]) -> FirstToken:
    """The median time; greedy decoding must give the same token every time."""
    if len({run.token_id for run in runs}) != 1:
        raise RuntimeError(f"greedy first token changed between identical runs: {[r.token_id for r in runs]}")
    return FirstToken(
        runs[0].token_id,
        statistics.median(r.ms for r in runs),
        min(r.cached_tokens for r in runs),
        statistics.median(r.reuse_ms for r in runs),
    )


@dataclass(frozen=True)
class Probe:
    bare: FirstToken  # the user's text with no system prompt: the floor a cache can approach
    cold: FirstToken  # full prompt, full prefill: what a cold server does
    warm: FirstToken  # full prompt from the cached prefix (the median run)
    warm_fastest_ms: float | None = None  # the fastest warm run: this worker at its best, now


def probe(
    engine: PrefixEngine,
    resident: ResidentModel,
    prompt_ids: torch.Tensor,
    bare_ids: torch.Tensor,
    repeats: int,
) -> Probe:
    """Median TTFT of the three ways to answer, measured side by side; probes are not
    counted as cache traffic."""
    runs = side_by_side(
        {
            "bare": lambda: engine.first_token(resident, bare_ids, use_cache=False),
            "cold": lambda: engine.first_token(resident, prompt_ids, use_cache=False),
            "warm": lambda: engine.first_token(resident, prompt_ids),
        },
        repeats,
    )
    return Probe(
        bare=median_of(runs["bare"]),
        cold=median_of(runs["cold"]),
        warm=median_of(runs["warm"]),
        warm_fastest_ms=min(run.ms for run in runs["warm"]),
    )


def reference_ttft(measured: Probe, *, steady_ms: float | None, best_ms: float | None) -> tuple[float, str]:
    """What a warm probe is held to: the fastest of this worker's own warm figures for the
    template — its served requests' steady state, the best warm probe it measured before,
    and the fastest run of this probe. Each already pays attention over the cached tokens,
    so a warm worker meets it at any prefix length (the no-system-prompt TTFT does not: a
    3,000-token prefix made every healthy warmup 2-2.3x it); a worker slowed since its best
    (throttled, contended) does not, and neither does one whose runs stall in turn (a CPU
    quota's throttling makes the median far slower than the fastest)."""
    candidates = [
        (steady_ms, "steady state"),
        (best_ms, "best warm TTFT this worker measured"),
        (measured.warm_fastest_ms, "fastest warm probe run"),
    ]
    known = [(ms, what) for ms, what in candidates if ms]
    return min(known) if known else (measured.warm.ms, "warm TTFT")


def verdict(
    result: TemplateWarmup,
    measured: Probe,
    prefix_tokens: int,
    *,
    steady_ms: float | None,
    warm_factor: float,
    best_ms: float | None = None,
) -> None:
    """Warm only when verified: the cached prefix was used, it gives full prefill's token,
    and the probe is as fast as this worker's own best for it (within `warm_factor`)."""
    result.ttft_bare_ms, result.ttft_cold_ms, result.ttft_warm_ms = measured.bare.ms, measured.cold.ms, measured.warm.ms
    result.ttft_steady_ms = steady_ms
    reference, what = reference_ttft(measured, steady_ms=steady_ms, best_ms=best_ms)
    result.status, result.error = "degraded", None
    if measured.warm.cached_tokens < prefix_tokens:
        result.error = "the probe did not start from the cached prefix"
    elif measured.warm.token_id != measured.cold.token_id:
        result.error = (
            f"cached-prefix first token {measured.warm.token_id} differs from full prefill's {measured.cold.token_id}"
        )
    elif measured.warm.ms > warm_factor * reference:
        result.error = (
            f"warm TTFT {measured.warm.ms:.1f} ms is {measured.warm.ms / reference:.2f}x the {what} "
            f"{reference:.1f} ms, over the warm factor {warm_factor:g}"
        )
    else:
        result.status = "warm"
