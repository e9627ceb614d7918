"""The int8 fidelity floors of issue #15 and their checks, shared by the tests that hold
converted checkpoints to float references (tests/test_hf_fidelity.py, tests/test_exit_fidelity.py).

Per-position cosine of int8 logits with the float forward, evaluated at every position compared:
the mean >= 0.998 and no position below 0.99 (a single broken position shows); top-1 agreement
is measured and must stay >= 0.85.
"""
import numpy as np

INT8_MEAN_COSINE = 0.998
INT8_MIN_COSINE = 0.99
INT8_MIN_TOP1 = 0.85


def cosines(a, b):
    """Per-position cosine of two (n, V) logit arrays."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def top1_agreement(a, b):
    return float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))


def assert_faithful(logits, reference, what):
    cos, top1 = cosines(logits, reference), top1_agreement(logits, reference)
    print(f"{what}: min cosine {cos.min():.5f}, mean {cos.mean():.5f}, top-1 {top1:.3f}")
    assert cos.mean() >= INT8_MEAN_COSINE, (what, cos.mean())
    assert cos.min() >= INT8_MIN_COSINE, (what, cos.min(), int(cos.argmin()))
    assert top1 >= INT8_MIN_TOP1, (what, top1)
