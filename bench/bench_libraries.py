"""Prefill speed of two or more libtinyloop builds side by side, per kernel path, as a fraction
of this machine's int8 peak on that path (issue #34 point 4: before and after a kernel change),
and with --decode-batches their batched decode.

    python bench/bench_libraries.py --library before=PATH --library after=PATH
                                    [--isas avx512-vnni,amx] [--shape quick|full] [--format int8]
                                    [--kv-mode int8|int4] [--model FILE]
                                    [--prompts 512,2048] [--chunk 512] [--threads 2]
                                    [--decode-batches 1,4,8]
                                    [--rounds 3] [--repeats 3] [--dir DIR] [--name NAME]

A build is a libtinyloop shared library (a `cmake --build` of libtinyloop/ at some commit, for
instance in a `git worktree`), named LABEL=PATH. Each measurement runs in a child process of its
own with TINYLOOP_LIBRARY=PATH and TINYLOOP_ISA set (the tinyloop package binds one library per
process): it opens the random model of --shape (bench/common.model_file; int8 or int4 weights),
or the model file --model names, with prefix_cache_bytes=0 and --kv-mode, builds a prefix of each --prompts length in chunks of --chunk tokens
(the first chunk into an empty cache, the later ones attending to the earlier), best of
--repeats, then greedily decodes 8 tokens from the longest prefix. The children run in
alternating rounds (every build and path once, then again, --rounds times) and each figure is
the best over the rounds, so load from other processes lands on every build alike. Every build
must decode the same tokens on every path (checked; the exit code is 1 otherwise).

Columns:
- build, isa, prompt: the library's label, the kernel path, the prompt length.
- pp tok/s: prompt tokens per second of the prefix build.
- ratio: the row / the first --library's on the same path and prompt.
- prefill GMAC/s: the linears' int8 multiply-adds per second (bench_isa.linear_work: the
  blocks' linears per token, plus one head row per prefix build); attention's own products are
  not counted, so long prompts, whose attention grows, show lower fractions.
- % of peak: prefill GMAC/s / the path's int8 peak at --threads threads (bench_isa.int8_peaks:
  bench/int8_peak.c, AMX tiles for amx, VPDPBUSD for avx512-vnni; empty for avx2).
- same tokens: the build's decoded tokens equal the first build's on that path.

With --decode-batches, each child also decodes greedily a batch of B sequences (generate_batch,
16-token prompts) for each B, and a second table gives the seconds a decode step takes (a step:
one token of each sequence; (time of 1 + DECODE_TOKENS tokens - time of 1) / DECODE_TOKENS, each
time the best of --repeats), its ratio to the first build's and to the build's own smallest batch: the
linears' small-batch kernels, which batched decode, the scheduler and the speculative wave
(several positions a pass) run.

Writes bench/results/<--name, default libraries-<shape>-<format>-kv<kv mode>>.{json,md}, and
the decode table to <name>-decode.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_isa import int8_peaks, linear_work
import tinyloop
from common import SHAPES, cpu_description, exit_text, model_file, write_results
from tinyloop.config import ModelConfig

DECODE_TOKENS = 8


def child(args):
    """In a child process: measure one build on one path; print one JSON line."""
    path = args.model or model_file(args.shape, args.format, args.dir)
    model = tinyloop.Model(path, backend="native", threads=args.threads, prefix_cache_bytes=0,
                           kv_mode=args.kv_mode)
    prompts = [int(n) for n in args.prompts.split(",")]
    vocab = model.config()["vocab_size"]
    rng = np.random.default_rng(1)
    tok_s, prefix = {}, None
    for n in prompts:
        prompt = rng.integers(0, vocab, n)
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            prefix = model.build_prefix_cache(prompt, prefill_chunk=args.chunk)
            best = min(best, time.perf_counter() - start)
        tok_s[n] = n / best
    tokens = model.generate_from_prefix_cache(prefix, max_tokens=DECODE_TOKENS)
    config = ModelConfig.from_dict(model.config())
    steps = {}
    for batch in [int(b) for b in args.decode_batches.split(",")] if args.decode_batches else []:
        prompts = [rng.integers(0, vocab, 16).tolist() for _ in range(batch)]
        fastest = {1: float("inf"), 1 + DECODE_TOKENS: float("inf")}
        for _ in range(args.repeats):
            for n in fastest:
                start = time.perf_counter()
                model.generate_batch(prompts, max_tokens=n)
                fastest[n] = min(fastest[n], time.perf_counter() - start)
        # a tiny model's difference may drown in noise: never below a nanosecond
        steps[batch] = max((fastest[1 + DECODE_TOKENS] - fastest[1]) / DECODE_TOKENS, 1e-9)
    print(json.dumps({"isa": model.runtime()["isa"], "tok/s": tok_s, "tokens": tokens,
                      "work": linear_work(config)[:2], "step s": steps}))
    return 0


def measure(label, library, isa, args):
    """One child's figures for build `label` on path `isa`."""
    env = {**os.environ, "TINYLOOP_LIBRARY": library, "TINYLOOP_ISA": isa}
    env.pop("TINYLOOP_ROW_KERNELS", None)
    cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--format", args.format,
           "--kv-mode", args.kv_mode, *(["--model", args.model] if args.model else []),
           "--prompts", args.prompts, "--chunk", str(args.chunk), "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--dir", args.dir,
           *(["--decode-batches", args.decode_batches] if args.decode_batches else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{label} on {isa} ended with {exit_text(done.returncode)}:\n{done.stderr}")
    result = json.loads(done.stdout.splitlines()[-1])
    if result["isa"] != isa:
        raise SystemExit(f"{label} ran the {result['isa']} kernels for TINYLOOP_ISA={isa}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--isas", default="avx512-vnni,amx")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--format", choices=["int8", "int4"], default="int8")
    ap.add_argument("--kv-mode", choices=["int8", "int4"], default="int8")
    ap.add_argument("--model", help="bench this model file instead of a random one of --shape")
    ap.add_argument("--prompts", default="512,1536")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-batches", default="",
                    help="comma list of batch sizes whose decode step is timed too")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="keep the model file here (default: a temporary directory)")
    ap.add_argument("--name", help="results file name (default libraries-<shape>-<format>-kv<mode>)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    builds = dict(spec.split("=", 1) for spec in args.library if "=" in spec)
    if len(builds) < 2 or len(builds) != len(args.library):
        ap.error("give two or more --library LABEL=PATH, each label once")
    for label, path in builds.items():
        if not Path(path).is_file():
            ap.error(f"--library {label}={path}: no such file")
    longest = max(int(n) for n in args.prompts.split(","))
    if args.model:
        with tinyloop.Model(args.model, backend="native", prefix_cache_bytes=0) as model:
            max_seq_len = model.config()["max_seq_len"]
    else:
        max_seq_len = SHAPES[args.shape]["max_seq_len"]
    if longest + DECODE_TOKENS > max_seq_len:
        ap.error(f"--prompts: {longest} + {DECODE_TOKENS} decoded tokens exceed the model's "
                 f"max_seq_len {max_seq_len}")
    isas = args.isas.split(",")
    cpu, flags = cpu_description()
    peaks, no_peak = int8_peaks([args.threads], flags)
    print(f"CPU: {cpu}; int8 peaks {peaks}; not measured: {no_peak}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        args.dir = args.dir or scratch
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        if not args.model:
            model_file(args.shape, args.format, args.dir, progress=print)
        best, tokens, work, steps = {}, {}, None, {}
        for round_ in range(args.rounds):
            for isa in isas:
                for label, library in builds.items():
                    print(f"round {round_ + 1} of {args.rounds}: {label} on {isa}", flush=True)
                    result = measure(label, library, isa, args)
                    work = result["work"]
                    tokens[label, isa] = result["tokens"]
                    for n, speed in result["tok/s"].items():
                        best[label, isa, int(n)] = max(best.get((label, isa, int(n)), 0.0), speed)
                    for b, seconds in result["step s"].items():
                        key = label, isa, int(b)
                        steps[key] = min(steps.get(key, float("inf")), seconds)
    first = next(iter(builds))
    per_token, head_macs = work
    rows = []
    for (label, isa, n), speed in best.items():
        gmacs = (n * per_token + head_macs) * speed / n / 1e9
        peak = peaks.get(isa, {}).get(args.threads)
        rows.append({"build": label, "isa": isa, "prompt": n, "pp tok/s": speed,
                     "ratio": speed / best[first, isa, n], "prefill GMAC/s": gmacs,
                     "% of peak": gmacs / (10 * peak) if peak else None,
                     "same tokens": tokens[label, isa] == tokens[first, isa]})
    rows.sort(key=lambda r: (isas.index(r["isa"]), r["prompt"], list(builds).index(r["build"])))
    peak_text = "; ".join([f"{isa} {by[args.threads]:.2f} T MAC/s" for isa, by in peaks.items()]
                          + [f"{isa} not measured: {why}" for isa, why in no_peak.items()])
    model = f"model {args.model}" if args.model else f"{args.shape} shape, {args.format} weights"
    notes = (f"CPU: {cpu}. Builds: " + ", ".join(f"{k} = {v}" for k, v in builds.items())
             + f". {model}, {args.kv_mode} KV cache, {args.threads} "
             f"threads; prompts built "
             f"in chunks of {args.chunk}, best of {args.repeats} per child and of {args.rounds} "
             f"alternating rounds. int8 peaks on {args.threads} thread(s): {peak_text}. Ratios vs "
             f"{first}.")
    name = args.name or f"libraries-{args.shape}-{args.format}-kv{args.kv_mode}"
    print(write_results(name, rows, list(rows[0]), notes))
    if steps:
        smallest = min(b for _, _, b in steps)
        decode = [{"build": label, "isa": isa, "batch": b, "step ms": 1e3 * seconds,
                   "ratio": seconds / steps[first, isa, b],
                   "vs smallest batch": seconds / steps[label, isa, smallest]}
                  for (label, isa, b), seconds in steps.items()]
        decode.sort(key=lambda r: (isas.index(r["isa"]), r["batch"], list(builds).index(r["build"])))
        print(write_results(f"{name}-decode", decode, list(decode[0]),
                            notes + f" Decode: {DECODE_TOKENS} greedy steps of a batch of B "
                            "16-token prompts."))
    return 0 if all(r["same tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
