"""Sleep and wake of a resident model, on a real model: KV and weights freed, answers unchanged
after a wake, requests never cut, and a request that meets a sleeping model wakes it."""

import threading

import pytest

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.prefixstore import PrefixStore
from preheat.workers.sleep import resident_set_bytes, unique_parameters, weight_bytes
from tests.workers.test_runtime import SUMMARY, make_runtime

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture
def runtime(tmp_path, tiny_model):
    runtime = make_runtime(tmp_path, tiny_model, SUMMARY, prefix_store=PrefixStore(tmp_path / "prefixes", 2**30))
    assert runtime.preload() == []
    yield runtime
    runtime.close()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_kv_and_weights_and_a_wake_answers_as_before(runtime, level):
    answer = runtime.infer("support", "Where is my parcel?", GREEDY)
    model = runtime.resident_models.get("tiny").model
    weights, kv = weight_bytes(model), runtime.cache.stats().bytes
    assert kv > 0

    slept = runtime.sleeps.sleep("tiny", level)
    assert (slept.status, slept.sleep_level, slept.error) == ("asleep", level, None)
    assert slept.bytes_freed == weights + kv and slept.cache_bytes == kv and slept.sleep_ms > 0
    assert runtime.cache.stats().entries == 0  # pinned prefixes too: they stay in the prefix store
    assert all(p.numel() == 0 for _, p in unique_parameters(model).values())  # the weights' storage is gone
    assert runtime.readiness() == [f"model tiny: asleep (level {level})"]
    assert runtime.describe()["asleep"]["tiny"]["level"] == level
    assert runtime.sleeps.sleep("tiny", level).status == "skipped"  # idempotent

    woken = runtime.sleeps.wake("tiny")
    assert (woken.status, woken.sleep_level, woken.error) == ("awake", level, None) and woken.wake_ms > 0
    assert runtime.readiness() == []  # its prefixes restored and pinned, as after start-up
    assert runtime.cache.stats().entries == 2 and runtime.metrics.restores.labels(model="tiny")._value.get() == 2
    for template in ("support", "summarise"):  # a wake is a warmup: the jobs probe and judge
        warmed = runtime.warm_template(template)
        assert (warmed.status, warmed.prefix_source) == ("warm", "restored"), warmed.error
        assert warmed.restore_ms > 0
    again = runtime.infer("support", "Where is my parcel?", GREEDY)
    assert again.token_ids == answer.token_ids and again.cached_tokens == answer.cached_tokens
    assert runtime.sleeps.wake("tiny").status == "skipped"


def test_a_request_for_a_sleeping_model_wakes_it_and_gets_the_same_answer(runtime):
    answer = runtime.infer("support", "Where is my parcel?", GREEDY)
    assert runtime.sleeps.sleep("tiny", 1).status == "asleep"
    again = runtime.infer("support", "Where is my parcel?", GREEDY)  # woken on demand: the user waits the wake
    assert again.token_ids == answer.token_ids and again.cached_tokens == answer.cached_tokens
    assert runtime.sleeps.wakes_on_demand == 1 and runtime.readiness() == []  # its templates pre-filled too


def test_a_sleep_waits_for_running_requests_and_is_refused_past_its_bound(runtime):
    stream = runtime.generate("support", "Tell me a long story.", SamplingParams(max_tokens=400, temperature=0.0))
    pieces = iter(stream)
    next(pieces)  # running
    runtime.sleeps.drain_s = 0.2
    refused = runtime.sleeps.sleep("tiny", 1)
    assert refused.status == "failed" and "still running or waiting after 0.2 s" in refused.error
    assert runtime.readiness() == [] and runtime.sleeps.asleep == {}  # as before: the model serves
    completion = stream.collect()
    assert completion.finish_reason == "length" and len(completion.token_ids) == 400  # never cut

    runtime.sleeps.drain_s = 30.0
    stream = runtime.generate("support", "Tell me a story.", SamplingParams(max_tokens=40, temperature=0.0))
    slept: list = []
    sleeping = threading.Thread(target=lambda: slept.append(runtime.sleeps.sleep("tiny", 1)))
    sleeping.start()
    completion = stream.collect()  # the sleep waits for it
    sleeping.join(30)
    assert len(completion.token_ids) == 40 and slept[0].status == "asleep"


def test_level_one_wake_refuses_weights_that_changed_on_disk_and_reloads_them(runtime, tmp_path, monkeypatch):
    """What is read back is proven by the content digest: a file that changed while the model
    slept is not taken as the weights it slept with."""
    import preheat.workers.sleep as sleep

    assert runtime.sleeps.sleep("tiny", 1).status == "asleep"
    monkeypatch.setattr(sleep, "digest_contents", lambda model: "another model")
    woken = runtime.sleeps.wake("tiny")
    assert woken.status == "failed" and "changed while it slept" in woken.error
    assert runtime.sleeps.level_of("tiny") == 1  # still asleep, honestly
    monkeypatch.undo()
    assert runtime.sleeps.wake("tiny").status == "awake"


def test_level_one_releases_the_weights_from_the_resident_set(tmp_path, tiny_model):
    """On the CPU, level 1 gives the weights' memory back to the system (measured, not
    assumed): the resident set falls by most of the weight bytes."""
    runtime = make_runtime(tmp_path, tiny_model)
    runtime.load_models()
    weights = weight_bytes(runtime.resident_models.get("tiny").model)
    before = resident_set_bytes()
    assert runtime.sleeps.sleep("tiny", 1).status == "asleep"
    assert before - resident_set_bytes() >= 0.8 * weights
    assert runtime.sleeps.wake("tiny").status == "awake"


def test_metrics_say_each_models_sleep_state_as_vllm_names_it(runtime):
    def state(level_name: str) -> str:
        return f'preheat_model_sleep_state{{model="tiny",sleep_state="{level_name}"}} 1.0'

    assert state("awake") in runtime.render_metrics().decode()
    runtime.sleeps.sleep("tiny", 1)
    assert state("weights_offloaded") in runtime.render_metrics().decode()
    runtime.sleeps.wake("tiny")
    runtime.sleeps.sleep("tiny", 2)
    assert state("discard_all") in runtime.render_metrics().decode()


def test_a_runtime_told_to_start_asleep_loads_nothing_and_a_wake_loads_it(tmp_path, tiny_model):
    runtime = make_runtime(tmp_path, tiny_model)
    asked = []
    runtime.asleep_at_start = lambda: asked.append(1) or {"tiny": "schedule night put it to sleep"}
    assert runtime.preload() == ["model tiny: asleep (level 2)"]
    runtime.load_models()
    assert asked == [1]  # asked once, before the first load, whichever start-up thread comes first
    assert runtime.resident_models.get("tiny") is None and runtime.cache.stats().entries == 0
    woken = runtime.sleeps.wake("tiny")
    assert woken.status == "awake" and woken.load_ms > 0 and runtime.readiness() == []
    assert runtime.warm_template("support").status == "warm"
