/* matmul_avx512.c — AVX-512 VNNI linear kernel (16-row tiles, int8 ones in pairs, up to 8 tokens
 * per pass).
 *
 * int8: vpdpbusd multiplies u8 by s8 and sums 4 products into i32 without saturation. The
 *       activations go in as u8 (q + 128) and the weights stay s8 (the layout the AMX path
 *       shares), so each lane gets Σ q*w + 128 * Σ w; corr, the per-row 128 * Σ w, is
 *       subtracted at the end (mod 2^32, exact because the true sum fits in i32).
 * int4: activations as u8 (q + 128) times the unpacked w (-8 .. 7) per group, then times the
 *       group multiplier (vpmulld) into the row total; corr removes Σ_g m * 128 * Σ w.
 * "Tokens" below are q rows (a block input's two digit rows count as two, matmul_kernels.h).
 * Compiled with a function-level target, so the library needs no -march flag. */
#include <immintrin.h>
#include <string.h>

#include "cpu/matmul_kernels.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE_AVX512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni")))

enum { TR = 16, NT = 8, PREFETCH_AHEAD = 2048 };

INLINE_AVX512 __m512i broadcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

INLINE_AVX512 void int8_tile(const tl_linear* L, size_t tile, const tl_acts* A, size_t t0, int nt,
                             int32_t acc_out[NT][TR]) {
    const size_t steps = L->cols_padded / 4;
    const uint8_t* W = L->packed + tile * TR * (size_t)L->cols_padded;
    __m512i acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_si512();
    for (size_t s = 0; s < steps; s++) {
        _mm_prefetch((const char*)(W + 64 * s + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m512i w = _mm512_load_si512((const void*)(W + 64 * s));
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            acc[t] = _mm512_dpbusd_epi32(acc[t], broadcast4(A->qx + (t0 + t) * A->stride + 4 * s), w);
        }
    }
    const __m512i corr = _mm512_loadu_si512((const void*)(L->corr + tile * TR));
    for (int t = 0; t < nt; t++) _mm512_storeu_si512((void*)acc_out[t], _mm512_sub_epi32(acc[t], corr));
}

/* int8_tile on two consecutive tiles at once: each activation broadcast feeds both. */
INLINE_AVX512 void int8_tile_pair(const tl_linear* L, size_t tile, const tl_acts* A, size_t t0, int nt,
                                  int32_t acc_out[2][NT][TR]) {
    const size_t steps = L->cols_padded / 4;
    const uint8_t* W0 = L->packed + tile * TR * (size_t)L->cols_padded;
    const uint8_t* W1 = W0 + TR * (size_t)L->cols_padded;
    __m512i acc0[NT], acc1[NT];
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm512_setzero_si512();
    for (size_t s = 0; s < steps; s++) {
        _mm_prefetch((const char*)(W0 + 64 * s + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)(W1 + 64 * s + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m512i w0 = _mm512_load_si512((const void*)(W0 + 64 * s));
        const __m512i w1 = _mm512_load_si512((const void*)(W1 + 64 * s));
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const __m512i a = broadcast4(A->qx + (t0 + t) * A->stride + 4 * s);
            acc0[t] = _mm512_dpbusd_epi32(acc0[t], a, w0);
            acc1[t] = _mm512_dpbusd_epi32(acc1[t], a, w1);
        }
    }
    const __m512i corr0 = _mm512_loadu_si512((const void*)(L->corr + tile * TR));
    const __m512i corr1 = _mm512_loadu_si512((const void*)(L->corr + (tile + 1) * TR));
    for (int t = 0; t < nt; t++) {
        _mm512_storeu_si512((void*)acc_out[0][t], _mm512_sub_epi32(acc0[t], corr0));
        _mm512_storeu_si512((void*)acc_out[1][t], _mm512_sub_epi32(acc1[t], corr1));
    }
}

INLINE_AVX512 void int4_tile(const tl_linear* L, size_t tile, const tl_acts* A, size_t t0, int nt,
                             int32_t acc_out[NT][TR]) {
    const size_t K = L->src.cols, gs = L->src.group_size, groups = K / gs, steps_per_group = gs / 8;
    const uint8_t* W = L->packed + tile * (TR * K / 2);
    const int32_t* mult = L->mult + tile * groups * TR;
    const __m512i nibble = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    __m512i acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_si512();
    for (size_t g = 0; g < groups; g++) {
        __m512i part[NT];
        for (int t = 0; t < NT; t++) part[t] = _mm512_setzero_si512();
        for (size_t st = g * steps_per_group; st < (g + 1) * steps_per_group; st++) {
            _mm_prefetch((const char*)(W + 64 * st + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m512i x = _mm512_load_si512((const void*)(W + 64 * st));
            const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(x, nibble), eight);
            const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), nibble), eight);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const uint8_t* qx = A->qx + (t0 + t) * A->stride + 8 * st;
                part[t] = _mm512_dpbusd_epi32(part[t], broadcast4(qx), lo);
                part[t] = _mm512_dpbusd_epi32(part[t], broadcast4(qx + 4), hi);
            }
        }
        const __m512i m = _mm512_loadu_si512((const void*)(mult + g * TR));
        for (int t = 0; t < nt; t++) acc[t] = _mm512_add_epi32(acc[t], _mm512_mullo_epi32(part[t], m));
    }
    const __m512i corr = _mm512_loadu_si512((const void*)(L->corr + tile * TR));
    for (int t = 0; t < nt; t++) _mm512_storeu_si512((void*)acc_out[t], _mm512_sub_epi32(acc[t], corr));
}

/* One pass over `tiles` (1, or 2 for int8) consecutive tiles for tokens t0 .. t0+nt-1. */
INLINE_AVX512 void tiles_pass(const tl_linear* L, size_t tile, int tiles, const tl_acts* A, size_t t0, int nt,
                              int32_t acc[2][NT][TR]) {
    if (tiles == 2) int8_tile_pair(L, tile, A, t0, nt, acc);
    else if (L->src.group_size) int4_tile(L, tile, A, t0, nt, acc[0]);
    else int8_tile(L, tile, A, t0, nt, acc[0]);
}

/* tiles_pass with nt a constant in each case, so the token loops unroll. */
INLINE_AVX512 void tokens_pass(const tl_linear* L, size_t tile, int tiles, const tl_acts* A, size_t t0, int nt,
                               int32_t acc[2][NT][TR]) {
    switch (nt) {
    case 8: tiles_pass(L, tile, tiles, A, t0, 8, acc); break;
    case 7: tiles_pass(L, tile, tiles, A, t0, 7, acc); break;
    case 6: tiles_pass(L, tile, tiles, A, t0, 6, acc); break;
    case 5: tiles_pass(L, tile, tiles, A, t0, 5, acc); break;
    case 4: tiles_pass(L, tile, tiles, A, t0, 4, acc); break;
    case 3: tiles_pass(L, tile, tiles, A, t0, 3, acc); break;
    case 2: tiles_pass(L, tile, tiles, A, t0, 2, acc); break;
    default: tiles_pass(L, tile, tiles, A, t0, 1, acc); break;
    }
}

/* Put the accumulators of `tile` for tokens t0 .. t0+nt-1 where out says (rows below row1). */
INLINE_AVX512 void emit_tile(const tl_linear* L, const tl_acts* A, size_t tile, size_t t0, int nt,
                             int32_t acc[NT][TR], const tl_gemm_out* out) {
    for (int t = 0; t < nt; t++)
        for (uint32_t r = 0; r < TR && tile * TR + r < out->row1; r++)
            tl_gemm_put(out, L, A, t0 + t, tile * TR + r, acc[t][r]);
}

/* int8 tiles go two at a time where two remain, so each activation broadcast feeds 32 rows. */
AVX512 void tl_gemm_avx512(const tl_linear* L, const tl_acts* A, uint32_t row0, const tl_gemm_out* out) {
    const size_t n = tl_acts_rows(A);
    int32_t acc[2][NT][TR];
    for (size_t tile = row0 / TR, tiles; tile * TR < out->row1; tile += tiles) {
        tiles = !L->src.group_size && (tile + 1) * TR < out->row1 ? 2 : 1;
        for (size_t t0 = 0; t0 < n; t0 += NT) {
            const int nt = n - t0 < NT ? (int)(n - t0) : NT;
            tokens_pass(L, tile, (int)tiles, A, t0, nt, acc);
            for (size_t k = 0; k < tiles; k++) emit_tile(L, A, tile + k, t0, nt, acc[k], out);
        }
    }
}
