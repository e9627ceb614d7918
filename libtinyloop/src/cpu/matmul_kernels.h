/* matmul_kernels.h — the contract between the linear dispatcher (matmul.c, matmul.h) and its
 * per-ISA GEMM kernels (matmul_scalar.c, matmul_avx2.c, matmul_avx512.c, matmul_amx.c): the
 * quantized activations and the prepared linear they read, each kernel's entry point, and the
 * f32 epilogue they share. The kernels include this header only, never the dispatcher's: the
 * dispatcher calls the kernels, a kernel never reaches back up. */
#ifndef TL_MATMUL_KERNELS_H
#define TL_MATMUL_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"

/* Quantized input rows of a linear, one per token. */
typedef struct tl_acts {
    size_t n;         /* tokens                                                     */
    size_t stride;    /* bytes per row: tl_acts_stride(K)                           */
    int8_t* q;        /* [n][stride], zero from K to stride                         */
    uint8_t* qx;      /* [n][stride] = q + 128 as u8 (SIMD paths), see tl_acts_finish_row */
    float* scale;     /* [n] a (from NQ) or s (from Q8)                              */
    uint8_t* scratch; /* [pool threads][scratch_bytes] for the kernels: tl_linear_scratch_bytes */
    size_t scratch_bytes;
    int8_t* tiled;    /* [tl_acts_tiled_bytes] AMX: q in tile order (tl_linear_run fills it) */
} tl_acts;

static inline size_t tl_acts_stride(size_t cols) { return (cols + 63) / 64 * 64; }

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
