/* quant.c — Q8/Q4 row quantization, NQ, RoPE and RN (docs/spec.md §2.2, §2.3, §2.6, §2.7),
 * scalar and exact. These rows are O(d) per token; the matmuls dominate, so clarity wins here. */
#include "cpu/quant.h"

#include <math.h>

#include "core/numerics.h"

/* max_i |x_i| from 0, NaN-ignoring (a NaN never compares greater), as eight independent running
 * maxima rather than one serial chain: the values are >= +0 and never NaN, so the order in which
 * the maxima combine cannot change the result. */
static float abs_max(const float* x, size_t n) {
    float m[8] = {0.0f};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) m[k] = fabsf(x[i + k]) > m[k] ? fabsf(x[i + k]) : m[k];
    for (; i < n; i++) m[0] = fabsf(x[i]) > m[0] ? fabsf(x[i]) : m[0];
    float amax = 0.0f;
    for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
    return amax;
}

#define TINY_ROW 5.421010862427522e-20f /* 2^-64, 0x1f800000: §2.2 step 2 */

/* §2.2 step 4 for one element: rint(clamp(x * r, -qmax, qmax)), qmax = fq. */
static inline int quantize_one(float x, float r, float fq) {
    return (int)tl_rint_small(tl_clamp(x * r, -fq, fq));
}

float tl_quantize_row(const float* x, size_t n, int qmax, int8_t* q) {
    const float amax = abs_max(x, n);
    if (amax < TINY_ROW) {
        for (size_t i = 0; i < n; i++) q[i] = 0;
        return 0.0f;
    }
    const float fq = (float)qmax;
    const float r = fq / amax;
    for (size_t i = 0; i < n; i++) q[i] = (int8_t)quantize_one(x[i], r, fq);
    return amax / fq;
}

float tl_nq_from_q8(const int8_t* q, size_t n, float s, float eps) {
    int64_t ss = 0;
    for (size_t i = 0; i < n; i++) ss += (int32_t)q[i] * q[i];
    return tl_nq_scale(ss, s, n, eps);
}

float tl_rms_quantize_row(const float* x, size_t n, float eps, int8_t* q) {
    return tl_nq_from_q8(q, n, tl_quantize_row(x, n, 127, q), eps);
}

void tl_rms_norm_row(const float* x, const float* gain, size_t n, float eps, float* y) {
    const float fq = 32767.0f, amax = abs_max(x, n); /* Q16; a tiny row has q = 0, s = 0 */
    int64_t ss = 0;
    float s = 0.0f;
    if (amax >= TINY_ROW) {
        const float r = fq / amax;
        for (size_t i = 0; i < n; i++) {
            const int64_t q = quantize_one(x[i], r, fq);
            ss += q * q;
        }
        s = amax / fq;
    }
    const float t = tl_rms_of(ss, s, n, eps);
    for (size_t i = 0; i < n; i++) y[i] = (x[i] / t) * gain[i];
}

void tl_swiglu_row(float* gate, const float* up, size_t n) {
    for (size_t i = 0; i < n; i++) gate[i] = tl_silu(gate[i]) * up[i];
}

void tl_rope_head(float* x, size_t D, const float* cos, const float* sin) {
    const size_t half = D / 2;
    for (size_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        const float ac = a * cos[i], bs = b * sin[i];
        const float bc = b * cos[i], as = a * sin[i];
        x[i] = ac - bs;
        x[i + half] = bc + as;
    }
}
