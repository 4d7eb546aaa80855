"""One row's linear layers in bfloat16 on the CPU: a matrix-vector kernel of bf16 dot products.

A single user's decode step reads every weight once for one row, so its speed is the speed
at which its linear layers stream their weights. In bfloat16, the loops inductor writes for
them (a float32 multiply-add per weight, after widening it) stream at half the memory's
speed here (measured on 2 cores of a Sapphire Rapids: 15.5 GB/s, against 28.3 GB/s for a
float32 sum). This kernel multiplies bf16 pairs with the CPU's own instruction
(`vdpbf16ps`, AVX512-BF16: exact products, float32 sums; llama.cpp's BF16 dot product uses
it too), eight weight rows at a time with the next rows prefetched: 28.6-31.4 GB/s on the
same host, and the real model's one-row step went from 22.3 to 15.2 ms.

The kernel is C, built by the machine's C compiler once per process into a folder of its
own (a fifth of a second) and loaded from there: never a library read back from disk. It
runs on torch's OpenMP threads (the process's libgomp, which inductor's kernels use too).
The op `preheat::matvec_bf16` is what a compiled one-token graph calls
(preheat.workers.engine.compiled); where the kernel cannot be built, it computes the same
products with torch, slower, and says why once.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from preheat.workers.engine.device import cpu_flags

log = logging.getLogger(__name__)

# What the kernel's instructions need of the CPU (AVX512-BF16 and the AVX-512 it extends).
NEEDS = ("avx512f", "avx512bw", "avx512_bf16")
ROWS = 8  # weight rows a thread reads together: eight independent sums hide the latency

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* y[n] = sum_k w[n, k] * x[k]: w [n_rows, k_len] bf16 row-major, x [k_len] bf16, y float32. */
void matvec_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t n_rows, int64_t k_len) {
    const int64_t full = k_len / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ULL << (k_len - full)) - 1);
    const int64_t blocks = (n_rows + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b * ROWS;
        const int rows = n_rows - n < ROWS ? (int)(n_rows - n) : ROWS;
        const uint16_t *w0 = w + n * k_len;
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        if (rows == ROWS) {
            for (int64_t k = 0; k < full; k += 32) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
                #pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    /* the same column of this row, ROWS rows on: what the next block reads */
                    _mm_prefetch((const char *)(w0 + (r + ROWS) * k_len + k), _MM_HINT_T0);
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w0 + r * k_len + k), xv);
                }
            }
        } else {
            for (int r = 0; r < rows; r++)
                for (int64_t k = 0; k < full; k += 32)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w0 + r * k_len + k),
                                              (__m512bh)_mm512_loadu_si512(x + k));
        }
        if (full < k_len) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + r * k_len + full), xv);
        }
        for (int r = 0; r < rows; r++) y[n + r] = _mm512_reduce_add_ps(acc[r]);
    }
}
"""

_BUILD_LOCK = threading.Lock()
_BUILT: list[tuple[object | None, str | None]] = []


def why_not_built() -> str | None:
    """Why this machine cannot run the kernel, or None when it can (it is then built)."""
    return _built()[1]


def available() -> bool:
    return _built()[0] is not None


def _built() -> tuple[object | None, str | None]:
    """(the kernel, None) or (None, why not): built once a process, by the first call (two
    threads' first calls build it once; later calls, a step's, take no lock)."""
    if not _BUILT:
        with _BUILD_LOCK:
            if not _BUILT:
                _BUILT.append(_build())
    return _BUILT[0]


def _build() -> tuple[object | None, str | None]:
    if missing := [flag for flag in NEEDS if flag not in cpu_flags()]:
        return None, f"the CPU lacks {', '.join(missing)}"
    compiler = next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)
    if compiler is None:
        return None, "no C compiler on this machine"
    folder = Path(tempfile.mkdtemp(prefix="preheat-matvec-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "matvec.c").write_text(SOURCE)
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC", f"-DROWS={ROWS}"]
    done = subprocess.run(
        [compiler, *flags, "matvec.c", "-o", "matvec.so"], cwd=folder, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        return None, f"the kernel did not build ({compiler}: {first})"
    # torch is loaded, so the library's libgomp is torch's: one OpenMP runtime in the process.
    # PyDLL: the call holds the GIL, as inductor's kernels do (a Python thread let run meanwhile
    # would take a core from the kernel's threads; measured no faster with the GIL released).
    kernel = ctypes.PyDLL(str(folder / "matvec.so")).matvec_bf16
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    kernel.restype = None
    return kernel, None


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight @ x` for one row `x` ([..., 1, K], bfloat16) and `weight` ([N, K], bfloat16),
    in float32: [..., 1, N]."""
    one_row = x.numel() == x.shape[-1] and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
    if not one_row or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"matvec_bf16 takes one bf16 row and bf16 weights of its length, "
            f"got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    kernel = _built()[0]
    if kernel is None:
        _fallback_once(why_not_built())
        return torch.mv(weight.float(), x.reshape(-1).float()).view(out.shape)
    x, weight = x.contiguous(), weight.contiguous()
    kernel(weight.data_ptr(), x.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1])
    return out


@functools.cache
def _fallback_once(reason: str | None) -> None:
    log.warning("bf16 one-row products run through torch, slower: %s", reason)


# Registered with torch.library's lower-level API, not `custom_op`: a step calls it once per
# linear layer (211 times on the real model), and `custom_op` adds about 2 µs a call (its
# aliasing check), measured on 2 cores.
_LIBRARY = torch.library.Library("preheat", "FRAGMENT")
_LIBRARY.define("matvec_bf16(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("matvec_bf16", matvec, "CPU")


@torch.library.register_fake("preheat::matvec_bf16")
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
