"""Random looped models of any shape, weight format, version-2 layout and exit gate,
reproducible from a seed.

Used by tests and benchmarks. Weights are drawn so activations stay in a realistic range at any
depth: fan-in scaled projections, residual branches scaled by 1/sqrt(2 * layers), norm gains
(folded or stored) near 1, small biases, an adapter that keeps its input's scale, an embedding
whose product with embed_scale is about 1, logits with a standard deviation of about 3, exit
gate scores (before the sigmoid) with one of about 1.4.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .config import ModelConfig
from .modelfile import meta_tensor, save_model
from .quantize import quantize_model

# ModelConfig's keyword arguments (of several types: Any)
DEFAULT_CONFIG: dict[str, Any] = dict(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2,
                                      head_dim=16, ffn_dim=128, n_pre_blocks=1, default_loops=4,
                                      max_seq_len=256, weight_format="int8", group_size=0,
                                      tied_head=False, name="random")
DEFAULT_INT4_GROUP = 32


def random_config(**overrides: Any) -> ModelConfig:
    """A ModelConfig from DEFAULT_CONFIG and overrides (int4 gets a default group size)."""
    fields = {**DEFAULT_CONFIG, **overrides}
    if fields["weight_format"] == "int4" and not fields.get("group_size"):
        fields["group_size"] = DEFAULT_INT4_GROUP
    config = ModelConfig(**fields)
    config.validate()
    return config


def random_float_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights in the layout tinyloop.quantize.quantize_model expects."""
    rng = np.random.default_rng(seed)
    d, H, G, D, F, V = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                        config.ffn_dim, config.vocab_size)
    residual = 1.0 / np.sqrt(2.0 * config.n_layers(config.default_loops))

    def normal(shape: int | tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def gain() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {"tok_emb": normal((V, d), 1.0 / config.embed_scale)}
    for b in config.block_prefixes():
        w[f"{b}.attn_norm"], w[f"{b}.mlp_norm"] = gain(), gain()
        w[f"{b}.wq"] = normal((H * D, d), d ** -0.5)
        w[f"{b}.wk"] = normal((G * D, d), d ** -0.5)
        w[f"{b}.wv"] = normal((G * D, d), d ** -0.5)
        if config.attn_gate:
            w[f"{b}.wg"] = normal((H * D, d), d ** -0.5)
        w[f"{b}.wo"] = normal((d, H * D), (H * D) ** -0.5 * residual)
        w[f"{b}.w_gate"] = normal((F, d), d ** -0.5)
        w[f"{b}.w_up"] = normal((F, d), d ** -0.5)
        w[f"{b}.w_down"] = normal((d, F), F ** -0.5 * residual)
        if config.qkv_bias:
            w[f"{b}.bq"], w[f"{b}.bk"], w[f"{b}.bv"] = (normal(n, 0.1) for n in (H * D, G * D, G * D))
            if config.attn_gate:
                w[f"{b}.bg"] = normal(H * D, 0.1)
        if config.block_layout != "pre":
            w[f"{b}.attn_post_norm"], w[f"{b}.ffn_post_norm"] = gain(), gain()
        if config.loop_window and b.startswith("core."):     # gate logits of about unit size
            w[f"{b}.loop_gate"] = normal((H, D), D ** -0.5)
            w[f"{b}.loop_gate_bias"] = normal(H, 0.5)
    if config.injection:
        w["core.adapter"] = normal((d, 2 * d), (2 * d) ** -0.5)
    if config.step_norm:
        w["core.step_norm"] = gain()
    if config.coda_norm:
        w["coda.input_norm"] = gain()
    if config.tied_head:
        w["final_norm"] = np.ones(d, np.float32)
        w["tok_emb"] *= np.float32(3.0 / np.sqrt(d))
    else:
        w["final_norm"] = gain()
        w["head"] = normal((V, d), 3.0 / np.sqrt(d))
    if config.exit_gate:        # drawn last: the other weights are those of the model without it
        w["exit_gate"], w["exit_gate_bias"] = normal((1, d), d ** -0.5), normal(1, 1.0)
    return w


def random_model(path: str | os.PathLike[str], seed: int = 0, meta: Mapping[str, str] | None = None,
                 **overrides: Any) -> ModelConfig:
    """Write a random model to `path`; returns its ModelConfig. Overrides are config fields;
    `meta` maps meta.* tensor names (docs/spec.md §6.3) to their texts."""
    config = random_config(**overrides)
    config, tensors = quantize_model(config, random_float_weights(config, seed))
    for name, text in (meta or {}).items():
        tensors[name] = meta_tensor(text)
    save_model(path, config, tensors)
    return config
