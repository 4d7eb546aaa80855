"""LoRA adapters on a worker runtime: declared in the catalog, requested by name as a model
(vLLM's way), pinned and pre-filled for their templates, evicted and read again on demand,
taken along by a sleep and a wake; a bad one is one line and the others serve on. Every
answer is token for token what transformers + PEFT gives with that adapter."""

from __future__ import annotations

import pytest

from preheat.api.sampling import SamplingParams
from preheat.cli.devadapter import make_adapter
from preheat.core.catalog import load_catalog
from preheat.core.errors import ConfigError
from preheat.workers.engine.chat import conversation, render
from preheat.workers.engine.lora import AdapterError
from preheat.workers.runtime import RuntimeConfig, WorkerRuntime
from tests.conftest import SUPPORT_PROMPT
from tests.workers.engine.test_lora import peft_generate

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model, folder / name, rank=8, seed=seed) for seed, name in enumerate("abc")}


def adapter_catalog(tmp_path, tiny_model, adapter_dirs, extra_adapters: str = "") -> str:
    text = (
        f'[models.tiny]\npath = "{tiny_model}"\nmax_adapters = 2\n\n'
        "[models.tiny.adapters]\n"
        + "".join(f'{name} = "{path}"\n' for name, path in adapter_dirs.items())
        + extra_adapters
        + f'\n[templates.support]\nmodel = "tiny"\nsystem_prompt = "{SUPPORT_PROMPT}"\nprobe = "Where is my parcel?"\n'
        + f'\n[templates.support-a]\nmodel = "tiny"\nadapter = "a"\nsystem_prompt = "{SUPPORT_PROMPT}"\n'
        'probe = "Where is my parcel?"\n'
    )
    path = tmp_path / "preheat.toml"
    path.write_text(text)
    return path


@pytest.fixture
def runtime(tmp_path, tiny_model, adapter_dirs):
    catalog = load_catalog(adapter_catalog(tmp_path, tiny_model, adapter_dirs, 'broken = "no-such-folder"\n'))
    runtime = WorkerRuntime(catalog, RuntimeConfig("cpu", probe_repeats=1, warm_factor=100.0))
    yield runtime
    runtime.close()


def _chat(runtime, model: str, text: str):
    messages = conversation(SUPPORT_PROMPT, text)
    return runtime.generate_chat(model, messages, GREEDY).collect(), messages


def test_an_adapters_template_is_pinned_and_prefilled_under_it_and_requests_answer_as_peft(
    runtime, tiny_model, adapter_dirs
):
    assert runtime.preload() == []
    slots = runtime.adapters.slots["tiny"]
    assert slots.resident == ["a"] and slots.pinned == {"a"}  # the template's adapter, ahead of its tenants
    warmed = runtime.warm_template("support-a")
    assert warmed.status == "warm", warmed.error
    resident = runtime.resident_models.get("tiny")
    completion, messages = _chat(runtime, "a", "Where is my parcel?")
    prompt_ids = render(resident, messages)
    assert completion.cached_tokens >= runtime.templates.resolve("support-a").prefix.ids.shape[-1]  # its own prefix
    assert (
        completion.token_ids == peft_generate(tiny_model, adapter_dirs["a"], prompt_ids, 8)[: len(completion.token_ids)]
    )
    base, _ = _chat(runtime, "tiny", "Where is my parcel?")
    assert base.token_ids != completion.token_ids  # the adapter changes the answer; the base keeps its own


def test_adapters_are_evicted_least_recently_used_and_read_again_on_demand(runtime, tiny_model, adapter_dirs):
    assert runtime.preload() == []
    first_b, messages = _chat(runtime, "b", "Hello")
    _chat(runtime, "c", "Hello")  # two slots, a pinned: c evicts b
    slots = runtime.adapters.slots["tiny"]
    assert set(slots.resident) == {"a", "c"} and slots.evictions == 1
    again_b, _ = _chat(runtime, "b", "Hello")  # read again for the request that needs it
    assert again_b.token_ids == first_b.token_ids and slots.loads == 4
    prompt_ids = render(runtime.resident_models.get("tiny"), messages)
    assert again_b.token_ids == peft_generate(tiny_model, adapter_dirs["b"], prompt_ids, 8)[: len(again_b.token_ids)]
    metrics = runtime.render_metrics().decode()
    assert (
        'preheat_adapter_slots_used{model="tiny"} 2.0' in metrics
        and 'preheat_adapter_slots{model="tiny"} 2.0' in metrics
    )
    assert 'preheat_adapter_evictions_total{model="tiny"} 2.0' in metrics
    assert 'preheat_adapter_requests_total{adapter="b",model="tiny"} 2.0' in metrics


def test_a_bad_adapter_is_one_line_and_the_others_serve_on(runtime):
    assert runtime.preload() == []
    with pytest.raises(AdapterError) as refused:
        _chat(runtime, "broken", "Hello")
    assert "no adapter_config.json" in str(refused.value) and "\n" not in str(refused.value)
    assert _chat(runtime, "b", "Hello")[0].token_ids  # the others serve on
    assert "broken" in runtime.describe()["adapters"]["tiny"]["errors"]


def test_a_sleep_and_wake_take_the_adapters_along(runtime):
    assert runtime.preload() == []
    assert runtime.sleeps.sleep("tiny", 1).status == "asleep"
    assert runtime.adapters.slots["tiny"].resident == [] and runtime.adapters.slots["tiny"].pinned == set()
    assert runtime.sleeps.wake("tiny").status == "awake"
    slots = runtime.adapters.slots["tiny"]
    assert slots.resident == ["a"] and slots.pinned == {"a"} and runtime.readiness() == []


def test_the_catalog_refuses_adapters_that_cannot_be_named(tmp_path, tiny_model, adapter_dirs):
    taken = adapter_catalog(tmp_path, tiny_model, adapter_dirs, 'tiny = "x"\n')
    with pytest.raises(ConfigError, match="the name is taken"):
        load_catalog(taken)
    other = tmp_path / "other.toml"
    other.write_text(
        f'[models.tiny]\npath = "{tiny_model}"\n[templates.t]\nmodel = "tiny"\nadapter = "nope"\nsystem_prompt = "x"\n'
    )
    with pytest.raises(ConfigError, match="'nope' is no adapter of model 'tiny'"):
        load_catalog(other)


def test_inductors_probe_runs_ahead_only_for_a_model_whose_adapter_steps_need_it(
    tmp_path, tiny_model, adapter_dirs, monkeypatch
):
    """A restore loads packages without inductor; only a model with adapters (their steps are
    torch.compile graphs) has a restore that probes the CPU, so only there it runs ahead."""
    import preheat.workers.runtime as runtime_module

    probed = []
    monkeypatch.setattr(runtime_module, "probe_ahead", lambda mode, device: probed.append((mode, device)))
    plain = tmp_path / "plain.toml"
    plain.write_text(f'[models.tiny]\npath = "{tiny_model}"\n')
    for catalog, expected in ((plain, []), (adapter_catalog(tmp_path, tiny_model, adapter_dirs), [("auto", "cpu")])):
        runtime = WorkerRuntime(load_catalog(catalog), RuntimeConfig("cpu", compile="auto"))
        try:
            runtime.load_models()
        finally:
            runtime.close()
        assert probed == expected, catalog
        probed.clear()
