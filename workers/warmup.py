"""Warm one template on this process: model resident, prefix pre-filled, probe measured."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from preheat.catalog import Catalog
from preheat.errors import PreheatError
from workers.models import ModelRegistry
from workers.prefix import Prefix, encode, first_token_cold, first_token_warm, median_first_token, prefill, prefix_key

log = logging.getLogger(__name__)


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


@dataclass
class WorkerRuntime:
    """Everything a worker process keeps warm: resident models and their pre-filled prefixes."""

    catalog: Catalog
    device_preference: str = "auto"
    probe_repeats: int = 3
    registry: ModelRegistry = field(init=False)
    prefixes: dict[tuple[str, str], Prefix] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.registry = ModelRegistry(self.device_preference)

    def warm_template(self, template: str) -> TemplateWarmup:
        """Never raises for a broken model or prompt: the failure is the measurement."""
        result = TemplateWarmup(model="", template=template, status="failed")
        try:
            result.model = self.catalog.template(template).model
            self._warm(result.model, template, result)
        except (PreheatError, ValueError, RuntimeError, OSError) as exc:
            result.status, result.error = "failed", str(exc)
            log.warning("warmup of %s failed: %s", template, exc)
        return result

    def _warm(self, model: str, template: str, result: TemplateWarmup) -> None:
        spec = self.catalog.model(model)
        resident, result.load_ms = self.registry.ensure(model, self.catalog.model_path(model), spec.dtype,
                                                        spec.revision)
        result.device = resident.placement.describe()
        system_prompt = self.catalog.system_prompt(template)
        prefix, result.prefill_ms = self._ensure_prefix(resident, template, system_prompt)
        result.cached_tokens, result.cache_bytes = prefix.num_tokens, prefix.nbytes

        probe, repeats = self.catalog.template(template).probe, self.probe_repeats
        bare = median_first_token(lambda: first_token_cold(resident, None, probe), repeats)
        cold = median_first_token(lambda: first_token_cold(resident, system_prompt, probe), repeats)
        warm = median_first_token(lambda: first_token_warm(resident, prefix, probe), repeats)
        result.ttft_bare_ms, result.ttft_cold_ms, result.ttft_warm_ms = bare.ms, cold.ms, warm.ms
        # Verified, not assumed: the cached prefix must give the token a full prefill gives.
        if warm.token_id == cold.token_id:
            result.status = "warm"
        else:
            result.status = "degraded"
            result.error = f"cached-prefix first token {warm.token_id} differs from full prefill's {cold.token_id}"

    def _ensure_prefix(self, resident, template: str, system_prompt: str) -> tuple[Prefix, float]:
        """Reuse the cached prefix when the prompt is unchanged; else pre-fill. Returns ms spent."""
        cached = self.prefixes.get((resident.name, template))
        current_key = prefix_key(resident.name, encode(resident, system_prompt, with_bos=True))
        if cached is not None and cached.key == current_key:
            return cached, 0.0
        prefix = prefill(resident, template, system_prompt)
        self.prefixes[(resident.name, template)] = prefix
        return prefix, prefix.prefill_ms
