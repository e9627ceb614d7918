/* matmul_amx.c — the AMX linear kernel: 16 tokens x 16 rows x 64 k per TDPBSSD, exact int32.
 *
 * The weights are the AVX-512 layout (pack.c) with K padded to 64: a 16-row tile's k-block kb
 * (packed + tile * 16 * Kp + 1024 * kb, 16 rows of 64 bytes) is already a TDPBSSD B operand.
 * The A operand is 16 token rows of the quantized activations at 64 * kb, from acts->tiled,
 * where tl_linear_run has copied them tile by tile (each tile's 1 KiB contiguous; rows past n
 * are zeros, and their results are dropped). Tiles: 0..3 accumulators, 4..5 activations,
 * 6..7 weights.
 *
 * int8: a block of 2 row tiles x 2 token tiles, c[i][j] += A_j B_i over every kb, is the exact
 *       sum Σ q w (signed x signed, no offset to remove); tokens go in spans that keep their
 *       activations in L2 (token_span).
 * int4: a row tile's weights are unpacked once per call into the worker's scratch as two int8
 *       matrices hi, lo with m·w = 128·hi + lo (m the group multiplier 0..255, w in -8..7, so
 *       m·w is in -2040..1785, lo in -64..63 and hi in -16..14); then acc = 128 Σ q hi + Σ q lo,
 *       the exact Σ_g m Σ_{k∈g} q w modulo 2^32, hence exactly (the loader proved it fits).
 *       A block is 1 row tile x 2 token tiles x {hi, lo}.
 * The f32 epilogue is the spec's, tl_emit's, on the stored int32 accumulators (or those go raw,
 * matmul_kernels.h). "Tokens" are q rows: a block input's two digit rows count as two. */
#include <string.h>

#include "cpu/amx_tiles.h"
#include "cpu/matmul_kernels.h"

enum { TR = TL_TILE_ROWS, KB = TL_TILE_BYTES, TILE_BYTES = TR * KB };

/* Where a call writes: out's rows [.., row1) of tokens [.., n). */
typedef struct amx_out {
    const tl_gemm_out* out;
    size_t n;
} amx_out;

/* Tokens per pass over a call's rows: whole pairs of token tiles whose activations (span x Kp
 * bytes) stay within about 512 KiB of L2 while the rows' weights stream past them. Without
 * it a K = 5632 linear re-read 2.9 MB of activations from L3 for every pair of row tiles. */
static size_t token_span(size_t Kp) {
    const size_t span = ((size_t)1 << 19) / Kp / (2 * TR) * (2 * TR);
    return span > 2 * TR ? span : 2 * TR;
}

/* The 16-token x 16-row accumulator block acc (row-major, stride ld int32) at token t0, row r0,
 * put where o says: only tokens < n and rows < row1. */
static inline void emit_block(const tl_linear* L, const tl_acts* A, const int32_t* acc, size_t ld, size_t t0,
                              size_t r0, const amx_out* o) {
    const size_t row1 = o->out->row1, rows = row1 - r0 < TR ? row1 - r0 : TR;
    for (size_t t = 0; t < TR && t0 + t < o->n; t++)
        for (size_t r = 0; r < rows; r++) tl_gemm_put(o->out, L, A, t0 + t, r0 + r, acc[t * ld + r]);
}

/* int8: row tiles tile .. tile+rt-1 x tokens t0 .. t0+16*nt-1 (rt, nt in {1, 2}, constants at
 * every call site). */
TL_TILES static inline __attribute__((always_inline)) void int8_block(const tl_linear* L, const tl_acts* A,
                                                                      size_t tile, int rt, size_t t0, int nt,
                                                                      const amx_out* o) {
    const size_t Kp = L->cols_padded, blocks = Kp / KB;
    const uint8_t* B0 = L->packed + tile * TR * Kp;
    const uint8_t* B1 = B0 + TR * Kp;
    const int8_t* A0 = A->tiled + t0 / TR * blocks * TILE_BYTES;
    const int8_t* A1 = A0 + blocks * TILE_BYTES;
    tl_tile_zero(0);
    if (rt > 1) tl_tile_zero(1);
    if (nt > 1) tl_tile_zero(2);
    if (rt > 1 && nt > 1) tl_tile_zero(3);
    for (size_t kb = 0; kb < blocks; kb++) {
        tl_tile_load(4, A0 + TILE_BYTES * kb, KB);
        tl_tile_load(6, B0 + TILE_BYTES * kb, KB);
        tl_tile_dpbssd(0, 4, 6);
        if (rt > 1) {
            tl_tile_load(7, B1 + TILE_BYTES * kb, KB);
            tl_tile_dpbssd(1, 4, 7);
        }
        if (nt > 1) {
            tl_tile_load(5, A1 + TILE_BYTES * kb, KB);
            tl_tile_dpbssd(2, 5, 6);
            if (rt > 1) tl_tile_dpbssd(3, 5, 7);
        }
    }
    int32_t acc[2 * TR][2 * TR]; /* [token][row] */
    tl_tile_store(0, &acc[0][0], sizeof acc[0]);
    if (rt > 1) tl_tile_store(1, &acc[0][TR], sizeof acc[0]);
    if (nt > 1) tl_tile_store(2, &acc[TR][0], sizeof acc[0]);
    if (rt > 1 && nt > 1) tl_tile_store(3, &acc[TR][TR], sizeof acc[0]);
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < rt; i++)
            emit_block(L, A, &acc[TR * j][TR * i], 2 * TR, t0 + TR * j, (tile + i) * TR, o);
}

TL_TILES static void int8_rows(const tl_linear* L, const tl_acts* A, uint32_t row0, const amx_out* o) {
    const size_t tiles_end = (o->out->row1 + TR - 1) / TR;
    const size_t span = token_span(L->cols_padded);
    for (size_t tb = 0; tb < o->n; tb += span) {
        const size_t te = tb + span < o->n ? tb + span : o->n;
        for (size_t tile = row0 / TR; tile < tiles_end; tile += 2) {
            const bool two_rows = tile + 1 < tiles_end;
            size_t t0 = tb;
            for (; t0 + TR < te; t0 += 2 * TR) {
                if (two_rows) int8_block(L, A, tile, 2, t0, 2, o);
                else int8_block(L, A, tile, 1, t0, 2, o);
            }
            if (t0 < te) {
                if (two_rows) int8_block(L, A, tile, 2, t0, 1, o);
                else int8_block(L, A, tile, 1, t0, 1, o);
            }
        }
    }
}

/* Unpacks row tile `tile` of an int4 linear into hi and lo ([Kp/64] TDPBSSD B blocks each):
 * packed step st (16 rows x 4 bytes) holds k = 8st + b in its low nibbles (B row 2st) and
 * k = 8st + 4 + b in its high nibbles (B row 2st + 1); the group of a B row is 4 * row / gs
 * (gs is a multiple of 8). B rows from K/4 up to Kp/4 are zero. */
/* One B row of hi and lo from the nibbles at `shift` of the 64 packed bytes w. */
TL_TILES static inline void split_nibbles(const uint8_t* restrict w, int shift, const int16_t* restrict m,
                                          int8_t* restrict hi, int8_t* restrict lo) {
    for (int i = 0; i < KB; i++) {
        const int16_t e = (int16_t)(m[i] * (((w[i] >> shift) & 15) - 8));
        const int16_t low = (int16_t)(((e + 64) & 127) - 64);
        hi[i] = (int8_t)((e - low) >> 7); /* e - low is a multiple of 128 */
        lo[i] = (int8_t)low;
    }
}

TL_TILES static void unpack_int4(const tl_linear* L, size_t tile, int8_t* restrict hi, int8_t* restrict lo) {
    const size_t K = L->src.cols, gs = L->src.group_size, groups = K / gs, steps = K / 8;
    const uint8_t* W = L->packed + tile * (TR * K / 2);
    const int32_t* mult = L->mult + tile * groups * TR;
    int16_t m[KB]; /* the group multiplier of each byte of a B row: row i / 4 of the tile */
    for (size_t st = 0; st < steps; st++) {
        if (8 * st % gs == 0)
            for (int i = 0; i < KB; i++) m[i] = (int16_t)mult[(8 * st / gs) * TR + i / 4];
        const uint8_t* w = W + KB * st;
        split_nibbles(w, 0, m, hi + 2 * st * KB, lo + 2 * st * KB);
        split_nibbles(w, 4, m, hi + (2 * st + 1) * KB, lo + (2 * st + 1) * KB);
    }
    const size_t used = K / 4 * KB, all = L->cols_padded / 4 * KB;
    memset(hi + used, 0, all - used);
    memset(lo + used, 0, all - used);
}

/* int4: tokens t0 .. t0+16*nt-1 of one unpacked row tile (nt in {1, 2}). */
TL_TILES static inline __attribute__((always_inline)) void int4_block(const tl_linear* L, const tl_acts* A,
                                                                      const int8_t* hi, const int8_t* lo,
                                                                      size_t tile, size_t t0, int nt,
                                                                      const amx_out* o) {
    const size_t blocks = L->cols_padded / KB;
    const int8_t* A0 = A->tiled + t0 / TR * blocks * TILE_BYTES;
    const int8_t* A1 = A0 + blocks * TILE_BYTES;
    tl_tile_zero(0);
    tl_tile_zero(1);
    if (nt > 1) {
        tl_tile_zero(2);
        tl_tile_zero(3);
    }
    for (size_t kb = 0; kb < blocks; kb++) {
        tl_tile_load(4, A0 + TILE_BYTES * kb, KB);
        tl_tile_load(6, hi + TILE_BYTES * kb, KB);
        tl_tile_load(7, lo + TILE_BYTES * kb, KB);
        tl_tile_dpbssd(0, 4, 6);
        tl_tile_dpbssd(1, 4, 7);
        if (nt > 1) {
            tl_tile_load(5, A1 + TILE_BYTES * kb, KB);
            tl_tile_dpbssd(2, 5, 6);
            tl_tile_dpbssd(3, 5, 7);
        }
    }
    int32_t acc_hi[2 * TR][TR], acc_lo[2 * TR][TR]; /* [token][row] */
    tl_tile_store(0, &acc_hi[0][0], sizeof acc_hi[0]);
    tl_tile_store(1, &acc_lo[0][0], sizeof acc_lo[0]);
    if (nt > 1) {
        tl_tile_store(2, &acc_hi[TR][0], sizeof acc_hi[0]);
        tl_tile_store(3, &acc_lo[TR][0], sizeof acc_lo[0]);
    }
    for (int t = 0; t < TR * nt; t++)
        for (int r = 0; r < TR; r++)
            acc_hi[t][r] = (int32_t)((uint32_t)acc_hi[t][r] * 128u + (uint32_t)acc_lo[t][r]);
    emit_block(L, A, &acc_hi[0][0], TR, t0, tile * TR, o);
    if (nt > 1) emit_block(L, A, &acc_hi[TR][0], TR, t0 + TR, tile * TR, o);
}

TL_TILES static void int4_rows(const tl_linear* L, const tl_acts* A, uint32_t row0, uint8_t* scratch,
                               const amx_out* o) {
    int8_t* hi = (int8_t*)scratch;
    int8_t* lo = hi + (size_t)TR * L->cols_padded;
    for (size_t tile = row0 / TR; tile * TR < o->out->row1; tile++) {
        unpack_int4(L, tile, hi, lo);
        size_t t0 = 0;
        for (; t0 + TR < o->n; t0 += 2 * TR) int4_block(L, A, hi, lo, tile, t0, 2, o);
        if (t0 < o->n) int4_block(L, A, hi, lo, tile, t0, 1, o);
    }
}

size_t tl_amx_scratch_bytes(size_t cols) { return 2 * (size_t)TR * ((cols + KB - 1) / KB * KB); }

TL_TILES void tl_gemm_amx(const tl_linear* L, const tl_acts* A, uint32_t row0, const tl_gemm_out* out,
                          uint8_t* scratch) {
    const amx_out o = {out, tl_acts_rows(A)};
    tl_tiles_configure(&tl_tiles_full);
    if (L->src.group_size) int4_rows(L, A, row0, scratch, &o);
    else int8_rows(L, A, row0, &o);
    tl_tiles_release();
}
