"""Calibration for GPTQ: a float64 forward of a looped model that records each linear's inputs.

Contract:
    token_windows(tokens, max_seq_len) -> (N, T) int64
        the calibration tokens cut into N windows of T = min(len, max_seq_len, WINDOW) tokens
        (a remainder shorter than T is dropped); ValueError when there are no tokens.
    forward(config, weights, windows, inv_freq=None, observe=None) -> (N, T, d) float64
        the model of docs/spec.md §1 / §4 at its default depth, in float64 without any
        quantization, over each window from position 0 with causal attention: the head's input
        (the last state, before the final norm). `observe(name, x)`, when given, is called with
        every linear's input rows (..., K) under the linear's tensor name (§6.3:
        "pre.0.attn_qkv", "core.1.ffn_down", "core.adapter_inject", "head", ...), once per
        application: a core block's linears once per iteration.
    input_grams(config, weights, windows, inv_freq=None) -> {linear name: (K, K) float64}
        sum of x^T x over every input row of every application (GPTQ's H, up to a factor).

`weights` is tinyloop.quantize's float weight mapping (HF orientation, any float dtype, may be
lazy) and `config` its ModelConfig; `inv_freq` a scaled RoPE's frequencies (quantize_model's).
The inputs are those TinyLoop's forward feeds each linear: a norm that folds into a linear
(attention, MLP and final norms, §6.4) gives the normalized row *without* its gain, which the
writer folds into the weight's columns, so the Gram matrices belong to the folded weights that
GPTQ quantizes; attn_out sees the attention output, ffn_down the SwiGLU product,
core.adapter_state the state (zero entering iteration 0, §4.4), core.adapter_inject the
prelude's output, and head the final normalized state. Every layout of the converter is
covered: pre / sandwich / post placements, q/k/v biases, GQA, injection, the step norm, the
coda and its norm, the embedding scale, HRM-Text's two-state core (its closing norms have no
gain) and attention gate (its rows are attn_qkv's, seeing the same input), IQuest-Coder
Loop's loop attention (its gates are int8 round-to-nearest, so unobserved); a head tied to the
embedding still has its Gram recorded (quantize_model uses it only when it unties the head).

Cost: one (K, K) float64 matrix per linear of the file, held together until quantization, so
8 * sum(K^2) bytes (per block d^2 + (H D)^2 + d^2 + F^2, plus d^2 per adapter half and for the
head: 12 MB for the demo model, 3.3 MB for the tiny Ouro model, about 8.5 GB for Ouro-1.4B),
plus the activations of all windows, N * T * max((H + 2G) D, 2F) float64 at a time, and one
float64 weight at a time. Compute: about 2 * N * T * (parameters applied) multiply-adds plus
the attention's 4 * N * T^2 * H * D.

Not here: GPTQ itself (quantize.py), reading and tokenizing the text (tinyloop.hf's convert),
TinyLoop's integer numerics (this forward quantizes nothing: it stands for the float model the
quantized one approximates), KV caches (each window is attended in full).
"""
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import numpy.typing as npt

from .config import ModelConfig
from .quantize import rope_angles

WINDOW = 256                     # calibration tokens per window (at most max_seq_len)
Array = npt.NDArray[np.float64]
Observer = Callable[[str, Array], None]


def token_windows(tokens: np.ndarray, max_seq_len: int) -> np.ndarray:
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    if len(tokens) == 0:
        raise ValueError("the calibration text gives no tokens")
    length = min(len(tokens), max_seq_len, WINDOW)
    n = len(tokens) // length
    return tokens[:n * length].reshape(n, length)


def input_grams(config: ModelConfig, weights: Mapping[str, np.ndarray], windows: np.ndarray,
                inv_freq: Optional[np.ndarray] = None) -> Dict[str, Array]:
    grams: Dict[str, Array] = {}

    def observe(name: str, x: Array) -> None:
        rows = x.reshape(-1, x.shape[-1])
        gram = rows.T @ rows
        if name in grams:
            grams[name] += gram
        else:
            grams[name] = gram

    forward(config, weights, windows, inv_freq, observe)
    return grams


def forward(config: ModelConfig, weights: Mapping[str, np.ndarray], windows: np.ndarray,
            inv_freq: Optional[np.ndarray] = None, observe: Optional[Observer] = None
            ) -> Array:
    run = _Forward(config, weights, windows.shape[1], inv_freq,
                   observe if observe is not None else lambda name, x: None)
    x: Array = _f64(weights["tok_emb"])[np.asarray(windows)] * config.embed_scale
    for b in range(config.n_pre_blocks):
        x = run.block(f"pre.{b}", x)
    e = x
    if config.core_cycles:
        x = _two_state_core(config, run, x)
    elif config.injection:
        x = np.zeros_like(e)
    for i in range(0 if config.core_cycles else config.default_loops):
        if config.step_norm and i >= 1:
            x = run.norm(x, "core.step_norm")
        if config.injection:
            adapter = _f64(weights["core.adapter"])
            x = (run.linear("core.adapter_state", x, adapter[:, :config.d_model])
                 + run.linear("core.adapter_inject", e, adapter[:, config.d_model:]))
        for j in range(config.n_core_blocks):
            x = run.block(f"core.{j}", x, iteration=i)
    if config.coda_norm:
        x = run.norm(x, "coda.input_norm")
    for c in range(config.n_coda_blocks):
        x = run.block(f"coda.{c}", x)
    run.observe("head", _normalize(x, config.rms_eps))
    return x


def _two_state_core(config: ModelConfig, run: "_Forward", high: Array) -> Array:
    """A two-state core's iterations (docs/spec.md §1) from the high state `high`; returns the
    last high state."""
    n = config.n_core_blocks // 2
    low = np.zeros_like(high)
    for _ in range(config.default_loops):
        for c in range(config.core_cycles + 1):
            y = low + high
            for j in range(n) if c < config.core_cycles else range(n, 2 * n):
                y = run.block(f"core.{j}", y)
            if c < config.core_cycles:
                low = _normalize(y, config.rms_eps)
            else:
                high = _normalize(y, config.rms_eps)
    return high


def _f64(a: np.ndarray) -> Array:
    return np.asarray(a, np.float64)


def _normalize(x: Array, eps: float) -> Array:
    """RMSNorm without a gain: x / sqrt(mean(x^2) + eps) per row."""
    rms: Array = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / rms


def _silu(v: Array) -> Array:
    return v / (1.0 + np.exp(-v))


class _Forward:
    """The pieces of the float forward for one config, weights and window length."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], length: int,
                 inv_freq: Optional[np.ndarray], observe: Observer) -> None:
        self.c, self.w, self.observe = config, weights, observe
        self.first_kv: Dict[str, Tuple[Array, Array]] = {}   # loop attention: iteration 0's k, v
        angles = rope_angles(length, config.head_dim, config.rope_theta, inv_freq)
        self.cos, self.sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def linear(self, name: str, x: Array, w: Array, gain: Optional[Array] = None) -> Array:
        """x @ (w * gain).T, observed under `name` as x (the gain folded into w)."""
        self.observe(name, x)
        return x @ (w if gain is None else w * gain).T

    def norm(self, x: Array, gain_name: str) -> Array:
        return _normalize(x, self.c.rms_eps) * _f64(self.w[gain_name])

    def residual(self, x: Array, y: Array, gain_name: str) -> Array:
        layout = self.c.block_layout
        if layout == "pre":
            return x + y
        if layout == "sandwich":
            return x + self.norm(y, gain_name)
        return self.norm(x + y, gain_name)                                   # post

    def block(self, b: str, x: Array, iteration: int = 0) -> Array:
        """Block `b` on x (N, T, d); a core block in `iteration` (loop attention's)."""
        c, w = self.c, self.w
        H, G, D, F = c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
        parts = "qkvg" if c.attn_gate else "qkv"          # attn_qkv's rows (§6.3)
        qkv_w = np.concatenate([_f64(w[f"{b}.w{part}"]) for part in parts])
        z = self.linear(f"{b}.attn_qkv", _normalize(x, c.rms_eps), qkv_w,
                        _f64(w[f"{b}.attn_norm"]))
        if c.qkv_bias:
            z = z + np.concatenate([_f64(w[f"{b}.b{part}"]) for part in parts])
        n, t = x.shape[:2]
        q = self.rope(z[..., :H * D].reshape(n, t, H, D))
        k = self.rope(z[..., H * D:(H + G) * D].reshape(n, t, G, D))
        v = z[..., (H + G) * D:(H + 2 * G) * D].reshape(n, t, G, D)
        o = self.loop_attention(b, q, k, v, iteration) if c.loop_window and b.startswith(
            "core.") else self.attention(q, k, v)
        if c.attn_gate:                                    # o * sigmoid(gate) (§4)
            o = o / (1.0 + np.exp(-z[..., (H + 2 * G) * D:]))
        x = self.residual(x, self.linear(f"{b}.attn_out", o, _f64(w[f"{b}.wo"])),
                          f"{b}.attn_post_norm")
        gate_up = np.concatenate([_f64(w[f"{b}.w_gate"]), _f64(w[f"{b}.w_up"])])
        gu = self.linear(f"{b}.ffn_gate_up", _normalize(x, c.rms_eps), gate_up,
                         _f64(w[f"{b}.mlp_norm"]))
        hh = _silu(gu[..., :F]) * gu[..., F:]
        return self.residual(x, self.linear(f"{b}.ffn_down", hh, _f64(w[f"{b}.w_down"])),
                             f"{b}.ffn_post_norm")

    def rope(self, x: Array) -> Array:
        """Rotate-half RoPE (§2.6) of x (N, T, heads, D) at positions 0 .. T-1."""
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * self.cos - b * self.sin, b * self.cos + a * self.sin], -1)

    def loop_attention(self, b: str, q: Array, k: Array, v: Array, iteration: int) -> Array:
        """Loop attention (§4) of core block b: iteration 0 attends as any layer and keeps its
        k, v; a later one mixes the attention over those (global) with its own through the loop
        window (local) by sigmoid(gate_h . q_h + bias_h) per head."""
        if iteration == 0:
            self.first_kv[b] = k, v
            return self.attention(q, k, v)
        logit = np.einsum("nthd,hd->nth", q, _f64(self.w[f"{b}.loop_gate"]))
        gate = np.repeat(1.0 / (1.0 + np.exp(-(logit + _f64(self.w[f"{b}.loop_gate_bias"])))),
                         q.shape[-1], axis=-1)                      # (N, T, H * D)
        local = self.attention(q, k, v, self.c.loop_window)
        return gate * self.attention(q, *self.first_kv[b]) + (1 - gate) * local

    def attention(self, q: Array, k: Array, v: Array, window: int = 0) -> Array:
        """Causal softmax attention, q (N, T, H, D), k, v (N, T, G, D) -> (N, T, H * D), one
        window at a time (T^2 * H scores held); a query at t sees keys j > t - window when
        window > 0."""
        n, t, H, D = q.shape
        G = k.shape[2]
        visible = np.tril(np.ones((t, t), bool))
        if window:
            visible &= np.arange(t)[None, :] > np.arange(t)[:, None] - window
        out = np.empty((n, t, H, D))
        for i in range(n):
            qi = q[i].reshape(t, G, H // G, D)
            scores = np.einsum("tgrd,sgd->grts", qi, k[i]) / np.sqrt(D)
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[i] = np.einsum("grts,sgd->tgrd", p, v[i]).reshape(t, H, D)
        return out.reshape(n, t, H * D)
