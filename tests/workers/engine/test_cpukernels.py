"""preheat's bf16 CPU kernels (preheat.workers.engine.cpukernels) against torch on the same bf16
values. The matrix-vector kernel: the products are exact in float32 either way, so only the
order of the float32 sums differs. Lengths that are not whole runs of the kernel's loops (not a multiple of 128
columns, nor of 32) included, and the torch path it takes where it cannot be built. The
attention kernel: against torch's SDPA in float32 on the same bf16 values, within the
rounding of its bf16 output, for grouped and plain heads and the real model's sizes. The LoRA
kernel: each token through its own adapter's columns, against the same products in float64
over a mask of those columns."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from preheat.workers.engine import cpukernels

CPUINFO = Path("/proc/cpuinfo").read_text()
SHAPES = [(1, 1), (7, 33), (8, 32), (9, 64), (3, 200), (192, 576), (17, 1536), (1000, 577)]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.double() @ x.reshape(-1).double()).float()


def _close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    # float32 sums of K exact products, in another order: within K float32 roundings of the
    # sum of magnitudes.
    bound = (weight.double().abs() @ x.reshape(-1).double().abs()).float() * weight.shape[1] * 2**-23
    difference = (got.reshape(-1) - _reference(x, weight)).abs()
    assert bool((difference <= bound + 1e-30).all()), (difference - bound).max()


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize("rows,length", SHAPES)
def test_the_kernel_gives_torchs_products(rows, length):
    generator = torch.Generator().manual_seed(rows * 1000 + length)
    weight = torch.randn(rows, length, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 1, length, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        got = torch.ops.preheat.matvec_bf16(x, weight)
    assert got.shape == (1, 1, rows) and got.dtype == torch.float32
    _close(got, x, weight)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
def test_fetching_a_rows_weights_ahead_or_not_gives_the_same_sums():
    """Whether one-row products fetch ahead depends on the CPU (a speed, never an answer):
    either way the same float32 sums, bit for bit."""
    module = cpukernels._built()[0]
    chosen = module.ahead_rows()
    amd_family_19h = "AuthenticAMD" in CPUINFO and "\ncpu family\t: 25\n" in CPUINFO  # Zen 3 and Zen 4
    assert chosen == (0 if amd_family_19h else module.AHEAD_ROWS)
    weight = torch.randn(1000, 577, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    x = torch.randn(1, 1, 577, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    try:
        sums = []
        for rows in (0, module.AHEAD_ROWS):
            assert module.ahead_rows(rows) == rows
            sums.append(torch.ops.preheat.matvec_bf16(x, weight))
    finally:
        module.ahead_rows(chosen)
    assert torch.equal(sums[0], sums[1])
    with pytest.raises(ValueError, match=f"rows must be 0 or {module.AHEAD_ROWS}"):
        module.ahead_rows(3)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
def test_a_weight_that_is_a_view_is_read_as_its_values():
    """A transposed (not contiguous) weight is read by its values, not its storage's order."""
    base = torch.randn(64, 40).to(torch.bfloat16)
    weight, x = base.t(), torch.randn(1, 1, 64).to(torch.bfloat16)
    _close(torch.ops.preheat.matvec_bf16(x, weight), x, weight)


def test_where_the_kernel_cannot_be_built_torch_computes_the_same_products(monkeypatch, caplog):
    monkeypatch.setattr(cpukernels, "_built", lambda kit=None: (None, "the CPU lacks avx512_bf16"))
    weight, x = torch.randn(19, 70).to(torch.bfloat16), torch.randn(1, 1, 70).to(torch.bfloat16)
    with caplog.at_level("WARNING"):
        got = torch.ops.preheat.matvec_bf16(x, weight)
    _close(got, x, weight)
    assert not cpukernels.available() and cpukernels.why_not_built() == "the CPU lacks avx512_bf16"


def test_without_pythons_headers_the_kernel_is_not_built_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(cpukernels, "cpu_flags", lambda: set(cpukernels.BF16.needs))
    monkeypatch.setattr(cpukernels.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(cpukernels.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert cpukernels._build() == (None, f"no Python headers in {tmp_path} (apt-get install python3-dev)")


@pytest.mark.parametrize(
    "x,weight",
    [
        (torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),  # two rows
        (torch.zeros(1, 1, 8), torch.zeros(4, 8, dtype=torch.bfloat16)),  # a float32 row
        (torch.zeros(1, 1, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16)),  # lengths differ
    ],
)
def test_what_the_kernel_does_not_compute_is_refused(x, weight):
    with pytest.raises(ValueError, match="matvec_bf16"):
        torch.ops.preheat.matvec_bf16(x, weight)


def _sdpa_float32(query, keys, values, columns, scale):
    k, v = keys[None, :, :columns].float(), values[None, :, :columns].float()
    seen = torch.nn.functional.scaled_dot_product_attention(query.float(), k, v, scale=scale, enable_gqa=True)
    return seen.transpose(1, 2)


def _within_bf16(got, expected) -> bool:
    # bf16 keeps 8 bits: the output within half an ulp of float32's, and a little for the sums
    return bool(((got.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all())


# (heads, kv_heads, head_dim, columns, capacity): the real model's (9 over 3, 64), a longer
# context, Llama's 128 with 4 heads a group, plain heads, one column, columns not a multiple of 16
ATTENTION = [(9, 3, 64, 64, 80), (9, 3, 64, 1024, 1100), (32, 8, 128, 17, 40), (4, 4, 32, 1, 8), (6, 2, 96, 33, 33)]


def _bf16(*shape, generator):
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize("heads,kv_heads,head_dim,columns,capacity", ATTENTION)
def test_a_lone_querys_attention_is_torchs_within_its_bf16_rounding(heads, kv_heads, head_dim, columns, capacity):
    generator = torch.Generator().manual_seed(heads * 7 + columns)
    query = _bf16(1, heads, 1, head_dim, generator=generator)
    keys, values = (_bf16(2, kv_heads, capacity, head_dim, generator=generator) for _ in range(2))
    keys[1, :, columns:] = values[1, :, columns:] = 1e4  # past the row's columns, and the other slot: never read
    keys[0], values[0] = 1e4, 1e4
    rows = torch.tensor([[0, 1, columns]])
    with torch.inference_mode():
        got = cpukernels.attend_rows(query, keys, values, rows, columns, head_dim**-0.5)
    assert got.shape == (1, 1, heads, head_dim) and got.dtype == torch.bfloat16
    assert _within_bf16(got, _sdpa_float32(query, keys[1], values[1], columns, head_dim**-0.5))


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
def test_a_batchs_rows_each_attend_to_their_own_slot_and_leave_other_tokens_alone():
    """Five packed tokens: rows at tokens 4, 0 and 2 (slots 2, 0, 1, each its own columns);
    tokens 1 and 3 (a pre-fill chunk's) are the caller's and keep what they held."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = 9, 3, 64
    query = _bf16(1, heads, 5, head_dim, generator=generator)
    keys, values = (_bf16(3, kv_heads, 50, head_dim, generator=generator) for _ in range(2))
    rows = torch.tensor([[4, 2, 50], [0, 0, 7], [2, 1, 1]])
    out = torch.full((1, 5, heads, head_dim), 3.0, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert cpukernels.attend_rows(query, keys, values, rows, 50, 0.125, out) is out
    for token, slot, columns in rows.tolist():
        expected = _sdpa_float32(query[:, :, token : token + 1], keys[slot], values[slot], columns, 0.125)
        assert _within_bf16(out[:, token : token + 1], expected), (token, slot)
    assert bool((out[:, [1, 3]] == 3.0).all())


def test_what_the_attention_kernel_does_not_compute_is_left_to_torch():
    query = torch.randn(1, 4, 1, 48).to(torch.bfloat16)  # a head size not a multiple of 32
    keys, rows = torch.randn(1, 2, 8, 48).to(torch.bfloat16), torch.tensor([[0, 0, 8]])
    assert cpukernels.attend_rows(query, keys, keys, rows, 8, 1.0) is None
    assert cpukernels.attend_rows(query.float(), keys.float(), keys.float(), rows, 8, 1.0) is None


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize(
    "row,most",
    [((0, 0, 0), 8), ((0, 0, 9), 9), ((0, 0, 8), 7), ((0, 2, 4), 8), ((1, 0, 4), 8), ((-1, 0, 4), 8)],
    ids=["no columns", "past the slot", "past the scratch", "no such slot", "no such token", "a negative token"],
)
def test_a_row_outside_the_buffers_is_refused(row, most):
    query, keys = torch.randn(1, 4, 1, 32).to(torch.bfloat16), torch.randn(2, 2, 8, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="attention row 0"):
        cpukernels.attend_rows(query, keys, keys, torch.tensor([row]), most, 1.0)


def _lora_reference(x, y, a, b, columns):
    where = torch.arange(a.shape[0])
    first, rank = columns[:, :1], columns[:, 1:]
    mask = ((where >= first) & (where < first + rank)).double()
    delta = (x.reshape(columns.shape[0], -1).double() @ a.double().t()) * mask @ b.double()
    return y.reshape(delta.shape).double() + delta


# (tokens, in, out, ranks stacked, each token's adapter by index or None for the base): one
# token, the real model's k_proj and down_proj over four adapters, sizes that are not whole
# vectors (ranks 3 and 17, 70 in, 33 out), a pre-fill chunk of one adapter, a rank of 64.
LORA = [
    (1, 576, 576, [16], [0]),
    (16, 576, 192, [16, 8, 16, 4], [0, 1, 2, 3, None]),
    (16, 1536, 576, [16, 16, 16, 16], [3, 2, 1, 0]),
    (5, 70, 33, [3, 17], [1, None, 0]),
    (64, 576, 1536, [16], [0]),
    (3, 96, 96, [64, 2], [0, 1, None]),
]


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize("stacks", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,in_len,out_len,ranks,chosen", LORA)
def test_each_token_gets_its_own_adapters_products_and_no_others(dtype, stacks, tokens, in_len, out_len, ranks, chosen):
    generator = torch.Generator().manual_seed(tokens * 7 + in_len)
    firsts = [sum(ranks[:i]) for i in range(len(ranks))]
    picks = [chosen[t % len(chosen)] for t in range(tokens)]
    columns = torch.tensor([[0, 0] if i is None else [firsts[i], ranks[i]] for i in picks])
    x = torch.randn(1, tokens, in_len, generator=generator).to(dtype)
    y = torch.randn(1, tokens, out_len, generator=generator).to(dtype)
    a = (torch.randn(sum(ranks), in_len, generator=generator) * 0.1).to(stacks)
    b = (torch.randn(sum(ranks), out_len, generator=generator) * 0.1).to(stacks)
    got = torch.ops.preheat.lora_add(x, y, a, b, columns)
    assert got.shape == y.shape and got.dtype == dtype
    expected = _lora_reference(x, y, a, b, columns)
    # float32 sums in another order; bf16 output rounded once (half an ulp of its 8 bits)
    bound = 1e-4 if dtype == torch.float32 else 2**-8
    assert bool(((got.reshape(expected.shape).double() - expected).abs() <= expected.abs() * bound + 1e-4).all())
    base = [t for t, i in enumerate(picks) if i is None]
    assert torch.equal(got[0, base], y[0, base])  # the base's tokens untouched
    into = y.clone()  # in place, as the linear layer's own op adds them (preheat::packed_linear_lora)
    assert cpukernels.lora_add(x, into, a, b, columns, out=into) is into and torch.equal(into, got)


def test_where_the_kernel_cannot_be_built_torch_adds_the_same_adapters(monkeypatch, caplog):
    monkeypatch.setattr(cpukernels, "_built", lambda kit=None: (None, "the CPU lacks avx512_bf16"))
    x, y = torch.randn(1, 3, 40), torch.randn(1, 3, 24)
    a, b, columns = torch.randn(6, 40), torch.randn(6, 24), torch.tensor([[0, 2], [2, 4], [0, 0]])
    with caplog.at_level("WARNING"):
        got = torch.ops.preheat.lora_add(x, y, a, b, columns)
    assert torch.allclose(got.reshape(3, 24).double(), _lora_reference(x, y, a, b, columns), atol=1e-4)
    assert "LoRA adapters' products run through torch" in caplog.text
    into = y.clone()  # in place too, as preheat::packed_linear_lora asks for it
    assert cpukernels.lora_add(x, into, a, b, columns, out=into) is into and torch.equal(into, got)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
@pytest.mark.parametrize("pair", [[-1, 2], [5, 2], [0, 7], [2, -1]], ids=["before", "past", "too wide", "negative"])
def test_a_tokens_columns_outside_the_stacks_are_refused(pair):
    x, y, a, b = torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(6, 8), torch.randn(6, 4)
    with pytest.raises(ValueError, match="token 1's adapter columns"):
        torch.ops.preheat.lora_add(x, y, a, b, torch.tensor([[0, 2], pair]))


@pytest.mark.parametrize(
    "x,y,a,b,columns",
    [
        (torch.zeros(1, 2, 8), torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.zeros(6, 8), torch.zeros(6, 4),
         torch.zeros(2, 2, dtype=torch.int64)),  # x and y of two dtypes
        (torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(6, 9), torch.zeros(6, 4),
         torch.zeros(2, 2, dtype=torch.int64)),  # a not x's length
        (torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(6, 8), torch.zeros(6, 4),
         torch.zeros(3, 2, dtype=torch.int64)),  # a column pair per token, not more
        (torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(6, 8), torch.zeros(6, 4),
         torch.zeros(2, 2, dtype=torch.int32)),  # int32 columns
        (torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(6, 8), torch.zeros(6, 4, dtype=torch.bfloat16),
         torch.zeros(2, 2, dtype=torch.int64)),  # stacks of two dtypes
    ],
)  # fmt: skip
def test_what_the_lora_kernel_does_not_compute_is_refused(x, y, a, b, columns):
    with pytest.raises(ValueError, match="lora_add takes"):
        torch.ops.preheat.lora_add(x, y, a, b, columns)


@pytest.mark.parametrize(
    "out",
    [torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 5), torch.zeros(1, 4, 2).transpose(1, 2)],
    ids=["dtype", "shape", "strided"],
)
def test_an_output_that_is_not_ys_like_is_refused(out):
    x, y, a, b = torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.zeros(6, 8), torch.zeros(6, 4)
    with pytest.raises(ValueError, match="lora_add takes"):
        cpukernels.lora_add(x, y, a, b, torch.zeros(2, 2, dtype=torch.int64), out=out)


@pytest.mark.skipif(not cpukernels.available(), reason=f"kernel not built here: {cpukernels.why_not_built()}")
def test_the_kernels_are_kept_built_and_a_damaged_kept_build_is_built_again(monkeypatch, tmp_path, caplog):
    """A process keeps its build (file and digest) for the next, which loads it without a
    compiler; a kept file whose bytes no longer match its digest is built again, never loaded."""
    monkeypatch.setattr(cpukernels, "KEPT", tmp_path)
    module, why = cpukernels._build()
    assert why is None and module is not None
    (kept,) = tmp_path.glob("*.so")
    digest = kept.with_suffix("").with_suffix(".sha256")
    assert digest.read_text() == hashlib.sha256(kept.read_bytes()).hexdigest()
    built = []
    real_run = cpukernels.subprocess.run
    monkeypatch.setattr(cpukernels.subprocess, "run", lambda args, **kw: built.append(args) or real_run(args, **kw))
    assert cpukernels._build()[0] is not None
    assert all("-o" not in args for args in built)  # loaded as kept: only the compiler's version asked
    # Damaged between two processes (a new file in its place: this process has the old one mapped)
    damaged = tmp_path / "damaged"
    damaged.write_bytes(kept.read_bytes()[:-64] + bytes(64))
    damaged.replace(kept)
    with caplog.at_level("WARNING"):
        module, why = cpukernels._build()
    assert why is None and module is not None and any("-o" in args for args in built)
    assert "do not match their digest: built again" in caplog.text
    assert digest.read_text() == hashlib.sha256(kept.read_bytes()).hexdigest()  # kept whole again


def test_a_folder_that_cannot_keep_the_kernels_costs_a_build_not_the_kernels(monkeypatch, tmp_path):
    if not cpukernels.available():
        pytest.skip(f"kernel not built here: {cpukernels.why_not_built()}")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(cpukernels, "KEPT", blocked / "kernels")
    module, why = cpukernels._build()
    assert why is None and module is not None
