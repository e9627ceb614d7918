"""Peak memory and time of one-shot vs chunked prefill on the native backend (issue #7 point 2).

    python bench/bench_chunked_prefill.py [--max 8192] [--lengths 1024,2048,...] [--chunk 512]
                                          [--threads 2] [--dir DIR]

For each prompt length (1024, 2048, 4096, 8192 by default, about 6 minutes on 2 shared cores;
`--max 16384` adds 16k and takes about 20 minutes: attention makes long prefill quadratic, and
16k one-shot alone is ~8 minutes) the bench builds a prefix with model.build_prefix_cache(prompt,
prefill_chunk=C), once with C = the whole prompt (one-shot) and once with C = --chunk (512).
The model is the "quick" shape (d512, ffn 1408, 8 heads, n_pre 2, L 8, int8) with
max_seq_len 16640. Every configuration runs in a fresh process, so that process's peak RSS
belongs to it alone.

Columns:
- KV MiB: the prefix's own KV cache (PrefixCache.nbytes), the same for every chunking.
- activation MiB: tinyloop.native_memory_stats() peak_bytes during the prefill, minus what the
  library held before it (the model) and minus the prefix's KV: the working memory of the
  forward pass. It grows with the chunk, so the chunked column stays flat.
- peak RSS MiB: the process's VmHWM from /proc/self/status (model, Python, numpy included).
- seconds: wall time of build_prefix_cache.
- same next token: one greedy step from each prefix gives the same token (chunking never
  changes a result).

Writes bench/results/chunked-prefill.{json,md}, and chunked-prefill.png when matplotlib is
installed (it is not a dependency; without it the plot is skipped with a note).
"""
import argparse
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

import tinyloop
from common import RESULTS, SHAPES, write_results
from tinyloop.quickbench import timed

MAX_SEQ_LEN = 16640
MIB = 2 ** 20


def model_path(directory):
    """The quick shape with a long max_seq_len, written once into `directory`."""
    path = Path(directory) / f"quick-int8-{MAX_SEQ_LEN}.tinyloop"
    if not path.exists():
        tinyloop.random_model(path, seed=0, **{**SHAPES["quick"], "max_seq_len": MAX_SEQ_LEN})
    return path


def peak_rss_bytes():
    """VmHWM of this process (the peak resident set size) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(path, n_prompt, chunk, threads):
    """One prefill of n_prompt random tokens in chunks of `chunk` (run in a fresh process)."""
    with tinyloop.Model(path, backend="native", threads=threads, prefix_cache_bytes=0) as model:
        prompt = np.random.default_rng(1).integers(0, model.config()["vocab_size"], n_prompt)
        before = tinyloop.native_memory_stats(reset_peak=True)
        prefix, seconds = timed(lambda: model.build_prefix_cache(prompt, prefill_chunk=chunk))
        peak = tinyloop.native_memory_stats()["peak_bytes"]
        rss = peak_rss_bytes()
        next_token = model.generate_from_prefix_cache(prefix, max_tokens=1)[-1]
        return {"kv": prefix.nbytes, "activation": peak - before["bytes_in_use"] - prefix.nbytes,
                "rss": rss, "seconds": seconds, "next": next_token}


def measure_fresh(path, n_prompt, chunk, threads):
    """measure() in a new interpreter."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(measure, path, n_prompt, chunk, threads).result()


def row(path, n_prompt, chunk, threads):
    """The table row of one prompt length: one-shot next to chunked."""
    ways = {"one-shot": measure_fresh(path, n_prompt, n_prompt, threads),
            f"chunk {chunk}": measure_fresh(path, n_prompt, chunk, threads)}
    out = {"prompt": n_prompt, "KV MiB": ways["one-shot"]["kv"] / MIB}
    for key, label in (("activation", "activation MiB"), ("rss", "peak RSS MiB")):
        out.update({f"{label} {way}": m[key] / MIB for way, m in ways.items()})
    out.update({f"seconds {way}": m["seconds"] for way, m in ways.items()})
    out["same next token"] = len({m["next"] for m in ways.values()}) == 1
    return out


def plot(rows, chunk, png):
    """Activation and peak RSS vs prompt length; returns a note for the results."""
    try:
        import matplotlib
    except ImportError:
        return "No plot: matplotlib is not installed."
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    lengths = [r["prompt"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for way, colour in (("one-shot", "tab:red"), (f"chunk {chunk}", "tab:blue")):
        ax.plot(lengths, [r[f"activation MiB {way}"] for r in rows], "o-", color=colour,
                label=f"activation, {way}")
        ax.plot(lengths, [r[f"peak RSS MiB {way}"] for r in rows], "s--", color=colour,
                label=f"peak RSS, {way}")
    ax.plot(lengths, [r["KV MiB"] for r in rows], "^:", color="gray", label="prefix KV")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MiB")
    ax.set_title("Prefill memory, native backend, quick shape (n_pre 2, L 8)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return f"Plot: {png.name}."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384",
                    help="prompt lengths, comma-separated (each <= 16384)")
    ap.add_argument("--max", type=int, default=8192, help="skip lengths above this")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="keep the model file here (default: a temporary directory)")
    args = ap.parse_args(argv)
    lengths = [n for n in map(int, args.lengths.split(",")) if n <= args.max]
    if not lengths or max(lengths) >= MAX_SEQ_LEN:
        ap.error(f"need prompt lengths <= --max and below {MAX_SEQ_LEN}")
    with tempfile.TemporaryDirectory() as scratch:
        path = model_path(args.dir or scratch)
        rows = []
        for n in lengths:
            rows.append(row(path, n, args.chunk, args.threads))
            print(rows[-1], flush=True)
    notes = (f"quick shape (int8, n_pre 2, L 8, max_seq_len {MAX_SEQ_LEN}), native backend, "
             f"{args.threads} threads, one fresh process per configuration. activation = library "
             f"peak - model - prefix KV. {plot(rows, args.chunk, RESULTS / 'chunked-prefill.png')}")
    print(write_results("chunked-prefill", rows, list(rows[0]), notes))
    return 0 if all(r["same next token"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
