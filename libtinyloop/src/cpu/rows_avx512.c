/* rows_avx512.c — AVX-512 forms of the per-token row operations of quant.h (Q8 / Q4, NQ, SwiGLU,
 * the attention gate), bit-identical to the scalar ones: 16 lanes, the row's tail under a mask
 * instead of a scalar loop. The NaN-ignoring max keeps the running maximum as vmaxps's second
 * operand (a NaN input is ignored, a masked-off lane loads 0, which no |x| maximum exceeds); rint
 * is vrndscaleps; NQ's sum of squares is exact in i64 lanes (each vpmaddwd pair is at most
 * 2 * 127^2). */
#include <immintrin.h>

#include "cpu/numerics_avx512.h"
#include "cpu/row_kernels.h"

TL_AVX512 float tl_quantize_row_avx512(const float* x, size_t n, int qmax, int8_t* q) {
    __m512 vmax = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
    if (i < n) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(tl_tail16(n - i), x + i)), vmax);
    const float amax = _mm512_reduce_max_ps(vmax); /* lanes >= +0, never NaN: any order */
    if (amax < TL_TINY_ROW) {
        for (i = 0; i < n; i++) q[i] = 0;
        return 0.0f;
    }
    const float fq = (float)qmax;
    const float r = fq / amax;
    const __m512 vr = _mm512_set1_ps(r), lo = _mm512_set1_ps(-fq), hi = _mm512_set1_ps(fq);
    for (i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : tl_tail16(n - i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), vr);
        _mm512_mask_cvtsepi32_storeu_epi8(q + i, live, _mm512_cvtps_epi32(tl_rint16(tl_clamp16(v, lo, hi))));
    }
    return amax / fq;
}

/* tl_nq_from_q8 with the exact sum of squares 32 values at a time. */
TL_AVX512 static float nq_from_q8(const int8_t* q, size_t n, float s, float eps) {
    __m512i ss8 = _mm512_setzero_si512(); /* i64 lanes */
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + i)));
        const __m512i pairs = _mm512_madd_epi16(v, v);
        ss8 = _mm512_add_epi64(ss8, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(pairs)));
        ss8 = _mm512_add_epi64(ss8, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(pairs, 1)));
    }
    int64_t ss = _mm512_reduce_add_epi64(ss8);
    for (; i < n; i++) ss += (int32_t)q[i] * q[i];
    return tl_nq_scale(ss, s, n, eps);
}

TL_AVX512 float tl_rms_quantize_row_avx512(const float* x, size_t n, float eps, int8_t* q) {
    return nq_from_q8(q, n, tl_quantize_row_avx512(x, n, 127, q), eps);
}

TL_AVX512 void tl_swiglu_row_avx512(float* gate, const float* up, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : tl_tail16(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(live, gate + i), u = _mm512_maskz_loadu_ps(live, up + i);
        _mm512_mask_storeu_ps(gate + i, live, _mm512_mul_ps(tl_silu16(g), u));
    }
}

TL_AVX512 void tl_gate_row_avx512(float* o, const float* z, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : tl_tail16(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(live, o + i), g = _mm512_maskz_loadu_ps(live, z + i);
        _mm512_mask_storeu_ps(o + i, live, _mm512_mul_ps(v, tl_sig16(g)));
    }
}

const tl_row_kernels tl_rows_avx512 = {.quantize = tl_quantize_row_avx512,
                                       .rms_quantize = tl_rms_quantize_row_avx512,
                                       .swiglu = tl_swiglu_row_avx512,
                                       .gate = tl_gate_row_avx512};
