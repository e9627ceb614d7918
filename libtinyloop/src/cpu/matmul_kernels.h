/* matmul_kernels.h — the contract between the linear dispatcher (matmul.c, matmul.h) and its
 * per-ISA GEMM kernels (matmul_scalar.c, matmul_avx2.c, matmul_avx512.c, matmul_amx.c): the
 * quantized activations and the prepared linear they read, each kernel's entry point, where a
 * kernel puts its i32 accumulators (the f32 epilogue they share, or raw, for the dispatcher to
 * combine the digit rows of block inputs). The kernels include this header only, never the
 * dispatcher's: the dispatcher calls the kernels, a kernel never reaches back up. */
#ifndef TL_MATMUL_KERNELS_H
#define TL_MATMUL_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"

/* Quantized input rows of a linear: one per token, or with digits (block inputs, docs/spec.md
 * §3) two, the token's p = 255 * h + l as h in row 2t and l in row 2t + 1 (tl_acts_rows). */
typedef struct tl_acts {
    size_t n;         /* tokens                                                     */
    size_t stride;    /* bytes per row: tl_acts_stride(K)                           */
    int8_t* q;        /* [rows][stride], zero from K to stride                      */
    uint8_t* qx;      /* [rows][stride] = q + 128 as u8 (SIMD paths), see tl_acts_finish_row */
    float* scale;     /* [n] a (from NQ, NQB) or s (from Q8, QB)                     */
    uint8_t* scratch; /* [pool threads][scratch_bytes] for the kernels: tl_linear_scratch_bytes */
    size_t scratch_bytes;
    int8_t* tiled;    /* [tl_acts_tiled_bytes] AMX: q in tile order (tl_linear_run fills it) */
    bool digits;      /* rows are digit rows of block inputs (act_block)             */
    int32_t* raw;     /* digits: [pool threads][tl_acts_raw_bytes] the digit rows' accumulators */
} tl_acts;

/* The q rows of acts: n, or 2n digit rows. */
static inline size_t tl_acts_rows(const tl_acts* A) { return A->digits ? 2 * A->n : A->n; }

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

/* The row scales ws [R] of a prepared linear (the file's on the scalar path). */
static inline const float* tl_linear_scales(const tl_linear* L) {
    return L->isa == TL_ISA_SCALAR ? L->src.scale : L->scale;
}

/* Where a kernel call puts the accumulator acc of (q row t, output row j), for j < row1: by
 * default through the epilogue into y (row t at y + t * y_stride, stored or added); with raw,
 * the integer itself at raw[t * raw_stride + j - raw_row0] (rows raw_row0 .. row1 - 1). */
typedef struct tl_gemm_out {
    uint32_t row1;
    float* y;
    size_t y_stride;
    bool accumulate;
    int32_t* raw;
    size_t raw_stride;
    uint32_t raw_row0;
} tl_gemm_out;

/* The kernel of one path: output rows [row0, out->row1) (row0 a multiple of tile_rows, row1 too
 * unless it is R) for every q row of acts (tl_acts_rows). */
typedef void (*tl_gemm_fn)(const tl_linear* lin, const tl_acts* acts, uint32_t row0, const tl_gemm_out* out);
void tl_gemm_scalar(const tl_linear*, const tl_acts*, uint32_t, const tl_gemm_out*);
void tl_gemm_avx2(const tl_linear*, const tl_acts*, uint32_t, const tl_gemm_out*);
void tl_gemm_avx512(const tl_linear*, const tl_acts*, uint32_t, const tl_gemm_out*);
/* The AMX kernel also takes the calling worker's scratch (tl_linear_scratch_bytes). */
void tl_gemm_amx(const tl_linear* lin, const tl_acts* acts, uint32_t row0, const tl_gemm_out* out, uint8_t* scratch);
size_t tl_amx_scratch_bytes(size_t cols); /* per worker, for an int4 linear of `cols` columns */

/* The epilogue shared by every path: y = ((f32)acc * a) * ws, stored or added. acc is the exact
 * integer: an i32 for row inputs, up to 2^53 for block inputs (docs/spec.md §3), converted once. */
static inline void tl_emit(float* y, int64_t acc, float a, float ws, bool accumulate) {
    float v = ((float)acc * a) * ws;
    *y = accumulate ? *y + v : v;
}

/* Accumulator acc of q row t and output row j where o says: raw, or the epilogue with row t's
 * scale (row inputs only: digit rows go raw). */
static inline void tl_gemm_put(const tl_gemm_out* o, const tl_linear* L, const tl_acts* A, size_t t, size_t j,
                               int32_t acc) {
    if (o->raw) o->raw[t * o->raw_stride + (j - o->raw_row0)] = acc;
    else tl_emit(&o->y[t * o->y_stride + j], acc, A->scale[t], tl_linear_scales(L)[j], o->accumulate);
}

#endif
