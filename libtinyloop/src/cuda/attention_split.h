/* attention_split.h — the arithmetic of one (row, head)'s attention (docs/spec.md §4.1) split
 * over key ranges, as __host__ __device__ functions: attention.cu runs them on the device and
 * tests/test_attention_split.c runs the same code on the CPU against cpu/attention.c.
 *
 * Why a split is exact: the attention needs only (a) the maxima M = max S_j and
 * svmax = max sv_j, and (b) the integer sums den = Σ E_j and num_d = Σ U_j * vq_jd (exact in
 * i64: below 2^25 * 127 * max_seq_len < 2^53). A split i of the visible keys computes, over its
 * own range, the NaN-ignoring partial maxima (from -inf, so never NaN) and, once every split's
 * maxima are merged into M and svmax, its partial integer sums. Merging maxima of NaN-free values
 * and adding integers are order-free, so the merged M, svmax, den and num_d are those of the
 * unsplit pass, whatever the number of splits or the order of the merge (a zero maximum may differ
 * in sign only, which no output depends on: cpu/attention_kernels.h). The output is then the
 * unsplit pass's own final step, tl_att_output. Plain C (no device intrinsics) so both sides
 * compile it. */
#ifndef TL_CUDA_ATTENTION_SPLIT_H
#define TL_CUDA_ATTENTION_SPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/numerics.h"

/* Pass 1's result over one split's keys: NaN-ignoring maxima from -inf (-inf when empty). */
typedef struct tl_att_max {
    float m;     /* max S_j  */
    float svmax; /* max sv_j */
} tl_att_max;

/* Pass 2's result over one split's keys: Σ E_j, and whether some U_j is NaN. */
typedef struct tl_att_sum {
    int64_t den;
    int32_t nan;
} tl_att_sum;

/* Keys [*k0, *k1) (relative to the first visible key) of split i of n over nvis keys:
 * consecutive ranges of ceil(nvis / n) keys, the last ones shorter or empty. */
static inline TL_HD void tl_att_split_range(uint32_t nvis, uint32_t n, uint32_t i, uint32_t* k0, uint32_t* k1) {
    const uint32_t per = (nvis + n - 1) / n;
    const uint64_t a = (uint64_t)i * per, b = a + per;
    *k0 = a < nvis ? (uint32_t)a : nvis;
    *k1 = b < nvis ? (uint32_t)b : nvis;
}

/* E_j = rint(e_j * 2^24) of one key with score s and value scale sv, e_j = exp2s((s - M) * LOG2E);
 * *u = U_j = rint(e_j * (sv * kappa)), or 0 with *nan set when U_j is NaN (sv = inf). */
static inline TL_HD int64_t tl_att_weight(float s, float M, float sv, float kappa, int32_t* u, bool* nan) {
    const float e = tl_exp2s((s - M) * TL_LOG2E);
    const float uf = tl_rint(e * (sv * kappa)); /* <= 2^24 + 2, or NaN if sv = inf */
    *nan |= uf != uf;
    *u = uf == uf ? (int32_t)uf : 0;
    return (int64_t)tl_rint(e * 16777216.0f); /* <= 2^24 */
}

/* The maxima of the whole key range from its n splits' partial maxima. */
static inline TL_HD tl_att_max tl_att_merge_max(const tl_att_max* part, uint32_t n) {
    tl_att_max r = {-INFINITY, -INFINITY};
    for (uint32_t i = 0; i < n; i++) {
        r.m = tl_fmax(r.m, part[i].m);
        r.svmax = tl_fmax(r.svmax, part[i].svmax);
    }
    return r;
}

/* den of the whole key range from its n splits' partial sums; *nan if some split saw a NaN U_j. */
static inline TL_HD int64_t tl_att_merge_den(const tl_att_sum* part, uint32_t n, bool* nan) {
    int64_t den = 0;
    for (uint32_t i = 0; i < n; i++) {
        den += part[i].den;
        *nan |= part[i].nan != 0;
    }
    return den;
}

/* num_d of the whole key range from the splits' partials num[i * stride], i < n. */
static inline TL_HD int64_t tl_att_merge_num(const int64_t* num, uint32_t n, size_t stride) {
    int64_t s = 0;
    for (uint32_t i = 0; i < n; i++) s += num[(size_t)i * stride];
    return s;
}

/* κ = 2^24 / svmax (for 0 < svmax < inf). */
static inline TL_HD float tl_att_kappa(float svmax) { return 16777216.0f / svmax; }

/* o_d = ((f32)num_d / (f32)den) * svmax. */
static inline TL_HD float tl_att_output(int64_t num, int64_t den, float svmax) {
    return ((float)num / (float)den) * svmax;
}

#endif
