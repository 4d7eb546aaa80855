"""Prometheus metrics of one worker process.

Cache and model figures are read from their owners at scrape time (a collector, not a
second set of counters kept in step); only TTFT and pre-fill counts are observed as they
happen. Each runtime has its own collectors, so tests and several runtimes never share state.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from preheat.workers.engine.kvcache import KVCacheManager
from preheat.workers.engine.resident import ResidentModels

# From a warm tiny model on a CPU (milliseconds) to a cold 70B prefill (tens of seconds).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StateCollector:
    def __init__(self, cache: KVCacheManager, models: ResidentModels, is_ready: Callable[[], bool]) -> None:
        self._cache, self._models, self._is_ready = cache, models, is_ready

    def collect(self):
        stats = self._cache.stats()
        for name, value, doc in (
            ("preheat_kv_cache_queries", stats.queries, "Prefix lookups by requests."),
            ("preheat_kv_cache_hits", stats.hits, "Lookups that found a cached prefix."),
            ("preheat_kv_cache_misses", stats.misses, "Lookups that found none."),
            ("preheat_kv_cache_query_tokens", stats.tokens_queried, "Prompt tokens looked up."),
            ("preheat_kv_cache_hit_tokens", stats.tokens_hit, "Prompt tokens served from the cache."),
            ("preheat_kv_cache_inserts", stats.inserts, "Prefixes added."),
            ("preheat_kv_cache_evictions", stats.evictions, "Prefixes evicted to respect the budget."),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        budget = self._cache.budget
        for name, value, doc in (
            ("preheat_kv_cache_bytes", stats.bytes, "Exact bytes of cached key/value tensors."),
            ("preheat_kv_cache_entries", stats.entries, "Cached prefixes."),
            ("preheat_kv_cache_pinned_bytes", stats.pinned_bytes, "Bytes of pinned prefixes."),
            ("preheat_kv_cache_pinned_entries", stats.pinned_entries, "Pinned prefixes."),
            ("preheat_kv_cache_max_bytes", budget.max_bytes, "Byte budget of the cache."),
            ("preheat_kv_cache_max_entries", budget.max_entries, "Entry budget of the cache."),
            ("preheat_worker_ready", int(self._is_ready()), "1 once every catalog model is resident and pre-filled."),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        load = GaugeMetricFamily("preheat_model_load_seconds", "Time the model took to load.", labels=["model"])
        resident = GaugeMetricFamily(
            "preheat_model_resident", "1 when the model is loaded, 0 when it failed.", labels=["model"]
        )
        for name, model in self._models.resident.items():
            load.add_metric([name], model.load_ms / 1000)
            resident.add_metric([name], 1)
        for name in self._models.unavailable:
            resident.add_metric([name], 0)
        yield load
        yield resident


class EngineCollector:
    """The batching scheduler's load, read at scrape time."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler

    def collect(self):
        load = self._scheduler.load()
        yield GaugeMetricFamily("preheat_requests_running", "Requests decoding now.", value=load["running"])
        yield GaugeMetricFamily("preheat_requests_waiting", "Requests waiting for a row.", value=load["waiting"])
        yield CounterMetricFamily(
            "preheat_decode_steps", "Batched decode steps run.", value=self._scheduler.outcomes.steps
        )
        yield CounterMetricFamily(
            "preheat_decode_step_rows",
            "Requests fed by those steps (over steps: the mean batch).",
            value=self._scheduler.outcomes.rows_stepped,
        )


class SleepCollector:
    """Each model's sleep state, named as vLLM names its own (`vllm:engine_sleep_state`):
    one series per state, 1 on the one it is in."""

    STATES = ("awake", "weights_offloaded", "discard_all")  # level 0, 1, 2

    def __init__(self, sleeps, models: Callable[[], list[str]]) -> None:
        self._sleeps, self._models = sleeps, models

    def collect(self):
        state = GaugeMetricFamily(
            "preheat_model_sleep_state",
            "1 on the model's sleep state: awake, weights_offloaded (level 1) or discard_all (level 2).",
            labels=["model", "sleep_state"],
        )
        for model in self._models():
            level = self._sleeps.level_of(model) or 0
            for i, name in enumerate(self.STATES):
                state.add_metric([model, name], int(i == level))
        yield state
        yield CounterMetricFamily(
            "preheat_model_wakes_on_demand",
            "Models woken because a request came while they slept here.",
            value=self._sleeps.wakes_on_demand,
        )


class RuntimeMetrics:
    def __init__(self, cache: KVCacheManager, models: ResidentModels, is_ready: Callable[[], bool]) -> None:
        self.collectors = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram(
            "preheat_ttft_seconds",
            "Time to first token of requests.",
            ["model", "cache"],
            buckets=TTFT_BUCKETS_S,
            registry=self.collectors,
        )
        self.prefills = Counter(
            "preheat_prefills", "System prompts pre-filled into the KV cache.", ["model"], registry=self.collectors
        )
        self.restores = Counter(
            "preheat_prefix_restores",
            "System prompts restored from the prefix store instead of computed.",
            ["model"],
            registry=self.collectors,
        )
        # Requests taken from this worker's own queue (sent there by preheat.routing: it holds
        # their prefix) against the model's shared queue: how much of the traffic routing places.
        self.requests_taken = Counter(
            "preheat_requests_taken",
            "preheat.infer requests taken, by the queue they came from (own: routed here; shared).",
            ["model", "queue"],
            registry=self.collectors,
        )
        # Requests under a LoRA adapter: their TTFT, by whether the adapter was resident or was
        # read for them (what warming adapters ahead saves their first users).
        self.adapter_ttft = Histogram(
            "preheat_adapter_ttft_seconds",
            "Time to first token of requests under a LoRA adapter, by whether it was resident or read for them.",
            ["model", "state"],
            buckets=TTFT_BUCKETS_S,
            registry=self.collectors,
        )
        self.collectors.register(_StateCollector(cache, models, is_ready))

    def start_series(self, models: list[str], with_adapters: list[str] = ()) -> None:
        """Every labelled series at 0 from the start: a rate over a series that appears only
        with its first event misses that event, and a dashboard shows nothing, not zero."""
        for model in models:
            self.prefills.labels(model=model)
            self.restores.labels(model=model)
            for cache in ("hit", "miss"):
                self.ttft.labels(model=model, cache=cache)
            for queue in ("own", "shared"):
                self.requests_taken.labels(model=model, queue=queue)
        for model in with_adapters:
            for state in ("resident", "read"):
                self.adapter_ttft.labels(model=model, state=state)

    def observe_ttft(self, model: str, cached_tokens: int, ttft_ms: float) -> None:
        self.ttft.labels(model=model, cache="hit" if cached_tokens else "miss").observe(ttft_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.collectors)
