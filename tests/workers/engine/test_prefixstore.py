"""Pre-filled prefixes on disk: restored token-identical to computed ones, used only on an
exact key, never trusted when damaged, kept within their byte budget."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.prefixstore import PrefixStore
from preheat.workers.engine.scheduler import Scheduler
from tests.conftest import load_resident, new_scheduler, reference_generate, support_request

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def engine_with(store: PrefixStore | None) -> Scheduler:
    """A worker's scheduler over this prefix store: what a (re)started process has."""
    return new_scheduler(store, max_entries=4, max_bytes=256 * 1024**2)


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # full attention; sliding windows past their window
def test_a_restored_prefix_answers_token_for_token_like_a_computed_one(arch, dev_model, tmp_path):
    resident = load_resident(dev_model(arch), name=arch)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel?")
    computed = engine_with(store)
    first = computed.prefill(resident, prefix_ids, pin=True)
    store.flush()
    assert first.source == "computed" and first.prefill_ms > 0 and len(list(store.folder.iterdir())) == 1

    restarted = engine_with(store)  # a new process would hold nothing in memory
    again = restarted.prefill(resident, prefix_ids, pin=True)
    assert again.source == "restored" and again.restore_ms > 0 and again.prefill_ms == 0
    assert again.entry.nbytes == first.entry.nbytes and again.entry.truncatable == first.entry.truncatable
    for ours, theirs in zip(again.entry.payload.cache.layers, first.entry.payload.cache.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and ours.get_seq_length() == theirs.get_seq_length()
    want = computed.submit(resident, prompt_ids, GREEDY).collect()
    got = restarted.submit(resident, prompt_ids, GREEDY).collect()
    assert got.token_ids == want.token_ids and got.cached_tokens == want.cached_tokens == prefix_ids.shape[-1]
    assert restarted.prefill(resident, prefix_ids).source == "cached"


def test_only_an_exact_key_is_restored(tiny_model, tmp_path):
    resident = load_resident(tiny_model)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, _ = support_request(resident, "")
    engine_with(store).prefill(resident, prefix_ids)
    store.flush()
    assert store.restore(resident, prefix_ids[0, :-1].numpy()) is None  # other ids: another file
    assert store.restore(resident, prefix_ids[0].numpy()) is not None


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Where a tensor's bytes lie in a safetensors file (its header says)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + size])[name]["data_offsets"]
    return 8 + size + start, 8 + size + end


def rewrite(path: Path, name: str, change) -> None:
    """`change(bytes) -> bytes` of the same length, applied to one tensor's bytes in place."""
    data = bytearray(path.read_bytes())
    start, end = tensor_span(path, name)
    data[start:end] = change(bytes(data[start:end]))
    path.write_bytes(bytes(data))


def flip_bytes(raw: bytes) -> bytes:
    return raw[:64] + bytes(b ^ 0xFF for b in raw[64:320]) + raw[320:]


def flip_low_bit(raw: bytes) -> bytes:
    return raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]


def nans(raw: bytes) -> bytes:
    return np.full(len(raw) // 4, np.nan, dtype=np.float32).tobytes()


def rewritten_copy(model_dir: Path, folder: Path, change_config=None, change_weight=None) -> Path:
    """The model's folder copied, one thing in it changed with every file's size and mtime
    kept: what a new checkpoint or an edited config under the same name looks like to a
    stamp of sizes and times."""
    copy = folder / "changed"
    shutil.copytree(model_dir, copy)
    target = copy / ("config.json" if change_config else "model.safetensors")
    stat = target.stat()
    if change_config:
        target.write_text(change_config(target.read_text()))
    else:
        rewrite(target, change_weight, lambda raw: (np.frombuffer(raw, np.float32) * 1.5).astype(np.float32).tobytes())
    assert target.stat().st_size == stat.st_size
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return copy


@pytest.mark.parametrize("changed", ["weights", "config"])
def test_a_model_changed_under_the_same_file_sizes_and_times_restores_nothing(changed, tiny_model, tmp_path):
    """The model's identity is digested from its contents at load: a new checkpoint, or a
    config whose rope_theta changed, is another model however its files are stamped."""
    resident = load_resident(tiny_model)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel?")
    engine_with(store).prefill(resident, prefix_ids)
    store.flush()
    if changed == "config":
        copy = rewritten_copy(tiny_model, tmp_path, change_config=lambda text: text.replace("10000.0", "20000.0"))
    else:
        copy = rewritten_copy(tiny_model, tmp_path, change_weight="model.layers.0.self_attn.q_proj.weight")
    now = load_resident(copy)
    assert now.content_digest != resident.content_digest
    restarted = engine_with(PrefixStore(store.folder, 2**30))
    assert restarted.prefill(now, prefix_ids).source == "computed"
    answer = restarted.submit(now, prompt_ids, GREEDY).collect()
    assert answer.cached_tokens == prefix_ids.shape[-1]
    assert answer.token_ids == reference_generate(now, prompt_ids, GREEDY.max_tokens)


def test_the_same_model_in_another_folder_restores_what_it_stored(tiny_model, tmp_path):
    """Replicas mount one model at different paths: its identity is what the files hold, so
    a store shared between them serves each (and a changed copy, above, restores nothing)."""
    resident = load_resident(tiny_model)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel?")
    engine_with(store).prefill(resident, prefix_ids)
    store.flush()
    elsewhere = load_resident(shutil.copytree(tiny_model, tmp_path / "mounted" / "elsewhere"))
    assert elsewhere.path != resident.path and elsewhere.content_digest == resident.content_digest
    restarted = engine_with(PrefixStore(store.folder, 2**30))
    assert restarted.prefill(elsewhere, prefix_ids).source == "restored"
    answer = restarted.submit(elsewhere, prompt_ids, GREEDY).collect()
    assert answer.cached_tokens == prefix_ids.shape[-1]
    assert answer.token_ids == reference_generate(elsewhere, prompt_ids, GREEDY.max_tokens)


def another_models_file(tmp_path: Path, prefix_ids) -> Path:
    """The same ids pre-filled by another model of the same shapes (other weights)."""
    from preheat.cli.devmodel import make_model

    other = load_resident(make_model(tmp_path / "other-model", seed=1), name="tiny")
    store = PrefixStore(tmp_path / "other-store", 2**30)
    return store.save(other, prefix_ids[0].numpy(), engine_with(None).prefill(other, prefix_ids).entry.payload)


def layer_short_by_three(path: Path) -> None:
    """A well-formed file, its digests right, whose first layer holds 3 positions too few."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from preheat.workers.engine.prefixstore import tensor_digest

    with safe_open(str(path), framework="pt") as stored:
        metadata = stored.metadata()
        tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
    for name in ("keys.0", "values.0"):
        tensors[name] = tensors[name][:, :, 3:, :].contiguous()
        metadata[f"sha256.{name}"] = tensor_digest(tensors[name])
    save_file(tensors, str(path), metadata=metadata)


DAMAGES = {
    "truncated": lambda path, tmp, ids: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "garbage": lambda path, tmp, ids: path.write_bytes(b"\x00" * path.stat().st_size),
    "256 bytes flipped in a layer's keys": lambda path, tmp, ids: rewrite(path, "keys.1", flip_bytes),
    "one low bit flipped in a layer's values": lambda path, tmp, ids: rewrite(path, "values.2", flip_low_bit),
    "NaNs written into a layer": lambda path, tmp, ids: rewrite(path, "keys.3", nans),
    "bytes flipped in the stored logits": lambda path, tmp, ids: rewrite(path, "logits", flip_bytes),
    "a layer 3 positions short, well-formed": lambda path, tmp, ids: layer_short_by_three(path),
}


def transplant(path: Path, tmp_path: Path, prefix_ids) -> None:
    """This file's header and metadata, another model's tensors (the same shapes) after it."""
    other = another_models_file(tmp_path, prefix_ids).read_bytes()
    own = path.read_bytes()
    own_header = 8 + int.from_bytes(own[:8], "little")
    other_header = 8 + int.from_bytes(other[:8], "little")
    path.write_bytes(own[:own_header] + other[other_header:])


DAMAGES["another model's tensors under this file's name and metadata"] = transplant


@pytest.mark.parametrize("damage", [*DAMAGES, "other ids"])
def test_a_damaged_file_costs_one_log_line_and_a_normal_prefill(damage, tiny_model, tmp_path, caplog):
    """Every damage is found before the file is used: removed, one log line, the prefix
    computed, and the answer is transformers' on the current files."""
    resident = load_resident(tiny_model)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, prompt_ids = support_request(resident, "Where is my parcel?")
    engine_with(store).prefill(resident, prefix_ids)
    store.flush()
    [path] = store.folder.iterdir()
    if damage == "other ids":  # a whole, valid file, for other ids, under this key's name
        other = PrefixStore(tmp_path / "other", 2**30)
        longer = torch.cat([prefix_ids, torch.tensor([[5]])], dim=-1)
        other.save(resident, longer[0].numpy(), engine_with(None).prefill(resident, longer).entry.payload)
        path.write_bytes(next(other.folder.iterdir()).read_bytes())
    else:
        DAMAGES[damage](path, tmp_path, prefix_ids)
    restarted = engine_with(store)
    with caplog.at_level(logging.WARNING, logger="preheat.workers.engine.prefixstore"):
        prefilled = restarted.prefill(resident, prefix_ids)
    assert prefilled.source == "computed" and prefilled.prefill_ms > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "preheat.workers.engine.prefixstore"]
    assert len(lines) == 1 and "is unusable" in lines[0] and "removed; computing it" in lines[0], lines
    answer = restarted.submit(resident, prompt_ids, GREEDY).collect()
    assert answer.token_ids == reference_generate(resident, prompt_ids, GREEDY.max_tokens)
    store.flush()
    assert store.restore(resident, prefix_ids[0].numpy()) is not None  # stored again, whole


def test_the_store_keeps_to_its_byte_budget_least_recently_used_first(tiny_model, tmp_path):
    resident = load_resident(tiny_model)
    prefixes = [support_request(resident, f"question {i}")[1] for i in range(3)]
    engine = engine_with(None)
    payloads = [engine.prefill(resident, ids).entry.payload for ids in prefixes]
    probe = PrefixStore(tmp_path / "probe", 2**30)
    size = probe.save(resident, prefixes[0][0].numpy(), payloads[0]).stat().st_size
    store = PrefixStore(tmp_path / "prefixes", 2 * size + size // 2)  # room for two
    first = store.save(resident, prefixes[0][0].numpy(), payloads[0])
    second = store.save(resident, prefixes[1][0].numpy(), payloads[1])
    os.utime(first, ns=(1, 1))
    os.utime(second, ns=(2, 2))
    assert store.restore(resident, prefixes[0][0].numpy()) is not None  # touched: now the most recent
    third = store.save(resident, prefixes[2][0].numpy(), payloads[2])
    assert sorted(p.name for p in store.folder.iterdir()) == sorted([first.name, third.name])
    assert store.nbytes() <= store.max_bytes
    tiny = PrefixStore(tmp_path / "tiny", size // 2)
    assert tiny.save(resident, prefixes[0][0].numpy(), payloads[0]) is not None
    assert list(tiny.folder.glob("*.safetensors")) == []  # larger than the whole budget: not kept
    assert not list(store.folder.glob(".*.tmp"))  # written under a temporary name, then renamed
