"""WorkerRuntime without Celery: eager preload, readiness, warmups, requests through the cache."""

import shutil

import pytest
import torch

from preheat.api.sampling import SamplingParams
from preheat.core.catalog import load_catalog
from preheat.core.errors import UnknownNameError
from preheat.workers.engine.chat import conversation
from preheat.workers.engine.kvcache import CacheBudget, CacheBudgetError
from preheat.workers.runtime import RuntimeConfig, WorkerRuntime
from tests.conftest import SUPPORT_PROMPT, write_catalog

SUMMARY = '\n[templates.summarise]\nmodel = "tiny"\nsystem_prompt = "Summarise the text in three bullet points."\n'
BROKEN = (
    '\n[models.gone]\npath = "does/not/exist"\n[templates.orphan]\nmodel = "gone"\nsystem_prompt = "You are lost."\n'
)


FILED = '\n[templates.filed]\nmodel = "tiny"\nsystem_prompt_file = "filed.txt"\nprobe = "Where is it?"\n'


def make_runtime(tmp_path, model_dir, extra="", prefix_store=None, **config) -> WorkerRuntime:
    # The verdict's timing rule is tested with exact numbers in test_warmup; here a shared
    # machine's noise must not turn `warm` into `degraded` (see conftest: 12x was seen).
    config = {"device": "cpu", "probe_repeats": 2, "warm_factor": 100.0, **config}
    catalog = load_catalog(write_catalog(tmp_path, model_dir, extra))
    return WorkerRuntime(catalog, RuntimeConfig(**config), prefix_store)


@pytest.fixture
def runtime(tmp_path, tiny_model):
    return make_runtime(tmp_path, tiny_model, SUMMARY + BROKEN)


def test_preload_loads_what_it_can_prefills_and_pins_its_templates_and_says_why_not_ready(runtime):
    warm_models = []
    runtime.announce_to(warm_models.append, gated=False)
    # Grouped by model: each model's own reason, then its templates'.
    assert runtime.readiness() == [
        "model tiny not loaded yet",
        "template support: not pre-filled yet",
        "template summarise: not pre-filled yet",
        "model gone not loaded yet",
        "template orphan: not pre-filled yet",
    ]
    reasons = runtime.preload()
    assert (
        reasons
        == runtime.readiness()
        == [
            f"model gone unavailable: {runtime.resident_models.unavailable['gone']}",
            "template orphan: not pre-filled yet",
        ]
    )
    assert "does/not/exist" in reasons[0]
    assert warm_models == ["tiny"]  # announced once, when its last template was pre-filled
    assert sorted(e.label for e in runtime.cache.entries()) == ["summarise", "support"]
    assert all(e.pinned for e in runtime.cache.entries())
    assert runtime.resident_models.resident["tiny"].load_ms > 0


def test_a_worker_whose_models_all_load_is_ready(tmp_path, tiny_model):
    runtime = make_runtime(tmp_path, tiny_model, SUMMARY)
    assert runtime.preload() == [] and runtime.describe()["ready"]


def test_first_warmup_reports_the_start_up_load_then_reuses_model_and_prefix(runtime):
    runtime.preload()
    first = runtime.warm_template("support")
    assert first.status == "warm", first.error
    assert first.load_ms == runtime.resident_models.resident["tiny"].load_ms > 0  # the preload's, reported once
    assert first.prefill_ms > 0  # pre-filled at start, reported by the first job
    assert first.ttft_cold_ms > 0 and first.ttft_warm_ms > 0 and first.ttft_bare_ms > 0
    assert first.cached_tokens > 20 and first.cache_bytes > 0 and first.device == "cpu/float32"

    again = runtime.warm_template("support")
    assert (again.status, again.load_ms, again.prefill_ms) == ("warm", 0.0, 0.0)
    assert runtime.cache.stats().queries == 0  # probes are not traffic


def test_a_warmup_without_preload_loads_and_prefills(runtime):
    result = runtime.warm_template("support")
    assert result.status == "warm" and result.load_ms > 0 and result.prefill_ms > 0


def test_a_prompt_file_edited_on_disk_is_prefilled_again_by_the_next_warmup(tmp_path, tiny_model):
    (tmp_path / "filed.txt").write_text(SUPPORT_PROMPT)
    runtime = make_runtime(tmp_path, tiny_model, FILED)
    first = runtime.warm_template("filed")
    (tmp_path / "filed.txt").write_text("Be brief.")
    assert runtime.infer("filed", "Hi", SamplingParams(max_tokens=2)).cached_tokens == first.cached_tokens
    old = runtime.cache.peek(runtime.templates.known("filed").key)
    result = runtime.warm_template("filed")  # a warmup reads the file again; a request does not
    assert result.prefill_ms > 0 and result.cached_tokens < first.cached_tokens
    assert old.pinned is False  # the old version is an LRU entry now: it holds no pinned budget
    assert runtime.cache.peek(runtime.templates.known("filed").key).pinned


def test_the_serving_threads_exercise_uses_the_prefix_as_prefilled_not_a_prompt_edited_since(tmp_path, tiny_model):
    """The process exercises the warm templates once before taking requests; a prompt file
    edited between the preload and then is pre-filled by a warmup, not there (an
    out-of-memory there once kept a model from its requests for good)."""
    (tmp_path / "filed.txt").write_text(SUPPORT_PROMPT)
    runtime = make_runtime(tmp_path, tiny_model, FILED)
    runtime.preload()
    inserts = runtime.cache.stats().inserts
    (tmp_path / "filed.txt").write_text("Be brief.")
    runtime.exercise("tiny")
    assert runtime.cache.stats().inserts == inserts


def test_the_exercise_leaves_kv_buffers_that_a_request_of_the_default_length_runs_on(tmp_path, tiny_model):
    """The first-call exercise reads two pieces of a request of the default length and closes
    it: the runner keeps its row's KV buffers, and the first request of that length on the
    template runs on them instead of making its own."""
    import time

    from preheat.api.requests import DEFAULT_MAX_TOKENS

    runtime = make_runtime(tmp_path, tiny_model)
    runtime.preload()
    runner = runtime.resident_models.get("tiny").runner
    runner.spare_kv = None
    runtime.exercise("tiny")
    deadline = time.monotonic() + 30
    while runner.spare_kv is None and time.monotonic() < deadline:  # the closed row leaves at the next step
        time.sleep(0.01)
    kept = runner.spare_kv
    probe = runtime.catalog.template("support").probe
    answer = runtime.generate("support", probe, SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0))
    completion = answer.collect()
    assert kept[1][1] >= completion.prompt_tokens + DEFAULT_MAX_TOKENS
    assert runner.spare_kv[0][0][0] is kept[0][0][0]


def test_a_missing_model_fails_the_job_and_the_runtime_keeps_serving(runtime):
    broken = runtime.warm_template("orphan")
    assert broken.status == "failed"
    assert "model 'gone' failed to load from" in broken.error and "does/not/exist" in broken.error
    assert runtime.resident_models.unavailable.keys() == {"gone"}
    assert runtime.warm_template("support").status == "warm"


def test_an_unknown_template_is_a_failed_result_and_an_error_for_a_request(runtime):
    result = runtime.warm_template("nope")
    assert result.status == "failed" and "unknown template 'nope'" in result.error
    with pytest.raises(UnknownNameError, match="unknown template 'nope'"):
        runtime.infer("nope", "hi")


def test_truncated_weights_fail_with_the_loader_error(tmp_path, tiny_model):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    runtime = make_runtime(tmp_path, corrupt)
    result = runtime.warm_template("support")
    assert result.status == "failed"
    assert result.error.startswith(f"model 'tiny' failed to load from {corrupt}: ")
    assert runtime.preload() and not runtime.describe()["ready"]


def test_a_warm_worker_answers_from_the_cache_and_never_prefills_again(runtime):
    runtime.preload()
    prefills = runtime.metrics.prefills.labels(model="tiny")._value.get()
    answers = [
        runtime.infer("support", question, SamplingParams(max_tokens=6)) for question in ("Hi", "Where?", "When?")
    ]
    assert all(a.cached_tokens > 20 and len(a.token_ids) >= 1 for a in answers)
    assert runtime.metrics.prefills.labels(model="tiny")._value.get() == prefills
    stats = runtime.cache.stats()
    assert (stats.hits, stats.misses) == (3, 0)


def test_an_evicted_template_is_prefilled_again_by_the_next_request(runtime):
    runtime.preload()
    entry = next(e for e in runtime.cache.entries() if e.label == "support")
    runtime.cache.unpin(entry.key)
    runtime.cache.remove(entry.key)
    answer = runtime.infer("support", "Hello", SamplingParams(max_tokens=3))
    assert answer.cached_tokens == entry.num_tokens
    assert any(e.label == "support" for e in runtime.cache.entries())


def test_a_budget_smaller_than_one_prefix_fails_clearly_and_leaves_the_cache_consistent(tmp_path, tiny_model):
    runtime = make_runtime(tmp_path, tiny_model, SUMMARY, cache_budget=CacheBudget(max_entries=4, max_bytes=200_000))
    reasons = runtime.preload()
    assert any(
        r.startswith("template support: prefix support needs") and "the whole cache budget is 200,000" in r
        for r in reasons
    )
    result = runtime.warm_template("support")
    assert result.status == "failed" and "the whole cache budget is 200,000 bytes" in result.error
    stats = runtime.cache.stats()
    assert stats.bytes <= 200_000 and stats.bytes == sum(e.nbytes for e in runtime.cache.entries())
    assert [e.label for e in runtime.cache.entries()] == ["summarise"]
    # A request still gets an answer, computed without the cache (the chat template's opening,
    # which it shares with the other template's prefix, is too short to be worth a cut).
    assert runtime.infer("support", "Hello", SamplingParams(max_tokens=2)).cached_tokens == 0
    with pytest.raises(CacheBudgetError):
        runtime.templates.prefill("support")


def test_a_system_prompt_longer_than_the_context_fails_the_warmup(tmp_path, tiny_model):
    huge = '\n[templates.huge]\nmodel = "tiny"\nsystem_prompt = "' + "word " * 5000 + '"\n'
    runtime = make_runtime(tmp_path, tiny_model, huge)
    result = runtime.warm_template("huge")
    assert result.status == "failed" and "model 'tiny' has a context of 4096" in result.error
    assert len(runtime.cache) == 0 and runtime.cache.stats().bytes == 0
    with pytest.raises(ValueError, match="has a context of 4096"):
        runtime.infer("huge", "hi")


def test_only_if_cold_skips_a_template_already_warm_and_warms_a_cold_one(runtime):
    runtime.preload()
    skipped = runtime.warm_template("support", only_if_cold=True)
    assert skipped.status == "skipped" and skipped.error == "already warm: prefix cached and pinned"
    runtime.cache.clear()
    again = runtime.warm_template("support", only_if_cold=True)
    assert again.status == "warm" and again.prefill_ms > 0
    assert runtime.describe()["last_warmup"]["support"]["status"] == "warm"


def test_served_cache_hits_become_the_steady_state_a_warmup_is_judged_against(runtime):
    runtime.preload()
    assert runtime.warmups.steady_ttft_ms("support") is None
    served = [runtime.infer("support", f"question {i}", SamplingParams(max_tokens=1)) for i in range(5)]
    assert all(c.cached_tokens for c in served)
    assert runtime.warmups.steady_ttft_ms("support") == pytest.approx(sorted(c.ttft_ms for c in served)[2])
    result = runtime.warm_template("support")
    assert result.ttft_steady_ms == pytest.approx(runtime.warmups.steady_ttft_ms("support"))


def test_chat_requests_with_a_template_prompt_use_its_pinned_prefix_and_are_remembered(runtime):
    runtime.preload()
    pinned = next(e for e in runtime.cache.entries() if e.label == "support")
    two = SamplingParams(max_tokens=2, temperature=0.0)
    messages = conversation(SUPPORT_PROMPT, "Where is my parcel?")
    as_chat = runtime.generate_chat("tiny", messages, two).collect()
    template = runtime.infer("support", "Where is my parcel?", two)
    assert as_chat.cached_tokens == pinned.num_tokens
    assert as_chat.token_ids == template.token_ids
    # The chat left its prompt and answer cached: the template request found more than the prefix.
    assert template.cached_tokens > pinned.num_tokens
    assert [e.label for e in runtime.cache.entries()].count("conversation") == 1
    other = runtime.generate_text("tiny", "Once upon a time", two).collect()
    assert other.cached_tokens == 0


def test_a_warmup_and_a_request_resolve_their_template_once_and_hash_nothing_twice(tmp_path, tiny_model, monkeypatch):
    import preheat.workers.engine.kvcache as kvcache

    runtime = make_runtime(tmp_path, tiny_model)
    calls = {"system_prompt": 0, "ensure": 0, "digest": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    catalog_class = type(runtime.catalog)  # a frozen model: patched on its class
    monkeypatch.setattr(catalog_class, "system_prompt", counted("system_prompt", catalog_class.system_prompt))
    monkeypatch.setattr(runtime.resident_models, "ensure", counted("ensure", runtime.resident_models.ensure))
    monkeypatch.setattr(kvcache, "digest_tokens", counted("digest", kvcache.digest_tokens))

    result = runtime.warm_template("support")  # a cold miss: tokenized, hashed, pre-filled
    assert result.status == "warm" and result.prefill_ms > 0
    assert calls == {"system_prompt": 1, "ensure": 1, "digest": 1}

    calls.update(dict.fromkeys(calls, 0))
    assert runtime.infer("support", "Hello", SamplingParams(max_tokens=2)).cached_tokens == result.cached_tokens
    assert calls == {"system_prompt": 0, "ensure": 0, "digest": 0}  # resolved: no file, no load, no hash


def test_a_prompt_file_emptied_since_the_start_is_not_warm(tmp_path, tiny_model):
    prompt = tmp_path / "filed.txt"
    prompt.write_text("You answer questions about parcels.")
    runtime = make_runtime(tmp_path, tiny_model, FILED)
    assert runtime.warm_template("filed").status == "warm"
    prompt.write_text("")
    result = runtime.warm_template("filed")
    assert result.status == "failed" and "is empty: it must hold a system prompt" in result.error
    assert any("filed" in reason and "is empty" in reason for reason in runtime.readiness())


def test_a_restarted_runtime_restores_its_prefixes_and_prefills_nothing(tmp_path, tiny_model, caplog):
    from preheat.workers.engine.prefixstore import PrefixStore

    store_folder = tmp_path / "prefixes"
    first = make_runtime(tmp_path, tiny_model, SUMMARY, prefix_store=PrefixStore(store_folder, 2**30))
    assert first.preload() == []
    first.close()
    assert first.metrics.prefills.labels(model="tiny")._value.get() == 2
    answer = first.infer("support", "Where is my parcel?", SamplingParams(max_tokens=8, temperature=0.0))

    for _ in range(2):  # restarted twice in a row: the second start computes nothing either
        restarted = make_runtime(tmp_path, tiny_model, SUMMARY, prefix_store=PrefixStore(store_folder, 2**30))
        assert restarted.preload() == []
        assert restarted.metrics.prefills.labels(model="tiny")._value.get() == 0
        assert restarted.metrics.restores.labels(model="tiny")._value.get() == 2
        job = restarted.warm_template("support")  # the first job reports how the start-up got it
        assert (job.status, job.prefix_source, job.prefill_ms) == ("warm", "restored", 0.0) and job.restore_ms > 0
        assert restarted.warm_template("support").prefix_source == "cached"
        again = restarted.infer("support", "Where is my parcel?", SamplingParams(max_tokens=8, temperature=0.0))
        assert again.token_ids == answer.token_ids and again.cached_tokens == answer.cached_tokens
        restarted.close()


def test_a_gated_process_is_ready_only_once_it_takes_the_models_requests(tmp_path, tiny_model):
    runtime = make_runtime(tmp_path, tiny_model)
    warm = []
    runtime.announce_to(warm.append)
    assert runtime.preload() == ["model tiny: warm, not taking requests yet"] and warm == ["tiny"]
    runtime.taking_requests("tiny")
    assert runtime.readiness() == [] and runtime.describe()["ready"] is True


def test_a_warmup_under_load_runs_between_decode_steps_and_never_stops_the_traffic(runtime):
    """The warmup's pre-fill and probe runs are calls on the scheduler's thread, between
    steps: the request decoding meanwhile keeps getting tokens, and the warmup finishes."""
    import threading
    import time

    runtime.preload()
    stream = runtime.generate("support", "Tell me everything.", SamplingParams(max_tokens=400, temperature=0.0))
    arrivals: list[float] = []

    def read() -> None:
        for _ in stream:
            arrivals.append(time.perf_counter())

    reader = threading.Thread(target=read)
    reader.start()
    while len(arrivals) < 5:
        time.sleep(0.005)
    runtime.cache.unpin(runtime.templates.known("support").key)
    runtime.cache.remove(runtime.templates.known("support").key)  # a cold template: the warmup pre-fills it
    began = time.perf_counter()
    result = runtime.warm_template("support")
    ended = time.perf_counter()
    reader.join(120)
    assert result.status in ("warm", "degraded") and result.prefill_ms > 0, result.error
    during = [t for t in arrivals if began <= t <= ended]
    assert during, "no token reached the request while the warmup ran"
    assert len(stream.completion.token_ids) == 400 or stream.completion.finish_reason == "stop"


def test_a_prefix_whose_first_token_is_wrong_is_taken_out_of_service_until_proven_again(tmp_path, tiny_model):
    """A cached prefix whose KV went bad (here: every key scaled in place, as a bad restore or
    a memory fault would leave it) makes the probe's first token differ from full prefill's:
    the job says degraded, the prefix leaves the cache and the prefix store, readiness says
    why, and the next warmup computes it again and proves it."""
    from preheat.workers.engine.kvtensors import kv_tensors
    from preheat.workers.engine.prefixstore import PrefixStore

    store = PrefixStore(tmp_path / "prefixes", 2**30)
    runtime = make_runtime(tmp_path, tiny_model, SUMMARY, prefix_store=store)
    assert runtime.preload() == []
    store.flush()
    resolved = runtime.templates.resolve("support")
    stored = store.path_for(resolved.resident, resolved.prefix.ids.reshape(-1).numpy())
    assert stored.is_file()
    entry = runtime.cache.peek(resolved.prefix.key)
    for _, _, tensor in kv_tensors(entry.payload.cache):
        tensor.copy_(torch.randn_like(tensor) * 50)

    judged = runtime.warm_template("support")
    assert judged.status == "degraded" and "differs from full prefill's" in judged.error, judged.error
    assert "out of service" in judged.error
    assert runtime.cache.peek(resolved.prefix.key) is None and not stored.exists()  # never served from again
    assert any(r.startswith("template support: out of service: cached-prefix first token") for r in runtime.readiness())

    again = runtime.warm_template("support")
    assert (again.status, again.prefix_source) == ("warm", "computed"), again.error
    assert runtime.readiness() == []
    runtime.close()
