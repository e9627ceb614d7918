"""The Python engine's self-speculative decoding and prefix warm start (docs/spec.md §5.6,
§5.4), driven through fallback.Engine directly on each Python backend (numpy, numba,
numba-cuda; the simulator gets tiny models and few examples):

- speculative decoding emits exactly plain decoding's tokens, and the logits each was sampled
  from bit for bit, for random models, depths, draft depths, n_draft, sampling, windows, stop
  rules, from a prefix too; its (drafted, accepted) counts are consistent with what it emitted;
- a round that fails leaves the sequence as it was, and retried decodes as plain;
- a warm-start prefix extended to L (in one or two steps) holds exactly what a prefix built at L
  holds and generates exactly what it does at every depth <= L, also while a generation from
  it runs or while threads race to extend it;
- the scheduler gives speculative requests generate's tokens and counts, within its events
  capacity and a KV budget.
The public API's tests across every backend, native included, are tests/test_speculative.py.
"""
import threading

import numpy as np
import pytest
from hypothesis import strategies as st

from tinyloop.engine import Callbacks, GenerationParams, stop_reached
from tinyloop.fallback import speculate

from conftest import TEST_BACKENDS, assert_same_bits, backend_fixture, backend_given, simulated
from strategies import model_shapes, prompts, sampling

MAX_NEW = 12


# The backends under test that run the Python engine (native is not one).
backend = backend_fixture([name for name in TEST_BACKENDS if name in ("numpy", "numba", "numba-cuda")])


def request_params(**fields):
    """GenerationParams of `fields` (loops among them), the others at plain defaults."""
    base = dict(max_tokens=MAX_NEW, cache_window=0, temperature=0.0, top_k=0, top_p=1.0,
                repetition_penalty=1.0, stop_sequences=(), seed=0, prefill_chunk=4)
    return GenerationParams(**{**base, **fields})


def plain(**fields):
    """request_params(**fields) decoding plainly."""
    return request_params(**{**fields, "n_draft": 0})


class DraftTotals:
    """An on_draft summing what it is told: [drafted, accepted]."""

    def __init__(self):
        self.totals = [0, 0]

    def __call__(self, drafted, accepted):
        self.totals[0] += drafted
        self.totals[1] += accepted


def assert_same_generation(got, want):
    """Two engine results: the same tokens, each sampled from the same logits bit for bit."""
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1]):
        assert_same_bits(a, b)


class Rounds:
    """Callbacks recording, per speculative round, (drafted, accepted, tokens emitted)."""

    def __init__(self):
        self.rounds, self.pending = [], -1      # the first token comes before any round

    def callbacks(self):
        return Callbacks(on_token=self._token, on_draft=self._draft)

    def _token(self, token):
        self.pending += 1

    def _draft(self, drafted, accepted):
        self.rounds.append((drafted, accepted, self.pending))
        self.pending = 0

    def check(self, n_draft, emitted):
        """Every round drafted 1 .. n_draft, emitted 1 .. drafted tokens of which all or all but
        the last were its drafts."""
        assert sum(m for _, _, m in self.rounds) == len(emitted) - 1 and self.pending == 0
        for drafted, accepted, m in self.rounds:
            assert 1 <= m <= drafted <= n_draft and accepted in (m - 1, m)


@st.composite
def speculative_requests(draw, vocab):
    """(loops, fields of GenerationParams): a depth >= 2, a draft depth below it, n_draft,
    sampling, a window, maybe stop sequences."""
    loops = draw(st.integers(2, 4))
    fields = dict(draw(sampling()), loops=loops, draft_loops=draw(st.integers(1, loops - 1)),
                  n_draft=draw(st.integers(1, 6)), cache_window=draw(st.sampled_from([0, 2, 5, 9])),
                  prefill_chunk=draw(st.integers(1, 8)), max_tokens=draw(st.integers(1, MAX_NEW)),
                  stop_sequences=tuple(tuple(s) for s in draw(
                      st.lists(prompts(vocab, 1, 2), max_size=2))))
    return loops, fields


def drawn_engine(data, zoo, backend):
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    block_size = data.draw(st.sampled_from([1, 2, 3, 4, 16]), "block_size")
    return zoo.open(shape, backend, block_size=block_size, threads=1)


@backend_given(data=st.data())
def test_speculative_decoding_is_plain_decoding(backend, zoo, data):
    with drawn_engine(data, zoo, backend) as model:
        engine, vocab = model._engine, model._engine.config.vocab_size
        loops, fields = data.draw(speculative_requests(vocab), "request")
        prompt = np.array(data.draw(prompts(vocab, 1, 12), "prompt"), np.int32)
        want = engine.generate(prompt, plain(**fields))
        if len(want[0]) >= 2 and data.draw(st.booleans(), "stop on tokens plain decoding emits"):
            fields["stop_sequences"] += (tuple(want[0][len(want[0]) // 2:][:2]),)
            want = engine.generate(prompt, plain(**fields))
        rounds = Rounds()
        got = engine.generate(prompt, request_params(**fields), callbacks=rounds.callbacks())
        assert_same_generation(got, want)
        rounds.check(fields["n_draft"], got[0])


@backend_given(data=st.data())
def test_speculative_decoding_from_a_prefix_is_plain_decoding(backend, zoo, data):
    with drawn_engine(data, zoo, backend) as model:
        engine, vocab = model._engine, model._engine.config.vocab_size
        loops, fields = data.draw(speculative_requests(vocab), "request")
        tokens = np.array(data.draw(prompts(vocab, 1, 10), "prefix"), np.int32)
        suffix = np.array(data.draw(prompts(vocab, 0, 4), "suffix"), np.int32)
        built_at = data.draw(st.integers(loops, 4), "prefix loops")
        prefix = engine.build_prefix(tokens, built_at, fields["cache_window"], 3,
                                     warm_start=data.draw(st.booleans(), "warm start"))
        try:
            want = engine.generate(np.concatenate([tokens, suffix]), plain(**fields))
            rounds = Rounds()
            got = engine.generate_from_prefix(prefix, suffix, request_params(**fields),
                                              callbacks=rounds.callbacks())
            assert_same_generation(got, want)
            rounds.check(fields["n_draft"], got[0])
        finally:
            prefix.free()


def test_every_draft_depth_and_size_gives_the_same_tokens(backend, zoo):
    """Exhaustively over draft_loops and n_draft on one model with coda, injection, step norm
    and GQA: the tokens and logits never change, and some drafts are accepted (the accepting
    path runs) and some rejected (the rollback runs)."""
    shape = dict(vocab_size=40, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=16,
                 n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1, default_loops=3,
                 max_seq_len=64, block_layout="post", injection=True, step_norm=True,
                 coda_norm=True, qkv_bias=True)
    sim = simulated(backend)             # a simulated generation takes a minute: a few sizes
    loops = 3 if sim else 4
    with zoo.open(shape, backend, block_size=3) as model:
        engine, prompt = model._engine, np.array([5, 9, 2, 31, 7], np.int32)
        for temperature in (0.0, 0.9):
            fields = dict(loops=loops, temperature=temperature, seed=11, cache_window=4,
                          max_tokens=6 if sim else MAX_NEW)
            want = engine.generate(prompt, request_params(**fields))
            accepted = rejected = 0
            for draft_loops in range(1, loops):
                for n_draft in (2, 7) if sim else (1, 2, 4, 8):
                    rounds = Rounds()
                    got = engine.generate(prompt, request_params(**fields, draft_loops=draft_loops,
                                                                 n_draft=n_draft),
                                          callbacks=rounds.callbacks())
                    assert_same_generation(got, want)
                    rounds.check(n_draft, got[0])
                    accepted += sum(a for _, a, _ in rounds.rounds)
                    rejected += sum(d - a for d, a, _ in rounds.rounds)
            assert accepted > 0 and rejected > 0


def test_a_failed_round_leaves_the_sequence_as_it_was(backend, zoo, monkeypatch):
    """A round whose verification fails (out of memory) emits nothing and leaves the cache's
    length, blocks and pool exactly as before; decoding on from there is plain decoding."""
    shape = dict(vocab_size=50, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, n_core_blocks=1, n_coda_blocks=1, default_loops=3,
                 max_seq_len=64, injection=True)
    with zoo.open(shape, backend, block_size=2) as model:
        engine = model._engine
        prompt = np.array([3, 1, 4, 1, 5], np.int32)
        fields = dict(loops=3, draft_loops=1, n_draft=4, temperature=0.8, seed=5)
        params = request_params(**fields)
        want = engine.generate(prompt, plain(**fields))
        cache = engine.new_cache(3, 0)
        history = prompt.tolist()
        logits = engine.prefill(cache, prompt, 4)
        history.append(engine.kernels.sample(logits, history, params, len(history)))
        before = ([list(blocks) for blocks in cache.layers], cache.length, engine.pool.bytes_in_use)
        real = speculate.forward_part

        def failing_verification(*args, **kwargs):
            if kwargs.get("first_iter"):
                raise MemoryError("injected")
            return real(*args, **kwargs)

        monkeypatch.setattr(speculate, "forward_part", failing_verification)
        emitted = []

        def emit(token, z):
            history.append(token)
            emitted.append(z)
            return stop_reached(history[len(prompt):], params, engine.config.stop_token_ids())

        with pytest.raises(MemoryError, match="injected"):
            speculate.speculative_round(engine.kernels, engine.weights, cache, history, params, emit, 4)
        assert emitted == [] and len(history) == len(prompt) + 1
        assert ([list(blocks) for blocks in cache.layers], cache.length,
                engine.pool.bytes_in_use) == before
        monkeypatch.setattr(speculate, "forward_part", real)
        while not stop_reached(history[len(prompt):], params, engine.config.stop_token_ids()):
            speculate.speculative_round(engine.kernels, engine.weights, cache, history, params, emit,
                                        MAX_NEW - (len(history) - len(prompt)))
        cache.free()
        assert history[len(prompt):] == want[0]
        assert len(emitted) == len(want[1]) - 1
        for z, w in zip(emitted, want[1][1:]):
            assert_same_bits(z, w)


def blocks_of(prefix, kernels):
    """Per layer: None for a released block, else its (kq, sk, vq, sv) at the prefix's
    positions, as host arrays."""
    n, bs = len(prefix.tokens), prefix.cache.pool.block_size
    return [[None if blk is None else tuple(kernels.to_host(getattr(blk, name))[:min(bs, n - b * bs)]
                                            for name in ("kq", "sk", "vq", "sv"))
             for b, blk in enumerate(blocks)]
            for blocks in prefix.cache.layers]


def assert_same_prefix(got, want, kernels):
    """The same depth, KV (released blocks included), final states and kept states."""
    assert (got.loops, got.warm_start) == (want.loops, want.warm_start)
    mine, theirs = blocks_of(got, kernels), blocks_of(want, kernels)
    assert [[b is None for b in layer] for layer in mine] == [[b is None for b in layer] for layer in theirs]
    for layer_a, layer_b in zip(mine, theirs):
        for a, b in zip(layer_a, layer_b):
            for x, y in zip(a or (), b or ()):
                assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert len(got.loop_states) == len(want.loop_states) == got.loops
    for a, b in zip(got.loop_states, want.loop_states):
        assert_same_bits(kernels.to_host(a), kernels.to_host(b))
    assert_same_bits(got.states, want.states)
    assert (got.injected is None) == (want.injected is None)
    if got.injected is not None:
        assert_same_bits(got.injected, want.injected)
    assert got.nbytes == want.nbytes


@backend_given(data=st.data())
def test_an_extended_prefix_is_a_prefix_built_at_its_depth(backend, zoo, data):
    with drawn_engine(data, zoo, backend) as model:
        engine, vocab = model._engine, model._engine.config.vocab_size
        tokens = np.array(data.draw(prompts(vocab, 1, 14), "prefix"), np.int32)
        window = data.draw(st.sampled_from([0, 3, 8]), "window")
        depths = sorted(data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=3, unique=True),
                                  "built at, then extended to"))
        chunks = data.draw(st.lists(st.integers(1, 9), min_size=len(depths), max_size=len(depths)),
                           "chunks")
        prefix = engine.build_prefix(tokens, depths[0], window, chunks[0], warm_start=True)
        try:
            for loops, chunk in zip(depths[1:], chunks[1:]):
                engine.extend_prefix(prefix, loops, chunk)
                built = engine.build_prefix(tokens, loops, window, data.draw(st.integers(1, 9), "chunk"),
                                            warm_start=True)
                try:
                    assert_same_prefix(prefix, built, engine.kernels)
                    fields = dict(draw_request(data, vocab, loops), cache_window=window)
                    suffix = np.array(data.draw(prompts(vocab, 0, 3), "suffix"), np.int32)
                    assert_same_generation(
                        engine.generate_from_prefix(prefix, suffix, request_params(**fields)),
                        engine.generate_from_prefix(built, suffix, request_params(**fields)))
                finally:
                    built.free()
        finally:
            prefix.free()


def draw_request(data, vocab, loops):
    """GenerationParams fields at a drawn depth <= loops, speculative or not."""
    depth = data.draw(st.integers(1, loops), "depth")
    fields = dict(data.draw(sampling(), "sampling"), loops=depth, max_tokens=6)
    if depth > 1 and data.draw(st.booleans(), "speculative"):
        fields.update(draft_loops=data.draw(st.integers(1, depth - 1), "draft_loops"),
                      n_draft=data.draw(st.integers(1, 4), "n_draft"))
    return fields


def test_extension_serves_every_depth_and_leaves_running_generations_alone(backend, zoo):
    """A prefix built at 1 and extended to 3 (then to 3 again: a no-op) generates at every
    depth <= 3 exactly what a build at 3 does; a generation already running from it when it is
    extended keeps its own KV; a cold prefix refuses with a message saying what to do; the
    stored states are counted in nbytes."""
    shape = dict(vocab_size=60, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, n_core_blocks=1, n_coda_blocks=1, default_loops=3,
                 max_seq_len=64, injection=True, coda_norm=True)
    with zoo.open(shape, backend, block_size=4) as model:
        engine = model._engine
        tokens = np.array([7, 1, 8, 2, 8, 1, 8, 2, 8, 4], np.int32)
        cold = engine.build_prefix(tokens, 1, 0, 4)
        warm = engine.build_prefix(tokens, 1, 0, 4, warm_start=True)
        assert (cold.warm_start, warm.warm_start) == (False, True)
        d = engine.config.d_model
        assert warm.nbytes - cold.nbytes == 2 * 4 * len(tokens) * d      # state + injected term
        with pytest.raises(RuntimeError, match=r"loops mismatch: prefix built at loops=1, requested 3 "
                                               r"\(a prefix serves loops <= its own; build it with "
                                               r"warm_start=True to extend it\)"):
            engine.extend_prefix(cold, 3, 4)
        params = request_params(loops=1, temperature=0.7, seed=2)
        during = []

        def extend_on_first_token(token):
            if not during:
                engine.extend_prefix(warm, 3, 3)
            during.append(token)

        shallow = engine.generate_from_prefix(warm, np.array([], np.int32), params,
                                              callbacks=Callbacks(on_token=extend_on_first_token))
        assert_same_generation(shallow, engine.generate_from_prefix(cold, np.array([], np.int32), params))
        assert warm.loops == 3
        engine.extend_prefix(warm, 3, 1)
        engine.extend_prefix(warm, 2, 1)
        built = engine.build_prefix(tokens, 3, 0, 5, warm_start=True)
        assert_same_prefix(warm, built, engine.kernels)
        for loops in (1, 2, 3):
            params = request_params(loops=loops, temperature=0.5, seed=loops)
            assert_same_generation(engine.generate_from_prefix(warm, np.array([3], np.int32), params),
                                   engine.generate(np.append(tokens, 3).astype(np.int32), params))
        for prefix in (cold, warm, built):
            prefix.free()


def run_scheduler(engine, requests, max_batch, step_tokens, budget):
    """Every (prompt, params) through one scheduler: ({id: tokens}, ids, final stats)."""
    s = engine.new_scheduler(max_batch, step_tokens, budget)
    try:
        ids = [s.add(prompt, params) for prompt, params in requests]
        got = {i: [] for i in ids}
        while s.stats()["running"] or s.stats()["waiting"]:
            events = s.step()
            assert len(events) <= step_tokens
            for rid, token, _ in events:
                got[rid].append(token)
            for r in s.running:            # no block past the committed positions survives a round
                held = -(-r.cache.length // engine.pool.block_size)
                assert all(len(blocks) in (0, held) for blocks in r.cache.layers)
        return got, ids, s.stats()
    finally:
        s.free()


@backend_given(data=st.data())
def test_the_scheduler_gives_speculative_requests_generates_tokens(backend, zoo, data):
    with drawn_engine(data, zoo, backend) as model:
        engine, vocab = model._engine, model._engine.config.vocab_size
        requests = []
        for r in range(data.draw(st.integers(1, 3), "requests")):
            loops, fields = data.draw(speculative_requests(vocab), f"request {r}")
            if data.draw(st.booleans(), f"request {r} plain"):
                fields["n_draft"] = 0
            requests.append((np.array(data.draw(prompts(vocab, 1, 10), f"prompt {r}"), np.int32),
                             request_params(**fields)))
        max_batch = data.draw(st.sampled_from([1, 2, 3, 4, 24]), "max_batch")
        step_tokens = max_batch + data.draw(st.integers(0, 6), "step_tokens - max_batch")
        count = DraftTotals()
        want = [engine.generate(prompt, params, callbacks=Callbacks(on_draft=count))[0]
                for prompt, params in requests]
        got, ids, stats = run_scheduler(engine, requests, max_batch, step_tokens, 0)
        assert [got[i] for i in ids] == want
        extra = sum(max(params.n_draft - 1, 0) for _, params in requests)
        if step_tokens - len(requests) >= extra:      # every round had room for its n_draft
            assert [stats["drafted_tokens"], stats["accepted_tokens"]] == count.totals
        assert stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_the_scheduler_fits_rounds_in_its_capacity_and_budget(backend, zoo):
    """Speculative requests under a tight step (step_tokens) and a KV budget that
    preempts: the same tokens; with room for every round, generate's draft counts."""
    if simulated(backend):
        pytest.skip("minutes on the simulator; the policy is the kernels' caller, and the "
                    "drawn scheduler test above runs there")
    shape = dict(vocab_size=48, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, n_core_blocks=1, n_coda_blocks=1, default_loops=3, max_seq_len=64)
    with zoo.open(shape, backend, block_size=2) as model:
        engine = model._engine
        requests = [(np.array(p, np.int32), request_params(loops=3, draft_loops=d, n_draft=k,
                                                          temperature=t, seed=i, max_tokens=10))
                    for i, (p, d, k, t) in enumerate([([1, 2, 3], 1, 4, 0.0), ([4, 5], 2, 3, 0.8),
                                                      ([6, 7, 8, 9], 1, 0, 0.0), ([10], 2, 6, 0.0)])]
        count = DraftTotals()
        want = [engine.generate(p, params, callbacks=Callbacks(on_draft=count))[0]
                for p, params in requests]
        got, ids, stats = run_scheduler(engine, requests, 16, 16, 0)
        assert [got[i] for i in ids] == want
        assert [stats["drafted_tokens"], stats["accepted_tokens"]] == count.totals
        got, ids, stats = run_scheduler(engine, requests, 4, 4, 0)
        assert [got[i] for i in ids] == want
        one = -(-(4 + 10) // 2) * engine.config.n_layers(3) * engine.pool.block_nbytes
        got, ids, stats = run_scheduler(engine, requests, 4, 5, int(1.5 * one))
        assert [got[i] for i in ids] == want and stats["preemptions"] > 0


def test_racing_extensions_and_generations_agree(backend, zoo):
    """Two threads extend one warm prefix (to 3 and to 2) while two others generate from it
    at its old depth: one extension does the work, the other finds it deep enough or deepens
    it further, and every generation is the one of a prefix built at its depth."""
    if simulated(backend):
        pytest.skip("threads racing on the simulator take minutes; the numba kernels are the same")
    shape = dict(vocab_size=60, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1, default_loops=3,
                 max_seq_len=64, injection=True)
    with zoo.open(shape, backend, block_size=4) as model:
        engine = model._engine
        tokens = np.array([t % 50 + 1 for t in range(30)], np.int32)
        params = request_params(loops=1, temperature=1.0, seed=4, max_tokens=4)
        built = engine.build_prefix(tokens, 3, 0, 7, warm_start=True)
        want = engine.generate_from_prefix(built, np.array([9], np.int32), params)
        for _ in range(2):
            warm = engine.build_prefix(tokens, 1, 0, 5, warm_start=True)
            got, errors = [], []

            def run(work):
                try:
                    work()
                except Exception as exc:          # reported below, not lost in the thread
                    errors.append(exc)

            def generate():
                got.append(engine.generate_from_prefix(warm, np.array([9], np.int32), params))

            works = [lambda: engine.extend_prefix(warm, 3, 4), lambda: engine.extend_prefix(warm, 2, 6),
                     generate, generate]
            threads = [threading.Thread(target=run, args=(work,)) for work in works]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors
            for result in got:
                assert_same_generation(result, want)
            assert_same_prefix(warm, built, engine.kernels)
            warm.free()
        built.free()
