"""The numba-cuda backend against the numpy reference, bit for bit, on tiny models.

Runs on a real GPU, or on numba's CPU simulator in its own pytest process (numba reads the
variable once, at import):

    NUMBA_ENABLE_CUDASIM=1 pytest tests/test_numba_cuda.py

The simulator runs each GPU thread as a Python thread, so these models and prompts are tiny.
Elsewhere the tests skip (or fail, when TINYLOOP_REQUIRE_BACKENDS names numba-cuda). The
broad property suite joins with
    TINYLOOP_TEST_BACKENDS=numba-cuda pytest tests/test_cross_backend.py   (bench/gpu_check.sh runs both)

The PTX of every kernel is checked twice: compiled for sm_90 without a GPU wherever
numba-cuda and libNVVM are installed (pip install numba-cuda "cuda-toolkit[nvvm]==13.*"),
and as actually compiled on a real GPU.
"""
import re

import numpy as np
import pytest

import tinyloop
from conftest import assert_same_bits, env_names, require_backend

# Before any numba import: without numba the module skips (or, when required, cuda_backend
# fails saying why).
if "numba-cuda" not in env_names("TINYLOOP_REQUIRE_BACKENDS"):
    pytest.importorskip("numba", reason="numba is not installed: no numba-cuda backend")

TINY = dict(vocab_size=48, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=24,
            n_pre_blocks=1, default_loops=2, max_seq_len=40)
FORMATS = {"int8": dict(weight_format="int8"), "int4": dict(weight_format="int4", group_size=8)}
PTX_HAZARDS = re.compile(r"\b(fma|mad)\.\S*f(16|32|64)|\.approx\.|\.ftz\b|div\.full\.")


def hazards(ptx):
    """PTX lines that could break bit-exactness: a fused multiply-add on floats, approximate
    division or square root, flush-to-zero."""
    return [line.strip() for line in ptx.splitlines() if PTX_HAZARDS.search(line)]


@pytest.fixture(scope="module")
def cuda_backend():
    require_backend("numba-cuda")


@pytest.fixture(scope="module")
def pairs(cuda_backend, tmp_path_factory):
    """format -> (numpy model, numba-cuda model) of a tiny random model. block_size 2 spreads
    a prompt over many blocks, so the device arena grows and copy-on-write runs."""
    opened = {}
    for fmt, extra in FORMATS.items():
        path = tmp_path_factory.mktemp("cuda") / f"{fmt}.tinyloop"
        tinyloop.random_model(path, seed=4, **TINY, **extra)
        opened[fmt] = (tinyloop.Model(path, backend="numpy"),
                       tinyloop.Model(path, backend="numba-cuda", block_size=2))
    yield opened
    for models in opened.values():
        for model in models:
            model.close()


PROMPT = [3, 17, 5, 40, 22, 9, 31, 2]


@pytest.fixture(scope="module")
def kernels(cuda_backend):
    from tinyloop.fallback.numba_cuda import CudaKernels
    return CudaKernels()


def assert_same_bits_or_nan(got, want):
    """Bit for bit, except that a NaN may be any NaN: the default NaN a GPU makes (inf - inf,
    0 / 0) is not x86's."""
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert_same_bits(np.where(nan, np.float32(0), got), np.where(nan, np.float32(0), want))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the simulator's numpy scalars: inf * 0
def test_rms_norm_matches_numpy_on_edge_rows(kernels):
    """RN (spec §2.7) on random, zero, tiny, huge, non-finite and +-amax rows, one of them a
    single element."""
    from numba import cuda

    from tinyloop.fallback.numerics import rms_norm
    rng = np.random.default_rng(5)
    n = 7
    x = np.array([rng.standard_normal(n), np.zeros(n), rng.standard_normal(n) * 1e-19,
                  np.full(n, 1e-30), [3e38, -3e38, 1, 0, -0.0, 2.5, 1e-45],
                  [np.nan, np.inf, 1, 2, 3, 4, 5], [-np.inf] + [1.0] * 6,
                  np.where(rng.random(n) < 0.5, 7.0, -7.0)], np.float32)
    gain = np.array([1.5, -2, 0, -0.0, 3e38, 1e-3, 1], np.float32)
    with np.errstate(all="ignore"):
        want, want_one = rms_norm(x, gain, 1e-5), rms_norm(x[:1, :1], gain[:1], 1e-5)
        got = kernels.rms_norm(cuda.to_device(x), kernels.table(gain), 1e-5).copy_to_host()
        got_one = kernels.rms_norm(cuda.to_device(x[:1, :1]), kernels.table(gain[:1]), 1e-5)
    assert_same_bits_or_nan(got, want)
    assert_same_bits_or_nan(got_one.copy_to_host(), want_one)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the simulator's numpy scalars: inf * 0
@pytest.mark.parametrize("block", [1, 4, 8])
def test_block_quantizers_match_numpy(kernels, block):
    """QB and NQB (spec §2.2.1) on rows of 8 in blocks of 1, 4 and 8: an outlier block, block
    maxima at multiples of amax / 255 (ceil's edges), rows below 2^-64, zero, huge and
    non-finite rows."""
    from numba import cuda

    from tinyloop.fallback.numerics import quantize_input, rms_quantize_input
    rng = np.random.default_rng(block)
    steps = (np.arange(8) // block) * np.float32(0.37) * np.array([1, -1] * 4)
    x = np.array([[1e3, -2e-3, 5e-4, 1e-3, 3e-4, -1e-4, 2e-3, 1e-3], steps,
                  steps[::-1] * 1e-17, np.full(8, 1e-20), np.zeros(8), rng.standard_normal(8),
                  [np.nan, np.inf, 1, -2, 3, -np.inf, 0, 5],
                  [3e38, -3e38, 1, 0, -0.0, 2.5, 1e-45, 7]], np.float32)
    with np.errstate(all="ignore"):
        p, s = kernels.quantize_rows(cuda.to_device(x), block)
        want_p, want_s = quantize_input(x, block)
        assert (p.copy_to_host() == want_p).all() and p.dtype == np.int16
        assert_same_bits(s.copy_to_host(), want_s)
        p, a = kernels.rms_quantize(cuda.to_device(x), 1e-5, block)
        want_p, want_a = rms_quantize_input(x, 1e-5, block)
        assert (p.copy_to_host() == want_p).all()
        assert_same_bits_or_nan(a.copy_to_host(), want_a)


def test_block_inputs_sum_past_int32_across_tiles(kernels):
    """Block inputs at |p| = 32385 against int4 weights of -8 times 255 over K = 48 (three
    tiles, each tile's int32 sum near its bound): acc = 32385 * 2040 * 48 > 2**31, exact in
    int64; and alternating signs."""
    from numba import cuda

    from tinyloop.fallback.weights import Linear
    n_in = 48
    w = np.stack([np.full(n_in // 2, 0x88), np.full(n_in // 2, 0x78)]).astype(np.uint8)
    m = np.full((2, n_in // 8), 255, np.uint8)
    p = np.stack([np.full(n_in, -32385), np.tile([32385, -32385], n_in // 2)]).astype(np.int16)
    a, scale = np.ones(2, np.float32), np.ones(2, np.float32)
    got = kernels.linear(w, scale, m, 8)(cuda.to_device(p), cuda.to_device(a)).copy_to_host()
    assert_same_bits(got, Linear(w, scale, m, 8)(p, a))
    assert got[0, 0] == np.float32(32385 * 2040 * n_in)


@pytest.mark.parametrize("block_inputs", [False, True])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_linear_with_a_bias_matches_numpy(kernels, fmt, block_inputs):
    """The bias is added after the row scale (spec §3): -0.0 + b, infinities, NaN; q int8 and
    block inputs (int16, §2.2.1)."""
    from numba import cuda

    from tinyloop.fallback.weights import Linear
    rng = np.random.default_rng(6)
    n_out, n_in = 5, 16
    if fmt == "int8":
        w, m, group = rng.integers(-127, 128, (n_out, n_in), dtype=np.int8), None, 0
    else:
        w, group = rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8), 8
        m = rng.integers(0, 256, (n_out, n_in // group), dtype=np.uint8)
    scale = np.array([0.5, -0.25, 1, -3, 2], np.float32)
    bias = np.array([-0.0, 0.0, np.inf, np.nan, 1.5], np.float32)
    qmax = 127 * 255 if block_inputs else 127
    q = rng.integers(-qmax, qmax + 1, (3, n_in)).astype(np.int16 if block_inputs else np.int8)
    q[0] = 0                                          # acc 0: y is -0.0 where ws < 0
    a = np.array([1, 0.5, 3], np.float32)
    got = kernels.linear(w, scale, m, group, bias=bias)(cuda.to_device(q), cuda.to_device(a))
    assert_same_bits_or_nan(got.copy_to_host(), Linear(w, scale, m, group, bias=bias)(q, a))


def test_copy_is_independent_of_its_source(kernels):
    from numba import cuda
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    source = cuda.to_device(x)
    twin = kernels.copy(source)
    source.copy_to_device(np.zeros_like(x))
    assert_same_bits(twin.copy_to_host(), x)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_logits_match_numpy(pairs, fmt):
    ref, got = pairs[fmt]
    kw = dict(cache_window=3, prefill_chunk=5)
    assert_same_bits(got.logits(PROMPT, **kw), ref.logits(PROMPT, **kw))


def test_prefix_suffix_generation_matches_numpy(pairs):
    """A 5-token prefix at depth 3 serves depth 2 with a suffix, twice (its partial last
    block is copied on write), sampling with every knob."""
    ref, got = pairs["int4"]
    run = dict(loops=2, max_tokens=3, temperature=0.8, top_k=10, top_p=0.9,
               repetition_penalty=1.3, seed=99, suffix=PROMPT[5:], prefill_chunk=2,
               return_logits=True)
    want = ref.generate_from_prefix_cache(ref.build_prefix_cache(PROMPT[:5], loops=3), **run)
    prefix = got.build_prefix_cache(PROMPT[:5], loops=3)
    for _ in range(2):
        tokens, logits = got.generate_from_prefix_cache(prefix, **run)
        assert tokens == want[0]
        assert_same_bits(logits, want[1])


def test_looped_v2_model_matches_numpy(cuda_backend, tmp_path):
    """Every version-2 part on the device: embed_scale, the injection adapter from a zero
    state, the step norm, qkv biases, sandwich norms, the coda norm and a coda block. A
    prefix built at depth 2 runs the coda after iteration 1 on a copy of the state; it then
    serves depth 1 (the coda slots of depth 1) with a suffix."""
    path = tmp_path / "v2.tinyloop"
    tinyloop.random_model(path, seed=4, **TINY, n_core_blocks=2, n_coda_blocks=1,
                          block_layout="sandwich", qkv_bias=True, injection=True, step_norm=True,
                          coda_norm=True, embed_scale=4.0)
    run = dict(loops=1, max_tokens=2, suffix=PROMPT[4:6], return_logits=True)
    with tinyloop.Model(path, backend="numpy") as ref, \
            tinyloop.Model(path, backend="numba-cuda", block_size=2) as got:
        want = ref.generate_from_prefix_cache(ref.build_prefix_cache(PROMPT[:4], loops=2), **run)
        tokens, logits = got.generate_from_prefix_cache(got.build_prefix_cache(PROMPT[:4],
                                                                               loops=2), **run)
    assert tokens == want[0]
    assert_same_bits(logits, want[1])


def test_compiled_kernels_have_no_fma_approximation_or_ftz(pairs):
    """Reads the PTX of every kernel the runs above compiled (a real GPU only). The control
    kernel shows the hazard is real: NVVM fuses a plain a*b+c even without fastmath."""
    from numba import config, cuda

    from tinyloop.fallback import numba_cuda
    if config.ENABLE_CUDASIM:
        pytest.skip("the simulator compiles no PTX")
    pairs["int8"][1].generate(PROMPT, max_tokens=2, cache_window=3)
    kernels = [kernel for name, kernel in vars(numba_cuda).items()
               if name.endswith("_kernel") and kernel.signatures]
    assert len(kernels) >= 9
    found = {k.__name__: [line for ptx in k.inspect_asm().values() for line in hazards(ptx)]
             for k in kernels}
    assert found == {name: [] for name in found}

    @cuda.jit(fastmath=False)
    def plain(a, b, c, out):
        out[0] = a[0] * b[0] + c[0]

    args = [cuda.to_device(np.ones(1, np.float32)) for _ in range(4)]
    plain[1, 1](*args)
    assert any("fma.rn.f32" in ptx for ptx in plain.inspect_asm().values())


def kernel_signatures():
    """Every numba_cuda kernel with the argument types the backend launches it with."""
    from numba import types as t
    f1, f2, f3 = t.float32[::1], t.float32[:, ::1], t.float32[:, :, ::1]
    i8_2, i8_3, i8_4, n = t.int8[:, ::1], t.int8[:, :, ::1], t.int8[:, :, :, ::1], t.int64
    i16_2 = t.int16[:, ::1]                                       # block inputs; int4 weights
    kv_rows = [(i8_3, i8_4), (t.uint8[:, :, ::1], t.uint8[:, :, :, ::1])]   # int8, int4 KV
    return {
        "embed_kernel": [(t.int32[::1], i8_2, f1, t.float32, f2)],
        "add_kernel": [(f2, f2, f2)],
        "swiglu_kernel": [(f2, f2)],
        "gate_kernel": [(f2, f2, n, f2)],
        "loop_mix_kernel": [(f3, f2, f2, i8_2, f1, f1, f2)],
        "quantize_rows_kernel": [(f2, n, q, f1) for q in (i8_2, i16_2)],
        "rms_quantize_kernel": [(f2, t.float32, n, q, f1) for q in (i8_2, i16_2)],
        "rms_norm_kernel": [(f2, f1, t.float32, f2)],
        "rope_kernel": [(f2, f2, f2, f3, f3)],
        "quantize_kv_kernel": [(f3, f2, n, t.float32, kv, f2, kv, f2) for kv, _ in kv_rows],
        "linear_kernel": [(q, f1, w, f1, f1, f2) for q in (i8_2, i16_2) for w in (i8_2, i16_2)],
        "attend_kernel": [(f3, kv, t.float32[:, :, ::1], kv, t.float32[:, :, ::1],
                           t.int32[::1], n, n, n, n, n, n, f2) for _, kv in kv_rows],
    }


def test_ptx_for_sm90_has_no_hazards_without_a_gpu(monkeypatch):
    """Compiles every kernel to PTX for compute capability 9.0 with libNVVM alone."""
    from types import SimpleNamespace

    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        pytest.skip("the simulator compiles no PTX")
    if getattr(cuda, "implementation", "") != "NVIDIA":
        pytest.skip("needs the numba-cuda package (numba's built-in CUDA target is deprecated)")
    try:
        cuda.compile_ptx(lambda a: None, "void(float32[:])", cc=(9, 0))
    except Exception as exc:  # no libNVVM: numba-cuda's error types vary between versions
        pytest.skip(f"numba.cuda cannot compile PTX here: {str(exc).splitlines()[0][:120]}")
    from numba.cuda import dispatcher
    monkeypatch.setattr(dispatcher, "get_current_device",       # device functions ask for it
                        lambda: SimpleNamespace(compute_capability=(9, 0)))
    from tinyloop.fallback import numba_cuda
    found = {}
    for name, signatures in kernel_signatures().items():
        for sig in signatures:
            ptx, _ = cuda.compile_ptx(getattr(numba_cuda, name).py_func, sig, cc=(9, 0))
            assert ".entry" in ptx
            found[f"{name}{sig}"] = hazards(ptx)
    assert found == {key: [] for key in found}
    kernels = {name for name in vars(numba_cuda) if name.endswith("_kernel")}
    assert kernels == set(kernel_signatures())                 # every kernel was checked

    def plain(a, b, c, out):
        out[0] = a[0] * b[0] + c[0]

    ptx, _ = cuda.compile_ptx(plain, "void(float32[:], float32[:], float32[:], float32[:])",
                              cc=(9, 0))
    assert any("fma.rn.f32" in line for line in hazards(ptx))    # the check can fail
