"""The numba CPU kernel set: JIT-compiled kernels for the forward pass's hot operations.

Plugs into the shared engine (fallback/engine.py) as `NumbaKernels(threads)`; everything not
here (paged KV cache, prefixes, chunking, windows, stop rules, the generation loop) is the
numpy backend's own code. `sample` is also used by the numba-cuda backend. Results are bit-identical to the numpy reference (tests/test_numba*.py):

- integer matmuls accumulate exactly in int32 (docs/spec.md §3 proves the bound per tensor);
  int4 weights are unpacked with their group multiplier folded in as int16
  (weights.integer_weights), so int8 and int4 share one kernel;
- every float operation is one float32 operation in the spec's order (numba_scalar.py); no
  kernel uses fastmath, and LLVM does not contract a*b+c into an FMA without it (checked on
  the compiled assembly by tests/test_numba_cpu.py);
- attention keeps each query's score row, so the exact max is known before the exponentials,
  and reads the KV cache in place (numba_arena.py), never gathering it.

Kernels are compiled on first use and cached on disk (`cache=True`, NUMBA_CACHE_DIR to move
the cache). numba's cache is keyed by each function's own source file: after editing
numba_scalar.py, touch this file (or clear the cache) so cached kernels are rebuilt.
Every kernel is compiled parallel; before each call the kernel set sets numba's thread count
(numba keeps it per calling thread): `threads` for work of PARALLEL_WORK or more, else one.
A parallel region costs a wake-up of every worker, more than a decode step's small kernels
take, and far more when another process holds a core.
"""
from types import SimpleNamespace

import numba
import numpy as np
from numba import njit, prange

from . import numba_scalar
from .attention import key_range
from .forward import NumpyKernels
from .numba_arena import ArenaBlockPool
from .numerics import LOG2E
from .sampling import NumericError, apply_repetition_penalty, rng
from .weights import integer_weights

F32 = np.float32
I32 = np.int32
NEG_INF = F32(-np.inf)
ROW_BLOCK = 4          # linear weights are padded to a multiple of this many rows
PARALLEL_WORK = 1 << 21  # multiply-adds (or so) below which a kernel runs on one thread
TWO_20 = F32(1 << 20)      # the sampler's fixed-point unit (spec §5.1)
scalar = njit(cache=True, inline="always")   # scalar helpers: inlined where they are called


@scalar
def _mul(a, b):
    return a * b


@scalar
def _add(a, b):
    return a + b


@scalar
def _sub(a, b):
    return a - b


@scalar
def _rint(x):
    return np.rint(x)


@scalar
def _floor(x):
    return np.floor(x)


@scalar
def _sqrt(x):
    return np.sqrt(x)


@scalar
def _f32_from_bits(i):
    return np.int32(i).view(np.float32)


S = numba_scalar.build(scalar, SimpleNamespace(
    mul=_mul, add=_add, sub=_sub, rint=_rint, floor=_floor, sqrt=_sqrt,
    f32_from_bits=_f32_from_bits))
quantize_row, rms_scale, linear_out = S.quantize_row, S.rms_scale, S.linear_out
rope_pair, silu_times, exp2s = S.rope_pair, S.silu_times, S.exp2s
attention_score, attention_weights, attention_out = (
    S.attention_score, S.attention_weights, S.attention_out)


# -- row quantization ---------------------------------------------------------------------

@njit(parallel=True, cache=True)
def quantize_rows_kernel(x, q, s):
    """Q8 of every row. x: (N, n) float32 -> q: (N, n) int8, s: (N,) float32."""
    for i in prange(x.shape[0]):
        s[i] = quantize_row(x[i], q[i], numba_scalar.QMAX8)


@njit(parallel=True, cache=True)
def rms_quantize_kernel(x, eps, q, a):
    """NQ of every row. x: (N, n) float32 -> q: (N, n) int8, a: (N,) float32."""
    for i in prange(x.shape[0]):
        a[i] = rms_scale(q[i], quantize_row(x[i], q[i], numba_scalar.QMAX8), eps)


# -- linear -------------------------------------------------------------------------------

@njit(cache=True)
def _dots_2x2(q0, q1, w0, w1):
    """Four exact int32 dot products of two int8 activation rows with two weight rows
    (int8, or int16 for int4)."""
    a, b, c, d = I32(0), I32(0), I32(0), I32(0)
    for k in range(q0.shape[0]):
        x0 = I32(q0[k])
        x1 = I32(q1[k])
        y0 = I32(w0[k])
        y1 = I32(w1[k])
        a = I32(a + x0 * y0)
        b = I32(b + x0 * y1)
        c = I32(c + x1 * y0)
        d = I32(d + x1 * y1)
    return a, b, c, d


@njit(cache=True)
def _dots_1x4(q0, w0, w1, w2, w3):
    """Four exact int32 dot products of one int8 activation row with four weight rows."""
    a, b, c, d = I32(0), I32(0), I32(0), I32(0)
    for k in range(q0.shape[0]):
        x = I32(q0[k])
        a = I32(a + x * I32(w0[k]))
        b = I32(b + x * I32(w1[k]))
        c = I32(c + x * I32(w2[k]))
        d = I32(d + x * I32(w3[k]))
    return a, b, c, d


@njit(parallel=True, cache=True)
def linear_kernel(q, a, w, scale, y):
    """spec §3 for T tokens: y = ((f32) acc * a) * ws with acc = Σ_k q_k w_k exact in int32.

    q: (T, K) int8; a: (T,) float32; w: (R', K) int8, or int16 (int4 with its multipliers
    folded in), R' >= R a multiple of ROW_BLOCK; scale: (R',) float32 -> y: (T, R) float32.
    Each thread takes ROW_BLOCK weight rows and runs every token over them: two tokens at a
    time against two rows, then a last odd token against all four. (Written out here on
    purpose: moved behind a function call, the token loop ran at half the speed.)
    """
    n_tok, n_out = q.shape[0], y.shape[1]
    for rb in prange(w.shape[0] // ROW_BLOCK):
        for r in range(rb * ROW_BLOCK, (rb + 1) * ROW_BLOCK, 2):
            for t in range(0, n_tok - 1, 2):
                acc0, acc1, acc2, acc3 = _dots_2x2(q[t], q[t + 1], w[r], w[r + 1])
                if r < n_out:
                    y[t, r] = linear_out(acc0, a[t], scale[r])
                    y[t + 1, r] = linear_out(acc2, a[t + 1], scale[r])
                if r + 1 < n_out:
                    y[t, r + 1] = linear_out(acc1, a[t], scale[r + 1])
                    y[t + 1, r + 1] = linear_out(acc3, a[t + 1], scale[r + 1])
        if n_tok % 2:
            t, r = n_tok - 1, rb * ROW_BLOCK
            accs = _dots_1x4(q[t], w[r], w[r + 1], w[r + 2], w[r + 3])
            for i in range(ROW_BLOCK):
                if r + i < n_out:
                    y[t, r + i] = linear_out(accs[i], a[t], scale[r + i])


class NumbaLinear:
    """A linear layer's exact integer weights (weights.integer_weights), rows padded with
    zeros to a multiple of ROW_BLOCK."""

    def __init__(self, kernels, w, scale, multipliers=None, group_size=0):
        self.kernels = kernels
        self.n_out = len(scale)
        pad = -self.n_out % ROW_BLOCK
        values = integer_weights(w, multipliers, group_size)
        self.w = np.ascontiguousarray(np.pad(values, ((0, pad), (0, 0))))    # (R', K)
        self.scale = np.pad(np.asarray(scale, F32), (0, pad))                 # (R',)

    def __call__(self, q, a):
        """q: (T, K) int8, a: (T,) float32 -> (T, R) float32."""
        y = np.empty((len(q), self.n_out), F32)
        self.kernels.use_threads(self.w.size * len(q))
        linear_kernel(np.ascontiguousarray(q), a, self.w, self.scale, y)
        return y


# -- attention, heads, MLP -------------------------------------------------------------------

@scalar
def _dot(qq, k):
    """Exact int32 dot product of two int8 rows."""
    acc = I32(0)
    for d in range(qq.shape[0]):
        acc = I32(acc + I32(qq[d]) * I32(k[d]))
    return acc


@njit(parallel=True, cache=True)
def attend_kernel(qh, kq, sk, vq, sv, table, shift, block_size, pos0, lo, window, out):
    """spec §4.1 for T queries at pos0.. over the keys of one cache layer, read in place.

    qh: (T, H, D) float32; kq, vq: (rows, block_size, G, D) int8 and sk, sv: (rows,
    block_size, G) float32, the pool's arena; position j is in arena row
    table[(j - shift) // block_size] at (j - shift) % block_size -> out: (T, H * D) float32.
    Per (query, head): scores (and the values' scales) of the visible keys, their max, then
    E and U in one element-wise pass, then the exact sums Σ E (int64) and Σ U vq (float64
    holding integers below 2**53, as the reference does).
    """
    n_tok, n_heads, head_dim = qh.shape
    group = n_heads // kq.shape[2]
    root = np.sqrt(F32(head_dim))
    for th in prange(n_tok * n_heads):
        t, h = th // n_heads, th % n_heads
        g = h // group
        pos = pos0 + t
        first = max(lo, pos - window + 1) if window else lo
        n_keys = pos + 1 - first
        qq = np.empty(head_dim, np.int8)
        c = quantize_row(qh[t, h], qq, numba_scalar.QMAX8) / root
        scores, svs = np.empty(n_keys, F32), np.empty(n_keys, F32)
        rows, offsets = np.empty(n_keys, np.int32), np.empty(n_keys, np.int32)
        m = NEG_INF
        svmax = NEG_INF
        for i in range(n_keys):
            b, o = table[(first + i - shift) // block_size], (first + i - shift) % block_size
            rows[i], offsets[i] = b, o
            scores[i] = attention_score(_dot(qq, kq[b, o, g]), c, sk[b, o, g])
            svs[i] = sv[b, o, g]
            m = scores[i] if scores[i] > m else m
            svmax = svs[i] if svs[i] > svmax else svmax
        row = out[t, h * head_dim:(h + 1) * head_dim]
        row[:] = 0
        if svmax > 0:                    # else every visible value row is zero
            kappa = numba_scalar.TWO_24 / svmax
            e_int, u = np.empty(n_keys, F32), np.empty(n_keys, F32)
            for i in range(n_keys):
                e_int[i], u[i] = attention_weights(scores[i], m, svs[i], kappa)
            den = np.int64(0)
            for i in range(n_keys):
                den += np.int64(e_int[i])
            num = np.zeros(head_dim, np.float64)
            for i in range(n_keys):
                u64, v = np.float64(u[i]), vq[rows[i], offsets[i], g]
                for d in range(head_dim):
                    num[d] += u64 * np.float64(v[d])
            for d in range(head_dim):
                row[d] = attention_out(num[d], den, svmax)


@njit(parallel=True, cache=True)
def split_heads_kernel(z, cos, sin, n_heads, n_kv, qh, kq, sk, vq, sv):
    """RoPE of the Q and K heads, Q8 of K and V per kv head (forward.split_heads).

    z: (T, (H + 2G) * D); cos, sin: (T, D/2) -> qh (T, H, D); kq, vq (T, G, D); sk, sv (T, G).
    """
    head_dim = qh.shape[2]
    half = head_dim // 2
    for t in prange(z.shape[0]):
        kh = np.empty(head_dim, F32)
        for h in range(n_heads + n_kv):
            x = z[t, h * head_dim:(h + 1) * head_dim]
            dst = qh[t, h] if h < n_heads else kh
            for i in range(half):
                dst[i], dst[i + half] = rope_pair(x[i], x[i + half], cos[t, i], sin[t, i])
            if h >= n_heads:
                sk[t, h - n_heads] = quantize_row(kh, kq[t, h - n_heads], numba_scalar.QMAX8)
        for g in range(n_kv):
            col = (n_heads + n_kv + g) * head_dim
            sv[t, g] = quantize_row(z[t, col:col + head_dim], vq[t, g], numba_scalar.QMAX8)


@njit(parallel=True, cache=True)
def swiglu_kernel(gu, h):
    """gu: (T, 2F) float32 -> h: (T, F) float32, silu(gate) * up."""
    ffn = h.shape[1]
    for t in prange(gu.shape[0]):
        for i in range(ffn):
            h[t, i] = silu_times(gu[t, i], gu[t, ffn + i])


# -- sampling -------------------------------------------------------------------------------

@njit(cache=True)
def _positive_weights(y, m):
    """(ids, w) of the ids whose fixed-point weight w = rint(exp2s((y - m) * LOG2E) * 2**20)
    (spec §5.1 step 5) is positive. y: (V,) float32, m: the first candidate's y."""
    ids, w = np.empty(y.shape[0], np.int64), np.empty(y.shape[0], np.int64)
    n = 0
    for i in range(y.shape[0]):
        wi = np.int64(_rint(_mul(exp2s(_mul(_sub(y[i], m), LOG2E)), TWO_20)))
        if wi > 0:
            ids[n], w[n] = i, wi
            n += 1
    return ids[:n], w[:n]


def sample(logits, history, params, pos):
    """spec §5.1, giving sampling.sample's token without ordering the whole vocabulary.

    Along the spec's order (z descending, ties by id) the weights w never increase, so the
    ids with w > 0 are a prefix of it; the rest add nothing to any sum and are never drawn.
    Computing every w first and ordering only those ids changes no step: top-k keeps the
    same prefix, top-p stops inside it, the draw lands in it.
    """
    if not np.isfinite(logits).all():
        raise NumericError("non-finite logits")
    z = apply_repetition_penalty(logits, history, params.repetition_penalty)
    top = int(np.argmax(z))                         # the first id in the spec's order
    if params.temperature == 0:
        return top
    with np.errstate(over="ignore"):
        y = z / F32(params.temperature)
    if np.isinf(y[top]):                            # z / T overflowed: the top candidate wins
        return top
    ids, w = _positive_weights(y, y[top])            # ids ascending
    order = np.argsort(-z[ids], kind="stable")      # z descending, ties keep ids ascending
    ids, w = ids[order], w[order]
    if 0 < params.top_k < len(z):
        ids, w = ids[:params.top_k], w[:params.top_k]
    cum = np.cumsum(w)
    p = int(np.rint(F32(params.top_p) * TWO_20))
    n_keep = int(np.argmax(cum * (1 << 20) >= p * int(cum[-1]))) + 1
    r = rng(params.seed, pos) % int(cum[n_keep - 1])
    return int(ids[np.searchsorted(cum[:n_keep], r, side="right")])


class NumbaKernels(NumpyKernels):
    """The kernel set of backend "numba": numba kernels for the hot operations, the numpy
    reference's for the rest (embedding, residual additions); the KV cache's blocks live in
    an arena that attention reads in place."""
    name = "numba"
    new_pool = ArenaBlockPool
    sample = staticmethod(sample)

    def __init__(self, threads=None):
        """threads: Model(threads=...); None, or more than numba's pool has, means all."""
        self.threads = min(threads or numba.config.NUMBA_NUM_THREADS,
                           numba.config.NUMBA_NUM_THREADS)

    def use_threads(self, work):
        """Set the thread count for a kernel of about `work` multiply-adds."""
        threads = self.threads if work >= PARALLEL_WORK else 1
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)

    def linear(self, w, scale, multipliers=None, group_size=0):
        return NumbaLinear(self, w, scale, multipliers, group_size)

    def quantize_rows(self, x):
        q, s = np.empty(x.shape, np.int8), np.empty(x.shape[:-1], F32)
        self.use_threads(x.size)
        quantize_rows_kernel(x.reshape(-1, x.shape[-1]), q.reshape(-1, x.shape[-1]), s.reshape(-1))
        return q, s

    def rms_quantize(self, x, eps):
        q, a = np.empty(x.shape, np.int8), np.empty(len(x), F32)
        self.use_threads(x.size)
        rms_quantize_kernel(x, F32(eps), q, a)
        return q, a

    def split_heads(self, z, cos, sin, config):
        n_tok, H, G, D = len(z), config.n_heads, config.n_kv_heads, config.head_dim
        qh = np.empty((n_tok, H, D), F32)
        kq, vq = np.empty((n_tok, G, D), np.int8), np.empty((n_tok, G, D), np.int8)
        sk, sv = np.empty((n_tok, G), F32), np.empty((n_tok, G), F32)
        self.use_threads(z.size)
        split_heads_kernel(z, cos, sin, H, G, qh, kq, sk, vq, sv)
        return qh, (kq, sk, vq, sv)

    def attend(self, qh, cache, layer, pos0):
        lo, hi = key_range(pos0, len(qh), cache.window)
        table, shift = cache.pool.block_table(cache, layer, lo, hi)
        out = np.empty((len(qh), qh.shape[1] * qh.shape[2]), F32)
        arena = cache.pool.arena
        self.use_threads(qh.size * (hi - lo))
        attend_kernel(qh, arena["kq"], arena["sk"], arena["vq"], arena["sv"], table, shift,
                      cache.pool.block_size, pos0, lo, cache.window, out)
        return out

    def swiglu(self, gu):
        h = np.empty((len(gu), gu.shape[1] // 2), F32)
        self.use_threads(h.size * 16)                 # an exp2s is some 16 operations
        swiglu_kernel(gu, h)
        return h
