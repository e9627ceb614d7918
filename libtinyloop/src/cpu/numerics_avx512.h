/* numerics_avx512.h — 16-lane AVX-512 forms of the spec's element-wise primitives (numerics.h),
 * bit-identical to the scalar ones, as numerics_avx2.h's 8-lane forms are: vmaxps / vminps for
 * the clamp (a NaN becomes lo), vrndscaleps for floor and for rint (half to even), Horner as
 * separate multiplies and adds (no FMA), exact power-of-two scaling. Only for files compiled
 * with the TL_AVX512 target (AVX-512 F, BW, DQ, VL: every CPU TL_ISA_AVX512_VNNI accepts). */
#ifndef TL_NUMERICS_AVX512_H
#define TL_NUMERICS_AVX512_H

#include <immintrin.h>

#include "core/numerics.h"

#define TL_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl"
#define TL_AVX512 __attribute__((target(TL_AVX512_TARGET)))
#define TL_INLINE_AVX512 static inline __attribute__((always_inline, target(TL_AVX512_TARGET)))

/* The mask of the first n < 16 lanes (a row's tail). */
TL_INLINE_AVX512 __mmask16 tl_tail16(size_t n) { return (__mmask16)((1u << n) - 1u); }

/* (x >= lo) ? x : lo, then (x <= hi) ? x : hi, for lo < hi, neither zero nor NaN: vmaxps
 * returns its second operand for a NaN x, and differs from the spec only at x == lo, where
 * both give that value (as tl_clamp8, numerics_avx2.h). */
TL_INLINE_AVX512 __m512 tl_clamp16(__m512 x, __m512 lo, __m512 hi) {
    return _mm512_min_ps(_mm512_max_ps(x, lo), hi);
}

TL_INLINE_AVX512 __m512 tl_rint16(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* §2.4 exp2s on 16 lanes. */
TL_INLINE_AVX512 __m512 tl_exp2s16(__m512 x) {
    x = tl_clamp16(x, _mm512_set1_ps(-126.0f), _mm512_set1_ps(126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.0002179613511543721f);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.001241427380591631f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.009681273251771927f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.0554824098944664f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.24022991955280304f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.6931470036506653f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* §2.5 the t = 1 + exps(-v) that silu and sig divide by. */
TL_INLINE_AVX512 __m512 tl_silu_den16(__m512 v) {
    const __m512 t = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))); /* -v, exactly */
    const __m512 e = tl_exp2s16(_mm512_mul_ps(t, _mm512_set1_ps(TL_LOG2E)));
    return _mm512_add_ps(_mm512_set1_ps(1.0f), e);
}

/* §2.5 silu(v) = v / (1 + exps(-v)). */
TL_INLINE_AVX512 __m512 tl_silu16(__m512 v) { return _mm512_div_ps(v, tl_silu_den16(v)); }

/* §2.5 sig(v) = 1 / (1 + exps(-v)). */
TL_INLINE_AVX512 __m512 tl_sig16(__m512 v) { return _mm512_div_ps(_mm512_set1_ps(1.0f), tl_silu_den16(v)); }

#endif
