/* matmul.h — exact integer linear layers (docs/spec.md §3) on T tokens at once.
 *
 *   y[t][j] = ((f32) acc[t][j] * a[t]) * ws[j],   acc[t][j] = Σ_k q[t][k] * w[j][k]   (int8)
 *                                                 acc[t][j] = Σ_g m[j][g] Σ_{k∈g} q w  (int4)
 *
 * acc is an exact integer. For a row input (q in [-128, 127]) the loader proved it fits in i32,
 * so every kernel path — scalar, AVX2, AVX-512 VNNI, AMX tiles — returns identical bits; SIMD
 * paths may compute it modulo 2^32 with offset tricks because the true value is known to fit.
 * A block input (act_block: p = m_b * q up to 32385, §2.2.1) may not fit: its acts hold each
 * token's digit rows h and l (p = 255 h + l, both in [-127, 127]), the kernels run them as two
 * row inputs with their accumulators left raw, and tl_linear_run combines acc = 255 acc_h + acc_l
 * in i64 before the same epilogue: the same integer, converted once. Weights are repacked once at load
 * into the layout of the chosen path (pack.c); each kernel processes several tokens per pass
 * over a tile of weights, so prefill is a GEMM. The AMX path runs calls of TL_AMX_MIN_TOKENS
 * tokens or more on tiles and fewer on the AVX-512 kernel, which shares its packed weights. */
#ifndef TL_MATMUL_H
#define TL_MATMUL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"
#include "cpu/matmul_kernels.h"
#include "cpu/threadpool.h"

#if defined(TL_AMX_EMULATION)
enum { TL_AMX_MIN_TOKENS = 1 };  /* the test build runs every call on the emulated tiles  */
#else
enum { TL_AMX_MIN_TOKENS = 16 }; /* fewer tokens than a tile has rows: AVX-512 is as fast  */
#endif

/* Scratch bytes per pool thread that a call of n q rows (tl_acts_rows) on a linear of at most
 * `cols` columns needs on `isa`: the AMX int4 path unpacks a row tile there; 0 for every other
 * call. */
size_t tl_linear_scratch_bytes(tl_isa isa, size_t n, size_t cols);
/* Bytes of acts->tiled a call of n q rows of at most `cols` columns needs on `isa`: the AMX
 * kernel loads its activation tiles from a copy of q laid out [n/16][K/64][16][64], each tile
 * contiguous; 0 (tiled may be NULL) for every other call. */
size_t tl_acts_tiled_bytes(tl_isa isa, size_t n, size_t cols);
/* Bytes of acts->raw per pool thread that a call of n tokens with digit rows needs. */
size_t tl_acts_raw_bytes(size_t n);

/* Repack `src` for `isa` (an int4 linear whose group size is not a multiple of 8 runs on the
 * scalar path). On failure nothing is allocated. */
tl_status tl_linear_prepare(tl_linear* out, const tl_linear_src* src, tl_isa isa);
/* Whether the prepared linear still reads the weights of its source (the scalar path runs on
 * the file's layout); when it does not, the caller may free them (tl_file_release_linear). */
static inline bool tl_linear_reads_src(const tl_linear* lin) { return lin->isa == TL_ISA_SCALAR; }
void tl_linear_release(tl_linear* lin);
size_t tl_linear_bytes(const tl_linear* lin);

/* Fill qx[r] from q[r] (needed before a SIMD linear reads q row r). */
void tl_acts_finish_row(tl_acts* acts, size_t r);

/* y[t][j] for t < acts->n, j < R into y + t * y_stride; with `accumulate`, y += instead
 * (one f32 addition per element). Rows are split over the pool. */
void tl_linear_run(const tl_linear* lin, const tl_acts* acts, float* y, size_t y_stride,
                   bool accumulate, tl_pool* pool);

#endif
