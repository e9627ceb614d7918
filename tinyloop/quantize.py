"""Quantizer: float weights of a looped model -> the tensors of a .tinyloop file (version 2).

Round-to-nearest with a per-row (int8) or per-group (int4) clipping search, after folding each
RMSNorm gain that feeds a linear into that linear's input columns (docs/spec.md §6.4); the
gains that cannot fold (post norms, step and coda norms) and the biases are stored as f32.

Float weights (a Mapping of numpy arrays, any float dtype, in HF (out, in) orientation; it may
be lazy, loading a value when it is looked up, e.g. memory-mapped safetensors), keyed by name:
    tok_emb (V, d); final_norm (d,); head (V, d) unless tied; rope is computed from
    config.rope_theta;
    per block prefix B of config.block_prefixes(): B.attn_norm (d,), B.wq (H*D, d),
    B.wk (G*D, d), B.wv (G*D, d), B.bq (H*D,), B.bk (G*D,), B.bv (G*D,) [qkv_bias],
    B.wo (d, H*D), B.attn_post_norm (d,) [sandwich, post], B.mlp_norm (d,), B.w_gate (F, d),
    B.w_up (F, d), B.w_down (d, F), B.ffn_post_norm (d,) [sandwich, post];
    core.adapter (d, 2d) [injection: columns 0 .. d-1 act on the state, d .. 2d-1 on e];
    core.step_norm (d,) [step_norm]; coda.input_norm (d,) [coda_norm].

Memory: one linear at a time, its float64 form only a block of rows at a time (quantization is
per row, so the blocking changes no value), so a multi-billion-parameter model quantizes in
about the size of its largest float tensor plus the output.
"""
import dataclasses

import numpy as np

from .modelfile import pack_int4

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
INT4_MULTIPLIER_MAX = 255
BLOCK_ELEMENTS = 2**20                      # float64 elements of one row block


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


def _row_blocks(w, gain):
    """(row slice, float64 rows * gain) over w (R, K) in blocks of about BLOCK_ELEMENTS."""
    rows, cols = w.shape
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        block = np.asarray(w[r:r + step], np.float64)
        yield slice(r, r + step), block if gain is None else block * gain


def quantize_int8(w, gain=None):
    """w: (R, K) float, times the column gain (K,) if given -> (int8 (R, K), f32 scales (R,))."""
    q, s = np.empty(w.shape, np.int8), np.empty(w.shape[0], np.float32)
    for rows, block in _row_blocks(w, gain):
        amax = np.abs(block).max(axis=1)
        bq, bs = _best_by_error(block, [c * amax / 127 for c in CLIP_RATIOS], 127)
        q[rows], s[rows] = bq, bs
    return q, s


def quantize_int4(w, group_size, gain=None):
    """w: (R, K) float, times the column gain (K,) if given -> (packed uint8 (R, K/2),
    multipliers uint8 (R, K/g), f32 scales (R,))."""
    rows, cols = w.shape
    m_max = min(INT4_MULTIPLIER_MAX, (2**31 - 1) // (127 * 8 * cols))  # spec §3 bound
    packed = np.empty((rows, cols // 2), np.uint8)
    mult = np.empty((rows, cols // group_size), np.uint8)
    row_scale = np.empty(rows, np.float32)
    for sl, block in _row_blocks(w, gain):
        wg = block.reshape(len(block), cols // group_size, group_size)
        gmax = np.abs(wg).max(axis=2)                                # (rows, groups)
        scale = (gmax.max(axis=1) / 7 / m_max).astype(np.float32)
        unit = np.where(scale > 0, scale, 1).astype(np.float64)[:, None]
        candidates = [np.clip(np.rint(c * gmax / 7 / unit), 1, m_max) * unit
                      for c in CLIP_RATIOS]                          # effective group scales
        q, eff = _best_by_error(wg, candidates, 7)
        packed[sl] = pack_int4(q.reshape(len(block), cols).astype(np.int8))
        mult[sl], row_scale[sl] = np.rint(eff / unit), scale
    return packed, mult, row_scale


def rope_tables(max_seq_len, head_dim, theta, inv_freq=None):
    """cos, sin: (max_seq_len, head_dim/2) float32, evaluated in float64 and rounded once;
    `inv_freq` (head_dim/2 float64 frequencies, e.g. a scaled RoPE's) replaces theta's."""
    if inv_freq is None:
        inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _linear_tensors(name, w, config, gain=None):
    if config.weight_format == "int8":
        q, s = quantize_int8(w, gain)
        return {f"{name}.w": q, f"{name}.s": s}
    packed, m, s = quantize_int4(w, config.group_size, gain)
    return {f"{name}.w": packed, f"{name}.m": m, f"{name}.s": s}


def quantize_model(config, weights, progress=None, inv_freq=None):
    """Returns (config, tensors) in the required order of §6.3; `progress(name)` (if given) is
    called as each output tensor is made. A tied config is untied if the final norm gain is
    not 1 (§6.4). `inv_freq` (D/2 float64, e.g. a scaled RoPE's) replaces the rope_theta
    frequencies of the RoPE tables (rope_tables)."""
    final_norm = np.asarray(weights["final_norm"], np.float64)
    head_key = "tok_emb" if config.tied_head else "head"       # an untied tied head: tok_emb
    if config.tied_head and not np.all(final_norm == 1):
        config = dataclasses.replace(config, tied_head=False)
    tensors = {}

    def put(parts):
        for name, array in parts.items():
            tensors[name] = array
            if progress is not None:
                progress(name)

    def linear(name, w, gain=None):
        put(_linear_tensors(name, w, config, gain))

    def vector(name, *keys):                 # f32 as stored; several keys are concatenated
        put({name: np.concatenate([np.asarray(weights[k], np.float32) for k in keys])})

    emb_q, emb_s = quantize_int8(weights["tok_emb"])
    put({"tok_emb.w": emb_q, "tok_emb.s": emb_s})
    cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta, inv_freq)
    put({"rope.cos": cos, "rope.sin": sin})
    post = config.block_layout != "pre"
    for b in config.block_prefixes():
        qkv = np.concatenate([weights[f"{b}.wq"], weights[f"{b}.wk"], weights[f"{b}.wv"]])
        linear(f"{b}.attn_qkv", qkv, np.asarray(weights[f"{b}.attn_norm"], np.float64))
        del qkv
        if config.qkv_bias:
            vector(f"{b}.attn_qkv.b", f"{b}.bq", f"{b}.bk", f"{b}.bv")
        linear(f"{b}.attn_out", weights[f"{b}.wo"])
        if post:
            vector(f"{b}.attn_post_norm", f"{b}.attn_post_norm")
        gate_up = np.concatenate([weights[f"{b}.w_gate"], weights[f"{b}.w_up"]])
        linear(f"{b}.ffn_gate_up", gate_up, np.asarray(weights[f"{b}.mlp_norm"], np.float64))
        del gate_up
        linear(f"{b}.ffn_down", weights[f"{b}.w_down"])
        if post:
            vector(f"{b}.ffn_post_norm", f"{b}.ffn_post_norm")
    if config.injection:
        adapter, d = weights["core.adapter"], config.d_model
        linear("core.adapter_state", adapter[:, :d])
        linear("core.adapter_inject", adapter[:, d:])
    if config.step_norm:
        vector("core.step_norm", "core.step_norm")
    if config.coda_norm:
        vector("coda.input_norm", "coda.input_norm")
    if not config.tied_head:
        linear("head", weights[head_key], final_norm)
    return config, tensors
