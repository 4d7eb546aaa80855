"""Many requests at once through the scheduler, on real dev models: every answer
token-identical to the same request run alone (and, greedy, to transformers), a closed
stream freeing its row, a full queue refused, one request's failure its own, a cache that
cannot be batched run as a batch of one."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import preheat.workers.engine.request as request_module
from preheat.api.sampling import SamplingParams
from preheat.workers.engine.batch import Batch
from preheat.workers.engine.chat import TemplatePrefix
from preheat.workers.engine.device import DeviceOutOfMemory
from preheat.workers.engine.lone import LoneRequests
from preheat.workers.engine.runner import ModelRunner
from preheat.workers.engine.scheduler import BatchLimits, QueueFullError, Scheduler
from tests.conftest import SUPPORT_PROMPT, greedy, load_resident, new_scheduler, reference_generate

SYSTEM_PROMPTS = [
    SUPPORT_PROMPT,
    "You summarise documents in three bullet points. Keep every number exactly as written.",
    "You are a code reviewer. Point out bugs first, style last. Quote the line you mean.",
]
USER_INPUTS = ["Where is my parcel?", "", "Summarise: " + "the quarterly numbers went up. " * 12, "Ünïcødé ✓", "ok"]


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def resident(request, dev_model):
    """Llama (grouped KV heads), Mistral (a window shorter than the prompts), Gemma 3
    (sliding and full layers in one model)."""
    return load_resident(dev_model(request.param), name=request.param)


def prefixes(resident) -> list[TemplatePrefix]:
    return [TemplatePrefix.of(resident, text) for text in SYSTEM_PROMPTS]


def mixed_requests(resident, count: int = 16):
    """(prompt ids, sampling) of `count` requests: three templates, five user inputs,
    lengths from 1 to 24 tokens; every third request has a stop string taken from its
    own answer, so it ends early on a stop string."""
    known = prefixes(resident)
    requests = []
    for i in range(count):
        prompt_ids = known[i % 3].prompt_ids(resident, USER_INPUTS[i % len(USER_INPUTS)])
        sampling = greedy(1 + (i * 7) % 24)
        if i % 3 == 2:
            answer = reference_generate(resident, prompt_ids, sampling.max_tokens)
            text = resident.tokenizer.decode(answer, skip_special_tokens=True)
            if len(text) > 6:
                sampling = greedy(sampling.max_tokens, stop=(text[3:5],))
        requests.append((prompt_ids, sampling))
    return known, requests


def alone(resident, known, prompt_ids, sampling):
    """The request on a scheduler of one row, its templates pre-filled."""
    scheduler = warm_scheduler(resident, known, BatchLimits(max_running=1))
    try:
        return scheduler.submit(resident, prompt_ids, sampling).collect()
    finally:
        scheduler.close()


def run_together(scheduler: Scheduler, resident, requests):
    """Submit every request at once (a thread each, as HTTP handlers do); their completions."""
    results: list = [None] * len(requests)
    go = threading.Barrier(len(requests))

    def one(i: int) -> None:
        go.wait()
        prompt_ids, sampling = requests[i]
        results[i] = scheduler.submit(resident, prompt_ids, sampling).collect()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def record_steps(monkeypatch) -> list[list]:
    """The segments of every step the runner runs from now on (ModelRunner.step)."""
    steps, real_step = [], ModelRunner.step

    def recorded(runner, kv, segments, adapters=None):
        steps.append(list(segments))
        return real_step(runner, kv, segments, adapters)

    monkeypatch.setattr(ModelRunner, "step", recorded)
    return steps


def warm_scheduler(resident, known, limits: BatchLimits = BatchLimits()) -> Scheduler:
    scheduler = new_scheduler(limits=limits)
    for prefix in known:
        scheduler.prefill(resident, prefix.ids, key=prefix.key, pin=True)
    return scheduler


def test_sixteen_concurrent_greedy_requests_equal_each_run_alone(resident):
    known, requests = mixed_requests(resident)
    scheduler = warm_scheduler(resident, known)
    together = run_together(scheduler, resident, requests)
    for (prompt_ids, sampling), got in zip(requests, together, strict=True):
        want = alone(resident, known, prompt_ids, sampling)
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.cached_tokens == want.cached_tokens > 0
        truth = reference_generate(resident, prompt_ids, sampling.max_tokens)
        assert got.token_ids == truth[: len(got.token_ids)]  # a stop string ends it early, never elsewhere
    assert any(
        c.finish_reason == "stop" and c.token_ids and len(c.token_ids) < s.max_tokens
        for c, (_, s) in zip(together, requests, strict=True)
    )
    assert scheduler.outcomes.rows_stepped / scheduler.outcomes.steps > 2  # they were decoded together, not in turn
    assert scheduler.load()["running"] == 0
    scheduler.close()


def test_a_closed_stream_frees_its_row_at_once(resident):
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known, BatchLimits(max_running=1))
    prompt_ids = known[0].prompt_ids(resident, "Where is my parcel?")
    long_one = scheduler.submit(resident, prompt_ids, SamplingParams(max_tokens=3000, temperature=1.0, seed=3))
    pieces = iter(long_one)
    next(pieces)
    waiting = scheduler.submit(resident, prompt_ids, greedy(3))  # no row for it while the first runs
    time.sleep(0.2)
    assert scheduler.load() == {"running": 1, "waiting": 1, "max_running": 1}
    long_one.close()  # the client went away
    assert waiting.collect().token_ids == alone(resident, known, prompt_ids, greedy(3)).token_ids
    assert len(long_one.completion.token_ids) < 3000
    assert scheduler.load()["running"] == 0
    scheduler.close()


def test_the_next_batch_runs_on_the_kv_buffers_the_last_one_left_and_answers_the_same(resident):
    """A batch whose rows all left hands its KV buffers to the runner, and the next batch takes
    them (a first request after a pause allocates none); what they still hold of the last
    rows is never read: its answer is transformers'. A first row longer than they hold gets
    buffers of its own size; a sleep frees them."""
    known, _ = mixed_requests(resident, 1)
    scheduler, runner = warm_scheduler(resident, known), resident.runner
    runner.spare_kv = None  # what the module's tests before this one left (the resident is the module's)
    long_ids = known[0].prompt_ids(resident, "Summarise: " + "the quarterly numbers went up. " * 6)
    scheduler.submit(resident, long_ids, greedy(12)).collect()
    kept = runner.spare_kv
    assert kept is not None and kept[1][1] == long_ids.shape[-1] + 12
    short_ids = known[1].prompt_ids(resident, "ok")
    got = scheduler.submit(resident, short_ids, greedy(8)).collect()
    assert got.token_ids == reference_generate(resident, short_ids, 8)[: len(got.token_ids)]
    assert runner.spare_kv[0][0][0] is kept[0][0][0] and runner.spare_kv[1] == kept[1]
    run_together(scheduler, resident, [(short_ids, greedy(4))] * 3)  # three rows: more slots than one
    assert runner.spare_kv[1][0] >= 3
    longer = scheduler.submit(resident, long_ids, greedy(40)).collect()
    assert longer.token_ids == reference_generate(resident, long_ids, 40)[: len(longer.token_ids)]
    assert runner.spare_kv[0][0][0] is not kept[0][0][0] and runner.spare_kv[1] == (1, long_ids.shape[-1] + 40)
    scheduler.close()
    runner.suspend()
    assert runner.spare_kv is None


def test_a_full_queue_is_refused_with_when_to_come_back(resident):
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known, BatchLimits(max_running=1, max_queued=1))
    prompt_ids = known[0].prompt_ids(resident, "hello")
    # It must still run when the third arrives: its end-of-turn ids are banned, so a sampled
    # one cannot end it early and free the row; and its pieces' iterator is held, since an
    # iterator dropped (`next(iter(running))`) ends its request, which freed the row before the
    # third came now and then in a full run (the scheduler's thread was quicker).
    banned = tuple((token, -100.0) for token in sorted(resident.stop_token_ids))
    long_one = SamplingParams(max_tokens=3000, temperature=1.0, seed=1, logit_bias=banned)
    running = scheduler.submit(resident, prompt_ids, long_one)
    pieces = iter(running)
    next(pieces)
    queued = scheduler.submit(resident, prompt_ids, greedy(2))
    with pytest.raises(QueueFullError, match="PREHEAT_MAX_QUEUED_REQUESTS") as refused:
        scheduler.submit(resident, prompt_ids, greedy(2))
    assert 1 <= refused.value.retry_after_s <= 60
    pieces.close()
    assert len(queued.collect().token_ids) == 2
    scheduler.close()


def test_one_requests_failure_is_its_own(resident, monkeypatch):
    """A sampler that fails (bad input found late) and a decode step out of memory: the
    request concerned ends with its error, its neighbours' answers are unchanged."""
    known, requests = mixed_requests(resident, 6)
    real_sampler_for = request_module.sampler_for

    def failing_for_seed_13(params, *args):
        sampler = real_sampler_for(params, *args)
        if params.seed == 13:
            sampler.choose = lambda *_: (_ for _ in ()).throw(ValueError("injected: a bad logits row"))
        return sampler

    monkeypatch.setattr(request_module, "sampler_for", failing_for_seed_13)
    real_step, failed = ModelRunner.step, {"n": 0}

    def out_of_memory_once_at_five(runner, kv, segments, adapters=None):
        if len(kv) == 5 and not failed["n"]:
            failed["n"] += 1
            raise DeviceOutOfMemory("injected: out of memory running 5 requests")
        return real_step(runner, kv, segments, adapters)

    monkeypatch.setattr(ModelRunner, "step", out_of_memory_once_at_five)
    bad = (requests[0][0], SamplingParams(max_tokens=5, temperature=0.7, seed=13))  # sampled: its own sampler runs
    requests = [(ids, greedy(20)) for ids, _ in requests[1:]] + [bad]
    scheduler = warm_scheduler(resident, known)
    outcomes: list = [None] * len(requests)

    def one(i: int) -> None:
        try:
            outcomes[i] = scheduler.submit(resident, *requests[i]).collect()
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert any("a bad logits row" in str(e) for e in errors)
    assert failed["n"] == 1 and any("out of memory" in str(e) for e in errors)
    assert len(errors) == 2
    for (prompt_ids, sampling), got in zip(requests, outcomes, strict=True):
        if not isinstance(got, Exception):
            assert got.token_ids == alone(resident, known, prompt_ids, sampling).token_ids
    scheduler.close()


def test_a_remembered_turn_is_cached_for_the_next_from_the_batch(resident):
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known)
    prompt_ids = known[0].prompt_ids(resident, "Where is my parcel? It was due on Monday.")
    first = scheduler.submit(resident, prompt_ids, greedy(6), remember=True).collect()
    cached = scheduler.prefixes.cache.acquire_longest(resident.name, prompt_ids[0].numpy(), record=False)
    assert cached is not None and cached.tokens == prompt_ids.shape[-1]
    scheduler.prefixes.cache.release(cached.entry)
    assert first.cached_tokens == known[0].ids.shape[-1]
    scheduler.close()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_running"):
        BatchLimits(max_running=0)


def test_a_step_feeds_every_decoding_row_and_prompt_chunks_oldest_first_up_to_the_budget():
    """Decoding rows get their next id each; pre-filling rows the next chunks of their
    prompts, oldest first, until the step's prompt budget is spent (model-free)."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicCache, DynamicLayer

    from preheat.workers.engine.batch import Row
    from preheat.workers.engine.raggedkv import RaggedKV, Segment

    shell = DynamicCache()
    shell.layers = [DynamicLayer()]
    batch = Batch(RaggedKV(shell, torch.device("cpu")))
    rows = [  # (ids so far, feed left, admitted as)
        ([1, 2, 3, 40], [], 1),
        ([1, 2, 3, 4, 5, 6, 7], [5, 6, 7], 4),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9], 3),
        ([1, 2, 41], [], 2),
        ([1, 2, 3], [1, 2, 3], 5),
    ]
    for ids, feed, order in rows:
        batch.kv.lengths.append(len(ids) - max(1, len(feed)))
        batch.kv.offsets.append(0)
        batch.rows.append(Row(SimpleNamespace(ids=ids), feed, order))
    assert batch.plan(8, alone=False) == [
        Segment(0, 3, (40,)),
        Segment(3, 2, (41,)),
        Segment(2, 3, (4, 5, 6, 7, 8, 9)),  # the oldest pre-fill first, whole: 6 of the 8
        Segment(1, 4, (5, 6)),  # the next gets what is left; the newest waits for the next step
    ]


def test_a_long_prompt_is_pre_filled_a_chunk_a_step_while_the_others_decode(resident):
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known, BatchLimits(prefill_tokens_per_step=8))
    running = scheduler.submit(resident, known[0].prompt_ids(resident, "hi"), greedy(2000))
    pieces = iter(running)
    next(pieces)
    long_ids = known[1].prompt_ids(resident, "Summarise: " + "the quarterly numbers went up. " * 12)
    before = scheduler.outcomes.steps
    late = scheduler.submit(resident, long_ids, SamplingParams(max_tokens=6, temperature=0.0), use_cache=False)
    late_pieces = iter(late)  # held: an iterator dropped would end the request
    first = next(late_pieces)  # its first piece: all of its prompt computed, 8 ids an iteration
    assert first.text is not None
    assert scheduler.outcomes.steps - before >= long_ids.shape[-1] // 8 - 2  # a decode step between every chunk
    late_answer = late.collect()
    assert late_answer.finish_reason != "abort"
    assert late_answer.token_ids == reference_generate(resident, long_ids, 6)[: len(late_answer.token_ids)]
    running.close()
    scheduler.close()


def test_a_cache_that_cannot_be_batched_runs_as_a_batch_of_one_beside_the_batch(resident, monkeypatch):
    """Layers of a type the batch does not know (written in place, or of other shapes) are
    never batched: each such request decodes alone, between the batch's steps, and answers
    as transformers does."""
    known, requests = mixed_requests(resident, 8)
    scheduler = warm_scheduler(resident, known)
    entry = scheduler.prefixes.cache.peek(known[0].key)
    for layer in entry.payload.cache.layers:
        layer.__class__ = type(f"InPlace{type(layer).__name__}", (type(layer),), {})
    alone_steps = {"n": 0}
    real_step_all = LoneRequests.step_all

    def counted(self):
        alone_steps["n"] += len(self.requests())
        return real_step_all(self)

    monkeypatch.setattr(LoneRequests, "step_all", counted)
    together = run_together(scheduler, resident, requests)
    for (prompt_ids, sampling), got in zip(requests, together, strict=True):
        assert got.cached_tokens > 0
        assert got.token_ids == reference_generate(resident, prompt_ids, sampling.max_tokens)[: len(got.token_ids)]
    assert alone_steps["n"] > 0 and scheduler.outcomes.rows_stepped / scheduler.outcomes.steps > 1
    assert scheduler.load()["running"] == 0
    scheduler.close()


def test_a_long_prompt_with_nothing_else_to_run_is_computed_in_one_pass(resident, monkeypatch):
    """Chunks make room for other rows' decode steps; alone, a prompt is one pass."""
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known, BatchLimits(prefill_tokens_per_step=8))
    fed = record_steps(monkeypatch)
    long_ids = known[1].prompt_ids(resident, "Summarise: " + "the quarterly numbers went up. " * 12)
    answer = scheduler.submit(resident, long_ids, greedy(1), use_cache=False).collect()
    assert [[len(segment.ids) for segment in step] for step in fed] == [[long_ids.shape[-1]]]
    assert answer.token_ids == reference_generate(resident, long_ids, 1)
    scheduler.close()


def test_a_fault_of_the_schedulers_own_ends_its_running_requests_and_the_next_is_served(resident, monkeypatch):
    """A bug in an iteration (not a request's own failure) must not leave readers waiting
    for ever: the requests it ran end with the error, and the scheduler serves on."""
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known)
    prompt_ids = known[0].prompt_ids(resident, "Where is my parcel?")
    real_step, broken = Batch.step, {"n": 0}

    def fails_once(self, *args):
        if not broken["n"]:
            broken["n"] += 1
            raise RuntimeError("injected: a scheduler bug")
        return real_step(self, *args)

    monkeypatch.setattr(Batch, "step", fails_once)
    with pytest.raises(RuntimeError, match="injected: a scheduler bug"):
        scheduler.submit(resident, prompt_ids, greedy(8)).collect()
    assert scheduler.load()["running"] == 0
    again = scheduler.submit(resident, prompt_ids, greedy(8)).collect()
    assert again.token_ids == reference_generate(resident, prompt_ids, 8)[: len(again.token_ids)]
    scheduler.close()


def test_a_served_request_is_admitted_before_waiting_probes(tiny_model):
    """A user never waits behind a warmup's measurements: with one row, the served request
    waiting behind three probes is admitted first, and answers as it would alone."""
    resident = load_resident(tiny_model)
    scheduler = new_scheduler(limits=BatchLimits(max_running=1))
    try:
        ids = TemplatePrefix.of(resident, SUPPORT_PROMPT).prompt_ids(resident, "Where is my parcel?")
        held, release = threading.Event(), threading.Event()
        blocker = threading.Thread(target=lambda: scheduler._call(lambda: (held.set(), release.wait(10))))
        blocker.start()
        held.wait(10)  # the scheduler's thread is busy: everything below waits
        probes = [scheduler.submit(resident, ids, greedy(4), record=False) for _ in range(3)]
        served = scheduler.submit(resident, ids, greedy(4))
        release.set()
        blocker.join(10)
        answer = served.collect()
        finished = [probe.collect() for probe in probes]
        assert answer.token_ids == reference_generate(resident, ids, 4)
        assert all(answer.total_ms < done.total_ms for done in finished)  # it did not wait for them
    finally:
        scheduler.close()


def test_an_arrival_is_pre_filled_inside_the_running_rows_decode_steps(resident, monkeypatch):
    """One pass per step: a request that arrives while another decodes is pre-filled in the
    same forward passes as the other's next tokens, a chunk a step, and the running stream
    gets a token in every step (it never stalls for the pre-fill)."""
    known, _ = mixed_requests(resident, 1)
    scheduler = warm_scheduler(resident, known, BatchLimits(prefill_tokens_per_step=8))
    running = scheduler.submit(resident, known[0].prompt_ids(resident, "hi"), greedy(400))
    pieces = iter(running)
    next(pieces)
    steps = record_steps(monkeypatch)  # from here the first request decodes
    late_ids = known[1].prompt_ids(resident, "Summarise: " + "the quarterly numbers went up. " * 6)
    late = scheduler.submit(resident, late_ids, greedy(4), use_cache=False).collect()
    running.close()
    scheduler.close()
    pre_filling = [step for step in steps if any(len(segment.ids) > 1 for segment in step)]
    assert len(pre_filling) >= late_ids.shape[-1] // 8
    assert all(sum(len(segment.ids) == 1 for segment in step) >= 1 for step in pre_filling)  # decoding beside
    assert all(sum(len(segment.ids) for segment in step) <= 8 + 1 for step in pre_filling)  # the budget held
    assert late.token_ids == reference_generate(resident, late_ids, 4)[: len(late.token_ids)]


def test_rows_are_as_many_as_their_kv_fits_in_the_budget(resident, monkeypatch):
    """Each row needs its prompt and max_tokens of KV; with room for three such rows, six
    requests run three at a time, and each answers as transformers does."""
    known, _ = mixed_requests(resident, 1)
    prompt_ids = known[0].prompt_ids(resident, "Where is my parcel?")
    per_token = resident.kv_bytes_per_token
    need = prompt_ids.shape[-1] + 6
    scheduler = warm_scheduler(resident, known, BatchLimits(running_kv_bytes=3 * need * per_token))
    steps = record_steps(monkeypatch)
    together = run_together(scheduler, resident, [(prompt_ids, greedy(6))] * 6)
    truth = reference_generate(resident, prompt_ids, 6)
    assert all(got.token_ids == truth[: len(got.token_ids)] for got in together)
    assert max(len(step) for step in steps) == 3
    scheduler.close()
