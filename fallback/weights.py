"""Model weights prepared for a backend.

`Weights` gathers what a forward pass reads; the backend's kernel set decides how each linear
is stored (its `linear` class) and where tables live (its `table` function). The numpy
reference `Linear` turns a linear's integer weights once into a float64 matrix (K, R) holding
the exact integers w (int8) or m * w (int4 with its group multiplier folded in), so `q @ W` is
an exact integer matmul done by BLAS (docs/spec.md §3).
"""
from dataclasses import dataclass, fields

import numpy as np

from tinyloop.modelfile import unpack_int4

from .numerics import int_to_f32


def integer_weights(w, multipliers=None, group_size=0):
    """A linear's exact integer weights (R, K): w as int8, or for int4 each unpacked value
    times its group multiplier as int16 (|m * w| <= 255 * 8), so acc = Σ_k q_k W_jk."""
    if multipliers is None:
        return np.asarray(w, np.int8)
    values = unpack_int4(w).astype(np.int16)
    values *= np.repeat(np.asarray(multipliers, np.int16), group_size, axis=1)
    return values


class Linear:
    """y = ((f32) acc * a) * ws with acc = q @ W exact. Weights: (R, K) in the file."""

    def __init__(self, w, scale, multipliers=None, group_size=0):
        exact = integer_weights(w, multipliers, group_size).astype(np.float64)
        self.weight = np.ascontiguousarray(exact.T)    # (K, R)
        self.scale = np.asarray(scale, np.float32)      # (R,)

    @property
    def n_out(self):
        return self.weight.shape[1]

    @property
    def nbytes(self):
        return self.weight.nbytes + self.scale.nbytes

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
    """Everything a forward pass reads: embedding, RoPE tables, blocks, head.

    `linear(w, scale, multipliers=None, group_size=0)` builds one linear from the file's
    arrays (w: (R, K) int8, or (R, K/2) packed int4 with multipliers (R, K/group_size));
    `table(array)` places a lookup table where the backend's kernels read it. Each linear
    says its `nbytes`; `Weights.nbytes` counts everything the kernels read, wherever it lives.
    """

    def __init__(self, config, tensors, linear=Linear, table=np.asarray):
        self.config = config
        self._new_linear = linear
        self.embedding = table(tensors["tok_emb.w"])              # (V, d) int8
        self.embedding_scale = table(tensors["tok_emb.s"])        # (V,) float32
        self.rope_cos = table(tensors["rope.cos"])                # (max_seq_len, D/2)
        self.rope_sin = table(tensors["rope.sin"])
        names = config.block_prefixes()
        blocks = [Block(*(self._linear(tensors, f"{b}.{part}") for part in
                          ("attn_qkv", "attn_out", "ffn_gate_up", "ffn_down"))) for b in names]
        self.pre_blocks, self.loop_block = blocks[:-1], blocks[-1]
        if config.tied_head:
            self.head = linear(np.asarray(tensors["tok_emb.w"]), np.asarray(tensors["tok_emb.s"]))
        else:
            self.head = self._linear(tensors, "head")

    @property
    def nbytes(self):
        tables = (self.embedding, self.embedding_scale, self.rope_cos, self.rope_sin)
        linears = [getattr(block, f.name) for block in self.pre_blocks + [self.loop_block]
                   for f in fields(Block)] + [self.head]
        return sum(t.nbytes for t in tables) + sum(linear.nbytes for linear in linears)

    def _linear(self, tensors, name):
        if self.config.weight_format == "int8":
            return self._new_linear(tensors[name + ".w"], tensors[name + ".s"])
        return self._new_linear(tensors[name + ".w"], tensors[name + ".s"], tensors[name + ".m"],
                                self.config.group_size)

    def block(self, layer):
        """The weights of layer `layer`: a pre block, else the shared loop block."""
        return self.pre_blocks[layer] if layer < len(self.pre_blocks) else self.loop_block
