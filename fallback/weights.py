"""Model weights prepared for a backend.

`Weights` gathers what a forward pass reads; the backend's kernel set decides how each linear
is stored (its `linear` class) and where tables and f32 vectors live (its `table` function).
The numpy reference `Linear` turns a linear's integer weights once into a float64 matrix
(K, R) holding the exact integers w (int8) or m * w (int4 with its group multiplier folded in),
so `q @ W` is an exact integer matmul done by BLAS (docs/spec.md §3).
"""
from dataclasses import dataclass

import numpy as np

from tinyloop.modelfile import unpack_int4

from .exit_rules import ExitGate
from .numerics import F32, int_to_f32

LINEAR_PARTS = ("attn_qkv", "attn_out", "ffn_gate_up", "ffn_down")


def integer_weights(w, multipliers=None, group_size=0):
    """A linear's exact integer weights (R, K): w as int8, or for int4 each unpacked value
    times its group multiplier as int16 (|m * w| <= 255 * 8), so acc = Σ_k q_k W_jk."""
    if multipliers is None:
        return np.asarray(w, np.int8)
    values = unpack_int4(w).astype(np.int16)
    values *= np.repeat(np.asarray(multipliers, np.int16), group_size, axis=1)
    return values


class Linear:
    """y = ((f32) acc * a) * ws (+ b) with acc = q @ W exact. Weights: (R, K) in the file."""

    def __init__(self, w, scale, multipliers=None, group_size=0, bias=None):
        exact = integer_weights(w, multipliers, group_size).astype(np.float64)
        self.weight = np.ascontiguousarray(exact.T)    # (K, R)
        self.scale = np.asarray(scale, np.float32)      # (R,)
        self.bias = None if bias is None else np.asarray(bias, np.float32)

    @property
    def n_out(self):
        return self.weight.shape[1]

    @property
    def nbytes(self):
        return self.weight.nbytes + self.scale.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, q, a):
        """q: (T, K) int8, or int16 block inputs p (§3; |acc| < 2^53, so float64 stays exact),
        a: (T,) float32 -> (T, R) float32."""
        acc = q.astype(np.float64) @ self.weight
        y = (int_to_f32(acc) * a[:, None]) * self.scale
        return y if self.bias is None else y + self.bias


@dataclass
class LoopGate:
    """A core block's loop-attention gate (docs/spec.md §4): w (H, D) int8, s and b (H,)
    float32, placed by the kernel set's table."""
    w: object
    s: object
    b: object

    @property
    def nbytes(self):
        return self.w.nbytes + self.s.nbytes + self.b.nbytes


@dataclass
class Block:
    """One block's weights: its four linears (attn_qkv with its bias when the model has one)
    and, in the sandwich and post placements, the gains of its two residual norms."""
    attn_qkv: object
    attn_out: object
    ffn_gate_up: object
    ffn_down: object
    attn_post_norm: object = None     # (d,) f32 table, or None (block_layout "pre")
    ffn_post_norm: object = None
    loop_gate: object = None          # a core block's LoopGate with loop attention, else None

    def parts(self):
        """What the block holds, for byte counts: its linears, gain tables and loop gate."""
        return [p for p in (self.attn_qkv, self.attn_out, self.ffn_gate_up, self.ffn_down,
                            self.attn_post_norm, self.ffn_post_norm, self.loop_gate)
                if p is not None]


class Weights:
    """Everything a forward pass reads: embedding, RoPE tables, the prelude, core and coda
    blocks, the adapter, the step and coda norms, the head, the exit gate (on the host).

    `linear(w, scale, multipliers=None, group_size=0, bias=None)` builds one linear from the
    file's arrays (w: (R, K) int8, or (R, K/2) packed int4 with multipliers (R, K/group_size);
    bias (R,) f32); `table(array)` places a lookup table or f32 vector where the backend's
    kernels read it. Each linear says its `nbytes`; `Weights.nbytes` counts everything the
    kernels read, wherever it lives. Absent parts (no injection, no step norm, ...) are None.
    """

    def __init__(self, config, tensors, linear=Linear, table=np.asarray):
        self.config = config
        self._new_linear, self._table = linear, table
        self.embedding = table(tensors["tok_emb.w"])              # (V, d) int8
        self.embedding_scale = table(tensors["tok_emb.s"])        # (V,) float32
        self.embed_scale = F32(config.embed_scale)                 # the header's multiplier
        self.rope_cos = table(tensors["rope.cos"])                # (max_seq_len, D/2)
        self.rope_sin = table(tensors["rope.sin"])
        blocks = [self._block(tensors, b) for b in config.block_prefixes()]
        n_pre, k = config.n_pre_blocks, config.n_core_blocks
        self.pre_blocks = blocks[:n_pre]
        self.core_blocks = blocks[n_pre:n_pre + k]
        self.coda_blocks = blocks[n_pre + k:]
        # the core block of each application of an iteration (§1: a two-state core's stacks)
        self.core_applied = [self.core_blocks[j] for j in config.core_applications()]
        # a two-state core's weightless closing norm: RN with a gain of ones (§2.7)
        self.unit_gain = table(np.ones(config.d_model, np.float32)) if config.core_cycles else None
        self.adapter_state = self.adapter_inject = None
        if config.injection:
            self.adapter_state = self._linear(tensors, "core.adapter_state")
            self.adapter_inject = self._linear(tensors, "core.adapter_inject")
        self.step_norm = self._vector(tensors, "core.step_norm", config.step_norm)
        self.coda_norm = self._vector(tensors, "coda.input_norm", config.coda_norm)
        self.exit_gate = ExitGate.from_tensors(tensors) if config.exit_gate else None  # host
        if config.tied_head:
            self.head = linear(np.asarray(tensors["tok_emb.w"]), np.asarray(tensors["tok_emb.s"]))
        else:
            self.head = self._linear(tensors, "head")

    @property
    def nbytes(self):
        parts = [self.embedding, self.embedding_scale, self.rope_cos, self.rope_sin,
                 self.adapter_state, self.adapter_inject, self.step_norm, self.coda_norm,
                 self.head]
        for block in self.pre_blocks + self.core_blocks + self.coda_blocks:
            parts += block.parts()
        return sum(p.nbytes for p in parts if p is not None)

    def block(self, slot):
        """The weights of the layer at cache slot `slot` (docs/spec.md §1), at any depth."""
        n_pre, w = self.config.n_pre_blocks, self.config.core_width
        if slot < n_pre:
            return self.pre_blocks[slot]
        j = (slot - n_pre) % (w + self.config.n_coda_blocks)
        return self.core_applied[j] if j < w else self.coda_blocks[j - w]

    def _block(self, tensors, prefix):
        post = self.config.block_layout != "pre"
        bias = tensors[f"{prefix}.attn_qkv.b"] if self.config.qkv_bias else None
        gate = None
        if self.config.loop_window and prefix.startswith("core."):
            gate = LoopGate(*(self._table(np.asarray(tensors[f"{prefix}.loop_gate.{part}"]))
                              for part in "wsb"))
        return Block(self._linear(tensors, f"{prefix}.attn_qkv", bias),
                     *(self._linear(tensors, f"{prefix}.{part}") for part in LINEAR_PARTS[1:]),
                     self._vector(tensors, f"{prefix}.attn_post_norm", post),
                     self._vector(tensors, f"{prefix}.ffn_post_norm", post), gate)

    def _vector(self, tensors, name, present):
        return self._table(np.asarray(tensors[name], np.float32)) if present else None

    def _linear(self, tensors, name, bias=None):
        if self.config.weight_format == "int8":
            return self._new_linear(tensors[name + ".w"], tensors[name + ".s"], bias=bias)
        return self._new_linear(tensors[name + ".w"], tensors[name + ".s"], tensors[name + ".m"],
                                self.config.group_size, bias=bias)
