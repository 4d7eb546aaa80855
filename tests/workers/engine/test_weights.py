"""Weights read by transformers or by the Run:ai Model Streamer: the same model either way."""

import shutil

import pytest
import torch

from preheat.core.errors import ModelLoadError
from preheat.workers.engine import weights
from preheat.workers.engine.device import Placement
from preheat.workers.engine.resident import ModelSource, ResidentModels

CPU = Placement(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streamed_weights_give_the_model_transformers_loads(dev_model, arch):
    path = str(dev_model(arch))
    read = ResidentModels("cpu", "transformers").ensure(ModelSource("read", path))[0]
    streamed = ResidentModels("cpu", "runai-streamer").ensure(ModelSource("streamed", path))[0]
    assert (read.weight_loader, streamed.weight_loader) == ("transformers", "runai-streamer")
    ids = read.tokenizer("Where is my parcel? It was due on Tuesday.", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.equal(read.model(input_ids=ids).logits, streamed.model(input_ids=ids).logits)
    # The generation defaults come from the folder's generation_config.json either way.
    assert streamed.model.generation_config.to_dict() == read.model.generation_config.to_dict()
    assert type(streamed.model) is type(read.model) and not streamed.model.training


def test_auto_reads_with_transformers_on_the_cpu_and_an_explicit_choice_is_kept():
    assert weights.pick_loader("auto", CPU) == "transformers"
    assert weights.pick_loader("runai-streamer", CPU) == "runai-streamer"
    with pytest.raises(ModelLoadError, match="PREHEAT_WEIGHT_LOADER must be one of auto, transformers"):
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
    assert weights.pick_loader("auto", CPU) == "transformers"


@pytest.mark.parametrize("loader", ["transformers", "runai-streamer"])
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
    assert decided == [False]
