"""The numba CUDA kernel set: the forward pass on an NVIDIA GPU, bit-identical to numpy.

Plugs into the shared engine (fallback/engine.py) as `CudaKernels()`. Weights, RoPE tables,
activations and the KV cache stay in device memory; only token ids go in and logits come out.
The engine's paged KV cache keeps its blocks in one device arena (`DeviceBlockPool`,
numba_arena.py) and attention reads them through a block table, so paging, sharing and
copy-on-write are the numpy backend's own code.

Exactness on the device:
- integer matmuls accumulate exactly (int4 weights are unpacked with their group multiplier
  folded in, weights.integer_weights): in int32 over each TILE of inputs, whatever the input
  (block inputs too, act_block: |p| <= 32385, §2.2.1), then in int64;
- the float numerics are numba_scalar.py's, with libdevice's fmul_rn / fadd_rn / fsub_rn:
  NVVM contracts a plain a*b+c into fma.rn.f32 even without fastmath, never these; division
  and sqrt are div.rn / sqrt.rn (fastmath off). tests/test_numba_cuda.py reads every kernel's
  PTX for fma/mad on floats, .approx and .ftz;
- attention makes two passes over the keys (max first, then the exact integer sums).

Under NUMBA_ENABLE_CUDASIM=1 the same kernels run on numba's CPU simulator, with numpy's
float32 scalar operations standing in for libdevice's (also single, correctly rounded ops).
"""
import operator
from types import SimpleNamespace

import numpy as np
from numba import config, cuda

from . import numba_cpu, numba_scalar
from .attention import key_range
from .forward import NumpyKernels
from .kvcache import kv_row_format
from .numba_arena import ArenaBlockPool
from .weights import integer_weights

F32 = np.float32
I32 = np.int32
NEG_INF = F32(-np.inf)
TILE = 16             # linear: TILE weight rows x up to TILE tokens per block, K in TILE steps
                      # (at most 32: a K tile's int32 sum of block inputs, TILE * 32385 * 2040)
ATTN_THREADS = 32     # attention: one block of at most this many threads per (query, head)
MAX_HEAD_DIM = 1024   # spec §6.1
DIMS_PER_THREAD = MAX_HEAD_DIM // ATTN_THREADS
ROWS_PER_BLOCK = 64   # row kernels: one thread per row (or element)


def _float_ops():
    if config.ENABLE_CUDASIM:
        return SimpleNamespace(mul=operator.mul, add=operator.add, sub=operator.sub,
                               rint=np.rint, floor=np.floor, ceil=np.ceil, sqrt=np.sqrt,
                               f32_from_bits=lambda i: np.int32(i).view(np.float32),
                               dmul=operator.mul, dadd=operator.add)
    from numba.cuda import libdevice as ld
    return SimpleNamespace(mul=ld.fmul_rn, add=ld.fadd_rn, sub=ld.fsub_rn, rint=ld.rintf,
                           floor=ld.floorf, ceil=ld.ceilf, sqrt=ld.fsqrt_rn,
                           f32_from_bits=ld.int_as_float,
                           dmul=ld.dmul_rn, dadd=ld.dadd_rn)


OPS = _float_ops()
S = numba_scalar.build(cuda.jit(device=True), OPS)
fmul, fadd, fsqrt, dmul, dadd = OPS.mul, OPS.add, OPS.sqrt, OPS.dmul, OPS.dadd
quantize_row, quantize_input_row, store_kv_row, kv_value = (
    S.quantize_row, S.quantize_input_row, S.store_kv_row, S.kv_value)
rms_scale, rms_norm_row, linear_out = S.rms_scale, S.rms_norm_row, S.linear_out
rope_pair, silu_times, sigmoid_times = S.rope_pair, S.silu_times, S.sigmoid_times
loop_mix_head = S.loop_mix_head
attention_score, attention_weights, attention_out = (
    S.attention_score, S.attention_weights, S.attention_out)


def _blocks(n, per_block):
    return (n + per_block - 1) // per_block


def _grid(n):
    """Launch configuration [blocks, threads] covering n threads, one per row or element."""
    per_block = max(1, min(ROWS_PER_BLOCK, n))
    return _blocks(n, per_block), per_block


# -- element and row kernels ----------------------------------------------------------------

@cuda.jit(fastmath=False)
def embed_kernel(tokens, table, scale, embed_scale, x):
    """x[t, i] = ((f32) E[tok, i] * es[tok]) * embed_scale. tokens (T,) int32; x (T, d)."""
    i = cuda.grid(1)
    if i < x.size:
        t, c = i // x.shape[1], i % x.shape[1]
        tok = tokens[t]
        x[t, c] = fmul(fmul(F32(table[tok, c]), scale[tok]), embed_scale)


@cuda.jit(fastmath=False)
def add_kernel(x, y, out):
    """out = x + y, element-wise float32 (T, d)."""
    i = cuda.grid(1)
    if i < out.size:
        t, c = i // out.shape[1], i % out.shape[1]
        out[t, c] = fadd(x[t, c], y[t, c])


@cuda.jit(fastmath=False)
def swiglu_kernel(gu, h):
    """gu (T, 2F) -> h (T, F) = silu(gate) * up."""
    i = cuda.grid(1)
    if i < h.size:
        ffn = h.shape[1]
        t, c = i // ffn, i % ffn
        h[t, c] = silu_times(gu[t, c], gu[t, ffn + c])


@cuda.jit(fastmath=False)
def gate_kernel(o, z, at, out):
    """o (T, H * D), z (T, R) -> out = o * sig(z[:, at : at + H * D])."""
    i = cuda.grid(1)
    if i < out.size:
        t, c = i // out.shape[1], i % out.shape[1]
        out[t, c] = sigmoid_times(z[t, at + c], o[t, c])


@cuda.jit(fastmath=False)
def loop_mix_kernel(qh, glob, local, gw, gs, gb, out):
    """Loop attention's gated mix (spec §4), one thread per (row t, head h). qh: (T, H, D)
    float32; glob, local, out: (T, H * D) float32; gw: (H, D) int8; gs, gb: (H,) float32."""
    i = cuda.grid(1)
    n_heads, head_dim = qh.shape[1], qh.shape[2]
    if i < qh.shape[0] * n_heads:
        t, h = i // n_heads, i % n_heads
        q8 = cuda.local.array(MAX_HEAD_DIM, np.int8)
        loop_mix_head(qh[t, h], q8[:head_dim], gw, gs, gb, h, glob[t], local[t], out[t])


@cuda.jit(fastmath=False)
def quantize_rows_kernel(x, block, q, s):
    """Q8 (block 0) or QB(., block) of every row: x (N, n) float32 -> q (N, n) int8 (block 0)
    or int16, s (N,)."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        s[i] = quantize_input_row(x[i], q[i], block)


@cuda.jit(fastmath=False)
def rms_quantize_kernel(x, eps, block, q, a):
    """NQ (block 0) or NQB(., block) of every row: x (N, n) float32 -> q (N, n) int8 (block
    0) or int16, a (N,)."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        a[i] = rms_scale(q[i], quantize_input_row(x[i], q[i], block), eps)


@cuda.jit(fastmath=False)
def rms_norm_kernel(x, gain, eps, y):
    """RN of every row: x (N, n) float32, gain (n,) -> y (N, n) float32."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        rms_norm_row(x[i], gain, eps, y[i])


@cuda.jit(fastmath=False)
def rope_kernel(z, cos, sin, qh, kh):
    """RoPE of the Q heads into qh (T, H, D) and of the K heads into kh (T, G, D)."""
    i = cuda.grid(1)
    n_heads, n_kv, head_dim = qh.shape[1], kh.shape[1], qh.shape[2]
    half = head_dim // 2
    per_tok = (n_heads + n_kv) * half
    if i < z.shape[0] * per_tok:
        t, rest = i // per_tok, i % per_tok
        h, c = rest // half, rest % half
        x1, x2 = z[t, h * head_dim + c], z[t, h * head_dim + half + c]
        y1, y2 = rope_pair(x1, x2, cos[t, c], sin[t, c])
        dst = qh[t, h] if h < n_heads else kh[t, h - n_heads]
        dst[c] = y1
        dst[half + c] = y2


@cuda.jit(fastmath=False)
def quantize_kv_kernel(kh, z, v_col, qmax, kq, sk, vq, sv):
    """Q(., qmax) per kv head of K (kh (T, G, D)) and of V (z[t, v_col + g*D ...]) into the
    cache rows kq, vq (T, G, R): int8 (R = D) or packed int4 uint8 (R = D/2)."""
    i = cuda.grid(1)
    n_kv, head_dim = kh.shape[1], kh.shape[2]
    q = cuda.local.array(MAX_HEAD_DIM, np.int8)
    if i < kh.shape[0] * n_kv * 2:
        t, rest = i // (2 * n_kv), i % (2 * n_kv)
        g = rest // 2
        if rest % 2 == 0:
            sk[t, g] = quantize_row(kh[t, g], q[:head_dim], qmax)
            store_kv_row(q[:head_dim], kq[t, g])
        else:
            col = v_col + g * head_dim
            sv[t, g] = quantize_row(z[t, col:col + head_dim], q[:head_dim], qmax)
            store_kv_row(q[:head_dim], vq[t, g])


# -- linear ---------------------------------------------------------------------------------

@cuda.jit(fastmath=False)
def linear_kernel(q, a, w, scale, bias, y):
    """spec §3: y (T, R) = ((f32) (q @ w.T) * a) * ws (+ b), exact: each K tile's sum in
    int32 (|term| <= 32385 * 2040, TILE of them < 2**31), the tiles' in int64.

    q: (T, K) int8, or int16 block inputs; a: (T,) float32; w: (R, K) int8, or int16 holding
    m * w for int4; scale: (R,) float32; bias: (R,) float32, or empty for a linear without one.
    Block (TILE, n): thread (x, y) computes weight row x of the block's TILE rows for token
    y of its n tokens; K advances in TILE-wide tiles staged in shared memory.
    """
    sq = cuda.shared.array((TILE, TILE), np.int32)
    sw = cuda.shared.array((TILE, TILE), np.int32)
    tx, ty, n_tok_block = cuda.threadIdx.x, cuda.threadIdx.y, cuda.blockDim.y
    r0 = cuda.blockIdx.x * TILE
    t = cuda.blockIdx.y * n_tok_block + ty
    n_tok, n_in = q.shape
    acc = np.int64(0)
    for k0 in range(0, n_in, TILE):
        k = k0 + tx
        sq[ty, tx] = I32(q[t, k]) if t < n_tok and k < n_in else I32(0)
        for i in range(ty, TILE, n_tok_block):
            sw[i, tx] = I32(w[r0 + i, k]) if r0 + i < w.shape[0] and k < n_in else I32(0)
        cuda.syncthreads()
        part = I32(0)
        for kk in range(TILE):
            part = I32(part + sq[ty, kk] * sw[tx, kk])
        acc += part
        cuda.syncthreads()
    if t < n_tok and r0 + tx < w.shape[0]:
        y[t, r0 + tx] = linear_out(acc, a[t], scale, bias, r0 + tx)


class CudaLinear:
    """A linear layer on the device: (R, K) int8 weights, or int16 m * w for int4; its bias
    (an empty array when it has none)."""

    def __init__(self, w, scale, multipliers=None, group_size=0, bias=None):
        self.w = cuda.to_device(np.ascontiguousarray(integer_weights(w, multipliers, group_size)))
        self.scale = cuda.to_device(np.asarray(scale, F32))
        self.bias = cuda.to_device(np.empty(0, F32) if bias is None
                                   else np.ascontiguousarray(bias, F32))
        self.n_out = len(scale)

    @property
    def nbytes(self):
        return self.w.nbytes + self.scale.nbytes + self.bias.nbytes

    def __call__(self, q, a):
        """q: (T, K) int8, or int16 block inputs, a: (T,) float32 (device) -> (T, R) float32
        (device)."""
        n_tok = q.shape[0]
        per_block = min(TILE, n_tok)
        y = cuda.device_array((n_tok, self.n_out), F32)
        grid = (_blocks(self.n_out, TILE), _blocks(n_tok, per_block))
        linear_kernel[grid, (TILE, per_block)](q, a, self.w, self.scale, self.bias, y)
        return y


# -- attention ------------------------------------------------------------------------------

@cuda.jit(device=True)
def _key(table, j, block_size):
    """(arena block, row) of the key at table position j (j = position - shift)."""
    return table[j // block_size], j % block_size


@cuda.jit(device=True)
def _block_max(values, tid):
    """NaN-free max over the block's `values` (one per thread), in place; returns it."""
    stride = cuda.blockDim.x // 2
    while stride > 0:
        cuda.syncthreads()
        if tid < stride and values[tid + stride] > values[tid]:
            values[tid] = values[tid + stride]
        stride //= 2
    cuda.syncthreads()
    return values[0]


@cuda.jit(fastmath=False)
def attend_kernel(qh, kq, sk, vq, sv, table, shift, block_size, pos0, lo, window, instruction,
                  out):
    """spec §4.1; one block per (query t, head h) of n threads, n a power of two <= 32 and
    n >= D or n = 32. Thread i visits keys i, i + n, ... and output dims i, i + n, ...

    qh: (T, H, D) float32; kq, vq: (blocks, block_size, G, R) arena, int8 (R = D) or packed
    int4 uint8 (R = D/2, read a nibble at a time, kv_value); sk, sv: (blocks,
    block_size, G) float32; table: arena indices of the blocks holding positions lo ..;
    position j is in table[(j - shift) // block_size] with shift = first block * block_size.
    out: (T, H * D) float32.
    """
    t, h, tid, n_thr = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
    n_heads, head_dim = qh.shape[1], qh.shape[2]
    g = h // (n_heads // kq.shape[2])
    packed = kq.shape[3] != head_dim
    qq = cuda.shared.array(MAX_HEAD_DIM, np.int8)
    red = cuda.shared.array(ATTN_THREADS, np.float32)
    red2 = cuda.shared.array(ATTN_THREADS, np.float32)
    den_part = cuda.shared.array(ATTN_THREADS, np.float64)
    u_chunk = cuda.shared.array(ATTN_THREADS, np.float32)
    c_shared = cuda.shared.array(1, np.float32)
    num = cuda.local.array(DIMS_PER_THREAD, np.float64)    # dims tid + i * n
    pos = pos0 + t
    first = max(lo, pos - window + 1) if window else lo
    last = instruction - 1 if pos < instruction else pos    # e(t): the instruction block
    if tid == 0:
        c_shared[0] = quantize_row(qh[t, h], qq[:head_dim], numba_scalar.QMAX8) / fsqrt(
            F32(head_dim))
    cuda.syncthreads()
    c = c_shared[0]
    m = NEG_INF
    svmax = NEG_INF
    for j in range(first + tid, last + 1, n_thr):
        b, row = _key(table, j - shift, block_size)
        score = _score(qq, kq, sk, b, row, g, head_dim, packed, c)
        m = score if score > m else m
        svmax = sv[b, row, g] if sv[b, row, g] > svmax else svmax
    red[tid] = m
    red2[tid] = svmax
    m = _block_max(red, tid)
    svmax = _block_max(red2, tid)
    n_mine = (head_dim - tid + n_thr - 1) // n_thr
    for i in range(n_mine):
        num[i] = 0.0
    den = 0.0
    if svmax > 0:
        kappa = numba_scalar.TWO_24 / svmax
        for base in range(first, last + 1, n_thr):
            j = base + tid
            u_chunk[tid] = 0
            if j <= last:
                b, row = _key(table, j - shift, block_size)
                e_int, u = attention_weights(_score(qq, kq, sk, b, row, g, head_dim, packed, c),
                                             m, sv[b, row, g], kappa)
                den = dadd(den, np.float64(e_int))
                u_chunk[tid] = u
            cuda.syncthreads()
            for jj in range(min(n_thr, last + 1 - base)):
                b, row = _key(table, base + jj - shift, block_size)
                u64 = np.float64(u_chunk[jj])
                values = vq[b, row, g]
                for i in range(n_mine):
                    d = tid + i * n_thr
                    num[i] = dadd(num[i], dmul(u64, np.float64(kv_value(values, d, packed))))
            cuda.syncthreads()
    den_part[tid] = den
    stride = n_thr // 2
    while stride > 0:                     # exact: integers below 2**53, any order
        cuda.syncthreads()
        if tid < stride:
            den_part[tid] = dadd(den_part[tid], den_part[tid + stride])
        stride //= 2
    cuda.syncthreads()
    for i in range(n_mine):
        d = tid + i * n_thr
        o = attention_out(num[i], den_part[0], svmax) if svmax > 0 else F32(0)
        out[t, h * head_dim + d] = o


@cuda.jit(device=True)
def _score(qq, kq, sk, b, row, g, head_dim, packed, c):
    """S_j of the key in arena block b, row `row`, kv head g (packed: an int4 arena)."""
    key = kq[b, row, g]
    dot = I32(0)
    for d in range(head_dim):
        dot = I32(dot + I32(qq[d]) * kv_value(key, d, packed))
    return attention_score(dot, c, sk[b, row, g])


# -- the KV arena ---------------------------------------------------------------------------

class DeviceBlockPool(ArenaBlockPool):
    """ArenaBlockPool with its arena in device memory."""
    empty = staticmethod(cuda.device_array)
    place_table = staticmethod(cuda.to_device)

    @staticmethod
    def copy_into(dst, src):
        dst.copy_to_device(src)


# -- the kernel set -------------------------------------------------------------------------

class CudaKernels(NumpyKernels):
    """The kernel set of backend "numba-cuda": every forward operation on the device; the
    sampler is the numba CPU backend's, on the host's copy of the logits."""
    name = "numba-cuda"
    device = "cuda"
    new_pool = DeviceBlockPool
    linear = CudaLinear
    sample = staticmethod(numba_cpu.sample)

    def __init__(self):
        gpu = cuda.current_context().device
        name = "CUDA simulator" if config.ENABLE_CUDASIM else gpu.name
        name = name.decode() if isinstance(name, bytes) else name
        major, minor = gpu.compute_capability
        self.device_name = f"{name} (sm_{major}{minor})"
        self.isa = "cudasim" if config.ENABLE_CUDASIM else "ptx"

    @staticmethod
    def table(array):
        return cuda.to_device(np.ascontiguousarray(array))

    @staticmethod
    def embed(weights, tokens):
        x = cuda.device_array((len(tokens), weights.config.d_model), F32)
        embed_kernel[_grid(x.size)](cuda.to_device(tokens), weights.embedding,
                                    weights.embedding_scale, weights.embed_scale, x)
        return x

    @staticmethod
    def add(x, y):
        out = cuda.device_array(x.shape, F32)
        add_kernel[_grid(out.size)](x, y, out)
        return out

    @staticmethod
    def swiglu(gu):
        h = cuda.device_array((gu.shape[0], gu.shape[1] // 2), F32)
        swiglu_kernel[_grid(h.size)](gu, h)
        return h

    @staticmethod
    def gate(o, z, at):
        out = cuda.device_array(o.shape, F32)
        gate_kernel[_grid(out.size)](o, z, at, out)
        return out

    @staticmethod
    def quantize_rows(x, block=0):
        q = cuda.device_array(x.shape, numba_cpu.input_type(block))
        s = cuda.device_array(x.shape[0], F32)
        quantize_rows_kernel[_grid(x.shape[0])](x, block, q, s)
        return q, s

    @staticmethod
    def rms_quantize(x, eps, block=0):
        q = cuda.device_array(x.shape, numba_cpu.input_type(block))
        a = cuda.device_array(x.shape[0], F32)
        rms_quantize_kernel[_grid(x.shape[0])](x, F32(eps), block, q, a)
        return q, a

    @staticmethod
    def rms_norm(x, gain, eps):
        y = cuda.device_array(x.shape, F32)
        rms_norm_kernel[_grid(x.shape[0])](x, gain, F32(eps), y)
        return y

    @staticmethod
    def copy(x):
        twin = cuda.device_array(x.shape, F32)
        twin.copy_to_device(x)
        return twin

    @staticmethod
    def split_heads(z, cos, sin, config, kv_bits):
        n_tok, H, G, D = z.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
        qmax, row_bytes, row_type = kv_row_format(D, kv_bits)
        qh, kh = cuda.device_array((n_tok, H, D), F32), cuda.device_array((n_tok, G, D), F32)
        rope_kernel[_grid(n_tok * (H + G) * D // 2)](z, cos, sin, qh, kh)
        kq, vq = (cuda.device_array((n_tok, G, row_bytes), row_type) for _ in range(2))
        sk, sv = cuda.device_array((n_tok, G), F32), cuda.device_array((n_tok, G), F32)
        quantize_kv_kernel[_grid(n_tok * G * 2)](kh, z, (H + G) * D, F32(qmax), kq, sk, vq, sv)
        return qh, (kq, sk, vq, sv)

    @staticmethod
    def attend(qh, cache, layer, pos0, window=None):
        window = cache.window if window is None else window
        lo, hi = key_range(pos0, qh.shape[0], window, cache.instruction)
        table, shift = cache.pool.block_table(cache, layer, lo, hi)
        out = cuda.device_array((qh.shape[0], qh.shape[1] * qh.shape[2]), F32)
        arena = cache.pool.arena
        n_thr = min(ATTN_THREADS, 1 << (qh.shape[2] - 1).bit_length())
        attend_kernel[(qh.shape[0], qh.shape[1]), n_thr](
            qh, arena["kq"], arena["sk"], arena["vq"], arena["sv"], table, shift,
            cache.pool.block_size, pos0, lo, window, cache.instruction, out)
        return out

    @staticmethod
    def loop_mix(qh, global_out, local_out, gate):
        out = cuda.device_array(global_out.shape, F32)
        loop_mix_kernel[_grid(qh.shape[0] * qh.shape[1])](qh, global_out, local_out, gate.w,
                                                          gate.s, gate.b, out)
        return out

    @staticmethod
    def last_row(x):
        row = cuda.device_array((1, x.shape[1]), F32)
        row.copy_to_device(x[x.shape[0] - 1:])
        return row

    @staticmethod
    def to_host(y):
        return y.copy_to_host()
