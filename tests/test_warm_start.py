"""Warm start (build_prefix_cache(warm_start=True), PrefixCache.extend; docs/api.md), on every
backend: a warm-start prefix built at depth L_b and deepened to L > L_b, by a generation at L or
by extend(L), in one step or several, is bit for bit a prefix built at L: the same size, and
every generation from it (tokens and logits, at L or any shallower depth, any window and chunk)
the same. It is extended once however many calls ask; the stored states cost 4 * d_model bytes
a token (twice that with injection); a prefix built without warm start is refused with a
message saying how to build one; on native, generations run while another thread extends; on
libtinyloop's CUDA backend a warm-start prefix keeps its states and, extended by resuming on the
device, is the numpy reference's byte for byte.
"""
import threading

import pytest
from hypothesis import strategies as st

import tinyloop

from conftest import assert_same_generation, backend_given, require_backend
from strategies import drawn_model, prompts, sampling

REFUSED = (r"loops mismatch: prefix built at loops=2, requested 4 \(a prefix serves loops <= "
           r"its own; build it with warm_start=True to extend it\)")


@backend_given(data=st.data())
def test_an_extended_prefix_is_a_prefix_built_at_its_new_depth(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        prompt = data.draw(prompts(vocab), "prompt")
        window = data.draw(st.sampled_from([0, 0, 3, 8]), "window")
        # the depths it is built at, then extended to: L_b < ... < L
        depths = sorted(data.draw(st.sets(st.integers(1, 5), min_size=2, max_size=3), "depths"))
        chunk = data.draw(st.integers(1, 9), "chunk")
        warm = model.build_prefix_cache(prompt, loops=depths[0], cache_window=window,
                                        prefill_chunk=chunk, warm_start=True)
        built = model.build_prefix_cache(prompt, loops=depths[-1], cache_window=window,
                                         warm_start=True)
        request = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 6)),
                       suffix=data.draw(prompts(vocab, min_size=0, max_size=5), "suffix"),
                       return_logits=True)
        for depth in depths[1:]:
            if data.draw(st.booleans(), "by extend()"):
                warm.extend(depth, prefill_chunk=data.draw(st.integers(1, 9)))
                assert warm.loops == depth
            else:
                extended = model.generate_from_prefix_cache(warm, loops=depth, **request)
                assert warm.loops == depth
                if depth == depths[-1]:
                    want = model.generate_from_prefix_cache(built, loops=depth, **request)
                    assert_same_generation(extended, want)
        assert warm.nbytes == built.nbytes
        assert warm.warm_start and len(warm) == len(prompt)
        loops = data.draw(st.integers(1, depths[-1]), "generation depth")
        assert_same_generation(model.generate_from_prefix_cache(warm, loops=loops, **request),
                               model.generate_from_prefix_cache(built, loops=loops, **request))


def test_repeated_deeper_calls_extend_once(on_fast_backend, monkeypatch):
    model = on_fast_backend["int8-v2-coda"]
    prefix = model.build_prefix_cache(list(range(1, 20)), loops=1, warm_start=True)
    calls = []
    extend = model._engine.extend_prefix
    monkeypatch.setattr(model._engine, "extend_prefix",
                        lambda *args: calls.append(args[1:]) or extend(*args))
    first = model.generate_from_prefix_cache(prefix, loops=3, max_tokens=4)
    size = prefix.nbytes
    for loops in (3, 2, 3, 1):
        model.generate_from_prefix_cache(prefix, loops=loops, max_tokens=4)
    prefix.extend(3)
    assert model.generate_from_prefix_cache(prefix, loops=3, max_tokens=4) == first
    assert len(calls) == 1 and calls[0][0] == 3
    assert (prefix.loops, prefix.nbytes) == (3, size)


def test_a_batch_extends_to_its_deepest_request(on_fast_backend):
    model = on_fast_backend["int8-gqa"]
    prompt = list(range(5, 30))
    warm = model.build_prefix_cache(prompt, loops=1, warm_start=True)
    built = model.build_prefix_cache(prompt, loops=4)
    per_request = [dict(loops=2), dict(loops=4, temperature=1.0, seed=3), dict(loops=1)]
    got = model.generate_batch([[1], [], [2, 3]], prefix=warm, per_request=per_request,
                               max_tokens=3)
    assert warm.loops == 4
    assert got == model.generate_batch([[1], [], [2, 3]], prefix=built, per_request=per_request,
                                       max_tokens=3)


@pytest.mark.parametrize("shape, states", [("int8-gqa", 1), ("int8-v2-coda", 2)])
def test_warm_start_keeps_4_d_bytes_a_token_twice_with_injection(on_fast_backend, shape,
                                                                  states):
    model = on_fast_backend[shape]
    assert model.config()["injection"] == (states == 2)
    prompt = list(range(1, 38))
    plain = model.build_prefix_cache(prompt, loops=2)
    warm = model.build_prefix_cache(prompt, loops=2, warm_start=True)
    assert (plain.warm_start, warm.warm_start) == (False, True)
    assert warm.nbytes - plain.nbytes == 4 * model.config()["d_model"] * len(prompt) * states


@pytest.mark.parametrize("shape", ["int8-gqa", "int8-v2-coda", "int4-v2-sandwich"])
@pytest.mark.parametrize("window", [0, 9])
def test_the_cuda_backend_extends_a_prefix_as_numpy_does(model_files, shape, window):
    """libtinyloop's CUDA backend resumes a warm-start prefix from its kept states (part passes
    on the device, the old layers of each block copied there): at every step its blob is
    numpy's, states and KV alike, and so is what it generates."""
    require_backend("native-cuda")
    prompt = [t % 120 + 1 for t in range(30)]
    request = dict(suffix=[5, 6], max_tokens=5, temperature=0.7, seed=3, return_logits=True)
    with tinyloop.Model(model_files[shape], backend="numpy") as numpy_model, \
            tinyloop.Model(model_files[shape], backend="native", device="cuda") as cuda_model:
        want = numpy_model.build_prefix_cache(prompt, loops=1, cache_window=window,
                                              warm_start=True)
        got = cuda_model.build_prefix_cache(prompt, loops=1, cache_window=window, warm_start=True,
                                            prefill_chunk=7)
        assert got.to_bytes() == want.to_bytes()
        for loops, chunk in ((2, 11), (4, None)):
            want.extend(loops)
            got.extend(loops, prefill_chunk=chunk)
            assert got.loops == loops and got.to_bytes() == want.to_bytes()
        for loops in (1, 4):
            assert_same_generation(
                cuda_model.generate_from_prefix_cache(got, loops=loops, **request),
                numpy_model.generate_from_prefix_cache(want, loops=loops, **request))


def test_a_prefix_without_warm_start_is_refused_and_says_how(on_fast_backend):
    model = on_fast_backend["int8-gqa"]
    prefix = model.build_prefix_cache([1, 2, 3], loops=2)
    size = prefix.nbytes
    for call in (lambda: model.generate_from_prefix_cache(prefix, loops=4),
                 lambda: prefix.extend(4)):
        with pytest.raises(RuntimeError, match=REFUSED):
            call()
    with pytest.raises(RuntimeError, match="request 1: " + REFUSED):
        model.generate_batch([[], [1]], prefix=prefix, per_request=[{}, {"loops": 4}])
    prefix.extend(2)                               # deep enough already: nothing to do
    assert (prefix.loops, prefix.nbytes) == (2, size)


@pytest.mark.parametrize("loops, error, message", [
    (0, ValueError, "loops < 1"),
    (1025, ValueError, "loops > 1024"),
    (2.5, ValueError, "loops must be an integer, got float"),
    (None, ValueError, "loops must be an integer, got NoneType"),
])
def test_bad_extend_arguments_are_named(on_fast_backend, loops, error, message):
    model = on_fast_backend["int8-gqa"]
    prefix = model.build_prefix_cache([1, 2, 3], loops=1, warm_start=True)
    with pytest.raises(error, match=message):
        prefix.extend(loops)
    with pytest.raises(ValueError, match="prefill_chunk < 1"):
        prefix.extend(2, prefill_chunk=0)
    assert prefix.loops == 1


def test_warm_start_must_be_a_bool(small_model):
    with pytest.raises(ValueError, match="warm_start must be a bool, got str"):
        small_model.build_prefix_cache([1, 2], warm_start="yes")


def test_generations_run_while_another_thread_extends(require_native, model_files):
    """Two threads keep generating from a warm prefix, one at its old depth and one deeper
    (which may be the call that extends it), while a third extends it: every result is the
    one of a prefix built at the depth asked."""
    with tinyloop.Model(model_files["int8-v2-coda"], backend="native", threads=2) as model:
        prompt = [t % 250 + 1 for t in range(80)]       # max_seq_len 96
        built = model.build_prefix_cache(prompt, loops=5)
        want = {loops: model.generate_from_prefix_cache(built, loops=loops, suffix=[7],
                                                        max_tokens=6, temperature=1.0, seed=11)
                for loops in (1, 4, 5)}
        for _ in range(3):
            warm = model.build_prefix_cache(prompt, loops=1, warm_start=True)
            got, errors = {1: [], 4: []}, []

            def generate(loops):
                try:
                    for _ in range(4):
                        got[loops].append(model.generate_from_prefix_cache(
                            warm, loops=loops, suffix=[7], max_tokens=6, temperature=1.0,
                            seed=11))
                except Exception as exc:          # reported below, not lost in the thread
                    errors.append(exc)

            threads = [threading.Thread(target=generate, args=(loops,)) for loops in got]
            threads.append(threading.Thread(target=warm.extend, args=(5,)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors
            assert got == {loops: [want[loops]] * 4 for loops in got}
            assert warm.loops == 5 and warm.nbytes == model.build_prefix_cache(
                prompt, loops=5, warm_start=True).nbytes
            assert model.generate_from_prefix_cache(warm, loops=5, suffix=[7], max_tokens=6,
                                                    temperature=1.0, seed=11) == want[5]
