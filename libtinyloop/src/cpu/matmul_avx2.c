/* matmul_avx2.c — AVX2 linear kernel. A pass computes a panel of 8-row tiles x tokens in
 * registers, loading each weight vector once per token of the panel and each activation word
 * once per tile: int8 runs 2 tiles x 4 tokens (prefill) or 4 tiles x 1 token (decode), int4
 * 1 tile x 4 tokens. Results are emitted 8 rows at a time, with the spec's f32 operations.
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

#include "cpu/matmul_kernels.h"

#define AVX2 __attribute__((target("avx2")))
#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2")))

enum {
    TR = 8,                    /* rows per packed tile                                  */
    RT_MAX = 4, NT_MAX = 4,    /* the largest panel: tiles, tokens                       */
    INT4_STEPS_PER_FLUSH = 4,  /* 8-k steps per 16-bit partial (the bound above)         */
    PREFETCH_AHEAD = 1024      /* bytes ahead in a weight stream, when streaming (decode) */
};

typedef __m256i panel_acc[RT_MAX][NT_MAX];

INLINE_AVX2 __m256i broadcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* acc[i][t] = Σ_k q[t0+t][k] * w[row][k] for the 8 rows of tile tile0 + i, i < rt, t < nt. */
INLINE_AVX2 void int8_panel(const tl_linear* L, size_t tile0, int rt, const tl_acts* A, size_t t0, int nt,
                            panel_acc acc) {
    const size_t steps = L->cols_padded / 4, tile_bytes = TR * (size_t)L->cols_padded;
    const uint8_t* W = L->packed + tile0 * tile_bytes;
    const int8_t* q = A->q + t0 * A->stride;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int i = 0; i < rt; i++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[i][t] = _mm256_setzero_si256();
    for (size_t s = 0; s < steps; s++) {
        __m256i w[RT_MAX], w_abs[RT_MAX];
#pragma GCC unroll 4
        for (int i = 0; i < rt; i++) {
            const uint8_t* wp = W + i * tile_bytes + 32 * s;
            if (nt == 1) _mm_prefetch((const char*)(wp + PREFETCH_AHEAD), _MM_HINT_T0);
            w[i] = _mm256_load_si256((const __m256i*)wp);
            w_abs[i] = _mm256_abs_epi8(w[i]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const __m256i a = broadcast4(q + t * A->stride + 4 * s);
#pragma GCC unroll 4
            for (int i = 0; i < rt; i++) {
                const __m256i p = _mm256_maddubs_epi16(w_abs[i], _mm256_sign_epi8(a, w[i]));
                acc[i][t] = _mm256_add_epi32(acc[i][t], _mm256_madd_epi16(p, ones));
            }
        }
    }
}

/* acc[0][t] = the int4 dot products of tile tile0 with token t0 + t, t < nt (rt is 1). */
INLINE_AVX2 void int4_panel(const tl_linear* L, size_t tile0, const tl_acts* A, size_t t0, int nt,
                            panel_acc acc) {
    const size_t K = L->src.cols, gs = L->src.group_size, groups = K / gs, steps_per_group = gs / 8;
    const uint8_t* W = L->packed + tile0 * (TR * K / 2);
    const int32_t* mult = L->mult + tile0 * groups * TR;
    const uint8_t* qx = A->qx + t0 * A->stride;
    const __m256i nibble = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    const __m256i corr = _mm256_loadu_si256((const __m256i*)(L->corr + tile0 * TR));
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[0][t] = _mm256_sub_epi32(_mm256_setzero_si256(), corr);
    for (size_t g = 0; g < groups; g++) {
        const __m256i m = _mm256_loadu_si256((const __m256i*)(mult + g * TR));
        const __m256i m_pairs = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
        for (size_t sub = 0; sub < steps_per_group; sub += INT4_STEPS_PER_FLUSH) {
            const size_t st0 = g * steps_per_group + sub;
            const size_t st1 = st0 + (steps_per_group - sub < INT4_STEPS_PER_FLUSH ? steps_per_group - sub
                                                                                 : INT4_STEPS_PER_FLUSH);
            __m256i part[NT_MAX];
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) part[t] = _mm256_setzero_si256();
            for (size_t st = st0; st < st1; st++) {
                if (nt == 1) _mm_prefetch((const char*)(W + 32 * st + PREFETCH_AHEAD), _MM_HINT_T0);
                const __m256i x = _mm256_load_si256((const __m256i*)(W + 32 * st));
                const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(x, nibble), eight);
                const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), nibble), eight);
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) {
                    const uint8_t* a = qx + t * A->stride + 8 * st;
                    part[t] = _mm256_add_epi16(part[t], _mm256_maddubs_epi16(broadcast4(a), lo));
                    part[t] = _mm256_add_epi16(part[t], _mm256_maddubs_epi16(broadcast4(a + 4), hi));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) acc[0][t] = _mm256_add_epi32(acc[0][t], _mm256_madd_epi16(part[t], m_pairs));
        }
    }
}

/* y[t][row0 .. row0+8) = ((f32)acc * a_t) * ws, or +=, or the 8 accumulators into o->raw; a
 * tile that ends past row1 (the last of the linear) goes row by row. */
INLINE_AVX2 void emit(const tl_linear* L, const tl_acts* A, size_t row0, size_t t, __m256i acc,
                      const tl_gemm_out* o) {
    if (row0 + TR > o->row1) {
        int32_t lanes[TR];
        _mm256_storeu_si256((__m256i*)lanes, acc);
        for (size_t r = 0; row0 + r < o->row1; r++) tl_gemm_put(o, L, A, t, row0 + r, lanes[r]);
        return;
    }
    if (o->raw) {
        _mm256_storeu_si256((__m256i*)(o->raw + t * o->raw_stride + (row0 - o->raw_row0)), acc);
        return;
    }
    float* y = o->y + t * o->y_stride + row0;
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(A->scale[t])),
                             _mm256_loadu_ps(L->scale + row0));
    if (o->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(y), v);
    _mm256_storeu_ps(y, v);
}

/* Tiles tile0 .. tile0+rt-1 x tokens t0 .. t0+nt-1, emitted (int4, rt and nt are constants at
 * every call site, so the panel lives in registers; int4 panels have one tile). */
INLINE_AVX2 void panel(const tl_linear* L, const tl_acts* A, bool int4, size_t tile0, int rt, size_t t0, int nt,
                       const tl_gemm_out* out) {
    panel_acc acc;
    if (int4) int4_panel(L, tile0, A, t0, nt, acc);
    else int8_panel(L, tile0, rt, A, t0, nt, acc);
#pragma GCC unroll 4
    for (int i = 0; i < rt; i++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            emit(L, A, (tile0 + i) * TR, t0 + t, acc[i][t], out);
}

/* Every token of tiles tile0 .. tile0+rt-1: panels of 4 tokens, then the rest. */
INLINE_AVX2 void tile_tokens(const tl_linear* L, const tl_acts* A, bool int4, size_t tile0, int rt,
                             const tl_gemm_out* out) {
    const size_t n = tl_acts_rows(A);
    size_t t0 = 0;
    for (; t0 + 4 <= n; t0 += 4) panel(L, A, int4, tile0, rt, t0, 4, out);
    switch (n - t0) {
    case 3: panel(L, A, int4, tile0, rt, t0, 3, out); break;
    case 2: panel(L, A, int4, tile0, rt, t0, 2, out); break;
    case 1: panel(L, A, int4, tile0, rt, t0, 1, out); break;
    default: break;
    }
}

AVX2 void tl_gemm_avx2(const tl_linear* L, const tl_acts* A, uint32_t row0, const tl_gemm_out* out) {
    const size_t tiles_end = (out->row1 + TR - 1) / TR;
    size_t tile = row0 / TR;
    if (L->src.group_size) {
        for (; tile < tiles_end; tile++) tile_tokens(L, A, true, tile, 1, out);
        return;
    }
    if (tl_acts_rows(A) == 1) { /* decode: four tiles per activation word */
        for (; tile + 4 <= tiles_end; tile += 4) panel(L, A, false, tile, 4, 0, 1, out);
        for (; tile < tiles_end; tile++) panel(L, A, false, tile, 1, 0, 1, out);
        return;
    }
    for (; tile + 2 <= tiles_end; tile += 2) tile_tokens(L, A, false, tile, 2, out);
    for (; tile < tiles_end; tile++) tile_tokens(L, A, false, tile, 1, out);
}
