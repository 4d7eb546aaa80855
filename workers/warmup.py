"""Warmup jobs on one worker: what each measures (the history job's columns), the probes,
the verdict, and the bookkeeping a later warmup is judged against.

A warmup makes a template warm (its model resident, its prefix pre-filled and pinned) and
proves it: probes are one-token greedy requests through the scheduler, the path requests
take, so `warm` compares like with like.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.chat import conversation, render
from preheat.workers.engine.kvcache import CacheKey
from preheat.workers.engine.prefixes import Prefilled
from preheat.workers.engine.resident import ResidentModel
from preheat.workers.engine.scheduler import Scheduler
from preheat.workers.templates import TEMPLATE_ERRORS, Templates

log = logging.getLogger(__name__)

# A probe: the first token, greedy, as a request that is not counted as cache traffic.
PROBE = SamplingParams(max_tokens=1, temperature=0.0)
SERVED_KEPT = 50  # served requests' TTFTs kept per template: the steady state
# Probes a new one is judged against: the latest, so the reference moves with the machine
# (a sudden several-fold slowdown stands out for a few warmups, a lasting change becomes
# the new normal), and a median, so one stalled probe among them does not move it.
RECENT_PROBES = 9
# A recent self needs a few probes: one is a sample, not a reference.
MIN_RECENT_PROBES = 3


@dataclass
class TemplateWarmup:
    """What one warmup of one template measured; the fields are the history job's columns."""

    model: str
    template: str
    status: str  # warm | degraded | failed | skipped
    device: str | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    compile_source: str | None = None  # compiled | restored (from the compile store) | eager
    compile_ms: float | None = None
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


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    ms: float
    cached_tokens: int = 0
    reuse_ms: float = 0.0


def first_token(
    scheduler: Scheduler, resident: ResidentModel, prompt_ids: torch.Tensor, *, use_cache: bool = True, adapter=None
) -> FirstToken:
    """Time to the first greedy token of `prompt_ids`, through the scheduler as a request:
    from the longest cached prefix, or (use_cache=False) cold; under `adapter` if given."""
    done = scheduler.submit(resident, prompt_ids, PROBE, use_cache=use_cache, record=False, adapter=adapter).collect()
    return FirstToken(done.token_ids[0], done.ttft_ms, done.cached_tokens, done.reuse_ms)


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
    """Each way's median run (what history records) and the fastest warm and bare runs (what
    the verdict judges: a neighbour's burst only ever slows a run, so the fastest is the
    worker's speed, where a median of three moves with the burst)."""

    bare: FirstToken  # the user's text with no system prompt: the floor a cache can approach
    cold: FirstToken  # full prompt, full prefill: what a cold server does
    warm: FirstToken  # full prompt from the cached prefix (the median run)
    warm_fastest_ms: float = 0.0
    bare_fastest_ms: float = 0.0


def probe(
    scheduler: Scheduler,
    resident: ResidentModel,
    prompt_ids: torch.Tensor,
    bare_ids: torch.Tensor,
    repeats: int,
    adapter=None,
) -> Probe:
    """Median TTFT of the three ways to answer, measured side by side (all three under the
    template's adapter, if it has one); probes are not counted as cache traffic."""
    runs = side_by_side(
        {
            "bare": lambda: first_token(scheduler, resident, bare_ids, use_cache=False, adapter=adapter),
            "cold": lambda: first_token(scheduler, resident, prompt_ids, use_cache=False, adapter=adapter),
            "warm": lambda: first_token(scheduler, resident, prompt_ids, adapter=adapter),
        },
        repeats,
    )
    return Probe(
        bare=median_of(runs["bare"]),
        cold=median_of(runs["cold"]),
        warm=median_of(runs["warm"]),
        warm_fastest_ms=min(run.ms for run in runs["warm"]),
        bare_fastest_ms=min(run.ms for run in runs["bare"]),
    )


@dataclass(frozen=True)
class Recent:
    """What this worker's latest probes of a prefix measured (their fastest runs): the
    reference a new probe is judged against, a reference that moves with the machine."""

    warm_ms: tuple[float, ...]
    bare_ms: tuple[float, ...]

    @property
    def warm(self) -> float:
        return statistics.median(self.warm_ms)

    @property
    def bare(self) -> float:
        return statistics.median(self.bare_ms)


def cache_error(measured: Probe, prefix_tokens: int) -> str | None:
    """Why the probe does not prove the cache: it did not start from the cached prefix, or
    that gave another first token than full prefill; None when it does."""
    if measured.warm.cached_tokens < prefix_tokens:
        return "the probe did not start from the cached prefix"
    if measured.warm.token_id != measured.cold.token_id:
        warm, cold = measured.warm.token_id, measured.cold.token_id
        return f"cached-prefix first token {warm} differs from full prefill's {cold}"
    return None


def timing_error(measured: Probe, recent: Recent | None, *, warm_factor: float) -> str | None:
    """Held to this worker's recent probes of the prefix, on fastest runs (a neighbour's
    burst only ever slows a run): its warm and its bare TTFT each within `warm_factor` of
    theirs. A busy worker is slowed by a fraction, a throttled or starved one several-fold:
    the factor tells them apart. Before a few probes there is no recent self: None."""
    if recent is None:
        return None
    for way, now, usual in (
        ("warm", measured.warm_fastest_ms, recent.warm),
        ("bare", measured.bare_fastest_ms, recent.bare),
    ):
        if now > warm_factor * usual:
            return (
                f"{way} TTFT {now:.1f} ms (fastest run) is {now / usual:.1f}x this worker's recent self ({usual:.1f} "
                f"ms, the median of its last {len(recent.bare_ms)} probes), over the warm factor {warm_factor:g}"
            )
    return None


def verdict(
    result: TemplateWarmup,
    measured: Probe,
    prefix_tokens: int,
    *,
    recent: Recent | None,
    warm_factor: float,
    steady_ms: float | None = None,
) -> None:
    """Warm only when verified: the probe proves the cache (`cache_error`) and holds to this
    worker's recent self (`timing_error`)."""
    result.ttft_bare_ms, result.ttft_cold_ms, result.ttft_warm_ms = measured.bare.ms, measured.cold.ms, measured.warm.ms
    result.ttft_steady_ms = steady_ms
    result.error = cache_error(measured, prefix_tokens) or timing_error(measured, recent, warm_factor=warm_factor)
    result.status = "degraded" if result.error else "warm"


class Warmups:
    """The warmup jobs of one worker, and what they are judged against: the latest probes
    of each prefix here (`Recent`). The TTFT of the requests it served from each template
    (its steady state) is reported beside. The start-up's load and pre-fill times are
    reported by the first job after them, once."""

    def __init__(
        self,
        templates: Templates,
        scheduler: Scheduler,
        *,
        probe_repeats: int,
        warm_factor: float,
        on_warm: Callable[[str], None],
    ) -> None:
        self._templates, self._scheduler, self._on_warm = templates, scheduler, on_warm
        self._probe_repeats, self._warm_factor = probe_repeats, warm_factor
        # Held by the start-up preload and by each warmup: a warmup that arrives while the
        # worker is still starting waits, instead of racing it on the same model and device
        # (which would pre-fill twice and skew both measurements).
        self.lock = threading.RLock()
        self._served_ms: dict[str, deque[float]] = {}
        self._recent: dict[CacheKey, deque[tuple[float, float]]] = {}  # (warm, bare) of the latest probes
        self._unreported_prefill: dict[CacheKey, Prefilled] = {}
        self._load_reported: set[str] = set()
        self._unreported_compile: dict[str, object] = {}  # model -> its compile's report
        self.last: dict[str, dict] = {}  # template -> what its latest warmup reported

    def started_with(self, prefilled: Prefilled) -> None:
        """A prefix computed or restored at start: the first job that uses it reports how."""
        if prefilled.source != "cached":
            self._unreported_prefill[prefilled.entry.key] = prefilled

    def compiled(self, model: str, report) -> None:
        """A model's steps compiled (restored, or eager): the first job after reports how."""
        self._unreported_compile[model] = report

    def observe(self, template: str, ttft_ms: float) -> None:
        """A served request that started from its template's cached prefix."""
        self._served_ms.setdefault(template, deque(maxlen=SERVED_KEPT)).append(ttft_ms)

    def steady_ttft_ms(self, template: str, min_samples: int = 5) -> float | None:
        """Median TTFT of this template's latest served cache-hit requests, once there are enough."""
        served = self._served_ms.get(template)
        return statistics.median(served) if served and len(served) >= min_samples else None

    def warm(self, template: str, only_if_cold: bool = False) -> TemplateWarmup:
        """Model resident, prefix pre-filled, probes measured. Never raises for a broken
        model, prompt or budget: the failure is the measurement. With `only_if_cold`, a
        template already warm here is `skipped` (a worker-online trigger after the
        worker's own start-up warmup)."""
        result = TemplateWarmup(model="", template=template, status="failed")
        try:
            result.model = self._templates.catalog.template(template).model
            with self.lock:
                if not self._templates.in_plan(template):
                    result.status, result.error = "skipped", "not this worker's share of the fleet's template plan"
                elif only_if_cold and self._templates.is_warm(template):
                    result.status, result.error = "skipped", "already warm: prefix cached and pinned"
                else:
                    self._warm(template, result)
        except TEMPLATE_ERRORS as exc:
            result.status, result.error = "failed", str(exc)
            log.warning("warmup of %s failed: %s", template, exc)
        self.last[template] = {"status": result.status, **result.as_record()}
        return result

    def _warm(self, template: str, result: TemplateWarmup) -> None:
        resolved, prefilled = self._templates.prefill(template)
        resident, prefix = resolved.resident, resolved.prefix
        result.load_ms = self._unreported_load_ms(resident)
        if (adapter := resolved.adapter) is not None and ("adapter", id(adapter)) not in self._load_reported:
            self._load_reported.add(("adapter", id(adapter)))  # its read, reported once per load
            result.load_ms += adapter.load_ms
        if (report := self._unreported_compile.pop(resident.name, None)) is not None:
            result.compile_source, result.compile_ms = report.source, report.ms
        result.device = resident.placement.describe()
        if prefilled.source == "cached":  # done at start: the first job reports how
            prefilled = self._unreported_prefill.pop(prefilled.entry.key, prefilled)
        entry = prefilled.entry
        result.cached_tokens, result.cache_bytes = entry.num_tokens, entry.nbytes
        result.prefill_ms, result.prefix_source = prefilled.prefill_ms, prefilled.source
        result.restore_ms = prefilled.restore_ms if prefilled.source == "restored" else None
        probe_text = resolved.spec.probe
        prompt_ids, bare_ids = prefix.prompt_ids(resident, probe_text), render(resident, conversation(None, probe_text))
        measured = probe(self._scheduler, resident, prompt_ids, bare_ids, self._probe_repeats, resolved.adapter)
        recent = self._recent.setdefault(prefix.key, deque(maxlen=RECENT_PROBES))
        reference = Recent(*map(tuple, zip(*recent, strict=True))) if len(recent) >= MIN_RECENT_PROBES else None
        proves_cache = cache_error(measured, result.cached_tokens) is None
        if proves_cache and timing_error(measured, reference, warm_factor=self._warm_factor):
            # Confirmed before it is said: a burst beside one probe passes, a throttled
            # worker or a slow cache does not. The second probe's runs join the first's.
            again = probe(self._scheduler, resident, prompt_ids, bare_ids, self._probe_repeats, resolved.adapter)
            measured = replace(
                measured,
                warm_fastest_ms=min(measured.warm_fastest_ms, again.warm_fastest_ms),
                bare_fastest_ms=min(measured.bare_fastest_ms, again.bare_fastest_ms),
            )
        verdict(
            result,
            measured,
            result.cached_tokens,
            recent=reference,
            steady_ms=self.steady_ttft_ms(template),
            warm_factor=self._warm_factor,
        )
        if proves_cache:  # only a probe that used the cache joins the reference
            recent.append((measured.warm_fastest_ms, measured.bare_fastest_ms))
        elif measured.warm.token_id != measured.cold.token_id:  # never served from again
            self._templates.withdraw(resolved, result.error)
            result.error += "; the prefix is out of service until a warmup proves it again"
        if result.status == "warm":
            self._on_warm(result.model)

    def _unreported_load_ms(self, resident: ResidentModel) -> float:
        """The model's load time, reported once, by the first job after the load (the
        start-up's goes to the first warmup); 0 after that."""
        if resident.name in self._load_reported:
            return 0.0
        self._load_reported.add(resident.name)
        return resident.load_ms
