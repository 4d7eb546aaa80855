import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from preheat.cli.devmodel import BOS, make_model


def test_the_small_model_loads_through_from_pretrained(tiny_model):
    files = {path.name for path in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    size_mb = (tiny_model / "model.safetensors").stat().st_size / 1e6
    assert 10 < size_mb < 100  # "a few tens of MB"
    assert json.loads((tiny_model / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = tokenizer("def main():\n    return 0")["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(BOS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def main():\n    return 0"  # byte-level round trip
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_a_second_architecture_and_determinism(tmp_path):
    first = make_model(tmp_path / "a", arch="qwen2")
    second = make_model(tmp_path / "b", arch="qwen2")
    assert json.loads((first / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_refuses_to_overwrite_and_unknown_architectures(tmp_path, tiny_model):
    with pytest.raises(FileExistsError):
        make_model(tiny_model)
    with pytest.raises(ValueError, match="unknown architecture 'gpt5'"):
        make_model(tmp_path / "x", arch="gpt5")
