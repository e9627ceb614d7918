"""bench/bench_mixed_pass.py's machinery on a tiny model: its workloads arrive as described, and
the paired schedule steps a mixed and a separate scheduler in lock-step to the same events, the
mixed one counting a mixed pass at every step that had decodes and a prompt chunk."""
import sys
from pathlib import Path

import tinyloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_mixed_pass as bench  # noqa: E402


def test_the_workloads_arrive_as_described():
    for kind, w in bench.WORKLOADS.items():
        requests = bench.workload(kind, 5, 100, seed=3)
        assert [at for at, _ in requests] == [i * w["every"] for i in range(5)]
        assert all(w["prompt_min"] <= len(p) <= w["prompt_max"] for _, p in requests)
        assert all(0 <= t < 100 for _, p in requests for t in p)
        assert requests == bench.workload(kind, 5, 100, seed=3)


def test_paired_steps_emit_the_same_events_and_count_the_mixed_passes(require_native, model_files):
    with tinyloop.Model(model_files["int8-gqa"], backend="native", prefix_cache_bytes=0) as model:
        requests = [(i, [(7 * i + j) % 250 for j in range(5 + 3 * i)]) for i in range(4)]
        times, stats, mixed_steps, same = bench.paired_schedule(model, requests, max_tokens=6)
    assert same
    assert len(times["mixed"]) == len(times["separate"]) == len(mixed_steps) == stats["mixed"]["steps"]
    # requests 1..3 arrive while the earlier ones decode: their prompt steps are mixed passes
    assert stats["mixed"]["mixed_passes"] == sum(mixed_steps) == 3
    assert stats["separate"]["mixed_passes"] == 0
    assert stats["mixed"]["generated_tokens"] == stats["separate"]["generated_tokens"] == 4 * 6
