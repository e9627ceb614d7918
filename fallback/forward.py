"""Forward pass of a looped model over a chunk of tokens (docs/spec.md §4).

`forward_chunk` runs T new tokens at positions cache.length .. cache.length+T-1 through every
layer of the cache, writing their keys and values, and returns the final hidden states.
"""
import numpy as np

from .attention import attend, visible_keys
from .numerics import F32, quantize_rows, rms_quantize, rope, silu


def embed(weights, tokens):
    """tokens: (T,) int -> (T, d) float32."""
    return weights.embedding[tokens].astype(F32) * weights.embedding_scale[tokens][:, None]


def attention_block(weights, block, cache, layer, x, positions):
    """x: (T, d) -> x + attention output, writing this layer's KV at `positions`."""
    cfg = weights.config
    n_tok, H, G, D = len(x), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, a = rms_quantize(x, cfg.rms_eps)
    z = block.attn_qkv(q, a)                                   # (T, (H + 2G) * D)
    cos, sin = weights.rope_cos[positions], weights.rope_sin[positions]
    qh = rope(z[:, :H * D].reshape(n_tok, H, D), cos, sin)
    kh = rope(z[:, H * D:(H + G) * D].reshape(n_tok, G, D), cos, sin)
    vh = z[:, (H + G) * D:].reshape(n_tok, G, D)
    kq, sk = quantize_rows(kh)
    vq, sv = quantize_rows(vh)
    cache.write(layer, positions[0], kq, sk, vq, sv)
    lo = max(0, positions[0] - cache.window + 1) if cache.window else 0
    keys = cache.read(layer, lo, positions[-1] + 1)
    o = attend(qh, *keys, visible_keys(positions, np.arange(lo, positions[-1] + 1), cache.window))
    q, s = quantize_rows(o)
    return x + block.attn_out(q, s)


def mlp_block(weights, block, x):
    """x: (T, d) -> x + SwiGLU MLP output."""
    ffn = weights.config.ffn_dim
    q, a = rms_quantize(x, weights.config.rms_eps)
    gu = block.ffn_gate_up(q, a)                               # (T, 2F)
    h = silu(gu[:, :ffn]) * gu[:, ffn:]
    q, s = quantize_rows(h)
    return x + block.ffn_down(q, s)


def forward_chunk(weights, cache, tokens, layer_states=None):
    """Run tokens (T,) through all of the cache's layers; returns (T, d) final hidden states.

    If `layer_states` is a list, the last token's hidden state after every loop iteration is
    appended to it (what a prefix keeps, spec §5.4).
    """
    positions = np.arange(cache.length, cache.length + len(tokens))
    x = embed(weights, np.asarray(tokens))
    n_pre = weights.config.n_pre_blocks
    for layer in range(cache.n_layers):
        block = weights.block(layer)
        x = attention_block(weights, block, cache, layer, x, positions)
        x = mlp_block(weights, block, x)
        if layer_states is not None and layer >= n_pre:
            layer_states.append(x[-1].copy())
    cache.length += len(tokens)
    cache.release_outside_window()
    return x


def head_logits(weights, x):
    """x: (T, d) final hidden states -> (T, V) float32 logits."""
    q, a = rms_quantize(x, weights.config.rms_eps)
    return weights.head(q, a)
