"""Forward pass of a looped model over a chunk of tokens (docs/spec.md §4), for any kernel set.

`forward_chunk` runs T new tokens at positions cache.length .. cache.length+T-1 through every
layer of the cache, writing their keys and values, and returns the final hidden states. It
releases nothing: the caller drops blocks a window no longer sees once its call is done.

The orchestration here is shared by every Python backend; the arithmetic comes from a *kernel
set*, an object with the attributes of `NumpyKernels` (the reference, the spec in numpy).
Another backend (fallback/numba_cpu.py, fallback/numba_cuda.py) swaps in its own kernels for
the same operations, each of which must give bit-identical results:

    name                                     backend name ("numpy", "numba", ...)
    device, device_name, isa, threads        where and how it runs, for Engine.runtime():
                                             "cpu" or "cuda", e.g. "cpu (numpy)", the
                                             kernel path, the threads a kernel may use
    linear(w, scale, multipliers, group)     a linear layer's weights; calling it with
                                             (q (T, K) int8, a (T,) f32) gives (T, R) f32
    table(array)                             places a lookup table (embedding, RoPE)
    new_pool(block_size, n_kv_heads, D)      the KV cache's BlockPool
    embed(weights, tokens)                   tokens (T,) int32 -> (T, d) f32
    rms_quantize(x, eps) / quantize_rows(x)  NQ / Q8 of every row: (q int8, scale (rows,) f32)
    split_heads(z, cos, sin, config)         z (T, (H + 2G) * D) -> qh (T, H, D) after RoPE,
                                             and Q8 of K (after RoPE) and V: kq, sk, vq, sv
    attend(qh, cache, layer, pos0)           (T, H, D) queries over one cache layer -> (T, H * D)
    swiglu(gu)                               (T, 2F) gate|up -> (T, F)
    add(x, y)                                the residual addition
    last_row(x)                              (T, d) -> a (1, d) copy of the last row
    to_host(y)                               a numpy array of y
    sample(logits, history, params, pos)     spec §5.1 on host logits (V,)
"""
import numpy as np

from .attention import attend_cached
from .kvcache import BlockPool
from .numerics import F32, quantize_rows, rms_quantize, rope, silu
from .sampling import sample
from .weights import Linear


def embed(weights, tokens):
    """tokens: (T,) int -> (T, d) float32."""
    return weights.embedding[tokens].astype(F32) * weights.embedding_scale[tokens][:, None]


def split_heads(z, cos, sin, config):
    """z: (T, (H + 2G) * D) -> qh (T, H, D) float32, (kq, sk, vq, sv) for the KV cache."""
    n_tok, H, G, D = len(z), config.n_heads, config.n_kv_heads, config.head_dim
    qh = rope(z[:, :H * D].reshape(n_tok, H, D), cos, sin)
    kh = rope(z[:, H * D:(H + G) * D].reshape(n_tok, G, D), cos, sin)
    vh = z[:, (H + G) * D:].reshape(n_tok, G, D)
    return qh, quantize_rows(kh) + quantize_rows(vh)


def swiglu(gu):
    """gu: (T, 2F), gate then up -> silu(gate) * up, (T, F) float32."""
    ffn = gu.shape[1] // 2
    return silu(gu[:, :ffn]) * gu[:, ffn:]


class NumpyKernels:
    """The reference kernel set: every operation of the forward pass in numpy."""
    name = "numpy"
    device = "cpu"
    device_name = "cpu (numpy)"
    isa = "numpy"             # exact integer matmuls as float64 BLAS products (weights.Linear)
    threads = 1
    linear = Linear
    table = staticmethod(np.asarray)
    new_pool = BlockPool
    embed = staticmethod(embed)
    rms_quantize = staticmethod(rms_quantize)
    quantize_rows = staticmethod(quantize_rows)
    split_heads = staticmethod(split_heads)
    attend = staticmethod(attend_cached)
    swiglu = staticmethod(swiglu)
    add = staticmethod(np.add)
    last_row = staticmethod(lambda x: x[-1:].copy())
    to_host = staticmethod(np.asarray)
    sample = staticmethod(sample)


def attention_block(kernels, weights, block, cache, layer, x, pos0):
    """x: (T, d) -> x + attention output, writing this layer's KV at pos0 .. pos0+T-1."""
    cfg = weights.config
    q, a = kernels.rms_quantize(x, cfg.rms_eps)
    z = block.attn_qkv(q, a)                                   # (T, (H + 2G) * D)
    rows = slice(pos0, pos0 + len(z))
    qh, kv = kernels.split_heads(z, weights.rope_cos[rows], weights.rope_sin[rows], cfg)
    cache.write(layer, pos0, *kv)
    o = kernels.attend(qh, cache, layer, pos0)                 # (T, H * D)
    q, s = kernels.quantize_rows(o)
    return kernels.add(x, block.attn_out(q, s))


def mlp_block(kernels, weights, block, x):
    """x: (T, d) -> x + SwiGLU MLP output."""
    q, a = kernels.rms_quantize(x, weights.config.rms_eps)
    h = kernels.swiglu(block.ffn_gate_up(q, a))                # (T, F)
    q, s = kernels.quantize_rows(h)
    return kernels.add(x, block.ffn_down(q, s))


def forward_chunk(kernels, weights, cache, tokens, layer_states=None):
    """Run tokens (T,) int32 through all of the cache's layers; returns (T, d) final states.

    If `layer_states` is a list, the last token's hidden state after every loop iteration is
    appended to it as a (1, d) row (what a prefix keeps, spec §5.4).
    """
    pos0 = cache.length
    x = kernels.embed(weights, tokens)
    n_pre = weights.config.n_pre_blocks
    for layer in range(cache.n_layers):
        block = weights.block(layer)
        x = attention_block(kernels, weights, block, cache, layer, x, pos0)
        x = mlp_block(kernels, weights, block, x)
        if layer_states is not None and layer >= n_pre:
            layer_states.append(kernels.last_row(x))
    cache.length += len(tokens)
    return x


def head_logits(kernels, weights, x):
    """x: (T, d) final hidden states -> (T, V) float32 logits, on the host."""
    q, a = kernels.rms_quantize(x, weights.config.rms_eps)
    return kernels.to_host(weights.head(q, a))
