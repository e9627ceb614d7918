/* numerics.h — the element-wise primitives of docs/spec.md §2, inline.
 *
 * Each is a sequence of single, correctly rounded binary32 operations in exactly the spec's
 * order (the library is compiled with -ffp-contract=off and without fast-math). No libm
 * transcendental is used; rounding helpers are exact for every input they are given. */
#ifndef TL_NUMERICS_H
#define TL_NUMERICS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Host and device: the CUDA backend (src/cuda/) runs these same functions in its kernels. */
#ifdef __CUDACC__
#define TL_HD __host__ __device__
#else
#define TL_HD
#endif

#define TL_LOG2E 1.4426950216293335f /* 0x3fb8aa3b */

static inline TL_HD float tl_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline TL_HD uint32_t tl_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* §2.1: a NaN becomes lo. */
static inline TL_HD float tl_clamp(float x, float lo, float hi) {
    x = (x >= lo) ? x : lo;
    x = (x <= hi) ? x : hi;
    return x;
}

/* rint (round half to even) for finite x, without libm: adding and subtracting 2^23 rounds
 * |x| < 2^23 to an integer in the current (round-to-nearest-even) mode; larger values
 * already are integers. */
static inline TL_HD float tl_rint(float x) {
    const float two23 = 8388608.0f;
    if (x >= 0.0f) return x < two23 ? (x + two23) - two23 : x;
    return x > -two23 ? -((-x + two23) - two23) : x;
}

/* rint for |x| <= 2^22, branch-free: x + 1.5 * 2^23 lies in [2^23, 2^24), where the spacing
 * of floats is 1, so the addition itself rounds x half-to-even. (-0.5 gives +0, not -0: the
 * callers convert to integers.) */
static inline TL_HD float tl_rint_small(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (x + magic) - magic;
}

/* floor for x in [-126, 126] (after the exp2 clamp), exact. */
static inline TL_HD int tl_floor_small(float x) {
    int n = (int)x; /* truncation toward zero */
    return ((float)n > x) ? n - 1 : n;
}

/* §2.4 exp2s: clamp, split, Horner in the fixed order, exact power-of-two scaling. */
static inline TL_HD float tl_exp2s(float x) {
    x = tl_clamp(x, -126.0f, 126.0f);
    int n = tl_floor_small(x);
    float f = x - (float)n;
    float p = 0.0002179613511543721f;     /* C6 0x39648c8e */
    p = p * f + 0.001241427380591631f;    /* C5 0x3aa2b764 */
    p = p * f + 0.009681273251771927f;    /* C4 0x3c1e9e34 */
    p = p * f + 0.0554824098944664f;      /* C3 0x3d634186 */
    p = p * f + 0.24022991955280304f;     /* C2 0x3e75fed5 */
    p = p * f + 0.6931470036506653f;      /* C1 0x3f317215 */
    p = p * f + 1.0f;                     /* C0 0x3f800000 */
    return p * tl_bits_to_f32((uint32_t)(n + 127) << 23);
}

#define TL_LN2 0.6931471824645996f /* 0x3f317218: §2.8 */

/* §2.8 log2s(N) for an integer 1 <= N < 2^63: e = N's highest set bit, f = (f32) N * 2^-e in
 * [1, 2], s = (f - 1) / (f + 1), an odd series in s by Horner in w = s * s, then e + p. */
static inline TL_HD float tl_log2s(uint64_t N) {
    int e = 0;
    for (int k = 32; k > 0; k /= 2)
        if (N >> (e + k)) e += k;
    const float f = (float)N * tl_bits_to_f32((uint32_t)(127 - e) << 23); /* 2^-e: exact */
    const float s = (f - 1.0f) / (f + 1.0f);
    const float w = s * s;
    float p = 0.22195307910442352f;       /* K6 0x3e6347ab */
    p = p * w + 0.26230818033218384f;     /* K5 0x3e864d42 */
    p = p * w + 0.32059890031814575f;     /* K4 0x3ea4258a */
    p = p * w + 0.41219857335090637f;     /* K3 0x3ed30bb1 */
    p = p * w + 0.5770780444145203f;      /* K2 0x3f13bb63 */
    p = p * w + 0.9617967009544373f;      /* K1 0x3f76384f */
    p = p * w + 2.885390043258667f;       /* K0 0x4038aa3b */
    p = p * s;
    return (float)e + p;
}

/* §2.4 exps(x) = exp2s(x * LOG2E). */
static inline TL_HD float tl_exps(float x) { return tl_exp2s(x * TL_LOG2E); }

/* §2.5 the t = 1 + exps(-v) that silu and sig divide by, in the spec's order. */
static inline TL_HD float tl_silu_den(float v) {
    float t = -v;
    float e = tl_exps(t);
    t = 1.0f + e;
    return t;
}

/* §2.5 silu(v) = v / (1 + exps(-v)). */
static inline TL_HD float tl_silu(float v) { return v / tl_silu_den(v); }

/* §2.5 sig(v) = 1 / (1 + exps(-v)). */
static inline TL_HD float tl_sigmoid(float v) { return 1.0f / tl_silu_den(v); }

/* §4 loop attention's gate of one head: g = sig(gz), gz = (((f32)dot * sq) * gs) + gb, where dot
 * is the exact integer Σ_d qq_d * gw_d of the head's quantized query (qq, sq) and its gate row. */
static inline TL_HD float tl_loop_gate(int64_t dot, float sq, float gs, float gb) {
    return tl_sigmoid((((float)dot * sq) * gs) + gb);
}

/* §4 loop attention's mix of one element: (g * og) + (rest * ol), rest = 1 - g (once per head). */
static inline TL_HD float tl_loop_mix(float g, float rest, float og, float ol) { return (g * og) + (rest * ol); }

/* f32 -> i64 of an integral value as x86 converts (and so numpy on x86): a NaN or a value
 * outside the i64 range gives INT64_MIN instead of undefined behaviour. */
static inline TL_HD int64_t tl_to_i64(float x) {
    return (x >= -9.2233720368547758e18f && x < 9.2233720368547758e18f) ? (int64_t)x : INT64_MIN;
}

/* NaN-ignoring max (C fmaxf semantics, without the libm call). */
static inline TL_HD float tl_fmax(float acc, float x) { return (x > acc || acc != acc) ? x : acc; }

#define TL_TINY_ROW 5.421010862427522e-20f /* 2^-64, 0x1f800000: §2.2 step 2 */

/* §2.2 step 1: max_i |x_i| from 0, NaN-ignoring (a NaN never compares greater), as eight
 * independent running maxima rather than one serial chain: the values are >= +0 and never NaN,
 * so the order in which the maxima combine cannot change the result. */
static inline TL_HD float tl_abs_max(const float* x, size_t n) {
    float m[8] = {0.0f};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) m[k] = fabsf(x[i + k]) > m[k] ? fabsf(x[i + k]) : m[k];
    for (; i < n; i++) m[0] = fabsf(x[i]) > m[0] ? fabsf(x[i]) : m[0];
    float amax = 0.0f;
    for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
    return amax;
}

/* §2.2 Q(x, qmax) but step 4, with fq = (f32) qmax: returns the scale s, and *r the factor step
 * 4 multiplies by. s == 0 exactly for a row below 2^-64 (step 2), whose q are all 0. */
static inline TL_HD float tl_quantize_begin(const float* x, size_t n, float fq, float* r) {
    const float amax = tl_abs_max(x, n);
    if (amax < TL_TINY_ROW) {
        *r = 0.0f;
        return 0.0f;
    }
    *r = fq / amax;
    return amax / fq;
}

/* §2.2 step 4 for one element: rint(clamp(x * r, -fq, fq)). */
static inline TL_HD int tl_quantize_one(float x, float r, float fq) {
    return (int)tl_rint_small(tl_clamp(x * r, -fq, fq));
}

/* ceil for x in [1, 255] (after §2.2.1's clamp), exact. */
static inline TL_HD int tl_ceil_small(float x) {
    const int n = (int)x; /* truncation toward zero: x is positive */
    return ((float)n < x) ? n + 1 : n;
}

#define TL_BLOCK_QMAX 32385.0f /* 255 * 127: §2.2.1's largest |p| */

/* §2.2.1 step 3: the multiplier m_b = (int) ceil(clamp(amax_b * u, 1, 255)) of a block whose
 * NaN-ignoring max |x_i| is amax_b, u = 255 / amax (a NaN product, from an infinite row, is 1). */
static inline TL_HD int tl_block_multiplier(float amax_b, float u) {
    return tl_ceil_small(tl_clamp(amax_b * u, 1.0f, 255.0f));
}

/* §3's high digit of a block input p (|p| <= 32385): h = floor((p + 127) / 255), so that
 * p = 255 * h + l with h and l both in [-127, 127] (p + 32767 > 0, where / is floor). */
static inline TL_HD int tl_digit_high(int p) { return (p + 32767) / 255 - 128; }

/* §2.3 step 3 and §2.7 step 3: the root mean square t of a row of n elements from
 * ss = Σ q² (exact) and the row's quantization scale s (Q8 for NQ, Q16 for RN). */
static inline TL_HD float tl_rms_of(int64_t ss, float s, size_t n, float eps) {
    float t = (float)ss;
    t = t * s;
    t = t * s;
    t = t / (float)n;
    t = t + eps;
    return sqrtf(t);
}

/* §2.3 NQ, steps 3-4: the matmul input scale a from ss = Σ q² (exact) and the Q8 scale s of a
 * row of n elements. */
static inline TL_HD float tl_nq_scale(int64_t ss, float s, size_t n, float eps) {
    return s / tl_rms_of(ss, s, n, eps);
}

#endif
