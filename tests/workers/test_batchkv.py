"""The batch's KV bookkeeping, without a model: padding, alignment, rows in and out."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from workers.batchkv import BatchKV, GrowingLayer, batchable

WINDOW = 4  # a sliding layer holds window - 1 = 3 positions


def row_cache(length: int, fill: float) -> DynamicCache:
    """A request's cache: one full layer and one sliding layer, every value `fill` + position."""
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=WINDOW)]
    positions = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 2, length, 3)
    for layer in cache.layers:
        layer.update(positions + fill, -(positions + fill))
    return cache


def test_rows_of_different_lengths_are_right_aligned_over_zeros():
    batch = BatchKV.like(row_cache(1, 0))
    assert batch.add(row_cache(2, 100), 2) == 0
    assert batch.add(row_cache(5, 200), 5) == 1
    full, sliding = batch.cache.layers
    assert full.keys.shape == (2, 2, 5, 3) and sliding.keys.shape == (2, 2, 3, 3)
    assert full.keys[0, 0, :, 0].tolist() == [0, 0, 0, 100, 101]
    assert full.keys[1, 0, :, 0].tolist() == [200, 201, 202, 203, 204]
    assert sliding.keys[0, 0, :, 0].tolist() == [0, 100, 101]
    assert sliding.keys[1, 0, :, 0].tolist() == [202, 203, 204]
    assert sliding.cumulative_length == 5 == batch.width
    assert full.values[1, 0, :, 0].tolist() == [-200, -201, -202, -203, -204]


def test_step_inputs_mask_each_rows_padding_and_place_it_at_its_own_position():
    batch = BatchKV.like(row_cache(1, 0))
    batch.add(row_cache(2, 0), 2)
    batch.add(row_cache(4, 0), 4)
    inputs = batch.step_inputs([7, 9])
    assert inputs["input_ids"].tolist() == [[7], [9]]
    assert inputs["position_ids"].tolist() == [[2], [4]]
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    batch.stepped()
    assert batch.lengths == [3, 5] and batch.width == 5


def test_a_row_taken_out_is_its_own_kv_exactly():
    batch = BatchKV.like(row_cache(1, 0))
    batch.add(row_cache(2, 100), 2)
    batch.add(row_cache(6, 200), 6)
    alone = batch.row(0)
    original = row_cache(2, 100)
    for mine, theirs in zip(alone.layers, original.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        assert mine.keys.untyped_storage().nbytes() == mine.keys.numel() * mine.keys.element_size()
    assert alone.layers[1].cumulative_length == 2


def test_keeping_rows_drops_columns_nobody_needs():
    batch = BatchKV.like(row_cache(1, 0))
    for length, fill in ((3, 100), (8, 200), (2, 300)):
        batch.add(row_cache(length, fill), length)
    batch.keep([2, 0])  # the longest row left, order changed
    full, sliding = batch.cache.layers
    assert batch.lengths == [2, 3] and batch.width == 3
    assert full.keys.shape == (2, 2, 3, 3)
    assert full.keys[0, 0, :, 0].tolist() == [0, 300, 301]
    assert full.keys[1, 0, :, 0].tolist() == [100, 101, 102]
    assert sliding.keys.shape == (2, 2, 3, 3) and sliding.cumulative_length == 3
    batch.keep([])
    assert len(batch) == 0 and batch.width == 0 and batch.nbytes == 0


def test_a_longer_row_joining_pads_the_others_further():
    batch = BatchKV.like(row_cache(1, 0))
    batch.add(row_cache(2, 100), 2)
    batch.add(row_cache(5, 200), 5)
    assert batch.cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 0, 0, 100, 101]
    assert batch.nbytes == 2 * (2 * 2 * 5 * 3 + 2 * 2 * 3 * 3) * 4  # exact: keys and values, both layers


def test_a_failed_step_is_undone_by_its_snapshot():
    batch = BatchKV.like(row_cache(1, 0))
    batch.add(row_cache(3, 0), 3)
    before = batch.snapshot()
    for layer in batch.cache.layers:
        layer.update(torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3))  # a step half-way
    batch.restore(before)
    assert batch.cache.layers[0].keys.shape[-2] == 3 and batch.cache.layers[1].cumulative_length == 3


def test_only_caches_that_grow_by_concatenation_are_batched():
    class Quantized(DynamicLayer):
        pass

    cache = row_cache(2, 0)
    assert batchable(cache)
    cache.layers[0] = Quantized()
    assert not batchable(cache)
    with pytest.raises(TypeError, match="concatenation"):
        BatchKV.like(cache)


def test_a_step_writes_one_column_in_place_and_a_row_leaves_as_a_plain_layer():
    batch = BatchKV.like(row_cache(1, 0))
    batch.add(row_cache(3, 100), 3)
    full = batch.cache.layers[0]
    assert isinstance(full, GrowingLayer) and type(batch.cache.layers[1]) is DynamicSlidingWindowLayer
    storages = set()
    for step in range(5):
        column = torch.full((1, 2, 1, 3), 500.0 + step)
        keys, values = full.update(column, -column)
        assert torch.equal(values[..., -1:, :], -column)
        storages.add(keys.untyped_storage().data_ptr())
        assert keys.shape == (1, 2, 4 + step, 3) and torch.equal(keys[..., -1:, :], column)
    assert len(storages) == 1  # one buffer: no step copied the layer
    assert full.keys[0, 0, :, 0].tolist() == [100, 101, 102, 500, 501, 502, 503, 504]
    batch.lengths, batch.width = [8], 8
    alone = batch.row(0)
    assert type(alone.layers[0]) is DynamicLayer and batchable(alone)
    assert alone.layers[0].keys[0, 0, :, 0].tolist() == [100, 101, 102, 500, 501, 502, 503, 504]
    batch.add(row_cache(2, 700), 2)  # a new row: the layer's tensors are replaced, its next step re-buffers
    keys, _ = full.update(torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3))
    assert keys[1, 0, :, 0].tolist() == [0, 0, 0, 0, 0, 0, 700, 701, 0]
