"""Resident models: loaded in parallel, once per name, failures kept as reasons."""

import threading
import time

import pytest

import preheat.workers.engine.resident as models
from preheat.workers.engine.resident import ModelSource, ResidentModels


def record_loads(monkeypatch) -> list[tuple[str, float, float]]:
    """Wrap the real loader to note which thread loaded what, and when."""
    calls, real = [], models._load

    def load(source, placement, loader):
        started = time.monotonic()
        try:
            return real(source, placement, loader)
        finally:
            calls.append((source.name, started, time.monotonic()))

    monkeypatch.setattr(models, "_load", load)
    return calls


def test_preload_loads_models_in_parallel_and_keeps_the_failures(monkeypatch, tiny_model, tiny_qwen2):
    calls = record_loads(monkeypatch)
    registry = ResidentModels("cpu")
    failures = registry.preload(
        [
            ModelSource("llama", str(tiny_model)),
            ModelSource("qwen2", str(tiny_qwen2)),
            ModelSource("gone", "/does/not/exist"),
        ]
    )
    assert set(registry.resident) == {"llama", "qwen2"}
    assert failures.keys() == registry.unavailable.keys() == {"gone"}
    assert "model 'gone' failed to load from /does/not/exist" in failures["gone"]
    spans = {name: (start, end) for name, start, end in calls}
    # Each load began before the other ended: they overlapped, not one after the other.
    assert spans["llama"][0] < spans["qwen2"][1] and spans["qwen2"][0] < spans["llama"][1]
    assert all(m.load_ms > 0 and m.model.training is False for m in registry.resident.values())


def test_concurrent_callers_for_one_model_load_it_once(monkeypatch, tiny_model):
    calls = record_loads(monkeypatch)
    registry = ResidentModels("cpu")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(registry.ensure(ModelSource("m", str(tiny_model)))))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len({id(resident) for resident, _ in results}) == 1
    assert sorted(load_ms > 0 for _, load_ms in results) == [False, False, True]  # only the loader reports it


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt2"])
def test_kv_bytes_per_token_from_the_config_is_what_one_position_of_its_kv_holds(dev_model, arch):
    """What the fleet plans pins by (preheat.fleet.placement) equals the exact bytes the cache counts."""
    import torch

    from preheat.workers.engine.kvtensors import cache_nbytes
    from tests.conftest import load_resident

    resident = load_resident(dev_model(arch), arch)
    _, kv = resident.runner.forward(torch.zeros((1, 1), dtype=torch.long))
    assert resident.kv_bytes_per_token == cache_nbytes(kv) > 0
