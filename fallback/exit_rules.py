"""Adaptive depth's exit rules (docs/spec.md §5.7), on the host, for every Python backend.

A decoded token asks its rule after each core iteration i <= L-2 whether it stops there. The
decision reads only the token's own state x_i (d,) f32, copied to the host, and is computed
with the spec's exact operations in numpy, so every kernel set shares it: a rule never depends
on the backend that produced the state, which is bit-identical anyway.

    rule = exit_rule(params, weights)     # None for plain decoding
    judge = rule.start(x_entry)           # one token: x_entry is the state entering iteration 0
    judge.exits(i, x_i) -> bool           # after iteration i (the caller asks for i <= L-2 only)

`ForcedExit` replays a recorded exit (a preempted scheduled request's recomputation).
"""
from typing import NamedTuple

import numpy as np

from .numerics import F32, exps, quantize_rows, rms_quantize

Q16_MAX = 32767


class ExitGate(NamedTuple):
    """The file's exit gate (spec §6.3): a 1-row int8 linear with a bias."""
    w: np.ndarray       # (d,) int8, the final norm's gain folded in
    scale: np.float32
    bias: np.float32

    @classmethod
    def from_tensors(cls, tensors):
        return cls(np.asarray(tensors["exit_gate.w"], np.int8).reshape(-1),
                   F32(np.asarray(tensors["exit_gate.s"]).reshape(-1)[0]),
                   F32(np.asarray(tensors["exit_gate.b"]).reshape(-1)[0]))

    def probability(self, x, eps):
        """λ = sigmoid(linear(exit_gate; NQ(x)) + b) of one state x (d,) f32."""
        q, a = rms_quantize(x[None, :], eps)
        acc = int(np.dot(q[0].astype(np.int64), self.w.astype(np.int64)))   # exact
        v = ((F32(acc) * a[0]) * self.scale) + self.bias
        e = exps(-v)
        return F32(1) / (F32(1) + e)


class GateJudge:
    """One token under the gate rule: the exit distribution's CDF c and the mass left r."""

    def __init__(self, gate, threshold, min_loops, eps):
        self.gate, self.q, self.m, self.eps = gate, F32(threshold), min_loops, eps
        self.c, self.r = F32(0), F32(1)

    def exits(self, i, x):
        lam = self.gate.probability(x, self.eps)
        p = lam * self.r
        self.c = self.c + p
        self.r = self.r * (F32(1) - lam)
        return i + 1 >= self.m and self.c >= self.q


def _norm(x):
    """(sqrt((f32) Σ q²), s) of Q16(x): a row's 2-norm as sqrt(n) * s."""
    q, s = quantize_rows(x[None, :], Q16_MAX)
    wide = q[0].astype(np.int64)
    return np.sqrt(F32(int(np.dot(wide, wide)))), s[0]


class LatentJudge:
    """One token under the latent rule: ‖x_i - x_{i-1}‖ / ‖x_i‖ < q."""

    def __init__(self, threshold, min_loops, x_entry):
        self.q, self.m = F32(threshold), min_loops
        self.previous = x_entry

    def exits(self, i, x):
        delta = x - self.previous
        self.previous = x
        root_d, scale_d = _norm(delta)
        root_x, scale_x = _norm(x)
        if root_x == 0:
            return False
        with np.errstate(over="ignore", invalid="ignore"):
            ratio = (root_d * scale_d) / (root_x * scale_x)
        return bool(i + 1 >= self.m and ratio < self.q)


class ExitRule:
    """A request's rule (params.exit_rule "gate" or "latent") and its resolved threshold."""

    def __init__(self, name, threshold, min_loops, gate, eps):
        self.name, self.threshold, self.min_loops = name, threshold, min_loops
        self.gate, self.eps = gate, eps

    def start(self, x_entry):
        """A judge for one decoded token; x_entry (d,) f32 on the host."""
        if self.name == "gate":
            return GateJudge(self.gate, self.threshold, self.min_loops, self.eps)
        return LatentJudge(self.threshold, self.min_loops, x_entry)


class ForcedExit:
    """A judge that stops after exactly `depth` iterations (a recorded exit, replayed)."""

    def __init__(self, depth):
        self.depth = depth

    def exits(self, i, x):
        return i + 1 == self.depth


def exit_rule(params, weights):
    """The request's ExitRule, or None when every decoded token runs the full depth: no rule,
    the gate rule at q = 1, or min_loops = loops (spec §5.7)."""
    if params.exit_rule == "none" or params.min_loops >= params.loops:
        return None
    if params.exit_rule == "gate" and params.exit_threshold >= 1:
        return None
    return ExitRule(params.exit_rule, params.exit_threshold, params.min_loops,
                    weights.exit_gate, weights.config.rms_eps)
