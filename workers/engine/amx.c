/* The small step's products on AMX tiles (smallstep.c), where the CPU has AMX-BF16 and Linux
   lets this process use its tile data: 16 weight rows against every token of the step in one
   tile instruction per 32 inputs, against one AVX-512 bf16 dot product per row, token and 32
   inputs. A step of 2 to 16 tokens then reads its weights at about the memory's pace, as one
   token does, instead of waiting on the dot products. Measured on the real model, 2 cores of
   an Intel host with AMX, kernel calls in one process: 16 rows 18.1 against 60.4 ms, 4 rows
   14.3 against 22.4, 2 rows 12.8 against 21.1, one row 12.4 against 14.3 (the weights' bytes
   over the memory's bandwidth: 10-13 ms); up to 64 tokens a step (`tile_stride`).

   Tiles: the weights as they lie (rows of nn.Linear's [out, in], 16 rows by 32 inputs, the
   "A" operand); the step's inputs in pairs ("B": for each pair of inputs, every token's two
   values side by side: `pair_pack`); the sums, float32, 16 rows by the step's tokens. */
#include <cpuid.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpukernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch/x86/include/uapi/asm/prctl.h */
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Whether the CPU has AMX-BF16 and the kernel granted this process its tile data (once: the
   grant holds for every thread of the process). Called with the GIL held. */
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        const int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        ready = tiles && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

/* How many columns a product's sums take per row in `out` (and its paired input per pair of
   inputs): the tokens themselves up to 16; past that, 32 or 64 (groups of 16 tokens a tile,
   the last padded with zero tokens). */
int64_t tile_stride(int64_t tokens) { return tokens <= 16 ? tokens : tokens <= 32 ? 32 : 64; }

/* How many floats apart `amx_rows` writes the rows of its sums: at least 16, so that
   smallstep.c's `token_sums` reads 16 rows of one token with one gather. */
int64_t sums_stride(int64_t tokens) { return tokens <= 16 ? 16 : tile_stride(tokens); }

/* This thread's tiles for steps of `tokens` (1 to 64). Up to 16 tokens: sums 0 and 1 [16 rows]
   [tokens] float32, weights 2 and 3 [16 rows][32 inputs], inputs 4 [16 pairs][tokens * 2].
   Past 16, every tile 16 rows of 64 bytes: 32 tokens, sums 0-3 (two blocks of rows by two
   groups of tokens), weights 4 and 5, inputs 6 and 7; 64 tokens, sums 0-3 (one block of rows
   by four groups), weights 4, inputs 5. */
__attribute__((target("amx-tile"))) void amx_configure(int64_t tokens) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < (tokens <= 16 ? 5 : 8); tile++) {
        config.rows[tile] = 16;
        config.colsb[tile] = (uint16_t)(tokens > 16 || tile == 2 || tile == 3 ? 64 : tokens * 4);
    }
    /* GCC's ldtilecfg names only the first 8 bytes of its operand, so the rest of the stores
       above would be dropped as dead (the instruction then faults): they are kept. */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void amx_release(void) { _tile_release(); }

/* x [tokens][k_len] (rows `stride` apart) as AMX takes its second operand: for each pair of
   inputs p, every token's x[t][2p] and x[t][2p + 1] side by side, zeros for the tokens that
   pad them to `tile_stride` (xp [k_len / 2][tile_stride(tokens)][2]). */
void pair_pack(const uint16_t *x, int64_t stride, int64_t tokens, int64_t k_len, uint16_t *xp) {
    const int64_t columns = tile_stride(tokens);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)stride));
    for (int64_t g = 0; g < columns; g += 16) { /* 16 tokens' pairs at a time, gathered, zeros past `tokens` */
        const __mmask16 live = first_lanes(tokens - g), kept = first_lanes(columns - g);
        const uint16_t *from = x + g * stride;
        for (int64_t p = 0; p < k_len / 2; p++) {
            const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, from + 2 * p, 2);
            _mm512_mask_storeu_epi32(xp + 2 * (p * columns + g), kept, pairs);
        }
    }
}

/* out[i][t] = w0's row i . x[t] for the 16 rows at w0 (and out[16 + i][t] for those at w1, when
   not NULL), every row k_len inputs long (a multiple of 32), out's rows sums_stride(tokens)
   apart; xp: x by `pair_pack`. The tiles configured for `tokens` (amx_configure). */
__attribute__((target("amx-tile,amx-bf16"))) void amx_rows(const uint16_t *w0, const uint16_t *w1, int64_t k_len,
                                                            const uint16_t *xp, int64_t tokens, float *out) {
    const int64_t pitch = tile_stride(tokens) * 4, stored = sums_stride(tokens) * 4, rows2 = 16 * sums_stride(tokens);
    if (tokens <= 16) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < k_len; k += 32) {
            _tile_loadd(4, xp + k * tokens, pitch);
            _tile_loadd(2, w0 + k, k_len * 2);
            _tile_dpbf16ps(0, 2, 4);
            if (w1) {
                _tile_loadd(3, w1 + k, k_len * 2);
                _tile_dpbf16ps(1, 3, 4);
            }
        }
        _tile_stored(0, out, stored);
        if (w1) _tile_stored(1, out + rows2, stored);
    } else if (tile_stride(tokens) == 32) { /* both blocks of rows against both groups of tokens */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < k_len; k += 32) {
            _tile_loadd(6, xp + k * 32, pitch);
            _tile_loadd(7, xp + k * 32 + 32, pitch);
            _tile_loadd(4, w0 + k, k_len * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (w1) {
                _tile_loadd(5, w1 + k, k_len * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, out, pitch);
        _tile_stored(1, out + 16, pitch);
        if (w1) {
            _tile_stored(2, out + rows2, pitch);
            _tile_stored(3, out + rows2 + 16, pitch);
        }
    } else { /* 64: each block of rows against the four groups of tokens, one block at a time */
        for (int block = 0; block < (w1 ? 2 : 1); block++) {
            const uint16_t *w = block ? w1 : w0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < k_len; k += 32) {
                _tile_loadd(4, w + k, k_len * 2);
                _tile_loadd(5, xp + k * 64, pitch);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, xp + k * 64 + 32, pitch);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, xp + k * 64 + 64, pitch);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, xp + k * 64 + 96, pitch);
                _tile_dpbf16ps(3, 4, 5);
            }
            float *to = out + block * rows2;
            _tile_stored(0, to, pitch);
            _tile_stored(1, to + 16, pitch);
            _tile_stored(2, to + 32, pitch);
            _tile_stored(3, to + 48, pitch);
        }
    }
}
