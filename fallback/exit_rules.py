"""Adaptive depth's exit rules (docs/spec.md §5.7), on the host, for every Python backend.

A decoded token asks its rule after each core iteration i <= L-2 whether it stops there. The
decision reads only the token's own state x_i (d,) f32 and, for the kl and argmax rules, its
probe logits z_i (V,) f32 (the logits it would have if it stopped there), both copied to the
host, and is computed with the spec's exact operations in numpy, so every kernel set shares
it: a rule never depends on the backend that produced its inputs, which are bit-identical
anyway.

    rule = exit_rule(params, weights)     # None for plain decoding
    judge = rule.start(x_entry)           # one token: x_entry is the state entering iteration 0
    judge.probes                          # whether exits() needs the probe logits
    judge.exits(i, x_i, z_i) -> bool      # after iteration i (the caller asks for i <= L-2 only)

`ForcedExit` replays a recorded exit (a preempted scheduled request's recomputation).
"""
from typing import NamedTuple

import numpy as np

from .numerics import (F32, LN2, LOG2E, TWO_24, exp2s, exps, i64_to_f32, log2s,
                       nan_ignoring_max, quantize_rows, rms_quantize)

Q16_MAX = 32767
Q19_MAX = (1 << 19) - 1       # the kl rule's quantization of logit differences


class ExitGate(NamedTuple):
    """The file's exit gate (spec §6.3): a 1-row int8 linear with a bias."""
    w: np.ndarray       # (d,) the int8 weights as int64 (exact dot products), norm gain folded in
    scale: np.float32
    bias: np.float32

    @classmethod
    def from_tensors(cls, tensors):
        return cls(np.asarray(tensors["exit_gate.w"], np.int8).reshape(-1).astype(np.int64),
                   F32(np.asarray(tensors["exit_gate.s"]).reshape(-1)[0]),
                   F32(np.asarray(tensors["exit_gate.b"]).reshape(-1)[0]))

    def probability(self, x, eps):
        """λ = sigmoid(linear(exit_gate; NQ(x)) + b) of one state x (d,) f32."""
        q, a = rms_quantize(x[None, :], eps)
        acc = int(np.dot(q[0].astype(np.int64), self.w))                      # exact
        v = ((F32(acc) * a[0]) * self.scale) + self.bias
        e = exps(-v)
        return F32(1) / (F32(1) + e)


class GateJudge:
    """One token under the gate rule: the exit distribution's CDF c and the mass left r."""
    probes = False

    def __init__(self, gate, threshold, min_loops, eps):
        self.gate, self.q, self.m, self.eps = gate, F32(threshold), min_loops, eps
        self.c, self.r = F32(0), F32(1)

    def exits(self, i, x, z=None):
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
    probes = False

    def __init__(self, threshold, min_loops, x_entry):
        self.q, self.m = F32(threshold), min_loops
        self.previous = x_entry

    def exits(self, i, x, z=None):
        delta = x - self.previous
        self.previous = x
        root_d, scale_d = _norm(delta)
        root_x, scale_x = _norm(x)
        if root_x == 0:
            return False
        with np.errstate(over="ignore", invalid="ignore"):
            ratio = (root_d * scale_d) / (root_x * scale_x)
        return bool(i + 1 >= self.m and ratio < self.q)


class Distribution(NamedTuple):
    """One iteration's probe logits z (V,) as the kl rule weighs them: M = max z, the weights
    W_j = rint(exp2s((z_j - M) * LOG2E) * 2^24) and S = Σ W_j, exact (None when a logit is not
    finite: no kl is computed against it)."""
    z: np.ndarray
    top: np.float32
    weights: np.ndarray      # (V,) int64
    total: int

    @classmethod
    def of(cls, z):
        if not np.isfinite(z).all():
            return None
        top = nan_ignoring_max(z)
        weights = np.rint(exp2s((z - top) * LOG2E) * TWO_24).astype(np.int64)
        return cls(z, top, weights, int(weights.sum()))


def kl_divergence(before, after):
    """KL(P_before || P_after) of two iterations' Distributions, as spec §5.7 writes it."""
    q, s = quantize_rows((before.z - after.z)[None, :], Q19_MAX)
    dot = int(np.dot(before.weights, q[0].astype(np.int64)))            # exact, < 2^63
    a = (i64_to_f32(dot) / i64_to_f32(before.total)) * s[0]
    k = a - (before.top - after.top)
    spread = (log2s(after.total) - log2s(before.total)) * LN2
    return k + spread


class KlJudge:
    """One token under the kl rule: KL of successive iterations' distributions below q."""
    probes = True

    def __init__(self, threshold, min_loops):
        self.q, self.m = F32(threshold), min_loops
        self.previous = None

    def exits(self, i, x, z):
        now, before = Distribution.of(z), self.previous
        self.previous = now
        if i == 0 or now is None or before is None:
            return False
        return bool(i + 1 >= self.m and kl_divergence(before, now) < self.q)


def top_id(z):
    """The smallest id with the largest logit (NaN never the largest); -1 when all are NaN."""
    top = nan_ignoring_max(z)
    hits = np.flatnonzero(z == top)
    return int(hits[0]) if len(hits) else -1


class ArgmaxJudge:
    """One token under the argmax rule: the same argmax for q more iterations."""
    probes = True

    def __init__(self, threshold, min_loops):
        self.q, self.m = int(threshold), min_loops
        self.previous, self.count = None, 0

    def exits(self, i, x, z):
        now = top_id(z)
        self.count = self.count + 1 if i > 0 and now == self.previous else 0
        self.previous = now
        return i + 1 >= self.m and self.count >= self.q


class ExitRule:
    """A request's rule (params.exit_rule "gate", "latent", "kl" or "argmax") and its resolved
    threshold."""

    def __init__(self, name, threshold, min_loops, gate, eps):
        self.name, self.threshold, self.min_loops = name, threshold, min_loops
        self.gate, self.eps = gate, eps

    def start(self, x_entry):
        """A judge for one decoded token; x_entry (d,) f32 on the host."""
        if self.name == "gate":
            return GateJudge(self.gate, self.threshold, self.min_loops, self.eps)
        if self.name == "latent":
            return LatentJudge(self.threshold, self.min_loops, x_entry)
        if self.name == "kl":
            return KlJudge(self.threshold, self.min_loops)
        return ArgmaxJudge(self.threshold, self.min_loops)


class ForcedExit:
    """A judge that stops after exactly `depth` iterations (a recorded exit, replayed)."""
    probes = False

    def __init__(self, depth):
        self.depth = depth

    def exits(self, i, x, z=None):
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
