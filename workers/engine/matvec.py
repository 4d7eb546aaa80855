"""One row's linear layers in bfloat16 on the CPU: a matrix-vector kernel of bf16 dot products.

A single user's decode step reads every weight once for one row, so its speed is the speed
at which its linear layers stream their weights. In bfloat16, the loops inductor writes for
them (a float32 multiply-add per weight, after widening it) stream at half the memory's
speed here (measured on 2 cores of a Sapphire Rapids: 15.5 GB/s, against 28.3 GB/s for a
float32 sum). This kernel multiplies bf16 pairs with the CPU's own instruction
(`vdpbf16ps`, AVX512-BF16: exact products, float32 sums; llama.cpp's BF16 dot product uses
it too), each thread reading its rows in order. The real model's one-row step went from
22.3 to 15.2 ms on that host.

The kernel is C with a CPython entry point, built by the machine's C compiler once per
process into a folder of its own (half a second) and imported from there: never a module
read back from disk. It runs on torch's OpenMP threads (the process's libgomp, which
inductor's kernels use too). The op `preheat::matvec_bf16` is what a compiled one-token
graph calls (preheat.workers.engine.compiled); where the kernel cannot be built, it
computes the same products with torch, slower, and says why once.
"""

from __future__ import annotations

import atexit
import functools
import importlib.machinery
import importlib.util
import logging
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from preheat.workers.engine.device import cpu_flags

log = logging.getLogger(__name__)

# What the kernel's instructions need of the CPU (AVX512-BF16 and the AVX-512 it extends).
NEEDS = ("avx512f", "avx512bw", "avx512_bf16")

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>

/* y[n] = sum_k w[n, k] * x[k]: w [n_rows, k_len] bf16 row-major, x [k_len] bf16, y float32.
   A thread takes a run of whole rows and reads them in order: one stream of memory per
   thread, the pattern the CPU's prefetchers follow best (eight rows read side by side
   streamed at 15-20 GB/s on a Zen 4, one stream at 21-30). Four sums per row hide the
   instruction's latency. */
static void matvec_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t n_rows, int64_t k_len) {
    const int64_t full = k_len / 128 * 128, part = k_len / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ULL << (k_len - part)) - 1);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_rows; n++) {
        const uint16_t *row = w + n * k_len;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t k = 0;
        for (; k < full; k += 128)
            for (int i = 0; i < 4; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + k + 32 * i),
                                          (__m512bh)_mm512_loadu_si512(x + k + 32 * i));
        for (int i = 0; k < part; k += 32, i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + k),
                                      (__m512bh)_mm512_loadu_si512(x + k));
        if (part < k_len)
            acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)_mm512_maskz_loadu_epi16(tail, row + part),
                                      (__m512bh)_mm512_maskz_loadu_epi16(tail, x + part));
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
}

/* matvec_bf16(w, x, y, n_rows, k_len), addresses as ints: a module function, since a step
   makes 211 calls and ctypes' argument conversion cost 0.7 us more a call. It holds the
   GIL, as inductor's kernels do. */
static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "matvec_bf16(w, x, y, n_rows, k_len)");
        return NULL;
    }
    const void *w = PyLong_AsVoidPtr(args[0]), *x = PyLong_AsVoidPtr(args[1]);
    void *y = PyLong_AsVoidPtr(args[2]);
    const long long n_rows = PyLong_AsLongLong(args[3]), k_len = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    matvec_bf16(w, x, y, n_rows, k_len);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"matvec_bf16", (PyCFunction)(void (*)(void))call, METH_FASTCALL, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "preheat_matvec", NULL, -1, methods};
PyMODINIT_FUNC PyInit_preheat_matvec(void) { return PyModule_Create(&module); }
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
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        return None, f"no Python headers in {headers} (apt-get install python3-dev)"
    folder = Path(tempfile.mkdtemp(prefix="preheat-matvec-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "matvec.c").write_text(SOURCE)
    built = folder / f"preheat_matvec{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC", f"-I{headers}"]
    done = subprocess.run(
        [compiler, *flags, "matvec.c", "-o", built.name], cwd=folder, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        return None, f"the kernel did not build ({compiler}: {first})"
    # torch is loaded, so the module's libgomp is torch's: one OpenMP runtime in the process.
    spec = importlib.util.spec_from_file_location("preheat_matvec", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.matvec_bf16, None


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight @ x` for one row `x` ([..., 1, K], bfloat16) and `weight` ([N, K], bfloat16),
    in float32: [..., 1, N]."""
    one_row = x.numel() == x.shape[-1] and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
    if not one_row or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"matvec_bf16 takes one bf16 row and bf16 weights of its length, "
            f"got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    # torch.empty's sizes as arguments, not a tuple: 1 us less a call (211 calls a step).
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
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
