"""Every execution path gives the same tokens and bit-identical logits (numpy backend).

Prefix cache vs plain generate, any prefill chunk size, depth nesting, sampling determinism.
"""
import numpy as np
from hypothesis import given, strategies as st

from conftest import MODEL_SHAPES

model_names = st.sampled_from(sorted(MODEL_SHAPES))


@st.composite
def prompts(draw, vocab, min_size=1, max_size=24):
    return draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size))


@st.composite
def sampling(draw):
    """Greedy or sampled settings, with a fixed seed."""
    if draw(st.booleans()):
        return dict(temperature=0.0, seed=draw(st.integers(0, 2**64 - 1)))
    return dict(temperature=draw(st.floats(0.05, 2.0)),
                top_k=draw(st.integers(0, 40)),
                top_p=draw(st.floats(0.05, 1.0)),
                repetition_penalty=draw(st.floats(0.5, 2.0)),
                seed=draw(st.integers(0, 2**64 - 1)))


@given(name=model_names, data=st.data())
def test_prefix_cache_generates_what_generate_generates(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"]))
    kw = data.draw(sampling())
    window = data.draw(st.sampled_from([0, 0, 3, 9]))
    plain, plain_logits = model.generate(prompt, max_tokens=8, cache_window=window,
                                         return_logits=True, **kw)
    prefix = model.build_prefix_cache(prompt, cache_window=window,
                                      prefill_chunk=data.draw(st.integers(1, 30)))
    cached, cached_logits = model.generate_from_prefix_cache(prefix, max_tokens=8,
                                                             return_logits=True, **kw)
    assert cached == plain
    assert np.array_equal(cached_logits.view(np.uint32), plain_logits.view(np.uint32))


@given(name=model_names, data=st.data())
def test_every_chunk_size_gives_identical_logits(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"], min_size=2))
    window = data.draw(st.sampled_from([0, 2, 5]))
    reference = model.logits(prompt, cache_window=window, prefill_chunk=len(prompt))
    for chunk in range(1, len(prompt)):
        got = model.logits(prompt, cache_window=window, prefill_chunk=chunk)
        assert np.array_equal(got.view(np.uint32), reference.view(np.uint32)), chunk


@given(name=model_names, data=st.data())
def test_prefix_built_deeper_serves_shallower_depths(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"]))
    deep = data.draw(st.integers(1, 5))
    kw = data.draw(sampling())
    prefix = model.build_prefix_cache(prompt, loops=deep)
    for loops in range(1, deep + 1):
        nested = model.generate_from_prefix_cache(prefix, loops=loops, max_tokens=5,
                                                  return_logits=True, **kw)
        fresh = model.generate_from_prefix_cache(model.build_prefix_cache(prompt, loops=loops),
                                                 max_tokens=5, return_logits=True, **kw)
        assert nested[0] == fresh[0]
        assert np.array_equal(nested[1].view(np.uint32), fresh[1].view(np.uint32))


@given(name=model_names, data=st.data())
def test_prefix_split_anywhere_gives_the_same_continuation(models, name, data):
    """prefix cache of prompt[:cut] + suffix prompt[cut:] == generate on the whole prompt."""
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"], min_size=2))
    kw = data.draw(sampling())
    window = data.draw(st.sampled_from([0, 4]))
    whole = model.generate(prompt, max_tokens=6, cache_window=window, return_logits=True, **kw)
    cut = data.draw(st.integers(1, len(prompt) - 1))
    prefix = model.build_prefix_cache(prompt[:cut], loops=data.draw(st.integers(
        model.config()["default_loops"], 5)), cache_window=window)
    split = model.generate_from_prefix_cache(prefix, max_tokens=6, suffix=prompt[cut:],
                                             loops=model.config()["default_loops"],
                                             prefill_chunk=data.draw(st.integers(1, 8)),
                                             return_logits=True, **kw)
    assert split[0] == whole[0]
    assert np.array_equal(split[1].view(np.uint32), whole[1].view(np.uint32))
    assert list(prefix.prompt) == prompt[:cut]


@given(name=model_names, data=st.data())
def test_same_seed_same_tokens(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"]))
    kw = data.draw(sampling())
    assert model.generate(prompt, max_tokens=8, **kw) == model.generate(prompt, max_tokens=8, **kw)


@given(name=model_names, data=st.data())
def test_temperature_zero_is_argmax_of_the_logits(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"]))
    out = model.generate(prompt, max_tokens=6)
    emitted = out[len(prompt):]
    logits = model.logits(out[:-1])
    assert emitted == [int(np.argmax(row)) for row in logits[len(prompt) - 1:]]


@given(name=model_names, data=st.data())
def test_top_k_one_is_greedy(models, name, data):
    model = models[name]
    prompt = data.draw(prompts(model.config()["vocab_size"]))
    sampled = model.generate(prompt, max_tokens=6, temperature=data.draw(st.floats(0.1, 3.0)),
                             top_k=1, seed=data.draw(st.integers(0, 99)))
    assert sampled == model.generate(prompt, max_tokens=6)


def test_different_seeds_sample_different_tokens(small_model):
    runs = {tuple(small_model.generate([1, 2, 3], max_tokens=12, temperature=1.5, top_k=0,
                                       seed=seed)) for seed in range(8)}
    assert len(runs) > 1


def test_stop_sequence_stays_in_the_output(small_model):
    free = small_model.generate([5, 6, 7], max_tokens=12)
    stop = free[5:7]
    stopped = small_model.generate([5, 6, 7], max_tokens=12, stop_sequences=[stop])
    assert stopped[-2:] == stop
    assert stopped == free[:len(stopped)]
    first = next(i for i in range(len(free) - 1) if i >= 4 and free[i - 1:i + 1] == stop)
    assert len(stopped) == first + 1


def test_stop_sequences_match_only_emitted_tokens(small_model):
    """A stop sequence already present in the prompt does not stop generation at once."""
    prompt = [9, 10, 11]
    out = small_model.generate(prompt, max_tokens=5, stop_sequences=[[10, 11]])
    assert len(out) > len(prompt) + 1 or out[-2:] == [10, 11]
    assert out[:len(prompt)] == prompt


def test_eos_stops_generation_and_is_kept(models):
    model = models["int4-eos"]
    eos = model.config()["eos_id"]
    for seed in range(40):
        out = model.generate([1, 2], max_tokens=30, temperature=1.0, top_k=0, seed=seed)
        emitted = out[2:]
        if eos in emitted:
            assert emitted.index(eos) == len(emitted) - 1
            return
    raise AssertionError("no sampled run produced the eos token; pick another model seed")
