"""Hidden-state prefixes (docs/spec.md §5.4.1): bytes at rest and the cost of the KV rebuild.

    python bench/bench_hidden_prefix.py [--backend native] [--prompt 512] [--repeats 3]

For the bundled demo model (GQA, 2 kv heads of 64, d 256) and the quick random shape (MHA, 8
heads of 64, d 512), one prompt of --prompt tokens built as a kv, an h8 and an h4 prefix at the
model's default depth. BYTES: each prefix's nbytes at rest. FIRST TOKEN: the best of --repeats
generate_from_prefix_cache(max_tokens=1) from it (kv: the first logits are stored; h8 / h4:
the sequence's KV is rebuilt from the rows first), and a full prefill of the prompt
(generate(max_tokens=1) without the automatic prefix cache), in ms. Ratios are against kv's
bytes and against the full prefill's time. Every row checks that h8's token is kv's.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

import tinyloop
from common import best_of, cpu_description, model_file, write_results
from tinyloop.demo import demo_model_path
from tinyloop.quickbench import backend_kwargs


def bench(name, path, backend, n_prompt, repeats):
    """One model's row: bytes at rest and first-token times of kv / h8 / h4, and the prefill's."""
    with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(backend)) as model:
        cfg = model.config()
        prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], n_prompt).tolist()
        prefixes = {s: model.build_prefix_cache(prompt, storage=s) for s in ("kv", "h8", "h4")}
        first = {s: best_of(lambda p=p: model.generate_from_prefix_cache(p, max_tokens=1), repeats)
                 for s, p in prefixes.items()}
        prefill = best_of(lambda: model.generate(prompt, max_tokens=1), repeats)
    kv_bytes, t_prefill = prefixes["kv"].nbytes, prefill[1]
    heads = f"{cfg['d_model']}, {cfg['n_kv_heads']} of {cfg['head_dim']}"
    row = {"model": name, "d, kv heads": heads, "L": cfg["default_loops"], "prompt": n_prompt}
    for s in ("kv", "h8", "h4"):
        row[f"{s} MiB"] = prefixes[s].nbytes / 2**20
    for s in ("h8", "h4"):
        row[f"{s} / kv bytes"] = prefixes[s].nbytes / kv_bytes
    row["prefill ms"] = 1e3 * t_prefill
    for s in ("kv", "h8", "h4"):
        row[f"{s} first token ms"] = 1e3 * first[s][1]
    for s in ("h8", "h4"):
        row[f"{s} first token / prefill"] = first[s][1] / t_prefill
    row["h8 token = kv"] = first["h8"][0] == first["kv"][0] == prefill[0]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="native", help="a backend, or native-cuda (GPU)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        models = [("demo", demo_model_path()),
                  ("quick (random)", model_file("quick", "int8", cache))]
        rows = []
        for name, path in models:
            rows.append(bench(name, path, args.backend, args.prompt, args.repeats))
            print(rows[-1], flush=True)
    columns = list(rows[0])
    print(write_results("hidden-prefix", rows, columns,
                        f"{cpu_description()[0]} ({os.cpu_count()} cores), backend {args.backend}, int8 "
                        f"KV, the model's default depth, best of {args.repeats}."))
    return 0 if all(r["h8 token = kv"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
