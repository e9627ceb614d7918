"""Continuous batching (tinyloop.Scheduler), on every backend: whatever the arrival order,
prompt lengths, cancellations, batch size, step token budget and KV budget, every request's
tokens are exactly what Model.generate gives it alone; a cancelled request's are a prefix of
them. Preemption under a tight KV budget loses nothing, a long prompt is prefilled in chunks
between the running decodes, the prefix cache serves prompts that share a prefix, speculative
requests among plain ones get plain decoding's tokens (their rounds counted), and bad
arguments are named. On libtinyloop's CPU backend a step's decodes and prompt chunks run as one
mixed pass: it emits exactly the events of separate passes (TINYLOOP_MIXED_PASS=0), step by
step.
"""
import collections
import contextlib
import os
import re

import pytest
from hypothesis import strategies as st

import tinyloop
from conftest import backend_given, run_retrying_failed_steps, simulated
from strategies import adaptive_request, engine_settings, model_shapes, prompts, sampling


def need_of(model, prompt, **kwargs):
    """The KV bytes a request could need alone, as a 1-byte budget's refusal names them."""
    with tinyloop.Scheduler(model, max_batch=1, step_tokens=1, kv_budget_bytes=1) as probe:
        with pytest.raises(ValueError, match="more than kv_budget_bytes 1") as refused:
            probe.add(prompt, **kwargs)
    return int(re.search(r"could need (\d+) bytes", str(refused.value)).group(1))


def step_events(kwargs):
    """The events a request may get in one step: one, or a speculative round's tokens."""
    return (kwargs.get("n_draft") or 4) if kwargs.get("draft_loops") else 1


def run(scheduler, arrivals, cancels=(), max_steps=10_000, kv_bound=0):
    """Step until idle, adding request i at step arrivals[i][0] and cancelling the (step,
    index) pairs of `cancels`; with kv_bound, check after every step that the running requests
    hold at most that many KV bytes. Returns ({index: tokens}, {index: finish}, ids)."""
    ids, tokens, finish, index = {}, {}, {}, {}
    for step in range(max_steps):
        for i, (at, prompt, kwargs) in enumerate(arrivals):
            if at == step:
                ids[i] = scheduler.add(prompt, **kwargs)
                index[ids[i]] = i
                tokens[i] = []
        for at, i in cancels:
            if at == step and i in ids:
                was_there = scheduler.cancel(ids[i])
                assert was_there == (i not in finish)
                finish.setdefault(i, "cancelled")
        events = scheduler.step()
        for rid, n in collections.Counter(e.id for e in events).items():
            assert n <= step_events(arrivals[index[rid]][2])
        for e in events:
            i = index[e.id]
            assert i not in finish, f"request {i} emitted after it ended"
            tokens[i].append(e.token)
            if e.finish:
                finish[i] = e.finish
        if kv_bound:
            assert scheduler.stats()["kv_bytes"] <= kv_bound
        if step >= max(at for at, _, _ in arrivals) and not scheduler.has_work:
            return tokens, finish, ids
    raise AssertionError("the scheduler did not finish")


@st.composite
def request_kwargs(draw, vocab):
    loops = draw(st.integers(1, 4))
    kwargs = dict(draw(sampling()), max_tokens=draw(st.integers(1, 8)), loops=loops,
                  cache_window=draw(st.sampled_from([0, 0, 3, 8])),
                  stop_sequences=draw(st.lists(prompts(vocab, max_size=2), max_size=2)))
    if loops > 1 and draw(st.booleans()):        # speculative decoding (docs/spec.md §5.6)
        kwargs.update(draft_loops=draw(st.integers(1, loops - 1)), n_draft=draw(st.integers(1, 6)))
    return kwargs


@backend_given(data=st.data())
def test_every_request_gets_what_it_gets_alone(backend, zoo, data):
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    cache_bytes = data.draw(st.sampled_from([0, 1 << 12, 1 << 20]), "prefix cache bytes")
    with zoo.open(shape, backend, **data.draw(engine_settings(), "engine"),
                  prefix_cache_bytes=cache_bytes) as model:
        vocab = model.config()["vocab_size"]
        shared = data.draw(prompts(vocab, min_size=0, max_size=40), "shared prefix")
        arrivals = data.draw(st.lists(st.tuples(
            st.integers(0, 8), prompts(vocab, max_size=30).map(lambda p: shared + p),
            request_kwargs(vocab)), min_size=1, max_size=6), "arrivals")
        max_batch = data.draw(st.integers(1, 4))
        step_tokens = data.draw(st.integers(max_batch, max_batch + 24))
        budget = 0
        if data.draw(st.booleans(), "tight KV budget"):
            largest = max(need_of(model, p, **kw) for _, p, kw in arrivals)
            budget = int(largest * data.draw(st.floats(1.0, 3.0)))
        cancels = data.draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, len(arrivals) - 1)),
                                     max_size=2), "cancels")
        with tinyloop.Scheduler(model, max_batch, step_tokens, budget) as scheduler:
            # with a prefix cache, its evictions hand running requests blocks they then hold
            # alone, past the plan: the bound holds without one
            tokens, finish, _ = run(scheduler, arrivals, cancels, kv_bound=budget * (cache_bytes == 0))
            stats = scheduler.stats()
        for i, (_, prompt, kwargs) in enumerate(arrivals):
            want = model.generate(prompt, **dict(kwargs, n_draft=0))[len(prompt):]   # plain
            if finish[i] == "cancelled":
                assert tokens[i] == want[:len(tokens[i])]
                continue
            assert tokens[i] == want
            assert finish[i] == ("length" if len(want) == kwargs["max_tokens"] and not (
                want[-1] in model.stop_token_ids() or any(
                    want[-len(s):] == s for s in kwargs["stop_sequences"])) else "stop")
        assert stats["running"] == stats["waiting"] == stats["kv_bytes"] == 0
        assert stats["finished"] + stats["cancelled"] == len(arrivals)
        assert stats["generated_tokens"] == sum(map(len, tokens.values()))
        assert stats["accepted_tokens"] <= stats["drafted_tokens"]


@contextlib.contextmanager
def separate_passes():
    """Schedulers created inside run a step's decodes and prompt chunks as separate passes."""
    os.environ["TINYLOOP_MIXED_PASS"] = "0"
    try:
        yield
    finally:
        del os.environ["TINYLOOP_MIXED_PASS"]


def events_by_step(model, arrivals, max_batch, step_tokens, budget):
    """Each step's events (id, token, finish) of a schedule of `arrivals`, and its counters."""
    steps = []
    with tinyloop.Scheduler(model, max_batch, step_tokens, budget) as scheduler:
        for step in range(10_000):
            for at, prompt, kwargs in arrivals:
                if at == step:
                    scheduler.add(prompt, **kwargs)
            steps.append(scheduler.step())
            if step >= max(at for at, _, _ in arrivals) and not scheduler.has_work:
                return steps, scheduler.stats()
    raise AssertionError("the scheduler did not finish")


@backend_given(data=st.data())
def test_the_mixed_pass_emits_what_separate_passes_emit(backend, zoo, data):
    """Plain, windowed, speculative and adaptive requests (not on CUDA, which has no exit rules
    yet) arriving while others decode: each step's events are the same with one mixed pass as
    with separate passes (the Python engines run rows alone either way)."""
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    cache_bytes = data.draw(st.sampled_from([0, 1 << 20]), "prefix cache bytes")
    with zoo.open(shape, backend, **data.draw(engine_settings(), "engine"),
                  prefix_cache_bytes=cache_bytes) as model:
        config = model.config()
        vocab = config["vocab_size"]
        arrivals = data.draw(st.lists(st.tuples(
            st.integers(0, 6), prompts(vocab, max_size=30),
            request_kwargs(vocab) if backend == "native-cuda" else
            st.one_of(request_kwargs(vocab), adaptive_request(config))), min_size=2, max_size=6), "arrivals")
        max_batch = data.draw(st.integers(2, 4))
        step_tokens = data.draw(st.integers(max_batch, max_batch + 12))
        budget = 0
        if data.draw(st.booleans(), "tight KV budget"):
            budget = max(need_of(model, p, **kw) for _, p, kw in arrivals)
        mixed, mixed_stats = events_by_step(model, arrivals, max_batch, step_tokens, budget)
        model.clear_prefix_cache()
        with separate_passes():
            separate, separate_stats = events_by_step(model, arrivals, max_batch, step_tokens, budget)
    assert mixed == separate
    assert separate_stats["mixed_passes"] == 0
    assert {k: v for k, v in mixed_stats.items() if k != "mixed_passes"} == \
        {k: v for k, v in separate_stats.items() if k != "mixed_passes"}


def test_a_step_with_decodes_and_a_prompt_chunk_is_one_pass(numpy_or_native, models_by_backend):
    """A request decoding while a long prompt is prefilled: on libtinyloop every such step is one
    mixed pass (counted); the Python engines run rows alone and count none."""
    model = models_by_backend(numpy_or_native)["int8-gqa"]
    try:
        with tinyloop.Scheduler(model, max_batch=2, step_tokens=8) as s:
            s.add([1, 2, 3], max_tokens=12, temperature=0.0)
            s.step()                                 # its prompt alone; its first token
            s.add(list(range(1, 40)), max_tokens=2)
            while s.has_work:
                s.step()
            stats = s.stats()
    finally:
        model.clear_prefix_cache()                   # the other tests' prompts start the same
    assert stats["generated_tokens"] == 12 + 2       # so the decodes outlast the prefill
    assert stats["mixed_passes"] == (-(-39 // 7) if numpy_or_native == "native" else 0)


def test_a_burst_beyond_the_kv_budget_is_preempted_and_loses_nothing(numpy_or_native, zoo):
    shape = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, default_loops=2, max_seq_len=128, eos_id=-1)
    with zoo.open(shape, numpy_or_native, block_size=4, prefix_cache_bytes=0) as model:
        arrivals = [(0, [i + 1] * (10 + 3 * i), dict(max_tokens=12, temperature=0.8, seed=i))
                    for i in range(8)]
        budget = 2 * max(need_of(model, p, **kw) for _, p, kw in arrivals)
        with tinyloop.Scheduler(model, max_batch=8, step_tokens=64, kv_budget_bytes=budget) as s:
            tokens, finish, _ = run(s, arrivals, kv_bound=budget)
            stats = s.stats()
        assert stats["preemptions"] > 0
        assert stats["prompt_tokens"] > sum(len(p) for _, p, _ in arrivals)   # recomputed
        for i, (_, prompt, kwargs) in enumerate(arrivals):
            assert tokens[i] == model.generate(prompt, **kwargs)[len(prompt):]
            assert finish[i] == "length"


def test_speculative_requests_among_plain_ones_get_plain_tokens(numpy_or_native, zoo):
    """Requests drafting at depth 1 or 2 (n_draft 2 .. 5) beside plain ones, under schedules
    that cap their rounds (a small batch and step budget) and a KV budget that preempts: each
    gets Model.generate's plain tokens, and the drafted and accepted tokens are counted."""
    shape = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, default_loops=3, max_seq_len=128, eos_id=-1)
    with zoo.open(shape, numpy_or_native, block_size=4, prefix_cache_bytes=0) as model:
        arrivals = [(i % 3, [i + 1] * (4 + 3 * i),
                     dict(max_tokens=14, temperature=0.8 if i % 2 else 0.0, seed=i,
                          **(dict(draft_loops=1 + i % 2, n_draft=2 + i % 4) if i % 3 else {})))
                    for i in range(8)]
        want = [model.generate(p, **dict(kw, n_draft=0))[len(p):] for _, p, kw in arrivals]
        budget = 2 * max(need_of(model, p, **kw) for _, p, kw in arrivals)
        for max_batch, step_tokens, kv_budget in ((8, 64, 0), (3, 3, 0), (8, 64, budget)):
            with tinyloop.Scheduler(model, max_batch, step_tokens, kv_budget) as s:
                tokens, finish, _ = run(s, arrivals, kv_bound=kv_budget)
                stats = s.stats()
            assert [tokens[i] for i in range(len(arrivals))] == want
            assert set(finish.values()) == {"length"}
            assert 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
            assert stats["generated_tokens"] == sum(map(len, want))
        assert stats["preemptions"] > 0


def test_a_long_prompt_is_prefilled_between_the_running_decodes(numpy_or_native, models_by_backend):
    model = models_by_backend(numpy_or_native)["int8-gqa"]
    with tinyloop.Scheduler(model, max_batch=2, step_tokens=8) as s:
        short = s.add([1, 2, 3], max_tokens=20, temperature=0.0)
        s.step()                                     # its prompt; its first token
        long_one = s.add(list(range(1, 60)), max_tokens=2)
        steps_until_long = 0
        while True:
            events = {e.id: e for e in s.step()}
            steps_until_long += 1
            assert short in events                   # the decode never waits for the prefill
            if long_one in events:
                break
        assert steps_until_long == -(-59 // 7)       # 7 prompt positions a step beside 1 decode


def test_requests_sharing_a_prefix_reuse_its_cached_blocks(numpy_or_native, model_files):
    with tinyloop.Model(model_files["int8-gqa"], backend=numpy_or_native, block_size=8,
                        prefix_cache_bytes=1 << 22) as model:
        shared = list(range(1, 41))
        with tinyloop.Scheduler(model) as s:
            first = s.add(shared + [5], max_tokens=3)
            while s.has_work:
                s.step()
            second = s.add(shared + [6, 7], max_tokens=3, seed=3, temperature=1.0)
            got = []
            while s.has_work:
                got += [e.token for e in s.step() if e.id == second]
            assert first != second
            assert s.stats()["cached_tokens"] == 40
        assert got == model.generate(shared + [6, 7], max_tokens=3, seed=3, temperature=1.0)[42:]


def test_a_salt_keeps_tenants_apart(numpy_or_native, model_files):
    with tinyloop.Model(model_files["int8-gqa"], backend=numpy_or_native, block_size=8,
                        prefix_cache_bytes=1 << 22) as model:
        shared = list(range(1, 41))
        with tinyloop.Scheduler(model) as s:
            for salt in ("a", "b", "a"):
                s.add(shared + [7], max_tokens=1, cache_salt=salt)
                while s.has_work:
                    s.step()
            assert s.stats()["cached_tokens"] == 40      # only the second "a"


def test_bad_arguments_are_named(numpy_or_native, models_by_backend):
    model = models_by_backend(numpy_or_native)["int8-gqa"]
    with pytest.raises(ValueError, match="step_tokens 3 < max_batch 4"):
        tinyloop.Scheduler(model, max_batch=4, step_tokens=3)
    with pytest.raises(ValueError, match="max_batch < 1"):
        tinyloop.Scheduler(model, max_batch=0)
    with pytest.raises(ValueError, match="kv_budget_bytes < 0"):
        tinyloop.Scheduler(model, kv_budget_bytes=-1)
    s = tinyloop.Scheduler(model, max_batch=2, step_tokens=4)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        s.add([1, 2], temperature=-1.0)
    with pytest.raises(ValueError, match="out of range"):
        s.add([1, 10**6])
    with pytest.raises(RuntimeError, match="exceeds max_seq_len"):
        s.add([1] * model.config()["max_seq_len"])
    assert s.cancel(12345) is False
    assert s.stats()["waiting"] == 0                 # nothing refused was queued
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="scheduler was closed"):
        s.step()


def test_a_closed_model_stops_its_scheduler(numpy_or_native, model_files):
    model = tinyloop.Model(model_files["int8-gqa"], backend=numpy_or_native)
    s = tinyloop.Scheduler(model)
    s.add([1, 2, 3])
    model.close()
    with pytest.raises(RuntimeError, match="model was closed"):
        s.step()
    s.close()


def test_a_failed_step_is_retried_exactly(monkeypatch, models_by_backend):
    """A step of the Python policy that fails half way (here the second decode of step 3)
    preempts its requests: the retried steps recompute them and no token changes."""
    from tinyloop.fallback import scheduler as policy
    model = models_by_backend("numpy")["int8-gqa"]
    prompts_ = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    want = [model.generate(p, max_tokens=6, temperature=0.9, seed=i)[len(p):]
            for i, p in enumerate(prompts_)]
    calls, real = [], policy.decode_pass

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "decode_pass", failing_once)
    with tinyloop.Scheduler(model, max_batch=3, step_tokens=3) as s:
        ids = [s.add(p, max_tokens=6, temperature=0.9, seed=i) for i, p in enumerate(prompts_)]
        got, raised = run_retrying_failed_steps(s, ids)
        assert raised == 1 and s.stats()["preemptions"] > 0
    assert [got[i] for i in ids] == want
