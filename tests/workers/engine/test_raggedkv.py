"""The running rows' KV bookkeeping and their attention, without a model: slots, columns,
windows, rows in and out, and each fed position attending to its own row only."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from preheat.workers.engine import cpukernels
from preheat.workers.engine.raggedkv import Layout, RaggedKV, Segment, attention, batchable

WINDOW = 4  # a sliding layer holds window - 1 = 3 positions
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 3


def shell() -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=WINDOW)]
    return cache


def row_cache(length: int, fill: float) -> DynamicCache:
    """A request's cache: one full layer and one sliding layer, every value `fill` + position."""
    cache = shell()
    positions = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, KV_HEADS, length, HEAD_DIM)
    for layer in cache.layers:
        layer.update(positions + fill, -(positions + fill))
    return cache


def held(kv: RaggedKV, layer: int, slot: int) -> list[float]:
    """The positions (values less the row's fill) a row holds on a layer, in column order."""
    return kv.buffers[layer][0][slot, 0, : kv.columns(slot, kv.windows[layer]), 0].tolist()


def test_a_row_joins_at_the_left_of_its_slot_and_a_sliding_layer_from_its_window():
    kv = RaggedKV(shell(), torch.device("cpu"))
    assert kv.add(row_cache(6, 0.0)) == 0 and kv.add(row_cache(2, 100.0)) == 1 and kv.add(None) == 2
    assert kv.lengths == [6, 2, 0] and kv.offsets == [3, 0, 0]  # row 0's window: positions 3, 4, 5
    assert held(kv, 0, 0) == [0, 1, 2, 3, 4, 5] and held(kv, 1, 0) == [3, 4, 5]
    assert held(kv, 0, 1) == [100, 101] and held(kv, 1, 1) == [100, 101] and held(kv, 0, 2) == []


def test_a_step_writes_each_rows_ids_at_its_own_columns():
    kv = RaggedKV(shell(), torch.device("cpu"))
    kv.add(row_cache(6, 0.0))
    kv.add(row_cache(2, 100.0))
    segments = [Segment(0, 6, (7,)), Segment(1, 2, (7, 7, 7))]
    inputs = kv.step_inputs(segments)
    assert inputs["input_ids"].tolist() == [[7, 7, 7, 7]]
    assert inputs["position_ids"].tolist() == [[6, 2, 3, 4]]
    assert inputs["logits_to_keep"].tolist() == [0, 3]  # each segment's last id
    new = torch.tensor([6.0, 102.0, 103.0, 104.0]).view(1, 1, 4, 1).expand(1, KV_HEADS, 4, HEAD_DIM)
    with torch.inference_mode():  # as in the model's pass
        for layer in range(2):
            kv.update(new, -new, layer)
    kv.stepped()
    assert kv.lengths == [7, 5]
    assert held(kv, 0, 0) == [0, 1, 2, 3, 4, 5, 6] and held(kv, 1, 0) == [3, 4, 5, 6]
    assert held(kv, 0, 1) == [100, 101, 102, 103, 104] == held(kv, 1, 1)


def test_each_fed_position_sees_its_own_row_up_to_itself_and_a_sliding_layer_its_window():
    kv = RaggedKV(shell(), torch.device("cpu"))
    kv.add(row_cache(6, 0.0))
    kv.add(row_cache(2, 100.0))
    kv.add(None)
    kv.lengths[0] = 7  # a step later: row 0 holds 0..6 (3..6 on the sliding layer)
    layout = Layout(kv, [Segment(0, 7, (7,)), Segment(1, 2, (7, 7))])  # row 2 pre-fills later
    decode, columns = layout.decode_mask(None)
    assert columns == 8 and decode[:, 0, 0].int().tolist() == [[1] * 8, [1] + [0] * 7, [1] + [0] * 7]
    window, columns = layout.decode_mask(WINDOW)  # 3..6 held, 7 fed: 7 sees 4..7
    assert columns == 5 and window[0, 0, 0].int().tolist() == [0, 1, 1, 1, 1]
    chunk, columns = layout.chunk_mask(1, None)
    assert columns == 4 and chunk[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(HEAD_DIM, torch.float32), (64, torch.bfloat16)], ids=["float32", "bfloat16"]
)
def test_the_rows_attention_is_each_rows_own_causal_attention(head_dim, dtype, monkeypatch):
    """Against torch's causal SDPA on each row's whole sequence (float32), on full and sliding
    layers: two decoding rows beside two pre-fill chunks. In bfloat16 with a head size of 64,
    the decoding rows of the full layer are preheat's kernel's, where it runs (within bf16's
    rounding, as the chunks' bf16 SDPA)."""
    kernel_calls = []
    attend_rows = cpukernels.attend_rows
    monkeypatch.setattr(cpukernels, "attend_rows", lambda *a: kernel_calls.append(attend_rows(*a)) or kernel_calls[-1])
    torch.manual_seed(0)
    lengths, feeds = [5, 0, 3, 2], [1, 4, 2, 1]
    whole = [torch.randn(1, KV_HEADS, n + f, head_dim).to(dtype) for n, f in zip(lengths, feeds, strict=True)]
    values = [torch.randn_like(k) for k in whole]
    queries = [torch.randn(1, HEADS, f, head_dim).to(dtype) for f in feeds]
    for window in (None, WINDOW):
        kv = RaggedKV(shell(), torch.device("cpu"))
        for k, v, n in zip(whole, values, lengths, strict=True):
            cache = shell()
            if n:
                for layer in cache.layers:
                    layer.update(k[:, :, :n], v[:, :, :n])
            kv.add(cache if n else None)
        segments = [Segment(i, n, (9,) * f) for i, (n, f) in enumerate(zip(lengths, feeds, strict=True))]
        kv.step_inputs(segments)
        layer = 1 if window else 0
        new_k = torch.cat([k[:, :, n:] for k, n in zip(whole, lengths, strict=True)], dim=2)
        new_v = torch.cat([v[:, :, n:] for v, n in zip(values, lengths, strict=True)], dim=2)
        with torch.inference_mode():
            keys, vals = kv.update(new_k, new_v, layer)
        got = attention(torch.cat(queries, dim=2), keys, vals, kv.layout, None, window)
        at = 0
        for k, v, q, n, f in zip(whole, values, queries, lengths, feeds, strict=True):
            seen = torch.ones(f, n + f, dtype=torch.bool).tril(n)
            if window:
                seen &= ~torch.ones(f, n + f, dtype=torch.bool).tril(n - window)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), attn_mask=seen
            )
            wide = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(got[0, at : at + f].float(), want[0].transpose(0, 1), **wide)
            at += f
    ran = [call for call in kernel_calls if call is not None]
    assert len(ran) == (1 if dtype == torch.bfloat16 and cpukernels.available() else 0)  # the full layer's rows


def test_a_row_that_leaves_gives_its_slot_to_the_last_row():
    kv = RaggedKV(shell(), torch.device("cpu"))
    for length, fill in ((6, 0.0), (2, 100.0), (4, 200.0)):
        kv.add(row_cache(length, fill))
    assert kv.remove(0) == 2  # the last row moved into slot 0
    assert kv.lengths == [4, 2] and kv.offsets == [1, 0]
    assert held(kv, 0, 0) == [200, 201, 202, 203] and held(kv, 1, 0) == [201, 202, 203]
    assert kv.remove(1) is None and kv.lengths == [4]


def test_a_row_taken_out_is_its_own_kv_as_a_plain_cache():
    kv = RaggedKV(shell(), torch.device("cpu"))
    kv.add(row_cache(2, 100.0))
    kv.add(row_cache(6, 0.0))
    alone = kv.row(1)
    want = row_cache(6, 0.0)
    assert [type(layer) for layer in alone.layers] == [DynamicLayer, DynamicSlidingWindowLayer]
    for mine, theirs in zip(alone.layers, want.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)
    assert alone.layers[1].cumulative_length == 6 and alone.get_seq_length() == 6
    assert alone.layers[0].keys.untyped_storage().data_ptr() != kv.buffers[0][0].untyped_storage().data_ptr()


def test_a_failed_step_is_undone_by_its_snapshot():
    kv = RaggedKV(shell(), torch.device("cpu"))
    kv.add(row_cache(3, 0.0))
    before = kv.snapshot()
    kv.step_inputs([Segment(0, 3, (7,))])
    kv.stepped()
    kv.restore(before)
    assert kv.lengths == [3] and kv.layout is None and held(kv, 0, 0) == [0, 1, 2]


def test_only_caches_that_grow_by_concatenation_run_together():
    cache = row_cache(2, 0.0)
    assert batchable(cache)
    cache.layers[0].__class__ = type("InPlaceLayer", (DynamicLayer,), {})
    assert not batchable(cache)
    with pytest.raises(TypeError):
        RaggedKV(cache, torch.device("cpu"))


def _a_lone_bf16_row(length: int, heads: int, kv_heads: int, head_dim: int):
    """(query, keys, values, kv): one row of `length` positions, about to decode one more."""
    k, v = (torch.randn(1, kv_heads, length + 1, head_dim, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, heads, 1, head_dim, dtype=torch.bfloat16)
    cache = shell()
    for layer in cache.layers:
        layer.update(k[:, :, :length], v[:, :, :length])
    kv = RaggedKV(shell(), torch.device("cpu"))
    kv.add(cache)
    kv.step_inputs([Segment(0, length, (9,))])
    return q, k, v, kv


@pytest.mark.parametrize(("length", "in_float32"), [(8, False), (300, True)])
def test_one_row_decoding_in_bfloat16_attends_in_float32_past_a_short_context(length, in_float32):
    """One query in bfloat16 on the CPU where preheat's kernel does not run it (here a head size
    of 3): torch's SDPA grows with the context (937 µs a layer at 1,200 columns); from
    ONE_ROW_FLOAT32_FROM (128) columns on it runs in float32 on the upcast inputs, the answer
    in bfloat16. Either way, the row's own causal attention."""
    torch.manual_seed(0)
    q, k, v, kv = _a_lone_bf16_row(length, HEADS, KV_HEADS, HEAD_DIM)
    with torch.inference_mode():
        keys, vals = kv.update(k[:, :, length:], v[:, :, length:], 0)
    got = attention(q, keys, vals, kv.layout, None)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, HEADS, HEAD_DIM)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    upcast = sdpa(q.float(), k.float(), v.float(), enable_gqa=True).to(torch.bfloat16)[0].transpose(0, 1)
    native = sdpa(q, k, v, enable_gqa=True)[0].transpose(0, 1)
    assert not torch.equal(upcast, native)  # the two ways differ here: the answer tells which ran
    torch.testing.assert_close(got[0], upcast if in_float32 else native, rtol=0, atol=0)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize("length", [1, 40])
def test_one_row_decoding_in_bfloat16_runs_preheats_kernel_on_both_layers(length):
    """A head size of 64 (the real model's): the row's attention is preheat's kernel's on the
    full layer and on the sliding layer until its window has slid, then torch's with the
    window's mask; either way within bf16's rounding of float32 attention."""
    torch.manual_seed(length)
    q, k, v, kv = _a_lone_bf16_row(length, 4, 2, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for layer, seen_from in ((0, 0), (1, max(0, length + 1 - (WINDOW - 1) - 1))):
        with torch.inference_mode():
            keys, vals = kv.update(k[:, :, length:], v[:, :, length:], layer)
        got = attention(q, keys, vals, kv.layout, 0.125, kv.windows[layer])
        ks, vs = k[:, :, seen_from:].float(), v[:, :, seen_from:].float()
        expected = sdpa(q.float(), ks, vs, scale=0.125, enable_gqa=True).transpose(1, 2)
        assert bool(((got.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()), layer
        slid = layer == 1 and length + 1 > WINDOW - 1
        kernel = cpukernels.attend_rows(q, keys, vals, torch.tensor([[0, 0, length + 1]]), length + 1, 0.125)
        assert torch.equal(got, kernel) != slid  # the kernel's answer exactly, unless the window slid
