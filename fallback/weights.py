"""Model weights prepared for the numpy backend.

A linear's integer weights are turned once into a float64 matrix (K, R) holding the exact
integers w (int8) or m * w (int4 with its group multiplier folded in), so `q @ W` is an exact
integer matmul done by BLAS (docs/spec.md §3).
"""
from dataclasses import dataclass

import numpy as np

from tinyloop.modelfile import unpack_int4

from .numerics import int_to_f32


class Linear:
    """y = ((f32) acc * a) * ws with acc = q @ W exact. Weights: (R, K) in the file."""

    def __init__(self, w, scale, multipliers=None, group_size=0):
        if multipliers is None:
            exact = w.astype(np.float64)
        else:
            exact = unpack_int4(w).astype(np.float64)
            exact *= np.repeat(multipliers.astype(np.float64), group_size, axis=1)
        self.weight = np.ascontiguousarray(exact.T)    # (K, R)
        self.scale = np.asarray(scale, np.float32)      # (R,)

    @property
    def n_out(self):
        return self.weight.shape[1]

    def __call__(self, q, a):
        """q: (T, K) int8, a: (T,) float32 -> (T, R) float32."""
        acc = q.astype(np.float64) @ self.weight
        return (int_to_f32(acc) * a[:, None]) * self.scale


@dataclass
class Block:
    attn_qkv: Linear
    attn_out: Linear
    ffn_gate_up: Linear
    ffn_down: Linear


class Weights:
    """Everything a forward pass reads: embedding, RoPE tables, blocks, head."""

    def __init__(self, config, tensors):
        self.config = config
        self.embedding = np.asarray(tensors["tok_emb.w"])        # (V, d) int8
        self.embedding_scale = np.asarray(tensors["tok_emb.s"])  # (V,) float32
        self.rope_cos = np.asarray(tensors["rope.cos"])          # (max_seq_len, D/2)
        self.rope_sin = np.asarray(tensors["rope.sin"])
        names = config.block_prefixes()
        blocks = [Block(*(self._linear(tensors, f"{b}.{part}") for part in
                          ("attn_qkv", "attn_out", "ffn_gate_up", "ffn_down"))) for b in names]
        self.pre_blocks, self.loop_block = blocks[:-1], blocks[-1]
        if config.tied_head:
            self.head = Linear(self.embedding, self.embedding_scale)
        else:
            self.head = self._linear(tensors, "head")

    def _linear(self, tensors, name):
        if self.config.weight_format == "int8":
            return Linear(tensors[name + ".w"], tensors[name + ".s"])
        return Linear(tensors[name + ".w"], tensors[name + ".s"], tensors[name + ".m"],
                      self.config.group_size)

    def block(self, layer):
        """The weights of layer `layer`: a pre block, else the shared loop block."""
        return self.pre_blocks[layer] if layer < len(self.pre_blocks) else self.loop_block
