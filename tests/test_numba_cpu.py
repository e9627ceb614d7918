"""The numba CPU kernels against the numpy reference on the edges a random model never hits:
non-finite and tiny rows, block quantization's outlier blocks and multiplier edges,
accumulators at the spec's bound (block inputs' past int32), all-zero value rows, padding
tails, biases, sampling with ties and overflow; plus the compiled code itself (no FMA) and
thread-count invariance."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

numba = pytest.importorskip("numba", reason="the numba backend needs numba")
import llvmlite.binding  # noqa: E402  (comes with numba)

import tinyloop  # noqa: E402
from tinyloop.fallback import forward as ref  # noqa: E402
from tinyloop.fallback import numba_cpu  # noqa: E402
from tinyloop.fallback.attention import attend_cached  # noqa: E402
from tinyloop.fallback.kvcache import KVCache  # noqa: E402
from tinyloop.fallback.numerics import rms_norm  # noqa: E402
from tinyloop.fallback.sampling import NumericError, sample as reference_sample  # noqa: E402
from tinyloop.fallback.weights import Linear  # noqa: E402
from tinyloop.params import GenerationParams  # noqa: E402

from conftest import generate_on_threads  # noqa: E402

KERNELS = numba_cpu.NumbaKernels(threads=2)
SPECIAL = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 2.0 ** -64, 2.0 ** -65, 3e38,
                    -3e38, 0.5, -0.5, 1.5, 2.5, 126.5, -126.5, 127.0, -200.0, 88.0, -88.0],
                   np.float32)


def bits(*arrays):
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays]


def edge_rows(rng, n):
    """Rows mixing random values with specials, tiny rows, zero rows and exact-tie rows."""
    rows = [rng.standard_normal(n) * 10 ** rng.uniform(-3, 3) for _ in range(6)]
    rows += [rng.choice(SPECIAL, n), np.zeros(n), np.full(n, 1e-30), np.arange(n) - n / 2]
    rows += [np.where(rng.random(n) < 0.3, np.nan, rng.standard_normal(n))]
    return np.array(rows, np.float32)


def block_rows(rng, n, block):
    """Rows for QB (spec §2.2.1) with blocks of `block`: one outlier block far above the rest
    (whose blocks keep m_b near 1), and block maxima at multiples of amax / 255 (amax_b * u
    at or next to an integer: ceil's edges), one of them with a zero block (m_b = 1)."""
    outlier = rng.standard_normal(n) * 1e-3
    outlier[rng.integers(n)] = 1e3
    signs = np.where(rng.random(n) < 0.5, 1, -1)
    steps = (np.arange(n) // block % 256) * np.float32(0.37) * signs
    rows = [outlier, steps, steps * np.float32(3.3e-17), np.roll(steps, block)]
    return np.array(rows, np.float32)


@pytest.mark.parametrize("n, block", [(n, block) for n in (1, 7, 64, 301)
                                      for block in sorted({0, 1, 4, 43, n})
                                      if n % max(block, 1) == 0])
def test_row_quantizers_match_on_edge_rows(n, block):
    """Q8 and NQ (block 0); QB and NQB with blocks of 1, n and sizes between (spec §2.2.1)."""
    rng = np.random.default_rng(n + block)
    x = np.concatenate([edge_rows(rng, n), block_rows(rng, n, max(block, 1))])
    with np.errstate(all="ignore"):
        assert bits(*KERNELS.quantize_rows(x, block)) == bits(
            *ref.NumpyKernels.quantize_rows(x, block))
        assert bits(*KERNELS.rms_quantize(x, 1e-5, block)) == bits(
            *ref.NumpyKernels.rms_quantize(x, 1e-5, block))


@pytest.mark.parametrize("eps", [1e-5, 0.0])
@pytest.mark.parametrize("n", [1, 7, 64, 301])
def test_rms_norm_matches_on_edge_rows(n, eps):
    """RN (spec §2.7) on the edge rows, on rows at +-amax (Σ q² past int32, rounded to
    float32), on rows below, just above and far above Q_TINY (the norm overflows), with
    gains holding zeros, signs and huge values (no NaN gain: which of two NaN operands a
    product keeps is the compiler's choice)."""
    rng = np.random.default_rng(n)
    signs = np.where(rng.random(n) < 0.5, 1, -1)
    x = np.concatenate([edge_rows(rng, n), [signs * 3.0, signs * 3e38],
                        rng.standard_normal((3, n)) * [[1e-40], [1e-19], [1e30]]])
    x = x.astype(np.float32)
    gains = np.array([rng.standard_normal(n), rng.choice(SPECIAL[~np.isnan(SPECIAL)], n)],
                     np.float32)
    for gain in gains:
        with np.errstate(all="ignore"):
            assert bits(KERNELS.rms_norm(x, gain, eps)) == bits(rms_norm(x, gain, eps))


def test_swiglu_and_exp2_match_on_special_values():
    rng = np.random.default_rng(0)
    values = np.concatenate([SPECIAL, rng.standard_normal(2000).astype(np.float32) * 30,
                             np.linspace(-130, 130, 5201, dtype=np.float32)])
    gu = np.concatenate([values[None], np.roll(values, 7)[None]], axis=1)
    with np.errstate(all="ignore"):
        assert bits(KERNELS.swiglu(gu)) == bits(ref.swiglu(gu))


def linear_inputs(rng, shape, block_inputs):
    """A linear's quantized input rows: q int8, or block inputs p = m_b * q int16 (§2.2.1)."""
    if block_inputs:
        return rng.integers(-127 * 255, 127 * 255 + 1, shape).astype(np.int16)
    return rng.integers(-127, 128, shape, dtype=np.int8)


@pytest.mark.parametrize("block_inputs", [False, True])
@pytest.mark.parametrize("n_tok", [1, 2, 3, 5])
@pytest.mark.parametrize("n_out", [1, 4, 6, 13, 17])
@pytest.mark.parametrize("n_in", [7, 40, 64, 300])
def test_linear_matches_for_every_tail(n_tok, n_out, n_in, block_inputs):
    """Token tiles, row tiles and row blocks with remainders; inputs shorter than, not a
    multiple of, and a multiple of numba_dot.LANES, and longer than numba_dot.WIDE_CHUNK; q
    int8 and block inputs."""
    rng = np.random.default_rng(n_tok * 100 + n_out + n_in * 10000)
    w = rng.integers(-127, 128, (n_out, n_in), dtype=np.int8)
    scale = rng.random(n_out).astype(np.float32)
    q = linear_inputs(rng, (n_tok, n_in), block_inputs)
    a = rng.random(n_tok).astype(np.float32)
    assert bits(KERNELS.linear(w, scale)(q, a)) == bits(Linear(w, scale)(q, a))


@pytest.mark.parametrize("block_inputs", [False, True])
@pytest.mark.parametrize("multipliers", [False, True])
@pytest.mark.parametrize("n_tok", [1, 2, 3])
def test_linear_with_a_bias_matches(n_tok, multipliers, block_inputs):
    """A bias is added after the row scale (spec §3), for every tile tail, int8 and int4, q
    and block inputs; bias values include -0.0 (-0.0 + -0.0 stays -0.0), infinities and NaN."""
    rng = np.random.default_rng(n_tok + 10 * multipliers + 100 * block_inputs)
    n_out, n_in, group = 21, 48, 16 if multipliers else 0
    w = (rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8) if multipliers else
         rng.integers(-127, 128, (n_out, n_in), dtype=np.int8))
    m = rng.integers(0, 256, (n_out, n_in // 16), dtype=np.uint8) if multipliers else None
    scale = (rng.random(n_out) - 0.5).astype(np.float32)
    bias = rng.choice(SPECIAL, n_out)
    q = linear_inputs(rng, (n_tok, n_in), block_inputs)
    q[0] = 0                                          # acc 0: y is -0.0 where ws < 0
    a = rng.random(n_tok).astype(np.float32)
    got = KERNELS.linear(w, scale, m, group, bias=bias)(q, a)
    assert bits(got) == bits(Linear(w, scale, m, group, bias=bias)(q, a))


@pytest.mark.parametrize("block_inputs", [False, True])
@pytest.mark.parametrize("group", [2, 8, 16, 48, 96])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_int4_linear_matches_grouped_and_folded(group, n_tok, block_inputs):
    """Group sizes that are multiples of numba_dot.LANES keep a multiplier per LANES columns;
    others have their multipliers folded into the weights."""
    rng = np.random.default_rng(group * 10 + n_tok)
    n_out, n_in = 21, 96
    packed = rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8)
    m = rng.integers(0, 256, (n_out, n_in // group), dtype=np.uint8)
    scale = rng.random(n_out).astype(np.float32)
    q = linear_inputs(rng, (n_tok, n_in), block_inputs)
    a = rng.random(n_tok).astype(np.float32)
    got = KERNELS.linear(packed, scale, m, group)(q, a)
    assert bits(got) == bits(Linear(packed, scale, m, group)(q, a))


def test_int8_accumulator_at_its_largest():
    """K = 2**16 inputs of 127 * 127: acc = 2**16 * 16129, the largest an int8 file allows."""
    k = 2 ** 16
    w = np.stack([np.full(k, 127), np.full(k, -127), np.tile([127, -127], k // 2)]).astype(np.int8)
    q = np.full((2, k), 127, np.int8)
    a, scale = np.ones(2, np.float32), np.ones(3, np.float32)
    got = KERNELS.linear(w, scale)(q, a)
    assert bits(got) == bits(Linear(w, scale)(q, a))
    assert got[0].tolist() == [np.float32(k * 16129), np.float32(-k * 16129), 0.0]


def test_int4_accumulator_at_the_spec_bound():
    """127 * 8 * K * max(m) just below 2**31 (spec §3), every term of one sign."""
    k, group = 8256, 32
    assert 127 * 8 * k * 255 <= 2 ** 31 - 1
    packed = np.full((2, k // 2), 0x88, np.uint8)            # every value -8
    m = np.full((2, k // group), 255, np.uint8)
    q = np.full((1, k), -127, np.int8)
    a, scale = np.ones(1, np.float32), np.ones(2, np.float32)
    got = KERNELS.linear(packed, scale, m, group)(q, a)
    assert bits(got) == bits(Linear(packed, scale, m, group)(q, a))
    assert got[0, 0] == np.float32(127 * 8 * k * 255)


@pytest.mark.parametrize("group", [0, 8, 32])
def test_block_input_accumulators_far_past_int32(group):
    """Block inputs at |p| = 32385 against weights of one sign at their largest, |w| = 127
    (int8) or 8 * 255 (int4: its multipliers folded into int16 weights, group 8, or one per
    numba_dot.LANES columns, group 32), and against alternating signs: acc reaches 32385 * 127
    * K or 32385 * 2040 * K (K past numba_dot.WIDE_CHUNK, not a multiple of it, with a tail
    past numba_dot.LANES for int8), where every int32 lane of a chunk nears 2**31."""
    k = 2 ** 16 + 7 if group == 0 else 8256
    signs = np.tile([1, -1], k)[:k]
    if group == 0:
        w, m, largest = np.stack([np.full(k, 127), -127 * signs]).astype(np.int8), None, 127
    else:                                             # -8 everywhere, or -8 and 7 alternately
        w = np.stack([np.full(k // 2, 0x88), np.full(k // 2, 0x78)]).astype(np.uint8)
        m, largest = np.full((2, k // group), 255, np.uint8), 8 * 255
    p = np.stack([np.full(k, -32385), 32385 * signs]).astype(np.int16)
    a, scale = np.ones(2, np.float32), np.ones(2, np.float32)
    got = KERNELS.linear(w, scale, m, group)(p, a)
    assert bits(got) == bits(Linear(w, scale, m, group)(p, a))
    assert abs(got[0, 0]) == np.float32(32385 * largest * k)


@pytest.mark.parametrize("window", [0, 1, 4, 11])
def test_attention_matches_with_zero_value_rows_and_gqa(window):
    """Keys written in uneven chunks over 5-position blocks; some value rows are all zero
    (sv = 0), so some queries see only zero values (svmax = 0, output 0)."""
    rng = np.random.default_rng(window)
    n_heads, n_kv, head_dim, n = 6, 2, 8, 23
    cache = KVCache(KERNELS.new_pool(5, n_kv, head_dim), 1, window)    # both read this one
    for pos0, chunk in ((0, 4), (4, 1), (5, 9), (14, 9)):
        kh = rng.standard_normal((chunk, n_kv, head_dim)).astype(np.float32)
        vh = rng.standard_normal((chunk, n_kv, head_dim)).astype(np.float32)
        vh[rng.random((chunk, n_kv)) < 0.5] = 0
        cache.write(0, pos0, *ref.quantize_rows(kh), *ref.quantize_rows(vh))
    qh = (rng.standard_normal((n - 14, n_heads, head_dim)) * 4).astype(np.float32)
    assert bits(KERNELS.attend(qh, cache, 0, 14)) == bits(attend_cached(qh, cache, 0, 14))
    cache.free()


def test_attention_sums_past_one_int32_chunk_at_the_bound():
    """4099 keys (odd, past PV_CHUNK) with every score equal, so every U_j = 2**24, and
    every value +-127: the int32 partial sums of U vq reach their bound. head_dim 40 also
    leaves columns past the last multiple of numba_dot.LANES."""
    n_heads, head_dim, n = 2, 40, numba_cpu.PV_CHUNK + 3
    rng = np.random.default_rng(0)
    cache = KVCache(KERNELS.new_pool(16, 1, head_dim), 1, 0)
    kh = np.ones((n, 1, head_dim), np.float32)
    vh = np.where(rng.random((n, 1, head_dim)) < 0.5, 1, -1).astype(np.float32)
    vh[:, :, :3] = 1                                  # columns whose sums only grow
    cache.write(0, 0, *ref.quantize_rows(kh), *ref.quantize_rows(vh))
    qh = np.zeros((1, n_heads, head_dim), np.float32)
    qh[0, 1] = rng.standard_normal(head_dim)
    assert bits(KERNELS.attend(qh, cache, 0, n - 1)) == bits(attend_cached(qh, cache, 0, n - 1))
    cache.free()


def test_attention_with_an_infinite_value_scale_gives_the_reference_nan():
    """A value row holding inf quantizes to scale inf (svmax = inf): the heads of its kv
    head get the reference's NaN, the others stay finite."""
    rng = np.random.default_rng(1)
    cache = KVCache(KERNELS.new_pool(4, 2, 16), 1, 0)
    kh = rng.standard_normal((9, 2, 16)).astype(np.float32)
    vh = rng.standard_normal((9, 2, 16)).astype(np.float32)
    vh[2, 1, 3] = np.inf
    with np.errstate(invalid="ignore"):
        cache.write(0, 0, *ref.quantize_rows(kh), *ref.quantize_rows(vh))
        qh = rng.standard_normal((6, 4, 16)).astype(np.float32)
        got, want = KERNELS.attend(qh, cache, 0, 3), attend_cached(qh, cache, 0, 3)
    assert np.isnan(got[:, 32:]).all() and not np.isnan(got[:, :32]).any()
    assert bits(got) == bits(want)
    cache.free()


@pytest.mark.parametrize("name", ["int4-mha", "int4-eos", "int8-gqa"])
def test_thread_count_never_changes_a_bit(model_files, monkeypatch, name):
    """With PARALLEL_WORK 0 every kernel of these small models runs parallel, and attention
    splits each one-token step's heads over the threads."""
    monkeypatch.setattr(numba_cpu, "PARALLEL_WORK", 0)
    prompt = list(range(1, 40))
    runs = []
    for threads in (1, 2):
        with tinyloop.Model(model_files[name], backend="numba", threads=threads) as model:
            runs.append((model.logits(prompt, prefill_chunk=16),
                         model.generate(prompt, max_tokens=6, return_logits=True)))
    (logits1, (tokens1, steps1)), (logits2, (tokens2, steps2)) = runs
    assert bits(logits1, *steps1) == bits(logits2, *steps2) and tokens1 == tokens2


FMA_PROBE = """
import json, sys
import numba, numpy as np, tinyloop
from tinyloop.fallback import numba_cpu
with tinyloop.Model(sys.argv[1], backend="numba") as model:
    model.generate([1, 2, 3], max_tokens=3, cache_window=2)
kernels, x = numba_cpu.NumbaKernels(), np.ones((2, 8), np.float32)
kernels.rms_norm(x, x[0], 1e-5)
linear = kernels.linear(np.ones((3, 8), np.int8), x[0, :3], bias=x[0, :3])
linear(np.ones((2, 8), np.int8), x[:, 0])
linear(*kernels.rms_quantize(x, 1e-5, 4))          # block activations: NQB, QB, int16 inputs
kernels.quantize_rows(x, 4)
found = {}
for f in list(vars(numba_cpu).values()) + list(vars(numba_cpu.S).values()):
    if isinstance(f, numba.core.dispatcher.Dispatcher) and f.signatures:
        asm = "".join(f.inspect_asm().values())
        found[f.__name__] = [asm.count("vmulss"), [line.strip() for line in asm.splitlines()
                             if any(op in line for op in FMA_OPS)]]
print(json.dumps(found))
"""
FMA_OPS = ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")


def test_no_kernel_contains_a_fused_multiply_add(model_files, tmp_path):
    """Compiles every numba_cpu kernel afresh (an empty NUMBA_CACHE_DIR: cached code cannot be
    inspected), runs a model and the kernels it may not use (RN, a biased linear) through
    them and reads their x86 assembly."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", f"FMA_OPS = {FMA_OPS!r}" + FMA_PROBE,
                          str(model_files["int8-gqa"])], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    found = json.loads(out)
    kernels = {name for name in found if name.endswith("_kernel")}
    assert kernels == {"quantize_rows_kernel", "rms_quantize_kernel", "rms_norm_kernel",
                       "linear_kernel", "attend_kernel", "split_heads_kernel", "swiglu_kernel"}
    assert sum(n_mul for n_mul, _ in found.values()) > 0          # float code was inspected
    assert {name: lines for name, (_, lines) in found.items() if lines} == {}


def test_the_fma_check_can_fail():
    """Control: with fastmath, LLVM does contract a*b+c on this CPU."""
    if "+fma" not in llvmlite.binding.get_host_cpu_features().flatten():
        pytest.skip("this CPU has no FMA instructions")
    fused = numba.njit(fastmath=True)(lambda a, b, c: a * b + c)
    fused(np.float32(1), np.float32(2), np.float32(3))
    asm = "".join(fused.inspect_asm().values())
    assert any(op in asm for op in FMA_OPS)


logit_rows = st.one_of(
    st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=300),
    st.lists(st.sampled_from([0.0, 1.0, 1.0, -2.5, 7.25, 3e38, -3e38]), min_size=2, max_size=50))


@given(z=logit_rows, data=st.data())
def test_sampler_picks_the_reference_token(z, data):
    """Ties, huge spreads, tiny temperatures (z / T overflows), every top-k / top-p."""
    z = np.array(z, np.float32)
    params = GenerationParams(
        max_tokens=1, loops=1, cache_window=0, stop_sequences=(), prefill_chunk=1,
        temperature=data.draw(st.sampled_from([0.0, 1e-30, 0.05, 0.7, 1.0, 3.0])),
        top_k=data.draw(st.integers(0, len(z) + 1)), top_p=data.draw(st.floats(1e-6, 1.0)),
        repetition_penalty=data.draw(st.sampled_from([1.0, 0.7, 1.3])),
        seed=data.draw(st.integers(0, 2**64 - 1)))
    history = data.draw(st.lists(st.integers(0, len(z) - 1), max_size=8))
    with np.errstate(over="ignore"):                  # the penalty may overflow to inf
        for pos in range(3):
            got = numba_cpu.sample(z, history, params, pos)
            assert got == reference_sample(z, history, params, pos)


def test_sampler_rejects_non_finite_logits():
    with pytest.raises(NumericError, match="non-finite logits"):
        numba_cpu.sample(np.array([0.0, np.inf], np.float32), [], None, 0)


def test_threads_racing_on_a_growing_kv_arena_lose_no_write(tmp_path):
    """The arena doubles by copying into new arrays; a KV write racing that on another thread
    once landed in the arena being replaced and was lost (wrong tokens about one run in three
    here). Four threads share a fresh model (small blocks: the arena grows often) and must get
    what the numpy reference gets alone."""
    path = tmp_path / "m.tinyloop"
    tinyloop.random_model(path, seed=3)
    rng = np.random.default_rng(9)
    systems = [rng.integers(0, 256, size=n).tolist() for n in (18, 27, 33)]
    calls = [(systems[i % 3] + [i], dict(max_tokens=3, temperature=0.9, seed=i)) for i in range(24)]
    with tinyloop.Model(path, backend="numpy", prefix_cache_bytes=0) as reference:
        want = [reference.generate(prompt, **kw) for prompt, kw in calls]
    for trial in range(20):
        with tinyloop.Model(path, backend="numba", block_size=4, prefix_cache_bytes=20000) as model:
            assert generate_on_threads(model, calls) == want, f"trial {trial}"


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_a_prefix_collected_while_its_pool_is_locked_frees_without_deadlock(backend, model_files):
    """The garbage collector may finalize a PrefixCache (freeing its KV blocks) in the middle
    of the pool's own locked code (the numba arena's store), on the same thread: that must not
    deadlock."""
    import gc
    import threading
    with tinyloop.Model(model_files["int8-gqa"], backend=backend) as model:
        prefix = model.build_prefix_cache([1, 2, 3, 4, 5])
        pool = prefix._state.cache.pool
        cycle = [prefix]
        cycle.append(cycle)              # only the collector frees it
        del prefix, cycle

        def collect_under_the_lock():
            with pool._lock:
                gc.collect()

        worker = threading.Thread(target=collect_under_the_lock, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "freeing a collected prefix deadlocked on its pool's lock"
