"""Quantizer: float weights of a looped model -> the tensors of a .tinyloop file.

Round-to-nearest with a per-row (int8) or per-group (int4) clipping search, after folding each
RMSNorm gain into the weights that consume its output (docs/spec.md §6.4).

Float weights (numpy arrays, any float dtype), keyed by name:
    tok_emb (V, d); rope is computed from config.rope_theta;
    per block prefix B ("pre.0" .. , "loop"): B.attn_norm (d,), B.wq (H*D, d), B.wk (G*D, d),
    B.wv (G*D, d), B.wo (d, H*D), B.mlp_norm (d,), B.w_gate (F, d), B.w_up (F, d), B.w_down (d, F);
    final_norm (d,); head (V, d) unless the config is tied.
"""
import dataclasses

import numpy as np

from .modelfile import pack_int4

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
INT4_MULTIPLIER_MAX = 255


def _best_by_error(w, scales_per_ratio, qmax):
    """Pick, per row of w (..., n), the candidate scale with the least squared error."""
    best_q, best_s, best_err = None, None, None
    for scale in scales_per_ratio:                           # scale: (...,) float64
        safe = np.where(scale > 0, scale, 1.0)[..., None]
        q = np.clip(np.rint(w / safe), -qmax, qmax)
        err = ((q * scale[..., None] - w) ** 2).sum(axis=-1)
        if best_err is None:
            best_q, best_s, best_err = q, scale.copy(), err
        else:
            better = err < best_err
            best_q = np.where(better[..., None], q, best_q)
            best_s = np.where(better, scale, best_s)
            best_err = np.where(better, err, best_err)
    return best_q, best_s


def quantize_int8(w):
    """w: (R, K) float -> (int8 (R, K), float32 scales (R,))."""
    w = np.asarray(w, np.float64)
    amax = np.abs(w).max(axis=1)
    q, s = _best_by_error(w, [c * amax / 127 for c in CLIP_RATIOS], 127)
    return q.astype(np.int8), s.astype(np.float32)


def quantize_int4(w, group_size):
    """w: (R, K) float -> (packed uint8 (R, K/2), multipliers uint8 (R, K/g), scales (R,))."""
    w = np.asarray(w, np.float64)
    rows, cols = w.shape
    m_max = min(INT4_MULTIPLIER_MAX, (2**31 - 1) // (127 * 8 * cols))  # spec §3 bound
    wg = w.reshape(rows, cols // group_size, group_size)
    gmax = np.abs(wg).max(axis=2)                                    # (R, groups)
    row_scale = (gmax.max(axis=1) / 7 / m_max).astype(np.float32)
    unit = np.where(row_scale > 0, row_scale, 1).astype(np.float64)[:, None]
    candidates = []
    for c in CLIP_RATIOS:
        m = np.clip(np.rint(c * gmax / 7 / unit), 1, m_max)
        candidates.append(m * unit)                                  # effective group scales
    q, eff = _best_by_error(wg, candidates, 7)
    m = np.rint(eff / unit).astype(np.uint8)
    return pack_int4(q.reshape(rows, cols).astype(np.int8)), m, row_scale


def rope_tables(max_seq_len, head_dim, theta):
    """cos, sin: (max_seq_len, head_dim/2) float32, evaluated in float64 and rounded once."""
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _linear_tensors(name, w, config):
    if config.weight_format == "int8":
        q, s = quantize_int8(w)
        return {f"{name}.w": q, f"{name}.s": s}
    packed, m, s = quantize_int4(w, config.group_size)
    return {f"{name}.w": packed, f"{name}.m": m, f"{name}.s": s}


def quantize_model(config, weights):
    """Returns (config, tensors). A tied config is untied if the final norm gain is not 1."""
    final_norm = np.asarray(weights["final_norm"], np.float64)
    if config.tied_head and not np.all(final_norm == 1):
        config = dataclasses.replace(config, tied_head=False)
    tensors = {}
    emb_q, emb_s = quantize_int8(weights["tok_emb"])
    tensors["tok_emb.w"], tensors["tok_emb.s"] = emb_q, emb_s
    tensors["rope.cos"], tensors["rope.sin"] = rope_tables(
        config.max_seq_len, config.head_dim, config.rope_theta)
    for b in config.block_prefixes():
        attn_gain = np.asarray(weights[f"{b}.attn_norm"], np.float64)[None, :]
        mlp_gain = np.asarray(weights[f"{b}.mlp_norm"], np.float64)[None, :]
        qkv = np.concatenate([weights[f"{b}.wq"], weights[f"{b}.wk"], weights[f"{b}.wv"]]) * attn_gain
        gate_up = np.concatenate([weights[f"{b}.w_gate"], weights[f"{b}.w_up"]]) * mlp_gain
        tensors.update(_linear_tensors(f"{b}.attn_qkv", qkv, config))
        tensors.update(_linear_tensors(f"{b}.attn_out", weights[f"{b}.wo"], config))
        tensors.update(_linear_tensors(f"{b}.ffn_gate_up", gate_up, config))
        tensors.update(_linear_tensors(f"{b}.ffn_down", weights[f"{b}.w_down"], config))
    if not config.tied_head:
        head = weights["tok_emb"] if "head" not in weights else weights["head"]
        tensors.update(_linear_tensors("head", np.asarray(head, np.float64) * final_norm[None, :], config))
    return config, tensors
