"""Everything one worker process keeps warm: resident models, the KV prefix cache, metrics.

Usable without Celery: `preload()` is what a worker does at start (every catalog model in
parallel, then every template pre-filled and pinned), `warm_template()` what a warmup job
measures, `generate()` / `infer()` what a request does, and `readiness()` what
`/health/ready` reports. It is built from parts, each given what it needs: the resident
models, the scheduler that runs every forward pass (over the prefix cache), the templates
as resolved and pre-filled, the warmups and their bookkeeping, and the gate that says when
a warm model takes requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from preheat.api.answers import LogprobShapes, whole_answer
from preheat.api.requests import DEFAULT_MAX_TOKENS, Ask
from preheat.api.sampling import SamplingParams
from preheat.core import startheap
from preheat.core.catalog import Catalog, load_catalog
from preheat.workers.adapters import AdapterCollector, Adapters
from preheat.workers.engine.chat import Messages, render, system_prompt_of
from preheat.workers.engine.compilestore import CompileStore, probe_ahead
from preheat.workers.engine.kvcache import CacheBudget, KVCacheManager
from preheat.workers.engine.prefixes import Prefixes
from preheat.workers.engine.prefixstore import PrefixStore
from preheat.workers.engine.request import Completion, Request, TextStream
from preheat.workers.engine.resident import ModelSource, ResidentModel, ResidentModels, encode
from preheat.workers.engine.scheduler import BatchLimits, ModelAsleepError, Scheduler
from preheat.workers.gate import RequestGate
from preheat.workers.metrics import EngineCollector, RuntimeMetrics, SleepCollector
from preheat.workers.sleep import Sleeps
from preheat.workers.templates import TEMPLATE_ERRORS, Templates
from preheat.workers.warmup import TemplateWarmup, Warmups

log = logging.getLogger(__name__)

DEFAULT_BUDGET = CacheBudget(max_entries=10, max_bytes=4 * 1024**3)


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"  # see Settings.device
    weight_loader: str = "auto"  # see Settings.weight_loader
    # A worker's come from its settings (auto: the hardware's fast precision, compiled); built
    # by hand, a runtime is the exact one: float32, eager.
    dtype: str = "float32"  # see Settings.dtype
    compile: str = "off"  # see Settings.compile
    compile_cache: Path | None = None  # see Settings.compile_cache
    probe_repeats: int = 3
    warm_factor: float = 3.0  # see Settings.warm_factor
    cache_budget: CacheBudget = DEFAULT_BUDGET
    batch_limits: BatchLimits = field(default_factory=BatchLimits)
    # Off only to measure what the cached prefixes give: every request computes its prompt.
    prefix_caching: bool = True
    sleep_drain_s: float = 30.0  # see Settings.sleep_drain_s

    @classmethod
    def from_settings(cls, settings) -> RuntimeConfig:
        return cls(
            device=settings.device,
            weight_loader=settings.weight_loader,
            dtype=settings.dtype,
            compile=settings.compile,
            compile_cache=settings.compile_cache_folder,
            probe_repeats=settings.probe_repeats,
            warm_factor=settings.warm_factor,
            cache_budget=CacheBudget(
                settings.kv_cache_max_entries, int(settings.kv_cache_max_bytes), settings.kv_cache_pinned_share
            ),
            batch_limits=BatchLimits(
                settings.max_running_requests,
                settings.max_queued_requests,
                settings.prefill_tokens_per_step,
                int(settings.running_kv_max_bytes),
            ),
            prefix_caching=settings.prefix_caching,
            sleep_drain_s=settings.sleep_drain_s,
        )


class WorkerRuntime:
    def __init__(
        self, catalog: Catalog, config: RuntimeConfig = RuntimeConfig(), prefix_store: PrefixStore | None = None
    ) -> None:
        self.catalog, self.config = catalog, config
        self.resident_models = ResidentModels(config.device, config.weight_loader, config.dtype)
        self.compile_store = CompileStore(config.compile_cache) if config.compile_cache is not None else None
        self.cache = KVCacheManager(config.cache_budget)
        self.scheduler = Scheduler(Prefixes(self.cache, prefix_store), config.batch_limits)
        self.metrics = RuntimeMetrics(self.cache, self.resident_models, lambda: not self.readiness())
        self.metrics.collectors.register(EngineCollector(self.scheduler))
        self.adapters = Adapters(catalog, self._resident)
        self.templates = Templates(catalog, self._resident, self.scheduler, self.metrics, self.adapters)
        self.warmups = Warmups(
            self.templates,
            self.scheduler,
            probe_repeats=config.probe_repeats,
            warm_factor=config.warm_factor,
            on_warm=self._announce_if_warm,
        )
        self.gate = RequestGate()
        # Asked once before the first load: the models to start asleep, and why (a worker
        # restarted off-peak; preheat.tasks.runtime sets it from the schedules).
        self.asleep_at_start: Callable[[], dict[str, str]] | None = None
        self._starting = threading.Lock()
        # This worker's share of the fleet's templates (preheat.tasks.worker.planned_share, by
        # preheat.fleet.placement's plan); None: every template is pinned here.
        self.planner: Callable[[], set[str] | None] | None = None
        self.sleeps = Sleeps(
            self.resident_models,
            self.scheduler,
            self.source,
            self.warmups.lock,
            on_sleep=self.gate.sleeping,
            on_wake=self._announce_if_warm,
            on_failed=self.gate.failed,
            forget_prefixes=self._asleep,
            restore_prefixes=self._ready_again,
            drain_s=config.sleep_drain_s,
        )
        self.metrics.collectors.register(SleepCollector(self.sleeps, lambda: list(catalog.models)))
        self.metrics.collectors.register(AdapterCollector(self.adapters))
        self.metrics.start_series(list(catalog.models), list(self.adapters.slots))

    @classmethod
    def from_settings(cls, settings) -> WorkerRuntime:
        """The runtime a preheat process builds from its settings (worker or `preheat serve`)."""
        folder = settings.prefix_store_folder
        store = PrefixStore(folder, int(settings.prefix_store_max_bytes)) if folder is not None else None
        return cls(load_catalog(settings.catalog), RuntimeConfig.from_settings(settings), store)

    # Start-up and readiness --------------------------------------------------------

    def announce_to(
        self,
        on_model_warm: Callable[[str], None],
        *,
        gated: bool = True,
        on_model_sleep: Callable[[str], None] | None = None,
    ) -> None:
        """Call `on_model_warm` once a model is warm (again after a wake), `on_model_sleep`
        when it goes to sleep; with `gated`, the model is ready only once `taking_requests`
        says the process takes its requests."""
        self.gate.on_model_warm, self.gate.gated = on_model_warm, gated
        self.gate.on_model_sleep = on_model_sleep

    def preload(self, max_parallel: int = 4) -> list[str]:
        """Load every catalog model in parallel, then pre-fill every template. Failures are
        kept (and reported by `readiness`), never raised. Returns the reasons not ready."""
        with self.warmups.lock:
            self.load_models(max_parallel)
            for model in self.resident_models.resident:
                self.compile_steps(model)
            if self.planner is not None:
                self.templates.planned = self._planned_quietly()
            for template in self.catalog.templates:
                resident = self.catalog.template(template).model in self.resident_models.resident
                if resident and self.templates.in_plan(template):
                    self._preload_template(template)
            for model in self.resident_models.resident:  # a model with no template is warm once loaded
                self._announce_if_warm(model)
        reasons = self.readiness()
        log.info("preload done: %s", "ready" if not reasons else "; ".join(reasons))
        return reasons

    def _preload_template(self, template: str) -> None:
        try:
            _, prefilled = self.templates.prefill(template)
            self.warmups.started_with(prefilled)
            if self.gate.on_model_warm is None:
                # Else the process exercises the model when it opens it (see exercise):
                # doing it here too cost a 135 M model 0.4 s of its start, for nothing.
                self._exercise(template)
            self._announce_if_warm(self.catalog.template(template).model)
        except TEMPLATE_ERRORS as exc:
            log.error("template %s could not be pre-filled: %s", template, exc)

    def load_models(self, max_parallel: int = 4) -> None:
        """Every catalog model resident (in parallel), nothing pre-filled, before the gate is set up; once."""
        with self._starting, startheap.building():
            if self.asleep_at_start is not None:
                ask, self.asleep_at_start = self.asleep_at_start, None
                self.sleeps.start_asleep(ask())
            awake = [name for name in self.catalog.models if name not in self.sleeps.asleep]
            # inductor's CPU probe beside the weights' read, where adapter steps (graphs) need it (compiled.py)
            if any(name in self.adapters.slots for name in awake):
                probe_ahead(self.config.compile, self.config.device)
            self.resident_models.preload_once([self.source(name) for name in awake], max_parallel)

    # The fleet's plan -------------------------------------------------------------

    def _planned_quietly(self) -> set[str] | None:
        try:
            return self.planner()
        except Exception as exc:  # the registry away: keep what this worker holds
            log.warning("template plan not read (%s): keeping %s", exc, self.templates.planned or "every template")
            return self.templates.planned

    def template_nbytes(self, name: str) -> int | None:
        """What pinning `name` takes here: its prefix ids × its model's KV per position.
        None while its model is not resident (asleep, or loading)."""
        resident = self.resident_models.get(self.catalog.template(name).model)
        if resident is None or self.sleeps.level_of(resident.name) is not None:
            return None
        return int(self.templates.resolve(name).prefix.ids.shape[-1]) * resident.kv_bytes_per_token

    def follow_plan(self) -> bool:
        """Pin this worker's share of the plan now: templates new to it pre-filled and pinned,
        those gone from it unpinned (LRU entries now, evicted when room is needed). True when
        the share changed."""
        if self.planner is None:
            return False
        with self.warmups.lock:
            planned = self._planned_quietly()
            if planned == self.templates.planned:
                return False
            before, self.templates.planned = self.templates.planned, planned
            log.info("template plan: %s (was %s)", sorted(planned or ()) or "every template", before)
            for name in self.catalog.templates:  # pins freed first: the pin cap holds the new share
                if not self.templates.in_plan(name):
                    self.templates.unpin(name)
            for name in self.catalog.templates:
                resident = self.catalog.template(name).model in self.resident_models.resident
                if self.templates.in_plan(name) and resident and not self.templates.is_warm(name):
                    self._preload_template(name)
            for model in self.catalog.models:
                self._announce_if_warm(model)
            return True

    def readiness(self) -> list[str]:
        """Why this worker should not take traffic yet; empty when it should."""
        return [reason for model in self.catalog.models for reason in self.model_readiness(model)]

    def model_readiness(self, model: str) -> list[str]:
        """Why `model` should not take requests yet; empty when it should."""
        reasons = []
        if (level := self.sleeps.level_of(model)) is not None:
            return [f"model {model}: asleep (level {level})"]
        if (failed := self.sleeps.failed.get(model)) is not None:
            return [f"model {model}: could not wake: {failed}"]
        if model in self.resident_models.unavailable:
            reasons.append(f"model {model} unavailable: {self.resident_models.unavailable[model]}")
        elif self.resident_models.get(model) is None:
            reasons.append(f"model {model} not loaded yet")
        for name in self.catalog.templates_of(model):
            if self.templates.in_plan(name) and (reason := self.templates.not_ready(name)) is not None:
                reasons.append(f"template {name}: {reason}")
        if not reasons and (gated := self.gate.reason(model)) is not None:
            reasons.append(gated)
        return reasons

    def taking_requests(self, model: str) -> None:
        """The process now takes `model`'s requests (see RequestGate)."""
        self.gate.taking(model)

    def source(self, model: str) -> ModelSource:
        spec = self.catalog.model(model)
        template, where = self.catalog.chat_template(model)
        return ModelSource(model, self.catalog.model_path(model), spec.dtype, spec.revision, template, where)

    def _resident(self, model: str) -> ResidentModel:
        """The model, loaded if it is not resident (its source, files included, read only then),
        woken if it sleeps (someone needs it now)."""
        self.sleeps.ensure_awake(model)
        resident = self.resident_models.get(model)
        if resident is None:
            resident, _ = self.resident_models.ensure(self.source(model))
        return resident

    def compile_steps(self, model: str) -> None:
        """Its steps compiled (or restored from the compile store) on the scheduler's thread,
        before the model takes requests; the first warmup after reports how."""
        resident = self.resident_models.get(model)
        if resident is not None and (resident.runner.compiled is None or not resident.runner.compiled.ready):
            runner, digest = resident.runner, resident.content_digest
            adapters = model in self.adapters.slots  # its steps with adapter rows compiled too
            report = self.scheduler.compile(runner, self.config.compile, self.compile_store, digest, adapters)
            self.warmups.compiled(model, report)

    def _asleep(self, model: str) -> None:
        """`model` went to sleep: its templates not ready (their KV freed), its adapters let go."""
        self.templates.asleep(model)
        self.adapters.asleep(model)

    def _ready_again(self, model: str) -> None:
        """After a wake: its steps compiled again (restored), the adapters that were resident
        read again, its templates restored and pinned."""
        self.compile_steps(model)
        self.adapters.awake(model)
        self._prefill_templates(model)

    def _prefill_templates(self, model: str) -> None:
        """Every template of `model` pre-filled (restored) and pinned, as at start-up."""
        for template in self.catalog.templates_of(model):
            if self.templates.in_plan(template):
                self._preload_template(template)

    def _announce_if_warm(self, model: str) -> None:
        planned = [name for name in self.catalog.templates_of(model) if self.templates.in_plan(name)]
        if all(self.templates.not_ready(name) is None for name in planned):
            self.gate.warm(model)

    def _exercise(self, template: str) -> None:
        """One request through the cache, off the books, read for two pieces and closed: the first real
        request must not pay the first-call costs (allocator, kernel selection, the scheduler thread's
        pool, the batch's KV buffers). Only the prefix as pre-filled: a prompt file edited since is a warmup's."""
        spec, known = self.catalog.template(template), self.templates.known(template)
        resident = self.resident_models.get(spec.model)
        if known is None or resident is None or known.key not in self.cache:
            return
        prompt_ids = known.prompt_ids(resident, spec.probe)
        # Of the default length, so the KV buffers the runner keeps (keep_batch_kv) fit a first request.
        new = max(1, min(DEFAULT_MAX_TOKENS, (resident.max_context or 1 << 30) - prompt_ids.shape[-1]))
        sampling = SamplingParams(max_tokens=new, temperature=0.0)
        self.scheduler.submit(resident, prompt_ids, sampling, record=False).close_after(2)

    def exercise(self, model: str) -> None:
        """One off-the-books request per warm template of `model`, before the process takes
        its requests. Best effort: a failure here is logged, and must not keep the model
        from its requests."""
        for name in self.catalog.templates_of(model):
            if self.templates.not_ready(name) is None:
                try:
                    self._exercise(name)
                except TEMPLATE_ERRORS as exc:
                    log.warning("first-call exercise of template %s failed: %s", name, exc)

    # Warmup jobs ------------------------------------------------------------------

    def warm_template(self, template: str, only_if_cold: bool = False) -> TemplateWarmup:
        """See Warmups.warm: never raises, the failure is the measurement."""
        return self.warmups.warm(template, only_if_cold)

    # Requests ---------------------------------------------------------------------

    def generate(self, template: str, user_input: str, sampling: SamplingParams = SamplingParams()) -> TextStream:
        """A request with a template's system prompt, rendered with the model's chat
        template and decoded from the cached prefix; a template that was evicted is
        pre-filled again first (and cached for the next)."""
        arrived = time.perf_counter()
        resolved = self.templates.resolve(template)
        prompt_ids = resolved.prefix.prompt_ids(resolved.resident, user_input)
        if self.config.prefix_caching:
            self.templates.ensure_prefix(resolved)
        return self._submit(resolved.resident, prompt_ids, sampling, arrived, template, adapter=resolved.adapter)

    def infer(self, template: str, user_input: str, sampling: SamplingParams = SamplingParams()) -> Completion:
        return self.generate(template, user_input, sampling).collect()

    def generate_chat(
        self, model: str, messages: Messages, sampling: SamplingParams = SamplingParams(), *, remember: bool = True
    ) -> TextStream:
        """A chat request, rendered with the model's chat template, from the longest cached
        prefix of its ids. Its system prompt's prefix is cached first: a template's pinned,
        any other unpinned (LRU), so the next conversation with it hits. With `remember`, the
        prompt and answer stay cached for the conversation's next turn."""
        arrived = time.perf_counter()
        base, adapter = self.catalog.base_and_adapter(model)  # `model` may name an adapter, as vLLM's
        resident = self._resident(base)
        weights, read = self.adapters.for_request(adapter)
        prompt_ids = render(resident, messages)
        system_prompt = system_prompt_of(messages)
        template = self.templates.named_by(base, system_prompt, adapter)
        if self.config.prefix_caching and template is not None:
            self.templates.ensure_prefix(self.templates.resolve(template))
        elif self.config.prefix_caching and system_prompt:
            self.templates.ensure_ad_hoc(resident, system_prompt, weights)
        return self._submit(
            resident, prompt_ids, sampling, arrived, template, remember=remember, adapter=weights, adapter_read=read
        )

    def generate_text(self, model: str, prompt: str, sampling: SamplingParams = SamplingParams()) -> TextStream:
        """A plain completion: the prompt's ids as the tokenizer gives them (no chat
        template), from the longest cached prefix."""
        arrived = time.perf_counter()
        base, adapter = self.catalog.base_and_adapter(model)
        resident = self._resident(base)
        weights, read = self.adapters.for_request(adapter)
        prompt_ids = encode(resident, prompt, with_bos=True)
        return self._submit(
            resident, prompt_ids, sampling, arrived, None, remember=sampling.n > 1, adapter=weights, adapter_read=read
        )

    def open_choice(self, ask: Ask, index: int = 0) -> TextStream:
        """Choice `index` of a parsed request (preheat.workers.protocol), chat or plain: what
        `/v1/*` and `preheat.infer` both open. Each later choice starts from what the ones
        before left cached."""
        sampling = ask.sampling.for_choice(index)
        if ask.prompt is not None:
            return self.generate_text(ask.model, ask.prompt, sampling)
        return self.generate_chat(ask.model, ask.messages, sampling)

    def answer(self, ask: Ask, request_id: str) -> dict:
        """The whole answer to a parsed request, every choice, in the route's own shape
        (`chat.completion`, usage with cached_tokens): `preheat.infer`'s chat form."""
        completions = [self.open_choice(ask, index).collect() for index in range(ask.sampling.n)]
        shapes = LogprobShapes(self.resident_models.get(self.catalog.base_and_adapter(ask.model)[0]).tokenizer)
        return whole_answer(ask, request_id, completions, shapes)

    def _submit(self, resident, prompt_ids, sampling, arrived: float, template: str | None, **how):
        """`how`: remember, adapter (the request's LoraWeights)."""
        try:
            return self._submit_now(resident, prompt_ids, sampling, arrived, template, **how)
        except ModelAsleepError:  # it went to sleep since the request looked: woken for it
            resident = self._resident(resident.name)
            if (adapter := how.get("adapter")) is not None:  # its adapter was let go with the model
                how["adapter"] = self.adapters.weights(adapter.name)
            return self._submit_now(resident, prompt_ids, sampling, arrived, template, **how)

    def _submit_now(
        self,
        resident,
        prompt_ids,
        sampling,
        arrived: float,
        template,
        *,
        remember=False,
        adapter=None,
        adapter_read=False,
    ):
        return self.scheduler.submit(
            resident,
            prompt_ids,
            sampling,
            use_cache=self.config.prefix_caching,
            remember=remember and self.config.prefix_caching,
            arrived=arrived,
            adapter=adapter,
            on_first_token=lambda request: self._observe(template, request, adapter_read),
        )

    def _observe(self, template: str | None, request: Request, adapter_read: bool = False) -> None:
        self.metrics.observe_ttft(request.model, request.cached_tokens, request.ttft_ms)
        if request.adapter is not None:
            state = "read" if adapter_read else "resident"
            self.metrics.adapter_ttft.labels(model=request.model, state=state).observe(request.ttft_ms / 1000)
        if template is not None and request.cached_tokens:
            self.warmups.observe(template, request.ttft_ms)

    # The process ------------------------------------------------------------------

    def close(self) -> None:
        """At shutdown: the requests taken run to their end, the prefix store's writes
        under way are finished."""
        self.scheduler.close()
        if (store := self.scheduler.prefixes.store) is not None:
            store.flush()

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def describe(self) -> dict:
        """This worker's state, for `preheat workers` and the health server."""
        stats, reasons, budget = self.cache.stats(), self.readiness(), self.config.cache_budget
        return {
            "ready": not reasons,
            "reasons": reasons,
            "models": {
                name: {
                    "device": m.placement.describe(),
                    "steps": m.runner.compile_report.source if m.runner.compile_report else "eager",
                    "load_ms": round(m.load_ms, 1),
                    "weight_loader": m.weight_loader,
                    "chat_template": m.chat_template_source,
                }
                for name, m in self.resident_models.resident.items()
            },
            "unavailable": self.resident_models.unavailable,
            "asleep": {name: state.describe() for name, state in self.sleeps.asleep.items()},
            "failed": dict(self.sleeps.failed),  # a wake that failed, and why
            "adapters": self.adapters.describe(),
            "engine": self.scheduler.load(),
            "serving": self.gate.serving(list(self.catalog.models)),
            # What the router sends template requests by (preheat.fleet.routing): the templates
            # pinned and warm here, and this worker's share of the fleet's plan (None: all).
            "templates": {
                "held": [name for name in self.catalog.templates if self.templates.is_warm(name)],
                "planned": None if self.templates.planned is None else sorted(self.templates.planned),
            },
            "cache": {
                "entries": stats.entries,
                "bytes": stats.bytes,
                "hits": stats.hits,
                "misses": stats.misses,
                "evictions": stats.evictions,
                "max_entries": budget.max_entries,
                "max_bytes": budget.max_bytes,
                "max_pinned_entries": budget.max_pinned_entries,
                "max_pinned_bytes": budget.max_pinned_bytes,
            },
            # What this worker measured at its latest warmup of each template, as reported to history.
            "last_warmup": dict(self.warmups.last),
        }
