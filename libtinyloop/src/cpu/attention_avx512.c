/* attention_avx512.c — AVX-512 kernels of the exact attention (attention_kernels.h),
 * bit-identical to the scalar ones.
 *
 * scores:     16 keys at a time. qq . k_j in 64-byte steps as vpdpbusd(k_j + 128, qq): the key
 *             bytes flipped to u8 times the s8 query, four products per i32 lane without
 *             saturation (at most 4 * 255 * 128 each); 128 Σ qq comes off once per key. A head
 *             size that is not a multiple of 64 loads its last step under a mask (zero bytes of
 *             k and of qq there). The 16 keys' lanes are summed into one vector of 16 exact dots
 *             (a 4 x 4 transpose of 128-bit blocks), then the spec's two f32 multiplies.
 * max:        vmaxps with the running maximum as the second operand ignores a NaN input, as
 *             tl_fmax does; the row's tail loads under a mask with the running maximum in the
 *             masked-off lanes.
 * weights:    exp2s and rint of 16 keys at once (numerics_avx512.h); E_j <= 2^24 summed exactly
 *             in i64 lanes; a NaN U is flagged and stored as 0; the tail under a mask.
 * accumulate: num_d += Σ u_j v_jd with u split as u = 4096 * uh + ul (0 <= ul < 4096,
 *             0 <= uh <= 4096), two keys per vpdpwssd on the sign-extended i16 pairs
 *             (v_j[d], v_j+1[d]): a pair adds at most 2 * 4096 * 128 = 2^20 to an i32 lane, so
 *             1024 pairs stay far below 2^31; then the lanes are flushed into the i64 sums, back
 *             in dimension order. 64 dimensions per step, the last step under a mask.
 * output:     (f32)num_d by vcvtqq2ps (the exact i64 conversion, rounded to nearest as C's
 *             cast), then 16 divisions and multiplications at once.
 * Compiled with a function-level target (AVX-512 F, BW, DQ, VL and VNNI), so the library needs
 * no -march flag. */
#include <immintrin.h>

#include "cpu/attention_kernels.h"
#include "cpu/numerics_avx512.h"
#include "cpu/row_kernels.h"

#define VNNI __attribute__((target(TL_AVX512_TARGET ",avx512vnni")))
#define INLINE_VNNI static inline __attribute__((always_inline, target(TL_AVX512_TARGET ",avx512vnni")))

enum { KEYS = 16, STEP = 64, MAX_STEPS = 8, FLUSH_PAIRS = 1024 };

/* The byte mask of step d0's live head dims (all 64 but in a head size's last partial step). */
INLINE_VNNI __mmask64 live_bytes(size_t d0, size_t D) {
    return D - d0 >= STEP ? ~(__mmask64)0 : (((__mmask64)1 << (D - d0)) - 1);
}

/* ---- scores --------------------------------------------------------------------------------- */

/* [Σ of each 128-bit block of a, b, c, d side by side]: lane 4i + k of the result is the sum of
 * block i's four lanes of the k-th vector. */
INLINE_VNNI __m512i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* Lane i = Σ of the lanes of v[i]. */
INLINE_VNNI __m512i sum16(const __m512i v[KEYS]) {
    const __m512i x0 = sum4(v[0], v[1], v[2], v[3]), x1 = sum4(v[4], v[5], v[6], v[7]);
    const __m512i x2 = sum4(v[8], v[9], v[10], v[11]), x3 = sum4(v[12], v[13], v[14], v[15]);
    const __m512i t0 = _mm512_shuffle_i32x4(x0, x1, 0x44), t1 = _mm512_shuffle_i32x4(x0, x1, 0xee);
    const __m512i t2 = _mm512_shuffle_i32x4(x2, x3, 0x44), t3 = _mm512_shuffle_i32x4(x2, x3, 0xee);
    return _mm512_add_epi32(_mm512_add_epi32(_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xdd)),
                            _mm512_add_epi32(_mm512_shuffle_i32x4(t1, t3, 0x88), _mm512_shuffle_i32x4(t1, t3, 0xdd)));
}

/* Scores j0 .. j0+15 from their 16 exact dots (Σ qq k_j + 128 Σ qq in acc's lanes). */
INLINE_VNNI void store_scores(__m512i acc[KEYS], __m512i offset, __m512 vc, const float* sk, size_t j0, size_t n,
                              float* scores) {
    const __m512i dots = _mm512_sub_epi32(sum16(acc), offset);
    const __mmask16 live = n - j0 >= KEYS ? (__mmask16)0xffff : tl_tail16(n - j0);
    const __m512 score = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), vc), _mm512_maskz_loadu_ps(live, sk + j0));
    _mm512_mask_storeu_ps(scores + j0, live, score);
}

/* Head sizes of one step (D <= 64, the common case) apart: without the loop over steps the
 * query and the 16 accumulators stay in registers. */
VNNI static void scores_one_step(__m512i q, __m512i offset, __m512 vc, const int8_t* k, const float* sk, size_t n,
                                 size_t D, float* scores) {
    const __m512i flip = _mm512_set1_epi8(-128);
    const __mmask64 live = live_bytes(0, D);
    for (size_t j0 = 0; j0 < n; j0 += KEYS) {
        __m512i acc[KEYS];
        for (int i = 0; i < KEYS; i++) {
            const int8_t* row = k + (j0 + i < n ? j0 + i : n - 1) * D; /* keys past n repeat the last */
            acc[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, row), flip),
                                         q);
        }
        store_scores(acc, offset, vc, sk, j0, n, scores);
    }
}

VNNI static void scores_avx512(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D,
                               float c, float* scores) {
    if (D > MAX_STEPS * STEP) { /* beyond the query vectors kept in registers */
        tl_attn_scores_avx2(s, k, sk, n, D, c, scores);
        return;
    }
    const size_t steps = (D + STEP - 1) / STEP;
    const __m512i flip = _mm512_set1_epi8(-128);
    __m512i q[MAX_STEPS];
    int32_t q_sum = 0;
    for (size_t i = 0; i < steps; i++) q[i] = _mm512_maskz_loadu_epi8(live_bytes(STEP * i, D), s->qq + STEP * i);
    for (size_t d = 0; d < D; d++) q_sum += s->qq[d];
    const __m512i offset = _mm512_set1_epi32(128 * q_sum);
    const __m512 vc = _mm512_set1_ps(c);
    if (steps == 1) {
        scores_one_step(q[0], offset, vc, k, sk, n, D, scores);
        return;
    }
    for (size_t j0 = 0; j0 < n; j0 += KEYS) {
        __m512i acc[KEYS];
        for (int i = 0; i < KEYS; i++) {
            const int8_t* row = k + (j0 + i < n ? j0 + i : n - 1) * D; /* keys past n repeat the last */
            acc[i] = _mm512_setzero_si512();
            for (size_t st = 0; st < steps; st++) {
                const __m512i kv = _mm512_maskz_loadu_epi8(live_bytes(STEP * st, D), row + STEP * st);
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_xor_si512(kv, flip), q[st]);
            }
        }
        store_scores(acc, offset, vc, sk, j0, n, scores);
    }
}

TL_INLINE_AVX512 __mmask16 live16(size_t j, size_t n) { return n - j >= 16 ? (__mmask16)0xffff : tl_tail16(n - j); }

TL_AVX512 static float max_avx512(const float* x, size_t n, float acc) {
    __m512 m = _mm512_set1_ps(acc); /* acc is not NaN, nor then is any lane of m */
    for (size_t j = 0; j < n; j += 16) m = _mm512_max_ps(_mm512_mask_loadu_ps(m, live16(j, n), x + j), m);
    return _mm512_reduce_max_ps(m);
}

TL_AVX512 static int64_t weights_avx512(const float* scores, const float* sv, size_t n, float M, float kappa,
                                        int32_t* u, bool* nan_weight) {
    const __m512 vM = _mm512_set1_ps(M), log2e = _mm512_set1_ps(TL_LOG2E), two24 = _mm512_set1_ps(16777216.0f);
    const __m512 vkappa = _mm512_set1_ps(kappa);
    __m512i den8 = _mm512_setzero_si512(); /* i64 lanes */
    __mmask16 nan_lanes = 0;
    for (size_t j = 0; j < n; j += 16) {
        const __mmask16 live = live16(j, n);
        const __m512 s = _mm512_maskz_loadu_ps(live, scores + j), v = _mm512_maskz_loadu_ps(live, sv + j);
        const __m512 e = tl_exp2s16(_mm512_mul_ps(_mm512_sub_ps(s, vM), log2e));
        const __m512i E = _mm512_maskz_cvtps_epi32(live, tl_rint16(_mm512_mul_ps(e, two24)));
        den8 = _mm512_add_epi64(den8, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(E)));
        den8 = _mm512_add_epi64(den8, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(E, 1)));
        const __m512 uf = tl_rint16(_mm512_mul_ps(e, _mm512_mul_ps(v, vkappa)));
        const __mmask16 is_nan = _mm512_mask_cmp_ps_mask(live, uf, uf, _CMP_UNORD_Q);
        nan_lanes |= is_nan;
        _mm512_mask_storeu_epi32(u + j, live, _mm512_maskz_cvtps_epi32((__mmask16)~is_nan, uf));
    }
    *nan_weight |= nan_lanes != 0;
    return _mm512_reduce_add_epi64(den8);
}

TL_AVX512 static void output_avx512(const int64_t* num, size_t D, int64_t den, float svmax, float* o) {
    const __m512 vden = _mm512_set1_ps((float)den), vsvmax = _mm512_set1_ps(svmax);
    for (size_t d = 0; d < D; d += 16) {
        const __mmask16 live = live16(d, D);
        const __m256 lo = _mm512_cvtepi64_ps(_mm512_maskz_loadu_epi64((__mmask8)live, num + d));
        const __m256 hi = _mm512_cvtepi64_ps(_mm512_maskz_loadu_epi64((__mmask8)(live >> 8), num + d + 8));
        const __m512 x = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
        _mm512_mask_storeu_ps(o + d, live, _mm512_mul_ps(_mm512_div_ps(x, vden), vsvmax));
    }
}

/* ---- accumulate ----------------------------------------------------------------------------- */

/* For 64 dims of rows x and y: acc[i] += wl * p_i and acc[4 + i] += wh * p_i, where p_i holds
 * the sign-extended i16 pairs (x_d, y_d) of dims {0-7, 16-23}, {32-39, 48-55}, {8-15, 24-31},
 * {40-47, 56-63} (the bytes interleaved per 128-bit block, then widened by halves). */
INLINE_VNNI void accumulate_pair(__m512i x, __m512i y, __m512i wl, __m512i wh, __m512i acc[8]) {
    const __m512i lo = _mm512_unpacklo_epi8(x, y), hi = _mm512_unpackhi_epi8(x, y);
    const __m512i p[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                          _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                          _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                          _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
    for (int i = 0; i < 4; i++) {
        acc[i] = _mm512_dpwssd_epi32(acc[i], p[i], wl);
        acc[4 + i] = _mm512_dpwssd_epi32(acc[4 + i], p[i], wh);
    }
}

/* num[0 .. 16) += 4096 * hi + lo in i64, for the dims that `live` (a bit per dim) keeps. */
INLINE_VNNI void add_wide(int64_t* num, __m512i lo, __m512i hi, __mmask16 live) {
    const __m512i halves_lo[2] = {_mm512_cvtepi32_epi64(_mm512_castsi512_si256(lo)),
                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lo, 1))};
    const __m512i halves_hi[2] = {_mm512_cvtepi32_epi64(_mm512_castsi512_si256(hi)),
                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(hi, 1))};
    for (int h = 0; h < 2; h++) {
        const __mmask8 m = (__mmask8)(live >> (8 * h));
        const __m512i sum = _mm512_add_epi64(_mm512_slli_epi64(halves_hi[h], 12), halves_lo[h]);
        _mm512_mask_storeu_epi64(num + 8 * h, m, _mm512_add_epi64(_mm512_maskz_loadu_epi64(m, num + 8 * h), sum));
    }
}

/* num[0 .. 64) += the lanes of acc, back in dimension order (dims 16 q .. 16 q + 15 are the low
 * 8 lanes of one accumulator and the low or high 8 of its partner), for the live dims. */
INLINE_VNNI void flush(const __m512i acc[8], int64_t* num, __mmask64 live) {
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    static const int pair[4][2] = {{0, 2}, {0, 2}, {1, 3}, {1, 3}}; /* the accumulators of dims 16 q .. */
    for (int qd = 0; qd < 4; qd++) {
        const __m512i idx = qd % 2 ? high : low;
        const int a = pair[qd][0], b = pair[qd][1];
        add_wide(num + 16 * qd, _mm512_permutex2var_epi32(acc[a], idx, acc[b]),
                 _mm512_permutex2var_epi32(acc[4 + a], idx, acc[4 + b]), (__mmask16)(live >> (16 * qd)));
    }
}

/* The broadcast i16 pair words (ul_a, ul_b) and (uh_a, uh_b) of u = 4096 * uh + ul. */
INLINE_VNNI void pair_words(int32_t ua, int32_t ub, __m512i* wl, __m512i* wh) {
    *wl = _mm512_set1_epi32((ua & 4095) | (ub & 4095) << 16);
    *wh = _mm512_set1_epi32((ua >> 12) | (ub >> 12) << 16);
}

/* acc += the pairs of keys [j0, j1) of rows v, dims d0 .. d0+64 under `live` (an odd last key
 * pairs with a zero row of weight 0). */
INLINE_VNNI void accumulate_keys(const int32_t* u, const int8_t* v, size_t j0, size_t j1, size_t D, size_t d0,
                                 __mmask64 live, __m512i acc[8]) {
    __m512i wl, wh;
    size_t j = j0;
    for (; j + 1 < j1; j += 2) {
        pair_words(u[j], u[j + 1], &wl, &wh);
        const __m512i x = _mm512_maskz_loadu_epi8(live, v + j * D + d0);
        accumulate_pair(x, _mm512_maskz_loadu_epi8(live, v + (j + 1) * D + d0), wl, wh, acc);
    }
    if (j < j1) {
        pair_words(u[j], 0, &wl, &wh);
        accumulate_pair(_mm512_maskz_loadu_epi8(live, v + j * D + d0), _mm512_setzero_si512(), wl, wh, acc);
    }
}

/* num[d0 .. d0+64) += Σ_j u_j v_jd over the segments, for the live dims: the i32 lanes take at
 * most FLUSH_PAIRS pairs between flushes, so a segment is cut where the room runs out. */
INLINE_VNNI void accumulate_chunk(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D, size_t d0,
                                  int64_t* num) {
    const __mmask64 live = live_bytes(d0, D);
    __m512i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_si512();
    size_t room = FLUSH_PAIRS;
    for (size_t i = 0; i < n_segs; u += segs[i].n, i++)
        for (size_t j0 = 0; j0 < segs[i].n;) {
            if (room == 0) {
                flush(acc, num + d0, live);
                for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_si512();
                room = FLUSH_PAIRS;
            }
            const size_t j1 = segs[i].n - j0 < 2 * room ? segs[i].n : j0 + 2 * room;
            accumulate_keys(u, segs[i].v, j0, j1, D, d0, live, acc);
            room -= (j1 - j0 + 1) / 2;
            j0 = j1;
        }
    flush(acc, num + d0, live);
}

VNNI static void accumulate_segments_avx512(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D,
                                            int64_t* num) {
    for (size_t d0 = 0; d0 < D; d0 += STEP) accumulate_chunk(u, segs, n_segs, D, d0, num);
}

const tl_attn_kernels tl_attn_avx512 = {.quantize = tl_quantize_row_avx512,
                                        .scores = scores_avx512,
                                        .max = max_avx512,
                                        .weights = weights_avx512,
                                        .accumulate_segments = accumulate_segments_avx512,
                                        .output = output_avx512};
