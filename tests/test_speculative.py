"""Self-speculative decoding (draft_loops, n_draft, draft_wave; docs/api.md), on every backend:
whatever the model shape (coda, injection, step norm, GQA), prompt, depth, draft depth, draft
length, schedule (rounds or the wave, which backends without a wave pass run as rounds),
sampling parameters, seed, window and stop rules, a speculative generation's tokens and logits
are bit for bit plain decoding's, from a prompt, from a PrefixCache and inside generate_batch
mixes; its draft_stats add up, drafts being drafted on every backend (libtinyloop's CUDA
backend has a part pass: no plain fallback); libtinyloop's CUDA backend drafts and emits exactly
the numpy reference's tokens, logits and counters; the trained demo model accepts most drafts;
bad arguments are named.
"""
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop.params import DEFAULT_N_DRAFT
from tinyloop.quickbench import backend_kwargs

from conftest import assert_same_generation, backend_given, require_backend, simulated
from strategies import drawn_model, prompts, sampling


@st.composite
def request_kwargs(draw, vocab, max_loops=5):
    """A plain request at a depth >= 2 (drafting needs a shallower depth)."""
    return dict(draw(sampling()), loops=draw(st.integers(2, max_loops)),
                max_tokens=draw(st.integers(1, 12)),
                cache_window=draw(st.sampled_from([0, 0, 3, 8])),
                prefill_chunk=draw(st.integers(1, 9)),
                stop_sequences=draw(st.lists(prompts(vocab, max_size=2), max_size=2)))


@st.composite
def drafting(draw, loops, wave=True):
    """draft_loops, n_draft (None: the default) and, unless not `wave`, draft_wave for a request
    at depth `loops`."""
    drawn = dict(draft_loops=draw(st.integers(1, loops - 1)),
                 n_draft=draw(st.sampled_from([None, 1, 2, 3, 5, 8, 64])))
    if wave:
        drawn["draft_wave"] = draw(st.booleans())
        if drawn["draft_wave"] and draw(st.booleans()):
            drawn["draft_loops"] = "auto"
    return drawn


def assert_stats_add_up(stats, n_emitted, n_draft, loops, wave=False, backend=None):
    """Rounds: every token after the first is a round's, a round emits 1 .. K' of its K'
    drafts (K: n_draft, by default 4, or loops for a wave request). The wave, where it
    runs (libtinyloop's CPU backend: elsewhere a wave request runs rounds), enters at most one
    draft a step and emits a token at least every `loops` steps. Only emitted tokens are
    accepted."""
    drafted, accepted = stats["drafted"], stats["accepted"]
    if wave and backend == "native":
        assert drafted <= n_emitted * loops, (stats, n_emitted)
    else:
        most = n_draft or (min(loops, 64) if wave else DEFAULT_N_DRAFT)
        assert n_emitted - 1 <= drafted <= (n_emitted - 1) * most, (stats, n_emitted)
    assert 0 <= accepted <= min(drafted, n_emitted - 1), (stats, n_emitted)
    assert stats["acceptance_rate"] == (accepted / drafted if drafted else 0.0), stats


@backend_given(data=st.data())
def test_speculative_generation_is_plain_generation(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        prompt = data.draw(prompts(vocab), "prompt")
        kwargs = data.draw(request_kwargs(vocab), "request")
        draft = data.draw(drafting(kwargs["loops"]), "draft")
        stats = {}
        got = model.generate(prompt, return_logits=True, draft_stats=stats, **draft, **kwargs)
        assert_same_generation(got, model.generate(prompt, return_logits=True, **kwargs))
        assert_stats_add_up(stats, len(got[0]) - len(prompt), draft["n_draft"], kwargs["loops"],
                            draft["draft_wave"], backend)


@backend_given(data=st.data())
def test_speculative_continuations_of_a_prefix_are_plain_ones(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        depth = data.draw(st.integers(2, 4), "prefix loops")
        prefix = model.build_prefix_cache(data.draw(prompts(vocab), "prefix"), loops=depth,
                                          cache_window=data.draw(st.sampled_from([0, 5])),
                                          warm_start=data.draw(st.booleans(), "warm start"))
        suffix = data.draw(prompts(vocab, min_size=0, max_size=6), "suffix")
        kwargs = dict(data.draw(sampling()), loops=data.draw(st.integers(2, depth)),
                      max_tokens=data.draw(st.integers(1, 10)))
        draft = data.draw(drafting(kwargs["loops"]), "draft")
        stats = {}
        got = model.generate_from_prefix_cache(prefix, suffix=suffix, return_logits=True,
                                               draft_stats=stats, **draft, **kwargs)
        want = model.generate_from_prefix_cache(prefix, suffix=suffix, return_logits=True,
                                                **kwargs)
        assert_same_generation(got, want)
        assert_stats_add_up(stats, len(got[0]) - len(prefix) - len(suffix), draft["n_draft"],
                            kwargs["loops"], draft["draft_wave"], backend)
        assert prefix.loops == depth


@backend_given(data=st.data())
def test_batches_mixing_speculative_and_plain_requests_get_plain_results(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        batch = []
        for _ in range(data.draw(st.integers(1, 4), "requests")):
            kwargs = data.draw(request_kwargs(vocab, max_loops=4))
            if data.draw(st.booleans(), "speculative"):
                kwargs.update(data.draw(drafting(kwargs["loops"], wave=False)), draft_stats={})
            batch.append((data.draw(prompts(vocab, max_size=12)), kwargs))
        got = model.generate_batch([p for p, _ in batch], per_request=[kw for _, kw in batch],
                                   return_logits=True)
        for (prompt, kwargs), result in zip(batch, got):
            stats = kwargs.pop("draft_stats", None)
            draft = {name: kwargs.pop(name, None) for name in ("draft_loops", "n_draft")}
            assert_same_generation(result, model.generate(prompt, return_logits=True, **kwargs))
            if stats is not None:
                assert_stats_add_up(stats, len(result[0]) - len(prompt), draft["n_draft"],
                                    kwargs["loops"])


def test_a_shared_draft_stats_dict_sums_the_batch(on_fast_backend):
    model = on_fast_backend["int8-v2-coda"]
    shared, alone = {}, [{}, {}]
    batch = [[1, 2, 3], [4, 5]]
    common = dict(max_tokens=8, loops=3, draft_loops=1, n_draft=3, temperature=0.0)
    got = model.generate_batch(batch, draft_stats=shared, **common)
    for prompt, stats, result in zip(batch, alone, got):
        assert model.generate(prompt, draft_stats=stats, **common) == result
    for name in ("drafted", "accepted"):
        assert shared[name] == alone[0][name] + alone[1][name]
    assert shared["drafted"] > 0


def test_the_demo_model_accepts_most_drafts(backend):
    """Trained: depth 2 mostly predicts depth 6's greedy tokens (measured here: 0.77)."""
    if simulated(backend):
        pytest.skip("the demo model's widths take minutes a token on the CUDA simulator; the "
                    "properties above run its kernels")
    with tinyloop.Model(**backend_kwargs(backend)) as model:
        prompt = model.encode("And God said")
        max_tokens = 40
        stats = {}
        got = model.generate(prompt, max_tokens=max_tokens, temperature=0.0, draft_loops=2,
                             draft_stats=stats)
        assert got == model.generate(prompt, max_tokens=max_tokens, temperature=0.0)
        assert stats["drafted"] >= max_tokens - 1
        assert stats["acceptance_rate"] > 0.5, stats


@pytest.mark.parametrize("shape", ["int8-gqa", "int8-v2-coda", "int4-v2-sandwich"])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_cuda_backend_drafts_what_numpy_drafts(model_files, shape, sampled):
    """libtinyloop's CUDA backend runs the part passes of a round on the device (drafts, then one
    verification resumed from their states): its tokens and logits are numpy's, plain or
    speculative, and so are its draft counters, which count drafts (no plain fallback)."""
    require_backend("native-cuda")
    request = dict(max_tokens=10, loops=3, temperature=0.8 if sampled else 0.0, seed=4,
                   return_logits=True)
    draft = dict(draft_loops=1 if sampled else 2, n_draft=3)
    with tinyloop.Model(model_files[shape], backend="numpy") as numpy_model, \
            tinyloop.Model(model_files[shape], backend="native", device="cuda") as cuda_model:
        prompt = list(range(3, 12))
        want, want_stats = numpy_model.generate(prompt, **request), {}
        assert_same_generation(numpy_model.generate(prompt, draft_stats=want_stats, **draft,
                                                    **request), want)
        stats = {}
        assert_same_generation(cuda_model.generate(prompt, draft_stats=stats, **draft, **request),
                               want)
        assert stats == want_stats
        assert stats["drafted"] >= len(want[0]) - len(prompt) - 1 > 0


def test_draft_stats_are_filled_for_plain_decoding_too(small_model):
    stats = {"drafted": 99, "other": 1}
    small_model.generate([1, 2], max_tokens=3, draft_stats=stats)
    assert stats == dict(drafted=0, accepted=0, acceptance_rate=0.0, other=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loops=3, draft_loops=1, n_draft=65), r"n_draft must be in 0 \.\. 64, got 65"),
    (dict(loops=3, draft_loops=1, n_draft=-1), r"n_draft must be in 0 \.\. 64, got -1"),
    (dict(loops=3, draft_loops=1, n_draft=2.0), "n_draft must be an integer, got float"),
    (dict(loops=3, n_draft=2), "n_draft > 0 needs draft_loops"),
    (dict(loops=3, draft_loops=0, n_draft=2), "n_draft > 0 needs draft_loops"),
    (dict(loops=6, draft_loops=6), r"draft_loops must be in 1 \.\. loops-1 \(loops=6\), got 6"),
    (dict(loops=1, draft_loops=1, n_draft=4),
     r"draft_loops must be in 1 \.\. loops-1 \(loops=1\), got 1"),
    (dict(draft_loops=3), r"draft_loops must be in 1 \.\. loops-1 \(loops=3\), got 3"),
    (dict(loops=3, draft_loops=-1), "draft_loops < 0"),
    (dict(loops=3, draft_loops="1"), "draft_loops must be an integer, got str"),
    (dict(loops=3, draft_loops=1, draft_stats=[]), "draft_stats must be a dict or None, got list"),
    (dict(loops=3, draft_loops="auto"), "draft_loops='auto' needs draft_wave=True"),
])
def test_bad_draft_arguments_are_named(small_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        small_model.generate([1, 2], max_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="request 0: " + message):
        small_model.generate_batch([[1, 2]], max_tokens=2, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loops=3, draft_loops=1, draft_wave=1), "draft_wave must be a bool, got int"),
    (dict(loops=1, draft_loops="auto", draft_wave=True), "draft_loops='auto' needs loops >= 2, got 1"),
    (dict(loops=3, draft_loops=3, draft_wave=True), r"draft_loops must be in 1 \.\. loops-1"),
])
def test_bad_wave_arguments_are_named(small_model, kwargs, message):
    """The wave is a lone request's schedule: generate_batch does not take draft_wave."""
    prefix = small_model.build_prefix_cache([1, 2], loops=3)
    with pytest.raises(ValueError, match=message):
        small_model.generate([1, 2], max_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        small_model.generate_from_prefix_cache(prefix, max_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=r"unknown generation argument\(s\) \['draft_wave'\]"):
        small_model.generate_batch([[1, 2]], max_tokens=2, **kwargs)


def test_n_draft_zero_is_plain_decoding_whatever_draft_loops(small_model):
    plain = small_model.generate([1, 2], max_tokens=4, loops=3)
    stats = {}
    assert small_model.generate([1, 2], max_tokens=4, loops=3, draft_loops=7, n_draft=0,
                                draft_stats=stats) == plain
    assert stats["drafted"] == 0
