"""Cross-backend identity: every backend gives the numpy reference's tokens and bit-identical
logits, on every path (chunked prefill, windows, depths, sampling, prefix + suffix, nesting).

Backends under test: TINYLOOP_TEST_BACKENDS, comma-separated (default "native,numba,native-cuda";
"native-cuda" is libtinyloop's CUDA backend, Model(backend="native", device="cuda")). One that
cannot be opened here is skipped with the reason it cannot, unless it is named in
TINYLOOP_REQUIRE_BACKENDS, which turns that skip into a failure (for CI and bench/gpu_check.sh).
The backend's models use block_size 4 and the reference's 16: paging never changes a value.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

import tinyloop

from conftest import MODEL_SHAPES, backend_kwargs, env_names, open_models, require_backend, same_bits
from test_paths import prompts, sampling


BACKENDS = env_names("TINYLOOP_TEST_BACKENDS", "native,numba,native-cuda")
model_names = st.sampled_from(sorted(MODEL_SHAPES))

# A longer context than MODEL_SHAPES: 64-wide heads, many cache blocks, long windows.
LONG_SHAPE = dict(vocab_size=700, d_model=96, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=160,
                  n_pre_blocks=1, default_loops=2, max_seq_len=320)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def under_test(backend, model_files):
    """name -> a Model of MODEL_SHAPES[name] opened with the backend under test."""
    opened = open_models(model_files, backend, block_size=4)
    yield opened
    for model in opened.values():
        model.close()


def test_backend_is_the_one_asked_for(backend, under_test):
    assert {model.backend for model in under_test.values()} == {backend}


@given(name=model_names, data=st.data())
def test_logits_match_numpy(models, under_test, name, data):
    ref, got = models[name], under_test[name]
    prompt = data.draw(prompts(ref.config()["vocab_size"], max_size=40))
    kw = dict(loops=data.draw(st.integers(1, 4)),
              cache_window=data.draw(st.sampled_from([0, 0, 1, 3, 7])),
              prefill_chunk=data.draw(st.integers(1, 40)))
    assert same_bits(got.logits(prompt, **kw), ref.logits(prompt, **kw))


@given(name=model_names, data=st.data())
def test_generation_matches_numpy(models, under_test, name, data):
    ref, got = models[name], under_test[name]
    prompt = data.draw(prompts(ref.config()["vocab_size"]))
    kw = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 8)),
              loops=data.draw(st.integers(1, 3)),
              cache_window=data.draw(st.sampled_from([0, 2, 5])),
              prefill_chunk=data.draw(st.integers(1, 16)), return_logits=True)
    want_tokens, want_logits = ref.generate(prompt, **kw)
    tokens, logits = got.generate(prompt, **kw)
    assert tokens == want_tokens
    assert same_bits(logits, want_logits)


@given(name=model_names, data=st.data())
def test_prefix_paths_match_numpy(models, under_test, name, data):
    """A prefix built at depth L_b serves depth L <= L_b with a suffix, twice (the shared
    prefix never changes), exactly as the reference does."""
    ref, got = models[name], under_test[name]
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
        assert same_bits(logits, want[1])


def test_long_context_matches_numpy(backend, tmp_path):
    """200 tokens in 64-token chunks over 64-wide heads, full and windowed, then decoding."""
    path = tmp_path / "long.tinyloop"
    tinyloop.random_model(path, seed=5, **LONG_SHAPE)
    prompt = np.random.default_rng(3).integers(0, LONG_SHAPE["vocab_size"], 200)
    with tinyloop.Model(path, backend="numpy") as ref, \
            tinyloop.Model(path, **backend_kwargs(backend), block_size=8) as got:
        for window in (0, 45):
            kw = dict(cache_window=window, prefill_chunk=64)
            assert same_bits(got.logits(prompt, **kw), ref.logits(prompt, **kw))
            kw = dict(kw, max_tokens=6, temperature=0.9, top_k=20, seed=11, return_logits=True)
            want, got_run = ref.generate(prompt, **kw), got.generate(prompt, **kw)
            assert got_run[0] == want[0]
            assert same_bits(got_run[1], want[1])


class StopStreaming(Exception):
    pass


@pytest.mark.parametrize("name", ["numpy", "native", "numba"])
def test_on_token_streams_every_emitted_token_and_can_stop(models_by_backend, name):
    model = models_by_backend(name)["int8-gqa"]
    prefix = model.build_prefix_cache([3, 4, 5])
    for run in (lambda **kw: model.generate([3, 4, 5, 6], **kw),
                lambda **kw: model.generate_from_prefix_cache(prefix, suffix=[6], **kw)):
        seen = []
        out = run(max_tokens=9, temperature=0.8, seed=5, on_token=seen.append)
        assert seen == out[4:] and len(seen) == 9

        def stop_after_three(token):
            if len(seen) == 3:
                raise StopStreaming
            seen.append(token)

        seen = []
        with pytest.raises(StopStreaming):
            run(max_tokens=9, temperature=0.8, seed=5, on_token=stop_after_three)
        assert seen == out[4:7]
        assert run(max_tokens=9, temperature=0.8, seed=5) == out    # still usable
