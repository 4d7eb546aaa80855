"""preheat's own CPU kernels for a single user's decode step in bfloat16: one row's linear
layers and one query's attention, with the CPU's bf16 dot product (`vdpbf16ps`, AVX512-BF16:
exact products, float32 sums; llama.cpp's BF16 dot product uses it too).

**One row's linear layers** (`matvec`, the op `preheat::matvec_bf16` a compiled one-token
graph calls: preheat.workers.engine.compiled). A single user's step reads every weight once
for one row, so its speed is the speed at which the layers stream their weights. The loops
inductor writes for them in bf16 (a float32 multiply-add per weight, after widening it)
stream at half the memory's speed (2 cores of a Sapphire Rapids: 15.5 GB/s against 28.3 for
a float32 sum); this kernel streams each thread's rows in order. The real model's one-row
step went from 22.3 to 15.2 ms on that host.

**One query's attention** (`attend_rows`, what preheat.workers.engine.raggedkv runs for a
lone decoding row, and for a batch's decoding rows on a layer without a window). torch's
SDPA for one bf16 query costs 44 µs a layer at 64 keys and 597 µs at 1,024 on a Zen 4
without AMX (2 cores), where its float32 path takes 15 and 79 µs and the casts to it cost
more than they save; a batch's rows went through a batched product with a mask, 716 µs a
layer at 16 rows. This kernel reads each row's keys and values once, in bf16, with a
float32 softmax, all rows and heads in one call.

The kernels are C with CPython entry points, built by the machine's C compiler once per
process into a folder of their own (half a second) and imported from there: never a module
read back from disk. They run on torch's OpenMP threads (the process's libgomp, which
inductor's kernels use too). Where they cannot be built, torch computes the same thing,
slower, and preheat says why once.
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

# What the kernels' instructions need of the CPU (AVX512-BF16 and the AVX-512 it extends).
NEEDS = ("avx512f", "avx512bw", "avx512_bf16")

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
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

/* exp(x) for x <= 0, 16 at a time: Cephes' expf (a degree-6 polynomial on a reduced
   argument, 2^n by scalef), within 2 float32 ulps. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* For each row r of `table` ([n_rows, 3]: token t, slot, columns) and each head h, out[t, h] =
   softmax(scale * q[h, t] . k[slot, g, j]) . v[slot, g, j] over j < columns, g = h / (heads / kv_heads):
   q [heads, tokens, head_dim], k and v [slots, kv_heads, capacity, head_dim] (the layer's
   buffers, read in place), out [tokens, heads, head_dim] bf16 (rounded to nearest even; other
   tokens untouched), scores [n_rows * heads, max_columns] float32 scratch. head_dim a multiple
   of 32, at most 256; the table checked by the caller. */
static void attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, float *scores,
                           const int64_t *table, int64_t n_rows, int64_t tokens, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t capacity, int64_t max_columns, float scale) {
    const int64_t group = heads / kv_heads, lanes = head_dim / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < n_rows * heads; pair++) {
        const int64_t *row = table + 3 * (pair / heads), h = pair % heads;
        const int64_t token = row[0], columns = row[2];
        const uint16_t *qh = q + (h * tokens + token) * head_dim;
        const int64_t at = ((row[1] * kv_heads) + h / group) * capacity * head_dim;
        const uint16_t *kh = k + at, *vh = v + at;
        uint16_t *oh = out + (token * heads + h) * head_dim;
        float *s = scores + pair * max_columns;
        float top = -INFINITY;
        for (int64_t j = 0; j < columns; j++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < head_dim; i += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kh + j * head_dim + i),
                                       (__m512bh)_mm512_loadu_si512(qh + i));
            s[j] = _mm512_reduce_add_ps(acc) * scale;
            top = s[j] > top ? s[j] : top;
        }
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < columns; j += 16) {
            const __mmask16 m = columns - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (columns - j)) - 1);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(top)));
            _mm512_mask_storeu_ps(s + j, m, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
        }
        __m512 acc[16];
        for (int64_t c = 0; c < lanes; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < columns; j++) {
            const __m512 p = _mm512_set1_ps(s[j]);
            for (int64_t c = 0; c < lanes; c++) {
                const __m256i half = _mm256_loadu_si256((const __m256i *)(vh + j * head_dim + 16 * c));
                const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
                acc[c] = _mm512_fmadd_ps(p, value, acc[c]);
            }
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t c = 0; c < lanes; c++) {
            /* float32 to bf16, rounded to nearest even (the model's own rounding) */
            const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(acc[c], inverse));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
            _mm256_storeu_si256((__m256i *)(oh + 16 * c),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
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

/* attention_bf16(q, k, v, out, scores, table, n_rows, tokens, heads, kv_heads, head_dim, capacity,
   max_columns, slots, scale): the table's rows checked against the buffers' sizes here, by value,
   since the kernel reads and writes where they point. */
static PyObject *attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "attention_bf16 takes 15 arguments");
        return NULL;
    }
    void *pointers[6];
    long long sizes[8];
    for (int i = 0; i < 6; i++) pointers[i] = PyLong_AsVoidPtr(args[i]);
    for (int i = 0; i < 8; i++) sizes[i] = PyLong_AsLongLong(args[6 + i]);
    const double scale = PyFloat_AsDouble(args[14]);
    if (PyErr_Occurred()) return NULL;
    const int64_t *table = pointers[5];
    const long long n_rows = sizes[0], tokens = sizes[1], capacity = sizes[5], max_columns = sizes[6], slots = sizes[7];
    for (long long r = 0; r < n_rows; r++) {
        const int64_t token = table[3 * r], slot = table[3 * r + 1], columns = table[3 * r + 2];
        if (token < 0 || token >= tokens || slot < 0 || slot >= slots || columns < 1 || columns > capacity ||
            columns > max_columns) {
            PyErr_Format(PyExc_ValueError, "attention row %lld (token %lld, slot %lld, %lld columns) is outside the "
                         "step's %lld tokens, %lld slots or %lld columns", r, (long long)token, (long long)slot,
                         (long long)columns, tokens, slots, max_columns < capacity ? max_columns : capacity);
            return NULL;
        }
    }
    attention_bf16(pointers[0], pointers[1], pointers[2], pointers[3], pointers[4], table, n_rows, tokens, sizes[2],
                   sizes[3], sizes[4], capacity, max_columns, (float)scale);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"matvec_bf16", (PyCFunction)(void (*)(void))call, METH_FASTCALL, NULL},
                                {"attention_bf16", (PyCFunction)(void (*)(void))attend, METH_FASTCALL, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "preheat_cpukernels", NULL, -1, methods};
PyMODINIT_FUNC PyInit_preheat_cpukernels(void) { return PyModule_Create(&module); }
"""

_BUILD_LOCK = threading.Lock()
_BUILT: list[tuple[object | None, str | None]] = []


def why_not_built() -> str | None:
    """Why this machine cannot run the kernels, or None when it can (they are then built)."""
    return _built()[1]


def available() -> bool:
    return _built()[0] is not None


def _built() -> tuple[object | None, str | None]:
    """(the kernels' module, None) or (None, why not): built once a process, by the first call (two
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
    folder = Path(tempfile.mkdtemp(prefix="preheat-cpukernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "cpukernels.c").write_text(SOURCE)
    built = folder / f"preheat_cpukernels{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC", f"-I{headers}"]
    done = subprocess.run(
        [compiler, *flags, "cpukernels.c", "-o", built.name], cwd=folder, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        return None, f"the kernel did not build ({compiler}: {first})"
    # torch is loaded, so the module's libgomp is torch's: one OpenMP runtime in the process.
    spec = importlib.util.spec_from_file_location("preheat_cpukernels", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, None


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
    kernels = _built()[0]
    if kernels is None:
        _fallback_once(why_not_built())
        return torch.mv(weight.float(), x.reshape(-1).float()).view(out.shape)
    x, weight = x.contiguous(), weight.contiguous()
    kernels.matvec_bf16(weight.data_ptr(), x.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1])
    return out


def attend_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    most_columns: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rows that each feed one query against their own slot, every column they hold seen
    (preheat.workers.engine.raggedkv): `query` [1, heads, tokens, head_dim] and a layer's
    `keys` and `values` [slots, kv_heads, capacity, head_dim], bfloat16 on the CPU; `rows`
    [n, 3] int64 (packed token, slot, columns), `most_columns` their largest. Written into
    `out` [1, tokens, heads, head_dim] (other tokens untouched; a new one when None) and
    returned. None where this kernel does not compute it (another dtype or device, a head size
    not a multiple of 32 or over 256): the caller's torch path does."""
    if query.dtype != torch.bfloat16 or not query.is_cpu:
        return None
    kernels = _built()[0]
    if kernels is None:
        _fallback_once(why_not_built())
        return None
    _, heads, tokens, head_dim = query.shape
    slots, kv_heads, capacity = keys.shape[:3]
    if head_dim % 32 or head_dim > 256 or heads % kv_heads or keys.dtype != torch.bfloat16:
        return None
    if out is None:
        out = torch.empty(1, tokens, heads, head_dim, dtype=torch.bfloat16)
    # The kernel trusts these with raw addresses: checked by value (the rows' own, in C).
    if (
        query.shape[0] != 1
        or keys.shape != values.shape
        or keys.shape[-1] != head_dim
        or values.dtype != keys.dtype
        or out.shape != (1, tokens, heads, head_dim)
        or out.dtype != torch.bfloat16
        or not out.is_contiguous()
        or rows.dtype != torch.int64
        or rows.dim() != 2
        or rows.shape[1] != 3
    ):
        raise ValueError(
            f"attend_rows takes queries, a layer's keys and values of their head size, [n, 3] int64 rows and "
            f"its output, got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, "
            f"{tuple(rows.shape)} {rows.dtype} and {tuple(out.shape)} {out.dtype}"
        )
    query, keys, values, rows = query.contiguous(), keys.contiguous(), values.contiguous(), rows.contiguous()
    scores = torch.empty(rows.shape[0] * heads * most_columns, dtype=torch.float32)
    kernels.attention_bf16(
        query.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        out.data_ptr(),
        scores.data_ptr(),
        rows.data_ptr(),
        rows.shape[0],
        tokens,
        heads,
        kv_heads,
        head_dim,
        capacity,
        most_columns,
        slots,
        float(scale),
    )
    return out


@functools.cache
def _fallback_once(reason: str | None) -> None:
    log.warning("bf16 one-row products and attention run through torch, slower: %s", reason)


# Registered with torch.library's lower-level API, not `custom_op`: a step calls it once per
# linear layer (211 times on the real model), and `custom_op` adds about 2 µs a call (its
# aliasing check), measured on 2 cores.
_LIBRARY = torch.library.Library("preheat", "FRAGMENT")
_LIBRARY.define("matvec_bf16(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("matvec_bf16", matvec, "CPU")


@torch.library.register_fake("preheat::matvec_bf16")
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
