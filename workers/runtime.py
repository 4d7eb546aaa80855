"""Everything one worker process keeps warm: resident models, the KV prefix cache, metrics.

Usable without Celery: `preload()` is what a worker does at start (every catalog model in
parallel, then every template pre-filled and pinned), `warm_template()` what a warmup job
measures, `generate()` / `infer()` what a request does, and `readiness()` what
`/health/ready` reports.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from preheat.catalog import Catalog, TemplateSpec, load_catalog
from preheat.errors import PreheatError
from workers.batch import BatchLimits, OnSchedulerThread, Scheduler
from workers.chat import Messages, TemplatePrefix, conversation, render
from workers.generate import Completion, Prefilled, PrefixEngine, TextStream
from workers.kvcache import CacheBudget, CacheBudgetError, CacheFullError, CacheKey, KVCacheManager
from workers.metrics import EngineCollector, RuntimeMetrics
from workers.prefix import encode
from workers.prefixstore import PrefixStore
from workers.resident import ModelSource, ResidentModel, ResidentModels
from workers.sampling import SamplingParams
from workers.warmup import TemplateWarmup, probe, verdict

log = logging.getLogger(__name__)

DEFAULT_BUDGET = CacheBudget(max_entries=10, max_bytes=4 * 1024**3)
# What a first-call exercise asks: two greedy tokens, off the books.
EXERCISE = SamplingParams(max_tokens=2, temperature=0.0)
# Ad hoc system prompts whose rendered prefix this worker remembers (each costs a few renders).
AD_HOC_PREFIXES = 64


@dataclass(frozen=True)
class ResolvedTemplate:
    """A template as one call uses it: resolved once, passed down (see WorkerRuntime._resolve)."""

    name: str
    spec: TemplateSpec
    resident: ResidentModel
    prefix: TemplatePrefix


@dataclass
class WorkerRuntime:
    catalog: Catalog
    device_preference: str = "auto"
    weight_loader: str = "auto"  # see Settings.weight_loader
    probe_repeats: int = 3
    cache_budget: CacheBudget = DEFAULT_BUDGET
    prefix_store: PrefixStore | None = None  # pre-filled prefixes kept on disk (workers/prefixstore.py)
    warm_factor: float = 1.5  # see Settings.warm_factor
    # "batch": requests decode together on the scheduler's thread (workers/batch.py);
    # "sequential": one at a time on the caller's thread, to measure the contrast.
    engine_kind: str = "batch"
    batch_limits: BatchLimits = field(default_factory=BatchLimits)
    prefix_caching: bool = True
    # Called with a model's name once every template of it is pre-filled (the worker then
    # starts consuming that model's inference queue).
    on_model_warm: Callable[[str], None] | None = None
    # Whether a warm model is ready only once the process takes its requests (`taking`):
    # the worker's inference queue consumed, serve's request thread warmed. Kubernetes
    # routes to a ready pod, so ready and taking requests must be the same moment.
    gate_requests: bool = False
    resident_models: ResidentModels = field(init=False)
    cache: KVCacheManager = field(init=False)
    engine: PrefixEngine = field(init=False)
    scheduler: Scheduler | None = field(init=False)
    submit: Callable[..., TextStream] = field(init=False)
    metrics: RuntimeMetrics = field(init=False)
    # template -> None once pre-filled, or the reason it is not
    _templates: dict[str, str | None] = field(init=False)
    _load_reported: set[str] = field(default_factory=set)
    _announced: set[str] = field(default_factory=set)
    # Pre-fill time of prefixes computed outside a warmup job (at start), reported by the
    # first job that uses them, like the start-up load time.
    _unreported_prefill: dict[CacheKey, Prefilled] = field(default_factory=dict)
    _prefixes: dict[str, TemplatePrefix] = field(default_factory=dict)
    _ad_hoc: dict[tuple[str, str], TemplatePrefix] = field(default_factory=dict)
    _taking: set[str] = field(default_factory=set)
    # TTFT of the latest served requests that started from their template's cached prefix:
    # this worker's steady state, against which a warmup's probe is judged.
    _served_ttft_ms: dict[str, deque[float]] = field(default_factory=dict)
    _last_warmup: dict[str, dict] = field(default_factory=dict)
    # The fastest warm probe run each prefix had here: the reference a later warmup of it
    # is held to (a worker throttled since then comes out degraded).
    _best_warm_ms: dict[CacheKey, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Held by the start-up preload and by each warmup: a warmup that arrives while the
    # worker is still starting waits, instead of racing it on the same model and device
    # (which would pre-fill twice and skew both measurements).
    _work_lock: threading.RLock = field(default_factory=threading.RLock)
    # The start-up load runs once, early or from preload, whichever comes first; later
    # warmups retry a failed model themselves.
    _models_loading: threading.Lock = field(default_factory=threading.Lock)
    _models_loaded: bool = False

    @classmethod
    def from_settings(cls, settings) -> WorkerRuntime:
        """The runtime a preheat process builds from its settings (worker or `preheat serve`)."""
        return cls(
            catalog=load_catalog(settings.catalog),
            device_preference=settings.device,
            weight_loader=settings.weight_loader,
            probe_repeats=settings.probe_repeats,
            warm_factor=settings.warm_factor,
            engine_kind=settings.engine,
            batch_limits=BatchLimits(
                settings.max_running_requests, settings.max_queued_requests, settings.prefill_tokens_per_step
            ),
            prefix_caching=settings.prefix_caching,
            cache_budget=CacheBudget(
                settings.kv_cache_max_entries, int(settings.kv_cache_max_bytes), settings.kv_cache_pinned_share
            ),
            prefix_store=(
                PrefixStore(settings.prefix_store_folder, int(settings.prefix_store_max_bytes))
                if settings.prefix_store_folder is not None
                else None
            ),
        )

    def __post_init__(self) -> None:
        self.resident_models = ResidentModels(self.device_preference, self.weight_loader)
        self.cache = KVCacheManager(self.cache_budget)
        self.engine = PrefixEngine(self.cache, self.prefix_store)
        if self.engine_kind not in ("batch", "sequential"):
            raise ValueError(f"engine must be batch or sequential, got {self.engine_kind!r}")
        self.scheduler = Scheduler(self.engine, self.batch_limits) if self.engine_kind == "batch" else None
        # What pre-fills and probes call: on the scheduler's thread when there is one.
        self.model_work = OnSchedulerThread(self.engine, self.scheduler) if self.scheduler else self.engine
        # Where a request goes: into the scheduler's batch, or decoded on the calling thread.
        self.submit = self.scheduler.submit if self.scheduler else self.engine.generate
        self.metrics = RuntimeMetrics(self.cache, self.resident_models, lambda: not self.readiness())
        if self.scheduler is not None:
            self.metrics.collectors.register(EngineCollector(self.scheduler))
        self._templates = {name: "not pre-filled yet" for name in self.catalog.templates}

    # Start-up and readiness --------------------------------------------------------

    def preload(self, max_parallel: int = 4) -> list[str]:
        """Load every catalog model in parallel, then pre-fill every template. Failures are
        kept (and reported by `readiness`), never raised. Returns the reasons not ready."""
        with self._work_lock:
            self._preload(max_parallel)
        reasons = self.readiness()
        log.info("preload done: %s", "ready" if not reasons else "; ".join(reasons))
        return reasons

    def load_models(self, max_parallel: int = 4) -> None:
        """Every catalog model resident (in parallel), nothing pre-filled: what a worker
        starts on before its gate is set up. Failures are kept, as in preload. Once: a
        second call waits for the first."""
        with self._models_loading:
            if not self._models_loaded:
                self.resident_models.preload([self.source(name) for name in self.catalog.models], max_parallel)
                self._models_loaded = True

    def _preload(self, max_parallel: int) -> None:
        self.load_models(max_parallel)
        for template in self.catalog.templates:
            if self.catalog.template(template).model in self.resident_models.resident:
                try:
                    prefilled = self.prefill_template(template)
                    if prefilled.source != "cached":
                        self._unreported_prefill[prefilled.entry.key] = prefilled
                    if self.on_model_warm is None:
                        # Else the thread that will serve requests exercises it (see exercise):
                        # doing it here too cost a 135 M model 0.4 s of its start, for nothing.
                        self._exercise(template)
                    self._announce_if_warm(self.catalog.template(template).model)
                except (PreheatError, ValueError, RuntimeError, OSError) as exc:
                    log.error("template %s could not be pre-filled: %s", template, exc)

    def readiness(self) -> list[str]:
        """Why this worker should not take traffic yet; empty when it should."""
        return [reason for model in self.catalog.models for reason in self.model_readiness(model)]

    def model_readiness(self, model: str) -> list[str]:
        """Why `model` should not take requests yet; empty when it should."""
        reasons = []
        if model in self.resident_models.unavailable:
            reasons.append(f"model {model} unavailable: {self.resident_models.unavailable[model]}")
        elif self.resident_models.get(model) is None:
            reasons.append(f"model {model} not loaded yet")
        reasons += [
            f"template {name}: {self._templates[name]}"
            for name in self.catalog.templates_of(model)
            if self._templates[name] is not None
        ]
        if not reasons and self.gate_requests and model not in self._taking:
            reasons.append(f"model {model}: warm, not taking requests yet")
        return reasons

    def taking_requests(self, model: str) -> None:
        """The process now takes `model`'s requests (see gate_requests)."""
        self._taking.add(model)
        log.info("model %s takes requests", model)

    def source(self, model: str) -> ModelSource:
        spec = self.catalog.model(model)
        template, where = self.catalog.chat_template(model)
        return ModelSource(model, self.catalog.model_path(model), spec.dtype, spec.revision, template, where)

    def _unreported_load_ms(self, resident: ResidentModel) -> float:
        """The model's load time, reported once, by the first caller after the load (the
        start-up preload's time goes to the first warmup job); 0 after that."""
        with self._lock:
            if resident.name in self._load_reported:
                return 0.0
            self._load_reported.add(resident.name)
            return resident.load_ms

    # Pre-fill ---------------------------------------------------------------------

    def prefill_template(self, template: str) -> Prefilled:
        """Pre-fill (or restore) and pin a template's system prompt."""
        return self._prefill(self._resolve_noting(template))

    def _resolve_noting(self, template: str) -> ResolvedTemplate:
        """_resolve, with a failure kept as the reason the template is not ready."""
        try:
            return self._resolve(template)
        except (PreheatError, ValueError, RuntimeError, OSError) as exc:
            self._templates[template] = str(exc)
            raise

    def _prefill(self, resolved: ResolvedTemplate) -> Prefilled:
        prefix = resolved.prefix
        try:
            prefilled = self.model_work.prefill(
                resolved.resident, prefix.ids, key=prefix.key, label=resolved.name, pin=True
            )
        except (PreheatError, ValueError, RuntimeError, OSError) as exc:
            self._templates[resolved.name] = str(exc)
            raise
        if prefilled.source == "computed":
            self.metrics.prefills.labels(model=resolved.resident.name).inc()
        elif prefilled.source == "restored":
            self.metrics.restores.labels(model=resolved.resident.name).inc()
        self._templates[resolved.name] = None
        return prefilled

    def _exercise(self, template: str) -> None:
        """One short request through the cache, off the books: the first real request must
        not be the one that pays for first-call costs (allocator, kernel selection). Only
        the prefix as pre-filled: a prompt file edited since is pre-filled by a warmup."""
        known, spec = self._prefixes.get(template), self.catalog.template(template)
        resident = self.resident_models.get(spec.model)
        if known is None or resident is None or self.cache.peek(known.key) is None:
            return
        prompt_ids = known.prompt_ids(resident, spec.probe)
        self.submit(resident, prompt_ids, EXERCISE, record=False).collect()  # the path requests take

    def exercise(self, model: str) -> None:
        """One off-the-books request per template of `model`, the way requests go: through
        the scheduler's batch, or (sequential engine) on the calling thread, which will serve
        them. That thread pays its own first-call costs here (torch's per-thread OpenMP pool
        is built by the first parallel op a thread runs). Best effort: a failure here is
        logged, and must not keep the model from its requests."""
        for name in self.catalog.templates_of(model):
            if self._templates[name] is None:
                try:
                    self._exercise(name)
                except (PreheatError, ValueError, RuntimeError, OSError) as exc:
                    log.warning("first-call exercise of template %s failed: %s", name, exc)

    def _announce_if_warm(self, model: str) -> None:
        warm = all(self._templates[name] is None for name in self.catalog.templates_of(model))
        if warm and model not in self._announced and self.on_model_warm is not None:
            self._announced.add(model)
            self.on_model_warm(model)

    # Warmup jobs ------------------------------------------------------------------

    def warm_template(self, template: str, only_if_cold: bool = False) -> TemplateWarmup:
        """Model resident, prefix pre-filled, probes measured. Never raises for a broken
        model, prompt or budget: the failure is the measurement. With `only_if_cold`, a
        template already warm here is `skipped` (a worker-online trigger after the
        worker's own start-up warmup)."""
        result = TemplateWarmup(model="", template=template, status="failed")
        try:
            result.model = self.catalog.template(template).model
            with self._work_lock:
                if only_if_cold and self.is_warm(template):
                    result.status, result.error = "skipped", "already warm: prefix cached and pinned"
                else:
                    self._warm(template, result)
        except (PreheatError, ValueError, RuntimeError, OSError) as exc:
            result.status, result.error = "failed", str(exc)
            log.warning("warmup of %s failed: %s", template, exc)
        self._last_warmup[template] = {"status": result.status, **result.as_record()}
        return result

    def is_warm(self, template: str) -> bool:
        known = self._prefixes.get(template)
        return (
            self._templates.get(template, "unknown") is None
            and known is not None
            and self.cache.peek(known.key) is not None
        )

    def steady_ttft_ms(self, template: str, min_samples: int = 5) -> float | None:
        """Median TTFT of this template's latest served cache-hit requests, once there are enough."""
        served = self._served_ttft_ms.get(template)
        return statistics.median(served) if served and len(served) >= min_samples else None

    def _warm(self, template: str, result: TemplateWarmup) -> None:
        resolved = self._resolve_noting(template)
        resident, prefix, probe_text = resolved.resident, resolved.prefix, resolved.spec.probe
        result.load_ms = self._unreported_load_ms(resident)
        result.device = resident.placement.describe()
        prefilled = self._prefill(resolved)
        if prefilled.source == "cached":  # done at start: the first job reports how
            prefilled = self._unreported_prefill.pop(prefilled.entry.key, prefilled)
        entry = prefilled.entry
        result.cached_tokens, result.cache_bytes = entry.num_tokens, entry.nbytes
        result.prefill_ms, result.prefix_source = prefilled.prefill_ms, prefilled.source
        result.restore_ms = prefilled.restore_ms if prefilled.source == "restored" else None
        measured = probe(
            self.model_work,
            resident,
            prefix.prompt_ids(resident, probe_text),
            render(resident, conversation(None, probe_text)),
            self.probe_repeats,
        )
        best_ms = self._best_warm_ms.get(prefix.key)
        if measured.warm.cached_tokens and measured.warm_fastest_ms:
            self._best_warm_ms[prefix.key] = min(best_ms or measured.warm_fastest_ms, measured.warm_fastest_ms)
        verdict(
            result,
            measured,
            result.cached_tokens,
            steady_ms=self.steady_ttft_ms(template),
            best_ms=best_ms,
            warm_factor=self.warm_factor,
        )
        if result.status == "warm":
            self._announce_if_warm(result.model)

    # Requests ---------------------------------------------------------------------

    def generate(self, template: str, user_input: str, sampling: SamplingParams = SamplingParams()) -> TextStream:
        """A request with a template's system prompt, rendered with the model's chat
        template and decoded from the cached prefix; a template that was evicted is
        pre-filled again first (and cached for the next)."""
        started = time.perf_counter()
        resolved = self._resolve(template)
        prompt_ids = resolved.prefix.prompt_ids(resolved.resident, user_input)
        self._ensure_prefix(resolved)
        return self._generate_ids(resolved.resident, prompt_ids, sampling, started, template)

    def _resident(self, model: str) -> ResidentModel:
        """The model, loaded if it is not resident (its source, files included, read only then)."""
        resident = self.resident_models.get(model)
        if resident is None:
            resident, _ = self.resident_models.ensure(self.source(model))
        return resident

    def _ensure_prefix(self, resolved: ResolvedTemplate) -> None:
        if resolved.prefix.key in self.cache or not self.prefix_caching:
            return
        log.info("template %s is not cached (evicted or never warmed): pre-filling it", resolved.name)
        try:
            self._prefill(resolved)
        except (CacheBudgetError, CacheFullError) as exc:
            log.warning("answering %s without the cache: %s", resolved.name, exc)

    def _resolve(self, template: str) -> ResolvedTemplate:
        """Everything one call needs of a template, looked up once: its spec, its model
        (loaded if needed), and its prefix ids and cache key (the prompt file read once,
        rendered and hashed once per system prompt text)."""
        spec = self.catalog.template(template)
        resident = self._resident(spec.model)
        system_prompt = self.catalog.system_prompt(template)
        known = self._prefixes.get(template)
        if known is None or known.system_prompt != system_prompt or known.model != resident.name:
            known = TemplatePrefix.of(resident, system_prompt)
            self._prefixes[template] = known
        return ResolvedTemplate(template, spec, resident, known)

    # Chat and raw prompts (`preheat serve`) -----------------------------------------

    def _system_prompts(self, model: str) -> list[tuple[str, str]]:
        """(template, system prompt) of `model`'s templates; the texts already rendered are
        taken from memory, so a request does not read prompt files per template."""
        return [
            (name, self._prefixes[name].system_prompt if name in self._prefixes else self.catalog.system_prompt(name))
            for name in self.catalog.templates_of(model)
        ]

    def template_for(self, model: str, system_prompt: str | None) -> str | None:
        """The catalog template of `model` whose system prompt this is, if any."""
        return next(
            (name for name, text in self._system_prompts(model) if system_prompt and text == system_prompt), None
        )

    def generate_chat(
        self, model: str, messages: Messages, sampling: SamplingParams = SamplingParams(), *, remember: bool = True
    ) -> TextStream:
        """A chat request, rendered with the model's chat template, from the longest cached
        prefix of its ids. Its system prompt's prefix is cached first: a template's pinned,
        any other unpinned (LRU), so the next conversation with it hits. With `remember`, the
        prompt and answer stay cached for the conversation's next turn."""
        started = time.perf_counter()
        resident = self._resident(model)
        prompt_ids = render(resident, messages)
        system_prompt = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        template = self.template_for(model, system_prompt)
        if template is not None:
            self._ensure_prefix(self._resolve(template))
        elif system_prompt:
            self._ensure_ad_hoc_prefix(resident, system_prompt)
        return self._generate_ids(resident, prompt_ids, sampling, started, template, remember=remember)

    def _ensure_ad_hoc_prefix(self, resident: ResidentModel, system_prompt: str) -> None:
        if not self.prefix_caching:
            return
        key = (resident.name, system_prompt)
        prefix = self._ad_hoc.pop(key, None) or TemplatePrefix.of(resident, system_prompt)
        self._ad_hoc[key] = prefix  # most recent last
        while len(self._ad_hoc) > AD_HOC_PREFIXES:
            self._ad_hoc.pop(next(iter(self._ad_hoc)))
        if prefix.key not in self.cache:
            try:
                self.model_work.prefill(resident, prefix.ids, key=prefix.key, label="ad hoc system prompt")
            except (CacheBudgetError, CacheFullError) as exc:
                log.info("ad hoc system prompt not cached: %s", exc)

    def generate_text(self, model: str, prompt: str, sampling: SamplingParams = SamplingParams()) -> TextStream:
        """A plain completion: the prompt's ids as the tokenizer gives them (no chat
        template), from the longest cached prefix."""
        started = time.perf_counter()
        resident = self._resident(model)
        prompt_ids = encode(resident, prompt, with_bos=True)
        return self._generate_ids(resident, prompt_ids, sampling, started, None, remember=sampling.n > 1)

    def _generate_ids(
        self,
        resident: ResidentModel,
        prompt_ids,
        sampling: SamplingParams,
        started: float,
        template: str | None,
        *,
        remember: bool = False,
    ) -> TextStream:
        return self.submit(
            resident,
            prompt_ids,
            sampling,
            use_cache=self.prefix_caching,
            remember=remember and self.prefix_caching,
            started=started,
            on_first_token=lambda completion: self._observe(template, completion),
        )

    def infer(self, template: str, user_input: str, sampling: SamplingParams = SamplingParams()) -> Completion:
        return self.generate(template, user_input, sampling).collect()

    def _observe(self, template: str | None, completion: Completion) -> None:
        self.metrics.observe_ttft(completion.model, completion.cached_tokens, completion.ttft_ms)
        if template is not None and completion.cached_tokens:
            self._served_ttft_ms.setdefault(template, deque(maxlen=50)).append(completion.ttft_ms)

    def close(self) -> None:
        """At shutdown: the prefix store's writes under way are finished."""
        if self.scheduler is not None:
            self.scheduler.close()  # the requests it took run to their end
        if self.prefix_store is not None:
            self.prefix_store.flush()

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def describe(self) -> dict:
        """This worker's state, for `preheat workers` and the health server."""
        stats, reasons = self.cache.stats(), self.readiness()
        return {
            "ready": not reasons,
            "reasons": reasons,
            "models": {
                name: {
                    "device": m.placement.describe(),
                    "load_ms": round(m.load_ms, 1),
                    "weight_loader": m.weight_loader,
                    "chat_template": m.chat_template_source,
                }
                for name, m in self.resident_models.resident.items()
            },
            "unavailable": self.resident_models.unavailable,
            "engine": {"kind": self.engine_kind, **(self.scheduler.load() if self.scheduler else {})},
            "cache": {
                "entries": stats.entries,
                "bytes": stats.bytes,
                "hits": stats.hits,
                "misses": stats.misses,
                "evictions": stats.evictions,
                "max_entries": self.cache_budget.max_entries,
                "max_bytes": self.cache_budget.max_bytes,
            },
            # What this worker measured at its latest warmup of each template, as it
            # reported it to history.
            "last_warmup": dict(self._last_warmup),
        }
