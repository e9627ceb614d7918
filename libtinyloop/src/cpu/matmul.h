/* matmul.h — exact integer linear layers (docs/spec.md §3) on T tokens at once.
 *
 *   y[t][j] = ((f32) acc[t][j] * a[t]) * ws[j],   acc[t][j] = Σ_k q[t][k] * w[j][k]   (int8)
 *                                                 acc[t][j] = Σ_g m[j][g] Σ_{k∈g} q w  (int4)
 *
 * acc is an exact integer (the loader proved it fits in i32), so every kernel path — scalar,
 * AVX2, AVX-512 VNNI, AMX tiles — returns identical bits; SIMD paths may compute it modulo 2^32
 * with offset tricks because the true value is known to fit. Weights are repacked once at load
 * into the layout of the chosen path (pack.c); each kernel processes several tokens per pass
 * over a tile of weights, so prefill is a GEMM. The AMX path runs calls of TL_AMX_MIN_TOKENS
 * tokens or more on tiles and fewer on the AVX-512 kernel, which shares its packed weights. */
#ifndef TL_MATMUL_H
#define TL_MATMUL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"
#include "cpu/threadpool.h"

#if defined(TL_AMX_EMULATION)
enum { TL_AMX_MIN_TOKENS = 1 };  /* the test build runs every call on the emulated tiles  */
#else
enum { TL_AMX_MIN_TOKENS = 16 }; /* fewer tokens than a tile has rows: AVX-512 is as fast  */
#endif

/* Quantized input rows of a linear, one per token. */
typedef struct tl_acts {
    size_t n;         /* tokens                                                     */
    size_t stride;    /* bytes per row: tl_acts_stride(K)                           */
    int8_t* q;        /* [n][stride], zero from K to stride                         */
    uint8_t* qx;      /* [n][stride] = q + 128 as u8 (SIMD paths), see tl_acts_finish_row */
    float* scale;     /* [n] a (from NQ) or s (from Q8)                              */
    uint8_t* scratch; /* [pool threads][scratch_bytes] for the kernels, see below    */
    size_t scratch_bytes;
    int8_t* tiled;    /* [tl_acts_tiled_bytes] AMX: q in tile order (tl_linear_run fills it) */
} tl_acts;

static inline size_t tl_acts_stride(size_t cols) { return (cols + 63) / 64 * 64; }
/* Scratch bytes per pool thread that a call of n tokens on a linear of at most `cols` columns
 * needs on `isa`: the AMX int4 path unpacks a row tile there; 0 for every other call. */
size_t tl_linear_scratch_bytes(tl_isa isa, size_t n, size_t cols);
/* Bytes of acts->tiled a call of n tokens of at most `cols` columns needs on `isa`: the AMX
 * kernel loads its activation tiles from a copy of q laid out [n/16][K/64][16][64], each tile
 * contiguous; 0 (tiled may be NULL) for every other call. */
size_t tl_acts_tiled_bytes(tl_isa isa, size_t n, size_t cols);

/* A linear prepared for one kernel path. */
typedef struct tl_linear {
    tl_linear_src src;     /* the file's shape; its weights only where tl_linear_reads_src */
    tl_isa isa;            /* path that runs this linear                                 */
    uint32_t tile_rows;    /* rows per packed tile: 8 (AVX2) or 16 (AVX-512, AMX)        */
    uint32_t rows_padded;  /* R rounded up to tile_rows                                  */
    uint32_t cols_padded;  /* K rounded up to 8 (64 on AMX: whole tile k-blocks)         */
    uint8_t* packed;       /* SIMD weights, see pack.c for the layout                    */
    int32_t* mult;         /* int4: [tiles][K/gs][tile_rows] group multipliers           */
    int32_t* corr;         /* 16-row tiles: [rows_padded] the u8-activation offset       */
    float* scale;          /* [rows_padded] row scales, zero-padded                      */
} tl_linear;

/* Repack `src` for `isa` (an int4 linear whose group size is not a multiple of 8 runs on the
 * scalar path). On failure nothing is allocated. */
tl_status tl_linear_prepare(tl_linear* out, const tl_linear_src* src, tl_isa isa);
/* Whether the prepared linear still reads the weights of its source (the scalar path runs on
 * the file's layout); when it does not, the caller may free them (tl_file_release_linear). */
static inline bool tl_linear_reads_src(const tl_linear* lin) { return lin->isa == TL_ISA_SCALAR; }
void tl_linear_release(tl_linear* lin);
size_t tl_linear_bytes(const tl_linear* lin);

/* Fill qx[t] from q[t] (needed before a SIMD linear reads row t). */
void tl_acts_finish_row(tl_acts* acts, size_t t);

/* y[t][j] for t < acts->n, j < R into y + t * y_stride; with `accumulate`, y += instead
 * (one f32 addition per element). Rows are split over the pool. */
void tl_linear_run(const tl_linear* lin, const tl_acts* acts, float* y, size_t y_stride,
                   bool accumulate, tl_pool* pool);

/* The kernel of one path: rows [row0, row1) (multiples of tile_rows, except row1 == R). */
typedef void (*tl_gemm_fn)(const tl_linear* lin, const tl_acts* acts, uint32_t row0,
                           uint32_t row1, float* y, size_t y_stride, bool accumulate);
void tl_gemm_scalar(const tl_linear*, const tl_acts*, uint32_t, uint32_t, float*, size_t, bool);
void tl_gemm_avx2(const tl_linear*, const tl_acts*, uint32_t, uint32_t, float*, size_t, bool);
void tl_gemm_avx512(const tl_linear*, const tl_acts*, uint32_t, uint32_t, float*, size_t, bool);
/* The AMX kernel also takes the calling worker's scratch (tl_linear_scratch_bytes). */
void tl_gemm_amx(const tl_linear* lin, const tl_acts* acts, uint32_t row0, uint32_t row1, float* y,
                 size_t y_stride, bool accumulate, uint8_t* scratch);
size_t tl_amx_scratch_bytes(size_t cols); /* per worker, for an int4 linear of `cols` columns */

/* The epilogue shared by every path: y = ((f32)acc * a) * ws, stored or added. */
static inline void tl_emit(float* y, int32_t acc, float a, float ws, bool accumulate) {
    float v = ((float)acc * a) * ws;
    *y = accumulate ? *y + v : v;
}

#endif
