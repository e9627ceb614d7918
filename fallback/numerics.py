"""Element-wise primitives of the numerics contract (docs/spec.md §2), in numpy.

Every function here is the executable form of one spec operation. All floating-point values
are float32 and every operation is a single numpy ufunc call on float32 operands, in the order
the spec writes it; integers that feed a float are converted exactly once. Constants are
float32 (a float64 scalar would silently promote a whole expression).
"""
import numpy as np

F32 = np.float32

EXP2_COEFFS = tuple(np.array([0x3F800000, 0x3F317215, 0x3E75FED5, 0x3D634186,
                              0x3C1E9E34, 0x3AA2B764, 0x39648C8E],
                             dtype=np.uint32).view(np.float32))  # C0 .. C6
LOG2E = np.array(0x3FB8AA3B, dtype=np.uint32).view(np.float32)[()]
LOG2_COEFFS = tuple(np.array([0x4038AA3B, 0x3F76384F, 0x3F13BB63, 0x3ED30BB1,
                              0x3EA4258A, 0x3E864D42, 0x3E6347AB],
                             dtype=np.uint32).view(np.float32))  # K0 .. K6 (spec §2.8)
LN2 = np.array(0x3F317218, dtype=np.uint32).view(np.float32)[()]
Q_TINY = F32(2.0 ** -64)     # rows whose max |x| is below this quantize to zero
TWO_24 = F32(2.0 ** 24)
BLOCK_QMAX = 127 * 255       # QB's row scale unit: s = amax / 32385 (§2.2.1)


def clamp(x, lo, hi):
    """spec §2.1: NaN maps to lo, so no NaN reaches an integer conversion."""
    x = np.where(x >= lo, x, F32(lo))
    return np.where(x <= hi, x, F32(hi))


def nan_ignoring_max(x, axis=-1, where=True):
    """max over axis ignoring NaN, starting from -inf (spec's NaN-ignoring max)."""
    return np.fmax.reduce(x, axis=axis, initial=F32(-np.inf), where=where)


def quantize_rows(x, qmax=127):
    """spec §2.2 Q(x, qmax). x: (..., n) float32 -> q: (..., n) int8 (int16 when qmax > 127,
    int32 when qmax > 32767), s: (...) float32."""
    x = np.asarray(x, dtype=F32)
    qmax = F32(qmax)
    amax = np.fmax.reduce(np.abs(x), axis=-1, initial=F32(0))
    live = amax >= Q_TINY
    safe_amax = np.where(live, amax, F32(1))
    r = qmax / safe_amax
    with np.errstate(invalid="ignore"):        # inf * 0 in a non-finite row: clamp maps it
        q = np.rint(clamp(x * r[..., None], -qmax, qmax)).astype(
            np.int8 if qmax <= 127 else np.int16 if qmax <= 32767 else np.int32)
    q[~live] = 0
    s = np.where(live, amax / qmax, F32(0))
    return q, s


def quantize_blocks(x, block):
    """spec §2.2.1 QB(x, B). x: (..., n) float32, B divides n -> p: (..., n) int16 (p = m_b * q,
    q in [-127, 127], m_b in 1 .. 255 per block of B), s: (...) float32."""
    x = np.asarray(x, dtype=F32)
    amax = np.fmax.reduce(np.abs(x), axis=-1, initial=F32(0))
    live = amax >= Q_TINY
    safe_amax = np.where(live, amax, F32(1))
    u, v = F32(255) / safe_amax, F32(BLOCK_QMAX) / safe_amax
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)        # (..., n/B, B)
    block_amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=F32(0))  # (..., n/B)
    with np.errstate(invalid="ignore"):        # inf * 0 in a non-finite row: clamp maps it
        m = np.ceil(clamp(block_amax * u[..., None], 1, 255))
        r = v[..., None] / m
        q = np.rint(clamp(blocks * r[..., None], -127, 127))
    p = (q.astype(np.int16) * m.astype(np.int16)[..., None]).reshape(x.shape)
    p[~live] = 0
    return p, np.where(live, amax / F32(BLOCK_QMAX), F32(0))


def quantize_input(x, block=0):
    """A linear's input rows (§4): Q8 (block 0) or QB(x, block) -> (q int8 or p int16, s)."""
    return quantize_blocks(x, block) if block else quantize_rows(x)


def root_mean_square(q, s, eps):
    """spec §2.3 step 3 (shared by §2.7): t from the row's integers q (..., n) and scale s."""
    q64 = q.astype(np.int64)
    ss = np.einsum("...i,...i->...", q64, q64)                  # exact
    t = ss.astype(F32)
    t = t * s
    t = t * s
    t = t / F32(q.shape[-1])
    t = t + F32(eps)
    return np.sqrt(t)


def rms_quantize(x, eps):
    """spec §2.3 NQ(x). x: (..., n) float32 -> q: (..., n) int8, a: (...) float32."""
    q, s = quantize_rows(x)
    return q, s / root_mean_square(q, s, eps)


def rms_quantize_input(x, eps, block=0):
    """A linear's normed input rows (§4): NQ (block 0) or NQB(x, eps, block) (§2.2.1)."""
    if not block:
        return rms_quantize(x, eps)
    p, s = quantize_blocks(x, block)
    return p, s / root_mean_square(p, s, eps)


def rms_norm(x, gain, eps):
    """spec §2.7 RN(x, g). x: (..., n) float32, gain: (n,) float32 -> (..., n) float32."""
    x = np.asarray(x, dtype=F32)
    t = root_mean_square(*quantize_rows(x, 32767), eps)
    with np.errstate(invalid="ignore", divide="ignore"):    # non-finite rows stay defined
        return (x / t[..., None]) * np.asarray(gain, F32)


def exp2s(x):
    """spec §2.4: the contract's own 2**x for float32 x."""
    x = clamp(np.asarray(x, dtype=F32), -126, 126)
    n = np.floor(x)
    f = x - n
    c = EXP2_COEFFS
    p = c[6]
    for coeff in c[5::-1]:
        p = p * f + coeff
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(F32)
    return p * scale


def exps(x):
    """spec §2.4: e**x as exp2s(x * LOG2E)."""
    return exp2s(np.asarray(x, dtype=F32) * LOG2E)


def i64_to_f32(n):
    """(f32) n of an exact integer n (|n| < 2^63), rounded once as C's (float)(int64_t) is."""
    return np.array(n, np.int64).astype(F32)[()]


def log2s(n):
    """spec §2.8: log2 of an integer 1 <= n < 2^63, as f32."""
    e = int(n).bit_length() - 1
    f = i64_to_f32(n) * F32(2.0 ** -e)
    s = (f - F32(1)) / (f + F32(1))
    w = s * s
    c = LOG2_COEFFS
    p = c[6]
    for coeff in c[5::-1]:
        p = p * w + coeff
    return F32(e) + p * s


def silu(v):
    """spec §2.5: v / (1 + exps(-v))."""
    e = exps(-v)
    return v / (F32(1) + e)


def sigmoid(v):
    """spec §2.5: sig(v) = 1 / (1 + exps(-v))."""
    return F32(1) / (F32(1) + exps(-v))


def rope(x, cos, sin):
    """spec §2.6 rotate-half RoPE. x: (T, heads, D); cos, sin: (T, D/2) for the tokens' positions."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def int_to_f32(acc):
    """Convert exact integers (held as int64 or as integral float64) to float32, once."""
    return acc.astype(F32)
