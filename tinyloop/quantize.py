"""Quantizer: float weights of a looped model -> the tensors of a .tinyloop file (version 3).

Round-to-nearest with a per-row (int8) or per-group (int4) clipping search, after folding each
RMSNorm gain that feeds a linear into that linear's input columns (docs/spec.md §6.4); the
gains that cannot fold (post norms, step and coda norms) and the biases are stored as f32. The
exit gate (§5.7), which reads the final norm's output as the head does, is int8 whatever the
weight format: one row with the final norm gain folded in, its scale and bias f32; so are loop
attention's gates (§4), a row per head over the head's query.

GPTQ (Frantar et al. 2022) for int4, when the linear's input Gram matrix H = X^T X is given
(tinyloop.calibrate.input_grams): the columns are quantized in order, each one's rounding error
spread over the columns not yet quantized through the Cholesky factor of the dampened H^-1, so
the output error ||(W - Q) X|| shrinks rather than each weight's own error. Each group's scale
is chosen (by the same clipping search, on the same multiplier grid m * ws) when GPTQ reaches
the group, from the error-updated weights; the format is the RTN one, so every backend runs it.

Float weights (a Mapping of numpy arrays, any float dtype, in HF (out, in) orientation; it may
be lazy, loading a value when it is looked up, e.g. memory-mapped safetensors), keyed by name:
    tok_emb (V, d); final_norm (d,); head (V, d) unless tied; rope is computed from
    config.rope_theta;
    per block prefix B of config.block_prefixes(): B.attn_norm (d,), B.wq (H*D, d),
    B.wk (G*D, d), B.wv (G*D, d), B.wg (H*D, d) [attn_gate], B.bq (H*D,), B.bk (G*D,),
    B.bv (G*D,), B.bg (H*D,) [attn_gate] [qkv_bias],
    B.wo (d, H*D), B.attn_post_norm (d,) [sandwich, post], B.mlp_norm (d,), B.w_gate (F, d),
    B.w_up (F, d), B.w_down (d, F), B.ffn_post_norm (d,) [sandwich, post];
    core.adapter (d, 2d) [injection: columns 0 .. d-1 act on the state, d .. 2d-1 on e];
    core.step_norm (d,) [step_norm]; coda.input_norm (d,) [coda_norm];
    core.J.loop_gate (H, D), core.J.loop_gate_bias (H,) [loop_window: core blocks J];
    exit_gate (1, d), exit_gate_bias (1,) [exit_gate].

Memory: one linear at a time, its float64 form only a block of rows at a time (quantization is
per row, GPTQ's updates included, so the blocking changes no value), so a multi-billion-parameter
model quantizes in about the size of its largest float tensor plus the output; GPTQ adds its
K x K float64 factor (K the linear's input width) per linear.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from .config import ModelConfig
from .modelfile import pack_int4

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
INT4_MULTIPLIER_MAX = 255
BLOCK_ELEMENTS = 2**20                      # float64 elements of one row block
GPTQ_DAMPING = 0.01                         # added to H's diagonal, times its mean
GPTQ_BATCH_COLUMNS = 128                    # lazy batch: columns whose updates are deferred


def _best_by_error(w: np.ndarray, scales_per_ratio: Iterable[np.ndarray],
                   qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Pick, per row of w (..., n), the candidate scale with the least squared error."""
    best_q, best_s, best_err = None, None, None
    for scale in scales_per_ratio:                           # scale: (...,) float64
        safe = np.where(scale > 0, scale, 1.0)[..., None]
        q = np.clip(np.rint(w / safe), -qmax, qmax)
        err = ((q * scale[..., None] - w) ** 2).sum(axis=-1)
        if best_err is None:
            best_q, best_s, best_err = q, scale.copy(), err
        else:
            assert best_q is not None and best_s is not None    # set with best_err
            better = err < best_err
            best_q = np.where(better[..., None], q, best_q)
            best_s = np.where(better, scale, best_s)
            best_err = np.where(better, err, best_err)
    assert best_q is not None and best_s is not None    # scales_per_ratio is never empty
    return best_q, best_s


def _row_blocks(w: np.ndarray, gain: np.ndarray | None) -> Iterator[tuple[slice, np.ndarray]]:
    """(row slice, float64 rows * gain) over w (R, K) in blocks of about BLOCK_ELEMENTS."""
    rows, cols = w.shape
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        block = np.asarray(w[r:r + step], np.float64)
        yield slice(r, r + step), block if gain is None else block * gain


def quantize_int8(w: np.ndarray, gain: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w: (R, K) float, times the column gain (K,) if given -> (int8 (R, K), f32 scales (R,))."""
    q, s = np.empty(w.shape, np.int8), np.empty(w.shape[0], np.float32)
    for rows, block in _row_blocks(w, gain):
        amax = np.abs(block).max(axis=1)
        bq, bs = _best_by_error(block, [c * amax / 127 for c in CLIP_RATIOS], 127)
        q[rows], s[rows] = bq, bs
    return q, s


def quantize_int4(w: np.ndarray, group_size: int, gain: np.ndarray | None = None,
                  hessian: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w: (R, K) float, times the column gain (K,) if given -> (packed uint8 (R, K/2),
    multipliers uint8 (R, K/g), f32 scales (R,)); by GPTQ when `hessian`, the (K, K) Gram
    matrix of the linear's inputs (gain not applied: the gain is folded into w), is given."""
    rows, cols = w.shape
    m_max = min(INT4_MULTIPLIER_MAX, (2**31 - 1) // (127 * 8 * cols))  # spec §3 bound
    factor = None if hessian is None else _gptq_factor(hessian, cols)
    packed = np.empty((rows, cols // 2), np.uint8)
    mult = np.empty((rows, cols // group_size), np.uint8)
    row_scale = np.empty(rows, np.float32)
    for sl, block in _row_blocks(w, gain):
        scale = (np.abs(block).max(axis=1) / 7 / m_max).astype(np.float32)
        unit = np.where(scale > 0, scale, 1).astype(np.float64)[:, None]
        if factor is None:
            wg = block.reshape(len(block), cols // group_size, group_size)
            q, eff = _group_scales(wg, unit, m_max)
        else:
            q, eff = _gptq(block, factor, group_size, unit, m_max)
        packed[sl] = pack_int4(q.reshape(len(block), cols).astype(np.int8))
        mult[sl], row_scale[sl] = np.rint(eff / unit), scale
    return packed, mult, row_scale


def _group_scales(wg: np.ndarray, unit: np.ndarray, m_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, effective scales m * unit) of the groups wg (rows, groups, gs): per group, the
    clipping ratio whose multiplier m in 1 .. m_max (of the row's unit (rows, 1)) rounds the
    group with the least squared error."""
    gmax = np.abs(wg).max(axis=2)                                # (rows, groups)
    candidates = [np.clip(np.rint(c * gmax / 7 / unit), 1, m_max) * unit
                  for c in CLIP_RATIOS]                          # effective group scales
    return _best_by_error(wg, candidates, 7)


def _gptq_factor(hessian: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead) for GPTQ: U the upper Cholesky factor of the inverse of the Gram matrix H
    (cols, cols) dampened by GPTQ_DAMPING of its mean diagonal (H^-1 = U^T U); `dead` marks
    the inputs that were always zero (their weights are set to zero, their diagonal to 1)."""
    h = np.array(hessian, np.float64)
    if h.shape != (cols, cols):
        raise ValueError(f"the GPTQ Hessian must be square, ({cols}, {cols}) for a linear of "
                         f"{cols} inputs, got shape {h.shape}")
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += GPTQ_DAMPING * np.mean(np.diag(h))
    try:
        lower = np.linalg.cholesky(np.linalg.inv(h))
    except np.linalg.LinAlgError:
        raise ValueError("the GPTQ Hessian is not positive definite after dampening") from None
    return lower.T, dead


def _gptq(block: np.ndarray, factor: tuple[np.ndarray, np.ndarray], group_size: int,
          unit: np.ndarray, m_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(q (rows, K), effective group scales (rows, K/g)) of the float64 rows `block` by GPTQ:
    columns in natural order, in lazy batches of whole groups; each group's scale is picked
    (_group_scales) from the error-updated weights when its first column comes up."""
    u, dead = factor
    w = block.copy()
    w[:, dead] = 0.0
    rows, cols = w.shape
    q = np.empty_like(w)
    eff = np.empty((rows, cols // group_size))
    batch = group_size * max(1, GPTQ_BATCH_COLUMNS // group_size)
    for c0 in range(0, cols, batch):
        c1 = min(c0 + batch, cols)
        err = np.empty((rows, c1 - c0))
        for c in range(c0, c1):
            g = c // group_size
            if c % group_size == 0:
                eff[:, g] = _group_scales(w[:, None, c:c + group_size], unit, m_max)[1][:, 0]
            q[:, c] = np.clip(np.rint(w[:, c] / eff[:, g]), -7, 7)
            err[:, c - c0] = (w[:, c] - q[:, c] * eff[:, g]) / u[c, c]
            w[:, c + 1:c1] -= np.outer(err[:, c - c0], u[c, c + 1:c1])
        w[:, c1:] -= err @ u[c0:c1, c1:]
    return q, eff


def rope_angles(max_seq_len: int, head_dim: int, theta: float,
                inv_freq: np.ndarray | None = None) -> np.ndarray:
    """The RoPE angles p * freq_i, (max_seq_len, head_dim/2) float64; `inv_freq` (head_dim/2
    float64 frequencies, e.g. a scaled RoPE's) replaces theta's."""
    if inv_freq is None:
        inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]


def rope_tables(max_seq_len: int, head_dim: int, theta: float,
                inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: (max_seq_len, head_dim/2) float32 of rope_angles, evaluated in float64 and
    rounded once."""
    angles = rope_angles(max_seq_len, head_dim, theta, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _linear_tensors(name: str, w: np.ndarray, config: ModelConfig, gain: np.ndarray | None = None,
                    hessian: np.ndarray | None = None) -> dict[str, np.ndarray]:
    if config.weight_format == "int8":
        q, s = quantize_int8(w, gain)
        return {f"{name}.w": q, f"{name}.s": s}
    packed, m, s = quantize_int4(w, config.group_size, gain, hessian)
    return {f"{name}.w": packed, f"{name}.m": m, f"{name}.s": s}


def quantize_model(config: ModelConfig, weights: Mapping[str, np.ndarray],
                   progress: Callable[[str], None] | None = None,
                   inv_freq: np.ndarray | None = None,
                   hessians: Mapping[str, np.ndarray] | None = None
                   ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Returns (config, tensors) in the required order of §6.3; `progress(name)` (if given) is
    called as each output tensor is made. A tied config is untied if the final norm gain is
    not 1 (§6.4). `inv_freq` (D/2 float64, e.g. a scaled RoPE's) replaces the rope_theta
    frequencies of the RoPE tables (rope_tables). `hessians` (int4 only): the input Gram
    matrix of each linear by its name ("core.0.attn_qkv", "head", ...;
    tinyloop.calibrate.input_grams); the linears it names are quantized by GPTQ. The embedding
    (and so a tied head) and the exit gate stay int8 round-to-nearest."""
    if hessians is not None and config.weight_format != "int4":
        raise ValueError(f"GPTQ applies to int4 weights only, not {config.weight_format}")
    hessians = {} if hessians is None else hessians
    final_norm = np.asarray(weights["final_norm"], np.float64)
    head_key = "tok_emb" if config.tied_head else "head"       # an untied tied head: tok_emb
    if config.tied_head and not np.all(final_norm == 1):
        config = dataclasses.replace(config, tied_head=False)
    tensors: dict[str, np.ndarray] = {}

    def put(parts: Mapping[str, np.ndarray]) -> None:
        for name, array in parts.items():
            tensors[name] = array
            if progress is not None:
                progress(name)

    def linear(name: str, w: np.ndarray, gain: np.ndarray | None = None) -> None:
        put(_linear_tensors(name, w, config, gain, hessians.get(name)))

    def vector(name: str, *keys: str) -> None:   # f32 as stored; several keys are concatenated
        put({name: np.concatenate([np.asarray(weights[k], np.float32) for k in keys])})

    emb_q, emb_s = quantize_int8(weights["tok_emb"])
    put({"tok_emb.w": emb_q, "tok_emb.s": emb_s})
    cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta, inv_freq)
    put({"rope.cos": cos, "rope.sin": sin})
    post = config.block_layout != "pre"
    for b in config.block_prefixes():
        parts = "qkvg" if config.attn_gate else "qkv"      # attn_qkv's rows (§6.3)
        qkv = np.concatenate([weights[f"{b}.w{p}"] for p in parts])
        linear(f"{b}.attn_qkv", qkv, np.asarray(weights[f"{b}.attn_norm"], np.float64))
        del qkv
        if config.qkv_bias:
            vector(f"{b}.attn_qkv.b", *(f"{b}.b{p}" for p in parts))
        linear(f"{b}.attn_out", weights[f"{b}.wo"])
        if post:
            vector(f"{b}.attn_post_norm", f"{b}.attn_post_norm")
        gate_up = np.concatenate([weights[f"{b}.w_gate"], weights[f"{b}.w_up"]])
        linear(f"{b}.ffn_gate_up", gate_up, np.asarray(weights[f"{b}.mlp_norm"], np.float64))
        del gate_up
        linear(f"{b}.ffn_down", weights[f"{b}.w_down"])
        if post:
            vector(f"{b}.ffn_post_norm", f"{b}.ffn_post_norm")
        if config.loop_window and b.startswith("core."):
            gate_q, gate_s = quantize_int8(weights[f"{b}.loop_gate"])
            put({f"{b}.loop_gate.w": gate_q, f"{b}.loop_gate.s": gate_s})
            vector(f"{b}.loop_gate.b", f"{b}.loop_gate_bias")
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
    if config.exit_gate:
        gate_q, gate_s = quantize_int8(weights["exit_gate"], final_norm)
        put({"exit_gate.w": gate_q, "exit_gate.s": gate_s})
        vector("exit_gate.b", "exit_gate_bias")
    return config, tensors
