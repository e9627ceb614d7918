"""Prefill and decode speed of every available backend and weight format.

    python bench/bench_backends.py [--shape quick|full] [--backends numpy,...] [--prefill 512]
                                   [--threads N] [--first-call] [--name backends]

Backends: tinyloop's (native, numpy, numba, numba-cuda) and native-cuda (the native backend on
a GPU). Prefill: tokens/s of building a prefix of --prefill tokens (one chunk). Decode: tokens/s
of --decode greedy steps from that prefix. Request: milliseconds of one generate() of the
--prefill-token prompt plus --decode new tokens, with no prefix cache. Every backend must
produce the same tokens; the bench checks that too.

--first-call adds the cost of compiling kernels: a fresh process opens the model and runs a
4-token prompt plus 2 decoded tokens with an empty NUMBA_CACHE_DIR (cold: every numba kernel
compiled) and, for a backend that caches kernels on disk (numba), again with the cache the
cold run left (warm). numba-cuda compiles its kernels in every process.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

import tinyloop
from common import SHAPES, best_of, model_file, write_results
from tinyloop.quickbench import backend_kwargs

DISK_CACHED = ("numba",)     # backends whose compiled kernels persist in NUMBA_CACHE_DIR
FIRST_CALL = """
import sys, time
start = time.perf_counter()
import tinyloop
from tinyloop.quickbench import backend_kwargs
threads = int(sys.argv[3]) if sys.argv[3] != "None" else None
with tinyloop.Model(sys.argv[1], threads=threads, **backend_kwargs(sys.argv[2])) as model:
    model.generate([1, 2, 3, 4], max_tokens=2)
print(time.perf_counter() - start)
"""


def measure(path, backend, n_prefill, n_decode, repeats, threads=None):
    """(tokens, prefill tok/s, decode tok/s, request ms) of one backend."""
    with tinyloop.Model(path, prefill_chunk=n_prefill, threads=threads, prefix_cache_bytes=0,
                        **backend_kwargs(backend)) as model:
        prompt = np.random.default_rng(1).integers(0, model.config()["vocab_size"], n_prefill)
        prefix, t_prefill = best_of(lambda: model.build_prefix_cache(prompt), repeats)
        tokens, t_decode = best_of(
            lambda: model.generate_from_prefix_cache(prefix, max_tokens=n_decode), repeats)
        _, t_request = best_of(lambda: model.generate(prompt, max_tokens=n_decode), repeats)
    return tokens, n_prefill / t_prefill, n_decode / t_decode, 1000 * t_request


def first_call_seconds(path, backend, threads, cache_dir):
    """Seconds from a fresh interpreter to the first generated tokens."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, str(path), backend, str(threads)],
                         env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def first_calls(path, backend, threads, tmp):
    """{"first call cold s", "first call warm s"} of one backend (warm: "-" if not cached)."""
    cache = tempfile.mkdtemp(dir=tmp)
    cold = first_call_seconds(path, backend, threads, cache)
    warm = first_call_seconds(path, backend, threads, cache) if backend in DISK_CACHED else "-"
    return {"first call cold s": cold, "first call warm s": warm}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--backends", default="numpy")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="Model(threads=...); default all")
    ap.add_argument("--first-call", action="store_true", help="also time compiling, cold and warm")
    ap.add_argument("--name", default="backends", help="results: bench/results/<name>-<shape>.*")
    args = ap.parse_args(argv)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as cache:
        for fmt in args.formats.split(","):
            path = model_file(args.shape, fmt, cache)
            reference = None
            for backend in args.backends.split(","):
                row = {"shape": args.shape, "format": fmt, "backend": backend,
                       "threads": args.threads or "all"}
                if args.first_call:
                    row.update(first_calls(path, backend, args.threads, cache))
                tokens, pre, dec, request = measure(path, backend, args.prefill, args.decode,
                                                    args.repeats, args.threads)
                reference = tokens if reference is None else reference
                same = tokens == reference
                ok &= same
                row.update({"prefill tok/s": pre, "decode tok/s": dec, "request ms": request,
                            "same tokens": same})
                rows.append(row)
                print(row, flush=True)
    notes = f"prefill {args.prefill} tokens, decode {args.decode} tokens, n_pre 2, L 8."
    print(write_results(f"{args.name}-{args.shape}", rows, list(rows[0]), notes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
