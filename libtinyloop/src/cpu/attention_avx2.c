/* attention_avx2.c — AVX2 kernels of the exact attention (attention.h).
 *
 * scores:     8 keys at a time. qq . k_j in 32-byte steps as vpmaddubsw(|qq|, sign(k_j, qq)):
 *             |qq| <= 127 and |k| <= 127 (both Q8), so each i16 pair sum is at most
 *             2 * 127 * 127 = 32258, exact; vpmaddwd by 1 widens to i32. A 16-wide tail step uses
 *             qq16 (vpmaddwd), the rest is scalar. The 8 keys' lanes are summed into one vector of
 *             8 exact dots, then the spec's two f32 multiplies.
 * max:        vmaxps with the running maximum as the second operand ignores a NaN input, as
 *             tl_fmax does.
 * weights:    exp2s and rint of 8 keys at once (numerics_avx2.h, bit-identical to the scalar
 *             primitives); E_j <= 2^24 summed exactly in i64 lanes.
 * accumulate: num_d += Σ u_j v_jd with u split as u = 4096 * uh + ul (0 <= ul < 4096; 0 <= uh <= 4096
 *             as 0 <= u <= 2^24 + 2), two keys per vpmaddwd on the i16 pairs (v_j[d] + 128,
 *             v_j+1[d] + 128) (the offset makes the bytes zero-extend; 128 Σ u_j comes off at the
 *             end): a pair adds at most 2 * 4096 * 255 = 2088960 to an i32 lane, so 1024 pairs
 *             stay below 2^31; then the lanes are flushed into the i64 sums.
 * output:     (f32)num_d converted one by one (the exact rounding of the i64), then 8 divisions
 *             and multiplications at once.
 * All exact or the spec's own f32 operations, so the bits equal the scalar path. Compiled with a
 * function-level target, so the library needs no -march flag. */
#include <immintrin.h>
#include <string.h>

#include "cpu/attention_kernels.h"
#include "cpu/numerics_avx2.h"
#include "cpu/row_kernels.h"

#define INLINE_AVX2 TL_INLINE_AVX2
#define AVX2 __attribute__((target("avx2")))

enum { KEYS = 8, FLUSH_PAIRS = 1024, D_CHUNK = 32 };

INLINE_AVX2 int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* ---- scores --------------------------------------------------------------------------------- */

/* Σ_d qq[d] * row[d] over d in [d0, D), d0 a multiple of 32: a 16-wide step, then scalar. */
INLINE_AVX2 int32_t dot_tail(const tl_attn_scratch* s, const int8_t* row, size_t d0, size_t D) {
    int32_t dot = 0;
    size_t d = d0;
    if (d + 16 <= D) {
        const __m256i k16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + d)));
        dot = hsum_epi32(_mm256_madd_epi16(k16, _mm256_loadu_si256((const __m256i*)(s->qq16 + d))));
        d += 16;
    }
    for (; d < D; d++) dot += (int32_t)s->qq[d] * row[d];
    return dot;
}

/* [Σ a[0..3], Σ b[0..3], Σ c[0..3], Σ d[0..3] | the same of lanes 4..7] */
INLINE_AVX2 __m256i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* Lane i = Σ of the lanes of v[i]. */
INLINE_AVX2 __m256i sum8(const __m256i v[KEYS]) {
    const __m256i x = sum4(v[0], v[1], v[2], v[3]), y = sum4(v[4], v[5], v[6], v[7]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
}

/* Lane i = qq . k_{j0+i} (keys past n repeat the last one; their lanes are not used). */
INLINE_AVX2 __m256i dots8(const tl_attn_scratch* s, const int8_t* k, size_t j0, size_t n, size_t D) {
    const int8_t* row[KEYS];
    for (int i = 0; i < KEYS; i++) row[i] = k + (j0 + i < n ? j0 + i : n - 1) * D;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[KEYS];
    for (int i = 0; i < KEYS; i++) acc[i] = _mm256_setzero_si256();
    const size_t D32 = D / 32 * 32;
    for (size_t d = 0; d < D32; d += 32) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(s->qq + d)), q_abs = _mm256_abs_epi8(q);
        for (int i = 0; i < KEYS; i++) {
            const __m256i kv = _mm256_loadu_si256((const __m256i*)(row[i] + d));
            const __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(kv, q));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
        }
    }
    __m256i dots = sum8(acc);
    if (D32 < D) {
        int32_t tail[KEYS];
        for (int i = 0; i < KEYS; i++) tail[i] = dot_tail(s, row[i], D32, D);
        dots = _mm256_add_epi32(dots, _mm256_loadu_si256((const __m256i*)tail));
    }
    return dots;
}

/* scores[j0 + i] = ((f32)dot_i * c) * sk[j0 + i] for lanes i < live. */
INLINE_AVX2 void store_scores(__m256i dots, const float* sk, size_t j0, size_t live, float c, float* scores) {
    float sk8[KEYS] = {0}, out[KEYS];
    const bool full = live == KEYS; /* a partial group goes through copies: no masked access */
    if (!full) memcpy(sk8, sk + j0, live * sizeof(float));
    const __m256 scale = _mm256_loadu_ps(full ? sk + j0 : sk8);
    const __m256 score = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(c)), scale);
    _mm256_storeu_ps(full ? scores + j0 : out, score);
    if (!full) memcpy(scores + j0, out, live * sizeof(float));
}

AVX2 void tl_attn_scores_avx2(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D,
                              float c, float* scores) {
    for (size_t j0 = 0; j0 < n; j0 += KEYS)
        store_scores(dots8(s, k, j0, n, D), sk, j0, n - j0 < KEYS ? n - j0 : KEYS, c, scores);
}

/* ---- max, weights, output ------------------------------------------------------------------- */

AVX2 static float max_avx2(const float* x, size_t n, float acc) {
    __m256 m = _mm256_set1_ps(acc); /* acc is not NaN; vmaxps returns m (its second operand) for a NaN x */
    size_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + j), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    acc = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; j < n; j++) acc = tl_fmax(acc, x[j]);
    return acc;
}

AVX2 static int64_t weights_avx2(const float* scores, const float* sv, size_t n, float M, float kappa, int32_t* u,
                                 bool* nan_weight) {
    size_t j = 0;
    const __m256 vM = _mm256_set1_ps(M), log2e = _mm256_set1_ps(TL_LOG2E), two24 = _mm256_set1_ps(16777216.0f);
    const __m256 vkappa = _mm256_set1_ps(kappa);
    __m256i den4 = _mm256_setzero_si256(); /* i64 lanes */
    for (; j + 8 <= n; j += 8) {
        const __m256 e = tl_exp2s8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vM), log2e));
        const __m256i E = _mm256_cvtps_epi32(tl_rint8(_mm256_mul_ps(e, two24)));
        den4 = _mm256_add_epi64(den4, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(E)),
                                                       _mm256_cvtepi32_epi64(_mm256_extracti128_si256(E, 1))));
        const __m256 uf = tl_rint8(_mm256_mul_ps(e, _mm256_mul_ps(_mm256_loadu_ps(sv + j), vkappa)));
        const __m256 is_nan = _mm256_cmp_ps(uf, uf, _CMP_UNORD_Q);
        *nan_weight |= _mm256_movemask_ps(is_nan) != 0;
        _mm256_storeu_si256((__m256i*)(u + j), _mm256_cvtps_epi32(_mm256_andnot_ps(is_nan, uf)));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, den4);
    int64_t den = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; j < n; j++) {
        const float e = tl_exp2s((scores[j] - M) * TL_LOG2E);
        den += (int64_t)tl_rint(e * 16777216.0f);
        const float uf = tl_rint(e * (sv[j] * kappa));
        *nan_weight |= uf != uf;
        u[j] = uf == uf ? (int32_t)uf : 0;
    }
    return den;
}

AVX2 static void output_avx2(const int64_t* num, size_t D, int64_t den, float svmax, float* o) {
    const float fden = (float)den;
    const __m256 vden = _mm256_set1_ps(fden), vsvmax = _mm256_set1_ps(svmax);
    size_t d = 0;
    for (; d + 8 <= D; d += 8) {
        float x[8];
        for (int i = 0; i < 8; i++) x[i] = (float)num[d + i];
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(x), vden), vsvmax));
    }
    for (; d < D; d++) o[d] = ((float)num[d] / fden) * svmax;
}

/* ---- accumulate ----------------------------------------------------------------------------- */

/* The broadcast i16 pair words (ul_a, ul_b) and (uh_a, uh_b) of u = 4096 * uh + ul. */
INLINE_AVX2 void pair_words(int32_t ua, int32_t ub, __m256i* wl, __m256i* wh) {
    *wl = _mm256_set1_epi32((ua & 4095) | (ub & 4095) << 16);
    *wh = _mm256_set1_epi32((ua >> 12) | (ub >> 12) << 16);
}

/* For 32 dims of rows x and y: acc[i] += wl * p_i and acc[4 + i] += wh * p_i, where p_i holds the
 * i16 pairs (x_d + 128, y_d + 128) of dims {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27},
 * {12-15, 28-31}: the bytes interleaved, flipped to u8 (v + 128) and zero-extended. */
INLINE_AVX2 void accumulate_pair(__m256i x, __m256i y, __m256i wl, __m256i wh, __m256i acc[8]) {
    const __m256i zero = _mm256_setzero_si256(), flip = _mm256_set1_epi8(-128);
    const __m256i bytes[2] = {_mm256_xor_si256(_mm256_unpacklo_epi8(x, y), flip),
                              _mm256_xor_si256(_mm256_unpackhi_epi8(x, y), flip)};
    for (int h = 0; h < 2; h++) {
        const __m256i p[2] = {_mm256_unpacklo_epi8(bytes[h], zero), _mm256_unpackhi_epi8(bytes[h], zero)};
        for (int i = 0; i < 2; i++) {
            acc[2 * h + i] = _mm256_add_epi32(acc[2 * h + i], _mm256_madd_epi16(p[i], wl));
            acc[4 + 2 * h + i] = _mm256_add_epi32(acc[4 + 2 * h + i], _mm256_madd_epi16(p[i], wh));
        }
    }
}

/* num[0 .. 8) += 4096 * hi + lo - offset, in i64. */
INLINE_AVX2 void add_wide(int64_t* num, __m256i lo, __m256i hi, __m256i offset) {
    const __m256i lo0 = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(lo));
    const __m256i lo1 = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(lo, 1));
    const __m256i hi0 = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(hi)), 12);
    const __m256i hi1 = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(hi, 1)), 12);
    const __m256i sums[2] = {_mm256_sub_epi64(_mm256_add_epi64(hi0, lo0), offset),
                             _mm256_sub_epi64(_mm256_add_epi64(hi1, lo1), offset)};
    __m256i* p = (__m256i*)num;
    for (int h = 0; h < 2; h++) _mm256_storeu_si256(p + h, _mm256_add_epi64(_mm256_loadu_si256(p + h), sums[h]));
}

/* num[0 .. 32) += the lanes of acc, back in dimension order, less offset (i64) from each. */
INLINE_AVX2 void flush(const __m256i acc[8], __m256i offset, int64_t* num) {
    add_wide(num, _mm256_permute2x128_si256(acc[0], acc[1], 0x20), _mm256_permute2x128_si256(acc[4], acc[5], 0x20),
             offset);
    add_wide(num + 8, _mm256_permute2x128_si256(acc[2], acc[3], 0x20),
             _mm256_permute2x128_si256(acc[6], acc[7], 0x20), offset);
    add_wide(num + 16, _mm256_permute2x128_si256(acc[0], acc[1], 0x31),
             _mm256_permute2x128_si256(acc[4], acc[5], 0x31), offset);
    add_wide(num + 24, _mm256_permute2x128_si256(acc[2], acc[3], 0x31),
             _mm256_permute2x128_si256(acc[6], acc[7], 0x31), offset);
}

/* acc += the pairs of keys [j0, j1) of rows v, dims d0 .. d0+32 (an odd last key pairs with a
 * zero row of weight 0); returns Σ u_j, whose 128-fold the flush removes. */
INLINE_AVX2 int64_t accumulate_keys(const int32_t* u, const int8_t* v, size_t j0, size_t j1, size_t D, size_t d0,
                                    __m256i acc[8]) {
    __m256i wl, wh;
    int64_t u_sum = 0;
    size_t j = j0;
    for (; j + 1 < j1; j += 2) {
        pair_words(u[j], u[j + 1], &wl, &wh);
        u_sum += (int64_t)u[j] + u[j + 1];
        accumulate_pair(_mm256_loadu_si256((const __m256i*)(v + j * D + d0)),
                        _mm256_loadu_si256((const __m256i*)(v + (j + 1) * D + d0)), wl, wh, acc);
    }
    if (j < j1) {
        pair_words(u[j], 0, &wl, &wh);
        u_sum += u[j];
        accumulate_pair(_mm256_loadu_si256((const __m256i*)(v + j * D + d0)), _mm256_setzero_si256(), wl, wh, acc);
    }
    return u_sum;
}

/* num[d0 .. d0+32) += Σ_j u_j v_jd over the segments: the i32 lanes take at most FLUSH_PAIRS
 * pairs between flushes, so a segment is cut where the room runs out. */
INLINE_AVX2 void accumulate_chunk(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D, size_t d0,
                                  int64_t* num) {
    __m256i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
    size_t room = FLUSH_PAIRS;
    int64_t u_sum = 0;
    for (size_t i = 0; i < n_segs; u += segs[i].n, i++)
        for (size_t j0 = 0; j0 < segs[i].n;) {
            if (room == 0) {
                flush(acc, _mm256_set1_epi64x(128 * u_sum), num + d0);
                for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
                room = FLUSH_PAIRS;
                u_sum = 0;
            }
            const size_t j1 = segs[i].n - j0 < 2 * room ? segs[i].n : j0 + 2 * room;
            u_sum += accumulate_keys(u, segs[i].v, j0, j1, D, d0, acc);
            room -= (j1 - j0 + 1) / 2;
            j0 = j1;
        }
    flush(acc, _mm256_set1_epi64x(128 * u_sum), num + d0);
}

AVX2 static void accumulate_segments_avx2(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D,
                                          int64_t* num) {
    const size_t D32 = D / D_CHUNK * D_CHUNK;
    for (size_t d0 = 0; d0 < D32; d0 += D_CHUNK) accumulate_chunk(u, segs, n_segs, D, d0, num);
    for (size_t i = 0; i < n_segs; u += segs[i].n, i++)
        for (size_t j = 0; j < segs[i].n; j++)
            for (size_t d = D32; d < D; d++) num[d] += (int64_t)u[j] * segs[i].v[j * D + d];
}

const tl_attn_kernels tl_attn_avx2 = {.quantize = tl_quantize_row_avx2,
                                      .scores = tl_attn_scores_avx2,
                                      .max = max_avx2,
                                      .weights = weights_avx2,
                                      .accumulate_segments = accumulate_segments_avx2,
                                      .output = output_avx2};
