"""Adaptive depth (docs/spec.md §5.7), on every backend: a decoded token exits at the same core
iteration, with bit-identical logits, on every backend and on every path — alone, inside
generate_batch among plain and adaptive requests, through the Scheduler with random arrivals and
preemption (whose recomputation replays the recorded exits), from a prefix, with any prefill
chunk; a rule that cannot fire is plain decoding bit for bit; the skipped iterations read the
last computed iteration's KV; bad arguments are named.
"""
import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from conftest import assert_same_bits, assert_same_generation, backend_given, simulated
from strategies import adaptive_request, engine_settings, model_shapes, prompts, sampling
from test_scheduler import need_of, run

def drawn_adaptive_model(data, zoo, backend, **kwargs):
    if backend == "native-cuda":        # test_the_cuda_backend_refuses_exit_rules instead
        pytest.skip("libtinyloop's CUDA backend has no exit rules yet (docs/c-api.md)")
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    return shape, zoo.open(shape, backend, **data.draw(engine_settings(), "engine"), **kwargs)


@backend_given(data=st.data())
def test_each_token_exits_where_the_reference_exits(backend, zoo, data):
    shape, model = drawn_adaptive_model(data, zoo, backend)
    with model, zoo.open(shape, "numpy") as reference:
        config = model.config()
        prompt = data.draw(prompts(config["vocab_size"], max_size=20), "prompt")
        kwargs = data.draw(adaptive_request(config), "request")
        got_depths, want_depths = {}, {}
        got = model.generate(prompt, return_logits=True, depth_stats=got_depths, **kwargs)
        want = reference.generate(prompt, return_logits=True, depth_stats=want_depths, **kwargs)
        assert_same_generation(got, want)
        assert got_depths == want_depths


@backend_given(data=st.data())
def test_a_request_gets_the_same_tokens_on_every_path(backend, zoo, data):
    shape, model = drawn_adaptive_model(data, zoo, backend)
    with model:
        config = model.config()
        vocab = config["vocab_size"]
        prompt = data.draw(prompts(vocab, max_size=24), "prompt")
        kwargs = data.draw(adaptive_request(config), "request")
        stats = {}
        want = model.generate(prompt, return_logits=True, depth_stats=stats, **kwargs)
        assert stats["tokens"] == len(want[1]) - 1
        assert stats["tokens"] <= stats["loops"] <= stats["tokens"] * kwargs["loops"]

        chunk = data.draw(st.integers(1, 9), "prefill chunk")
        assert_same_generation(
            model.generate(prompt, return_logits=True, prefill_chunk=chunk, **kwargs), want)

        split = data.draw(st.integers(1, len(prompt)), "prefix length")
        prefix = model.build_prefix_cache(prompt[:split], loops=kwargs["loops"])
        assert_same_generation(model.generate_from_prefix_cache(
            prefix, suffix=prompt[split:], return_logits=True, **kwargs), want)

        others = data.draw(st.lists(st.tuples(prompts(vocab, max_size=12), st.one_of(
            st.builds(dict, max_tokens=st.integers(1, 6), loops=st.integers(1, 4)),
            adaptive_request(config, 6))),
            max_size=4), "batch mates")
        place = data.draw(st.integers(0, len(others)), "place in the batch")
        batch = others[:place] + [(prompt, kwargs)] + others[place:]
        got = model.generate_batch([p for p, _ in batch], per_request=[kw for _, kw in batch],
                                   return_logits=True)
        assert_same_generation(got[place], want)
        for (p, kw), result in zip(batch, got):
            assert_same_generation(result, model.generate(p, return_logits=True, **kw))


@backend_given(data=st.data())
def test_scheduled_requests_replay_their_exits_when_preempted(backend, zoo, data):
    shape, model = drawn_adaptive_model(data, zoo, backend)
    with model:
        config = model.config()
        vocab = config["vocab_size"]
        arrivals = data.draw(st.lists(st.tuples(
            st.integers(0, 6), prompts(vocab, max_size=20),
            adaptive_request(config, 10)),
            min_size=1, max_size=5), "arrivals")
        max_batch = data.draw(st.integers(1, 4))
        budget = 0
        if data.draw(st.booleans(), "tight KV budget"):
            budget = max(need_of(model, p, **kw) for _, p, kw in arrivals)
        with tinyloop.Scheduler(model, max_batch, data.draw(st.integers(max_batch, max_batch + 16)),
                                budget) as scheduler:
            tokens, _, _ = run(scheduler, arrivals, kv_bound=budget)
            stats, counts = scheduler.stats(), scheduler.depth_counts()
        passes = loops = 0
        for i, (_, prompt, kwargs) in enumerate(arrivals):
            depths = {}
            assert tokens[i] == model.generate(prompt, depth_stats=depths, **kwargs)[len(prompt):]
            passes += depths["tokens"]
            loops += depths["loops"]
        assert (stats["decode_passes"], stats["decode_loops"]) == (passes, loops)
        assert (sum(counts), sum(u * n for u, n in enumerate(counts, 1))) == (passes, loops)
        assert not counts or counts[-1] > 0


def test_a_preempted_request_replays_its_exits(numpy_or_native, models_by_backend):
    """Three adaptive requests under a KV budget one of them needs alone: the newest are
    preempted while they decode, and their recomputation must replay the exits recorded."""
    model = models_by_backend(numpy_or_native)["int4-v2-sandwich"]
    arrivals = [(0, [3 * i + 1, 7, 9, 11 + i], dict(max_tokens=24, loops=3, exit_rule=rule,
                                                   exit_threshold=q, temperature=0.0))
                for i, (rule, q) in enumerate([("gate", 0.5), ("latent", 0.8), ("gate", 0.7)])]
    budget = max(need_of(model, p, **kw) for _, p, kw in arrivals)
    with tinyloop.Scheduler(model, max_batch=3, step_tokens=8, kv_budget_bytes=budget) as scheduler:
        tokens, _, _ = run(scheduler, arrivals, kv_bound=budget)
        assert scheduler.stats()["preemptions"] > 0
    for i, (_, prompt, kwargs) in enumerate(arrivals):
        depths = {}
        assert tokens[i] == model.generate(prompt, depth_stats=depths, **kwargs)[len(prompt):]
        assert 1 < depths["mean_loops"] < 3            # the rules do stop some tokens early


@backend_given(data=st.data())
def test_a_rule_that_cannot_fire_is_plain_decoding(backend, zoo, data):
    shape, model = drawn_adaptive_model(data, zoo, backend)
    with model:
        config = model.config()
        prompt = data.draw(prompts(config["vocab_size"], max_size=16), "prompt")
        loops = data.draw(st.integers(1, 4), "loops")
        plain = dict(data.draw(sampling()), loops=loops, max_tokens=data.draw(st.integers(1, 6)))
        never = [dict(exit_rule="latent", exit_threshold=1e30, min_loops=loops),
                 dict(exit_rule="kl", exit_threshold=1e30, min_loops=loops),
                 dict(exit_rule="argmax", exit_threshold=loops)]     # needs loops + 1 probes
        if config["exit_gate"]:
            never.append(dict(exit_rule="gate", exit_threshold=1.0))
        want = model.generate(prompt, return_logits=True, **plain)
        for rule in never:
            depths = {}
            assert_same_generation(
                model.generate(prompt, return_logits=True, depth_stats=depths, **plain, **rule),
                want)
            assert depths["loops"] == depths["tokens"] * loops


@pytest.mark.parametrize("exit_at", [1, 2, 3])
def test_skipped_iterations_hold_the_last_computed_kv(models, exit_at):
    """The reference's decode pass: a token exiting after `exit_at` of 4 iterations leaves in
    every skipped core slot the keys and values of its last computed iteration, and the other
    iterations' slots as they were computed."""
    from tinyloop.fallback.exit_rules import ForcedExit
    from tinyloop.fallback.forward import decode_adaptive

    engine = models["int8-v2-coda"]._live_engine()
    cfg, loops = engine.config, 4
    cache = engine.new_cache(loops, 0)
    try:
        engine.prefill(cache, np.array([5, 9, 14], np.int32), 3)
        _, depth = decode_adaptive(engine.kernels, engine.weights, cache, 21,
                                   lambda _: ForcedExit(exit_at))
        assert depth == exit_at and cache.length == 4
        for j in range(cfg.n_core_blocks):
            rows = [cache.read(cfg.core_slot(i, j), 3, 4) for i in range(loops)]
            for i in range(loops):
                same = all(np.array_equal(a, b) for a, b in zip(rows[i], rows[exit_at - 1]))
                assert same == (i >= exit_at - 1), (i, j)    # earlier iterations differ
    finally:
        cache.free()


@pytest.mark.parametrize("kwargs, message", [
    (dict(exit_rule="deep"), "exit_rule must be one of 'none', 'gate', 'latent', 'kl', 'argmax'"),
    (dict(exit_rule="argmax", exit_threshold=2.5),
     r"exit_threshold of exit_rule 'argmax' must be an integer \(steps\), got 2.5"),
    (dict(exit_rule="argmax", exit_threshold=0), "exit_threshold < 1"),
    (dict(exit_rule="kl", exit_threshold=-1.0), "exit_threshold must be finite and > 0"),
    (dict(exit_threshold=0.5), "exit_threshold needs an exit_rule"),
    (dict(min_loops=2), "min_loops needs an exit_rule"),
    (dict(exit_rule="latent", exit_threshold=0.0), "exit_threshold must be finite and > 0"),
    (dict(exit_rule="latent", exit_threshold=float("nan")), "exit_threshold must be finite"),
    (dict(exit_rule="latent", min_loops=0), "min_loops < 1"),
    (dict(exit_rule="latent", loops=2, min_loops=3), r"min_loops must be <= loops \(2\), got 3"),
    (dict(exit_rule="gate"), "exit_rule 'gate': the model has no exit gate"),
    (dict(exit_rule="latent", loops=3, draft_loops=1),
     r"exit_rule cannot be combined with speculative decoding \(n_draft > 0\)"),
    (dict(exit_rule="latent", depth_stats=[]), "depth_stats must be a dict or None, got list"),
])
def test_bad_exit_arguments_are_named(numpy_or_native, models_by_backend, kwargs, message):
    model = models_by_backend(numpy_or_native)["int8-gqa"]
    with pytest.raises(ValueError, match=message):
        model.generate([1, 2, 3], **kwargs)


def test_the_cuda_backend_refuses_exit_rules(model_files):
    """libtinyloop's CUDA backend runs every iteration of a row on the device in one go, so it
    refuses adaptive requests (docs/c-api.md) rather than running them at full depth."""
    from conftest import require_backend
    require_backend("native-cuda")
    with tinyloop.Model(model_files["int8-gqa"], backend="native", device="cuda") as model:
        for rule in ("latent", "kl", "argmax"):
            with pytest.raises(RuntimeError, match="not on the CUDA backend yet"):
                model.generate([1, 2, 3], exit_rule=rule)
