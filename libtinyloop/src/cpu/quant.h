/* quant.h — row operations of docs/spec.md §2.2, §2.2.1, §2.3, §2.6 and §2.7: Q8/Q4 row
 * quantization, the fused RMSNorm-quantize NQ, their block forms QB and NQB (act_block) and the
 * digits a linear runs a block input on (§3), rotate-half RoPE and the RMSNorm with a gain RN.
 * Shapes are per row. */
#ifndef TL_QUANT_H
#define TL_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "cpu/row_kernels.h"

/* §2.2 Q(x, qmax): x[n] -> q[n] in [-qmax, qmax]; returns the scale s (0 for tiny rows). */
float tl_quantize_row(const float* x, size_t n, int qmax, int8_t* q);
/* §2.3 NQ(x): x[n] -> q[n]; returns the matmul input scale a. */
float tl_rms_quantize_row(const float* x, size_t n, float eps, int8_t* q);
/* §2.2.1 QB(x, B): x[n] -> p[n] (|p| <= 32385, p = m_b * q), B dividing n; returns the scale s
 * (0 for tiny rows). */
float tl_block_quantize_row(const float* x, size_t n, size_t B, int16_t* p);
/* §2.2.1 NQB(x, B): x[n] -> p[n]; returns the matmul input scale a. */
float tl_block_rms_quantize_row(const float* x, size_t n, size_t B, float eps, int16_t* p);
/* §3's digits of block inputs p[n]: p = 255 * high + low, high = floor((p + 127) / 255), both
 * in [-127, 127], so each runs on the int8-input kernels. */
void tl_split_digits(const int16_t* p, size_t n, int8_t* high, int8_t* low);
/* §2.7 RN(x, g): y[i] = (x[i] / t) * gain[i], t the root mean square of x through Q16 and an
 * exact i64 sum of squares; gain NULL: the weightless RN(x), y[i] = x[i] / t. y may be x. */
void tl_rms_norm_row(const float* x, const float* gain, size_t n, float eps, float* y);
/* §2.5 SwiGLU in place: gate[i] = silu(gate[i]) * up[i]. */
void tl_swiglu_row(float* gate, const float* up, size_t n);
/* §4 the attention output gate in place: o[i] = o[i] * sig(z[i]). */
void tl_gate_row(float* o, const float* z, size_t n);
/* §4 loop attention's mix of one row of H heads of D: per head h, (qq, sq) = Q8(q[h]) (qq[D]
 * scratch), g = tl_loop_gate(qq . gw[h], sq, gs[h], gb[h]), then og[h][d] = (g * og[h][d]) +
 * ((1 - g) * ol[h][d]) in place. */
void tl_loop_mix_row(const float* q, const int8_t* gw, const float* gs, const float* gb, size_t H, size_t D,
                     float* og, const float* ol, int8_t* qq);

/* §2.6 RoPE in place on one head x[D] with the position's table rows cos[D/2], sin[D/2]. */
void tl_rope_head(float* x, size_t D, const float* cos, const float* sin);

#endif
