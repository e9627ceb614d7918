"""The numba CPU kernel set: JIT-compiled kernels for the forward pass's hot operations.

Plugs into the shared engine (fallback/engine.py) as `NumbaKernels(threads)`; everything not
here (paged KV cache, prefixes, chunking, windows, stop rules, the generation loop) is the
numpy backend's own code. `sample` is also used by the numba-cuda backend. Results are
bit-identical to the numpy reference (tests/test_numba*.py):

- integer sums are exact: the matmuls accumulate in int32 (docs/spec.md §3 proves the bound
  per tensor), int4 weights unpacked with their group multiplier folded in as int16
  (weights.integer_weights), so int8 and int4 share one kernel; block inputs (act_block,
  §2.2.1: int16, up to 32385) sum in int32 over a bounded run of columns at a time, then in
  int64 (numba_dot); attention's Σ U vq is split so that its int32 partial sums are bounded
  too (_add_weighted_rows). The vector loops are numba_dot's intrinsics;
- every float operation is one float32 operation in the spec's order (numba_scalar.py); no
  kernel uses fastmath, and LLVM does not contract a*b+c into an FMA without it (checked on
  the compiled assembly by tests/test_numba_cpu.py);
- attention keeps each query's score row, so the exact max is known before the exponentials,
  and reads the int8 KV cache in place (numba_arena.py), never gathering it; an int4 cache's
  visible blocks are unpacked to int8 values first (one pass over them), then read the same
  way.

Kernels are compiled on first use and cached on disk (`cache=True`, NUMBA_CACHE_DIR to move
the cache). numba's cache is keyed by each function's own source file (its contents in
recent numba, its time stamp in older releases): after editing numba_scalar.py or
numba_dot.py, clear the cache so cached kernels are rebuilt. Every kernel is compiled
parallel and run on `threads` threads for work of PARALLEL_WORK or more, else on one (numba
keeps the count per calling thread). A parallel region ends at a barrier: when another
process holds a core, a worker waits for a time slice, so regions shorter than a few
milliseconds (all of a decode step's) run on one thread.
"""
import threading
from types import SimpleNamespace

import numba
import numpy as np
from llvmlite import binding as llvm
from numba import njit, prange

from tinyloop.modelfile import unpack_int4

from . import numba_dot, numba_scalar
from .attention import key_range
from .forward import NumpyKernels
from .kvcache import kv_row_format
from .numba_arena import ARRAYS as ARENA_ARRAYS, ArenaBlockPool
from .numerics import LOG2E
from .sampling import NumericError, apply_repetition_penalty, rng
from .weights import integer_weights

F32 = np.float32
I32 = np.int32
NEG_INF = F32(-np.inf)
ROW_TILE = 4             # linear: weight rows per int_dots call
TOKEN_TILE = 2           # linear: tokens per int_dots call (then one at a time)
ROW_BLOCK = 16           # linear: weight rows per parallel work item, a multiple of ROW_TILE
PV_CHUNK = 4096          # attention: keys per int32 partial sum of U vq (_add_weighted_rows)
U_MAX = F32(2 ** 24 + 2)  # attention: the largest U_j when svmax is finite (e_j <= 1)
PARALLEL_WORK = 1 << 26  # multiply-adds (or so) below which a kernel runs on one thread
TWO_20 = F32(1 << 20)    # the sampler's fixed-point unit (spec §5.1)
scalar = njit(cache=True, inline="always")   # scalar helpers: inlined where they are called
_numba_threads = threading.local()           # .count: numba's thread count, as last set here


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
def _ceil(x):
    return np.ceil(x)


@scalar
def _sqrt(x):
    return np.sqrt(x)


@scalar
def _f32_from_bits(i):
    return np.int32(i).view(np.float32)


S = numba_scalar.build(scalar, SimpleNamespace(
    mul=_mul, add=_add, sub=_sub, rint=_rint, floor=_floor, ceil=_ceil, sqrt=_sqrt,
    f32_from_bits=_f32_from_bits))
quantize_row, quantize_input_row, store_kv_row, rms_scale, rms_norm_row, linear_out = (
    S.quantize_row, S.quantize_input_row, S.store_kv_row, S.rms_scale, S.rms_norm_row,
    S.linear_out)
rope_pair, silu_times, exp2s = S.rope_pair, S.silu_times, S.exp2s
sigmoid_times, loop_mix_head = S.sigmoid_times, S.loop_mix_head
attention_score, attention_weights, attention_out = (
    S.attention_score, S.attention_weights, S.attention_out)


# -- row quantization ---------------------------------------------------------------------

@njit(parallel=True, cache=True)
def quantize_rows_kernel(x, block, q, s):
    """Q8 (block 0) or QB(., block) of every row. x: (N, n) float32 -> q: (N, n) int8 (block
    0) or int16, s: (N,) float32."""
    for i in prange(x.shape[0]):
        s[i] = quantize_input_row(x[i], q[i], block)


@njit(parallel=True, cache=True)
def rms_quantize_kernel(x, eps, block, q, a):
    """NQ (block 0) or NQB(., block) of every row. x: (N, n) float32 -> q: (N, n) int8 (block
    0) or int16, a: (N,) float32."""
    for i in prange(x.shape[0]):
        a[i] = rms_scale(q[i], quantize_input_row(x[i], q[i], block), eps)


def input_type(block):
    """The integer type of a linear's quantized input rows: int8 (Q8, NQ), or int16 with block
    activations (QB, NQB: |p| <= 32385)."""
    return np.int16 if block else np.int8


@njit(parallel=True, cache=True)
def rms_norm_kernel(x, gain, eps, y):
    """RN of every row. x: (N, n) float32, gain: (n,) float32 -> y: (N, n) float32."""
    for i in prange(x.shape[0]):
        rms_norm_row(x[i], gain, eps, y[i])


# -- linear -------------------------------------------------------------------------------

@scalar
def _store_tile(accs, n_tok, n_rows, t, r, a, scale, bias, y):
    """y for tokens t .. t+n_tok-1 and rows r .. r+n_rows-1 (those below y's width) from
    int_dots' accumulators."""
    for i in range(n_tok):
        for j in range(n_rows):
            if r + j < y.shape[1]:
                y[t + i, r + j] = linear_out(accs[i * n_rows + j], a[t + i], scale, bias, r + j)


@njit(parallel=True, cache=True)
def linear_kernel(q, a, w, scale, bias, y):
    """spec §3 for T tokens: y = ((f32) acc * a) * ws (+ b) with acc exact: in int32 for an
    int8 input, in int64 for int16 block inputs (numba_dot.int_dots).

    q: (T, K) int8, or int16 block inputs; a: (T,) float32; w: NumbaLinear.w, R' >= R rows, a
    multiple of ROW_BLOCK; scale: (R',) float32; bias: (R,) float32, or empty -> y: (T, R)
    float32. Each thread takes ROW_BLOCK weight rows and runs every token over them:
    TOKEN_TILE tokens x ROW_TILE rows per int_dots call, the last tokens one row at a time
    (one row streams weights from memory faster than several).
    """
    q16 = q.astype(np.int16)
    n_tok = q.shape[0]
    tiled = n_tok - n_tok % TOKEN_TILE
    for rb in prange(scale.shape[0] // ROW_BLOCK):
        first = rb * ROW_BLOCK
        for t in range(0, tiled, TOKEN_TILE):
            for r in range(first, first + ROW_BLOCK, ROW_TILE):
                accs = numba_dot.int_dots(q16, t, w, r, TOKEN_TILE, ROW_TILE, q.dtype)
                _store_tile(accs, TOKEN_TILE, ROW_TILE, t, r, a, scale, bias, y)
        for t in range(tiled, n_tok):
            for r in range(first, first + ROW_BLOCK):
                _store_tile(numba_dot.int_dots(q16, t, w, r, 1, 1, q.dtype), 1, 1, t, r, a,
                            scale, bias, y)


def _pad_rows(array, n_rows):
    return np.ascontiguousarray(np.pad(array, ((0, n_rows - len(array)), (0, 0))))


class NumbaLinear:
    """A linear layer's weights as numba_dot.int_dots reads them, rows padded with zeros to a
    multiple of ROW_BLOCK: int8 as they are; int4 as (values int8, a multiplier per LANES
    columns int16) when the group size is a multiple of numba_dot.LANES (1.125 bytes a
    weight), else unpacked with the multipliers folded in (weights.integer_weights, int16).
    The bias, if any, as it is (an empty array when there is none)."""

    def __init__(self, kernels, w, scale, multipliers=None, group_size=0, bias=None):
        self.kernels = kernels
        self.n_out = len(scale)
        n_rows = self.n_out + -self.n_out % ROW_BLOCK
        if multipliers is not None and group_size % numba_dot.LANES == 0:
            per_lanes = np.repeat(np.asarray(multipliers, np.int16),
                                  group_size // numba_dot.LANES, axis=1)
            self.w = (_pad_rows(unpack_int4(w), n_rows), _pad_rows(per_lanes, n_rows))
        else:
            self.w = _pad_rows(integer_weights(w, multipliers, group_size), n_rows)
        self.scale = np.pad(np.asarray(scale, F32), (0, n_rows - self.n_out))
        self.bias = np.empty(0, F32) if bias is None else np.ascontiguousarray(bias, F32)

    @property
    def nbytes(self):
        parts = self.w if isinstance(self.w, tuple) else (self.w,)
        return sum(part.nbytes for part in parts) + self.scale.nbytes + self.bias.nbytes

    def __call__(self, q, a):
        """q: (T, K) int8, or int16 block inputs, a: (T,) float32 -> (T, R) float32."""
        y = np.empty((len(q), self.n_out), F32)
        self.kernels.launch(linear_kernel, self.kernels.threads_for(len(self.scale) * q.size),
                            np.ascontiguousarray(q), a, self.w, self.scale, self.bias, y)
        return y


# -- attention, heads, MLP -------------------------------------------------------------------

@njit(cache=True)
def _arena_slots(table, shift, block_size, lo, hi):
    """The arena slot (row * block_size + offset) of each position lo .. hi-1."""
    slots = np.empty(hi - lo, np.int64)
    for j in range(lo, hi):
        slots[j - lo] = (np.int64(table[(j - shift) // block_size]) * block_size
                         + (j - shift) % block_size)
    return slots


@scalar
def _interleaved(i, n):
    """The i-th of 0, n-1, 1, n-2, ...: with causal attention, consecutive items alternate
    short and long key runs, so numba's equal contiguous shares of items are equal work."""
    return i // 2 if i % 2 == 0 else n - 1 - i // 2


@scalar
def _nan_ignoring_max(x):
    m = NEG_INF
    for i in range(x.shape[0]):
        m = x[i] if x[i] > m else m
    return m


@scalar
def _quantized_queries(qh, h0, h1):
    """Q8 of query heads h0 .. h1-1 of qh (H, D) float32 (spec §4.1): qq (H, D) int16 and
    c = sq / sqrt(D) (H,), those heads' rows filled."""
    n_heads, head_dim = qh.shape
    qq, c = np.empty((n_heads, head_dim), np.int16), np.empty(n_heads, F32)
    q8 = np.empty(head_dim, np.int8)
    for h in range(h0, h1):
        c[h] = quantize_row(qh[h], q8, numba_scalar.QMAX8) / np.sqrt(F32(head_dim))
        qq[h] = q8
    return qq, c


@scalar
def _scores(qq, c, h0, keys, kscale, vscale, bases, group, scores, svs):
    """S_j (spec §4.1) of query heads h0, h0 + 1, ... into scores[h - h0, j] and the value
    scales sv_j of their kv heads into svs[h - h0, j], for the keys at row base_j + g of
    keys (n_slots * G, D) and of the scales (n_slots * G,). Position by position, so the
    keys are read in memory order."""
    for i in range(bases.shape[0]):
        for h in range(h0, h0 + scores.shape[0]):
            r = bases[i] + h // group
            dot = numba_dot.int_dots(qq, h, keys, r, 1, 1, np.int8)[0]
            scores[h - h0, i] = attention_score(dot, c[h], kscale[r])
            svs[h - h0, i] = vscale[r]


@scalar
def _add_weighted_rows(u, values, rows, num):
    """num[d] += Σ_j U_j vq_jd (spec §4.1) exactly, in int64, for U (n,) float32 holding
    integers in [0, U_MAX] and the value rows at `rows` of values (n_slots * G, D). In chunks
    of at most PV_CHUNK keys, U is split into 12-bit halves (U >> 12 <= 4096, U & 4095),
    each summed by int_weighted_rows in int32 (below PV_CHUNK * 4096 * 127 < 2**31); the
    terms it leaves out (an odd chunk's last key, the columns past a multiple of LANES) are
    added here."""
    n_cols = values.shape[1]
    paired_cols = n_cols - n_cols % numba_dot.LANES
    sums = np.empty((2, n_cols), np.int32)
    for start in range(0, u.shape[0], PV_CHUNK):
        n = min(PV_CHUNK, u.shape[0] - start)
        halves = np.empty((2, n), np.int16)
        for i in range(n):
            halves[0, i], halves[1, i] = I32(u[start + i]) >> 12, I32(u[start + i]) & 4095
        sums[:] = 0
        numba_dot.int_weighted_rows(halves, values, rows[start:start + n], sums, 2)
        for d in range(paired_cols):
            num[d] += np.int64(sums[0, d]) * 4096 + sums[1, d]
        for i in range(start, start + n):
            first = paired_cols if i < start + n - n % 2 else 0
            for d in range(first, n_cols):
                num[d] += np.int64(u[i]) * values[rows[i], d]


@scalar
def _head_output(scores, u, values, rows, out):
    """spec §4.1 from one query head's scores S_j and value scales sv_j (in u) of the keys
    at `rows` of values (n_slots * G, D) -> out (D,) float32. Overwrites u with U_j."""
    svmax = _nan_ignoring_max(u)
    if not svmax > 0:                    # every visible value row is zero
        out[:] = 0
        return
    m, kappa = _nan_ignoring_max(scores), numba_scalar.TWO_24 / svmax
    den, nan = np.int64(0), F32(0)
    for i in range(u.shape[0]):          # E_j, and U_j in place of sv_j
        e_int, u[i] = attention_weights(scores[i], m, u[i], kappa)
        den += np.int64(e_int)
        if not u[i] <= U_MAX:            # NaN, from inf * 0 when svmax is inf
            nan = u[i]
    if nan != 0:                         # the reference's sums are that NaN, and so is out
        out[:] = attention_out(np.float64(nan), den, svmax)
        return
    num = np.zeros(out.shape[0], np.int64)
    _add_weighted_rows(u, values, rows, num)
    for d in range(out.shape[0]):
        out[d] = attention_out(num[d], den, svmax)


@njit(parallel=True, cache=True)
def attend_kernel(qh, kq, sk, vq, sv, table, shift, block_size, pos0, lo, hi, window,
                  instruction, parts, out):
    """spec §4.1 for T queries at pos0.. over the keys lo .. hi-1 of one cache layer (the
    union of what they see: past pos0+T-1 up to an instruction block's end), read in place.

    qh: (T, H, D) float32; kq, vq: (rows, block_size, G, D) int8 and sk, sv: (rows,
    block_size, G) float32, the pool's arena; position j is in arena row
    table[(j - shift) // block_size] at (j - shift) % block_size -> out: (T, H, D) float32.
    Work items are (query, one of `parts` ranges of heads), the queries interleaved; parts > 1
    spreads one query over threads. Per head: the scores of the visible keys, their max, E
    and U, then the exact sums Σ E and Σ U vq.
    """
    n_tok, n_heads, head_dim = qh.shape
    n_kv = kq.shape[2]
    group = n_heads // n_kv
    keys, values = kq.reshape(-1, head_dim), vq.reshape(-1, head_dim)    # row: slot * G + g
    kscale, vscale = sk.reshape(-1), sv.reshape(-1)
    slots = _arena_slots(table, shift, block_size, lo, hi)
    for item in prange(n_tok * parts):
        t, part = _interleaved(item // parts, n_tok), item % parts
        first = max(lo, pos0 + t - window + 1) if window else lo
        last = instruction - 1 if pos0 + t < instruction else pos0 + t    # e(t)
        bases = slots[first - lo:last + 1 - lo] * n_kv
        h0, h1 = part * n_heads // parts, (part + 1) * n_heads // parts
        qq, c = _quantized_queries(qh[t], h0, h1)
        scores, u = np.empty((h1 - h0, len(bases)), F32), np.empty((h1 - h0, len(bases)), F32)
        _scores(qq, c, h0, keys, kscale, vscale, bases, group, scores, u)
        for h in range(h0, h1):
            _head_output(scores[h - h0], u[h - h0], values, bases + h // group, out[t, h])


@njit(parallel=True, cache=True)
def split_heads_kernel(z, cos, sin, n_heads, n_kv, qmax, qh, kq, sk, vq, sv):
    """RoPE of the Q and K heads, Q(., qmax) of K and V per kv head as the KV cache stores
    them (forward.split_heads).

    z: (T, (H + 2G) * D); cos, sin: (T, D/2) -> qh (T, H, D); kq, vq (T, G, R): int8 (R = D)
    or packed int4 uint8 (R = D/2); sk, sv (T, G).
    """
    head_dim = qh.shape[2]
    half = head_dim // 2
    for t in prange(z.shape[0]):
        kh, q = np.empty(head_dim, F32), np.empty(head_dim, np.int8)
        for h in range(n_heads + n_kv):
            x = z[t, h * head_dim:(h + 1) * head_dim]
            dst = qh[t, h] if h < n_heads else kh
            for i in range(half):
                dst[i], dst[i + half] = rope_pair(x[i], x[i + half], cos[t, i], sin[t, i])
            if h >= n_heads:
                sk[t, h - n_heads] = quantize_row(kh, q, qmax)
                store_kv_row(q, kq[t, h - n_heads])
        for g in range(n_kv):
            col = (n_heads + n_kv + g) * head_dim
            sv[t, g] = quantize_row(z[t, col:col + head_dim], q, qmax)
            store_kv_row(q, vq[t, g])


@njit(parallel=True, cache=True)
def swiglu_kernel(gu, h):
    """gu: (T, 2F) float32 -> h: (T, F) float32, silu(gate) * up."""
    ffn = h.shape[1]
    for t in prange(gu.shape[0]):
        for i in range(ffn):
            h[t, i] = silu_times(gu[t, i], gu[t, ffn + i])


@njit(parallel=True, cache=True)
def gate_kernel(o, z, at, out):
    """o: (T, H * D) float32, z: (T, R) -> out = o * sig(z[:, at : at + H * D])."""
    for t in prange(o.shape[0]):
        for i in range(o.shape[1]):
            out[t, i] = sigmoid_times(z[t, at + i], o[t, i])


@njit(parallel=True, cache=True)
def loop_mix_kernel(qh, glob, local, gw, gs, gb, out):
    """Loop attention's gated mix (spec §4). qh: (T, H, D) float32 queries; glob, local,
    out: (T, H * D) float32; gw: (H, D) int8; gs, gb: (H,) float32."""
    for t in prange(qh.shape[0]):
        q8 = np.empty(qh.shape[2], np.int8)
        for h in range(qh.shape[1]):
            loop_mix_head(qh[t, h], q8, gw, gs, gb, h, glob[t], local[t], out[t])


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
    reference's for the rest (embedding, residual additions, state copies); the KV cache's
    blocks live in an arena that attention reads in place."""
    name = "numba"
    isa = "llvm"              # compiled by numba's LLVM for this CPU (device_name)
    new_pool = ArenaBlockPool
    sample = staticmethod(sample)

    def __init__(self, threads=None):
        """threads: Model(threads=...); None, or more than numba's pool has, means all."""
        self.threads = min(threads or numba.config.NUMBA_NUM_THREADS,
                           numba.config.NUMBA_NUM_THREADS)
        self.device_name = f"cpu ({llvm.get_host_cpu_name()})"

    def threads_for(self, work):
        """`threads` for a kernel of PARALLEL_WORK multiply-adds (or so) or more, else one."""
        return self.threads if work >= PARALLEL_WORK else 1

    def launch(self, kernel, threads, *args):
        """kernel(*args) on `threads` threads. numba keeps the count per calling thread, and
        asking numba for it costs more than a small kernel, so the count last set here is
        remembered (should other code change it in this thread, only timing is affected)."""
        if getattr(_numba_threads, "count", None) != threads:
            numba.set_num_threads(threads)
            _numba_threads.count = threads
        kernel(*args)

    def linear(self, w, scale, multipliers=None, group_size=0, bias=None):
        return NumbaLinear(self, w, scale, multipliers, group_size, bias)

    def quantize_rows(self, x, block=0):
        q, s = np.empty(x.shape, input_type(block)), np.empty(x.shape[:-1], F32)
        self.launch(quantize_rows_kernel, self.threads_for(x.size), x.reshape(-1, x.shape[-1]),
                    block, q.reshape(-1, x.shape[-1]), s.reshape(-1))
        return q, s

    def rms_quantize(self, x, eps, block=0):
        q, a = np.empty(x.shape, input_type(block)), np.empty(len(x), F32)
        self.launch(rms_quantize_kernel, self.threads_for(x.size), x, F32(eps), block, q, a)
        return q, a

    def rms_norm(self, x, gain, eps):
        y = np.empty(x.shape, F32)
        self.launch(rms_norm_kernel, self.threads_for(x.size), x, gain, F32(eps), y)
        return y

    def split_heads(self, z, cos, sin, config, kv_bits):
        n_tok, H, G, D = len(z), config.n_heads, config.n_kv_heads, config.head_dim
        qmax, row_bytes, row_type = kv_row_format(D, kv_bits)
        qh = np.empty((n_tok, H, D), F32)
        kq, vq = (np.empty((n_tok, G, row_bytes), row_type) for _ in range(2))
        sk, sv = np.empty((n_tok, G), F32), np.empty((n_tok, G), F32)
        self.launch(split_heads_kernel, self.threads_for(z.size), z, cos, sin, H, G, F32(qmax),
                    qh, kq, sk, vq, sv)
        return qh, (kq, sk, vq, sv)

    def attend(self, qh, cache, layer, pos0, window=None):
        window = cache.window if window is None else window
        lo, hi = key_range(pos0, len(qh), window, cache.instruction)
        pool = cache.pool
        table, shift = pool.block_table(cache, layer, lo, hi)
        arena = pool.arena              # one arena: a growing thread may replace it
        kq, sk, vq, sv = (arena[name] for name in ARENA_ARRAYS)
        if pool.kv_bits == 4:           # the visible blocks' int8 values, as rows 0, 1, ...
            kq, sk, vq, sv = (unpack_int4(kq[table]), sk[table], unpack_int4(vq[table]),
                              sv[table])
            table = np.arange(len(table), dtype=np.int32)
        out = np.empty(qh.shape, F32)
        threads = self.threads_for(qh.size * (hi - lo))
        parts = min(threads, qh.shape[1]) if len(qh) < threads else 1   # split a lone query
        self.launch(attend_kernel, threads, qh, kq, sk, vq, sv, table, shift, pool.block_size,
                    pos0, lo, hi, window, cache.instruction, parts, out)
        return out.reshape(len(qh), -1)

    def loop_mix(self, qh, global_out, local_out, gate):
        out = np.empty(global_out.shape, F32)
        self.launch(loop_mix_kernel, self.threads_for(out.size * 16), qh, global_out,
                    local_out, gate.w, gate.s, gate.b, out)
        return out

    def swiglu(self, gu):
        h = np.empty((len(gu), gu.shape[1] // 2), F32)
        self.launch(swiglu_kernel, self.threads_for(h.size * 16), gu, h)   # exp2s: ~16 ops
        return h

    def gate(self, o, z, at):
        out = np.empty(o.shape, F32)
        self.launch(gate_kernel, self.threads_for(o.size * 16), o, z, at, out)
        return out
