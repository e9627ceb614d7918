/* quant.c — Q8/Q4 row quantization, NQ, RoPE and RN (docs/spec.md §2.2, §2.3, §2.6, §2.7),
 * scalar and exact. These rows are O(d) per token; the matmuls dominate, so clarity wins here. */
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
