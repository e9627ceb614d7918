/* matmul_avx2.c — AVX2 linear kernel (8-row tiles, up to 4 tokens per pass over the weights).
 *
 * int8: vpmaddubsw needs an unsigned operand, so it multiplies |w| (u8, <= 128) by q with w's
 *       sign applied (vpsignb; |q| <= 127 so no overflow): each 16-bit pair sum is at most
 *       2 * 128 * 127 = 32512, exact; vpmaddwd by 1 widens to i32.
 * int4: activations as u8 (q + 128) times w (-8 .. 7): a 16-bit lane gathers at most 4 steps
 *       x 2 pairs x 2 products of 255 * 8, i.e. |sum| <= 32640, exact; vpmaddwd with the group
 *       multiplier (both 16-bit halves hold m) gives m * (group partial) in i32. The +128
 *       offset adds Σ_g m * 128 * Σ w per row, removed with the precomputed corr (mod 2^32).
 * Compiled with a function-level target, so the library needs no -march flag. */
#include <immintrin.h>
#include <string.h>

#include "matmul.h"

#define AVX2 __attribute__((target("avx2")))
#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2")))

enum { TR = 8, NT = 4, INT4_STEPS_PER_FLUSH = 4, PREFETCH_AHEAD = 1024 };

INLINE_AVX2 __m256i broadcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* acc[t][r] = Σ_k q[t0+t][k] * w[r][k] for one tile of 8 rows, nt tokens. */
INLINE_AVX2 void int8_tile(const uint8_t* W, size_t steps, const tl_acts* A, size_t t0, int nt,
                           int32_t acc_out[NT][TR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_si256();
    for (size_t s = 0; s < steps; s++) {
        _mm_prefetch((const char*)(W + 32 * s + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m256i w = _mm256_load_si256((const __m256i*)(W + 32 * s));
        const __m256i w_abs = _mm256_abs_epi8(w);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const __m256i a = broadcast4(A->q + (t0 + t) * A->stride + 4 * s);
            const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
            acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, ones));
        }
    }
    for (int t = 0; t < nt; t++) _mm256_storeu_si256((__m256i*)acc_out[t], acc[t]);
}

INLINE_AVX2 void int4_tile(const tl_linear* L, size_t tile, const tl_acts* A, size_t t0, int nt,
                           int32_t acc_out[NT][TR]) {
    const size_t K = L->src.cols, gs = L->src.group_size, groups = K / gs, steps_per_group = gs / 8;
    const uint8_t* W = L->packed + tile * (TR * K / 2);
    const int32_t* mult = L->mult + tile * groups * TR;
    const __m256i nibble = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    __m256i acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_si256();
    for (size_t g = 0; g < groups; g++) {
        const __m256i m = _mm256_loadu_si256((const __m256i*)(mult + g * TR));
        const __m256i m_pairs = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
        for (size_t sub = 0; sub < steps_per_group; sub += INT4_STEPS_PER_FLUSH) {
            const size_t sub_end = sub + INT4_STEPS_PER_FLUSH < steps_per_group
                                       ? sub + INT4_STEPS_PER_FLUSH : steps_per_group;
            __m256i part[NT];
            for (int t = 0; t < NT; t++) part[t] = _mm256_setzero_si256();
            for (size_t st = g * steps_per_group + sub; st < g * steps_per_group + sub_end; st++) {
                _mm_prefetch((const char*)(W + 32 * st + PREFETCH_AHEAD), _MM_HINT_T0);
                const __m256i x = _mm256_load_si256((const __m256i*)(W + 32 * st));
                const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(x, nibble), eight);
                const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), nibble), eight);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    if (t >= nt) break;
                    const uint8_t* qx = A->qx + (t0 + t) * A->stride + 8 * st;
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(broadcast4(qx), lo),
                                                       _mm256_maddubs_epi16(broadcast4(qx + 4), hi));
                    part[t] = _mm256_add_epi16(part[t], p);
                }
            }
            for (int t = 0; t < nt; t++) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(part[t], m_pairs));
        }
    }
    const __m256i corr = _mm256_loadu_si256((const __m256i*)(L->corr + tile * TR));
    for (int t = 0; t < nt; t++) _mm256_storeu_si256((__m256i*)acc_out[t], _mm256_sub_epi32(acc[t], corr));
}

/* One tile x nt tokens, with nt a compile-time constant in each case. */
INLINE_AVX2 void tile_tokens(const tl_linear* L, size_t tile, const tl_acts* A, size_t t0, int nt,
                             int32_t acc[NT][TR]) {
    if (L->src.group_size) int4_tile(L, tile, A, t0, nt, acc);
    else int8_tile(L->packed + tile * TR * (size_t)L->cols_padded, L->cols_padded / 4, A, t0, nt, acc);
}

AVX2 void tl_gemm_avx2(const tl_linear* L, const tl_acts* A, uint32_t row0, uint32_t row1,
                       float* y, size_t y_stride, bool accumulate) {
    int32_t acc[NT][TR];
    for (size_t tile = row0 / TR; tile * TR < row1; tile++) {
        for (size_t t0 = 0; t0 < A->n; t0 += NT) {
            const int nt = A->n - t0 < NT ? (int)(A->n - t0) : NT;
            switch (nt) {
            case 4: tile_tokens(L, tile, A, t0, 4, acc); break;
            case 3: tile_tokens(L, tile, A, t0, 3, acc); break;
            case 2: tile_tokens(L, tile, A, t0, 2, acc); break;
            default: tile_tokens(L, tile, A, t0, 1, acc); break;
            }
            for (int t = 0; t < nt; t++)
                for (uint32_t r = 0; r < TR && tile * TR + r < row1; r++) {
                    const size_t row = tile * TR + r;
                    tl_emit(&y[(t0 + t) * y_stride + row], acc[t][r], A->scale[t0 + t], L->scale[row],
                            accumulate);
                }
        }
    }
}
