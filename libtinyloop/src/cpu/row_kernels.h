/* row_kernels.h — the contract of the per-ISA forms of quant.h's row operations (rows_avx2.c,
 * rows_avx512.c): their entry points, the table of one form's operations that a pass calls
 * through, and the scalar step of NQ (quant.c) the AVX2 form finishes with. The kernel files
 * include this header, not quant.h; tl_row_kernels_for (kernel_tables.c) picks the form a pass
 * on a given ISA runs, and the attention kernel tables quantize their queries with it. */
#ifndef TL_ROW_KERNELS_H
#define TL_ROW_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

/* §2.3's scale a of NQ from the row's Q8 values q[n] and their scale s (the exact i64 sum of
 * squares, then tl_nq_scale): what the scalar and AVX2 forms of tl_rms_quantize_row finish with. */
float tl_nq_from_q8(const int8_t* q, size_t n, float s, float eps);

/* One form of the row operations, each bit-identical to the scalar one (quant.h). */
typedef struct tl_row_kernels {
    float (*quantize)(const float* x, size_t n, int qmax, int8_t* q);      /* tl_quantize_row     */
    float (*rms_quantize)(const float* x, size_t n, float eps, int8_t* q); /* tl_rms_quantize_row */
    void (*swiglu)(float* gate, const float* up, size_t n);                /* tl_swiglu_row       */
    void (*gate)(float* o, const float* z, size_t n);                      /* tl_gate_row         */
} tl_row_kernels;

extern const tl_row_kernels tl_rows_scalar; /* quant.c                                    */
extern const tl_row_kernels tl_rows_avx2;   /* rows_avx2.c: only where the CPU has AVX2   */
extern const tl_row_kernels tl_rows_avx512; /* rows_avx512.c: only where tl_isa_available(TL_ISA_AVX512_VNNI) */

/* The widest form a pass on kernel path `path` can run (kernel_tables.c): TL_ISA_AVX512_VNNI
 * (the AVX-512 forms) on the AVX-512 VNNI and AMX paths where the CPU has AVX-512 (an AMX
 * emulation build on an AVX2 CPU does not), TL_ISA_AVX2 on the other SIMD paths, else
 * TL_ISA_SCALAR. */
tl_isa tl_widest_row_isa(tl_isa path);
/* The row kernels of form `row_isa` (TL_ISA_SCALAR, TL_ISA_AVX2 or TL_ISA_AVX512_VNNI). */
const tl_row_kernels* tl_row_kernels_for(tl_isa row_isa);

/* The AVX2 and AVX-512 entry points behind those tables. */
float tl_quantize_row_avx2(const float* x, size_t n, int qmax, int8_t* q);
float tl_rms_quantize_row_avx2(const float* x, size_t n, float eps, int8_t* q);
void tl_swiglu_row_avx2(float* gate, const float* up, size_t n);
void tl_gate_row_avx2(float* o, const float* z, size_t n);
float tl_quantize_row_avx512(const float* x, size_t n, int qmax, int8_t* q);
float tl_rms_quantize_row_avx512(const float* x, size_t n, float eps, int8_t* q);
void tl_swiglu_row_avx512(float* gate, const float* up, size_t n);
void tl_gate_row_avx512(float* o, const float* z, size_t n);

#endif
