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


def _change_one_row(model_dir, scale: float = 3.0) -> bytes:
    """One row of the embedding table changed in the safetensors file (a row the old strided
    sample never read); returns the file as it was."""
    from safetensors.torch import load_file, save_file

    [file] = model_dir.glob("*.safetensors")
    before = file.read_bytes()
    tensors = load_file(str(file))
    name = next(n for n in tensors if "embed_tokens" in n)
    tensors[name][7] *= scale
    save_file(tensors, str(file), metadata={"format": "pt"})
    return before


@pytest.fixture
def own_model(tmp_path, tiny_model):
    """A copy of the tiny model this test may change on disk."""
    import shutil

    return shutil.copytree(tiny_model, tmp_path / "own-tiny")


def test_level_one_wake_of_changed_weights_reads_once_frees_them_and_refuses_requests_at_once(
    tmp_path, own_model, monkeypatch
):
    """The content digest covers every byte: one changed row is caught. A failed wake reads
    the files once, keeps nothing of what it rejected, says why in readiness, and a request
    is refused with the reason at once (no second read); a later wake, once the files are
    right again, serves as before."""
    import preheat.workers.sleep as sleep
    from preheat.core.errors import ModelLoadError

    runtime = make_runtime(tmp_path, own_model, SUMMARY, prefix_store=PrefixStore(tmp_path / "prefixes", 2**30))
    assert runtime.preload() == []
    failed_models = []
    runtime.gate.on_model_warm = failed_models.append
    answer = runtime.infer("support", "Where is my parcel?", GREEDY)
    assert runtime.sleeps.sleep("tiny", 1).status == "asleep"
    original = _change_one_row(own_model)
    reads = []
    real_read = sleep.read_by_name
    monkeypatch.setattr(sleep, "read_by_name", lambda *a: reads.append(1) or real_read(*a))
    monkeypatch.setattr(sleep, "reload_into", lambda *a: reads.append("loader"))

    woken = runtime.sleeps.wake("tiny")
    assert woken.status == "failed" and "changed while it slept" in woken.error, woken
    assert reads == [1]  # read once, not again through the loader
    assert runtime.resident_models.get("tiny") is None  # the rejected weights are not held
    assert runtime.sleeps.level_of("tiny") is None and "changed while it slept" in runtime.sleeps.failed["tiny"]
    assert runtime.readiness() == [f"model tiny: could not wake: {woken.error}"]
    assert runtime.describe()["failed"] == {"tiny": woken.error}
    assert failed_models == ["tiny"]  # its requests are taken again, to be answered
    with pytest.raises(ModelLoadError, match=r"could not wake: .*changed while it slept"):
        runtime.infer("support", "Where is my parcel?", GREEDY)
    assert runtime.warm_template("support").status == "failed" and reads == [1]  # no read for either

    monkeypatch.undo()
    (next(own_model.glob("*.safetensors"))).write_bytes(original)
    again = runtime.sleeps.wake("tiny")  # an admin's wake tries again: a load
    assert again.status == "awake", again.error
    assert runtime.sleeps.failed == {} and runtime.readiness() == []
    assert runtime.infer("support", "Where is my parcel?", GREEDY).token_ids == answer.token_ids
    runtime.close()


def test_level_two_wake_of_changed_weights_serves_the_new_weights_never_the_old_prefixes(tmp_path, own_model):
    """At level 2 a wake is a load: changed files are a new model, whose identity differs, so
    no prefix stored under the old weights is restored; the answer is transformers' on the
    new weights."""
    from tests.conftest import reference_generate

    runtime = make_runtime(tmp_path, own_model, SUMMARY, prefix_store=PrefixStore(tmp_path / "prefixes", 2**30))
    assert runtime.preload() == []
    old = runtime.resident_models.get("tiny").content_digest
    assert runtime.sleeps.sleep("tiny", 2).status == "asleep"
    _change_one_row(own_model, scale=40.0)
    assert runtime.sleeps.wake("tiny").status == "awake"
    resident = runtime.resident_models.get("tiny")
    assert resident.content_digest != old
    assert runtime.metrics.restores.labels(model="tiny")._value.get() == 0  # computed again, not restored
    assert runtime.warm_template("support").status == "warm"
    completion = runtime.infer("support", "Where is my parcel?", GREEDY)
    prompt = runtime.templates.resolve("support").prefix.prompt_ids(resident, "Where is my parcel?")
    assert completion.token_ids == reference_generate(resident, prompt, 8)[: len(completion.token_ids)]
    runtime.close()


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
