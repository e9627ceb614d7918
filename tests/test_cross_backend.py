"""Cross-backend identity: every backend gives the numpy reference's tokens and bit-identical
logits, on every path (chunked prefill, windows, depths, sampling, prefix + suffix, nesting),
for drawn model shapes, thread counts and KV block sizes (the reference keeps block size 16:
paging never changes a value); and at the edges of the kernels' exact integer sums.

Backends under test: TINYLOOP_TEST_BACKENDS but numpy (see conftest.py); one that cannot run
here is skipped with the reason, or fails when TINYLOOP_REQUIRE_BACKENDS names it.
"""
import os

import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop.fallback import numerics as N
from tinyloop.fallback.weights import Weights
from tinyloop.modelfile import load_model, save_model
from tinyloop.quantize import quantize_model
from tinyloop.quickbench import backend_kwargs
from tinyloop.random_model import random_config, random_float_weights

from conftest import (COMPARED_BACKENDS, assert_same_bits, backend_fixture, backend_given,
                      require_backend)
from strategies import drawn_model, logits_requests, long_prompts, prompts, sampling

# A longer context than MODEL_SHAPES: 64-wide heads, many cache blocks, long windows.
LONG_SHAPE = dict(vocab_size=700, d_model=96, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=160,
                  n_pre_blocks=1, default_loops=2, max_seq_len=320)


backend = backend_fixture(COMPARED_BACKENDS)


def reference(model):
    """The numpy Model of the same file."""
    return tinyloop.Model(model.path, backend="numpy")


def test_backend_is_the_one_asked_for(backend, model_files):
    with tinyloop.Model(model_files["int8-gqa"], **backend_kwargs(backend)) as model:
        assert model.backend == backend_kwargs(backend)["backend"]


def test_native_models_run_the_isa_path_tinyloop_isa_names(backend, model_files):
    """`TINYLOOP_ISA=amx pytest tests/test_cross_backend.py` runs this suite's every native
    model on that path (docs/testing.md)."""
    forced = os.environ.get("TINYLOOP_ISA", "")
    if not backend.startswith("native"):
        pytest.skip(f"TINYLOOP_ISA is libtinyloop's: {backend} ignores it")
    if forced in ("", "auto"):
        pytest.skip("TINYLOOP_ISA forces no kernel path in this run")
    with tinyloop.Model(model_files["int8-gqa"], **backend_kwargs(backend)) as model:
        assert model.runtime()["isa"] == {"avx512": "avx512-vnni"}.get(forced, forced)


@backend_given(data=st.data())
def test_logits_match_numpy(backend, zoo, data):
    with drawn_model(data, zoo, backend) as got, reference(got) as ref:
        prompt = data.draw(long_prompts(ref.config()["vocab_size"], backend))
        kw = data.draw(logits_requests())
        assert_same_bits(got.logits(prompt, **kw), ref.logits(prompt, **kw))


@backend_given(data=st.data())
def test_generation_matches_numpy(backend, zoo, data):
    with drawn_model(data, zoo, backend) as got, reference(got) as ref:
        prompt = data.draw(long_prompts(ref.config()["vocab_size"], backend))
        kw = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 8)),
                  loops=data.draw(st.integers(1, 3)),
                  cache_window=data.draw(st.sampled_from([0, 2, 5])),
                  prefill_chunk=data.draw(st.integers(1, 16)), return_logits=True)
        want_tokens, want_logits = ref.generate(prompt, **kw)
        tokens, logits = got.generate(prompt, **kw)
        assert tokens == want_tokens
        assert_same_bits(logits, want_logits)


@backend_given(data=st.data())
def test_prefix_paths_match_numpy(backend, zoo, data):
    """A prefix built at depth L_b serves depth L <= L_b with a suffix, twice (the shared
    prefix never changes), exactly as the reference does."""
    with drawn_model(data, zoo, backend) as got, reference(got) as ref:
        prompt = data.draw(prompts(ref.config()["vocab_size"], min_size=2, max_size=30))
        cut = data.draw(st.integers(1, len(prompt)))
        deep = data.draw(st.integers(1, 4))
        window = data.draw(st.sampled_from([0, 3]))
        build = dict(loops=deep, cache_window=window, prefill_chunk=data.draw(st.integers(1, 12)))
        run = dict(data.draw(sampling()), loops=data.draw(st.integers(1, deep)), max_tokens=5,
                   suffix=prompt[cut:], prefill_chunk=data.draw(st.integers(1, 12)),
                   return_logits=True)
        want = ref.generate_from_prefix_cache(ref.build_prefix_cache(prompt[:cut], **build), **run)
        prefix = got.build_prefix_cache(prompt[:cut], **build)
        for _ in range(2):
            tokens, logits = got.generate_from_prefix_cache(prefix, **run)
            assert tokens == want[0]
            assert_same_bits(logits, want[1])


def test_long_context_matches_numpy(backend, tmp_path):
    """200 tokens in 64-token chunks over 64-wide heads, full and windowed, then decoding."""
    path = tmp_path / "long.tinyloop"
    tinyloop.random_model(path, seed=5, **LONG_SHAPE)
    prompt = np.random.default_rng(3).integers(0, LONG_SHAPE["vocab_size"], 200)
    with tinyloop.Model(path, backend="numpy") as ref, \
            tinyloop.Model(path, **backend_kwargs(backend), block_size=8) as got:
        for window in (0, 45):
            kw = dict(cache_window=window, prefill_chunk=64)
            assert_same_bits(got.logits(prompt, **kw), ref.logits(prompt, **kw))
            kw = dict(kw, max_tokens=6, temperature=0.9, top_k=20, seed=11, return_logits=True)
            want, got_run = ref.generate(prompt, **kw), got.generate(prompt, **kw)
            assert got_run[0] == want[0]
            assert_same_bits(got_run[1], want[1])


# -- the AVX2 attention's i32 flush (libtinyloop/src/cpu/attention_avx2.c) -----------------------
#
# The AVX2 kernel (run whenever the ISA path is not scalar) sums u_j * (v_jd + 128) two keys per
# i32 lane step, u = 4096 * uh + ul with uh <= 4096, so one pair adds at most
# 2 * 4096 * 255 = 2088960 to a lane; it flushes the lanes into i64 sums every FLUSH_PAIRS = 1024
# pairs (2048 keys) of one accumulate_segments call (at most 64 KV blocks), just below 2^31.
# This model drives one lane to that bound: q = 0 makes every score 0 and every weight
# u_j = 2^24 (uh = 4096), one token repeated gives every position the same value row, and
# positive embeddings and value weights make its largest entry +127 (v + 128 = 255). Its
# positions see 1 .. 2100 keys: past 2048 a missed flush overflows (1029 bound pairs exceed
# 2^31). Blocks of 4096, 64 and 33 tokens put the flush inside a block, on a block boundary,
# and after odd-sized blocks (whose last key pairs with a zero row).
FLUSH_PROMPT = [5] * 2100        # 1050 key pairs at the last position
FLUSH_SHAPE = dict(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=32,
                   n_pre_blocks=0, default_loops=1, max_seq_len=2200)
PAIR_BOUND = 2 * 4096 * 255


@pytest.fixture(scope="module")
def flush_model(tmp_path_factory):
    """(path, the numpy reference's logits and generation) of the model described above."""
    config = random_config(**FLUSH_SHAPE)
    w = random_float_weights(config, seed=1)
    w["tok_emb"], w["core.0.wv"] = np.abs(w["tok_emb"]), np.abs(w["core.0.wv"])
    w["core.0.wq"][:] = 0
    path = tmp_path_factory.mktemp("flush") / "flush.tinyloop"
    save_model(path, *quantize_model(config, w))
    with tinyloop.Model(path, backend="numpy") as ref:
        return path, ref.logits(FLUSH_PROMPT), ref.generate(FLUSH_PROMPT, max_tokens=3,
                                                            return_logits=True)


def test_flush_model_drives_a_lane_to_the_bound(flush_model):
    """The premise of the test below, checked on the reference's own first layer."""
    weights = Weights(*load_model(flush_model[0]))
    cfg = weights.config
    H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    token = FLUSH_PROMPT[:1]
    x = weights.embedding[token].astype(np.float32) * weights.embedding_scale[token][:, None]
    z = weights.block(0).attn_qkv(*N.rms_quantize(x, cfg.rms_eps))
    vq, _ = N.quantize_rows(z[:, (H + G) * D:].reshape(1, G, D))
    assert not z[:, :H * D].any()                     # q = 0: every weight u_j is 2^24
    assert vq.max() == 127                            # the lane's value byte is 255
    assert 1024 * PAIR_BOUND < 2**31 <= len(FLUSH_PROMPT) // 2 * PAIR_BOUND


@pytest.mark.parametrize("block_size", [4096, 64, 33])
def test_avx2_attention_flush_boundary_matches_numpy(flush_model, block_size):
    """Native only: the AVX2 kernel is libtinyloop's (the numba kernels sum in i64 directly)."""
    require_backend("native")
    path, want_logits, (want_tokens, want_run_logits) = flush_model
    with tinyloop.Model(path, backend="native", block_size=block_size) as got:
        if got.runtime()["isa"] == "scalar":
            pytest.skip("libtinyloop runs its scalar attention only here (no AVX2, or "
                        "TINYLOOP_ISA=scalar)")
        assert_same_bits(got.logits(FLUSH_PROMPT), want_logits)
        tokens, logits = got.generate(FLUSH_PROMPT, max_tokens=3, return_logits=True)
    assert tokens == want_tokens
    assert_same_bits(logits, want_run_logits)
