"""Decode speed against the loops a token runs: is adaptive depth's saving proportional?

    python bench/bench_adaptive_depth.py [--shape ouro-1.4b|huginn-0125] [--exits 4,2,1]
        [--prompt 64] [--tokens 8] [--repeats 2] [--backend native] [--threads N]

A random-weight file of a published shape (bench_real_shapes.py) decodes --tokens greedy tokens
from one --prompt-token prefix at the shape's depth L, then with every decoded token made to exit
after m iterations (docs/spec.md §5.7: the latent rule with an unreachable-to-miss threshold and
min_loops = m, so mean loops per token = m exactly, checked), for each m of --exits. Random
weights cannot say where a trained model's rule would stop; the cost of a token depends only on
where it stops, which this controls. Per m: decode tok/s (best of --repeats), the speed-up over
depth L, and that speed-up over two ideals: L / m (the loops alone) and the ratio of the
token's multiply-adds at L and at m (token_macs: the prelude, the coda and the head run
whatever the depth, so L / m is out of reach by their share).
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
    return {"exit after": exit_at, "mean loops": stats["mean_loops"],
            "decode tok/s": stats["tokens"] / seconds, "ideal (loops)": loops / exit_at,
            "ideal (compute)": token_macs(config, loops) / token_macs(config, exit_at)}


def token_macs(config, depth):
    """Multiply-adds of one decoded token's linears at `depth` iterations: n_pre + depth * k +
    n_coda blocks, the adapter's two linears per iteration with injection, and the head (what
    runs whatever the depth; attention over a short context is left out)."""
    d, H, G, D, F = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                     config.ffn_dim)
    block = d * (H + 2 * G) * D + H * D * d + 3 * d * F
    layers = config.n_pre_blocks + depth * config.n_core_blocks + config.n_coda_blocks
    adapter = 2 * d * d * depth if config.injection else 0
    return layers * block + adapter + config.vocab_size * d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="ouro-1.4b", choices=SHAPE_CHOICES)
    ap.add_argument("--exits", default="", help="comma list of m (default: L/2, L/4, .. 1)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="native")
    ap.add_argument("--threads", type=int, default=None, help="default: the library's")
    args = ap.parse_args(argv)
    loops = SHAPES[args.shape]["default_loops"]
    exits = ([int(m) for m in args.exits.split(",")] if args.exits
             else [loops >> k for k in range(1, loops.bit_length())])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.tinyloop")
        print(f"writing a random {args.shape} int8 model ...", flush=True)
        config = write_shape(path, args.shape, "int8", 0, args.prompt + args.tokens + 64)
        threads = {} if args.threads is None else {"threads": args.threads}
        with tinyloop.Model(path, prefix_cache_bytes=0, **threads,
                            **backend_kwargs(args.backend)) as model:
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
                row["of ideal (compute)"] = row["speed-up"] / row["ideal (compute)"]
            runtime = model.runtime()
            notes = (f"{args.shape} at L = {loops}, int8, random weights, {args.backend}, "
                     f"{runtime['device_name']}, {runtime['threads']} threads; {args.tokens} "
                     f"greedy tokens from a {args.prompt}-token prefix, best of {args.repeats}.")
            print(write_results(f"adaptive-depth-speed-{args.shape}", rows, list(rows[0]), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
