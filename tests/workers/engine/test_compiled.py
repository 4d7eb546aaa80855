"""Compiled steps on the production path: the same tokens as eager steps (and transformers) on
the dev architectures in float32, batched and alone; a restart restores the graphs instead of
compiling them; a damaged or foreign artefact costs a compile, never a crash or a wrong answer.

Compiling is slow (tens of seconds a model on 2 cores): these are the only tests that compile,
and each architecture compiles once per session (a compile store shared by the module)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.compilestore import CompileStore
from tests.conftest import answers_together, greedy, new_scheduler, reference_generate, run_folder, support_request

pytestmark = pytest.mark.slow

ARCHITECTURES = ("llama", "qwen3", "mistral", "gemma3", "gpt2")
INPUTS = ("Where is my parcel?", "Summarise: the launch moved to March.", "Hello", "Is it raining in Oslo today?")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One compile store for the run, shared by its test processes as replicas share one
    volume: a model one test compiled (the dev models are the run's, one folder each), the
    next restores, in any process (a compile costs 30-40 s of 2 cores a model)."""
    return CompileStore(run_folder(tmp_path_factory) / "compiled-shared")


@contextlib.contextmanager
def released(scheduler, resident):
    """The scheduler closed and the model's compiled steps let go, whatever the test raised:
    packed weights are one model's per name in a process, and the next test's model of the
    same name restores them."""
    try:
        yield
    finally:
        scheduler.close()
        resident.runner.release()


def packed_while_idle(resident, timeout_s: float = 60.0) -> None:
    """Wait until the scheduler has moved the weights into huge pages and packed every linear
    layer's weight (sidework.IdleWork)."""
    deadline = time.monotonic() + timeout_s
    while resident.runner.idle_work() is not None:
        assert time.monotonic() < deadline, "the weights were not packed while the scheduler was idle"
        time.sleep(0.01)


def compiled_layers(resident) -> list:
    from preheat.workers.engine import linears

    return [layer for layer in resident.model.modules() if isinstance(layer, linears._CompiledLinear)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compiled_steps_give_the_eager_steps_tokens_batched_and_alone(dev_model, arch, store):
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource(arch, str(dev_model(arch))))
    requests = [(support_request(resident, text)[1], greedy(12)) for text in INPUTS]
    eager = new_scheduler()
    with released(eager, resident):
        alone_eager = [eager.submit(resident, *request).collect() for request in requests]
        together_eager = answers_together(eager, resident, requests)
        report = eager.compile(resident.runner, "auto", store, resident.content_digest)
        assert report.source in ("compiled", "restored") and report.ms > 0, report
        packed_while_idle(resident)  # the steps' steady state: every layer's weight packed for oneDNN
        compiled_steps = []
        real_run = resident.runner.compiled._run

        def counted(kv, segments):
            compiled_steps.append(sum(len(segment.ids) for segment in segments))
            return real_run(kv, segments)

        resident.runner.compiled._run = counted
        alone = [eager.submit(resident, *request).collect() for request in requests]
        together = answers_together(eager, resident, requests)
    assert 1 in compiled_steps and max(compiled_steps) > 1  # both graphs ran
    for request, *answers in zip(requests, alone_eager, together_eager, alone, together, strict=True):
        ids = [answer.token_ids for answer in answers]
        assert ids[0] == ids[1] == ids[2] == ids[3]
        assert ids[0] == reference_generate(resident, request[0], 12)[: len(ids[0])]


def test_a_long_step_and_sampling_run_through_the_compiled_graphs(dev_model, store):
    """A step far longer than any the compile ran (a 700-token prompt in one pass) and a
    sampled request: one graph for every number of tokens, nothing padded, nothing eager."""
    from preheat.workers.engine.chat import conversation, render
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(
        ModelSource("llama", str(dev_model("llama")))
    )
    scheduler = new_scheduler()
    with released(scheduler, resident):
        report = scheduler.compile(resident.runner, "auto", store, resident.content_digest)
        assert report.source in ("compiled", "restored"), report
        long_ids = render(resident, conversation(" ".join(f"Rule {n}: be kind." for n in range(120)), "Hi"))
        assert long_ids.shape[-1] > 600
        got = scheduler.submit(resident, long_ids, greedy(6)).collect()
        sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
        first = scheduler.submit(resident, long_ids, sampled).collect()
        again = scheduler.submit(resident, long_ids, sampled).collect()
        assert resident.runner.compiled is not None and resident.runner.compiled.ready  # never fell back eager
        assert not resident.runner.compiled._refused
    assert got.token_ids == reference_generate(resident, long_ids, 6)[: len(got.token_ids)]
    assert first.token_ids == again.token_ids and len(first.token_ids) > 0


def test_a_layer_gives_the_same_tokens_before_its_weight_is_packed(dev_model, store):
    """Packing the weights for oneDNN waits for moments with no request (sidework.IdleWork):
    until a layer's is packed, its products run on the weight itself. A long prompt's
    many-token steps with no weight packed give the tokens they give with every weight
    packed, and transformers'; the scheduler packs every layer while idle."""
    from preheat.workers.engine.chat import conversation, render
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(
        ModelSource("llama", str(dev_model("llama")))
    )
    long_ids = render(resident, conversation(" ".join(f"Rule {n}: be kind." for n in range(60)), "Hi"))
    scheduler = new_scheduler()
    with released(scheduler, resident):
        # The runner's own compile, not the scheduler's: no idle work is queued, nothing is packed.
        assert scheduler.call(resident.runner.compile, "auto", store, resident.content_digest).source != "eager"
        layers = compiled_layers(resident)
        unpacked = scheduler.submit(resident, long_ids, greedy(8)).collect()
        assert layers and all(layer.packed is None for layer in layers)
        # Through the scheduler: the same steps (nothing compiled again), their packing queued.
        assert scheduler.compile(resident.runner, "auto", store, resident.content_digest).source != "eager"
        packed_while_idle(resident)
        assert all(layer.packed is not None for layer in layers)
        packed = scheduler.submit(resident, long_ids, greedy(8)).collect()
        assert "many" in resident.runner.compiled._graphs and not resident.runner.compiled._refused
    assert unpacked.token_ids == packed.token_ids == reference_generate(resident, long_ids, 8)[: len(packed.token_ids)]


def test_a_level_one_sleep_keeps_the_graphs_and_the_wake_only_packs_the_weights(dev_model, store, monkeypatch):
    """A level-1 sleep frees the weights and their packed copies (the small-step kernel keeps
    none) and keeps the graphs: the wake reads the weights back, packs them again and runs the
    same graphs and kernel, with no compile and no restore, and gives the eager tokens. A step
    whose inputs a graph refuses runs eager."""
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(
        ModelSource("llama", str(dev_model("llama")))
    )
    scheduler = new_scheduler()
    with released(scheduler, resident):
        _sleep_and_refusal(scheduler, resident, store, monkeypatch)


def _sleep_and_refusal(scheduler, resident, store, monkeypatch) -> None:
    import torch

    from preheat.workers.engine import linears

    request = (support_request(resident, "Where is my parcel?")[1], greedy(10))
    eager = scheduler.submit(resident, *request).collect()
    scheduler.compile(resident.runner, "auto", store, resident.content_digest)
    layers = compiled_layers(resident)
    packed_while_idle(resident)
    assert layers and all(layer.packed is not None and linears._LAYERS[layer.weight_id] is layer for layer in layers)
    from preheat.workers.sleep import offload_weights, restore_weights

    scheduler.call(resident.runner.suspend)
    offloaded, _ = scheduler.call(offload_weights, resident)  # a level-1 sleep's release (sleep.py)
    assert all(layer.packed is None for layer in layers)  # the packed copies are given back while it sleeps
    if (kernel := resident.runner.compiled.small_step) is not None:  # nor does the kernel keep the weights
        assert all(weight.numel() == 0 for layer in kernel.weights for weight in layer)
    scheduler.call(restore_weights, resident, offloaded)
    made = dict(resident.runner.compiled.made)
    report = scheduler.compile(resident.runner, "auto", store, resident.content_digest)
    assert report.source == "kept"
    packed_while_idle(resident)  # moved into huge pages and packed again while idle, not on the wake's path
    if (kernel := resident.runner.compiled.small_step) is not None:  # its table names the weights where they are
        from preheat.workers.engine.smallstep import WEIGHTS

        held = [weight.data_ptr() for layer in kernel.weights for weight in layer]
        assert kernel.table[:, : len(WEIGHTS)].flatten().tolist() == held
    woken = scheduler.submit(resident, *request).collect()
    assert resident.runner.compiled.made == made  # no graph compiled or loaded for the wake
    assert woken.token_ids == eager.token_ids

    # Inputs a graph was not compiled for (here int32 ids: its guards check the dtype) are
    # refused before anything runs, and that step runs eager: the same answer, never a crash.
    from preheat.workers.engine.raggedkv import RaggedKV

    real_inputs = RaggedKV.step_inputs

    def int32_ids(kv, segments):
        inputs = real_inputs(kv, segments)
        return {**inputs, "input_ids": inputs["input_ids"].to(torch.int32)}

    monkeypatch.setattr(RaggedKV, "step_inputs", int32_ids)
    refused = scheduler.submit(resident, *request).collect()
    assert refused.token_ids == eager.token_ids
    # A lone token is the small-step kernel's where it runs (smallstep_f32.c: AVX2): no graph to refuse it.
    kinds = {"many"} if resident.runner.compiled.small_step is not None else {"one", "many"}
    assert resident.runner.compiled._refused == kinds and resident.runner.compiled.ready


RESTART = textwrap.dedent(
    """
    import json, sys
    from preheat.workers.engine.compiled import CompiledSteps
    from preheat.workers.engine.compilestore import CompileStore
    from preheat.workers.engine.resident import ModelSource, ResidentModels
    from tests.conftest import greedy, new_scheduler, support_request

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("m", sys.argv[1]))
    scheduler = new_scheduler()
    steps, run = [], CompiledSteps._run
    CompiledSteps._run = lambda self, *args, **kwargs: steps.append(1) or run(self, *args, **kwargs)
    report = scheduler.compile(resident.runner, "auto", CompileStore(sys.argv[2]), resident.content_digest)
    CompiledSteps._run = run
    answer = scheduler.submit(resident, support_request(resident, "Where is my parcel?")[1], greedy(8)).collect()
    scheduler.close()
    made = resident.runner.compiled.made
    print(json.dumps({"source": report.source, "compiled": made["compiled"], "loaded": made["loaded"],
                      "built": report.kernels_built, "warm_up_steps": len(steps), "tokens": answer.token_ids,
                      "small_step": resident.runner.compiled.small_step is not None}))
    """
)


def _start(model, folder) -> dict:
    from tests.conftest import REPO

    done = subprocess.run(
        [sys.executable, "-c", RESTART, str(model), str(folder)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)  # two worker starts, one compiling
def test_a_restart_restores_the_graphs_and_a_damaged_or_foreign_artefact_is_refused_whole(tiny_model, tmp_path):
    folder = tmp_path / "compiled"
    cold = _start(tiny_model, folder)
    # The one-token graph and the many-token graph; only the latter where the small-step kernel
    # runs a lone token (smallstep_f32.c, on a CPU with AVX2).
    graphs = 1 if cold["small_step"] else 2
    assert (cold["source"], cold["compiled"], cold["loaded"], cold["warm_up_steps"]) == ("compiled", graphs, 0, 3)
    warm = _start(tiny_model, folder)  # a restarted worker: its graphs loaded from the store, nothing traced
    assert (warm["source"], warm["compiled"], warm["loaded"], warm["built"]) == ("restored", 0, graphs, 0)
    # The package ran the chunk alone where it was compiled: not again (compiled.WARM_UP).
    assert warm["warm_up_steps"] == 2
    assert warm["tokens"] == cold["tokens"]

    # An entry whole by its manifest that lacks a graph (a start that stopped before its
    # compile ended is never stored, but a foreign copy may be partial): the start loads what
    # is there, compiles what is not, and the entry is stored again whole, so the next start
    # compiles nothing. (A torch.compile graph's entry that lacks a kernel the graph calls is
    # stored again the same way, with the kernels its load built: `kernels_built`.)
    [entry] = [path for path in folder.iterdir() if path.is_dir()]
    manifest = json.loads((entry / "manifest.json").read_text())
    [graph] = [name for name in manifest["files"] if name.endswith("/many.pt2")]
    manifest["files"].pop(graph)
    (entry / "files" / graph).unlink()
    (entry / "manifest.json").write_text(json.dumps(manifest))
    mended = _start(tiny_model, folder)
    mended_as = ("compiled", 1, graphs - 1, 3)
    assert (mended["source"], mended["compiled"], mended["loaded"], mended["warm_up_steps"]) == mended_as
    assert mended["tokens"] == cold["tokens"]
    assert graph in json.loads((entry / "manifest.json").read_text())["files"]
    again = _start(tiny_model, folder)
    assert (again["source"], again["compiled"], again["loaded"], again["built"]) == ("restored", 0, graphs, 0)
    assert again["tokens"] == cold["tokens"]

    # A damaged or foreign entry is refused and removed before a file is copied into
    # inductor's cache: the next start finds the store empty and compiles, as the cold start
    # above did (checked in the store: each start that compiles costs a minute here).
    [entry] = [path for path in folder.iterdir() if path.is_dir()]
    shutil.copytree(entry, tmp_path / "whole")
    manifest = json.loads((entry / "manifest.json").read_text())
    key = dict(manifest["identity"])
    stored = max((path for path in (entry / "files").rglob("*") if path.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the largest artefact (a kernel library)
    stored.write_bytes(bytes(data))
    assert CompileStore(folder).restore(key) is False and not entry.exists()

    shutil.copytree(tmp_path / "whole", entry)  # whole again, but another identity's under this name
    manifest["identity"]["dtype"] = "torch.bfloat16"
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert CompileStore(folder).restore(key) is False and not entry.exists()


def test_compile_off_and_a_device_that_cannot_compile_run_eager_and_say_why(tiny_model, monkeypatch):
    from preheat.workers.engine import compiled
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("m", str(tiny_model)))
    off = resident.runner.compile("off", None, resident.content_digest)
    assert (off.source, off.reason) == ("eager", "PREHEAT_COMPILE=off") and resident.runner.compiled is None
    resident.runner.compile_report = None
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    missing = resident.runner.compile("auto", None, resident.content_digest)
    assert missing.source == "eager" and "no C++ compiler" in missing.reason


def test_rows_of_the_base_and_three_adapters_run_through_the_compiled_graphs_and_answer_as_peft(tiny_model, tmp_path):
    """A model that declares adapters compiles its adapter steps at start (stand-in adapters),
    and then any set of adapters (other ranks, other modules) runs through those graphs, with
    no compile on the request path: every answer equals transformers + PEFT. So does every
    answer after a restart that loaded the graphs from the store (a loaded graph once read the
    adapters of the step it was compiled on, pickled with it)."""
    import threading

    from preheat.cli.devadapter import make_adapter
    from preheat.workers.engine.lora import read_adapter
    from preheat.workers.engine.resident import ModelSource, ResidentModels
    from tests.workers.engine.test_lora import peft_generate

    folders = {
        "a": make_adapter(tiny_model, tmp_path / "a", rank=8, seed=1),
        "b": make_adapter(tiny_model, tmp_path / "b", rank=4, seed=2),
        "c": make_adapter(tiny_model, tmp_path / "c", rank=16, seed=3),
    }
    store = CompileStore(tmp_path / "compiled")
    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("lora-tiny", str(tiny_model)))
    weights = {n: read_adapter(n, "lora-tiny", f, resident.model, max_rank=64) for n, f in folders.items()}
    scheduler = new_scheduler()
    report = scheduler.compile(resident.runner, "auto", store, resident.content_digest, adapters=True)
    assert report.source == "compiled", report
    graphs, real_for_step = [], resident.runner.compiled.for_step

    def counted(kv, segments, adapters=None):
        graph = real_for_step(kv, segments, adapters)
        graphs.append((graph is not None, len({id(a) for a in adapters or [] if a is not None})))
        return graph

    resident.runner.compiled.for_step = counted
    plan = [(text, name) for text in INPUTS[:2] for name in (None, "a", "b", "c")]
    prompts = {text: support_request(resident, text)[1] for text in INPUTS[:2]}
    results: list = [None] * len(plan)
    made = dict(resident.runner.compiled.made)

    def one(i: int) -> None:
        text, name = plan[i]
        results[i] = scheduler.submit(resident, prompts[text], greedy(8), adapter=weights.get(name)).collect()

    def run_plan() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)

    run_plan()
    # one, many, one+lora, many+lora; a lone token without adapters is the small-step kernel's where it runs
    kinds = 3 if resident.runner.compiled.small_step is not None else 4
    assert made == {"compiled": kinds, "loaded": 0} and all(compiled for compiled, _ in graphs)  # never eager
    assert max(n for _, n in graphs) == 3
    assert resident.runner.compiled.made == made  # nothing compiled since
    expected = {
        (text, name): reference_generate(resident, prompts[text], 8)
        if name is None
        else peft_generate(tiny_model, folders[name], prompts[text], 8)
        for text, name in plan
    }
    for (text, name), completion in zip(plan, results, strict=True):
        assert completion.token_ids == expected[text, name][: len(completion.token_ids)], (text, name)

    # Restarted: the graphs loaded from the store, run with other stacks than they were saved with.
    scheduler.call(resident.runner.release)
    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("lora-tiny", str(tiny_model)))
    weights = {n: read_adapter(n, "lora-tiny", f, resident.model, max_rank=64) for n, f in folders.items()}
    report = scheduler.compile(resident.runner, "auto", store, resident.content_digest, adapters=True)
    assert report.source == "restored", report  # not eager: every graph loaded and ran the compile's steps
    assert resident.runner.compiled.made == {"compiled": 0, "loaded": kinds}
    graphs.clear()
    real_for_step = resident.runner.compiled.for_step
    resident.runner.compiled.for_step = counted
    results[:] = [None] * len(plan)
    run_plan()
    scheduler.close()
    assert graphs and all(compiled for compiled, _ in graphs)
    for (text, name), completion in zip(plan, results, strict=True):
        assert completion.token_ids == expected[text, name][: len(completion.token_ids)], ("restored", text, name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_one_token_step_runs_in_one_kernel_call_or_through_preheats_products(dev_model, arch):
    """In bfloat16 on a CPU with AVX512-BF16, a lone decoding row's step is one kernel call
    where the kernel computes the model (a Llama: preheat.workers.engine.smallstep; no graph,
    no op per layer), else its graph, whose linear layers are preheat's bf16 product, one call
    each (a Qwen2: its biases). Either way its logits are the eager step's up to bf16 rounding.
    A step of two rows is the kernel's too while it feeds few tokens; past that, the
    many-token graph's (compiled at start, never on a request's path)."""
    import torch

    from preheat.workers.engine import cpukernels, linears
    from preheat.workers.engine.raggedkv import Segment
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    if not cpukernels.available():
        pytest.skip(f"preheat's bf16 kernel does not run here: {cpukernels.why_not_built()}")
    model = ModelSource(f"bf16-{arch}", str(dev_model(arch)))
    resident, _ = ResidentModels("cpu", dtype_preference="bfloat16").ensure(model)
    runner, ids = resident.runner, support_request(resident, "Where is my parcel?")[1][0].tolist()
    kv = runner.new_batch()
    slot = kv.add(None, len(ids) + 8)
    runner.step(kv, [Segment(slot, 0, tuple(ids[:-1]))])
    kv.stepped()
    before, last = kv.snapshot(), [Segment(slot, len(ids) - 1, (ids[-1],))]
    eager = runner.step(kv, last).float()
    kv.restore(before)
    assert runner.compile("auto", None, resident.content_digest).source == "compiled"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = runner.step(kv, last).float()
    ops = {event.key: event.count for event in profile.key_averages()}
    layers = sum(isinstance(module, linears._CompiledLinear) for module in resident.model.modules())
    kernel = runner.compiled.small_step is not None
    assert kernel == (arch == "llama") and kernel == ("one" not in runner.compiled._graphs)
    assert ops.get("preheat::matvec_bf16", 0) == (0 if kernel else layers) and layers > 0, ops
    assert ("preheat::ragged_attention" in ops) != kernel
    assert got.argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert (got - eager).abs().max() <= 0.02 * eager.abs().max(), (got - eager).abs().max()
    made = dict(runner.compiled.made)
    for fed, small in ((2, kernel), (len(ids), False)):  # a second row feeding a chunk: small, then large
        before, two = kv.snapshot(), [last[0], Segment(kv.add(None, len(ids)), 0, tuple(ids[:fed]))]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            assert runner.step(kv, two).shape[0] == 2
        assert ("preheat::ragged_attention" in {event.key for event in profile.key_averages()}) != small
        kv.remove(two[1].slot), kv.restore(before)
    assert runner.compiled.made == made  # nothing compiled on a step's path
    runner.release()
    assert runner.compiled is None


def test_a_bf16_adapter_step_adds_each_rows_adapter_inside_its_linear_layers_op(tiny_model, tmp_path):
    """A step of many rows under adapters runs one op per adapted linear layer, the product and
    the rows' adapters together (`preheat::packed_linear_lora`: no op of their own between
    two products, where the OpenMP team would fall asleep), and its logits are the eager
    step's (PEFT's hooks) up to bf16 rounding, a base row's among them."""
    import torch

    from preheat.cli.devadapter import make_adapter
    from preheat.workers.engine import cpukernels, linears
    from preheat.workers.engine.lora import read_adapter
    from preheat.workers.engine.raggedkv import Segment
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    if not cpukernels.available():
        pytest.skip(f"preheat's bf16 kernel does not run here: {cpukernels.why_not_built()}")
    resident, _ = ResidentModels("cpu", dtype_preference="bfloat16").ensure(ModelSource("bf16-lora", str(tiny_model)))
    runner = resident.runner
    adapters = [
        read_adapter(
            n, "bf16-lora", make_adapter(tiny_model, tmp_path / n, rank=r, seed=s), resident.model, max_rank=64
        )
        for n, r, s in (("a", 8, 1), ("b", 16, 2))
    ]
    kv = runner.new_batch()
    rows = [support_request(resident, text)[1][0].tolist() for text in INPUTS[:3]]
    slots = [kv.add(None, len(ids) + 8) for ids in rows]
    step = [Segment(slot, 0, tuple(ids)) for slot, ids in zip(slots, rows, strict=True)]
    per_row = [adapters[0], None, adapters[1]]
    before = kv.snapshot()
    eager = runner.step(kv, step, per_row).float()
    kv.restore(before)
    assert runner.compile("auto", None, resident.content_digest, adapters=True).source == "compiled"
    for adapter in adapters:
        runner.adapter_resident(adapter)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = runner.step(kv, step, per_row).float()
    calls = {event.key: event.count for event in profile.key_averages()}
    adapted = sum(
        isinstance(module, linears._CompiledLinear) and module.lora_kind is not None
        for module in resident.model.modules()
    )
    assert adapted > 0 and calls.get("preheat::packed_linear_lora") == adapted
    assert "preheat::lora_add" not in calls
    assert got.argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert (got - eager).abs().max() <= 0.03 * eager.abs().max(), (got - eager).abs().max()
    runner.release()
