"""LoRA adapters in the engine: read and proven from a PEFT folder, kept in slots (LRU, pins
with a cap), and rows of the base and of several adapters run in one step, each answer
token for token what transformers + PEFT gives with that adapter on the same ids."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from preheat.cli.devadapter import make_adapter
from preheat.workers.engine.lora import AdapterError, AdapterSlots, LoraWeights, read_adapter
from tests.conftest import greedy, new_scheduler, support_request

INPUTS = ("Where is my parcel?", "Summarise: the launch moved to March.", "Hello", "Is it raining in Oslo today?")


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model, folder / name, rank=8, seed=seed) for seed, name in enumerate("abc")}


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory):
    """An adapter of another base: a model of other widths (128, not 256)."""
    from preheat.cli.devmodel import ModelShape, make_model

    folder = tmp_path_factory.mktemp("other-base")
    other = make_model(folder / "model", shape=ModelShape(hidden_size=128, intermediate_size=352, num_hidden_layers=2))
    return make_adapter(other, folder / "adapter", rank=8)


@pytest.fixture(scope="module")
def resident(tiny_model):
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("tiny", str(tiny_model)))
    return resident


def peft_generate(model_dir, adapter_dir, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers + PEFT with the adapter, from scratch: the ground truth."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, prompt_ids.shape[-1] :].tolist()


def test_rows_of_the_base_and_three_adapters_in_one_step_answer_as_peft(tiny_model, resident, adapters):
    weights = {name: read_adapter(name, "tiny", path, resident.model, max_rank=64) for name, path in adapters.items()}
    scheduler = new_scheduler()
    plan = [(text, name) for text in INPUTS for name in (None, "a", "b", "c")]
    prompts = {text: support_request(resident, text)[1] for text in INPUTS}
    results: list = [None] * len(plan)
    stepped = []
    real_step = resident.runner.step

    def counted(kv, segments, adapters=None):
        stepped.append(len({id(a) for a in adapters or [] if a is not None}) + (None in (adapters or [None])))
        return real_step(kv, segments, adapters)

    resident.runner.step = counted
    try:

        def one(i: int) -> None:
            text, name = plan[i]
            adapter = weights[name] if name else None
            results[i] = scheduler.submit(resident, prompts[text], greedy(10), adapter=adapter).collect()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    finally:
        resident.runner.step = real_step
        scheduler.close()
    assert max(stepped) >= 3  # base and adapters together in one pass, never one adapter at a time
    for (text, name), completion in zip(plan, results, strict=True):
        if name is None:
            from tests.conftest import reference_generate

            expected = reference_generate(resident, prompts[text], 10)
        else:
            expected = peft_generate(tiny_model, adapters[name], prompts[text], 10)
        assert completion.token_ids == expected[: len(completion.token_ids)], (text, name)
    assert len({tuple(c.token_ids) for (text, _), c in zip(plan, results, strict=True) if text == INPUTS[0]}) > 1


def test_a_prefix_never_crosses_adapters(tiny_model, resident, adapters):
    """The same system prompt pre-filled under an adapter and on the base are two entries;
    a request under an adapter starts from its adapter's prefix, and answers as PEFT."""
    weights = read_adapter("a", "tiny", adapters["a"], resident.model, max_rank=64)
    scheduler = new_scheduler()
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel?")
    base = scheduler.prefill(resident, prefix_ids, pin=True)
    under = scheduler.prefill(resident, prefix_ids, pin=True, adapter=weights)
    assert base.entry.key != under.entry.key and under.entry.key.model == "tiny+a"
    assert under.source == "computed"  # never the base's KV
    completion = scheduler.submit(resident, prompt_ids, greedy(8), adapter=weights).collect()
    assert completion.cached_tokens == prefix_ids.shape[-1]
    assert completion.token_ids == peft_generate(tiny_model, adapters["a"], prompt_ids, 8)[: len(completion.token_ids)]
    scheduler.close()


def test_slots_evict_the_least_recently_used_never_a_pinned_one():
    slots = AdapterSlots(capacity=2, max_pinned=1)

    def weights(name: str) -> LoraWeights:
        return LoraWeights(name, "m", f"/{name}", 8, 2.0, {})

    assert slots.put(weights("a"), pin=True) == [] and slots.put(weights("b")) == []
    assert slots.put(weights("c")) == ["b"]  # a is pinned
    with pytest.raises(AdapterError, match="pinned"):
        slots.put(weights("d"), pin=True)  # the pin cap
    assert slots.get("c") is not None and slots.put(weights("d")) == ["c"]
    slots.unpin("a")
    slots.get("d")
    assert slots.put(weights("e")) == ["a"]
    assert (slots.loads, slots.evictions) == (5, 3) and slots.resident == ["d", "e"]
    slots.pin("e")
    assert [w.name for w in slots.clear()] == ["d", "e"]  # a sleep: every slot let go, pins too
    assert slots.resident == [] and slots.pinned == set() and slots.describe()["pinned"] == []


def _corrupt(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "corrupt"
    copy.mkdir()
    (copy / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    name = next(iter(tensors))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(copy / "adapter_model.safetensors"))
    return copy


def _truncated(folder, tmp_path):
    copy = tmp_path / "truncated"
    copy.mkdir()
    (copy / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    data = (folder / "adapter_model.safetensors").read_bytes()
    (copy / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return copy


def _rank(folder, tmp_path):
    copy = tmp_path / "rank"
    copy.mkdir()
    config = json.loads((folder / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "r": 512}))
    (copy / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    return copy


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda folder, tmp, other: tmp / "missing", "no adapter_config.json and adapter_model.safetensors"),
        (lambda folder, tmp, other: other, "another base model?"),
        (lambda folder, tmp, other: _rank(folder, tmp), "rank 512 is over the cap of 64"),
        (lambda folder, tmp, other: _corrupt(folder, tmp), "not finite"),
        (lambda folder, tmp, other: _truncated(folder, tmp), "cannot be read"),
    ],
    ids=["missing", "wrong-base", "rank", "nan", "truncated"],
)
def test_a_bad_adapter_is_one_line(resident, adapters, other_base_adapter, tmp_path, make, says):
    other = other_base_adapter
    with pytest.raises(AdapterError) as refused:
        read_adapter("x", "tiny", make(adapters["a"], tmp_path, other), resident.model, max_rank=64)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_compiled_steps_stacks_follow_the_mix_of_recent_steps_and_rebuild_only_for_a_new_one():
    """Bookkeeping of the stacked adapters (no model): each adapter's A and B in its own
    columns, zeros where it leaves a module alone; a step whose adapters a kept stack holds
    takes the smallest such; a new one builds a stack of the recent steps' adapters, and one
    that stopped coming is left out. B holds the adapter's scaling; each token names its own
    adapter's columns."""
    from preheat.workers.engine.lorastack import AdapterStack, Stacked, Targets, step_columns

    targets = Targets({"model.layers.*.q": (2, 6, 4), "model.layers.*.up": (2, 8, 4)})

    def adapter(name: str, rank: int, value: float, modules=("model.layers.0.q", "model.layers.1.up")):
        layers = {
            m: (torch.full((rank, 4), value), torch.full((6 if m.endswith("q") else 8, rank), value)) for m in modules
        }
        return LoraWeights(name, "m", "", rank, 2.0, layers)

    a, b, c = adapter("a", 2, 1.0), adapter("b", 3, 2.0, ("model.layers.1.q",)), adapter("c", 1, 3.0)
    stack = AdapterStack(targets, "cpu")
    stack.admit(a)  # read ahead: its own stack, before any step
    alone = stack.for_step((a,))
    assert [s.name for s in alone.adapters] == ["a"]
    both = stack.for_step((b,))  # a ran just before: stacked with b
    assert [s.name for s in both.adapters] == ["a", "b"] and both.rank == 5
    assert torch.equal(both.a["model.layers.*.q"][0, :2], torch.ones(2, 4))  # a's A, layer 0
    assert both.a["model.layers.*.q"][0, 2:].abs().sum() == 0  # b leaves layer 0 alone
    assert torch.equal(both.b["model.layers.*.q"][1, 2:], torch.full((3, 6), 2.0 * 2.0))  # b's B, scaled
    assert stack.for_step((a,)) is alone and stack.for_step((a, b)) is both  # kept: no rebuild
    for _ in range(AdapterStack.RECENT_STEPS):
        stack.for_step((b,))
    third = stack.for_step((c,))  # a has not run for a while: left out
    assert [s.name for s in third.adapters] == ["b", "c"]
    assert step_columns([2, 1, 1], [c, None, b], third).tolist() == [[3, 1], [3, 1], [0, 0], [0, 3]]
    # A lone rank-1 adapter is stacked two columns wide (a zero one beside it): the graphs'
    # rank is symbolic, and a size of 1 would be a graph of its own.
    lone = Stacked.of((c,), targets, "cpu")
    assert lone.width == 2 and lone.a["model.layers.*.q"].shape[1] == 2 and lone.b["model.layers.*.up"].shape[1] == 2
    assert step_columns([1, 1], [c, None], lone).tolist() == [[0, 1], [0, 0]]
