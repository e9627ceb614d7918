/* rows_avx2.c — AVX2 forms of the per-token row operations of quant.h (Q8 / Q4, NQ, SwiGLU, the
 * attention gate), bit-identical to the scalar ones: the NaN-ignoring max uses vmaxps with the
 * running maximum as the second operand (a NaN input is ignored), rint is vroundps. */
#include <immintrin.h>
#include <math.h>

#include "cpu/numerics_avx2.h"
#include "cpu/row_kernels.h"

__attribute__((target("avx2"))) float tl_quantize_row_avx2(const float* x, size_t n, int qmax, int8_t* q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), vmax);
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float amax = 0.0f;
    for (int k = 0; k < 8; k++) amax = lanes[k] > amax ? lanes[k] : amax;
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax < 5.421010862427522e-20f) { /* 2^-64 */
        for (i = 0; i < n; i++) q[i] = 0;
        return 0.0f;
    }
    const float fq = (float)qmax;
    const float r = fq / amax;
    const __m256 vr = _mm256_set1_ps(r), lo = _mm256_set1_ps(-fq), hi = _mm256_set1_ps(fq);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtps_epi32(tl_rint8(tl_clamp8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), lo, hi)));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i*)(q + i), _mm_packs_epi16(w, w));
    }
    for (; i < n; i++) q[i] = (int8_t)(int)tl_rint_small(tl_clamp(x[i] * r, -fq, fq));
    return amax / fq;
}

float tl_rms_quantize_row_avx2(const float* x, size_t n, float eps, int8_t* q) {
    return tl_nq_from_q8(q, n, tl_quantize_row_avx2(x, n, 127, q), eps);
}

__attribute__((target("avx2"))) void tl_swiglu_row_avx2(float* gate, const float* up, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(tl_silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    for (; i < n; i++) gate[i] = tl_silu(gate[i]) * up[i];
}

__attribute__((target("avx2"))) void tl_gate_row_avx2(float* o, const float* z, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), tl_sig8(_mm256_loadu_ps(z + i))));
    for (; i < n; i++) o[i] = o[i] * tl_sigmoid(z[i]);
}

const tl_row_kernels tl_rows_avx2 = {.quantize = tl_quantize_row_avx2,
                                     .rms_quantize = tl_rms_quantize_row_avx2,
                                     .swiglu = tl_swiglu_row_avx2,
                                     .gate = tl_gate_row_avx2};
