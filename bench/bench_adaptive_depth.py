"""Decode speed against the loops a token runs: is adaptive depth's saving proportional?

    python bench/bench_adaptive_depth.py [--shape ouro-1.4b|huginn-0125] [--exits 4,2,1]
        [--prompt 64] [--tokens 8] [--repeats 2] [--backend native]

A random-weight file of a published shape (bench_real_shapes.py) decodes --tokens greedy tokens
from one --prompt-token prefix at the shape's depth L, then with every decoded token made to exit
after m iterations (docs/spec.md §5.7: the latent rule with an unreachable-to-miss threshold and
min_loops = m, so mean loops per token = m exactly, checked), for each m of --exits. Random
weights cannot say where a trained model's rule would stop; the cost of a token depends only on
where it stops, which this controls. Per m: decode tok/s (best of --repeats), the speed-up over
depth L, and that speed-up over two ideals: L / m (the loops alone) and the layer count ratio
(n_pre + L k + n_coda) / (n_pre + m k + n_coda), the prelude and coda running either way.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

import tinyloop
from bench_real_shapes import SHAPES, write_shape
from common import write_results
from tinyloop.quickbench import backend_kwargs, best_of

SHAPE_CHOICES = ("ouro-1.4b", "huginn-0125")


def decode_row(model, prefix, config, loops, exit_at, tokens, repeats):
    """Decode speed with every decoded token exiting after `exit_at` iterations."""
    kwargs = dict(max_tokens=tokens + 1, loops=loops, temperature=0.0)
    if exit_at < loops:
        kwargs.update(exit_rule="latent", exit_threshold=3e38, min_loops=exit_at)
    stats = {}
    _, seconds = best_of(lambda: model.generate_from_prefix_cache(prefix, depth_stats=stats,
                                                                  **kwargs), repeats)
    assert stats["mean_loops"] == exit_at, stats      # every decode pass stopped at exit_at
    layers = lambda m: config.n_pre_blocks + m * config.n_core_blocks + config.n_coda_blocks
    return {"exit after": exit_at, "mean loops": stats["mean_loops"],
            "decode tok/s": stats["tokens"] / seconds,
            "ideal (loops)": loops / exit_at, "ideal (layers)": layers(loops) / layers(exit_at)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="ouro-1.4b", choices=SHAPE_CHOICES)
    ap.add_argument("--exits", default="", help="comma list of m (default: L/2, L/4, .. 1)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="native")
    args = ap.parse_args(argv)
    loops = SHAPES[args.shape]["default_loops"]
    exits = ([int(m) for m in args.exits.split(",")] if args.exits
             else [loops >> k for k in range(1, loops.bit_length())])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.tinyloop")
        print(f"writing a random {args.shape} int8 model ...", flush=True)
        config = write_shape(path, args.shape, "int8", 0, args.prompt + args.tokens + 64)
        with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(args.backend)) as model:
            prompt = np.random.default_rng(3).integers(0, config.vocab_size, args.prompt)
            prefix = model.build_prefix_cache(prompt, loops=loops)
            rows = []
            for m in [loops] + exits:
                print(f"decoding with every token exiting after {m} of {loops} ...", flush=True)
                rows.append(decode_row(model, prefix, config, loops, m, args.tokens, args.repeats))
            full = rows[0]["decode tok/s"]
            for row in rows:
                row["speed-up"] = row["decode tok/s"] / full
                row["of ideal (loops)"] = row["speed-up"] / row["ideal (loops)"]
                row["of ideal (layers)"] = row["speed-up"] / row["ideal (layers)"]
            runtime = model.runtime()
            notes = (f"{args.shape} at L = {loops}, int8, random weights, {args.backend}, "
                     f"{runtime['device_name']}, {runtime['threads']} threads; {args.tokens} "
                     f"greedy tokens from a {args.prompt}-token prefix, best of {args.repeats}.")
            print(write_results(f"adaptive-depth-speed-{args.shape}", rows, list(rows[0]), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
