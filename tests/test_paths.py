"""Every execution path gives the same tokens and bit-identical logits, on every backend.

Prefix cache vs plain generate, any prefill chunk size, depth nesting, sampling determinism,
stop rules. Each property draws the model shape, the thread count and the KV block size too:
none of them may change a result.
"""
import numpy as np
import pytest
from hypothesis import assume, strategies as st

from conftest import assert_same_bits, backend_given
from strategies import SHORT_PROMPT, drawn_model, long_prompts, prompts, sampling


@backend_given(data=st.data())
def test_prefix_cache_generates_what_generate_generates(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(long_prompts(model.config()["vocab_size"], backend))
        kw = data.draw(sampling())
        window = data.draw(st.sampled_from([0, 0, 3, 9]))
        plain, plain_logits = model.generate(prompt, max_tokens=8, cache_window=window,
                                             return_logits=True, **kw)
        prefix = model.build_prefix_cache(prompt, cache_window=window,
                                          prefill_chunk=data.draw(st.integers(1, 30)))
        cached, cached_logits = model.generate_from_prefix_cache(prefix, max_tokens=8,
                                                                 return_logits=True, **kw)
        assert cached == plain
        assert_same_bits(cached_logits, plain_logits)


@backend_given(data=st.data())
def test_every_chunk_size_gives_identical_logits(backend, zoo, data):
    """Every chunk size of a short prompt; three drawn sizes of a long one."""
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(long_prompts(model.config()["vocab_size"], backend, min_size=2))
        n = len(prompt)
        chunks = range(1, n) if n <= SHORT_PROMPT else \
            data.draw(st.lists(st.integers(2, n - 1), min_size=3, max_size=3))
        window = data.draw(st.sampled_from([0, 2, 5]))
        loops = data.draw(st.integers(1, 4))
        reference = model.logits(prompt, loops=loops, cache_window=window, prefill_chunk=n)
        for chunk in chunks:
            assert_same_bits(model.logits(prompt, loops=loops, cache_window=window,
                                          prefill_chunk=chunk), reference)


@backend_given(data=st.data())
def test_prefix_built_deeper_serves_shallower_depths(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(long_prompts(model.config()["vocab_size"], backend))
        deep = data.draw(st.integers(1, 5))
        kw = data.draw(sampling())
        prefix = model.build_prefix_cache(prompt, loops=deep)
        for loops in range(1, deep + 1):
            nested = model.generate_from_prefix_cache(prefix, loops=loops, max_tokens=5,
                                                      return_logits=True, **kw)
            fresh = model.generate_from_prefix_cache(model.build_prefix_cache(prompt, loops=loops),
                                                     max_tokens=5, return_logits=True, **kw)
            assert nested[0] == fresh[0]
            assert_same_bits(nested[1], fresh[1])


@backend_given(data=st.data())
def test_prefix_split_anywhere_gives_the_same_continuation(backend, zoo, data):
    """prefix cache of prompt[:cut] + suffix prompt[cut:] == generate on the whole prompt."""
    with drawn_model(data, zoo, backend) as model:
        default_loops = model.config()["default_loops"]
        prompt = data.draw(long_prompts(model.config()["vocab_size"], backend, min_size=2))
        kw = data.draw(sampling())
        window = data.draw(st.sampled_from([0, 4]))
        whole = model.generate(prompt, max_tokens=6, cache_window=window, return_logits=True,
                               **kw)
        cut = data.draw(st.integers(1, len(prompt) - 1))
        prefix = model.build_prefix_cache(prompt[:cut], cache_window=window,
                                          loops=data.draw(st.integers(default_loops, 5)))
        split = model.generate_from_prefix_cache(prefix, max_tokens=6, suffix=prompt[cut:],
                                                 loops=default_loops,
                                                 prefill_chunk=data.draw(st.integers(1, 8)),
                                                 return_logits=True, **kw)
        assert split[0] == whole[0]
        assert_same_bits(split[1], whole[1])
        assert list(prefix.prompt) == prompt[:cut]


@backend_given(data=st.data())
def test_same_seed_same_tokens(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(prompts(model.config()["vocab_size"]))
        kw = data.draw(sampling())
        assert model.generate(prompt, max_tokens=8, **kw) == \
            model.generate(prompt, max_tokens=8, **kw)


@backend_given(data=st.data())
def test_temperature_zero_is_argmax_of_the_logits(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(prompts(model.config()["vocab_size"]))
        out = model.generate(prompt, max_tokens=6)
        emitted = out[len(prompt):]
        logits = model.logits(out[:-1])
        assert emitted == [int(np.argmax(row)) for row in logits[len(prompt) - 1:]]


@backend_given(data=st.data())
def test_top_k_one_is_greedy(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        prompt = data.draw(prompts(model.config()["vocab_size"]))
        sampled = model.generate(prompt, max_tokens=6, temperature=data.draw(st.floats(0.1, 3.0)),
                                 top_k=1, seed=data.draw(st.integers(0, 99)))
        assert sampled == model.generate(prompt, max_tokens=6)


def stop_point(emitted, stop_sequences):
    """The contract (docs/spec.md §5.3): the number of tokens a run emits before it stops — the
    first k at which emitted[:k] (never the prompt) ends with one of the stop sequences."""
    for k in range(1, len(emitted) + 1):
        if any(emitted[:k][-len(stop):] == stop for stop in stop_sequences if len(stop) <= k):
            return k
    return len(emitted)


@backend_given(data=st.data())
def test_stop_sequences_match_the_emitted_tokens_only(backend, zoo, data):
    """A stop sequence made of the prompt's last tokens and the first emitted one straddles
    them: matched against prompt + emitted it would stop the run after one token, matched
    against the emitted tokens (the contract) it does not. A second one, drawn from inside the
    emitted tokens, stops the run where it first appears. Every stop sequence has >= 2 tokens,
    so the contract's stop point is always past the first token: the two readings differ on
    every example. Plain, prefix + suffix and batched runs all stop there."""
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        prompt = data.draw(prompts(vocab, min_size=3, max_size=12))
        kw = dict(data.draw(sampling()), max_tokens=12)
        free = model.generate(prompt, **kw)
        emitted = free[len(prompt):]
        assume(len(emitted) >= 2)                 # not stopped at once by the eos token
        stops = [prompt[-data.draw(st.integers(1, 2)):] + emitted[:1]]
        if len(emitted) >= 3:
            start = data.draw(st.integers(1, len(emitted) - 2))
            stops.append(emitted[start:data.draw(st.integers(start + 2, len(emitted)))])
        want = prompt + emitted[:stop_point(emitted, stops)]
        assert len(want) > len(prompt) + 1
        assert model.generate(prompt, stop_sequences=stops, **kw) == want
        cut = data.draw(st.integers(1, len(prompt) - 1))
        prefix = model.build_prefix_cache(prompt[:cut])
        assert model.generate_from_prefix_cache(prefix, suffix=prompt[cut:],
                                                stop_sequences=stops, **kw) == want
        assert model.generate_batch([prompt], stop_sequences=stops, **kw) == [want]


def test_different_seeds_sample_different_tokens(on_backend):
    runs = {tuple(on_backend["int8-gqa"].generate([1, 2, 3], max_tokens=12, temperature=1.5,
                                                  top_k=0, seed=seed)) for seed in range(8)}
    assert len(runs) > 1


def test_stop_sequence_stays_in_the_output(on_backend):
    model = on_backend["int8-gqa"]
    free = model.generate([5, 6, 7], max_tokens=12)
    stop = free[5:7]
    stopped = model.generate([5, 6, 7], max_tokens=12, stop_sequences=[stop])
    assert stopped[-2:] == stop
    assert stopped == free[:len(stopped)]
    first = next(i for i in range(len(free) - 1) if i >= 4 and free[i - 1:i + 1] == stop)
    assert len(stopped) == first + 1


def test_every_stop_id_stops_generation_and_is_kept(on_backend):
    """eos_id and each of stop_ids (docs/spec.md §5.3) end a sampled run, as its last token."""
    model = on_backend["int4-eos"]
    stops = model.stop_token_ids()
    assert len(stops) == 3
    ended_by = set()
    for seed in range(80):
        emitted = model.generate([1, 2], max_tokens=30, temperature=1.0, top_k=0, seed=seed)[2:]
        hits = [i for i, token in enumerate(emitted) if token in stops]
        assert hits in ([], [len(emitted) - 1])
        ended_by.update(emitted[i] for i in hits)
        if ended_by == set(stops):
            return
    raise AssertionError(f"sampled runs ended only by {ended_by} of {stops}; pick another seed")


class StopStreaming(Exception):
    pass


def test_on_token_streams_every_emitted_token_and_can_stop(on_backend):
    model = on_backend["int8-gqa"]
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
