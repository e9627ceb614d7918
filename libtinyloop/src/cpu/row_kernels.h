/* row_kernels.h — the contract of the per-ISA forms of quant.h's row operations (rows_avx2.c):
 * their entry points, and the scalar step of NQ (quant.c) they finish with. The kernel includes
 * this header, not quant.h; forward.c picks the form per call, and attention_avx2.c's kernel
 * table quantizes its queries with the AVX2 one. */
#ifndef TL_ROW_KERNELS_H
#define TL_ROW_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* §2.3's scale a of NQ from the row's Q8 values q[n] and their scale s (the exact i64 sum of
 * squares, then tl_nq_scale): what both forms of tl_rms_quantize_row finish with. */
float tl_nq_from_q8(const int8_t* q, size_t n, float s, float eps);

/* AVX2 forms of tl_quantize_row, tl_rms_quantize_row and tl_swiglu_row (rows_avx2.c),
 * bit-identical; call only when the CPU has AVX2. */
float tl_quantize_row_avx2(const float* x, size_t n, int qmax, int8_t* q);
float tl_rms_quantize_row_avx2(const float* x, size_t n, float eps, int8_t* q);
void tl_swiglu_row_avx2(float* gate, const float* up, size_t n);

#endif
