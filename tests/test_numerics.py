"""Unit tests of the spec's primitives (docs/spec.md §2, §5) in the numpy reference."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from tinyloop.fallback import numerics as N
from tinyloop.fallback.sampling import NumericError, rng, sample
from tinyloop.params import GenerationParams

f32s = st.floats(-1e6, 1e6, width=32, allow_nan=False)


def test_exp2_constants_match_the_spec_bits():
    bits = [0x3F800000, 0x3F317215, 0x3E75FED5, 0x3D634186, 0x3C1E9E34, 0x3AA2B764, 0x39648C8E]
    assert [np.float32(c).view(np.uint32) for c in N.EXP2_COEFFS] == bits
    assert np.float32(N.LOG2E).view(np.uint32) == 0x3FB8AA3B


def test_exp2s_is_accurate_exact_at_integers_and_monotone():
    x = np.linspace(-125.9, 125.9, 200001, dtype=np.float32)
    y = N.exp2s(x)
    assert y.dtype == np.float32
    assert np.max(np.abs(y / np.exp2(x.astype(np.float64)) - 1)) < 1e-7
    assert np.all(np.diff(y) >= 0)
    ints = np.arange(-126, 127, dtype=np.float32)
    assert np.array_equal(N.exp2s(ints), np.exp2(ints))


def test_exp2s_clamps_and_maps_nan_to_the_lower_bound():
    y = N.exp2s(np.array([-1000, 1000, np.nan, -np.inf, np.inf], np.float32))
    assert y.tolist() == [2.0 ** -126, 2.0 ** 126, 2.0 ** -126, 2.0 ** -126, 2.0 ** 126]


def test_log2_constants_match_the_spec_bits():
    bits = [0x4038AA3B, 0x3F76384F, 0x3F13BB63, 0x3ED30BB1, 0x3EA4258A, 0x3E864D42, 0x3E6347AB]
    assert [np.float32(c).view(np.uint32) for c in N.LOG2_COEFFS] == bits
    assert np.float32(N.LN2).view(np.uint32) == 0x3F317218


@given(st.integers(1, (1 << 63) - 1))
def test_log2s_is_within_its_bound_and_exact_at_powers_of_two(n):
    """spec §2.8: |log2s(N) - log2 N| < 2^-19 for N < 2^32 (2^-18 beyond, where the final sum
    rounds at 2^-19), and log2s(2^e) = e exactly (s = 0)."""
    import math
    got = N.log2s(n)
    assert got.dtype == np.float32
    assert abs(float(got) - math.log2(n)) < 2.0 ** (-19 if n < 1 << 32 else -18)
    e = n.bit_length() - 1
    assert N.log2s(1 << e) == e


def test_i64_to_f32_rounds_once():
    """(f32) of a 63-bit integer is one rounding, not two through float64: 2^62 + 2^38 + 1 is
    above the f32 midpoint 2^62 + 2^38, so it rounds up; via float64 it would tie to even."""
    n = (1 << 62) + (1 << 38) + 1
    assert N.i64_to_f32(n) == np.float32(2.0 ** 62 + 2.0 ** 39)
    assert np.float32(float(n)) == np.float32(2.0 ** 62)


@given(st.lists(f32s, min_size=1, max_size=64))
def test_q8_reconstructs_within_half_a_step(values):
    x = np.array(values, np.float32)
    q, s = N.quantize_rows(x[None])
    amax = np.abs(x).max()
    if amax < 2.0 ** -64:
        assert not q.any() and s[0] == 0
    else:
        assert np.abs(q).max() == 127
        assert s[0] == np.float32(amax) / np.float32(127)
        assert np.all(np.abs(q[0] * np.float64(s[0]) - x) <= 0.5001 * s[0] + 1e-30)


def test_q8_rounds_half_to_even_and_handles_zero_tiny_and_nonfinite_rows():
    q, s = N.quantize_rows(np.array([[127.0, 0.5, 1.5, 2.5, -0.5]], np.float32))
    assert q.tolist() == [[127, 0, 2, 2, 0]] and s[0] == 1.0
    q, s = N.quantize_rows(np.zeros((2, 4), np.float32) + np.array([[0], [1e-30]], np.float32))
    assert not q.any() and not s.any()
    q, s = N.quantize_rows(np.array([[np.inf, 1.0, np.nan]], np.float32))
    assert q.tolist() == [[-127, 0, -127]] and np.isinf(s[0])
    q, s = N.quantize_rows(np.array([[3.0, np.nan, -1.5]], np.float32))
    assert q.tolist() == [[127, -127, -64]]


def literal_qb(x, block):
    """§2.2.1 QB(x, B) of one row, element by element in the spec's words (ceil and rint on
    exact f32 values, Python ints): (p, s, the block multipliers m)."""
    f = np.float32
    x = [f(v) for v in x]
    amax = f(0)
    for v in x:
        amax = np.fmax(amax, f(abs(v)))
    if amax < f(2.0 ** -64):
        return [0] * len(x), f(0), []
    u, v = f(255) / amax, f(32385) / amax
    p, ms = [], []
    for b0 in range(0, len(x), block):
        amax_b = f(0)
        for e in x[b0:b0 + block]:
            amax_b = np.fmax(amax_b, f(abs(e)))
        m = int(np.ceil(N.clamp(f(amax_b * u), 1, 255)))
        r = f(v / f(m))
        p += [m * int(np.rint(N.clamp(f(e * r), -127, 127))) for e in x[b0:b0 + block]]
        ms.append(m)
    return p, f(amax / f(32385)), ms


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.sampled_from([1, 2, 4, 8]), st.lists(f32s, min_size=8 * n, max_size=8 * n))))
def test_qb_is_the_spec_and_keeps_each_block_within_half_its_step(case):
    block, values = case
    x = np.array(values, np.float32)
    p, s = N.quantize_blocks(x[None], block)
    want_p, want_s, ms = literal_qb(x, block)
    assert p.dtype == np.int16 and p[0].tolist() == want_p and s[0] == want_s
    if s[0] == 0 or not np.isfinite(x).all():
        return
    for b0, m in zip(range(0, len(x), block), ms):
        ps = p[0, b0:b0 + block].astype(np.int64)
        assert 1 <= m <= 255 and np.abs(ps).max() <= 127 * m
        step = np.float64(s[0]) * m
        assert np.all(np.abs(ps * np.float64(s[0]) - x[b0:b0 + block]) <= 0.5001 * step + 1e-30)


def test_qb_keeps_a_small_block_next_to_an_outlier_block():
    x = np.array([[0.01, -0.02, 0.015, 0.005, 50.0, -3.0, 1.0, 0.5]], np.float32)
    p, s = N.quantize_blocks(x, 4)
    q8, s8 = N.quantize_rows(x)
    assert q8[0, :4].tolist() == [0, 0, 0, 0]                  # one scale per row loses it
    assert p[0, :4].tolist() == [6, -13, 10, 3]           # m = 1: steps of 50 / 32385
    assert p[0, 4:].tolist() == [255 * 127, -255 * 8, 255 * 3, 255 * 1]
    assert s[0] == np.float32(50) / np.float32(32385)
    q, a = N.rms_quantize_input(x, 1e-6, 4)
    assert q.tolist() == p.tolist()
    assert a[0] == s[0] / N.root_mean_square(p, s, 1e-6)[0]


def test_qb_handles_zero_tiny_and_nonfinite_rows():
    p, s = N.quantize_blocks(np.zeros((2, 4), np.float32) + np.array([[0], [1e-30]], np.float32), 2)
    assert not p.any() and not s.any()
    p, s = N.quantize_blocks(np.array([[np.inf, 1.0, np.nan, 2.0]], np.float32), 2)
    assert p.tolist() == [[-127, 0, -127, 0]] and np.isinf(s[0])    # m = 1 everywhere: u = 0
    assert N.quantize_input(np.ones((1, 4), np.float32), 0)[0].dtype == np.int8


def test_q4_uses_seven_levels():
    q, s = N.quantize_rows(np.array([[1.0, -0.5, 0.25, 0.07]], np.float32), qmax=7)
    assert q.tolist() == [[7, -4, 2, 0]] and s[0] == np.float32(1) / np.float32(7)


def test_rms_quantize_follows_the_spec_order():
    x = np.array([[0.3, -1.2, 2.0, 0.0, 0.7]], np.float32)
    q, a = N.rms_quantize(x, 1e-5)
    _, s = N.quantize_rows(x)
    t = np.float32(int((q.astype(np.int64) ** 2).sum()))
    t = np.float32(np.float32(np.float32(t * s[0]) * s[0]) / np.float32(5))
    t = np.sqrt(np.float32(t + np.float32(1e-5)))
    assert a[0] == np.float32(s[0] / t)
    assert abs(float(a[0]) * 127 - 2.0 / np.sqrt((x.astype(np.float64) ** 2).mean())) < 0.02


def test_q16_uses_32767_levels_in_int16():
    q, s = N.quantize_rows(np.array([[2.0, -1.0, 0.5, 2.0 ** -20]], np.float32), qmax=32767)
    assert q.dtype == np.int16 and s[0] == np.float32(2) / np.float32(32767)
    assert q.tolist() == [[32767, -16384, 8192, 0]]               # -16383.5 -> even -16384


def test_rms_norm_follows_the_spec_order():
    """§2.7 RN(x, g): Q16's integer sum of squares gives t, then (x / t) * g with x itself."""
    x = np.array([[0.3, -1.2, 2.0, 0.0, 0.7], [0.0] * 5], np.float32)
    g = np.array([1.0, 0.5, -2.0, 3.0, 1.25], np.float32)
    y = N.rms_norm(x, g, 1e-5)
    assert y.dtype == np.float32 and y.shape == x.shape
    q, s = N.quantize_rows(x[:1], qmax=32767)
    t = np.float32(int((q.astype(np.int64) ** 2).sum()))
    t = np.float32(np.float32(np.float32(t * s[0]) * s[0]) / np.float32(5))
    t = np.sqrt(np.float32(t + np.float32(1e-5)))
    assert np.array_equal(y[0].view(np.uint32), ((x[0] / t) * g).view(np.uint32))
    assert not y[1].any()                                            # a zero row stays zero
    rms = np.sqrt((x[0].astype(np.float64) ** 2).mean() + 1e-5)
    assert np.allclose(y[0], x[0] / rms * g, rtol=2.0 ** -13)


def test_rms_norm_of_a_non_finite_row_is_defined():
    y = N.rms_norm(np.array([[np.inf, 1.0], [np.nan, 1.0]], np.float32), np.ones(2, np.float32),
                   1e-5)
    assert np.isnan(y[0, 0]) and y[0, 1] == 0 and np.isnan(y[1, 0])


def test_rng_is_splitmix64():
    # the first outputs of the reference SplitMix64 generator seeded with 0
    assert rng(0, 0) == 0xE220A8397B1DCDAF
    assert rng(0, 1) == 0x6E789E6AA1B965F4
    assert rng(2**64 - 1, 5) != rng(2**64 - 2, 5)


def params(**kw):
    base = dict(max_tokens=1, loops=1, cache_window=0, temperature=1.0, top_k=0, top_p=1.0,
                repetition_penalty=1.0, stop_sequences=(), seed=0, prefill_chunk=1)
    return GenerationParams(**{**base, **kw})


def test_sampling_rejects_non_finite_logits():
    with pytest.raises(NumericError, match="non-finite logits"):
        sample(np.array([0.0, np.nan], np.float32), [], params(), 0)


def test_greedy_takes_the_lowest_id_on_ties():
    z = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    assert sample(z, [], params(temperature=0.0), 0) == 1


def test_repetition_penalty_is_ctrl_style():
    z = np.array([2.0, 1.9, -1.0], np.float32)
    assert sample(z, [0], params(temperature=0.0, repetition_penalty=2.0), 0) == 1
    assert sample(z, [0, 0, 2], params(temperature=0.0, repetition_penalty=1.0), 0) == 0


def test_small_top_p_keeps_only_the_top_candidate():
    z = np.array([0.0, 0.1, 0.05], np.float32)
    picks = {sample(z, [], params(top_p=1e-6, seed=s), 0) for s in range(50)}
    assert picks == {1}


def test_top_k_restricts_the_candidates():
    z = np.array([0.0, 0.3, 0.2, 0.1], np.float32)
    picks = {sample(z, [], params(top_k=2, seed=s), p) for s in range(30) for p in range(5)}
    assert picks == {1, 2}


def test_sampled_frequencies_follow_the_softmax():
    z = np.array([1.0, 0.0, -1.0, 2.0], np.float32)
    draws = np.array([sample(z, [], params(seed=7), p) for p in range(20000)])
    freq = np.bincount(draws, minlength=4) / len(draws)
    probs = np.exp(z) / np.exp(z).sum()
    assert np.max(np.abs(freq - probs)) < 0.015


def test_tiny_temperature_overflow_takes_the_top_candidate():
    z = np.array([3e38, 1.0], np.float32)
    assert sample(z, [], params(temperature=1e-30), 0) == 0
    # every logit negative: m = -inf, every weight 0; still the first candidate, not a draw
    z = np.array([-3e38, -2e30, -1e30, -1e30], np.float32)
    assert {sample(z, [], params(temperature=1e-30, seed=s), 0) for s in range(8)} == {2}


def test_attention_ignores_keys_a_query_cannot_see():
    """A key outside a query's view changes nothing, even with an infinite value scale in the
    same chunk (spec §4.1 sums over visible keys only; U of a hidden key is not 0 * inf)."""
    from tinyloop.fallback.attention import attend, visible_keys
    rng = np.random.default_rng(0)
    qh = rng.standard_normal((2, 2, 8)).astype(np.float32)       # T 2, H 2 (one kv head), D 8
    kq = rng.integers(-127, 128, (2, 1, 8)).astype(np.int8)
    vq = rng.integers(-127, 128, (2, 1, 8)).astype(np.int8)
    sk = np.array([[0.01], [0.02]], np.float32)
    sv = np.array([[0.03], [np.inf]], np.float32)                 # key 1: non-finite values
    out = attend(qh, kq, sk, vq, sv, visible_keys(np.arange(2), np.arange(2), 0))
    alone = attend(qh[:1], kq[:1], sk[:1], vq[:1], sv[:1], visible_keys(np.arange(1), np.arange(1), 0))
    assert np.array_equal(out[0].view(np.uint32), alone[0].view(np.uint32))   # query 0 sees key 0 only
    assert np.isnan(out[1]).all()                                  # query 1 sees sv = inf: NaN
