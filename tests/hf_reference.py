"""Float64 references of the published looped layouts, and tiny random checkpoints of them.

Written from the published model code's description (Ouro's `modeling_ouro.py`, Huginn's
`raven_modeling_minimal.py`, Nanbeige's `modeling_nanbeige.py`, the retrofitted-recurrence
Llama's `raven_modeling_minimal_llama.py` from github.com/LoopedLMs/retrofitting-recurrence at
e21042a6, HRM-Text's `modeling_hrm_text.py` in transformers 5.23.0, IQuest-Coder Loop's
`iquest_loopcoder.py` in vLLM 0.32.0), not from any TinyLoop
backend, so a converter or backend that misreads a layout
disagrees with them. Each `*_logits` takes a checkpoint's tensors by their Hugging Face names
and its `config.json` dict and returns float64 logits (n, V) for a token list, attending
causally over the whole list (no KV cache: one slot per (pass, layer) is what full-sequence
attention computes anyway); the recurrent ones take `steps`, the depth (default the config's).
transformers itself stands for the LLaMA family (tests/test_hf_fidelity.py). Ouro's early-exit
readout (its exit gate's per-step λ, the exit CDF, the exit step for a threshold and its logits)
is `ouro_exit`, on `ouro_states`, the per-step normed states.

Tiny random checkpoints of these layouts come from tests/hf_folders.py.
"""
import math
from typing import NamedTuple

import numpy as np

from hf_folders import RETROFIT_LLAMA


# ---- the float64 pieces -----------------------------------------------------------------

def rms_norm(x, gain, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def silu(v):
    return v / (1.0 + np.exp(-v))


def inverse_frequencies(head_dim, theta):
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_inverse_frequencies(theta, head_dim, factor, low_freq_factor, high_freq_factor,
                               original_max_position_embeddings):
    """transformers' _compute_llama3_parameters, restated in float64: wavelengths longer than
    original / low are slowed by `factor`, shorter than original / high kept, and those between
    blended by how many of them fit in the original context."""
    inv = inverse_frequencies(head_dim, theta)
    original = original_max_position_embeddings
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def rope_rotate_half(x, theta, inv_freq=None):
    """x: (n, heads, D) at positions 0 .. n-1; pairs (i, i + D/2); frequencies `inv_freq`
    (default theta's)."""
    n, D = x.shape[0], x.shape[-1]
    if inv_freq is None:
        inv_freq = inverse_frequencies(D, theta)
    angle = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def rope_interleaved(x, theta):
    """x: (n, heads, D); pairs (2i, 2i + 1), as a complex multiplication."""
    n, D = x.shape[0], x.shape[-1]
    angle = np.arange(n, dtype=np.float64)[:, None] * inverse_frequencies(D, theta)[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def causal_attention(q, k, v, instruction=0, window=0):
    """q: (n, H, D), k, v: (n, G, D) -> (n, H * D), softmax(q k^T / sqrt(D)) v per head; causal,
    except that positions 0 .. instruction-1 see each other (transformers' blockwise overlay of
    HRM-Text's token_type_ids 1: the mask is causal OR both in the block); with a window W > 0
    a query at t sees only keys j > t - W (vLLM's sliding_window: W keys, itself included)."""
    n, H, D = q.shape
    G = k.shape[1]
    k, v = np.repeat(k, H // G, axis=1), np.repeat(v, H // G, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
    block = np.arange(n) < instruction
    visible = np.tril(np.ones((n, n), bool)) | (block[:, None] & block[None, :])
    if window:
        visible &= np.arange(n)[None, :] > np.arange(n)[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(n, H * D)


def swiglu(x, w_gate, w_up, w_down):
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# ---- LLaMA-style projections (Ouro and Nanbeige share the names) -----------------------

def _llama_attention(t, p, x, cfg):
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    n = len(x)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, H, D)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, G, D)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, G, D)
    theta = cfg.get("rope_theta", 10000.0)
    o = causal_attention(rope_rotate_half(q, theta), rope_rotate_half(k, theta), v)
    return o @ t[p + "self_attn.o_proj.weight"].T


def _llama_mlp(t, p, x):
    return swiglu(x, t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"],
                  t[p + "mlp.down_proj.weight"])


def _embed_and_head(t):
    return t["model.embed_tokens.weight"], t.get("lm_head.weight", t["model.embed_tokens.weight"])


def ouro_states(t, cfg, tokens, steps=None):
    """OuroModel.forward's hidden_states_list: the state after each of `steps` (default
    total_ut_steps) passes of every layer, each normed by model.norm, the normed state feeding
    the next pass. Sandwich layers (each sublayer's output normed before the residual add).
    A list of `steps` (n, d) float64 arrays."""
    eps = cfg["rms_norm_eps"]
    x = _embed_and_head(t)[0][np.asarray(tokens)]
    states = []
    for _ in range(cfg["total_ut_steps"] if steps is None else steps):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            y = _llama_attention(t, p, rms_norm(x, t[p + "input_layernorm.weight"], eps), cfg)
            x = x + rms_norm(y, t[p + "input_layernorm_2.weight"], eps)
            y = _llama_mlp(t, p, rms_norm(x, t[p + "post_attention_layernorm.weight"], eps))
            x = x + rms_norm(y, t[p + "post_attention_layernorm_2.weight"], eps)
        x = rms_norm(x, t["model.norm.weight"], eps)
        states.append(x)
    return states


def ouro_logits(t, cfg, tokens, steps=None):
    """lm_head on the last pass's normed state (ouro_states): Ouro's readout with no exit
    step or threshold."""
    return ouro_states(t, cfg, tokens, steps)[-1] @ _embed_and_head(t)[1].T


class OuroExit(NamedTuple):
    """ouro_exit's readout, per position (n tokens, T steps)."""
    gates: np.ndarray       # (n, T) λ_t = sigmoid(early_exit_gate(state_t)), every step's
    cdf: np.ndarray         # (n, T) the exit distribution's CDF; the last step takes the rest
    exit_step: np.ndarray   # (n,) int, 0-based: the first step whose CDF >= q, else the last
    logits: np.ndarray      # (n, V) lm_head of the exit step's normed state


def ouro_exit(t, cfg, tokens, threshold, steps=None):
    """OuroForCausalLM.forward's threshold readout (no labels, exit_threshold = `threshold`):
    every pass runs for every position (ouro_states); each pass's normed state is scored by
    early_exit_gate, λ_t = sigmoid(score); the pdf is p_t = λ_t r_t with r_0 = 1,
    r_{t+1} = r_t (1 - λ_t) for t < T-1, and p_{T-1} = r_{T-1} (the last step takes the rest,
    its own λ unused); the CDF its cumulative sum; the exit step the first t with
    CDF_t >= threshold, the last step where none reaches it; the logits lm_head of that
    step's normed state."""
    states = ouro_states(t, cfg, tokens, steps)
    w, b = t["model.early_exit_gate.weight"][0], t["model.early_exit_gate.bias"][0]
    gates = np.stack([1.0 / (1.0 + np.exp(-(x @ w + b))) for x in states], axis=1)
    pdf, remaining = np.empty_like(gates), np.ones(len(gates))
    for i in range(gates.shape[1]):
        if i < gates.shape[1] - 1:
            pdf[:, i] = gates[:, i] * remaining
            remaining = remaining * (1.0 - gates[:, i])
        else:
            pdf[:, i] = remaining
    cdf = np.cumsum(pdf, axis=1)
    reached = cdf >= threshold
    exit_step = np.where(reached.any(axis=1), np.argmax(reached, axis=1), gates.shape[1] - 1)
    chosen = np.stack(states, axis=1)[np.arange(len(gates)), exit_step]
    return OuroExit(gates, cdf, exit_step, chosen @ _embed_and_head(t)[1].T)


def nanbeige_loops(cfg):
    """How many loops the forward runs (`_get_num_loops`): one more than there are
    loop_loss_weights when that list is non-empty, else num_loops (1 when absent)."""
    weights = cfg.get("loop_loss_weights") or []
    return len(weights) + 1 if len(weights) > 0 else cfg.get("num_loops", 1)


def nanbeige_logits(t, cfg, tokens):
    """Pre-norm LLaMA layers run nanbeige_loops(cfg) times, model.norm between loops (unless
    skip_loop_final_norm) and once at the end."""
    eps = cfg["rms_norm_eps"]
    emb, head = _embed_and_head(t)
    x = emb[np.asarray(tokens)]
    loops = nanbeige_loops(cfg)
    for loop in range(loops):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + _llama_attention(t, p, rms_norm(x, t[p + "input_layernorm.weight"], eps), cfg)
            x = x + _llama_mlp(t, p, rms_norm(x, t[p + "post_attention_layernorm.weight"], eps))
        if loop < loops - 1 and not cfg.get("skip_loop_final_norm", False):
            x = rms_norm(x, t["model.norm.weight"], eps)
    return rms_norm(x, t["model.norm.weight"], eps) @ head.T


# ---- RavenForCausalLM: Huginn-0125 and the retrofitted-recurrence Llama -------------------

def _raven_attention(t, p, h, cfg, rope):
    """CausalSelfAttention: Wqkv rows [q; k; v] of n_heads, num_key_value_heads and
    num_key_value_heads heads of n_embd // n_heads, q and k plus qk_bias (2, 1, H, D) when
    qk_bias, `rope` on q and k, causal attention (kv head h // (H / G)), proj."""
    d, H = cfg["n_embd"], cfg["n_heads"]
    G = cfg.get("num_key_value_heads", H)
    D, n = d // H, len(h)
    q, k, v = np.split(h @ t[p + "attn.Wqkv.weight"].T, [H * D, (H + G) * D], axis=-1)
    q, k, v = q.reshape(n, H, D), k.reshape(n, G, D), v.reshape(n, G, D)
    if cfg.get("qk_bias", True):
        bias = t[p + "attn.qk_bias"]
        q, k = q + bias[0, 0], k + bias[1, 0]
    return causal_attention(rope(q), rope(k), v) @ t[p + "attn.proj.weight"].T


def _raven_mlp(t, p, h):
    """GatedMLP: fc rows [gate; up], silu(gate) * up, proj."""
    gate, up = np.split(h @ t[p + "mlp.fc.weight"].T, 2, axis=-1)
    return (silu(gate) * up) @ t[p + "mlp.proj.weight"].T


def _huginn_block(t, p, x, cfg):
    """Post-residual norms: x = norm_2(x + attn(norm_1(x))), x = norm_4(x + mlp(norm_3(x)));
    interleaved-pair RoPE of rope_base."""
    eps = cfg["norm_eps"]

    def rope(v):
        return rope_interleaved(v, cfg["rope_base"])

    y = _raven_attention(t, p, rms_norm(x, t[p + "norm_1.weight"], eps), cfg, rope)
    x = rms_norm(x + y, t[p + "norm_2.weight"], eps)
    y = _raven_mlp(t, p, rms_norm(x, t[p + "norm_3.weight"], eps))
    return rms_norm(x + y, t[p + "norm_4.weight"], eps)


def _retrofit_block(t, p, x, cfg):
    """raven_modeling_minimal_llama.py's SandwichBlock, a LLaMA layer: x = x + attn(norm_1(x)),
    x = x + mlp(norm_2(x)); transformers' LlamaRotaryEmbedding (rotate-half) of rope_theta with
    rope_scaling (llama3) over head_dim."""
    eps, D = cfg["norm_eps"], cfg.get("head_dim") or cfg["n_embd"] // cfg["n_heads"]
    scaling = cfg.get("rope_scaling") or {"rope_type": "default"}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = llama3_inverse_frequencies(cfg["rope_theta"], D, scaling["factor"],
                                              scaling["low_freq_factor"],
                                              scaling["high_freq_factor"],
                                              scaling["original_max_position_embeddings"])
    else:
        assert scaling.get("rope_type", scaling.get("type")) == "default", scaling
        inv_freq = inverse_frequencies(D, cfg["rope_theta"])

    def rope(v):
        return rope_rotate_half(v, None, inv_freq)

    x = x + _raven_attention(t, p, rms_norm(x, t[p + "norm_1.weight"], eps), cfg, rope)
    return x + _raven_mlp(t, p, rms_norm(x, t[p + "norm_2.weight"], eps))


def _raven_logits(t, cfg, tokens, steps, block, ln_f_before_coda):
    """The embedding times init_values.embed_scale (RavenConfig derives sqrt(n_embd) when the
    config does not say), the prelude, then `steps` (default mean_recurrence) iterations of
    adapter([state, e]) and the core blocks from a zero state (the reference draws it at random,
    truncated normal times init_scale: init_scale = 0 gives TinyLoop's zeros), [ln_f], the coda,
    ln_f, lm_head (the embedding when tied)."""
    eps = cfg["norm_eps"]
    wte = t["transformer.wte.weight"]
    embed_scale = (cfg.get("init_values") or {}).get("embed_scale", math.sqrt(cfg["n_embd"]))
    x = wte[np.asarray(tokens)] * embed_scale
    for i in range(cfg["n_layers_in_prelude"]):
        x = block(t, f"transformer.prelude.{i}.", x, cfg)
    e, x = x, np.zeros_like(x)
    for _ in range(cfg["mean_recurrence"] if steps is None else steps):
        x = np.concatenate([x, e], axis=-1) @ t["transformer.adapter.weight"].T
        for j in range(cfg["n_layers_in_recurrent_block"]):
            x = block(t, f"transformer.core_block.{j}.", x, cfg)
    if ln_f_before_coda:
        x = rms_norm(x, t["transformer.ln_f.weight"], eps)
    for c in range(cfg["n_layers_in_coda"]):
        x = block(t, f"transformer.coda.{c}.", x, cfg)
    x = rms_norm(x, t["transformer.ln_f.weight"], eps)
    return x @ t.get("lm_head.weight", wte).T


def huginn_logits(t, cfg, tokens, steps=None):
    """Huginn-0125: post-norm blocks, ln_f before the coda (and again before the head)."""
    return _raven_logits(t, cfg, tokens, steps, _huginn_block, ln_f_before_coda=True)


def retrofit_llama_logits(t, cfg, tokens, steps=None):
    """A retrofitted-recurrence Llama: LLaMA layers, nothing between the core and the coda."""
    return _raven_logits(t, cfg, tokens, steps, _retrofit_block, ln_f_before_coda=False)


# ---- HRM-Text (transformers' models/hrm_text/modeling_hrm_text.py, 5.23.0) --------------

def weightless_norm(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _hrm_layer(t, p, x, cfg, instruction):
    """HrmTextDecoderLayer, from the checkpoint's fused tensors (transformers' conversion
    mapping splits `attn.gqkv_proj` into gate, q, k, v and `mlp.gate_up_proj` into gate, up):
    pre-norm (weightless) attention with a sigmoid gate on its output, then a pre-norm SwiGLU
    MLP; multi-head (k and v have every head); the first `instruction` positions attend to
    each other (the prefix-LM mask)."""
    H, D, eps = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    n = len(x)
    h = weightless_norm(x, eps)
    g, q, k, v = (z.reshape(n, H, D)
                  for z in np.split(h @ t[p + "attn.gqkv_proj.weight"].T, 4, axis=1))
    o = causal_attention(rope_rotate_half(q, theta), rope_rotate_half(k, theta), v, instruction)
    o = o * (1.0 / (1.0 + np.exp(-g.reshape(n, H * D))))
    x = x + o @ t[p + "attn.o_proj.weight"].T
    gate, up = np.split(t[p + "mlp.gate_up_proj.weight"], 2)
    return x + swiglu(weightless_norm(x, eps), gate, up, t[p + "mlp.down_proj.weight"])


def _hrm_stack(t, stack, x, cfg, instruction):
    """HrmTextStack: its layers, then its weightless final_norm."""
    for j in range(cfg["num_layers_per_stack"]):
        x = _hrm_layer(t, f"model.{stack}.layers.{j}.", x, cfg, instruction)
    return weightless_norm(x, cfg["rms_norm_eps"])


def hrm_text_logits(t, cfg, tokens, steps=None, instruction=0):
    """HrmTextModel.forward, with the causal mask or (instruction > 0, prefix_lm) the prefix-LM
    one of token_type_ids 1 on the first `instruction` tokens: the high state starts at
    the embedding times embedding_scale, the low one at z_L_init; each of `steps` (default
    H_cycles) high cycles runs the L stack L_cycles times on low + high, then the H stack on
    high + low; lm_head reads the last high state."""
    x = t["model.embed_tokens.weight"][np.asarray(tokens)] * cfg["embedding_scale"]
    high, low = x, np.broadcast_to(t["model.z_L_init"], x.shape)
    for _ in range(cfg["H_cycles"] if steps is None else steps):
        for _ in range(cfg["L_cycles"]):
            low = _hrm_stack(t, "L_module", low + high, cfg, instruction)
        high = _hrm_stack(t, "H_module", high + low, cfg, instruction)
    return high @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


# ---- IQuest-Coder Loop (vLLM 0.32.0's model_executor/models/iquest_loopcoder.py) -----------

def _iquest_layer(t, i, x, cfg, loop, global_kv):
    """LoopCoderDecoderLayer i in loop `loop`: a pre-norm LLaMA layer (q, k, v and o with no
    bias, head_dim = hidden_size / heads) whose attention, in loop 0, is causal over its own K/V
    (kept in global_kv[i]); in a later loop it mixes the causal attention of its own queries
    over loop 0's K/V (global) with their attention over this loop's K/V through a sliding
    window of loop_window_size (local), by g = sigmoid(gate_projections.i(q_h))[h] per head:
    g * global + (1 - g) * local."""
    p, eps = f"model.layers.{i}.", cfg["rms_norm_eps"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D, n = cfg["hidden_size"] // H, len(x)
    theta = cfg.get("rope_theta", 10000.0)
    h = rms_norm(x, t[p + "input_layernorm.weight"], eps)
    q = rope_rotate_half((h @ t[p + "self_attn.q_proj.weight"].T).reshape(n, H, D), theta)
    k = rope_rotate_half((h @ t[p + "self_attn.k_proj.weight"].T).reshape(n, G, D), theta)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(n, G, D)
    if loop == 0:
        global_kv[i] = k, v
        o = causal_attention(q, k, v)
    else:
        gp = f"model.gate_projections.{i}."
        logit = np.einsum("thd,hd->th", q, t[gp + "weight"]) + t[gp + "bias"]
        g = np.repeat(1.0 / (1.0 + np.exp(-logit)), D, axis=1)           # (n, H * D)
        local = causal_attention(q, k, v, window=cfg.get("loop_window_size", 64))
        o = causal_attention(q, *global_kv[i]) * g + local * (1 - g)
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    return x + _llama_mlp(t, p, rms_norm(x, t[p + "post_attention_layernorm.weight"], eps))


def iquest_loop_logits(t, cfg, tokens, steps=None):
    """IQuestLoopCoderModel.forward: `steps` (default loop_num) loops over every layer with
    shared weights and no norm between them (_iquest_layer), model.norm, lm_head."""
    emb, head = _embed_and_head(t)
    x, global_kv = emb[np.asarray(tokens)], {}
    for loop in range(cfg.get("loop_num", 2) if steps is None else steps):
        for i in range(cfg["num_hidden_layers"]):
            x = _iquest_layer(t, i, x, cfg, loop, global_kv)
    return rms_norm(x, t["model.norm.weight"], cfg["rms_norm_eps"]) @ head.T


LOGITS = {"OuroForCausalLM": ouro_logits, "NanbeigeForCausalLM": nanbeige_logits,
          "RavenForCausalLM": huginn_logits, RETROFIT_LLAMA: retrofit_llama_logits,
          "HrmTextForCausalLM": hrm_text_logits,
          "IQuestLoopCoderForCausalLM": iquest_loop_logits}
