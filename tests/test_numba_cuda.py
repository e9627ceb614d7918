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
    return {
        "embed_kernel": [(t.int32[::1], i8_2, f1, f2)],
        "add_kernel": [(f2, f2, f2)],
        "swiglu_kernel": [(f2, f2)],
        "quantize_rows_kernel": [(f2, i8_2, f1)],
        "rms_quantize_kernel": [(f2, t.float32, i8_2, f1)],
        "rope_kernel": [(f2, f2, f2, f3, f3)],
        "quantize_kv_kernel": [(f3, f2, n, i8_3, f2, i8_3, f2)],
        "linear_kernel": [(i8_2, f1, w, f1, f2) for w in (i8_2, t.int16[:, ::1])],
        "attend_kernel": [(f3, i8_4, t.float32[:, :, ::1], i8_4, t.float32[:, :, ::1],
                           t.int32[::1], n, n, n, n, n, f2)],
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
