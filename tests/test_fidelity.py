"""The exact integer engine is also a faithful one: its logits track a float64 evaluation of
the same (unquantized) weights with textbook RMSNorm, RoPE, softmax attention and SwiGLU."""
import numpy as np
import pytest

import tinyloop
from tinyloop.random_model import random_config, random_float_weights


def rms_norm(x, gain, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * gain


def float_forward(cfg, w, tokens, loops):
    """Textbook float64 forward of a looped model. Returns logits (T, V)."""
    H, G, D, n = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, len(tokens)
    inv = cfg.rope_theta ** (-np.arange(0, D, 2) / D)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(v):
        a, b = v[..., :D // 2], v[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["tok_emb"][tokens].astype(np.float64)
    causal = np.tril(np.ones((n, n), bool))
    blocks = cfg.block_prefixes()
    for layer in range(cfg.n_pre_blocks + loops):
        b = blocks[min(layer, len(blocks) - 1)]
        h = rms_norm(x, w[f"{b}.attn_norm"], cfg.rms_eps)
        q = rope((h @ w[f"{b}.wq"].T).reshape(n, H, D))
        k = rope((h @ w[f"{b}.wk"].T).reshape(n, G, D))
        v = (h @ w[f"{b}.wv"].T).reshape(n, G, D)
        k, v = np.repeat(k, H // G, axis=1), np.repeat(v, H // G, axis=1)
        s = np.einsum("thd,jhd->htj", q, k) / np.sqrt(D)
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("htj,jhd->thd", p, v).reshape(n, H * D)
        x = x + o @ w[f"{b}.wo"].T
        h = rms_norm(x, w[f"{b}.mlp_norm"], cfg.rms_eps)
        g, u = h @ w[f"{b}.w_gate"].T, h @ w[f"{b}.w_up"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[f"{b}.w_down"].T
    head = w["tok_emb"] if cfg.tied_head else w["head"]
    return rms_norm(x, w["final_norm"], cfg.rms_eps) @ head.T


def cosine(a, b):
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


@pytest.mark.parametrize("fmt, min_cos, min_top1", [("int8", 0.995, 0.9), ("int4", 0.95, 0.7)])
def test_quantized_logits_track_float_evaluation(tmp_path, fmt, min_cos, min_top1):
    shape = dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                 ffn_dim=256, n_pre_blocks=1, default_loops=4, max_seq_len=128,
                 weight_format=fmt)
    cfg = random_config(**shape)
    weights = random_float_weights(cfg, seed=11)
    tinyloop.random_model(tmp_path / "m.tinyloop", seed=11, **shape)
    tokens = np.random.default_rng(0).integers(0, 512, 64)
    with tinyloop.Model(tmp_path / "m.tinyloop", backend="numpy") as model:
        exact = model.logits(tokens).astype(np.float64)
    ref = float_forward(cfg, weights, tokens, cfg.default_loops)
    cos = np.mean([cosine(a, b) for a, b in zip(exact, ref)])
    top1 = np.mean(exact.argmax(-1) == ref.argmax(-1))
    print(f"\n{fmt}: mean logit cosine {cos:.5f}, top-1 agreement {top1:.3f}")
    assert cos >= min_cos and top1 >= min_top1
