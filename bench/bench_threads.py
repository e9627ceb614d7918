"""Concurrency: N Python threads continuing one shared prefix vs the same calls in sequence.

    python bench/bench_threads.py [--backend native] [--threads 8] [--model-threads 1]

cffi releases the GIL during C calls, so the threads run in parallel; every thread must get
exactly what the sequential call gets (checked).
"""
import argparse
import sys
import tempfile
import threading
import time

import tinyloop
from common import model_file, write_results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="native")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--model-threads", type=int, default=1,
                    help="the library's own pool size (1: parallelism comes from the callers)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        path = model_file("quick", "int8", cache)
        with tinyloop.Model(path, backend=args.backend, threads=args.model_threads) as model:
            prefix = model.build_prefix_cache(list(range(1, 257)))
            calls = [dict(max_tokens=args.max_tokens, temperature=0.8, seed=s)
                     for s in range(args.threads)]
            start = time.perf_counter()
            sequential = [model.generate_from_prefix_cache(prefix, **kw) for kw in calls]
            t_seq = time.perf_counter() - start
            results = [None] * len(calls)

            def work(i):
                results[i] = model.generate_from_prefix_cache(prefix, **calls[i])

            workers = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            t_par = time.perf_counter() - start
    same = results == sequential
    row = {"backend": args.backend, "threads": args.threads, "sequential s": t_seq,
           "threaded s": t_par, "speedup": t_seq / t_par, "same tokens": same}
    print(write_results(f"threads-{args.backend}", [row], list(row),
                        f"{args.threads} continuations of one 256-token prefix, "
                        f"{args.max_tokens} tokens each, library pool of {args.model_threads}."))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
