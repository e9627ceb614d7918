/* amx_tiles.h — the handful of AMX tile primitives the tile kernels (matmul_amx.c,
 * attention_amx.c) are written against, so that one kernel source builds two ways:
 *
 *   real      (default): the AMX-TILE / AMX-INT8 instructions through their intrinsics;
 *   emulated  (TL_AMX_EMULATION, a test-only CMake build): plain C with the instructions'
 *             semantics on a per-thread file of 8 tiles, so the packing, blocking and edge
 *             handling run bit for bit on any CPU
 *             (the rest of the AMX path needs AVX2). It also checks what the hardware would fault
 *             on (an unconfigured tile, shapes that do not match) and traps there.
 *
 * A tile is up to 16 rows of up to 64 bytes. tl_tile_dpbssd(c, a, b) is TDPBSSD: for each row m
 * of c and each int32 column n, c[m][n] += Σ_k a[m][k] * b[k/4][4n + k%4] over the a row's bytes
 * as int8 (b in the "VNNI" layout: 4 consecutive k of one column side by side), with wrap-around
 * int32 additions and no saturation. Tile numbers must be constants (the instructions encode
 * them). TL_TILES is the function attribute every caller of the primitives carries. */
#ifndef TL_AMX_TILES_H
#define TL_AMX_TILES_H

#include <stddef.h>
#include <stdint.h>

enum { TL_TILE_ROWS = 16, TL_TILE_BYTES = 64, TL_TILE_COUNT = 8 };

/* The 64-byte operand of LDTILECFG (palette 1). */
typedef struct tl_tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i (entries 8..15 must be 0) */
    uint8_t rows[16];   /* rows of tile i                                   */
} tl_tile_config;

/* What every tile kernel here uses: all eight tiles 16 rows x 64 bytes. A static constant:
 * GCC 12's LDTILECFG builtin tells the compiler it reads fewer bytes than it does, so stores
 * into a local config could be dropped. */
static const tl_tile_config tl_tiles_full = {
    .palette = 1,
    .colsb = {TL_TILE_BYTES, TL_TILE_BYTES, TL_TILE_BYTES, TL_TILE_BYTES, TL_TILE_BYTES, TL_TILE_BYTES,
              TL_TILE_BYTES, TL_TILE_BYTES},
    .rows = {TL_TILE_ROWS, TL_TILE_ROWS, TL_TILE_ROWS, TL_TILE_ROWS, TL_TILE_ROWS, TL_TILE_ROWS, TL_TILE_ROWS,
             TL_TILE_ROWS},
};

#if !defined(TL_AMX_EMULATION)

#include <immintrin.h>

#define TL_TILES __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
#define tl_tiles_configure(cfg) _tile_loadconfig(cfg)
#define tl_tiles_release() _tile_release()
#define tl_tile_zero(t) _tile_zero(t)
#define tl_tile_load(t, base, stride) _tile_loadd(t, base, stride)
#define tl_tile_store(t, base, stride) _tile_stored(t, base, stride)
#define tl_tile_dpbssd(c, a, b) _tile_dpbssd(c, a, b)

#else

#include <string.h>

#define TL_TILES

typedef struct tl_emulated_tile {
    unsigned rows, colsb;
    uint8_t data[TL_TILE_ROWS][TL_TILE_BYTES];
} tl_emulated_tile;

typedef struct tl_emulated_tiles {
    int configured;
    tl_emulated_tile t[TL_TILE_COUNT];
} tl_emulated_tiles;

static _Thread_local tl_emulated_tiles tl_emulated;

/* Where the hardware would raise a fault; in the test build, stop at once. */
static inline void tl_tile_check(int ok) {
    if (!ok) __builtin_trap();
}

static inline void tl_tiles_configure(const tl_tile_config* cfg) {
    tl_tile_check(cfg->palette == 1);
    for (int i = 0; i < TL_TILE_COUNT; i++) {
        tl_tile_check(cfg->rows[i] <= TL_TILE_ROWS && cfg->colsb[i] <= TL_TILE_BYTES && cfg->colsb[i] % 4 == 0);
        tl_emulated.t[i].rows = cfg->rows[i];
        tl_emulated.t[i].colsb = cfg->colsb[i];
        memset(tl_emulated.t[i].data, 0, sizeof tl_emulated.t[i].data);
    }
    tl_emulated.configured = 1;
}

static inline void tl_tiles_release(void) { tl_emulated.configured = 0; }

static inline tl_emulated_tile* tl_tile_at(int t) {
    tl_tile_check(tl_emulated.configured && t >= 0 && t < TL_TILE_COUNT && tl_emulated.t[t].rows > 0);
    return &tl_emulated.t[t];
}

static inline void tl_tile_zero(int t) { memset(tl_tile_at(t)->data, 0, sizeof tl_tile_at(t)->data); }

static inline void tl_tile_load(int t, const void* base, size_t stride) {
    tl_emulated_tile* T = tl_tile_at(t);
    memset(T->data, 0, sizeof T->data);
    for (unsigned r = 0; r < T->rows; r++) memcpy(T->data[r], (const uint8_t*)base + r * stride, T->colsb);
}

static inline void tl_tile_store(int t, void* base, size_t stride) {
    const tl_emulated_tile* T = tl_tile_at(t);
    for (unsigned r = 0; r < T->rows; r++) memcpy((uint8_t*)base + r * stride, T->data[r], T->colsb);
}

static inline void tl_tile_dpbssd(int c, int a, int b) {
    tl_emulated_tile *C = tl_tile_at(c), *A = tl_tile_at(a), *B = tl_tile_at(b);
    tl_tile_check(C->rows == A->rows && C->colsb == B->colsb && A->colsb == 4 * B->rows && c != a && c != b &&
                  a != b);
    for (unsigned m = 0; m < C->rows; m++)
        for (unsigned n = 0; n < C->colsb / 4; n++) {
            uint32_t acc;
            memcpy(&acc, &C->data[m][4 * n], sizeof acc);
            for (unsigned k = 0; k < A->colsb; k++)
                acc += (uint32_t)((int32_t)(int8_t)A->data[m][k] * (int8_t)B->data[k / 4][4 * n + k % 4]);
            memcpy(&C->data[m][4 * n], &acc, sizeof acc);
        }
}

#endif

#endif
