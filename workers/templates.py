"""A worker's templates as its requests and warmups use them.

A template is resolved once: its prompt file read, its system prompt rendered with the
model's chat template and its prefix ids hashed (``preheat.workers.engine.chat.TemplatePrefix``). Requests
use what was resolved and read no file; a warmup reads the prompt file again, so a prompt
edited on disk is pre-filled by the next warmup. Each template carries the reason it is
not ready (None once its prefix is pre-filled and pinned), which readiness reports.

System prompts that are no template (a chat request's own) get an unpinned prefix of their
own, remembered for the next request with the same prompt.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from preheat.core.catalog import Catalog, TemplateSpec
from preheat.core.errors import PreheatError
from preheat.workers.adapters import Adapters
from preheat.workers.engine.chat import TemplatePrefix
from preheat.workers.engine.kvcache import CacheBudgetError, CacheFullError
from preheat.workers.engine.lora import LoraWeights, namespace
from preheat.workers.engine.prefixes import Prefilled
from preheat.workers.engine.resident import ResidentModel
from preheat.workers.engine.scheduler import Scheduler
from preheat.workers.metrics import RuntimeMetrics

log = logging.getLogger(__name__)

# Ad hoc system prompts whose rendered prefix is remembered (each costs a few renders).
AD_HOC_PREFIXES = 64
# What a template's pre-fill can fail with and still leave the worker serving.
TEMPLATE_ERRORS = (PreheatError, ValueError, RuntimeError, OSError)


@dataclass(frozen=True)
class ResolvedTemplate:
    """A template as one call uses it: looked up once, passed down."""

    name: str
    spec: TemplateSpec
    resident: ResidentModel
    prefix: TemplatePrefix
    adapter: LoraWeights | None = None  # the template's adapter, resident (pinned while in the plan)


class Templates:
    def __init__(
        self,
        catalog: Catalog,
        resident_for: Callable[[str], ResidentModel],
        scheduler: Scheduler,
        metrics: RuntimeMetrics,
        adapters: Adapters,
    ) -> None:
        self.catalog, self._adapters = catalog, adapters
        self._resident_for, self._scheduler, self._metrics = resident_for, scheduler, metrics
        self._prefixes: dict[str, TemplatePrefix] = {}
        self._not_ready: dict[str, str | None] = dict.fromkeys(catalog.templates, "not pre-filled yet")
        self._ad_hoc: OrderedDict[tuple[str, str], TemplatePrefix] = OrderedDict()
        # This worker's share of the fleet's templates (preheat.fleet.placement); None: every one.
        # Only these are pinned and asked of readiness; the others are served from the LRU.
        self.planned: set[str] | None = None

    def in_plan(self, name: str) -> bool:
        return self.planned is None or name in self.planned

    def resolve(self, name: str, *, reread: bool = False) -> ResolvedTemplate:
        """Everything a call needs of a template: its spec, its model (loaded if need be),
        its prefix ids and key. The prompt file is read once, and again with `reread`."""
        spec = self.catalog.template(name)
        resident = self._resident_for(spec.model)
        adapter = None
        if spec.adapter is not None:
            # Pinned by a pre-fill of a template in the plan (a warmup's), never by a request.
            adapter = self._adapters.weights(spec.adapter, pin=reread and self.in_plan(name))
        space = namespace(resident.name, spec.adapter)
        known = self._prefixes.get(name)
        if known is None or reread or known.key.model != space:
            text = self.catalog.system_prompt(name)
            if known is None or known.system_prompt != text or known.key.model != space:
                self._replace(name, TemplatePrefix.of(resident, text, space))
        return ResolvedTemplate(name, spec, resident, self._prefixes[name], adapter)

    def _replace(self, name: str, prefix: TemplatePrefix) -> None:
        """A template's prompt changed: its old prefix is no longer pinned (an LRU entry
        like any other now), so old versions never hold the pinned budget."""
        old = self._prefixes.get(name)
        self._prefixes[name] = prefix
        cache = self._scheduler.prefixes.cache
        shared = old is not None and any(known.key == old.key for known in self._prefixes.values())
        if old is not None and not shared and old.key in cache:
            cache.unpin(old.key)

    def prefill(self, name: str) -> tuple[ResolvedTemplate, Prefilled]:
        """Pre-fill (or restore) and pin a template's prefix, its prompt file read again. A
        failure is kept as the reason the template is not ready, and raised."""
        try:
            resolved = self.resolve(name, reread=True)
        except TEMPLATE_ERRORS as exc:
            self._note(name, str(exc))
            raise
        return resolved, self._prefill(resolved)

    def _prefill(self, resolved: ResolvedTemplate) -> Prefilled:
        prefix, model = resolved.prefix, resolved.resident.name
        try:
            prefilled = self._scheduler.prefill(
                resolved.resident, prefix.ids, key=prefix.key, label=resolved.name, pin=True, adapter=resolved.adapter
            )
        except TEMPLATE_ERRORS as exc:
            self._note(resolved.name, str(exc))
            raise
        if prefilled.source == "computed":
            self._metrics.prefills.labels(model=model).inc()
        elif prefilled.source == "restored":
            self._metrics.restores.labels(model=model).inc()
        self._note(resolved.name, None)
        return prefilled

    def unpin(self, name: str) -> None:
        """`name` left this worker's share of the plan: its prefix stays, as an LRU entry."""
        known, cache = self._prefixes.get(name), self._scheduler.prefixes.cache
        if known is not None and known.key in cache:
            cache.unpin(known.key)

    def withdraw(self, resolved: ResolvedTemplate, reason: str) -> None:
        """The template's prefix gave a wrong first token: out of service (readiness says
        why) until a warmup computes it again and proves it."""
        self._scheduler.prefixes.withdraw(resolved.resident, resolved.prefix.ids, resolved.prefix.key)
        self._note(resolved.name, f"out of service: {reason}")
        log.warning("template %s out of service: %s", resolved.name, reason)

    def asleep(self, model: str) -> None:
        """`model` went to sleep: its prefixes are no longer cached; a wake pre-fills them."""
        for name in self.catalog.templates_of(model):
            self._note(name, "model asleep")

    def _note(self, name: str, reason: str | None) -> None:
        if name in self._not_ready:  # a name the catalog does not have stays out
            self._not_ready[name] = reason

    def ensure_prefix(self, resolved: ResolvedTemplate) -> None:
        """A request's template is cached before it starts: one evicted (or never warmed)
        is pre-filled again, for this request and the next."""
        if resolved.prefix.key in self._scheduler.prefixes.cache:
            return
        log.info("template %s is not cached (evicted or never warmed): pre-filling it", resolved.name)
        try:
            self._prefill(resolved)
        except (CacheBudgetError, CacheFullError) as exc:
            log.warning("answering %s without the cache: %s", resolved.name, exc)

    def ensure_ad_hoc(self, resident: ResidentModel, system_prompt: str, adapter: LoraWeights | None = None) -> None:
        """A system prompt that is no template: its prefix cached unpinned (LRU), so the
        next conversation with it starts from it (under its adapter, in its namespace)."""
        space = namespace(resident.name, adapter and adapter.name)
        key = (space, system_prompt)
        prefix = self._ad_hoc.pop(key, None) or TemplatePrefix.of(resident, system_prompt, space)
        self._ad_hoc[key] = prefix  # most recent last
        while len(self._ad_hoc) > AD_HOC_PREFIXES:
            self._ad_hoc.popitem(last=False)
        if prefix.key not in self._scheduler.prefixes.cache:
            try:
                self._scheduler.prefill(
                    resident, prefix.ids, key=prefix.key, label="ad hoc system prompt", adapter=adapter
                )
            except (CacheBudgetError, CacheFullError) as exc:
                log.info("ad hoc system prompt not cached: %s", exc)

    def named_by(self, model: str, system_prompt: str | None, adapter: str | None = None) -> str | None:
        """The template of `model` (under `adapter`) whose system prompt this is, if any (a
        prompt read before is not read again)."""
        if not system_prompt:
            return None
        for name in self.catalog.templates_of(model):
            if self.catalog.template(name).adapter != adapter:
                continue
            known = self._prefixes.get(name)
            if (known.system_prompt if known else self.catalog.system_prompt(name)) == system_prompt:
                return name
        return None

    def known(self, name: str) -> TemplatePrefix | None:
        """The template's prefix as it was last resolved (None before)."""
        return self._prefixes.get(name)

    def not_ready(self, name: str) -> str | None:
        return self._not_ready.get(name, "not in the catalog")

    def is_warm(self, name: str) -> bool:
        """In this worker's plan, ready, and its prefix in the cache now, pinned."""
        known = self._prefixes.get(name)
        entry = self._scheduler.prefixes.cache.peek(known.key) if known is not None else None
        # Pinned too: a template out of the plan and back keeps an LRU entry that may go any time.
        return self.in_plan(name) and self.not_ready(name) is None and entry is not None and entry.pinned
