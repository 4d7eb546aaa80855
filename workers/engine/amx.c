/* The small step's products on AMX tiles (smallstep.c), where the CPU has AMX-BF16 and Linux
   lets this process use its tile data: 16 weight rows against every token of the step in one
   tile instruction per 32 inputs, against one AVX-512 bf16 dot product per row, token and 32
   inputs. A step of 2 to 16 tokens then reads its weights at about the memory's pace, as one
   token does, instead of waiting on the dot products. Measured on the real model, 2 cores of
   an Intel host with AMX, kernel calls in one process: 16 rows 22.4 against 60.4 ms, 4 rows
   14.3 against 22.4, 2 rows 12.8 against 21.1, one row 12.4 against 14.3 (the weights' bytes
   over the memory's bandwidth: 10-13 ms).

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

/* This thread's tiles for steps of `tokens` (2 to 16): sums 0 and 1 [16 rows][tokens] float32,
   weights 2 and 3 [16 rows][32 inputs], inputs 4 [16 pairs][tokens * 2]. */
__attribute__((target("amx-tile"))) void amx_configure(int64_t tokens) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 5; tile++) {
        config.rows[tile] = 16;
        config.colsb[tile] = (uint16_t)(tile == 2 || tile == 3 ? 64 : tokens * 4);
    }
    /* GCC's ldtilecfg names only the first 8 bytes of its operand, so the rest of the stores
       above would be dropped as dead (the instruction then faults): they are kept. */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void amx_release(void) { _tile_release(); }

/* x [tokens][k_len] (rows `stride` apart) as AMX takes its second operand: for each pair of
   inputs p, every token's x[t][2p] and x[t][2p + 1] side by side (xp [k_len / 2][tokens][2]). */
void pair_pack(const uint16_t *x, int64_t stride, int64_t tokens, int64_t k_len, uint16_t *xp) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t p = 0; p < k_len / 2; p++) memcpy(xp + 2 * (p * tokens + t), x + t * stride + 2 * p, 4);
}

/* out[i][t] = w0's row i . x[t] for the 16 rows at w0 (and out[16 + i][t] for those at w1, when
   not NULL), every row k_len inputs long (a multiple of 32); xp: x by `pair_pack`. The tiles
   configured for `tokens` (amx_configure). */
__attribute__((target("amx-tile,amx-bf16"))) void amx_rows(const uint16_t *w0, const uint16_t *w1, int64_t k_len,
                                                            const uint16_t *xp, int64_t tokens, float *out) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < k_len; k += 32) {
        _tile_loadd(4, xp + k * tokens, tokens * 4);
        _tile_loadd(2, w0 + k, k_len * 2);
        _tile_dpbf16ps(0, 2, 4);
        if (w1) {
            _tile_loadd(3, w1 + k, k_len * 2);
            _tile_dpbf16ps(1, 3, 4);
        }
    }
    _tile_stored(0, out, tokens * 4);
    if (w1) _tile_stored(1, out + 16 * tokens, tokens * 4);
}
