"""Prefill and decode speed of every available backend and weight format.

    python bench/bench_backends.py [--shape quick|full] [--backends numpy,...] [--prefill 512]

Prefill: tokens/s of building a prefix of --prefill tokens (one chunk). Decode: tokens/s of
--decode greedy steps from that prefix. Every backend must produce the same tokens; the bench
checks that too.
"""
import argparse
import sys
import tempfile

import numpy as np

import tinyloop
from common import SHAPES, best_of, model_file, write_results


def measure(path, backend, n_prefill, n_decode, repeats):
    with tinyloop.Model(path, backend=backend, prefill_chunk=n_prefill) as model:
        prompt = np.random.default_rng(1).integers(0, model.config()["vocab_size"], n_prefill)
        prefix, t_prefill = best_of(lambda: model.build_prefix_cache(prompt), repeats)
        tokens, t_decode = best_of(
            lambda: model.generate_from_prefix_cache(prefix, max_tokens=n_decode), repeats)
    return tokens, n_prefill / t_prefill, n_decode / t_decode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--backends", default="numpy")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as cache:
        for fmt in args.formats.split(","):
            path = model_file(args.shape, fmt, cache)
            reference = None
            for backend in args.backends.split(","):
                tokens, pre, dec = measure(path, backend, args.prefill, args.decode, args.repeats)
                reference = tokens if reference is None else reference
                same = tokens == reference
                ok &= same
                rows.append({"shape": args.shape, "format": fmt, "backend": backend,
                             "prefill tok/s": pre, "decode tok/s": dec, "same tokens": same})
                print(rows[-1], flush=True)
    print(write_results(f"backends-{args.shape}", rows,
                        ["shape", "format", "backend", "prefill tok/s", "decode tok/s", "same tokens"],
                        f"prefill {args.prefill} tokens, decode {args.decode} tokens, n_pre 2, L 8."))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
