"""bench/bench_loop_speculation.py's machinery, on the native backend: the replay hook
(TINYLOOP_BENCH_PREDICTIONS) makes rounds and the wave (fixed or automatic draft depth) count
exactly the drafts and acceptances the bench's simulations of their schedules predict for
recorded predictions (so the ideal speed-ups it reports are those schedules' own), a bad value
is named, and without the hook the wave emits plain decoding's tokens."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyloop
from conftest import require_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_loop_speculation as bench  # noqa: E402

LOOPS = 6  # the demo model's


def recorded(seed, agree):
    """Predictions of 40 tokens at depths 1 .. LOOPS: ids 0 .. 2, each depth's the final one
    with probability `agree`, the deeper ones more often."""
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(40):
        final = int(rng.integers(0, 3))
        groups.append(tuple(final if rng.random() < agree + (1 - agree) * d / LOOPS
                            else int(rng.integers(0, 3)) for d in range(1, LOOPS)) + (final,))
    return groups


CASES = [recorded(seed, agree) for seed, agree in [(1, 0.0), (2, 0.5), (3, 0.8), (4, 1.0)]]


@pytest.fixture(scope="module")
def demo_prefix():
    require_backend("native")
    with tinyloop.Model(backend="native") as model:
        yield model, model.build_prefix_cache(model.encode("And God said"), loops=LOOPS)


@pytest.fixture(scope="module", params=["demo", "huginn layout"])
def any_prefix(request, tmp_path_factory):
    """The demo model (core blocks only), or a random one of Huginn's layout (prelude, coda,
    injection: every term of the automatic depth's weight reads)."""
    require_backend("native")
    path = None
    if request.param == "huginn layout":
        path = tmp_path_factory.mktemp("huginn") / "huginn.tinyloop"
        tinyloop.random_model(path, seed=5, vocab_size=300, d_model=32, n_heads=4, n_kv_heads=4,
                              head_dim=8, ffn_dim=64, n_pre_blocks=1, n_core_blocks=2,
                              n_coda_blocks=1, default_loops=LOOPS, max_seq_len=128,
                              block_layout="post", injection=True, coda_norm=True)
    with tinyloop.Model(path, backend="native") as model:
        yield model, model.build_prefix_cache([5, 6, 7, 8], loops=LOOPS)


def replayed(model, prefix, predicted, **kwargs):
    os.environ[bench.PREDICTIONS] = bench.encode(predicted)
    try:
        stats = {}
        model.generate_from_prefix_cache(prefix, suffix=[], loops=LOOPS, draft_stats=stats,
                                         **kwargs)
        return stats
    finally:
        del os.environ[bench.PREDICTIONS]


@pytest.mark.parametrize("schedule, draft_loops, n_draft", [
    (schedule, *setting) for schedule in ("rounds", "wave")
    for setting in [(1, 4), (2, 2), (3, 8), (5, 1)]] + [("wave", 0, 64), ("wave", 0, 2)])
def test_replayed_predictions_drive_the_schedules_as_simulated(any_prefix, schedule, draft_loops,
                                                               n_draft):
    """draft_loops 0: the wave's automatic depth, simulated by the rule docs/spec.md states."""
    model, prefix = any_prefix
    tokens = 60
    reads = bench.weight_reads(model.config())
    for predicted in CASES:
        stats = replayed(model, prefix, predicted, max_tokens=tokens,
                         draft_loops=draft_loops or "auto", n_draft=n_draft,
                         draft_wave=schedule == "wave")
        if schedule == "wave":
            _, drafted, accepted = bench.simulate_wave(predicted, LOOPS, draft_loops, n_draft,
                                                       tokens, reads)
        else:
            _, drafted, accepted = bench.simulate_rounds(predicted, LOOPS, draft_loops, n_draft,
                                                         tokens)
        assert (stats["drafted"], stats["accepted"]) == (drafted, accepted)


def test_the_ideal_wave_approaches_loops_per_draft_depth():
    """Every depth right, the wave finishes a token a step once full (L at L_d 1), and a token
    every L_d steps at a deeper draft depth; every depth but the last wrong, it is plain
    decoding; rounds stay below K L / (K L_d + L - L_d)."""
    right, wrong = [(1, 1, 1, 1)], [(0, 0, 0, 1)]
    assert 3.8 < bench.ideal("wave", right, 4, 1, 8, 400) <= 4
    assert 1.9 < bench.ideal("wave", right, 4, 2, 8, 400) <= 2
    assert bench.ideal("wave", wrong, 4, 1, 8, 400) == 1
    assert 1 < bench.ideal("rounds", right, 4, 1, 4, 400) < 4 * 4 / 7 + 0.01


@pytest.mark.parametrize("value", ["1,2", "1,2,3,4,5,6;7", "1,2,3,4,5,x", "1,2,3,4,5,-6"])
def test_a_bad_predictions_value_is_named(demo_prefix, value):
    model, prefix = demo_prefix
    os.environ[bench.PREDICTIONS] = value
    try:
        with pytest.raises(ValueError, match="TINYLOOP_BENCH_PREDICTIONS must be groups of 6 ids"):
            model.generate_from_prefix_cache(prefix, suffix=[], max_tokens=4, draft_loops=1,
                                             draft_wave=True)
    finally:
        del os.environ[bench.PREDICTIONS]


def test_without_the_hook_the_wave_emits_plain_tokens(demo_prefix):
    model, prefix = demo_prefix
    want = model.generate_from_prefix_cache(prefix, suffix=[], max_tokens=40, return_logits=True)
    for draft_loops, n_draft in [(1, 8), (2, 3), (4, 64), ("auto", 64)]:
        stats = {}
        got = model.generate_from_prefix_cache(prefix, suffix=[], max_tokens=40, return_logits=True,
                                               draft_loops=draft_loops, n_draft=n_draft,
                                               draft_wave=True, draft_stats=stats)
        assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()
        assert stats["accepted"] > 0
