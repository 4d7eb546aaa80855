"""The catalog's LoRA adapters on this worker: which are resident for each base model (their
slots: `preheat.workers.engine.lora.AdapterSlots`), read on demand or ahead of their
tenants (a warmup, a template's pin), let go at a sleep and read again at the wake.

A request names an adapter as vLLM's server does: the adapter's name as its `model`. The
base it belongs to is the catalog's (`Catalog.adapter_base`); the requests go to the base's
queue, and any worker that serves the base serves its adapters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from preheat.core.catalog import Catalog
from preheat.workers.engine.lora import AdapterError, AdapterSlots, LoraWeights, read_adapter
from preheat.workers.engine.openmp import team_released
from preheat.workers.engine.resident import ResidentModel

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, catalog: Catalog, resident_for: Callable[[str], ResidentModel]) -> None:
        self.catalog, self._resident_for = catalog, resident_for
        self.slots: dict[str, AdapterSlots] = {
            name: AdapterSlots(spec.max_adapters, max(1, spec.max_adapters // 2))
            for name, spec in catalog.models.items()
            if spec.adapters
        }
        self._asleep: dict[str, list[str]] = {}  # model -> the adapters resident when it went to sleep
        self._requests: dict[tuple[str, str], int] = {}
        self._errors: dict[str, str] = {}  # adapter -> why it cannot be used (its latest try)
        self._lock = threading.Lock()

    def weights(self, adapter: str, *, pin: bool = False, count: bool = False) -> LoraWeights:
        """The adapter, resident (read now if it is not: the load its first user would pay,
        unless a warmup paid it ahead); pinned with `pin`. AdapterError in one line."""
        model = self.catalog.adapter_base(adapter)
        slots = self.slots[model]
        weights = slots.get(adapter)
        if weights is None:
            with self._lock:  # one read of an adapter at a time: two first users pay one load
                weights = slots.get(adapter)
                if weights is None:
                    weights = self._read(model, adapter)
                    evicted = slots.put(weights, pin=pin)
                    log.info(
                        "adapter %s of %s resident in %.0f ms%s",
                        adapter,
                        model,
                        weights.load_ms,
                        f" (evicted {', '.join(evicted)})" if evicted else "",
                    )
        if pin:
            slots.pin(adapter)
        if count:
            with self._lock:
                self._requests[(model, adapter)] = self._requests.get((model, adapter), 0) + 1
        return weights

    def for_request(self, adapter: str | None) -> tuple[LoraWeights | None, bool]:
        """A request's adapter (None: the base's) and whether it was read for the request
        (not resident: its first user pays the read, and the metrics say so)."""
        if adapter is None:
            return None, False
        read = adapter not in self.slots[self.catalog.adapter_base(adapter)].resident
        return self.weights(adapter, count=True), read

    @team_released()  # read and stacked on a task's or a request's thread, which lives on
    def _read(self, model: str, adapter: str) -> LoraWeights:
        spec = self.catalog.model(model)
        try:
            weights = read_adapter(
                adapter,
                model,
                self.catalog.adapter_path(adapter),
                self._resident_for(model).model,
                max_rank=spec.max_adapter_rank,
            )
        except AdapterError as exc:
            self._errors[adapter] = str(exc)
            log.warning("%s", exc)
            raise
        self._errors.pop(adapter, None)
        self._resident_for(model).runner.adapter_resident(weights)
        return weights

    def asleep(self, model: str) -> None:
        """`model` went to sleep: its adapters let go, their names kept for the wake."""
        if (slots := self.slots.get(model)) is not None:
            pinned = slots.pinned
            self._asleep[model] = [(weights.name, weights.name in pinned) for weights in slots.clear()]

    def awake(self, model: str) -> None:
        """`model` woke: the adapters that were resident are read again (pinned as they were)."""
        for adapter, pinned in self._asleep.pop(model, []):
            try:
                self.weights(adapter, pin=pinned)
            except AdapterError:
                continue  # said once; its next request says it again

    def requests_answered(self) -> dict[tuple[str, str], int]:
        """(model, adapter) -> requests answered under the adapter so far."""
        with self._lock:
            return dict(self._requests)

    def describe(self) -> dict:
        errors = dict(self._errors)
        return {
            model: {
                **slots.describe(),
                "errors": {a: why for a, why in errors.items() if a in self.catalog.models[model].adapters},
            }
            for model, slots in self.slots.items()
        }


class AdapterCollector:
    """Adapter slots used / capacity, loads, evictions and requests per adapter, at scrape time."""

    def __init__(self, adapters: Adapters) -> None:
        self._adapters = adapters

    def collect(self):
        used = GaugeMetricFamily("preheat_adapter_slots_used", "Adapters resident now.", labels=["model"])
        capacity = GaugeMetricFamily("preheat_adapter_slots", "Adapter slots of the model.", labels=["model"])
        loads = CounterMetricFamily("preheat_adapter_loads", "Adapters read into a slot.", labels=["model"])
        evictions = CounterMetricFamily("preheat_adapter_evictions", "Adapters evicted from a slot.", labels=["model"])
        requests = CounterMetricFamily(
            "preheat_adapter_requests", "Requests answered under an adapter.", labels=["model", "adapter"]
        )
        for model, slots in self._adapters.slots.items():
            used.add_metric([model], len(slots.resident))
            capacity.add_metric([model], slots.capacity)
            loads.add_metric([model], slots.loads)
            evictions.add_metric([model], slots.evictions)
        for (model, adapter), count in sorted(self._adapters.requests_answered().items()):
            requests.add_metric([model, adapter], count)
        yield from (used, capacity, loads, evictions, requests)
