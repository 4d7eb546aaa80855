"""Pre-filled prefixes on disk: restored token-identical to computed ones, used only on an
exact key, never trusted when damaged, kept within their byte budget."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from tests.conftest import load_resident, new_scheduler, support_request
from workers.prefixstore import PrefixStore
from workers.sampling import SamplingParams
from workers.scheduler import Scheduler

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
    # The model's files changed (a new checkpoint under the same name): nothing is restored.
    weights = next(p for p in tiny_model.iterdir() if p.suffix == ".safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert PrefixStore(store.folder, 2**30).restore(resident, prefix_ids[0].numpy()) is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other ids"])
def test_a_damaged_file_costs_one_log_line_and_a_normal_prefill(damage, tiny_model, tmp_path, caplog):
    resident = load_resident(tiny_model)
    store = PrefixStore(tmp_path / "prefixes", 2**30)
    prefix_ids, _ = support_request(resident, "")
    engine_with(store).prefill(resident, prefix_ids)
    store.flush()
    [path] = store.folder.iterdir()
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * len(data))
    else:  # a whole, valid file, for other ids, under this key's name
        other = PrefixStore(tmp_path / "other", 2**30)
        other.save(
            resident,
            np.concatenate([prefix_ids[0].numpy(), [5]]),
            engine_with(None).prefill(resident, torch.cat([prefix_ids, torch.tensor([[5]])], dim=-1)).entry.payload,
        )
        path.write_bytes(next(other.folder.iterdir()).read_bytes())
    with caplog.at_level(logging.WARNING, logger="workers.prefixstore"):
        prefilled = engine_with(store).prefill(resident, prefix_ids)
    assert prefilled.source == "computed" and prefilled.prefill_ms > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.prefixstore"]
    assert len(lines) == 1 and "is unusable" in lines[0] and "removed; computing it" in lines[0]
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
