"""Hidden-state prefixes (docs/spec.md §5.4.1): bytes at rest and the cost of the KV rebuild.

    python bench/bench_hidden_prefix.py [--backend native] [--prompt 512] [--repeats 3]

For the bundled demo model (GQA, 2 kv heads of 64, d 256) and the quick random shape (MHA, 8
heads of 64, d 512), one prompt of --prompt tokens built as a kv, an h8 and an h4 prefix at the
model's default depth. BYTES: each prefix's nbytes at rest. FIRST TOKEN: the best of --repeats
generate_from_prefix_cache(max_tokens=1) from it (kv: the first logits are stored; h8 / h4:
the sequence's KV is rebuilt from the rows first), and a full prefill of the prompt
(generate(max_tokens=1) without the automatic prefix cache), in ms. Ratios are against kv's
bytes and against the full prefill's time. Every row checks that h8's token is kv's.
FIDELITY: what h4's approximation costs, over 32 windows of 190 tokens (the demo model: of the
built-in calibration text; the random model: random tokens): a prefix of the first 150 built as
kv and as h4, the other 40 as the suffix, and the logits of the next token from each; the
mean and minimum cosine of h4's against kv's, and how often their argmax agrees.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import tinyloop
from common import best_of, cpu_description, model_file, write_results
from tinyloop.bundled import demo_model_path

CALIBRATION = Path(tinyloop.__file__).parent / "data" / "calibration.txt"
from tinyloop.quickbench import backend_kwargs


WINDOWS, N_PREFIX, N_SUFFIX = 32, 150, 40


def fidelity_windows(model, text, rng):
    """WINDOWS token windows of N_PREFIX + N_SUFFIX: of the calibration text (text=True, for a
    model with a tokenizer), else of random tokens."""
    n = N_PREFIX + N_SUFFIX
    if text:
        ids = model.encode(CALIBRATION.read_text())
        return [ids[i:i + n] for i in range(0, len(ids) - n + 1, (len(ids) - n) // (WINDOWS - 1))][:WINDOWS]
    return rng.integers(0, model.config()["vocab_size"], (WINDOWS, n)).tolist()


def h4_fidelity(model, windows):
    """(mean cosine, min cosine, argmax agreement) of the next token's logits from an h4 prefix
    against a kv prefix of each window's first N_PREFIX tokens, its rest the suffix."""
    cosines, agree = [], 0
    for w in windows:
        kv, h4 = (model.generate_from_prefix_cache(model.build_prefix_cache(w[:N_PREFIX], storage=s),
                                                   suffix=w[N_PREFIX:], max_tokens=1,
                                                   return_logits=True)[1][0].astype(np.float64)
                  for s in ("kv", "h4"))
        cosines.append(kv @ h4 / (np.linalg.norm(kv) * np.linalg.norm(h4)))
        agree += int(kv.argmax() == h4.argmax())
    return float(np.mean(cosines)), float(np.min(cosines)), agree / len(windows)


def bench(name, path, backend, n_prompt, repeats):
    """One model's row: bytes at rest and first-token times of kv / h8 / h4, and the prefill's."""
    with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(backend)) as model:
        cfg = model.config()
        prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], n_prompt).tolist()
        prefixes = {s: model.build_prefix_cache(prompt, storage=s) for s in ("kv", "h8", "h4")}
        first = {s: best_of(lambda p=p: model.generate_from_prefix_cache(p, max_tokens=1), repeats)
                 for s, p in prefixes.items()}
        prefill = best_of(lambda: model.generate(prompt, max_tokens=1), repeats)
        fidelity = h4_fidelity(model, fidelity_windows(model, name == "demo", np.random.default_rng(1)))
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
    row["h4 cosine mean"], row["h4 cosine min"] = (f"{c:.6f}" for c in fidelity[:2])
    row["h4 argmax = kv"] = f"{fidelity[2]:.1%}"
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
