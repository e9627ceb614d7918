"""Token sampling and the counter-based generator (docs/spec.md §5.1–5.2)."""
import numpy as np

from .numerics import F32, LOG2E, exp2s

MASK64 = (1 << 64) - 1
TWO_20 = 1 << 20


class NumericError(RuntimeError):
    """Non-finite logits reached the sampler."""


def rng(seed, pos):
    """One SplitMix64 output at state seed + (pos + 1) * gamma; a Python int in [0, 2**64)."""
    z = (seed + (pos + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def apply_repetition_penalty(z, history, penalty):
    """CTRL-style penalty on the distinct ids of the history. z: (V,) float32, modified copy."""
    if penalty == 1:
        return z
    z = z.copy()
    ids = np.unique(np.asarray(history, dtype=np.int64))
    sel = z[ids]
    rho = F32(penalty)
    z[ids] = np.where(sel > 0, sel / rho, sel * rho)
    return z


def sample(logits, history, params, pos):
    """Pick the token at absolute position `pos` from logits (V,) float32 (spec §5.1)."""
    if not np.isfinite(logits).all():
        raise NumericError("non-finite logits")
    z = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(z))
    order = np.lexsort((np.arange(len(z)), -z))     # z descending, ties by id ascending
    if 0 < params.top_k < len(z):
        order = order[:params.top_k]
    with np.errstate(over="ignore"):
        y = z[order] / F32(params.temperature)
    if np.isinf(y[0]):                              # z / T overflowed: the top candidate wins
        return int(order[0])
    w = np.rint(exp2s((y - y[0]) * LOG2E) * F32(TWO_20)).astype(np.int64)
    cum = np.cumsum(w)
    p = int(np.rint(F32(params.top_p) * F32(TWO_20)))
    n_keep = int(np.argmax(cum * TWO_20 >= p * int(cum[-1]))) + 1
    r = rng(params.seed, pos) % int(cum[n_keep - 1])
    return int(order[np.searchsorted(cum[:n_keep], r, side="right")])
