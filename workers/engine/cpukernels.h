/* What preheat's CPU kernels share (cpukernels.c, smallstep.c): bf16 and float32 lanes, the
   bf16 rounding the model's own ops make, one row's dot product and one head's attention. */
#ifndef PREHEAT_CPUKERNELS_H
#define PREHEAT_CPUKERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Round to nearest even, as torch rounds a float32 to bfloat16 (a NaN stays a NaN). */
static inline __m512 round_bf16_ps(__m512 value) {
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if (value != value) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* Up to 16 values (the lanes of m) of a bf16 or float32 row, as float32; and back, rounded to
   nearest even where bf16 (the model's own rounding). */
static inline __m512 load_lanes(const void *row, int64_t at, __mmask16 m, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)row + at);
    const __m256i half = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline void store_lanes(void *row, int64_t at, __mmask16 m, __m512 value, int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)row + at, m, value);
        return;
    }
    const __m512i rounded = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(value)), 16);
    _mm256_mask_storeu_epi16((uint16_t *)row + at, m, _mm512_cvtepi32_epi16(rounded));
}

/* How far ahead of the row a product reads its weights are fetched into the cache, in rows.
   The products keep too few rows' loads in flight for the memory's latency (the out-of-order
   window holds a row or two of a many-token product's instructions), and the hardware's own
   prefetch does not make up for it: on a 2-core Zen 5 the real model's one-row step took 7.5
   ms without this and 5.7-6.1 with it, a 16-row step 32 and 13 ms (2 and 8 rows measured the same).
   One row's products stream in order, which some CPUs' own prefetch follows better: on a Zen 4
   the one-row step took 11.1 ms fetching ahead and 8.6-9.4 without (16 rows: 22-24 against 28),
   so whether they fetch ahead depends on the CPU (`one_row_ahead`, cpukernels.c). */
#define AHEAD_ROWS 4

extern int64_t one_row_ahead; /* 0 or AHEAD_ROWS: by the CPU (cpukernels.c) */

/* row . x over k_len bf16 pairs, summed in float32 by the CPU's bf16 dot product. Four sums
   hide the instruction's latency. */
static inline float dot_bf16(const uint16_t *row, const uint16_t *x, int64_t k_len) {
    const int64_t full = k_len / 128 * 128, part = k_len / 32 * 32;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    if (one_row_ahead)
        for (int64_t byte = 0; byte < 2 * k_len; byte += 64)
            _mm_prefetch((const char *)(row + one_row_ahead * k_len) + byte, _MM_HINT_T0);
    for (; k < full; k += 128)
        for (int i = 0; i < 4; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + k + 32 * i),
                                      (__m512bh)_mm512_loadu_si512(x + k + 32 * i));
    for (int i = 0; k < part; k += 32, i++)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (part < k_len) {
        const __mmask32 tail = (__mmask32)((1ULL << (k_len - part)) - 1);
        acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)_mm512_maskz_loadu_epi16(tail, row + part),
                                  (__m512bh)_mm512_maskz_loadu_epi16(tail, x + part));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
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

/* One query head against its key/value head's first `columns` positions: out = softmax(scale
   * q . k[j]) . v[j], bf16 in and out (rounded once), a float32 softmax; scores [columns]
   scratch. head_dim a multiple of 32, at most 256. */
static inline void attend_head(const uint16_t *qh, const uint16_t *kh, const uint16_t *vh, uint16_t *oh, float *s,
                               int64_t columns, int64_t head_dim, float scale) {
    const int64_t lanes = head_dim / 16;
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
        const __mmask16 m = first_lanes(columns - j);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(s + j, m, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    __m512 acc[16];
    for (int64_t c = 0; c < lanes; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < columns; j++) {
        const __m512 p = _mm512_set1_ps(s[j]);
        for (int64_t c = 0; c < lanes; c++)
            acc[c] = _mm512_fmadd_ps(p, load_lanes(vh, j * head_dim + 16 * c, 0xFFFF, 1), acc[c]);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t c = 0; c < lanes; c++) store_lanes(oh, 16 * c, 0xFFFF, _mm512_mul_ps(acc[c], inverse), 1);
}

/* Rows against several tokens at once (the small step's dot products, smallstep.c): at most
   DOT_TOKENS a call, so that their sums stay in registers. */
#define DOT_TOKENS 8

/* out0[t] = row0 . x[t] and out1[t] = row1 . x[t] for n tokens (n a constant where inlined:
   the 2n sums stay in registers), x's tokens `stride` apart: each piece of the two rows is read
   once for the n tokens, and each token's piece once for both rows, so the CPU's bf16 dot
   product, not the loads, sets the pace. */
static inline __attribute__((always_inline)) void pair_dots_n(const int n, const uint16_t *row0, const uint16_t *row1,
                                                              const uint16_t *x, int64_t stride, int64_t k_len,
                                                              float *out0, float *out1) {
    __m512 a[DOT_TOKENS], b[DOT_TOKENS];
    for (int t = 0; t < n; t++) a[t] = b[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 32) {
        _mm_prefetch((const char *)(row0 + k + AHEAD_ROWS * k_len), _MM_HINT_T0);
        _mm_prefetch((const char *)(row1 + k + AHEAD_ROWS * k_len), _MM_HINT_T0);
        const __mmask32 m = k_len - k >= 32 ? (__mmask32)0xFFFFFFFF : (__mmask32)((1u << (k_len - k)) - 1);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, row0 + k);
        const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m, row1 + k);
        for (int t = 0; t < n; t++) {
            const __m512bh value = (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * stride + k);
            a[t] = _mm512_dpbf16_ps(a[t], w0, value);
            b[t] = _mm512_dpbf16_ps(b[t], w1, value);
        }
    }
    for (int t = 0; t < n; t++) out0[t] = _mm512_reduce_add_ps(a[t]), out1[t] = _mm512_reduce_add_ps(b[t]);
}

/* amx.c: the small step's products on AMX tiles, where the CPU has them. */
int amx_ready(void);
int64_t tile_stride(int64_t tokens);
int64_t sums_stride(int64_t tokens);
void amx_configure(int64_t tokens);
void amx_release(void);
void pair_pack(const uint16_t *x, int64_t stride, int64_t tokens, int64_t k_len, uint16_t *xp);
void amx_rows(const uint16_t *w0, const uint16_t *w1, int64_t k_len, const uint16_t *xp, int64_t tokens, float *out);

#endif
