#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <omp.h>
#include <cpuid.h>
#include <stdlib.h>

#include "cpukernels.h"

int64_t one_row_ahead = AHEAD_ROWS;

/* Whether one-row products fetch ahead, by the CPU (cpukernels.h): not on AMD's family 19h
   (Zen 4: the real model's one-row step 8.6-9.4 ms without, 11.0-11.1 with), on the others
   (Zen 5: 5.7-6.1 with, 7.5 without). A synthetic stream timed at load could not tell them
   apart (within 10 %, either way with the host's noise); the step could. */
static void pick_one_row_ahead(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const int amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163; /* "AuthenticAMD" */
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return;
    const unsigned int family = ((a >> 8) & 0xF) + ((a >> 20) & 0xFF);
    if (family == 0x19) one_row_ahead = 0;
}

/* y[n] = sum_k w[n, k] * x[k]: w [n_rows, k_len] bf16 row-major, x [k_len] bf16, y float32.
   A thread takes a run of whole rows and reads them in order: one stream of memory per
   thread, the pattern the CPU's prefetchers follow best (eight rows read side by side
   streamed at 15-20 GB/s on a Zen 4, one stream at 21-30). Four sums per row hide the
   instruction's latency. */
static void matvec_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t n_rows, int64_t k_len) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_rows; n++) y[n] = dot_bf16(w + n * k_len, x, k_len);
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
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < n_rows * heads; pair++) {
        const int64_t *row = table + 3 * (pair / heads), h = pair % heads, token = row[0];
        const int64_t at = ((row[1] * kv_heads) + h / group) * capacity * head_dim;
        attend_head(q + (h * tokens + token) * head_dim, k + at, v + at, out + (token * heads + h) * head_dim,
                    scores + pair * max_columns, row[2], head_dim, scale);
    }
}

/* The shrink of up to 4 tokens of one adapter (n, a constant where it is inlined, so the sums
   stay in registers), 4 of its rows from j: h[k][j + u] = a[first + j + u] . x[tokens[k]].
   Each row of A is read once for the n tokens; bf16 pairs multiplied by the CPU's own
   instruction where the input and the stacks are both bf16. */
static inline __attribute__((always_inline)) void lora_shrink(const int n, const int64_t *tokens, const void *x,
                                                              const void *a, int64_t line, int64_t rows,
                                                              int64_t in_len, const int bf16, const int stacks_bf16,
                                                              float *h[4]) {
    __m512 acc[4][4];
    for (int k = 0; k < n; k++)
        for (int u = 0; u < 4; u++) acc[k][u] = _mm512_setzero_ps();
    const int64_t last = rows < 4 ? rows : 4; /* rows past the adapter's read as its last */
    if (bf16 && stacks_bf16) {
        const uint16_t *a16 = a, *x16 = x;
        for (int64_t i = 0; i < in_len; i += 32) {
            const __mmask32 m = in_len - i >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1u << (in_len - i)) - 1);
            __m512bh weight[4];
            for (int u = 0; u < 4; u++)
                weight[u] = (__m512bh)_mm512_maskz_loadu_epi16(m, a16 + (line + (u < last ? u : last - 1)) * in_len + i);
            for (int k = 0; k < n; k++) {
                const __m512bh value = (__m512bh)_mm512_maskz_loadu_epi16(m, x16 + tokens[k] * in_len + i);
                for (int u = 0; u < 4; u++) acc[k][u] = _mm512_dpbf16_ps(acc[k][u], value, weight[u]);
            }
        }
    } else {
        for (int64_t i = 0; i < in_len; i += 16) {
            const __mmask16 m = first_lanes(in_len - i);
            __m512 weight[4];
            for (int u = 0; u < 4; u++)
                weight[u] = load_lanes(a, (line + (u < last ? u : last - 1)) * in_len + i, m, stacks_bf16);
            for (int k = 0; k < n; k++) {
                const __m512 value = load_lanes(x, tokens[k] * in_len + i, m, bf16);
                for (int u = 0; u < 4; u++) acc[k][u] = _mm512_fmadd_ps(value, weight[u], acc[k][u]);
            }
        }
    }
    for (int k = 0; k < n; k++)
        for (int u = 0; u < last; u++) h[k][u] = _mm512_reduce_add_ps(acc[k][u]);
}

/* The expand of up to 4 tokens of one adapter, 64 outputs from o: out[t, o : o + 64] =
   y[t, o : o + 64] + h[k] @ b[first : first + rank, o : o + 64], summed in float32 and rounded
   once. out may be y (each value read before its own is written). */
static inline __attribute__((always_inline)) void lora_expand(const int n, const int64_t *tokens, const void *y,
                                                              void *out, const void *b, int64_t first, int64_t rank,
                                                              int64_t o, int64_t out_len, const int bf16,
                                                              const int stacks_bf16, float *h[4]) {
    __mmask16 m[4];
    __m512 acc[4][4];
    for (int u = 0; u < 4; u++) m[u] = first_lanes(out_len - o - 16 * u);
    for (int k = 0; k < n; k++)
        for (int u = 0; u < 4; u++) acc[k][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; j++) {
        const int64_t line = (first + j) * out_len + o;
        __m512 weight[4];
        for (int u = 0; u < 4; u++) weight[u] = load_lanes(b, line + 16 * u, m[u], stacks_bf16);
        for (int k = 0; k < n; k++) {
            const __m512 scale = _mm512_set1_ps(h[k][j]);
            for (int u = 0; u < 4; u++) acc[k][u] = _mm512_fmadd_ps(scale, weight[u], acc[k][u]);
        }
    }
    for (int k = 0; k < n; k++)
        for (int u = 0; u < 4; u++) {
            const int64_t at = tokens[k] * out_len + o + 16 * u;
            store_lanes(out, at, m[u], _mm512_add_ps(load_lanes(y, at, m[u], bf16), acc[k][u]), bf16);
        }
}

/* n (1 to 4) and the dtypes made constants where the phases are inlined: no branch in their loops. */
#define LORA_CASES(CALL)                                                                                               \
    switch (n) {                                                                                                       \
    case 1: CALL(1); break;                                                                                            \
    case 2: CALL(2); break;                                                                                            \
    case 3: CALL(3); break;                                                                                            \
    default: CALL(4); break;                                                                                           \
    }
#define LORA_DTYPES(F, N)                                                                                              \
    (bf16 ? (stacks_bf16 ? F(N, 1, 1) : F(N, 1, 0)) : (stacks_bf16 ? F(N, 0, 1) : F(N, 0, 0)))

/* The LoRA adapters of a step's tokens, each token through its own adapter's rows only:
   out[t] = y[t] + (a[c:c+r] @ x[t]) @ b[c:c+r], (c, r) = columns[t] (r = 0: the base's token,
   out[t] = y[t]). a [width, in_len] and b [width, out_len] (a layer's stacks, the scaling in b:
   preheat.workers.engine.lorastack), bf16 where stacks_bf16 is non-zero, else float32; x
   [tokens, in_len], y and out [tokens, out_len] (out may be y), bf16 where bf16 is non-zero,
   else float32. The delta is summed in float32 and added to y before the one rounding.
   Tokens are grouped by adapter, up to 4 a group, as Punica's and S-LoRA's kernels group
   them: each group reads its adapter's rows once (masking the other adapters' columns
   instead would cost every token the products of all of them). Two phases, each split over
   the threads: the shrinks (a group's 4 rows of A an item), then the expands (a group's 64
   outputs an item). Both threads work even at one token: a call that left one idle would
   let it fall asleep, and the step's next op would wait for its wake-up (35-40 us on a
   2-core VM). Each thread first asks memory for the rows its items read: each adapter's
   rows are short blocks (18 KB of A for the real model's k_proj), too short for the
   prefetchers to follow. Columns checked by the caller; returns 0, or -1 out of memory. */
static int lora_add(const void *x, const void *y, void *out, const void *a, const void *b, const int64_t *columns,
                    int64_t tokens, int64_t in_len, int64_t out_len, int64_t width, int bf16, int stacks_bf16) {
    int64_t groups = 0, opened = 0, rank_most = 1;
    int64_t(*group)[4] = malloc(sizeof(int64_t[4]) * tokens + 1), *size = malloc(sizeof(int64_t) * tokens + 1);
    int64_t *open = malloc(sizeof(int64_t) * tokens + 1);
    for (int64_t t = 0; group && size && open && t < tokens; t++) { /* a token joins its adapter's open group */
        if (columns[2 * t + 1] == 0) continue;                     /* the base's token: out[t] = y[t] below */
        int64_t g = -1;
        for (int64_t k = 0; k < opened && g < 0; k++)
            if (columns[2 * group[open[k]][0]] == columns[2 * t] && columns[2 * group[open[k]][0] + 1] == columns[2 * t + 1])
                g = open[k], open[k] = open[--opened];
        if (g < 0) g = groups++, size[g] = 0;
        group[g][size[g]++] = t;
        if (size[g] < 4) open[opened++] = g;
        rank_most = columns[2 * t + 1] > rank_most ? columns[2 * t + 1] : rank_most;
    }
    const int64_t blocks = (out_len + 63) / 64, row_blocks = (rank_most + 3) / 4;
    float *h = malloc(sizeof(float) * (groups * 4 * rank_most + 1));
    if (!group || !size || !open || !h) {
        free(group), free(size), free(open), free(h);
        return -1;
    }
    const int64_t bytes = stacks_bf16 ? 2 : 4, value_bytes = bf16 ? 2 : 4;
    if (out != y) /* the base's tokens, and every token's y before its delta */
        memcpy(out, y, tokens * out_len * value_bytes);
    #pragma omp parallel if (groups > 0)
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t shrinks = groups * row_blocks, expands = groups * blocks;
        const int64_t s0 = shrinks * me / threads, s1 = shrinks * (me + 1) / threads;
        const int64_t e0 = expands * me / threads, e1 = expands * (me + 1) / threads;
        for (int64_t it = s0; it < s1; it++) { /* this thread's rows of A, then of B, asked for first */
            const int64_t g = it / row_blocks, j = it % row_blocks * 4, rank = columns[2 * group[g][0] + 1];
            const char *rows = (const char *)a + (columns[2 * group[g][0]] + j) * in_len * bytes;
            for (int64_t at = 0; j < rank && at < (rank - j < 4 ? rank - j : 4) * in_len * bytes; at += 64)
                _mm_prefetch(rows + at, _MM_HINT_T0);
        }
        for (int64_t it = e0; it < e1; it++) {
            const int64_t g = it / blocks, o = it % blocks * 64, first = columns[2 * group[g][0]];
            for (int64_t j = 0; j < columns[2 * group[g][0] + 1]; j++)
                for (int64_t at = 0; at < (out_len - o < 64 ? out_len - o : 64) * bytes; at += 64)
                    _mm_prefetch((const char *)b + ((first + j) * out_len + o) * bytes + at, _MM_HINT_T1);
        }
        for (int64_t it = s0; it < s1; it++) {
            const int64_t g = it / row_blocks, j = it % row_blocks * 4, n = size[g];
            const int64_t first = columns[2 * group[g][0]], rank = columns[2 * group[g][0] + 1];
            float *sums[4] = {h + (g * 4 + 0) * rank_most + j, h + (g * 4 + 1) * rank_most + j,
                              h + (g * 4 + 2) * rank_most + j, h + (g * 4 + 3) * rank_most + j};
            if (j >= rank) continue;
#define SHRINK(N, X16, S16) lora_shrink(N, group[g], x, a, first + j, rank - j, in_len, X16, S16, sums)
#define SHRINK_N(N) LORA_DTYPES(SHRINK, N)
            LORA_CASES(SHRINK_N)
        }
        #pragma omp barrier
        for (int64_t it = e0; it < e1; it++) {
            const int64_t g = it / blocks, o = it % blocks * 64, n = size[g];
            const int64_t first = columns[2 * group[g][0]], rank = columns[2 * group[g][0] + 1];
            float *sums[4] = {h + (g * 4 + 0) * rank_most, h + (g * 4 + 1) * rank_most, h + (g * 4 + 2) * rank_most,
                              h + (g * 4 + 3) * rank_most};
#define EXPAND(N, X16, S16) lora_expand(N, group[g], out, out, b, first, rank, o, out_len, X16, S16, sums)
#define EXPAND_N(N) LORA_DTYPES(EXPAND, N)
            LORA_CASES(EXPAND_N)
        }
    }
    free(group), free(size), free(open), free(h);
    return 0;
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

/* lora_add(x, y, out, a, b, columns, tokens, in_len, out_len, width, bf16, stacks_bf16): each token's columns
   checked against the stacks' width here, by value, since the kernel reads where they point. */
static PyObject *add_lora(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "lora_add takes 12 arguments");
        return NULL;
    }
    void *pointers[6];
    long long sizes[6];
    for (int i = 0; i < 6; i++) pointers[i] = PyLong_AsVoidPtr(args[i]);
    for (int i = 0; i < 6; i++) sizes[i] = PyLong_AsLongLong(args[6 + i]);
    if (PyErr_Occurred()) return NULL;
    const int64_t *columns = pointers[5];
    const long long tokens = sizes[0], width = sizes[3];
    for (long long t = 0; t < tokens; t++) {
        const int64_t first = columns[2 * t], rank = columns[2 * t + 1];
        if (first < 0 || rank < 0 || first + rank > width) {
            PyErr_Format(PyExc_ValueError, "token %lld's adapter columns (%lld from %lld) are outside the stacks' %lld",
                         t, (long long)rank, (long long)first, width);
            return NULL;
        }
    }
    if (lora_add(pointers[0], pointers[1], pointers[2], pointers[3], pointers[4], columns, tokens, sizes[1], sizes[2],
                 width, (int)sizes[4], (int)sizes[5]) != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyObject *small_step_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* smallstep.c */

/* amx_ready(): whether the small step may run its products on AMX tiles here (amx.c). */
static PyObject *tiles_ready(PyObject *self, PyObject *unused) { return PyBool_FromLong(amx_ready()); }

/* ahead_rows(): the rows a one-row product fetches ahead here; ahead_rows(n): n from now on
   (the tests' way to run both). */
static PyObject *ahead_rows(PyObject *self, PyObject *args) {
    long rows = -1;
    if (!PyArg_ParseTuple(args, "|l", &rows)) return NULL;
    if (rows != -1) {
        if (rows != 0 && rows != AHEAD_ROWS) return PyErr_Format(PyExc_ValueError, "rows must be 0 or %d", AHEAD_ROWS);
        one_row_ahead = rows;
    }
    return PyLong_FromLong((long)one_row_ahead);
}

static PyMethodDef methods[] = {{"matvec_bf16", (PyCFunction)(void (*)(void))call, METH_FASTCALL, NULL},
                                {"ahead_rows", ahead_rows, METH_VARARGS, NULL},
                                {"attention_bf16", (PyCFunction)(void (*)(void))attend, METH_FASTCALL, NULL},
                                {"lora_add", (PyCFunction)(void (*)(void))add_lora, METH_FASTCALL, NULL},
                                {"small_step", (PyCFunction)(void (*)(void))small_step_call, METH_FASTCALL, NULL},
                                {"amx_ready", tiles_ready, METH_NOARGS, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "preheat_cpukernels", NULL, -1, methods};
PyMODINIT_FUNC PyInit_preheat_cpukernels(void) {
    pick_one_row_ahead();
    PyObject *created = PyModule_Create(&module);
    if (created != NULL && PyModule_AddIntConstant(created, "AHEAD_ROWS", AHEAD_ROWS) != 0) Py_CLEAR(created);
    return created;
}
