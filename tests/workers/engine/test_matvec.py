"""preheat's bf16 matrix-vector kernel (preheat.workers.engine.matvec) against torch on the same
bf16 values: the products are exact in float32 either way, so only the order of the float32
sums differs. Lengths that are not whole runs of the kernel's loops (not a multiple of 128
columns, nor of 32) included, and the torch path it takes where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from preheat.workers.engine import matvec

SHAPES = [(1, 1), (7, 33), (8, 32), (9, 64), (3, 200), (192, 576), (17, 1536), (1000, 577)]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.double() @ x.reshape(-1).double()).float()


def _close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    # float32 sums of K exact products, in another order: within K float32 roundings of the
    # sum of magnitudes.
    bound = (weight.double().abs() @ x.reshape(-1).double().abs()).float() * weight.shape[1] * 2**-23
    difference = (got.reshape(-1) - _reference(x, weight)).abs()
    assert bool((difference <= bound + 1e-30).all()), (difference - bound).max()


@pytest.mark.skipif(not matvec.available(), reason=f"kernel not built here: {matvec.why_not_built()}")
@pytest.mark.parametrize("rows,length", SHAPES)
def test_the_kernel_gives_torchs_products(rows, length):
    generator = torch.Generator().manual_seed(rows * 1000 + length)
    weight = torch.randn(rows, length, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 1, length, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        got = torch.ops.preheat.matvec_bf16(x, weight)
    assert got.shape == (1, 1, rows) and got.dtype == torch.float32
    _close(got, x, weight)


@pytest.mark.skipif(not matvec.available(), reason=f"kernel not built here: {matvec.why_not_built()}")
def test_a_weight_that_is_a_view_is_read_as_its_values():
    """A transposed (not contiguous) weight is read by its values, not its storage's order."""
    base = torch.randn(64, 40).to(torch.bfloat16)
    weight, x = base.t(), torch.randn(1, 1, 64).to(torch.bfloat16)
    _close(torch.ops.preheat.matvec_bf16(x, weight), x, weight)


def test_where_the_kernel_cannot_be_built_torch_computes_the_same_products(monkeypatch, caplog):
    monkeypatch.setattr(matvec, "_built", lambda: (None, "the CPU lacks avx512_bf16"))
    weight, x = torch.randn(19, 70).to(torch.bfloat16), torch.randn(1, 1, 70).to(torch.bfloat16)
    with caplog.at_level("WARNING"):
        got = torch.ops.preheat.matvec_bf16(x, weight)
    _close(got, x, weight)
    assert not matvec.available() and matvec.why_not_built() == "the CPU lacks avx512_bf16"


def test_without_pythons_headers_the_kernel_is_not_built_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(matvec, "cpu_flags", lambda: set(matvec.NEEDS))
    monkeypatch.setattr(matvec.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(matvec.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert matvec._build() == (None, f"no Python headers in {tmp_path} (apt-get install python3-dev)")


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
