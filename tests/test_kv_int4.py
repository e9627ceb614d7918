"""The int4 KV mode (Model(kv_mode="int4"), docs/api.md "KV modes", docs/spec.md §4): keys
and values quantized with Q4 (qmax 7) and packed two a byte, attention unchanged.

- the packing is the spec's (element 2i in the low nibble), the same in the numpy reference and
  in the numba kernels' scalar helpers (which the CUDA kernels share), over every value pair;
- every backend gives the numpy reference's tokens and bit-identical logits in int4 mode, over
  drawn shapes, thread counts and block sizes, chunk sizes, windows, sampling, prefixes (and
  nesting), batches, speculative decoding, warm start, automatic prefix cache hits and misses;
- int4 differs from int8 but is close; its KV blocks take about half the bytes;
- the mode is chosen by kv_mode or TINYLOOP_KV_INT4, reported by runtime(), and the CLI takes
  --kv-mode; bad values are refused, naming what was wrong (TINYLOOP_KV_H_MODE, the
  hidden-state prefixes: test_hidden_prefix.py).

Backends: TINYLOOP_TEST_BACKENDS but numpy (conftest.py), as in test_cross_backend.py; the
numba-cuda simulator runs in its own process (NUMBA_ENABLE_CUDASIM=1) on tiny shapes.
"""
import io
import itertools
import math

import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop.cli import main as cli_main
from tinyloop.fallback.forward import kv_row
from tinyloop.fallback.kvcache import BlockPool, KVCache
from tinyloop.fallback.numerics import quantize_rows
from tinyloop.modelfile import pack_int4, unpack_int4
from tinyloop.quickbench import backend_kwargs

from conftest import (COMPARED_BACKENDS, assert_same_bits, assert_same_generation,
                      backend_fixture, backend_given, simulated)
from strategies import engine_settings, logits_requests, model_shapes, prompts, sampling

# 64-wide heads: the scales are a small part of a row, so int4 blocks are close to half.
WIDE_SHAPE = dict(vocab_size=200, d_model=64, n_heads=2, n_kv_heads=2, head_dim=64, ffn_dim=96,
                  n_pre_blocks=1, default_loops=2, max_seq_len=128)


backend = backend_fixture(COMPARED_BACKENDS)


def int4_models(data, zoo, backend):
    """(the drawn model on `backend`, the numpy reference of the same file), both int4."""
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    got = zoo.open(shape, backend, kv_mode="int4", **data.draw(engine_settings(), "engine"))
    return got, zoo.open(shape, "numpy", kv_mode="int4")


# -- the packing ------------------------------------------------------------------------------

def test_kv_rows_are_q4_packed_low_nibble_first():
    x = np.random.default_rng(1).standard_normal((5, 3, 8)).astype(np.float32)
    packed, scales = kv_row(x, 4)
    q, s = quantize_rows(x, 7)
    assert packed.dtype == np.uint8 and packed.shape == (5, 3, 4)
    assert np.abs(q).max() == 7
    assert np.array_equal(packed & 0xF, q[..., 0::2].view(np.uint8) & 0xF)
    assert np.array_equal(packed >> 4, q[..., 1::2].view(np.uint8) & 0xF)
    assert np.array_equal(scales.view(np.uint32), s.view(np.uint32))
    q8, _ = kv_row(x, 8)
    assert q8.dtype == np.int8 and np.array_equal(q8, quantize_rows(x)[0])


def test_numba_helpers_pack_and_read_every_value_pair_as_the_reference():
    pytest.importorskip("numba", reason="numba is not installed")
    from numba import njit

    from tinyloop.fallback.numba_cpu import S
    store_kv_row, kv_value = S.store_kv_row, S.kv_value

    @njit
    def store(q, dst):
        store_kv_row(q, dst)

    @njit
    def read(row, n, packed):
        out = np.empty(n, np.int32)
        for d in range(n):
            out[d] = kv_value(row, d, packed)
        return out

    q = np.array(list(itertools.chain(*itertools.product(range(-7, 8), repeat=2))), np.int8)
    packed = np.empty(len(q) // 2, np.uint8)
    store(q, packed)
    assert np.array_equal(packed, pack_int4(q))
    assert np.array_equal(read(packed, len(q), True), q)
    assert np.array_equal(read(q, len(q), False), q)
    copied = np.empty_like(q)
    store(q, copied)
    assert np.array_equal(copied, q)


def test_the_cache_reads_int4_blocks_back_as_their_values():
    pool = BlockPool(3, 2, 4, kv_bits=4)
    cache = KVCache(pool, 1, 0)
    x = np.random.default_rng(2).standard_normal((7, 2, 4)).astype(np.float32)
    (kq, sk), (vq, sv) = kv_row(x, 4), kv_row(-x, 4)
    cache.write(0, 0, kq, sk, vq, sv)
    k, ks, v, vs = cache.read(0, 2, 7)
    assert k.dtype == v.dtype == np.int8
    assert np.array_equal(k, unpack_int4(kq)[2:]) and np.array_equal(v, unpack_int4(vq)[2:])
    assert np.array_equal(ks, sk[2:]) and np.array_equal(vs, sv[2:])
    assert cache.nbytes == 3 * 2 * 3 * 2 * (4 // 2 + 4)


# -- every backend is the reference in int4 mode -------------------------------------------------

@backend_given(data=st.data())
def test_int4_logits_match_numpy(backend, zoo, data):
    got, ref = int4_models(data, zoo, backend)
    with got, ref:
        prompt = data.draw(prompts(ref.config()["vocab_size"],
                                   max_size=16 if simulated(backend) else 40), "prompt")
        kw = data.draw(logits_requests())
        assert_same_bits(got.logits(prompt, **kw), ref.logits(prompt, **kw))


@backend_given(data=st.data())
def test_int4_generation_and_prefix_cache_hits_match_numpy(backend, zoo, data):
    """The same request twice: the second run reuses the first's blocks from the automatic
    prefix cache (a hit), and both are the reference's."""
    got, ref = int4_models(data, zoo, backend)
    with got, ref:
        prompt = data.draw(prompts(ref.config()["vocab_size"], max_size=30), "prompt")
        kw = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 8)),
                  loops=data.draw(st.integers(1, 3)),
                  cache_window=data.draw(st.sampled_from([0, 2, 5])),
                  prefill_chunk=data.draw(st.integers(1, 16)), return_logits=True)
        want = ref.generate(prompt, **kw)
        for _ in range(2):
            assert_same_generation(got.generate(prompt, **kw), want)


@backend_given(data=st.data())
def test_int4_prefixes_batches_and_drafts_match_numpy(backend, zoo, data):
    """A prefix built at depth L_b (warm start or not) serves a shallower depth with a suffix,
    alone, in a batch, and drafting self-speculatively, all as the reference."""
    got, ref = int4_models(data, zoo, backend)
    with got, ref:
        vocab = ref.config()["vocab_size"]
        head = data.draw(prompts(vocab, max_size=20), "prefix")
        suffixes = data.draw(st.lists(prompts(vocab, min_size=0, max_size=6), min_size=1,
                                      max_size=1 if simulated(backend) else 3), "suffixes")
        deep = data.draw(st.integers(2, 4))
        build = dict(loops=deep, cache_window=data.draw(st.sampled_from([0, 3])),
                     prefill_chunk=data.draw(st.integers(1, 12)),
                     warm_start=data.draw(st.booleans()))
        run = dict(data.draw(sampling()), loops=data.draw(st.integers(2, deep)),
                   max_tokens=2 if simulated(backend) else 5,
                   prefill_chunk=data.draw(st.integers(1, 12)))
        ref_prefix = ref.build_prefix_cache(head, **build)
        prefix = got.build_prefix_cache(head, **build)
        want = [ref.generate_from_prefix_cache(ref_prefix, suffix=s, return_logits=True, **run)
                for s in suffixes]
        draft = dict(draft_loops=data.draw(st.integers(1, run["loops"] - 1)),
                     n_draft=data.draw(st.integers(1, 5)))
        for suffix, expected in zip(suffixes, want):
            assert_same_generation(got.generate_from_prefix_cache(
                prefix, suffix=suffix, return_logits=True, **run), expected)
            assert_same_generation(got.generate_from_prefix_cache(
                prefix, suffix=suffix, return_logits=True, **run, **draft), expected)
        batch = got.generate_batch(suffixes, prefix=prefix, return_logits=True, **run)
        for result, expected in zip(batch, want):
            assert_same_generation(result, expected)


# -- int4 against int8 ---------------------------------------------------------------------------

def test_int4_differs_from_int8_but_is_close(tmp_path):
    path = tmp_path / "wide.tinyloop"
    tinyloop.random_model(path, seed=4, **WIDE_SHAPE)
    prompt = np.random.default_rng(5).integers(0, WIDE_SHAPE["vocab_size"], 60)
    with tinyloop.Model(path, backend="numpy") as int8, \
            tinyloop.Model(path, backend="numpy", kv_mode="int4") as int4:
        a, b = int8.logits(prompt), int4.logits(prompt)
    assert not np.array_equal(a.view(np.uint32), b.view(np.uint32))
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() > 0.95, cosine.min()


def test_int4_blocks_take_about_half_the_bytes(backend, tmp_path):
    if simulated(backend):
        pytest.skip("minutes on the CUDA simulator for 64-wide heads; its pool's bytes are "
                    "the numba pool's (numba_arena.py), counted on numba")
    path = tmp_path / "wide.tinyloop"
    tinyloop.random_model(path, seed=4, **WIDE_SHAPE)
    prompt = list(range(16))          # a block of 16 per layer: the ratio is any length's
    held = {}
    for mode in ("int8", "int4"):
        with tinyloop.Model(path, **backend_kwargs(backend), kv_mode=mode,
                            prefix_cache_bytes=0) as model:
            held[mode] = model.build_prefix_cache(prompt).nbytes
    kept = 4 * WIDE_SHAPE["default_loops"] * WIDE_SHAPE["d_model"] + 4 * len(prompt)
    ratio = (held["int4"] - kept) / (held["int8"] - kept)
    d = WIDE_SHAPE["head_dim"]
    assert math.isclose(ratio, (d // 2 + 4) / (d + 4), rel_tol=0.02), held


def test_python_pool_counts_the_stored_bytes():
    for bits, row in ((8, 64), (4, 32)):
        pool = BlockPool(16, 3, 64, kv_bits=bits)
        block = pool.new_block()
        stored = sum(getattr(block, name).nbytes for name in ("kq", "sk", "vq", "sv"))
        assert pool.block_nbytes == stored == 2 * 16 * 3 * (row + 4)
    with pytest.raises(ValueError, match="kv_bits"):
        BlockPool(16, 3, 64, kv_bits=2)


# -- choosing the mode ---------------------------------------------------------------------------

@pytest.mark.parametrize("value, mode", [("1", "int4"), ("yes", "int4"), ("0", "int8"),
                                         ("", "int8"), (None, "int8")])
def test_tinyloop_kv_int4_chooses_the_default_mode(model_files, monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("TINYLOOP_KV_INT4", raising=False)
    else:
        monkeypatch.setenv("TINYLOOP_KV_INT4", value)
    with tinyloop.Model(model_files["int8-gqa"], backend="numpy") as model:
        assert model.kv_mode == model.runtime()["kv_mode"] == mode
    with tinyloop.Model(model_files["int8-gqa"], backend="numpy", kv_mode="int8") as model:
        assert model.runtime()["kv_mode"] == "int8"          # an explicit mode wins


def test_every_backend_reports_its_kv_mode(backend, model_files):
    for mode in ("int8", "int4"):
        with tinyloop.Model(model_files["int8-gqa"], **backend_kwargs(backend),
                            kv_mode=mode) as model:
            assert model.kv_mode == model.runtime()["kv_mode"] == mode


@pytest.mark.parametrize("bad", ["int2", "INT4", "fp16", 4, ""])
def test_unknown_kv_modes_are_refused_naming_the_accepted_ones(model_files, bad):
    with pytest.raises(ValueError, match=r"kv_mode .* use one of 'int8', 'int4'"):
        tinyloop.Model(model_files["int8-gqa"], backend="numpy", kv_mode=bad)


def test_cli_kv_mode(model_files, capsys):
    path, out = str(model_files["int8-gqa"]), io.StringIO()
    assert cli_main(["info", "--model", path, "--backend", "numpy", "--kv-mode", "int4"],
                    out=out) == 0
    assert "int4 KV in blocks of 16" in out.getvalue()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["info", "--model", path, "--kv-mode", "int2"])
    assert exit_info.value.code == 2
    assert "--kv-mode: invalid choice: 'int2'" in capsys.readouterr().err
