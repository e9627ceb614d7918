/* numerics_avx2.h — 8-lane AVX2 forms of the spec's element-wise primitives (numerics.h),
 * bit-identical to the scalar ones: vmaxps / vminps for the clamp (a NaN becomes lo),
 * vroundps for floor and for rint (half to even), Horner as separate multiplies and adds
 * (no FMA), exact power-of-two scaling. Only for files compiled with target("avx2"). */
#ifndef TL_NUMERICS_AVX2_H
#define TL_NUMERICS_AVX2_H

#include <immintrin.h>

#include "core/numerics.h"

#define TL_INLINE_AVX2 static inline __attribute__((always_inline, target("avx2")))

/* (x >= lo) ? x : lo, then (x <= hi) ? x : hi (spec §2.1), for lo < hi, neither zero nor NaN.
 * vmaxps(x, lo) = (x > lo) ? x : lo and returns lo for a NaN x (its second operand); it differs
 * from the spec only at x == lo, where both give that value (lo is not zero, so no sign of zero
 * is at stake). The same holds for vminps at hi, and x is no longer NaN there. */
TL_INLINE_AVX2 __m256 tl_clamp8(__m256 x, __m256 lo, __m256 hi) {
    return _mm256_min_ps(_mm256_max_ps(x, lo), hi);
}

TL_INLINE_AVX2 __m256 tl_rint8(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* §2.4 exp2s on 8 lanes. */
TL_INLINE_AVX2 __m256 tl_exp2s8(__m256 x) {
    x = tl_clamp8(x, _mm256_set1_ps(-126.0f), _mm256_set1_ps(126.0f));
    const __m256 n = _mm256_floor_ps(x);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(0.0002179613511543721f);
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.001241427380591631f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.009681273251771927f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.0554824098944664f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.24022991955280304f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.6931470036506653f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* §2.5 the t = 1 + exps(-v) that silu and sig divide by. */
TL_INLINE_AVX2 __m256 tl_silu_den8(__m256 v) {
    const __m256 t = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); /* -v, exactly */
    const __m256 e = tl_exp2s8(_mm256_mul_ps(t, _mm256_set1_ps(TL_LOG2E)));
    return _mm256_add_ps(_mm256_set1_ps(1.0f), e);
}

/* §2.5 silu(v) = v / (1 + exps(-v)). */
TL_INLINE_AVX2 __m256 tl_silu8(__m256 v) { return _mm256_div_ps(v, tl_silu_den8(v)); }

/* §2.5 sig(v) = 1 / (1 + exps(-v)). */
TL_INLINE_AVX2 __m256 tl_sig8(__m256 v) { return _mm256_div_ps(_mm256_set1_ps(1.0f), tl_silu_den8(v)); }

#endif
