/* The small step's arguments, one rule for its two kernels: smallstep.c (bfloat16, AVX512-BF16
   or AMX) and smallstep_f32.c (float32, AVX2 and FMA). Plain C: each kernel's own flags build it. */
#ifndef PREHEAT_SMALLSTEP_H
#define PREHEAT_SMALLSTEP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { NORM_IN, Q, K, V, O, NORM_POST, GATE, UP, DOWN, KEYS, VALUES, TABLE_WIDTH };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, slots, capacity;
} Sizes;

/* small_step(table, embed, final_norm, head, inv_freq, logits, ids, where, tokens, keep, kept, layers, hidden,
   heads, kv_heads, head_dim, intermediate, vocab, slots, capacity, eps, scale, rope_scaling, stacks, width,
   columns, tiles), as preheat.workers.engine.smallstep passes them. */
typedef struct {
    const int64_t *table;
    const void *embed, *final_norm, *head;
    const float *inv_freq;
    void *logits;
    const int64_t *ids, (*where)[3], *keep, (*stacks)[2], (*columns)[2];
    int64_t tokens, kept, width, most_rank;
    Sizes z;
    float eps, scale, rope_scaling;
    int tiles;
} StepArgs;

/* The arguments read into `a`, and proven by value, since the kernel reads and writes where the
   addresses point: the sizes, each token's id and place, the kept tokens, the adapters' columns
   (their largest rank into a->most_rank). `most(tiles)`: the most tokens a step may feed. Returns
   0, or -1 with the exception set. */
static int step_arguments(const char *name, PyObject *const *args, Py_ssize_t nargs, int (*most)(int), StepArgs *a) {
    if (nargs != 27) {
        PyErr_Format(PyExc_TypeError, "%s takes 27 arguments", name);
        return -1;
    }
    void *pointers[11];
    long long v[12];
    const int pointer_at[11] = {0, 1, 2, 3, 4, 5, 6, 7, 9, 23, 25};
    const int size_at[12] = {8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 24};
    for (int i = 0; i < 11; i++) pointers[i] = PyLong_AsVoidPtr(args[pointer_at[i]]);
    for (int i = 0; i < 12; i++) v[i] = PyLong_AsLongLong(args[size_at[i]]);
    const double eps = PyFloat_AsDouble(args[20]), scale = PyFloat_AsDouble(args[21]);
    const double rope_scaling = PyFloat_AsDouble(args[22]);
    const int tiles = PyObject_IsTrue(args[26]);
    if (PyErr_Occurred()) return -1;
    *a = (StepArgs){.table = pointers[0], .embed = pointers[1], .final_norm = pointers[2], .head = pointers[3],
                    .inv_freq = pointers[4], .logits = pointers[5], .ids = pointers[6], .where = pointers[7],
                    .keep = pointers[8], .stacks = pointers[9], .columns = pointers[10], .tokens = v[0],
                    .kept = v[1], .width = v[11], .most_rank = 0,
                    .z = {v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10]},
                    .eps = (float)eps, .scale = (float)scale, .rope_scaling = (float)rope_scaling, .tiles = tiles};
    const Sizes z = a->z;
    if (z.layers < 1 || z.hidden < 1 || z.heads < 1 || z.kv_heads < 1 || z.heads % z.kv_heads || z.head_dim % 32 ||
        z.head_dim < 32 || z.head_dim > 256 || z.intermediate < 1 || z.vocab < 1) {
        PyErr_Format(PyExc_ValueError, "%s: heads, head size or layer sizes it does not compute", name);
        return -1;
    }
    const long long tokens = a->tokens, kept = a->kept;
    if (tokens < 1 || tokens > most(tiles) || kept < 1 || kept > tokens) {
        PyErr_Format(PyExc_ValueError, "%s: %lld tokens (1 to %d), %lld of them kept", name, tokens, most(tiles), kept);
        return -1;
    }
    for (long long t = 0; t < tokens; t++) {
        const int64_t id = a->ids[t], slot = a->where[t][0], column = a->where[t][1], position = a->where[t][2];
        if (id < 0 || id >= z.vocab || slot < 0 || slot >= z.slots || column < 0 || column >= z.capacity ||
            position < 0) {
            PyErr_Format(PyExc_ValueError, "%s: token %lld (id %lld, slot %lld, column %lld, position %lld) "
                         "is outside the vocabulary's %lld ids, the %lld slots or the %lld columns", name, t,
                         (long long)id, (long long)slot, (long long)column, (long long)position,
                         (long long)z.vocab, (long long)z.slots, (long long)z.capacity);
            return -1;
        }
    }
    for (long long k = 0; k < kept; k++)
        if (a->keep[k] < 0 || a->keep[k] >= tokens) {
            PyErr_Format(PyExc_ValueError, "%s: kept token %lld is not one of the %lld", name, (long long)a->keep[k],
                         tokens);
            return -1;
        }
    for (long long t = 0; a->columns && t < tokens; t++) {
        const int64_t first = a->columns[t][0], rank = a->columns[t][1];
        if (first < 0 || rank < 0 || first + rank > a->width) {
            PyErr_Format(PyExc_ValueError, "%s: token %lld's adapter columns (%lld from %lld) are outside the "
                         "stacks' %lld", name, t, (long long)rank, (long long)first, (long long)a->width);
            return -1;
        }
        a->most_rank = rank > a->most_rank ? rank : a->most_rank;
    }
    return 0;
}

#endif
