/* quant.c — Q8/Q4 row quantization, NQ, their block forms QB and NQB with the digit split of a
 * block input, RoPE and RN (docs/spec.md §2.2, §2.2.1, §2.3, §2.6, §2.7, §3), scalar and exact.
 * These rows are O(d) per token; the matmuls dominate, so clarity wins here. */
#include "cpu/quant.h"

#include <math.h>

#include "core/numerics.h"

float tl_quantize_row(const float* x, size_t n, int qmax, int8_t* q) {
    const float fq = (float)qmax;
    float r;
    const float s = tl_quantize_begin(x, n, fq, &r);
    if (s == 0.0f) {
        for (size_t i = 0; i < n; i++) q[i] = 0;
        return 0.0f;
    }
    for (size_t i = 0; i < n; i++) q[i] = (int8_t)tl_quantize_one(x[i], r, fq);
    return s;
}

float tl_nq_from_q8(const int8_t* q, size_t n, float s, float eps) {
    int64_t ss = 0;
    for (size_t i = 0; i < n; i++) ss += (int32_t)q[i] * q[i];
    return tl_nq_scale(ss, s, n, eps);
}

float tl_rms_quantize_row(const float* x, size_t n, float eps, int8_t* q) {
    return tl_nq_from_q8(q, n, tl_quantize_row(x, n, 127, q), eps);
}

float tl_block_quantize_row(const float* x, size_t n, size_t B, int16_t* p) {
    const float amax = tl_abs_max(x, n);
    if (amax < TL_TINY_ROW) {
        for (size_t i = 0; i < n; i++) p[i] = 0;
        return 0.0f;
    }
    const float u = 255.0f / amax, v = TL_BLOCK_QMAX / amax;
    for (size_t b0 = 0; b0 < n; b0 += B) {
        const int m = tl_block_multiplier(tl_abs_max(x + b0, B), u);
        const float r = v / (float)m;
        for (size_t i = b0; i < b0 + B; i++) p[i] = (int16_t)(m * tl_quantize_one(x[i], r, 127.0f));
    }
    return amax / TL_BLOCK_QMAX;
}

float tl_block_rms_quantize_row(const float* x, size_t n, size_t B, float eps, int16_t* p) {
    const float s = tl_block_quantize_row(x, n, B, p);
    int64_t ss = 0;
    for (size_t i = 0; i < n; i++) ss += (int32_t)p[i] * p[i];
    return tl_nq_scale(ss, s, n, eps);
}

void tl_split_digits(const int16_t* p, size_t n, int8_t* high, int8_t* low) {
    for (size_t i = 0; i < n; i++) {
        const int h = tl_digit_high(p[i]);
        high[i] = (int8_t)h;
        low[i] = (int8_t)(p[i] - 255 * h);
    }
}

void tl_rms_norm_row(const float* x, const float* gain, size_t n, float eps, float* y) {
    const float fq = 32767.0f; /* Q16; a tiny row has q = 0, s = 0 */
    float r;
    const float s = tl_quantize_begin(x, n, fq, &r);
    int64_t ss = 0;
    for (size_t i = 0; s != 0.0f && i < n; i++) {
        const int64_t q = tl_quantize_one(x[i], r, fq);
        ss += q * q;
    }
    const float t = tl_rms_of(ss, s, n, eps);
    if (!gain) {
        for (size_t i = 0; i < n; i++) y[i] = x[i] / t;
        return;
    }
    for (size_t i = 0; i < n; i++) y[i] = (x[i] / t) * gain[i];
}

void tl_swiglu_row(float* gate, const float* up, size_t n) {
    for (size_t i = 0; i < n; i++) gate[i] = tl_silu(gate[i]) * up[i];
}

void tl_gate_row(float* o, const float* z, size_t n) {
    for (size_t i = 0; i < n; i++) o[i] = o[i] * tl_sigmoid(z[i]);
}

void tl_loop_mix_row(const float* q, const int8_t* gw, const float* gs, const float* gb, size_t H, size_t D,
                     float* og, const float* ol, int8_t* qq) {
    for (size_t h = 0; h < H; h++) {
        const float sq = tl_quantize_row(q + h * D, D, 127, qq);
        int64_t dot = 0;
        for (size_t d = 0; d < D; d++) dot += (int64_t)qq[d] * gw[h * D + d];
        const float g = tl_loop_gate(dot, sq, gs[h], gb[h]), rest = 1.0f - g;
        for (size_t d = 0; d < D; d++) og[h * D + d] = tl_loop_mix(g, rest, og[h * D + d], ol[h * D + d]);
    }
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

const tl_row_kernels tl_rows_scalar = {.quantize = tl_quantize_row,
                                       .rms_quantize = tl_rms_quantize_row,
                                       .swiglu = tl_swiglu_row,
                                       .gate = tl_gate_row};
