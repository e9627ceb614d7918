/* attention_avx2.c — AVX2 segment kernels of the exact attention (attention.h).
 *
 * scores:     qq . k_j with vpmaddwd on int16-widened rows (exact i32), then the spec's two
 *             f32 multiplies per key.
 * weights:    exp2s and rint of 8 keys at once (numerics_avx2.h, bit-identical to the scalar
 *             primitives).
 * accumulate: num_d += Σ u_j v_jd with u split as u = 1024 * uh + ul (ul < 1024, uh <= 16385),
 *             two keys per vpmaddwd: the i32 partials stay below 2^31 for 256 key pairs, then
 *             they are flushed into the i64 sums. All exact, so the bits equal the scalar path.
 * Compiled with a function-level target, so the library needs no -march flag. */
#include <immintrin.h>
#include <string.h>

#include "attention.h"
#include "numerics_avx2.h"

#define INLINE_AVX2 TL_INLINE_AVX2
#define AVX2 __attribute__((target("avx2")))

enum { FLUSH_PAIRS = 256, D_CHUNK = 32 };

INLINE_AVX2 int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

AVX2 static void scores_avx2(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D,
                             float c, float* scores) {
    const size_t D16 = D / 16 * 16;
    for (size_t j = 0; j < n; j++) {
        const int8_t* row = k + j * D;
        __m256i acc = _mm256_setzero_si256();
        for (size_t d = 0; d < D16; d += 16) {
            const __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + d)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kv, _mm256_loadu_si256((const __m256i*)(s->qq16 + d))));
        }
        int32_t dot = hsum_epi32(acc);
        for (size_t d = D16; d < D; d++) dot += (int32_t)s->qq[d] * row[d];
        scores[j] = ((float)dot * c) * sk[j];
    }
}

AVX2 static int64_t weights_avx2(const float* scores, const float* sv, size_t n, float M, float kappa, int32_t* u,
                                 bool* nan_weight) {
    int64_t den = 0;
    size_t j = 0;
    const __m256 vM = _mm256_set1_ps(M), log2e = _mm256_set1_ps(TL_LOG2E), two24 = _mm256_set1_ps(16777216.0f);
    const __m256 vkappa = _mm256_set1_ps(kappa);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = tl_exp2s8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vM), log2e));
        int32_t E[8];
        _mm256_storeu_si256((__m256i*)E, _mm256_cvtps_epi32(tl_rint8(_mm256_mul_ps(e, two24))));
        for (int i = 0; i < 8; i++) den += E[i];
        const __m256 uf = tl_rint8(_mm256_mul_ps(e, _mm256_mul_ps(_mm256_loadu_ps(sv + j), vkappa)));
        const __m256 is_nan = _mm256_cmp_ps(uf, uf, _CMP_UNORD_Q);
        *nan_weight |= _mm256_movemask_ps(is_nan) != 0;
        _mm256_storeu_si256((__m256i*)(u + j), _mm256_cvtps_epi32(_mm256_andnot_ps(is_nan, uf)));
    }
    for (; j < n; j++) {
        const float e = tl_exp2s((scores[j] - M) * TL_LOG2E);
        den += (int64_t)tl_rint(e * 16777216.0f);
        const float uf = tl_rint(e * (sv[j] * kappa));
        *nan_weight |= uf != uf;
        u[j] = uf == uf ? (int32_t)uf : 0;
    }
    return den;
}

/* Interleave rows a and b at d .. d+15 as int16 pairs (a_d, b_d): two vectors of 8 pairs. */
INLINE_AVX2 void pairs16(const int8_t* a, const int8_t* b, __m256i* lo, __m256i* hi) {
    const __m128i x = _mm_loadu_si128((const __m128i*)a), y = _mm_loadu_si128((const __m128i*)b);
    *lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
    *hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));
}

/* num[d0 .. d0+32) += Σ_j u_j v_jd for keys [j0, j1), j1 - j0 even and <= 2 * FLUSH_PAIRS. */
INLINE_AVX2 void accumulate_chunk(const int32_t* u, const int8_t* v, size_t j0, size_t j1, size_t D, size_t d0,
                                  int64_t* num) {
    __m256i low[4], high[4]; /* d0 + 8i .. d0 + 8i + 7, weights ul and uh */
    for (int i = 0; i < 4; i++) low[i] = high[i] = _mm256_setzero_si256();
    for (size_t j = j0; j < j1; j += 2) {
        const int32_t ul = (u[j] & 1023) | (u[j + 1] & 1023) << 16;
        const int32_t uh = (u[j] >> 10) | (u[j + 1] >> 10) << 16;
        const __m256i wl = _mm256_set1_epi32(ul), wh = _mm256_set1_epi32(uh);
        for (int h = 0; h < 2; h++) {
            __m256i a, b;
            pairs16(v + j * D + d0 + 16 * h, v + (j + 1) * D + d0 + 16 * h, &a, &b);
            low[2 * h] = _mm256_add_epi32(low[2 * h], _mm256_madd_epi16(a, wl));
            low[2 * h + 1] = _mm256_add_epi32(low[2 * h + 1], _mm256_madd_epi16(b, wl));
            high[2 * h] = _mm256_add_epi32(high[2 * h], _mm256_madd_epi16(a, wh));
            high[2 * h + 1] = _mm256_add_epi32(high[2 * h + 1], _mm256_madd_epi16(b, wh));
        }
    }
    for (int i = 0; i < 4; i++) {
        int32_t l[8], hh[8];
        _mm256_storeu_si256((__m256i*)l, low[i]);
        _mm256_storeu_si256((__m256i*)hh, high[i]);
        for (int k = 0; k < 8; k++) num[d0 + 8 * i + k] += (int64_t)hh[k] * 1024 + l[k];
    }
}

AVX2 static void accumulate_avx2(const int32_t* u, const int8_t* v, size_t n, size_t D, int64_t* num) {
    const size_t pairs_end = n / 2 * 2, D32 = D / D_CHUNK * D_CHUNK;
    for (size_t j0 = 0; j0 < pairs_end; j0 += 2 * FLUSH_PAIRS) {
        const size_t j1 = j0 + 2 * FLUSH_PAIRS < pairs_end ? j0 + 2 * FLUSH_PAIRS : pairs_end;
        for (size_t d0 = 0; d0 < D32; d0 += D_CHUNK) accumulate_chunk(u, v, j0, j1, D, d0, num);
        for (size_t j = j0; j < j1; j++)
            for (size_t d = D32; d < D; d++) num[d] += (int64_t)u[j] * v[j * D + d];
    }
    for (size_t j = pairs_end; j < n; j++)
        for (size_t d = 0; d < D; d++) num[d] += (int64_t)u[j] * v[j * D + d];
}

const tl_attn_kernels tl_attn_avx2 = {scores_avx2, weights_avx2, accumulate_avx2};
