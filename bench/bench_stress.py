"""The automatic prefix cache under a serving-like load: requests drawn from a few shared system
prompts with random user suffixes, under a budget too small to keep every system prompt, run with
the cache on and off in the same process.

    python bench/bench_stress.py [--requests 200] [--systems 5] [--budget-prompts 3] [--backend native]

Reports the hit rate (prompt tokens served from cached blocks), evictions, the wall time of each
run and the speedup; checks that both runs produced identical tokens.
"""
import argparse
import sys
import tempfile
import time

import numpy as np

import tinyloop
from common import SHAPES, model_file, write_results


def block_bytes(shape, block_size=16):
    """One native KV block at the default depth (docs/api.md, Memory)."""
    s = SHAPES[shape]
    layers = s["n_pre_blocks"] + s["default_loops"]
    per_head = -(-(2 * block_size * s["head_dim"] + 8 * block_size) // 64) * 64
    return 64 + layers * s["n_kv_heads"] * per_head


def workload(n_requests, n_systems, seed=0):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 32000, size=int(n)).tolist() for n in rng.integers(200, 500, n_systems)]
    picks = rng.zipf(1.5, size=n_requests) % n_systems          # a few prompts dominate
    return systems, [systems[p] + rng.integers(0, 32000, size=int(rng.integers(1, 40))).tolist()
                     for p in picks]


def run(path, backend, budget, requests, max_tokens):
    with tinyloop.Model(path, backend=backend, prefix_cache_bytes=budget) as model:
        start = time.perf_counter()
        out = [model.generate(p, max_tokens=max_tokens, temperature=0.7, seed=i)
               for i, p in enumerate(requests)]
        return out, time.perf_counter() - start, model.cache_stats()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="native")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--systems", type=int, default=5)
    ap.add_argument("--budget-prompts", type=float, default=3,
                    help="budget in units of an average system prompt's KV")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    systems, requests = workload(args.requests, args.systems)
    mean_blocks = np.mean([len(s) for s in systems]) / 16
    budget = int(args.budget_prompts * mean_blocks * block_bytes("quick"))
    with tempfile.TemporaryDirectory() as cache:
        path = model_file("quick", "int8", cache)
        off, t_off, _ = run(path, args.backend, 0, requests, args.max_tokens)
        on, t_on, stats = run(path, args.backend, budget, requests, args.max_tokens)
    hit_rate = stats["hit_tokens"] / (stats["hit_tokens"] + stats["prefilled_tokens"])
    row = {"backend": args.backend, "requests": args.requests, "systems": args.systems,
           "budget MiB": budget / 2**20, "hit rate": hit_rate, "evicted blocks": stats["evicted_blocks"],
           "off s": t_off, "on s": t_on, "speedup": t_off / t_on, "same tokens": on == off}
    print(write_results(f"stress-{args.backend}", [row], list(row),
                        f"quick shape int8, {args.max_tokens} new tokens per request, system prompts "
                        f"of 200-500 tokens (Zipf-distributed), suffixes of 1-39."))
    return 0 if row["same tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
