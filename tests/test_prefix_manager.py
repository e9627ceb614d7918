"""Tests for tinyloop.prefix_manager.PrefixCacheManager."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

import tinyloop
from conftest import MODEL_SHAPES
from tinyloop.prefix_manager import PrefixCacheManager


# --------------------------------------------------------------------------- helpers

def naive_match(prefixes, prompt):
    """Brute-force reference: longest registered prefix wholly a prefix of prompt."""
    prompt = list(prompt)
    best = 0
    for p in prefixes:
        p = list(p)
        if len(p) <= len(prompt) and prompt[: len(p)] == p:
            best = max(best, len(p))
    return best


def assert_plain_ints(seq):
    for t in seq:
        assert type(t) is int, f"{t!r} is {type(t).__name__}"


def assert_chunking(chunks, tokens, block_size):
    flat = [t for c in chunks for t in c]
    assert flat == list(tokens)
    assert all(isinstance(c, tuple) for c in chunks)
    assert all(len(c) == block_size for c in chunks[:-1])
    if chunks:
        assert 1 <= len(chunks[-1]) <= block_size
    assert len(chunks) == -(-len(tokens) // block_size)
    assert_plain_ints(flat)


@pytest.fixture
def mgr():
    m = PrefixCacheManager(block_size=4)
    m.add_prefix([1, 2, 3, 4, 5])
    m.add_prefix([1, 2, 3])
    return m


PROMPT = [1, 2, 3, 4, 5, 6, 7]


# --------------------------------------------------------------------------- worked examples

def test_default_block_size():
    assert PrefixCacheManager().block_size == 4


def test_cached_and_chunked_prefixes(mgr):
    assert mgr.cached_prefixes == [(1, 2, 3, 4, 5), (1, 2, 3)]
    assert mgr.chunked_prefixes == [[(1, 2, 3, 4), (5,)], [(1, 2, 3)]]


def test_empty_manager():
    m = PrefixCacheManager(block_size=4)
    assert m.cached_prefixes == []
    assert m.chunked_prefixes == []
    assert m.match_prefix(PROMPT) == 0
    assert m.split_prompt(PROMPT) == ([], PROMPT, 0)
    assert m.chunked_suffix_prefill_plan(PROMPT) == [(1, 2, 3, 4), (5, 6, 7)]
    assert m.cache_stats(PROMPT) == {"hit_tokens": 0, "uncached_tokens": 7, "reuse_ratio": 0.0}


def test_match_prefix(mgr):
    assert mgr.match_prefix(PROMPT) == 5
    assert mgr.match_prefix([1, 2, 3, 4]) == 3
    assert mgr.match_prefix([1, 2, 3]) == 3
    assert mgr.match_prefix([1, 2]) == 0
    assert mgr.match_prefix([9, 1, 2, 3]) == 0
    assert mgr.match_prefix([1, 2, 3, 4, 9]) == 3
    assert mgr.match_prefix([]) == 0


def test_split_prompt(mgr):
    assert mgr.split_prompt(PROMPT) == ([1, 2, 3, 4, 5], [6, 7], 5)
    assert mgr.split_prompt([1, 2, 3, 9]) == ([1, 2, 3], [9], 3)
    assert mgr.split_prompt([7, 8]) == ([], [7, 8], 0)
    assert mgr.split_prompt([1, 2, 3, 4, 5]) == ([1, 2, 3, 4, 5], [], 5)
    assert mgr.split_prompt([]) == ([], [], 0)
    pre, suf, hit = mgr.split_prompt(PROMPT)
    assert isinstance(pre, list) and isinstance(suf, list) and type(hit) is int


def test_chunked_prefill_plan(mgr):
    assert mgr.chunked_prefill_plan(PROMPT) == [(1, 2, 3, 4), (5, 6, 7)]
    assert mgr.chunked_prefill_plan([1, 2, 3, 4, 5, 6, 7, 8]) == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert mgr.chunked_prefill_plan([]) == []


def test_chunked_suffix_prefill_plan(mgr):
    assert mgr.chunked_suffix_prefill_plan(PROMPT) == [(6, 7)]
    assert mgr.chunked_suffix_prefill_plan([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == [(6, 7, 8, 9), (10,)]
    assert mgr.chunked_suffix_prefill_plan([1, 2, 3]) == []  # full hit
    assert mgr.chunked_suffix_prefill_plan([1, 2, 3, 4, 5]) == []  # full hit
    assert mgr.chunked_suffix_prefill_plan([]) == []


def test_cache_stats(mgr):
    assert mgr.cache_stats(PROMPT) == {"hit_tokens": 5, "uncached_tokens": 2, "reuse_ratio": 0.7143}
    assert mgr.cache_stats([1, 2, 3]) == {"hit_tokens": 3, "uncached_tokens": 0, "reuse_ratio": 1.0}
    assert mgr.cache_stats([4]) == {"hit_tokens": 0, "uncached_tokens": 1, "reuse_ratio": 0.0}
    stats = mgr.cache_stats([])
    assert stats == {"hit_tokens": 0, "uncached_tokens": 0, "reuse_ratio": 0.0}
    assert type(stats["reuse_ratio"]) is float


def test_block_size_one_and_large():
    m = PrefixCacheManager(block_size=1)
    m.add_prefix([5, 6])
    assert m.chunked_prefixes == [[(5,), (6,)]]
    assert m.chunked_suffix_prefill_plan([5, 6, 7, 8]) == [(7,), (8,)]
    big = PrefixCacheManager(block_size=100)
    assert big.chunked_prefill_plan(PROMPT) == [tuple(PROMPT)]


# --------------------------------------------------------------------------- registration details

def test_duplicates_ignored():
    m = PrefixCacheManager(block_size=2)
    assert m.add_prefix([1, 2, 3]) is True
    assert m.add_prefix((1, 2, 3)) is False
    assert m.add_prefix([1, 2]) is True  # a strict prefix of a registered one is distinct
    assert m.add_prefix([1, 2, 3]) is False
    assert m.cached_prefixes == [(1, 2, 3), (1, 2)]
    assert m.chunked_prefixes == [[(1, 2), (3,)], [(1, 2)]]


def test_registration_order_kept():
    m = PrefixCacheManager(block_size=4)
    for p in ([3], [1, 2], [3, 4], [1]):
        m.add_prefix(p)
    assert m.cached_prefixes == [(3,), (1, 2), (3, 4), (1,)]


def test_empty_prefix_rejected():
    m = PrefixCacheManager(block_size=4)
    with pytest.raises(ValueError, match="at least one token"):
        m.add_prefix([])
    with pytest.raises(ValueError):
        m.add_prefix(())
    assert m.cached_prefixes == []


def test_longer_prefix_never_matches_short_prompt():
    m = PrefixCacheManager(block_size=4)
    m.add_prefix([1, 2, 3, 4, 5, 6])
    assert m.match_prefix([1, 2, 3]) == 0
    assert m.match_prefix([1, 2, 3, 4, 5]) == 0
    assert m.split_prompt([1, 2, 3]) == ([], [1, 2, 3], 0)
    assert m.match_prefix([1, 2, 3, 4, 5, 6]) == 6


def test_returned_state_is_a_copy_and_input_not_aliased():
    m = PrefixCacheManager(block_size=4)
    src = [1, 2, 3]
    m.add_prefix(src)
    src.append(4)
    m.cached_prefixes.append((9,))
    m.chunked_prefixes.clear()
    assert m.cached_prefixes == [(1, 2, 3)]
    assert m.chunked_prefixes == [[(1, 2, 3)]]
    assert m.match_prefix([1, 2, 3, 4]) == 3


def test_make_entry_hook_is_atomic():
    class Failing(PrefixCacheManager):
        def _make_entry(self, prefix, index):
            if len(prefix) > 2:
                raise RuntimeError("cannot build")
            return ("kv", prefix, index)

    m = Failing(block_size=4)
    assert m.add_prefix([1, 2])
    with pytest.raises(RuntimeError):
        m.add_prefix([1, 2, 3])
    assert m.cached_prefixes == [(1, 2)]
    assert m.match_prefix([1, 2, 3]) == 2
    assert m._entries == [("kv", (1, 2), 0)]
    assert m._longest_match((1, 2, 3)) == (2, 0)
    assert m._longest_match((5,)) == (0, None)


# --------------------------------------------------------------------------- input types

def test_tuple_and_range_inputs_equal_list_inputs(mgr):
    for prompt in (tuple(PROMPT), range(1, 8)):
        assert mgr.match_prefix(prompt) == mgr.match_prefix(PROMPT)
        assert mgr.split_prompt(prompt) == mgr.split_prompt(PROMPT)
        assert mgr.chunked_prefill_plan(prompt) == mgr.chunked_prefill_plan(PROMPT)
        assert mgr.chunked_suffix_prefill_plan(prompt) == mgr.chunked_suffix_prefill_plan(PROMPT)
        assert mgr.cache_stats(prompt) == mgr.cache_stats(PROMPT)


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint16", "uint64", "int8"])
def test_numpy_inputs_equal_list_inputs(dtype):
    np = pytest.importorskip("numpy")
    by_list = PrefixCacheManager(block_size=4)
    by_list.add_prefix([1, 2, 3, 4, 5])
    by_list.add_prefix([1, 2, 3])
    by_np = PrefixCacheManager(block_size=4)
    by_np.add_prefix(np.array([1, 2, 3, 4, 5], dtype=dtype))
    by_np.add_prefix(np.array([1, 2, 3], dtype=dtype))
    by_np.add_prefix(np.array([1, 2, 3], dtype=dtype))  # duplicate
    assert by_np.cached_prefixes == by_list.cached_prefixes
    assert by_np.chunked_prefixes == by_list.chunked_prefixes
    for p in by_np.cached_prefixes:
        assert_plain_ints(p)

    prompt = np.array(PROMPT, dtype=dtype)
    assert by_np.match_prefix(prompt) == by_list.match_prefix(PROMPT) == 5
    pre, suf, hit = by_np.split_prompt(prompt)
    assert (pre, suf, hit) == by_list.split_prompt(PROMPT)
    assert_plain_ints(pre)
    assert_plain_ints(suf)
    assert type(hit) is int
    plan = by_np.chunked_prefill_plan(prompt)
    assert plan == by_list.chunked_prefill_plan(PROMPT)
    assert_plain_ints([t for c in plan for t in c])
    splan = by_np.chunked_suffix_prefill_plan(prompt)
    assert splan == by_list.chunked_suffix_prefill_plan(PROMPT)
    assert_plain_ints([t for c in splan for t in c])
    stats = by_np.cache_stats(prompt)
    assert stats == by_list.cache_stats(PROMPT)
    assert type(stats["hit_tokens"]) is int and type(stats["uncached_tokens"]) is int
    assert type(stats["reuse_ratio"]) is float


def test_numpy_scalars_in_list_become_ints():
    np = pytest.importorskip("numpy")
    m = PrefixCacheManager(block_size=np.int64(2))
    assert type(m.block_size) is int and m.block_size == 2
    m.add_prefix([np.int32(1), np.uint8(2)])
    assert m.cached_prefixes == [(1, 2)]
    assert_plain_ints(m.cached_prefixes[0])
    assert m.match_prefix([np.int64(1), 2, 3]) == 2


# --------------------------------------------------------------------------- rejection

@pytest.mark.parametrize("bad", [0, -1, -4])
def test_nonpositive_block_size_raises_value_error(bad):
    with pytest.raises(ValueError, match="block_size"):
        PrefixCacheManager(block_size=bad)


@pytest.mark.parametrize("bad", [True, False, 4.0, 2.5, "4", None, [4]])
def test_non_integer_block_size_raises_type_error(bad):
    with pytest.raises(TypeError, match="block_size"):
        PrefixCacheManager(block_size=bad)


BAD_TOKEN_SEQS = [
    [1, 2.0, 3],
    [1.5],
    ["1", "2"],
    [1, None],
    [True, 2],
    [1, False],
    [[1, 2], [3]],
]


@pytest.mark.parametrize("bad", BAD_TOKEN_SEQS)
def test_non_integer_tokens_rejected(bad):
    m = PrefixCacheManager(block_size=4)
    with pytest.raises(TypeError, match=r"prefix\[\d+\]"):
        m.add_prefix(bad)
    for method in (m.match_prefix, m.split_prompt, m.chunked_prefill_plan,
                   m.chunked_suffix_prefill_plan, m.cache_stats):
        with pytest.raises(TypeError, match=r"prompt\[\d+\]"):
            method(bad)
    assert m.cached_prefixes == []


@pytest.mark.parametrize("bad", ["123", b"\x01\x02", 7, None, {1, 2}, {1: 2}, 3.0,
                                 (t for t in [1, 2])])
def test_bad_containers_rejected(bad):
    m = PrefixCacheManager(block_size=4)
    with pytest.raises(TypeError, match="prefix"):
        m.add_prefix(bad)
    with pytest.raises(TypeError, match="prompt"):
        m.match_prefix(bad)


def test_negative_tokens_rejected():
    m = PrefixCacheManager(block_size=4)
    with pytest.raises(ValueError, match="negative"):
        m.add_prefix([1, -2])
    with pytest.raises(ValueError, match="negative"):
        m.match_prefix([-1])


def test_bad_numpy_arrays_rejected():
    np = pytest.importorskip("numpy")
    m = PrefixCacheManager(block_size=4)
    with pytest.raises(ValueError, match="1-D"):
        m.add_prefix(np.array([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="1-D"):
        m.match_prefix(np.array(3))
    with pytest.raises(TypeError, match="float"):
        m.add_prefix(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="bool"):
        m.add_prefix(np.array([True, False]))
    with pytest.raises(TypeError, match="bool"):
        m.add_prefix([np.True_])
    with pytest.raises(TypeError):
        m.match_prefix(np.array(["1", "2"]))
    with pytest.raises(TypeError, match="float"):
        m.add_prefix([np.float32(1.0)])
    assert m.cached_prefixes == []


# --------------------------------------------------------------------------- properties

# A tiny alphabet makes shared and nested prefixes (and hence matches) common.
tokens = st.integers(min_value=0, max_value=3)
prefix_lists = st.lists(st.lists(tokens, min_size=1, max_size=8), max_size=8)
prompts = st.lists(tokens, max_size=16)
block_sizes = st.integers(min_value=1, max_value=6)


def build(block_size, prefixes):
    m = PrefixCacheManager(block_size=block_size)
    for p in prefixes:
        m.add_prefix(p)
    return m


@given(block_sizes, prefix_lists)
def test_prop_registration_ledger(block_size, prefixes):
    m = build(block_size, prefixes)
    expected = []
    for p in prefixes:
        if tuple(p) not in expected:
            expected.append(tuple(p))
    assert m.cached_prefixes == expected
    chunked = m.chunked_prefixes
    assert len(chunked) == len(expected)
    for chunks, p in zip(chunked, expected):
        assert_chunking(chunks, p, block_size)


@given(block_sizes, prefix_lists, prompts)
def test_prop_match_prefix_matches_naive(block_size, prefixes, prompt):
    m = build(block_size, prefixes)
    assert m.match_prefix(prompt) == naive_match(prefixes, prompt)


@given(block_sizes, prefix_lists, prompts)
def test_prop_split_prompt_reconstructs(block_size, prefixes, prompt):
    m = build(block_size, prefixes)
    pre, suf, hit = m.split_prompt(prompt)
    assert pre + suf == prompt
    assert hit == len(pre) == naive_match(prefixes, prompt)
    assert hit == 0 or tuple(pre) in m.cached_prefixes


@given(block_sizes, prefix_lists, prompts)
def test_prop_chunked_plans(block_size, prefixes, prompt):
    m = build(block_size, prefixes)
    assert_chunking(m.chunked_prefill_plan(prompt), prompt, block_size)
    suffix = prompt[naive_match(prefixes, prompt):]
    splan = m.chunked_suffix_prefill_plan(prompt)
    assert_chunking(splan, suffix, block_size)
    assert (splan == []) == (len(suffix) == 0)


@given(block_sizes, prefix_lists, prompts)
def test_prop_cache_stats_consistent(block_size, prefixes, prompt):
    m = build(block_size, prefixes)
    s = m.cache_stats(prompt)
    assert set(s) == {"hit_tokens", "uncached_tokens", "reuse_ratio"}
    hit = naive_match(prefixes, prompt)
    assert s["hit_tokens"] == hit
    assert s["hit_tokens"] + s["uncached_tokens"] == len(prompt)
    assert s["reuse_ratio"] == (round(hit / len(prompt), 4) if prompt else 0.0)
    assert 0.0 <= s["reuse_ratio"] <= 1.0


@given(block_sizes, prefix_lists, prompts)
def test_prop_input_types_agree(block_size, prefixes, prompt):
    np = pytest.importorskip("numpy")
    by_list = build(block_size, prefixes)
    by_np = build(block_size, [np.array(p, dtype=np.int64) for p in prefixes])
    assert by_np.cached_prefixes == by_list.cached_prefixes
    for variant in (tuple(prompt), np.array(prompt, dtype=np.int64)):
        assert by_np.split_prompt(variant) == by_list.split_prompt(prompt)
        assert by_np.cache_stats(variant) == by_list.cache_stats(prompt)
        assert by_np.chunked_suffix_prefill_plan(variant) == by_list.chunked_suffix_prefill_plan(prompt)


@given(st.integers(max_value=0))
def test_prop_nonpositive_block_size_rejected(bad):
    with pytest.raises(ValueError):
        PrefixCacheManager(block_size=bad)


@given(st.lists(tokens, max_size=4),
       st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.booleans(), st.none()),
       st.lists(tokens, max_size=4))
def test_prop_non_integer_token_rejected(head, bad, tail):
    m = PrefixCacheManager(block_size=4)
    seq = head + [bad] + tail
    with pytest.raises(TypeError):
        m.add_prefix(seq)
    with pytest.raises(TypeError):
        m.match_prefix(seq)
    assert m.cached_prefixes == []


# -- bound to a model: the registered prefixes hold real KV ------------------------------------

@pytest.fixture(scope="module")
def bound_model(numpy_or_native, tmp_path_factory):
    path = tmp_path_factory.mktemp("manager") / "m.tinyloop"
    tinyloop.random_model(path, seed=4, **MODEL_SHAPES["int8-gqa"])
    model = tinyloop.Model(path, backend=numpy_or_native, prefix_cache_bytes=0)
    yield model
    model.close()


@given(data=st.data())
def test_bound_manager_generates_what_the_model_generates(bound_model, data):
    vocab = bound_model.config()["vocab_size"]
    token_lists = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16)
    manager = PrefixCacheManager(data.draw(st.integers(1, 6)), model=bound_model)
    registered = data.draw(st.lists(token_lists, max_size=3))
    for prefix in registered:
        manager.add_prefix(prefix)
    for _ in range(3):
        prompt = data.draw(st.sampled_from(registered) if registered and data.draw(st.booleans())
                           else token_lists)
        prompt = prompt + data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        kwargs = dict(max_tokens=data.draw(st.integers(1, 4)), seed=data.draw(st.integers(0, 99)),
                      temperature=data.draw(st.sampled_from([0.0, 0.9])),
                      loops=data.draw(st.integers(1, bound_model.config()["default_loops"])),
                      instruction_length=data.draw(st.sampled_from([0, 0, len(prompt)])))
        assert manager.generate(prompt, **kwargs) == bound_model.generate(prompt, **kwargs)


def test_bound_manager_pins_one_prefix_cache_per_registered_prefix(bound_model):
    manager = PrefixCacheManager(4, model=bound_model, loops=2)
    assert manager.add_prefix([1, 2, 3, 4, 5]) and not manager.add_prefix([1, 2, 3, 4, 5])
    manager.add_prefix([1, 2])
    first, second = manager.prefix_cache(0), manager.prefix_cache(1)
    assert list(first.prompt) == [1, 2, 3, 4, 5] and list(second.prompt) == [1, 2]
    assert first.loops == 2 and first.nbytes > second.nbytes > 0
    assert manager.cached_prefixes == [(1, 2, 3, 4, 5), (1, 2)]
    assert manager.cache_stats([1, 2, 3, 4, 5, 6]) == {
        "hit_tokens": 5, "uncached_tokens": 1, "reuse_ratio": 0.8333}
    with pytest.raises(RuntimeError, match="loops mismatch"):
        manager.generate([1, 2, 3, 4, 5, 6], loops=3)


def test_a_failed_prefill_registers_nothing(bound_model):
    manager = PrefixCacheManager(4, model=bound_model)
    with pytest.raises(ValueError, match="out of range"):
        manager.add_prefix([1, 10**6])
    assert manager.cached_prefixes == []


def test_an_unbound_manager_cannot_generate():
    manager = PrefixCacheManager(4)
    manager.add_prefix([1, 2])
    with pytest.raises(RuntimeError, match="has no model"):
        manager.generate([1, 2, 3])
    with pytest.raises(RuntimeError, match="has no model"):
        manager.prefix_cache(0)
