"""Batched generation (Model.generate_batch), on every backend: every request's tokens and
logits are bit for bit what it gets alone, whatever the mix of depths, windows, sampling
parameters, seeds, lengths and stop rules in the batch, for prompts and for continuations of one
PrefixCache, whatever the model shape, thread count and KV block size; bad requests are named.
On native the live sequences decode together in one step per token; the others run them in turn.
"""
import pytest
from hypothesis import strategies as st

from conftest import assert_same_bits, backend_given
from strategies import drawn_model, prompts, sampling


@st.composite
def request_kwargs(draw, vocab):
    return dict(draw(sampling()), max_tokens=draw(st.integers(1, 6)),
                loops=draw(st.integers(1, 4)), cache_window=draw(st.sampled_from([0, 0, 3, 8])),
                prefill_chunk=draw(st.integers(1, 9)),
                stop_sequences=draw(st.lists(prompts(vocab, max_size=2), max_size=2)))


@backend_given(data=st.data())
def test_each_request_gets_what_it_gets_alone(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        batch = data.draw(st.lists(st.tuples(prompts(vocab, max_size=20), request_kwargs(vocab)),
                                   min_size=1, max_size=6))
        got = model.generate_batch([p for p, _ in batch], per_request=[kw for _, kw in batch],
                                   return_logits=True)
        assert len(got) == len(batch)
        for (prompt, kwargs), (tokens, logits) in zip(batch, got):
            want_tokens, want_logits = model.generate(prompt, return_logits=True, **kwargs)
            assert tokens == want_tokens
            assert_same_bits(logits, want_logits)


@backend_given(data=st.data())
def test_continuations_of_one_prefix_get_what_they_get_alone(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        prefix = model.build_prefix_cache(data.draw(prompts(vocab, max_size=20)), loops=4,
                                          cache_window=data.draw(st.sampled_from([0, 5])))
        suffixes = data.draw(st.lists(prompts(vocab, min_size=0, max_size=6), min_size=1,
                                      max_size=6))
        per_request = [dict(data.draw(sampling()), loops=data.draw(st.integers(1, 4)),
                            max_tokens=data.draw(st.integers(1, 5))) for _ in suffixes]
        got = model.generate_batch(suffixes, prefix=prefix, per_request=per_request,
                                   return_logits=True)
        for suffix, kwargs, (tokens, logits) in zip(suffixes, per_request, got):
            want_tokens, want_logits = model.generate_from_prefix_cache(
                prefix, suffix=suffix, return_logits=True, **kwargs)
            assert tokens == want_tokens
            assert_same_bits(logits, want_logits)


def test_shared_parameters_and_overrides_combine(on_backend):
    model = on_backend["int8-gqa"]
    got = model.generate_batch([[1, 2, 3]] * 3, max_tokens=4, temperature=1.0,
                               per_request=[{"seed": 0}, {"seed": 1}, {"seed": 0, "max_tokens": 2}])
    assert got[0] == model.generate([1, 2, 3], max_tokens=4, temperature=1.0, seed=0)
    assert got[1] == model.generate([1, 2, 3], max_tokens=4, temperature=1.0, seed=1)
    assert got[2] == got[0][:5]


def test_an_empty_batch_returns_nothing(on_backend):
    assert on_backend["int8-gqa"].generate_batch([]) == []


@pytest.mark.parametrize("call, error, message", [
    (lambda m, p: m.generate_batch([[1], [2]], per_request=[{}]), ValueError,
     "per_request has 1 entries for 2 prompts"),
    (lambda m, p: m.generate_batch([[1]], temprature=1.0), ValueError,
     r"request 0: unknown generation argument\(s\) \['temprature'\]"),
    (lambda m, p: m.generate_batch([[1], [2]], per_request=[{}, {"max_tokens": 0}]), ValueError,
     "request 1: max_tokens < 1"),
    (lambda m, p: m.generate_batch([[1], []]), ValueError, "request 1: prompt is empty"),
    (lambda m, p: m.generate_batch([[], [1]], prefix=p, per_request=[{}, {"loops": 9}]),
     RuntimeError, "request 1: loops mismatch"),
    (lambda m, p: m.generate_batch([[1, 99999]]), ValueError, "request 0: prompt: token id 99999"),
])
def test_bad_requests_are_named(on_backend, call, error, message):
    model = on_backend["int8-gqa"]
    prefix = model.build_prefix_cache([1, 2, 3], loops=2)
    with pytest.raises(error, match=message):
        call(model, prefix)
    assert model.generate_batch([[4, 5]], max_tokens=2) == [model.generate([4, 5], max_tokens=2)]
