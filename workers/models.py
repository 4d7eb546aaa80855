"""Models kept resident in a worker process.

A worker loads each catalog model once and keeps it for the life of the process; every
warmup and request after that reuses it. A model that fails to load is remembered as
unavailable with its error, so one broken model never takes the worker down.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field

from preheat.errors import ModelLoadError
from workers.device import Placement, pick_placement

log = logging.getLogger(__name__)


@dataclass
class ResidentModel:
    name: str
    path: str
    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers tokenizer
    placement: Placement
    load_ms: float
    # transformers 5.24 renamed the forward kwarg `past_key_values` to `cache`.
    cache_kwarg: str = "past_key_values"
    max_context: int = 0


@dataclass
class ModelRegistry:
    """Per-process registry of resident models (thread-safe; loads each name once)."""

    device_preference: str = "auto"
    _models: dict[str, ResidentModel] = field(default_factory=dict)
    _errors: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ensure(self, name: str, path: str, dtype: str = "auto", revision: str | None = None,
               ) -> tuple[ResidentModel, float]:
        """Return the resident model and the milliseconds this call spent loading it (0 if resident)."""
        with self._lock:
            if name in self._models:
                return self._models[name], 0.0
            started = time.perf_counter()
            try:
                resident = _load(name, path, revision, pick_placement(self.device_preference, dtype))
            except Exception as exc:
                self._errors[name] = f"{type(exc).__name__}: {exc}"
                raise ModelLoadError(f"model {name!r} failed to load from {path}: {self._errors[name]}") from exc
            resident.load_ms = (time.perf_counter() - started) * 1000
            self._models[name] = resident
            self._errors.pop(name, None)
            log.info("model %s resident on %s after %.0f ms", name, resident.placement.describe(), resident.load_ms)
            return resident, resident.load_ms

    @property
    def unavailable(self) -> dict[str, str]:
        return dict(self._errors)


def _load(name: str, path: str, revision: str | None, placement: Placement) -> ResidentModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    pinned = {"revision": revision} if revision else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **pinned)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=placement.dtype, **pinned)
    model.to(placement.device).eval()
    forward_params = inspect.signature(model.forward).parameters
    return ResidentModel(
        name=name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        placement=placement,
        load_ms=0.0,
        cache_kwarg="cache" if "cache" in forward_params else "past_key_values",
        max_context=int(getattr(model.config, "max_position_embeddings", 0) or 0),
    )
