"""The spec's scalar numerics (docs/spec.md §2–§4) once, for every numba target.

`build(jit, ops)` compiles these functions for one target: numba CPU (`njit`) or numba CUDA
(`cuda.jit(device=True)`, also under the simulator). `ops` supplies the float operations whose
lowering differs between targets:

    mul, add, sub        one correctly rounded float32 operation each, never fused: plain
                         `* + -` on the CPU (LLVM contracts only under fastmath, which is off);
                         libdevice's fmul_rn / fadd_rn / fsub_rn on CUDA (NVVM would otherwise
                         contract a*b+c into fma.rn.f32 even without fastmath)
    rint                 round half to even, float32 -> float32
    floor, ceil, sqrt    float32 -> float32 (sqrt correctly rounded)
    f32_from_bits        int32 bit pattern -> float32

Every value is float32 and every constant a float32 scalar: a float64 literal would promote a
whole expression. Division is written `/`, correctly rounded on both targets (CUDA's
`div.rn.f32` while fastmath is off). Integers are converted to float32 once.
"""
from types import SimpleNamespace

import numpy as np

from .numerics import BLOCK_QMAX, EXP2_COEFFS, LOG2E, Q_TINY, TWO_24

F32 = np.float32
C0, C1, C2, C3, C4, C5, C6 = EXP2_COEFFS
EXP2_LO, EXP2_HI = F32(-126), F32(126)
ONE = F32(1)
QMAX8 = F32(127)
QMAX16 = F32(32767)
QMAXB = F32(BLOCK_QMAX)   # QB's row scale unit (spec §2.2.1)
M_MAX = F32(255)          # QB's largest block multiplier


def build(jit, ops):
    """The scalar kernels for one target; returns a namespace of compiled functions."""
    mul, add, sub, rint, floor, ceil, sqrt, f32_from_bits = (
        ops.mul, ops.add, ops.sub, ops.rint, ops.floor, ops.ceil, ops.sqrt, ops.f32_from_bits)

    @jit
    def clamp(x, lo, hi):
        """spec §2.1: NaN becomes lo."""
        x = x if x >= lo else lo
        return x if x <= hi else hi

    @jit
    def exp2s(x):
        """spec §2.4: 2**x from a Horner polynomial and an exact power-of-two scale."""
        x = clamp(x, EXP2_LO, EXP2_HI)
        n = floor(x)
        f = sub(x, n)
        p = add(mul(C6, f), C5)
        p = add(mul(p, f), C4)
        p = add(mul(p, f), C3)
        p = add(mul(p, f), C2)
        p = add(mul(p, f), C1)
        p = add(mul(p, f), C0)
        return mul(p, f32_from_bits(np.int32((np.int32(n) + 127) << 23)))

    @jit
    def silu_times(g, u):
        """spec §2.5: silu(g) * u with silu(v) = v / (1 + exps(-v))."""
        e = exp2s(mul(-g, LOG2E))
        return mul(g / add(ONE, e), u)

    @jit
    def sigmoid_times(g, o):
        """spec §4's gated output o * sig(g), sig(v) = 1 / (1 + exps(-v)) (§2.5)."""
        e = exp2s(mul(-g, LOG2E))
        return mul(o, ONE / add(ONE, e))

    @jit
    def abs_max(x):
        """spec §2.2 step 1: max_i |x_i| of a row x (n,) float32, ignoring NaN, from 0."""
        amax = F32(0)
        for i in range(x.shape[0]):
            v = abs(x[i])
            if v > amax:                 # NaN never wins
                amax = v
        return amax

    @jit
    def quantized(v, r, qmax):
        """spec §2.2 step 4: rint(clamp(v * r, -qmax, qmax)), an integral float32."""
        return rint(clamp(mul(v, r), -qmax, qmax))

    @jit
    def live_abs_max(x, q):
        """spec §2.2 steps 1-2 for a row x (n,) float32 quantized into q (n,): max_i |x_i|,
        or 0 with q zeroed when that is below Q_TINY (the row quantizes to zero)."""
        amax = abs_max(x)
        if amax >= Q_TINY:
            return amax
        for i in range(q.shape[0]):
            q[i] = 0
        return F32(0)

    @jit
    def quantize_row(x, q, qmax):
        """spec §2.2 Q(x, qmax) of one row x (n,) float32 into q (n,) int8; returns the scale."""
        amax = live_abs_max(x, q)
        if amax == 0:
            return amax
        r = qmax / amax
        for i in range(x.shape[0]):
            q[i] = np.int8(quantized(x[i], r, qmax))
        return amax / qmax

    @jit
    def quantize_block_row(x, p, block):
        """spec §2.2.1 QB(x, block) of one row x (n,) float32 into p (n,) int16 (block divides
        n), p_i = m_b q_i with q_i in [-127, 127] and m_b in 1 .. 255 per block; returns the
        row scale s."""
        amax = live_abs_max(x, p)
        if amax == 0:
            return amax
        u, v = M_MAX / amax, QMAXB / amax
        for b0 in range(0, x.shape[0], block):
            m = ceil(clamp(mul(abs_max(x[b0:b0 + block]), u), ONE, M_MAX))
            r = v / m
            for i in range(b0, b0 + block):
                p[i] = np.int16(mul(quantized(x[i], r, QMAX8), m))     # exact: <= 32385
        return amax / QMAXB

    @jit
    def quantize_input_row(x, q, block):
        """A linear's input row (spec §4): Q8 of x (n,) float32 into q (n,) int8 (block 0), or
        QB(x, block) into q (n,) int16; returns the scale."""
        return quantize_block_row(x, q, block) if block else quantize_row(x, q, QMAX8)

    @jit
    def store_kv_row(q, dst):
        """A quantized K or V row q (D,) int8 into its KV cache row dst: (D,) int8 as it is,
        or (D/2,) uint8 in the int4 mode, element 2i in the low nibble of byte i."""
        if dst.shape[0] == q.shape[0]:
            for i in range(q.shape[0]):
                dst[i] = q[i]
        else:
            for i in range(dst.shape[0]):
                dst[i] = (np.int32(q[2 * i]) & 15) | ((np.int32(q[2 * i + 1]) & 15) << 4)

    @jit
    def kv_value(row, d, packed):
        """Element d of a KV cache row as int32: row[d] (int8), or, packed (int4 mode),
        the two's complement nibble d of the row's bytes."""
        if not packed:
            return np.int32(row[d])
        nibble = (np.int32(row[d >> 1]) >> ((d & 1) * 4)) & 15
        return nibble - 16 if nibble >= 8 else nibble

    @jit
    def rms(ss, s, n, eps):
        """spec §2.3 / §2.7 step 3: t from the exact ss = Σ q_i², the scale s and length n."""
        t = mul(F32(ss), s)
        t = mul(t, s)
        t = t / F32(n)
        return sqrt(add(t, eps))

    @jit
    def rms_scale(q, s, eps):
        """spec §2.3 (and §2.2.1's NQB): the input scale a of a row already quantized to
        (q (n,), s): Q8's int8 q, or QB's int16 p."""
        ss = np.int64(0)
        for i in range(q.shape[0]):
            v = np.int64(q[i])
            ss += v * v
        return s / rms(ss, s, q.shape[0], eps)

    @jit
    def rms_norm_row(x, g, eps, y):
        """spec §2.7 RN(x, g) of one row x (n,) float32 with gain g (n,) into y (n,): the
        Q16 values are summed as they are formed (exactly, in int64), never stored."""
        amax = abs_max(x)
        ss, s = np.int64(0), F32(0)
        if amax >= Q_TINY:
            r = QMAX16 / amax
            for i in range(x.shape[0]):
                v = np.int64(quantized(x[i], r, QMAX16))
                ss += v * v
            s = amax / QMAX16
        t = rms(ss, s, x.shape[0], eps)
        for i in range(x.shape[0]):
            y[i] = mul(x[i] / t, g[i])

    @jit
    def linear_out(acc, a, scale, bias, j):
        """spec §3, output j: ((f32) acc * a) * ws_j, then + b_j when the linear has a bias
        (scale (R,) float32; bias (R,) float32, or empty for a linear without one)."""
        y = mul(mul(F32(acc), a), scale[j])
        return add(y, bias[j]) if bias.shape[0] else y

    @jit
    def rope_pair(x1, x2, c, s):
        """spec §2.6: (x1 * c - x2 * s, x2 * c + x1 * s)."""
        return sub(mul(x1, c), mul(x2, s)), add(mul(x2, c), mul(x1, s))

    @jit
    def attention_score(dot, c, sk):
        """spec §4.1: S = ((f32) dot * c) * sk."""
        return mul(mul(F32(dot), c), sk)

    @jit
    def attention_weights(score, m, sv, kappa):
        """spec §4.1: (E_j, U_j) as integral float32 values, from S_j, M, sv_j and κ."""
        e = exp2s(mul(sub(score, m), LOG2E))
        return rint(mul(e, TWO_24)), rint(mul(e, mul(sv, kappa)))

    @jit
    def attention_out(num, den, svmax):
        """spec §4.1: o_d = ((f32) num_d / (f32) den) * svmax (num, den exact integers)."""
        return mul(F32(num) / F32(den), svmax)

    @jit
    def loop_gate(dot, sq, gs, gb, h):
        """spec §4, loop attention: (g, 1 - g) of head h, g = sig(((f32) dot * sq) * gs_h +
        gb_h) (the gate logit is linear_out's formula)."""
        g = sigmoid_times(linear_out(dot, sq, gs, gb, h), ONE)
        return g, sub(ONE, g)

    @jit
    def loop_mix_head(q, q8, gw, gs, gb, h, glob, local, out):
        """spec §4, loop attention's gated mix of query head h: q (D,) float32 its query, q8
        (D,) int8 scratch for Q8(q); glob, local, out (H * D,) float32 rows, out's head h
        written (g * og) + ((1 - g) * ol); gw (H, D) int8, gs, gb (H,) float32."""
        head_dim = q.shape[0]
        sq = quantize_row(q, q8, QMAX8)
        dot = 0
        for d in range(head_dim):
            dot += np.int32(q8[d]) * np.int32(gw[h, d])           # |dot| <= 127^2 * 1024
        g, rest = loop_gate(dot, sq, gs, gb, h)
        for i in range(h * head_dim, (h + 1) * head_dim):
            out[i] = add(mul(g, glob[i]), mul(rest, local[i]))

    return SimpleNamespace(clamp=clamp, exp2s=exp2s, silu_times=silu_times,
                           sigmoid_times=sigmoid_times, loop_mix_head=loop_mix_head,
                           quantize_row=quantize_row, quantize_input_row=quantize_input_row,
                           store_kv_row=store_kv_row,
                           kv_value=kv_value, rms_scale=rms_scale,
                           rms_norm_row=rms_norm_row, linear_out=linear_out,
                           rope_pair=rope_pair, attention_score=attention_score,
                           attention_weights=attention_weights, attention_out=attention_out)
