/* A Llama-family decoder's small step in one call (preheat.workers.engine.smallstep): 1 to 16
   tokens (a single user's decode token, the short rest of a prompt a cached prefix leaves, a
   few users decoding together, or these at once) through every layer, then the final norm and
   the output head for each row's last token, in one OpenMP parallel region whose phases meet at
   barriers, the GIL released. Each weight row is read once for all the tokens. Each op rounds
   to bf16 where transformers' eager bf16 op does (a product, a sum, a norm, a rotation). */
#include "smallstep.h"

#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpukernels.h"

#define MOST_TOKENS 16      /* dot products: past it, oneDNN's products are as fast (compute bounds them) */
#define MOST_TILE_TOKENS 64 /* AMX tiles (amx.c): four groups of 16 tokens against a block of rows */
#define GROUP DOT_TOKENS /* the tokens of a tile: two weight rows by GROUP tokens, 2 * GROUP sums in registers */

/* Where the step's phases meet: every thread of its parallel region, after its share of a
   phase (each `omp for` is `nowait`, then this). OpenMP's own barrier spins GOMP_SPINCOUNT
   turns and then sleeps on a futex; a worker sets that short (workers/__init__.py: a long
   spin between two steps fights a neighbour), while a step's phases end apart by more: the
   real model's one-row step on a Zen 4 spent 9-18% of each thread's time waiting at its
   barriers, mostly after the products, the late thread changing from one to the next. This
   one spins up to STEP_SPIN_CYCLES of the time-stamp counter (about 0.1 ms), inside the step
   only, where the thread it waits for is the step's own, then sleeps on a futex as OpenMP's
   does. Both builds in one process, step by step alternated (Zen 4, 2 cores): one row
   10.9-12.7 ms against 11.5-13.2 alone, and 20.5-23.7 against 23.7-28.4 beside a neighbour
   busy on both cores (4 rows 31.6-40.7 against 34.8-47.7); 16 rows alone the same. Measured
   and dropped: yielding the core instead of sleeping (beside the neighbour 42 ms against
   31: the spinner took the core back from the thread it waited for); a spin of 2^16 cycles
   (no gain); handing the products' rows out as threads finish (OpenMP's dynamic schedule,
   slower at every row count; a shared last quarter, 4-8% slower at 4 and 16 rows). The
   float32 kernel keeps OpenMP's barriers: beside the neighbour this one made its one-row
   step slower (46.6-47.9 ms against 40.0-41.1). */
#define STEP_SPIN_CYCLES (1ull << 18)

typedef struct {
    atomic_int arrived, generation, sleepers;
} StepBarrier;

static inline void step_barrier(StepBarrier *b) {
    const int threads = omp_get_num_threads();
    if (threads < 2) return;
    const int generation = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == threads - 1) {
        /* the last to arrive: the count back to 0 before the others may arrive at the next */
        atomic_store(&b->arrived, 0);
        atomic_store(&b->generation, generation + 1);
        if (atomic_load(&b->sleepers)) syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    const unsigned long long began = __rdtsc();
    while (atomic_load_explicit(&b->generation, memory_order_acquire) == generation) {
        if (__rdtsc() - began < STEP_SPIN_CYCLES) {
            _mm_pause();
            continue;
        }
        /* seq_cst: the last to arrive either sees a sleeper or changed what the futex compares */
        atomic_fetch_add(&b->sleepers, 1);
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, generation, NULL, NULL, 0);
        atomic_fetch_sub(&b->sleepers, 1);
    }
}

/* Two rows' sums over the step's `padded` tokens (1, 4, or a multiple of GROUP: x's rows past
   the step's tokens are zeros) into sums[0] and sums[1]. One token: each row's own four-sum
   product; more, both rows at once, up to GROUP tokens at a time, the rows still in the L1
   cache for the next GROUP (16 tokens: 27 against 36 ms on the real model). Up to GROUP tokens
   each row went by itself once (faster on a Zen 4); on a Zen 5 a chunk of 8 took 21.4 ms both
   at once against 27.5 each by itself, and 7.8-9.0 since the weights are fetched ahead. */
static inline void pair_dots(int64_t padded, const uint16_t *row0, const uint16_t *row1, const uint16_t *x,
                             int64_t stride, int64_t k_len, float sums[2][MOST_TILE_TOKENS]) {
    if (padded == 1) {
        sums[0][0] = dot_bf16(row0, x, k_len), sums[1][0] = dot_bf16(row1, x, k_len);
    } else if (padded == 4) {
        pair_dots_n(4, row0, row1, x, stride, k_len, sums[0], sums[1]);
    } else {
        for (int64_t g = 0; g < padded; g += GROUP)
            pair_dots_n(GROUP, row0, row1, x + g * stride, stride, k_len, sums[0] + g, sums[1] + g);
    }
}

/* LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), rounded, times the weight, rounded. */
static void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t n, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load_lanes(x, i, first_lanes(n - i), 1);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = first_lanes(n - i);
        const __m512 normed = round_bf16_ps(_mm512_mul_ps(load_lanes(x, i, m, 1), r));
        store_lanes(out, i, m, _mm512_mul_ps(normed, load_lanes(weight, i, m, 1)), 1);
    }
}

/* rotate_half's rotary embedding of one head, as transformers rounds it: x * cos and
   rotate_half(x) * sin each rounded, then their sum. cs: cos then sin, [half] each (bf16 values). */
static void rotate(const uint16_t *x, uint16_t *out, const float *cs, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = from_bf16(x[i]), b = from_bf16(x[i + half]), c = cs[i], s = cs[half + i];
        const float first = from_bf16(to_bf16(a * c)) + from_bf16(to_bf16(-b * s));
        const float second = from_bf16(to_bf16(b * c)) + from_bf16(to_bf16(a * s));
        out[i] = to_bf16(first), out[i + half] = to_bf16(second);
    }
}

/* SiLU(gate) * up for up to 16 values, each op rounded: x / (1 + e^-x), written x * e / (1 + e)
   for x < 0, with e = exp(-|x|), so exp_ps meets no positive argument. */
static __m512 silu_times(__m512 gate, __m512 up) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
    const __m512 one_plus = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(gate, negative, gate, e);
    return round_bf16_ps(_mm512_mul_ps(round_bf16_ps(_mm512_div_ps(numerator, one_plus)), up));
}

static inline uint16_t add_bf16(uint16_t residual, float product) {
    return to_bf16(from_bf16(residual) + from_bf16(to_bf16(product)));
}

/* The step's LoRA adapters (preheat.workers.engine.lorastack): per adapted kind (q, k, v, o,
   gate, up, down) the stacks A [layers, width, in] and B [layers, width, out] (bf16, B scaled),
   or none; each token's (first column, rank), rank 0 for the base's. delta [kind][token][out]:
   each token's own adapter's (A x) B, float32, added to the product before its rounding. Each
   thread holds its own copy (its shrinks h, the layer): a shrink is small enough to compute on
   every thread, which saves the barrier after it. `fused`: the expands are computed where the
   products' sums are rounded (on tiles: with_deltas), which saves the phase and its barrier. */
enum { LQ, LK, LV, LO, LGATE, LUP, LDOWN, KINDS };
typedef struct {
    const uint16_t *a[KINDS], *b[KINDS];
    int64_t width, most_rank, layer;
    const int64_t (*columns)[2];
    float *h, *delta[KINDS]; /* h [tokens][KINDS][most_rank], this thread's */
    int fused;
} Lora;

/* A group of kinds that read one input (x [tokens, in], `stride` apart): the shrinks (A x) of
   every token and kind, on this thread; unless `fused`, then the expands (64 outputs of a token
   and kind an item), split over the threads, for the caller's product phase to add. */
static void lora_phases(const Lora *l, const int *kinds, int count, const uint16_t *x, int64_t in,
                        const int64_t *outs, int64_t tokens, StepBarrier *meet) {
    const int64_t layer = l->layer;
    for (int64_t item = 0; item < tokens * count; item++) {
        const int64_t t = item / count, kind = kinds[item % count], first = l->columns[t][0];
        const int64_t rank = l->a[kind] ? l->columns[t][1] : 0;
        float *h = l->h + (t * KINDS + kind) * l->most_rank;
        for (int64_t j = 0; j < rank; j++) h[j] = dot_bf16(l->a[kind] + (layer * l->width + first + j) * in, x + t * in, in);
    }
    if (l->fused) return;
    int64_t blocks = 0;
    for (int i = 0; i < count; i++) blocks += (outs[i] + 63) / 64;
    #pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < tokens * blocks; item++) {
        const int64_t t = item / blocks;
        int64_t block = item % blocks, i = 0;
        while (block >= (outs[i] + 63) / 64) block -= (outs[i] + 63) / 64, i++;
        const int kind = kinds[i];
        const int64_t out = outs[i], o = 64 * block, first = l->columns[t][0];
        const int64_t rank = l->a[kind] ? l->columns[t][1] : 0;
        const float *h = l->h + (t * KINDS + kind) * l->most_rank;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t j = 0; j < rank; j++) {
            const uint16_t *row = l->b[kind] + (layer * l->width + first + j) * out;
            for (int u = 0; u < 4; u++)
                acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(h[j]), load_lanes(row, o + 16 * u, first_lanes(out - o - 16 * u), 1), acc[u]);
        }
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(l->delta[kind] + t * out + o + 16 * u, first_lanes(out - o - 16 * u), acc[u]);
    }
    step_barrier(meet);
}

/* A product's value for token t and output n, rounded as the graph's product then its adapter's
   delta are (`preheat::packed_linear_lora`): the product rounded, the delta added, rounded again. */
static inline float with_delta(float product, const Lora *l, int kind, int64_t t, int64_t out, int64_t n) {
    return l->columns ? from_bf16(to_bf16(product)) + l->delta[kind][t * out + n] : product;
}

/* Rows 2 * pair and the next (of `rows`) of a product whose output is added to the residual h
   ([tokens, rows]): w [rows, k_len], its input x [tokens, k_len]; `kind` its adapters'. */
static inline void residual_pair(uint16_t *h, int64_t pair, int64_t rows, int64_t padded, int64_t tokens,
                                 const uint16_t *w, const uint16_t *x, int64_t k_len, float sums[2][MOST_TILE_TOKENS],
                                 const Lora *l, int kind) {
    const int64_t n0 = 2 * pair, n1 = n0 + 1 < rows ? n0 + 1 : n0;
    pair_dots(padded, w + n0 * k_len, w + n1 * k_len, x, k_len, k_len, sums);
    for (int64_t t = 0; t < tokens; t++) {
        h[t * rows + n0] = add_bf16(h[t * rows + n0], with_delta(sums[0][t], l, kind, t, rows, n0));
        if (n1 != n0) h[t * rows + n1] = add_bf16(h[t * rows + n1], with_delta(sums[1][t], l, kind, t, rows, n1));
    }
}

/* Token t's sums of 16 rows of a product on tiles, a lane a row (out: amx_rows', its rows
   `stride` apart), gathered. */
static inline __m512 token_sums(const float *out, int64_t stride, int64_t t) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)stride));
    return _mm512_i32gather_ps(rows, out + t, 4);
}

/* `with_delta` for outputs n to n + 15 of token t at once, on tiles (`fused`): the delta's
   expand computed here, its rows of B against this thread's shrink of the token. */
static inline __m512 with_deltas(__m512 products, const Lora *l, int kind, int64_t t, int64_t out, int64_t n) {
    if (!l->columns) return products;
    const int64_t first = l->columns[t][0], rank = l->a[kind] ? l->columns[t][1] : 0;
    const float *h = l->h + (t * KINDS + kind) * l->most_rank;
    __m512 delta = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; j++)
        delta = _mm512_fmadd_ps(_mm512_set1_ps(h[j]),
                                load_lanes(l->b[kind] + (l->layer * l->width + first + j) * out, n, 0xFFFF, 1), delta);
    return _mm512_add_ps(round_bf16_ps(products), delta);
}

/* The same on AMX tiles: rows 16 * block to the next 32 (16 where only 16 are left), their
   input paired by `pair_pack` (xp); `out` room for 32 rows of sums. */
static void residual_tiles(uint16_t *h, int64_t block, int64_t rows, int64_t tokens, const uint16_t *w,
                           const uint16_t *xp, int64_t k_len, float *out, const Lora *l, int kind) {
    const int64_t n0 = 16 * block, count = n0 + 32 <= rows ? 32 : 16, stride = sums_stride(tokens);
    amx_rows(w + n0 * k_len, count == 32 ? w + (n0 + 16) * k_len : NULL, k_len, xp, tokens, out);
    for (int64_t n = n0; n < n0 + count; n += 16)
        for (int64_t t = 0; t < tokens; t++) {
            const __m512 p = with_deltas(token_sums(out + (n - n0) * stride, stride, t), l, kind, t, rows, n);
            const __m512 sum = _mm512_add_ps(load_lanes(h + t * rows, n, 0xFFFF, 1), round_bf16_ps(p));
            store_lanes(h + t * rows, n, 0xFFFF, sum, 1); /* add_bf16's rounding, 16 rows at once */
        }
}

/* A product added to the residual h ([tokens, rows]): w [rows, k_len] against x [tokens, k_len],
   its rows split over the step's threads (an orphaned `omp for`: every thread of the region calls
   it, and they meet at `meet` after it). On tiles where `xp` (this thread's room for x paired),
   else by dot products. */
static void residual_product(uint16_t *h, int64_t rows, int64_t tokens, int64_t padded, const uint16_t *w,
                             const uint16_t *x, int64_t k_len, uint16_t *xp, float *out,
                             float sums[2][MOST_TILE_TOKENS], const Lora *l, int kind, StepBarrier *meet) {
    if (xp) {
        pair_pack(x, k_len, tokens, k_len, xp);
        #pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < (rows / 16 + 1) / 2; pair++)
            residual_tiles(h, 2 * pair, rows, tokens, w, xp, k_len, out, l, kind);
    } else {
        #pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < (rows + 1) / 2; pair++)
            residual_pair(h, pair, rows, padded, tokens, w, x, k_len, sums, l, kind);
    }
    step_barrier(meet);
}

/* The step. table [layers, TABLE_WIDTH]: each layer's addresses (weights bf16 row-major as
   nn.Linear keeps them; keys and values the layer's [slots, kv_heads, capacity, head_dim]).
   Token t (ids[t]) sits at position where[t][2] of the row in slot where[t][0]; its key and
   value go to column where[t][1] of that slot, and its query sees the slot's columns 0 to
   where[t][1] (a row's earlier tokens of the step are written first). logits [kept, vocab]
   bf16: those of the tokens keep[0..kept). With `tiles`, its products run on AMX tiles (amx.c:
   granted and the sizes fit, as small_step_call proves). Returns 0, or -1 out of memory. */
static int small_step(const int64_t *table, const uint16_t *embed, const uint16_t *final_norm, const uint16_t *head,
                      const float *inv_freq, uint16_t *logits, const int64_t *ids, const int64_t (*where)[3],
                      int64_t tokens, const int64_t *keep, int64_t kept, Sizes z, float eps, float scale,
                      float rope_scaling, Lora *l, int tiles) {
    const int64_t hidden = z.hidden, dim = z.head_dim, half = dim / 2, q_rows = z.heads * dim;
    const int64_t kv_rows = z.kv_heads * dim, qkv_rows = q_rows + 2 * kv_rows, group = z.heads / z.kv_heads;
    const int64_t inter = z.intermediate, blocks = (inter + 15) / 16;
    int64_t most = 1; /* the most columns a token sees */
    for (int64_t t = 0; t < tokens; t++) most = where[t][1] + 1 > most ? where[t][1] + 1 : most;
    /* two or three tokens padded to four (each sum one chain: too short to hide the latency), more to GROUPs */
    const int64_t padded = tokens == 1 ? 1 : tokens <= 4 ? 4 : (tokens + GROUP - 1) / GROUP * GROUP;
    const int64_t padded_kept = kept == 1 ? 1 : kept <= 4 ? 4 : (kept + GROUP - 1) / GROUP * GROUP;
    const int threads = omp_get_max_threads();
    const int64_t widest = inter > hidden ? (inter > q_rows ? inter : q_rows) : (hidden > q_rows ? hidden : q_rows);
    const int64_t columns = tiles ? tile_stride(tokens) : 0; /* a token pair's row in `pairs` (pair_pack) */
    uint16_t *pairs = tiles ? malloc(2 * widest * columns * threads) : NULL;
    float *tile_sums = tiles ? malloc(sizeof(float) * 32 * MOST_TILE_TOKENS * threads) : NULL;
    /* Token-major; the products' inputs padded with zero tokens up to `padded`. */
    uint16_t *h = malloc(2 * hidden * tokens), *qkv = malloc(2 * qkv_rows * tokens);
    uint16_t *attn = calloc(q_rows * padded, 2), *mlp = calloc(inter * padded, 2);
    uint16_t *normed = calloc(hidden * padded * threads, 2);
    float *scores = malloc(sizeof(float) * z.heads * tokens * most), *cs = malloc(sizeof(float) * dim * tokens);
    const int64_t outs[KINDS] = {q_rows, kv_rows, kv_rows, hidden, inter, inter, hidden};
    int64_t delta_size = 0;
    for (int k = 0; k < KINDS; k++) delta_size += outs[k] * tokens;
    const int64_t shrunk = tokens * KINDS * (l->most_rank + 1); /* a thread's shrinks */
    float *lora_h = l->columns ? calloc(shrunk * threads, sizeof(float)) : NULL;
    float *deltas = l->columns && !tiles ? calloc(delta_size, sizeof(float)) : NULL; /* on tiles: fused */
    for (int64_t k = 0, at = 0; deltas && k < KINDS; at += outs[k] * tokens, k++) l->delta[k] = deltas + at;
    static const int QKV[3] = {LQ, LK, LV}, OUT[1] = {LO}, GATE_UP[2] = {LGATE, LUP}, DOWN_ONLY[1] = {LDOWN};
    int status = -1;
    if (!h || !qkv || !attn || !mlp || !normed || !scores || !cs || (l->columns && (!lora_h || (!tiles && !deltas))) ||
        (tiles && (!pairs || !tile_sums)))
        goto done;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(h + t * hidden, embed + ids[t] * hidden, 2 * hidden);
        for (int64_t i = 0; i < half; i++) { /* float32 angles, scaled, then bf16: the model's cos and sin */
            const float angle = (float)where[t][2] * inv_freq[i];
            cs[t * dim + i] = from_bf16(to_bf16(cosf(angle) * rope_scaling));
            cs[t * dim + half + i] = from_bf16(to_bf16(sinf(angle) * rope_scaling));
        }
    }
    StepBarrier meet = {0}; /* where the phases meet (each `omp for` is `nowait`) */
    #pragma omp parallel
    {
        uint16_t *x = normed + hidden * padded * omp_get_thread_num(); /* each thread's own copy of a norm */
        float sums[2][MOST_TILE_TOKENS];
        uint16_t *xp = tiles ? pairs + widest * columns * omp_get_thread_num() : NULL; /* its input, paired */
        float *out = tiles ? tile_sums + 32 * MOST_TILE_TOKENS * omp_get_thread_num() : NULL;
        if (tiles) amx_configure(tokens);
        Lora lora = *l; /* this thread's: its shrinks, the layer */
        lora.h = lora_h ? lora_h + shrunk * omp_get_thread_num() : NULL, lora.fused = tiles;
        for (int64_t layer = 0; layer < z.layers; layer++) {
            lora.layer = layer;
            const int64_t *at = table + TABLE_WIDTH * layer;
            const uint16_t *wq = (const uint16_t *)at[Q], *wk = (const uint16_t *)at[K], *wv = (const uint16_t *)at[V];
            const uint16_t *wo = (const uint16_t *)at[O], *wg = (const uint16_t *)at[GATE];
            const uint16_t *wu = (const uint16_t *)at[UP], *wd = (const uint16_t *)at[DOWN];
            uint16_t *keys = (uint16_t *)at[KEYS], *values = (uint16_t *)at[VALUES];
            for (int64_t t = 0; t < tokens; t++)
                rms_norm(h + t * hidden, (const uint16_t *)at[NORM_IN], x + t * hidden, hidden, eps);
            if (lora.columns) lora_phases(&lora, QKV, 3, x, hidden, outs, tokens, &meet);
            if (tiles) {
                pair_pack(x, hidden, tokens, hidden, xp);
                #pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < qkv_rows / 16; b++) { /* 16 rows of q, k or v */
                    const int64_t n = 16 * b, kind = n < q_rows ? LQ : n < q_rows + kv_rows ? LK : LV;
                    const int64_t row = kind == LQ ? n : kind == LK ? n - q_rows : n - q_rows - kv_rows;
                    amx_rows((kind == LQ ? wq : kind == LK ? wk : wv) + row * hidden, NULL, hidden, xp, tokens, out);
                    for (int64_t t = 0; t < tokens; t++) {
                        const __m512 sums16 = token_sums(out, sums_stride(tokens), t);
                        store_lanes(qkv + t * qkv_rows, n, 0xFFFF, with_deltas(sums16, &lora, kind, t, outs[kind], row), 1);
                    }
                }
            } else
            #pragma omp for schedule(static) nowait
            for (int64_t pair = 0; pair < (qkv_rows + 1) / 2; pair++) { /* q, k and v's rows as one matrix */
                const int64_t n0 = 2 * pair, n1 = n0 + 1 < qkv_rows ? n0 + 1 : n0;
                const uint16_t *rows[2];
                for (int i = 0; i < 2; i++) {
                    const int64_t n = i ? n1 : n0;
                    rows[i] = n < q_rows ? wq + n * hidden
                              : n < q_rows + kv_rows ? wk + (n - q_rows) * hidden
                                                     : wv + (n - q_rows - kv_rows) * hidden;
                }
                pair_dots(padded, rows[0], rows[1], x, hidden, hidden, sums);
                for (int i = 0; i < 2; i++) {
                    const int64_t n = i ? n1 : n0, kind = n < q_rows ? LQ : n < q_rows + kv_rows ? LK : LV;
                    const int64_t row = kind == LQ ? n : kind == LK ? n - q_rows : n - q_rows - kv_rows;
                    for (int64_t t = 0; t < tokens; t++)
                        qkv[t * qkv_rows + n] = to_bf16(with_delta(sums[i][t], &lora, kind, t, outs[kind], row));
                }
            }
            step_barrier(&meet);
            #pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < tokens * (z.heads + z.kv_heads); item++) {
                /* a query rotated; or a key rotated and written, and its value written */
                const int64_t t = item / (z.heads + z.kv_heads), g = item % (z.heads + z.kv_heads);
                uint16_t *own = qkv + t * qkv_rows;
                if (g < z.heads) {
                    rotate(own + g * dim, own + g * dim, cs + t * dim, half);
                    continue;
                }
                const int64_t kv = g - z.heads, to = ((where[t][0] * z.kv_heads + kv) * z.capacity + where[t][1]) * dim;
                rotate(own + q_rows + kv * dim, keys + to, cs + t * dim, half);
                memcpy(values + to, own + q_rows + kv_rows + kv * dim, 2 * dim);
            }
            step_barrier(&meet);
            #pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < tokens * z.heads; item++) {
                const int64_t t = item / z.heads, q = item % z.heads;
                const int64_t from = (where[t][0] * z.kv_heads + q / group) * z.capacity * dim;
                attend_head(qkv + t * qkv_rows + q * dim, keys + from, values + from, attn + t * q_rows + q * dim,
                            scores + item * most, where[t][1] + 1, dim, scale);
            }
            step_barrier(&meet);
            if (lora.columns) lora_phases(&lora, OUT, 1, attn, q_rows, outs + LO, tokens, &meet);
            residual_product(h, hidden, tokens, padded, wo, attn, q_rows, tiles ? xp : NULL, out, sums, &lora, LO, &meet);
            for (int64_t t = 0; t < tokens; t++)
                rms_norm(h + t * hidden, (const uint16_t *)at[NORM_POST], x + t * hidden, hidden, eps);
            if (lora.columns) lora_phases(&lora, GATE_UP, 2, x, hidden, outs + LGATE, tokens, &meet);
            if (tiles) pair_pack(x, hidden, tokens, hidden, xp);
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) { /* 16 rows of gate and of up, then their SiLU product */
                float gate[MOST_TILE_TOKENS][16], up[MOST_TILE_TOKENS][16];
                const int64_t first = 16 * b;
                const __mmask16 m = first_lanes(inter - first);
                if (tiles) {
                    amx_rows(wg + first * hidden, wu + first * hidden, hidden, xp, tokens, out);
                    const int64_t stride = sums_stride(tokens);
                    for (int64_t t = 0; t < tokens; t++) {
                        _mm512_storeu_ps(gate[t], with_deltas(token_sums(out, stride, t), &lora, LGATE, t, inter, first));
                        _mm512_storeu_ps(up[t], with_deltas(token_sums(out + 16 * stride, stride, t), &lora, LUP, t, inter, first));
                    }
                }
                for (int64_t k = 0; !tiles && k < 16 && first + k < inter; k++) { /* a gate row and its up row as a pair */
                    pair_dots(padded, wg + (first + k) * hidden, wu + (first + k) * hidden, x, hidden, hidden, sums);
                    for (int64_t t = 0; t < tokens; t++) {
                        gate[t][k] = with_delta(sums[0][t], &lora, LGATE, t, inter, first + k);
                        up[t][k] = with_delta(sums[1][t], &lora, LUP, t, inter, first + k);
                    }
                }
                for (int64_t t = 0; t < tokens; t++) {
                    const __m512 g16 = round_bf16_ps(_mm512_maskz_loadu_ps(m, gate[t]));
                    const __m512 u16 = round_bf16_ps(_mm512_maskz_loadu_ps(m, up[t]));
                    store_lanes(mlp + t * inter, first, m, silu_times(g16, u16), 1);
                }
            }
            step_barrier(&meet);
            if (lora.columns) lora_phases(&lora, DOWN_ONLY, 1, mlp, inter, outs + LDOWN, tokens, &meet);
            residual_product(h, hidden, tokens, padded, wd, mlp, inter, tiles ? xp : NULL, out, sums, &lora, LDOWN, &meet);
        }
        /* the kept tokens' final norms, packed (rows past `kept` stay zeros: padded_kept <= padded) */
        memset(x, 0, 2 * hidden * padded);
        for (int64_t k = 0; k < kept; k++) rms_norm(h + keep[k] * hidden, final_norm, x + k * hidden, hidden, eps);
        const int64_t tiled = tiles ? z.vocab / 16 * 16 : 0; /* the head's rows on tiles; the rest by dots */
        if (tiles) {
            if (kept != tokens) amx_configure(kept);
            pair_pack(x, hidden, kept, hidden, xp);
            #pragma omp for schedule(static) nowait
            for (int64_t pair = 0; pair < (tiled / 16 + 1) / 2; pair++) {
                const int64_t n0 = 32 * pair, count = n0 + 32 <= tiled ? 32 : 16;
                amx_rows(head + n0 * hidden, count == 32 ? head + (n0 + 16) * hidden : NULL, hidden, xp, kept, out);
                for (int64_t n = n0; n < n0 + count; n += 16)
                    for (int64_t k = 0; k < kept; k++)
                        store_lanes(logits + k * z.vocab, n, 0xFFFF, token_sums(out + (n - n0) * sums_stride(kept), sums_stride(kept), k), 1);
            }
        }
        #pragma omp for schedule(static) nowait
        for (int64_t pair = tiled / 2; pair < (z.vocab + 1) / 2; pair++) {
            const int64_t n0 = 2 * pair, n1 = n0 + 1 < z.vocab ? n0 + 1 : n0;
            pair_dots(padded_kept, head + n0 * hidden, head + n1 * hidden, x, hidden, hidden, sums);
            for (int64_t k = 0; k < kept; k++)
                logits[k * z.vocab + n0] = to_bf16(sums[0][k]), logits[k * z.vocab + n1] = to_bf16(sums[1][k]);
        }
        step_barrier(&meet); /* so the region's own closing barrier finds every thread there */
        if (tiles) amx_release();
    }
    status = 0;
done:
    free(h), free(qkv), free(attn), free(mlp), free(normed), free(scores), free(cs), free(lora_h), free(deltas);
    free(pairs), free(tile_sums);
    return status;
}

static int most_tokens(int tiles) { return tiles ? MOST_TILE_TOKENS : MOST_TOKENS; }

/* small_step(...) as smallstep.h reads it: `stacks` [KINDS][2] the adapters' A and B (0: a kind
   none adapts), `columns` [tokens][2] (0: no adapters); `tiles` proven granted and fitting here. */
PyObject *small_step_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    StepArgs a;
    if (step_arguments("small_step", args, nargs, most_tokens, &a) != 0) return NULL;
    const Sizes z = a.z;
    /* tiles: 16 rows of a product a tile, 32 of its inputs a step (amx.c) */
    const int64_t q_rows = z.heads * z.head_dim, kv_rows = z.kv_heads * z.head_dim;
    if (a.tiles && !(amx_ready() && z.hidden % 32 == 0 && q_rows % 32 == 0 && z.intermediate % 32 == 0 &&
                     kv_rows % 16 == 0)) {
        PyErr_SetString(PyExc_ValueError, "small_step: tiles asked for, but AMX is not granted here or the sizes "
                        "are not multiples of 32 inputs and 16 rows");
        return NULL;
    }
    Lora lora = {.columns = a.columns, .width = a.width, .most_rank = a.most_rank};
    for (int k = 0; a.columns && k < KINDS; k++)
        lora.a[k] = (const uint16_t *)a.stacks[k][0], lora.b[k] = a.stacks[k][0] ? (const uint16_t *)a.stacks[k][1] : NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = small_step(a.table, a.embed, a.final_norm, a.head, a.inv_freq, a.logits, a.ids, a.where, a.tokens,
                        a.keep, a.kept, z, a.eps, a.scale, a.rope_scaling, &lora, a.tiles);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
