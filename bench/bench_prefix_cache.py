"""The seed's prefix-cache experiment: N requests sharing one long prompt, without a cache,
with one shared PrefixCache, and with the N continuations decoded as one batch.

    python bench/bench_prefix_cache.py [--full] [--backend native] [--prefix 500,1024] [--n 10,50]

NO_CACHE: every request runs the whole prompt itself (model without the automatic cache).
SHARED: one build_prefix_cache, then N generate_from_prefix_cache calls in turn.
BATCHED: one build_prefix_cache, then one generate_batch of the N continuations.
BOUND: (P + D) / (P / N + D), the best SHARED can do given the measured prefill time P of the
prompt and decode time D of the new tokens. Greedy, L = 8, 32 new tokens; every row checks that
the three ways produced identical tokens.
"""
import argparse
import sys
import tempfile

import numpy as np

import tinyloop
from common import model_file, write_results
from tinyloop.quickbench import backend_kwargs, shared_prefix


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the 407M-like shape (slow on a CPU)")
    ap.add_argument("--backend", default="native", help="a backend, or native-cuda (GPU)")
    ap.add_argument("--format", default="int4", choices=["int8", "int4"])
    ap.add_argument("--prefix", default="500,1024")
    ap.add_argument("--n", default="10,50")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    shape = "full" if args.full else "quick"
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        path = model_file(shape, args.format, cache)
        with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(args.backend)) as model:
            rng = np.random.default_rng(0)
            for length in map(int, args.prefix.split(",")):
                prompt = rng.integers(0, 32000, size=length).tolist()
                for n in map(int, args.n.split(",")):
                    rows.append(shared_prefix(model, prompt, n, args.max_tokens))
                    print(rows[-1], flush=True)
    columns = list(rows[0])
    print(write_results(f"prefix-cache-{shape}-{args.format}-{args.backend}", rows, columns,
                        f"{shape} shape, {args.format}, {args.backend}, L 8, "
                        f"{args.max_tokens} new tokens, greedy."))
    return 0 if all(r["same tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
