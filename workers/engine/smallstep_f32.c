/* A Llama-family decoder's small step in float32 (preheat.workers.engine.smallstep) for CPUs with
   AVX2 and FMA: 1 to 64 tokens through every layer, then the final norm and the output head for
   the kept tokens, in one OpenMP parallel region whose phases meet at barriers, the GIL released.
   smallstep.c's step with every op in float32 as transformers' float32 ops compute it (nothing
   to round), without adapters or tiles: the step a host without fast bfloat16 runs. Each weight
   row is read once for all the tokens. */
#include "smallstep.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define MOST_TOKENS 64 /* past it, oneDNN's packed products and the graph's attention do better */
#define ROWS 4          /* weight rows a pass sums at once */
#define GROUP 3         /* tokens a pass sums at once: 12 sums in registers, each row and token loaded once */

static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* A row's dot product with x: four chains of 8 lanes (an FMA's latency hidden), then the tail. */
static inline float dot(const float *row, const float *x, int64_t k_len) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k_len; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + i + 8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(row + i + 16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(row + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    for (; i + 8 <= k_len; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(x + i), s0);
    float sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < k_len; i++) sum += row[i] * x[i];
    return sum;
}

/* ROWS rows' sums over n (a constant, up to GROUP) tokens of x ([n, k_len]) into sums[r][at + u]:
   one chain of 8 lanes a row and token, then its tail. Twelve chains hide an FMA's latency, and
   a pass loads 4 + 3 vectors for 12 FMAs: two rows by four tokens (6 for 8) ran at 0.7x. */
static inline __attribute__((always_inline)) void block_group(const int n, const float *const rows[ROWS],
                                                              const float *x, int64_t k_len,
                                                              float sums[ROWS][MOST_TOKENS], int64_t at) {
    __m256 acc[ROWS][GROUP];
    for (int r = 0; r < ROWS; r++)
        for (int u = 0; u < n; u++) acc[r][u] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k_len; i += 8) {
        __m256 w[ROWS];
        for (int r = 0; r < ROWS; r++) w[r] = _mm256_loadu_ps(rows[r] + i);
        for (int u = 0; u < n; u++) {
            const __m256 xu = _mm256_loadu_ps(x + u * k_len + i);
            for (int r = 0; r < ROWS; r++) acc[r][u] = _mm256_fmadd_ps(w[r], xu, acc[r][u]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int u = 0; u < n; u++) {
            float t = sum_lanes(acc[r][u]);
            for (int64_t j = i; j < k_len; j++) t += rows[r][j] * x[u * k_len + j];
            sums[r][at + u] = t;
        }
}

/* ROWS rows' sums over the step's tokens (x [tokens, k_len]) into sums[r][token]. One token
   streams the rows (its bound is the memory's), so each row is a dot product of four chains. */
static void row_dots(int64_t tokens, const float *const rows[ROWS], const float *x, int64_t k_len,
                     float sums[ROWS][MOST_TOKENS]) {
    if (tokens == 1) {
        for (int r = 0; r < ROWS; r++) sums[r][0] = dot(rows[r], x, k_len);
        return;
    }
    int64_t g = 0;
    for (; g + GROUP <= tokens; g += GROUP) block_group(GROUP, rows, x + g * k_len, k_len, sums, g);
    if (tokens - g == 2) block_group(2, rows, x + g * k_len, k_len, sums, g);
    if (tokens - g == 1) block_group(1, rows, x + g * k_len, k_len, sums, g);
}

/* The ROWS rows of w ([count, k_len]) from `first`, the last repeated past the end (its sums
   written once: see `owned`). */
static inline void rows_from(const float *w, int64_t first, int64_t count, int64_t k_len, const float *rows[ROWS]) {
    for (int r = 0; r < ROWS; r++) rows[r] = w + (first + r < count ? first + r : count - 1) * k_len;
}

/* How many of the ROWS rows from `first` are w's own, not the last repeated. */
static inline int owned(int64_t first, int64_t count) { return count - first < ROWS ? (int)(count - first) : ROWS; }

/* LlamaRMSNorm in float32: x * rsqrt(mean(x^2) + eps), times the weight. */
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    const float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

/* rotate_half's rotary embedding of one head: x * cos + rotate_half(x) * sin. cs: cos then sin. */
static void rotate(const float *x, float *out, const float *cs, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half], c = cs[i], s = cs[half + i];
        out[i] = a * c + -b * s, out[i + half] = b * c + a * s;
    }
}

/* n (a constant, 4 or 8) vectors of 8 lanes of the weighted sum of `columns` values from lane d:
   a chain a vector, each lane's sum in the columns' order. */
static inline __attribute__((always_inline)) void weigh_values(const int n, const float *scores, const float *values,
                                                               float *out, int64_t columns, int64_t dim, float total) {
    __m256 acc[8];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < columns; c++) {
        const __m256 weight = _mm256_set1_ps(scores[c]);
        for (int j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values + c * dim + 8 * j), acc[j]);
    }
    for (int j = 0; j < n; j++) _mm256_storeu_ps(out + 8 * j, _mm256_div_ps(acc[j], _mm256_set1_ps(total)));
}

/* One query head against `columns` keys and values of its slot's head: softmax(q k * scale) v. */
static void attend_head(const float *q, const float *keys, const float *values, float *out, float *scores,
                        int64_t columns, int64_t dim, float scale) {
    float most = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < columns; c++) {
        scores[c] = dot(q, keys + c * dim, dim) * scale;
        most = scores[c] > most ? scores[c] : most;
    }
    for (int64_t c = 0; c < columns; c++) total += scores[c] = expf(scores[c] - most);
    int64_t d = 0; /* 64 lanes a pass (8 chains: an FMA's latency hidden), then the last 32 */
    for (; d + 64 <= dim; d += 64) weigh_values(8, scores, values + d, out + d, columns, dim, total);
    if (d < dim) weigh_values(4, scores, values + d, out + d, columns, dim, total);
}

/* A product added to the residual h ([tokens, rows]): w [rows, k_len] against x [tokens, k_len],
   its blocks of ROWS rows split over the region's threads (an orphaned `omp for`). */
static void residual_product(float *h, int64_t rows, int64_t tokens, const float *w, const float *x, int64_t k_len,
                             float sums[ROWS][MOST_TOKENS]) {
    #pragma omp for schedule(static)
    for (int64_t block = 0; block < (rows + ROWS - 1) / ROWS; block++) {
        const float *from[ROWS];
        rows_from(w, block * ROWS, rows, k_len, from);
        row_dots(tokens, from, x, k_len, sums);
        for (int r = 0; r < owned(block * ROWS, rows); r++)
            for (int64_t t = 0; t < tokens; t++) h[t * rows + block * ROWS + r] += sums[r][t];
    }
}

/* The step, as smallstep.c's (its table, places and kept tokens), every tensor float32. Returns 0,
   or -1 out of memory. */
static int small_step(const StepArgs *a) {
    const Sizes z = a->z;
    const int64_t tokens = a->tokens, hidden = z.hidden, dim = z.head_dim, half = dim / 2, q_rows = z.heads * dim;
    const int64_t kv_rows = z.kv_heads * dim, qkv_rows = q_rows + 2 * kv_rows, group = z.heads / z.kv_heads;
    const int64_t inter = z.intermediate;
    const int64_t (*where)[3] = a->where;
    int64_t most = 1; /* the most columns a token sees */
    for (int64_t t = 0; t < tokens; t++) most = where[t][1] + 1 > most ? where[t][1] + 1 : most;
    const int threads = omp_get_max_threads();
    float *h = malloc(sizeof(float) * hidden * tokens), *qkv = malloc(sizeof(float) * qkv_rows * tokens);
    float *attn = malloc(sizeof(float) * q_rows * tokens), *mlp = malloc(sizeof(float) * inter * tokens);
    float *normed = malloc(sizeof(float) * hidden * tokens * threads);
    float *scores = malloc(sizeof(float) * z.heads * tokens * most), *cs = malloc(sizeof(float) * dim * tokens);
    const float *embed = a->embed, *head = a->head, *final_norm = a->final_norm;
    float *logits = a->logits;
    int status = -1;
    if (!h || !qkv || !attn || !mlp || !normed || !scores || !cs) goto done;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(h + t * hidden, embed + a->ids[t] * hidden, sizeof(float) * hidden);
        for (int64_t i = 0; i < half; i++) { /* the model's cos and sin: float32 angles, scaled */
            const float angle = (float)where[t][2] * a->inv_freq[i];
            cs[t * dim + i] = cosf(angle) * a->rope_scaling, cs[t * dim + half + i] = sinf(angle) * a->rope_scaling;
        }
    }
    #pragma omp parallel
    {
        float *x = normed + hidden * tokens * omp_get_thread_num(); /* each thread's own copy of a norm */
        float sums[ROWS][MOST_TOKENS];
        for (int64_t layer = 0; layer < z.layers; layer++) {
            const int64_t *at = a->table + TABLE_WIDTH * layer;
            const float *wq = (const float *)at[Q], *wk = (const float *)at[K], *wv = (const float *)at[V];
            const float *wg = (const float *)at[GATE], *wu = (const float *)at[UP];
            float *keys = (float *)at[KEYS], *values = (float *)at[VALUES];
            for (int64_t t = 0; t < tokens; t++)
                rms_norm(h + t * hidden, (const float *)at[NORM_IN], x + t * hidden, hidden, a->eps);
            #pragma omp for schedule(static)
            for (int64_t block = 0; block < (qkv_rows + ROWS - 1) / ROWS; block++) { /* q, k and v as one matrix */
                const float *rows[ROWS];
                for (int r = 0; r < ROWS; r++) {
                    const int64_t n = block * ROWS + r < qkv_rows ? block * ROWS + r : qkv_rows - 1;
                    rows[r] = n < q_rows             ? wq + n * hidden
                              : n < q_rows + kv_rows ? wk + (n - q_rows) * hidden
                                                     : wv + (n - q_rows - kv_rows) * hidden;
                }
                row_dots(tokens, rows, x, hidden, sums);
                for (int r = 0; r < owned(block * ROWS, qkv_rows); r++)
                    for (int64_t t = 0; t < tokens; t++) qkv[t * qkv_rows + block * ROWS + r] = sums[r][t];
            }
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < tokens * (z.heads + z.kv_heads); item++) {
                /* a query rotated; or a key rotated and written, and its value written */
                const int64_t t = item / (z.heads + z.kv_heads), g = item % (z.heads + z.kv_heads);
                float *own = qkv + t * qkv_rows;
                if (g < z.heads) {
                    rotate(own + g * dim, own + g * dim, cs + t * dim, half);
                    continue;
                }
                const int64_t kv = g - z.heads, to = ((where[t][0] * z.kv_heads + kv) * z.capacity + where[t][1]) * dim;
                rotate(own + q_rows + kv * dim, keys + to, cs + t * dim, half);
                memcpy(values + to, own + q_rows + kv_rows + kv * dim, sizeof(float) * dim);
            }
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < tokens * z.heads; item++) {
                const int64_t t = item / z.heads, q = item % z.heads;
                const int64_t from = (where[t][0] * z.kv_heads + q / group) * z.capacity * dim;
                attend_head(qkv + t * qkv_rows + q * dim, keys + from, values + from, attn + t * q_rows + q * dim,
                            scores + item * most, where[t][1] + 1, dim, a->scale);
            }
            residual_product(h, hidden, tokens, (const float *)at[O], attn, q_rows, sums);
            for (int64_t t = 0; t < tokens; t++)
                rms_norm(h + t * hidden, (const float *)at[NORM_POST], x + t * hidden, hidden, a->eps);
            #pragma omp for schedule(static)
            for (int64_t block = 0; block < (inter + 1) / 2; block++) { /* two gate rows and their up rows */
                const int64_t j0 = 2 * block, j1 = j0 + 1 < inter ? j0 + 1 : j0;
                const float *rows[ROWS] = {wg + j0 * hidden, wg + j1 * hidden, wu + j0 * hidden, wu + j1 * hidden};
                row_dots(tokens, rows, x, hidden, sums);
                for (int r = 0; r < (j1 != j0 ? 2 : 1); r++)
                    for (int64_t t = 0; t < tokens; t++) { /* SiLU(gate) * up */
                        const float gate = sums[r][t];
                        mlp[t * inter + 2 * block + r] = gate / (1.0f + expf(-gate)) * sums[2 + r][t];
                    }
            }
            residual_product(h, hidden, tokens, (const float *)at[DOWN], mlp, inter, sums);
        }
        for (int64_t k = 0; k < a->kept; k++) rms_norm(h + a->keep[k] * hidden, final_norm, x + k * hidden, hidden, a->eps);
        #pragma omp for schedule(static)
        for (int64_t block = 0; block < (z.vocab + ROWS - 1) / ROWS; block++) {
            const float *rows[ROWS];
            rows_from(head, block * ROWS, z.vocab, hidden, rows);
            row_dots(a->kept, rows, x, hidden, sums);
            for (int r = 0; r < owned(block * ROWS, z.vocab); r++)
                for (int64_t k = 0; k < a->kept; k++) logits[k * z.vocab + block * ROWS + r] = sums[r][k];
        }
    }
    status = 0;
done:
    free(h), free(qkv), free(attn), free(mlp), free(normed), free(scores), free(cs);
    return status;
}

static int most_tokens(int tiles) { return (void)tiles, MOST_TOKENS; } /* tiles asked for: refused below, by name */

/* small_step(...) as smallstep.h reads it, without adapters (`columns` 0) or tiles. */
static PyObject *small_step_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    StepArgs a;
    if (step_arguments("small_step_f32", args, nargs, most_tokens, &a) != 0) return NULL;
    if (a.columns || a.tiles) {
        PyErr_SetString(PyExc_ValueError, "small_step_f32: computes no adapters and runs on no tiles");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = small_step(&a);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"small_step", (PyCFunction)(void (*)(void))small_step_call, METH_FASTCALL, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "preheat_cpukernels_f32", NULL, -1, methods};
PyMODINIT_FUNC PyInit_preheat_cpukernels_f32(void) { return PyModule_Create(&module); }
