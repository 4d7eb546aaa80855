"""Weights read by name, by transformers or by the Run:ai Model Streamer: the same model every way."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from preheat.cli.devmodel import ARCHITECTURES
from preheat.core.errors import ModelLoadError
from preheat.workers.engine import weights
from preheat.workers.engine.device import Placement
from preheat.workers.engine.resident import ModelSource, ResidentModels

CPU = Placement(torch.device("cpu"), torch.float32)


def same_model(one, other) -> None:
    """Every tensor (parameters and buffers, bit for bit and dtype), the config, the
    generation defaults, the content digest and the logits on the same ids."""
    for tensors in (lambda m: m.state_dict(), lambda m: dict(m.named_buffers())):
        mine, theirs = tensors(one.model), tensors(other.model)
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
    assert one.model.config.to_json_string(use_diff=False) == other.model.config.to_json_string(use_diff=False)
    assert one.model.config._attn_implementation == other.model.config._attn_implementation  # preheat's, once resident
    assert one.model.generation_config.to_dict() == other.model.generation_config.to_dict()
    assert one.content_digest == other.content_digest
    assert type(one.model) is type(other.model) and not one.model.training
    ids = one.tokenizer("Where is my parcel? It was due on Tuesday.", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.equal(one.model(input_ids=ids).logits, other.model(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weights_read_by_name_give_the_model_transformers_loads(dev_model, arch, dtype):
    path = str(dev_model(arch))
    named = ResidentModels("cpu", "auto", dtype).ensure(ModelSource("named", path))[0]
    read = ResidentModels("cpu", "transformers", dtype).ensure(ModelSource("read", path))[0]
    assert (named.weight_loader, read.weight_loader) == ("safetensors", "transformers")  # auto, on the CPU
    assert named.model.dtype == getattr(torch, dtype)
    same_model(named, read)
    # A tied output head is one parameter under both names, as transformers ties it.
    head, embeddings = named.model.get_output_embeddings(), named.model.get_input_embeddings()
    assert (head.weight is embeddings.weight) == (
        read.model.get_output_embeddings().weight is read.model.get_input_embeddings().weight
    )


def _rewritten(model, folder, change) -> str:
    """A copy of `model` whose safetensors file went through `change` (its tensors by name)."""
    shutil.copytree(model, folder)
    file = next(folder.glob("*.safetensors"))
    save_file(change(load_file(file)), file, metadata={"format": "pt"})
    return str(folder)


def test_a_checkpoint_that_is_not_the_models_own_tensors_goes_to_transformers_under_auto(tiny_model, tmp_path):
    # An extra tensor transformers' loading ignores, and a renamed one it cannot place either:
    # auto reads each by transformers' loading (its own rules, as before); an explicit
    # `safetensors` refuses, naming the tensor, and is never swapped for another loader.
    extra = _rewritten(tiny_model, tmp_path / "extra", lambda t: {**t, "model.scale": torch.ones(1)})
    renamed = _rewritten(
        tiny_model,
        tmp_path / "renamed",
        lambda t: {k.replace("model.norm.", "model.final_norm."): v for k, v in t.items()},
    )
    auto = ResidentModels("cpu", "auto")
    assert auto.ensure(ModelSource("extra", extra))[0].weight_loader == "transformers"
    assert auto.ensure(ModelSource("renamed", renamed))[0].weight_loader == "transformers"
    strict = ResidentModels("cpu", "safetensors")
    with pytest.raises(ModelLoadError, match=r"holds tensors that are not LlamaForCausalLM's own \(model\.scale"):
        strict.ensure(ModelSource("extra", extra))
    with pytest.raises(ModelLoadError, match=r"1 weight\(s\) not found by name .* \(first: model\.norm\.weight\)"):
        strict.ensure(ModelSource("renamed", renamed))
    bent = _rewritten(
        tiny_model,
        tmp_path / "bent",
        lambda t: {k: v[:, :-1].contiguous() if k.endswith("q_proj.weight") else v for k, v in t.items()},
    )
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight has shape \(\d+, \d+\), the model \(\d+, \d+\)"):
        strict.ensure(ModelSource("bent", bent))
    assert set(strict.unavailable) == {"extra", "renamed", "bent"} and not strict.resident


def test_an_architecture_not_proven_or_a_pinned_revision_is_read_by_transformers(monkeypatch, tiny_model):
    monkeypatch.setattr(weights, "AS_NAMED", frozenset({"GPT2LMHeadModel"}))
    assert ResidentModels("cpu", "auto").ensure(ModelSource("m", str(tiny_model)))[0].weight_loader == "transformers"
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM is not an architecture read by name"):
        ResidentModels("cpu", "safetensors").ensure(ModelSource("m", str(tiny_model)))
    monkeypatch.undo()
    pinned = ModelSource("pinned", str(tiny_model), revision="v1")
    assert ResidentModels("cpu", "auto").ensure(pinned)[0].weight_loader == "transformers"
    with pytest.raises(ModelLoadError, match="revision 'v1': a read by name takes the folder's files as they are"):
        ResidentModels("cpu", "safetensors").ensure(pinned)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streamed_weights_give_the_model_transformers_loads(dev_model, arch):
    path = str(dev_model(arch))
    read = ResidentModels("cpu", "transformers").ensure(ModelSource("read", path))[0]
    streamed = ResidentModels("cpu", "runai-streamer").ensure(ModelSource("streamed", path))[0]
    assert (read.weight_loader, streamed.weight_loader) == ("transformers", "runai-streamer")
    same_model(streamed, read)  # the generation defaults from the folder's generation_config.json too


def test_auto_reads_by_name_on_the_cpu_and_an_explicit_choice_is_kept():
    assert weights.pick_loader("auto", CPU) == "safetensors"
    assert weights.pick_loader("auto", CPU, "/models/m.gguf") == "transformers"  # its GGUF loader
    assert weights.pick_loader("runai-streamer", CPU) == "runai-streamer"
    with pytest.raises(ModelLoadError, match="PREHEAT_WEIGHT_LOADER must be one of auto, transformers, safetensors"):
        weights.pick_loader("fastest", CPU)


def test_the_streamer_refuses_a_pinned_revision_and_a_folder_without_safetensors(tiny_model, tmp_path):
    registry = ResidentModels("cpu", "runai-streamer")
    with pytest.raises(ModelLoadError, match="a pinned revision needs PREHEAT_WEIGHT_LOADER=transformers"):
        registry.ensure(ModelSource("pinned", str(tiny_model), revision="v1"))
    bare = tmp_path / "no-weights"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match=r"has no \.safetensors files: the streamer reads safetensors only"):
        registry.ensure(ModelSource("bare", str(bare)))
    assert set(registry.unavailable) == {"pinned", "bare"}  # each kept as the reason it is not resident


def test_a_loader_asked_for_and_not_installed_leaves_the_model_unavailable_with_the_reason(monkeypatch, tiny_model):
    # This environment has the fast-load extra; a host without it is one where it cannot be found.
    monkeypatch.setattr(weights, "streamer_installed", lambda: False)
    registry = ResidentModels("cpu", "runai-streamer")
    with pytest.raises(ModelLoadError, match=r"not installed \(pip install 'preheat\[fast-load\]'\)"):
        registry.ensure(ModelSource("m", str(tiny_model)))
    assert "PREHEAT_WEIGHT_LOADER=runai-streamer" in registry.unavailable["m"] and not registry.resident
    assert weights.pick_loader("auto", CPU) == "safetensors"


@pytest.mark.parametrize("loader", ["transformers", "safetensors", "runai-streamer"])
def test_every_loader_keeps_the_models_own_modules_never_hub_kernels(monkeypatch, tiny_model, loader):
    # transformers 5.x kernelizes a loaded model by default wherever the `kernels` package is
    # installed (a CUDA host's image), fetching layers from the Hub: each loader says no.
    from transformers import PreTrainedModel

    decided, kernelize = [], PreTrainedModel.set_use_kernels

    def recorded(model, use_kernels, *args, **kwargs):
        decided.append(use_kernels)
        return kernelize(model, use_kernels, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", recorded)
    ResidentModels("cpu", loader).ensure(ModelSource("m", str(tiny_model)))
    assert decided == ([] if loader == "safetensors" else [False])  # a read by name never asks
