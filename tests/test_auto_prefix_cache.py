"""The automatic prefix cache (docs/spec.md §4.3) on every backend: the same tokens and
bit-identical logits with the cache on or off, after evictions, under budgets too small for the
workload, across salts, depths and windows; what it shares, keeps and evicts; and the memory it
reports (docs/api.md formulas, which differ between libtinyloop and the Python engine).

Each backend runs a cache-less twin of every cached model; a result is compared with the twin's.
"""

import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop.quickbench import backend_kwargs

from conftest import MODEL_SHAPES, assert_same_bits, backend_given, generate_on_threads, require_backend
from strategies import sampling

BLOCK = 4                          # the cached models' KV block size
SHAPE = MODEL_SHAPES["int8-gqa"]   # vocab 263, G=2, D=8, n_pre 1, default loops 3
BUDGETS = {"tiny": 2_500, "small": 9_000, "large": 1 << 30}
LIBRARY_BACKENDS = ("native", "native-cuda")   # libtinyloop's block layout; the rest: fallback/


def block_bytes(backend, n_layers, G=SHAPE["n_kv_heads"], D=SHAPE["head_dim"], bs=BLOCK):
    """Bytes of one cached block at n_layers layers (docs/api.md, "Memory")."""
    if backend in LIBRARY_BACKENDS:
        return 64 + n_layers * G * -(-(2 * bs * D + 8 * bs) // 64) * 64
    return n_layers * 2 * bs * G * (D + 4)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "gqa.tinyloop"
    tinyloop.random_model(path, seed=11, **SHAPE)
    return path


@pytest.fixture(scope="module")
def opened(backend, model_path):
    """budget name -> a cached Model, plus "off" -> its cache-less twin (module lifetime)."""
    models = {name: fresh(backend, model_path, budget) for name, budget in BUDGETS.items()}
    models["off"] = fresh(backend, model_path, 0)
    yield models
    for model in models.values():
        model.close()


def fresh(backend, path, budget):
    return tinyloop.Model(path, **backend_kwargs(backend), block_size=BLOCK,
                          prefix_cache_bytes=budget)


@st.composite
def workloads(draw):
    """Requests sharing a few system prompts: (prompt, generate kwargs) each."""
    vocab = SHAPE["vocab_size"]
    tokens = st.lists(st.integers(0, vocab - 1), min_size=0, max_size=12)
    systems = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30),
                            min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.sampled_from(systems)) + draw(tokens)
        kwargs = dict(draw(sampling()), max_tokens=draw(st.integers(1, 4)),
                      loops=draw(st.integers(1, 4)), cache_window=draw(st.sampled_from([0, 0, 5])),
                      prefill_chunk=draw(st.integers(1, 16)),
                      cache_salt=draw(st.sampled_from([None, None, "a", "b"])))
        requests.append((prompt, kwargs))
    return requests


@backend_given(workload=workloads(), budget=st.sampled_from(sorted(BUDGETS)))
def test_cache_never_changes_tokens_or_logits(backend, opened, workload, budget):
    cached, plain = opened[budget], opened["off"]
    for prompt, kwargs in workload:
        got, got_logits = cached.generate(prompt, return_logits=True, **kwargs)
        want, want_logits = plain.generate(prompt, return_logits=True, **kwargs)
        assert got == want
        assert_same_bits(got_logits, want_logits)


@backend_given(workload=workloads(), budget=st.sampled_from(sorted(BUDGETS)))
def test_stats_account_for_every_prompt_token_and_respect_the_budget(backend, opened, workload,
                                                                     budget):
    model = opened[budget]
    before = model.cache_stats()
    for prompt, kwargs in workload:
        model.generate(prompt, **kwargs)
        stats = model.cache_stats()
        assert stats["bytes_in_use"] <= stats["budget_bytes"] == BUDGETS[budget]
    after = model.cache_stats()
    assert after["lookups"] - before["lookups"] == len(workload)
    total = sum(len(prompt) for prompt, _ in workload)
    assert (after["hit_tokens"] + after["prefilled_tokens"]
            - before["hit_tokens"] - before["prefilled_tokens"]) == total


def test_a_repeated_prompt_reuses_its_full_blocks(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    prompt = list(range(1, 23))                       # 22 tokens: 5 full blocks of 4
    first = model.generate(prompt, max_tokens=3)
    assert model.cache_stats()["hit_tokens"] == 0
    assert model.cache_stats()["blocks"] == 5
    assert model.generate(prompt, max_tokens=3) == first
    assert model.cache_stats()["hit_tokens"] == 20
    # a prompt of exactly 5 blocks reuses 4: the last token is always run for its logits
    model.generate(prompt[:20], max_tokens=1)
    assert model.cache_stats()["hit_tokens"] == 20 + 16


def test_salts_isolate_tenants(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    prompt = list(range(40, 70))
    model.generate(prompt, max_tokens=2, cache_salt="alice")
    hits = model.cache_stats()["hit_tokens"]
    model.generate(prompt, max_tokens=2, cache_salt="bob")
    assert model.cache_stats()["hit_tokens"] == hits, "another tenant's blocks were shared"
    model.generate(prompt, max_tokens=2)
    assert model.cache_stats()["hit_tokens"] == hits, "a salted tenant's blocks were shared"
    model.generate(prompt, max_tokens=2, cache_salt="alice")
    assert model.cache_stats()["hit_tokens"] == hits + 28, "the same tenant shares"
    model.generate(prompt, max_tokens=2, cache_salt="")
    assert model.cache_stats()["hit_tokens"] == hits + 56, "'' is the unsalted tenant"


def test_a_deeper_block_serves_shallower_requests_and_replaces_a_shallower_one(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    prompt = list(range(100, 117))                    # 4 full blocks
    model.generate(prompt, max_tokens=1, loops=2)
    model.generate(prompt, max_tokens=1, loops=1)
    assert model.cache_stats()["hit_tokens"] == 16
    model.generate(prompt, max_tokens=1, loops=4)     # deeper than cached: a miss ...
    stats = model.cache_stats()
    assert stats["hit_tokens"] == 16
    assert stats["blocks"] == 4                       # ... whose blocks replace the shallow ones
    assert stats["bytes_in_use"] == 4 * block_bytes(backend, SHAPE["n_pre_blocks"] + 4)
    model.generate(prompt, max_tokens=1, loops=3)
    assert model.cache_stats()["hit_tokens"] == 32


def test_the_window_is_part_of_the_key(backend, model_path, opened):
    model = fresh(backend, model_path, 1 << 30)
    prompt = list(range(7, 40))
    want = opened["off"].generate(prompt, max_tokens=4, cache_window=6, return_logits=True)
    model.generate(prompt, max_tokens=4)
    got = model.generate(prompt, max_tokens=4, cache_window=6, return_logits=True)
    assert model.cache_stats()["hit_tokens"] == 0
    again = model.generate(prompt, max_tokens=4, cache_window=6, return_logits=True)
    assert model.cache_stats()["hit_tokens"] == 32
    for tokens, logits in (got, again):
        assert tokens == want[0]
        assert_same_bits(logits, want[1])


def test_tiny_budgets_evict_least_recently_used_first(backend, model_path, opened):
    per_block = block_bytes(backend, SHAPE["n_pre_blocks"] + 3)
    model = fresh(backend, model_path, 6 * per_block)
    a, b, c = ([base + i for i in range(13)] for base in (10, 50, 90))   # 3 full blocks each
    for prompt in (a, b):
        model.generate(prompt, max_tokens=1)
    model.generate(a, max_tokens=1)                   # a is now more recent than b
    model.generate(c, max_tokens=1)                   # needs room: b's blocks go
    stats = model.cache_stats()
    assert stats["evicted_blocks"] == 3 and stats["blocks"] == 6
    hits = stats["hit_tokens"]
    model.generate(a, max_tokens=1)
    assert model.cache_stats()["hit_tokens"] == hits + 12
    model.generate(b, max_tokens=1)
    assert model.cache_stats()["hit_tokens"] == hits + 12
    for prompt in (a, b, c):
        assert model.generate(prompt, max_tokens=5) == opened["off"].generate(prompt, max_tokens=5)


def test_blocks_in_use_are_never_evicted(backend, model_path):
    per_block = block_bytes(backend, SHAPE["n_pre_blocks"] + 3)
    model = fresh(backend, model_path, 3 * per_block)
    a, b = [5 + i for i in range(13)], [60 + i for i in range(13)]
    seen = []

    def meanwhile(token):
        if not seen:                                  # a's blocks are held by its sequence
            seen.append(model.generate(b, max_tokens=1))
            seen.append(model.cache_stats())

    model.generate(a, max_tokens=3, on_token=meanwhile)
    assert seen[1]["evicted_blocks"] == 0 and seen[1]["blocks"] == 3
    model.generate(b, max_tokens=1)                   # a is done: now its blocks may go
    assert model.cache_stats()["evicted_blocks"] == 3


def test_counters_agree_with_numpy(backend, model_path):
    """Every counter but bytes_in_use (whose formula is per engine) is numpy's."""
    rng = np.random.default_rng(5)
    systems = [rng.integers(0, 263, size=n).tolist() for n in (9, 17, 30)]
    workload = [systems[i % 3] + rng.integers(0, 263, size=i % 5).tolist() for i in range(12)]
    stats = {}
    for name in ("numpy", backend):
        model = fresh(name, model_path, 1 << 30)
        for i, prompt in enumerate(workload):
            model.generate(prompt, max_tokens=2, loops=1 + i % 3)
        stats[name] = model.cache_stats()
        del stats[name]["bytes_in_use"]
    assert stats[backend] == stats["numpy"]


def test_clear_and_close_drop_the_cached_blocks(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    model.generate(list(range(30)), max_tokens=1)
    assert model.cache_stats()["blocks"] == 7
    model.clear_prefix_cache()
    stats = model.cache_stats()
    assert stats["blocks"] == stats["bytes_in_use"] == 0 and stats["lookups"] == 1
    model.close()
    with pytest.raises(RuntimeError, match="model was closed"):
        model.cache_stats()


def test_a_model_without_cache_reports_zeros(opened):
    assert set(opened["off"].cache_stats().values()) == {0}


@pytest.mark.parametrize("salt, message", [(3, "cache_salt must be a str"),
                                           ("a\0b", "NUL")])
def test_bad_salts_are_refused(opened, salt, message):
    with pytest.raises(ValueError, match=message):
        opened["large"].generate([1, 2, 3], cache_salt=salt)


def test_bad_budgets_are_refused(model_path):
    """Model checks the budget before it opens any engine: one backend says it for all."""
    with pytest.raises(ValueError, match="prefix_cache_bytes < 0"):
        tinyloop.Model(model_path, backend="numpy", prefix_cache_bytes=-1)


# -- memory ------------------------------------------------------------------------------------

def test_prefix_nbytes_is_the_documented_formula(backend, model_path):
    model = fresh(backend, model_path, 0)
    for n, loops, window in ((1, 1, 0), (17, 3, 0), (33, 2, 6)):
        prefix = model.build_prefix_cache(list(range(n)), loops=loops, cache_window=window)
        n_layers = SHAPE["n_pre_blocks"] + loops
        first_live = max(0, n - window + 1) // BLOCK if window else 0
        n_blocks = -(-n // BLOCK) - first_live
        if backend in LIBRARY_BACKENDS:
            kv = n_blocks * block_bytes(backend, n_layers)
        else:
            kv = n_blocks * n_layers * block_bytes(backend, 1)
        assert prefix.nbytes == kv + 4 * loops * SHAPE["d_model"] + 4 * n


def test_cache_bytes_are_the_documented_formula(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    model.generate(list(range(50)), max_tokens=1, loops=2)
    stats = model.cache_stats()
    assert stats["blocks"] == 12
    assert stats["bytes_in_use"] == 12 * block_bytes(backend, SHAPE["n_pre_blocks"] + 2)


def test_continuations_of_a_long_prefix_copy_none_of_its_blocks(tmp_path):
    """Native only: it reads libtinyloop's own allocation counters (native_memory_stats)."""
    require_backend("native")
    path = tmp_path / "long.tinyloop"
    tinyloop.random_model(path, seed=3, **{**SHAPE, "n_kv_heads": 4, "head_dim": 32,
                                           "n_heads": 4, "n_pre_blocks": 2, "max_seq_len": 1100})
    model = tinyloop.Model(path, backend="native", prefix_cache_bytes=0)
    prefix = model.build_prefix_cache(np.arange(1024) % 263, loops=4)
    n = 8
    start = tinyloop.native_memory_stats(reset_peak=True)
    outs = model.generate_batch([[]] * n, prefix=prefix, max_tokens=8,
                                per_request=[{"seed": i, "temperature": 1.0} for i in range(n)])
    peak = tinyloop.native_memory_stats()["peak_bytes"] - start["bytes_in_use"]
    assert len({tuple(o) for o in outs}) > 1
    # each continuation opens one block of its own for its new tokens; a copy of the prefix
    # would cost prefix.nbytes per continuation. All 8 together stay below half of one copy.
    assert peak < prefix.nbytes / 2, (peak, prefix.nbytes)


# -- the stress workload -------------------------------------------------------------------------

def test_stress_200_requests_over_5_system_prompts(backend, model_path, opened):
    rng = np.random.default_rng(2026)
    systems = [rng.integers(0, 263, size=int(n)).tolist() for n in rng.integers(20, 60, size=5)]
    per_block = block_bytes(backend, SHAPE["n_pre_blocks"] + 3)
    model = fresh(backend, model_path, 24 * per_block)      # holds about 2 system prompts
    for i in range(200):
        prompt = systems[rng.integers(5)] + rng.integers(0, 263, size=int(rng.integers(0, 12))).tolist()
        kwargs = dict(max_tokens=2, seed=i, temperature=0.7)
        assert model.generate(prompt, **kwargs) == opened["off"].generate(prompt, **kwargs)
    stats = model.cache_stats()
    assert stats["lookups"] == 200 and stats["evicted_blocks"] > 0
    assert stats["hit_tokens"] / (stats["hit_tokens"] + stats["prefilled_tokens"]) > 0.3


# -- prefill progress ----------------------------------------------------------------------------

def test_prefill_progress_counts_reused_positions_and_can_stop_a_request(backend, model_path):
    model = fresh(backend, model_path, 1 << 30)
    prompt, log = list(range(30)), []

    def note(done, total):
        log.append((done, total))

    first = model.generate(prompt, max_tokens=3, prefill_chunk=8, on_prefill=note)
    assert log == [(8, 30), (16, 30), (24, 30), (30, 30)]
    log.clear()
    model.generate(prompt, max_tokens=3, prefill_chunk=8, on_prefill=note)   # 28 cached
    assert log == [(30, 30)]
    log.clear()
    prefix = model.build_prefix_cache(prompt[:10])
    model.generate_from_prefix_cache(prefix, suffix=prompt[10:], max_tokens=3, prefill_chunk=8,
                                     on_prefill=note)
    assert log == [(18, 30), (26, 30), (30, 30)]

    def interrupt(done, total):
        raise KeyboardInterrupt

    blocks = model.cache_stats()["blocks"]
    with pytest.raises(KeyboardInterrupt):
        model.generate(list(range(40, 80)), prefill_chunk=8, on_prefill=interrupt)
    assert model.cache_stats()["blocks"] == blocks, "a stopped prompt was cached"
    assert model.generate(prompt, max_tokens=3) == first


def test_threads_sharing_one_cache_get_what_they_get_alone(backend, model_path, opened):
    per_block = block_bytes(backend, SHAPE["n_pre_blocks"] + 3)
    model = fresh(backend, model_path, 10 * per_block)        # small: evictions while racing
    rng = np.random.default_rng(9)
    systems = [rng.integers(0, 263, size=n).tolist() for n in (18, 27, 33)]
    calls = [(systems[i % 3] + [i], dict(max_tokens=3, temperature=0.9, seed=i)) for i in range(24)]
    want = [opened["off"].generate(p, **kw) for p, kw in calls]
    assert generate_on_threads(model, calls) == want
    stats = model.cache_stats()
    assert stats["lookups"] == 24 and stats["bytes_in_use"] <= stats["budget_bytes"]
