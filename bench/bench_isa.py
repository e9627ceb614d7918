"""TinyLoop's CPU speed per kernel path (AVX2, AVX-512 VNNI, AMX; scalar on request), against
this machine's streaming read bandwidth and AMX tile peak (issue #17 item 5 and its goals).

    python bench/bench_isa.py [--shape quick|full] [--formats int8,int4] [--threads 2]
                              [--repeats 3] [--prefill 512] [--decode 32] [--scalar] [--dir DIR]

Kernel paths: every one this CPU and libtinyloop have (tinyloop.backend_features "native-avx2",
"native-avx512-vnni", "native-amx"), plus scalar with --scalar (slow: minutes on the full
shape). Each runs as a Model(path, backend="native", threads=--threads, prefix_cache_bytes=0)
opened with TINYLOOP_ISA set to it; the isa column is the path the Model reports it runs
(Model.runtime()["isa"]), and a libtinyloop that ignores TINYLOOP_ISA is said on stderr.

Method: all paths of a format stay loaded and run tinyloop.quickbench.speed in alternating
rounds (each path once, again, ...), each figure the best of --repeats rounds, so a burst of
load from the other processes on this shared machine lands on every path alike. Every path
must generate the same tokens (checked; the exit code is 1 otherwise).

Columns:
- pp512 tok/s: prefill of --prefill random tokens in one chunk into an empty cache.
- tg32 tok/s: --decode greedy single-token steps after it.
- pp ratio, tg ratio: the row / AVX-512 VNNI (or, without it, the best non-AMX path measured).
- prefill GMAC/s: int8 multiply-adds of the linears per second of prefill. Per token and layer
  d*(H + 2*G)*D + H*D*d + d*2*F + F*d (attn_qkv, attn_out, ffn_gate_up, ffn_down; d = d_model,
  H, G = query and kv heads, D = head_dim, F = ffn_dim), times n_pre + L layers (the core's
  blocks L times, plus the adapter's where the model has one), plus the head (V*d) once: the
  logits of the last row only. Attention's own products are not counted.
- % of tile peak: prefill GMAC/s / the AMX tile peak at --threads threads (below).
- weights MiB: bytes of weights one decode step reads, from the model's config (the stored size
  of each linear: .w, .m and .s tensors): the prelude blocks once, the core blocks L times (each
  iteration re-reads them: on the full shape they exceed the caches), then the head. Not
  counted: the KV cache (2*(D + 4) bytes per token, kv head and layer: after 512 tokens about
  4% of the full shape's int8 step, 7% of its int4 one) and the one embedding row.
- decode GB/s: weights MiB * tg32 tok/s; % of stream: that / the streaming bandwidth
  (below). Where the core block fits in the caches (the quick shape's 3 MiB int8 does) it can
  pass 100.
- load avg: the 1-minute load average after the format's rounds (about --threads = this bench
  alone; more = other processes competing).

Machine figures, measured in the same run before the models (the notes give them):
- streaming read bandwidth: np.max over a 1 GiB int8 array split into --threads contiguous
  parts, one Python thread each (numpy releases the GIL in reductions; int8 max is cheap enough
  per byte to be memory-bound); the best of 3.
- AMX tile peak: bench/tile_peak.c (TDPBSSD on 4 independent 16x16x64 int8 accumulator tiles
  after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); see its header), compiled here with
  `cc -O2 -mamx-tile -mamx-int8 -pthread` into a temporary folder and run once on 1 thread and
  once on --threads threads (while other processes hold cores, the --threads figure is low).
  Without AMX-INT8 in lscpu's flags, without cc, or when the program fails, the bench says why
  and leaves the tile-peak cells empty.
The CPU's model name and its avx2, avx512_vnni and amx_int8 flags (lscpu) go into the notes.

Writes bench/results/isa-<shape>.{json,md}.
"""
import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import (SHAPES, cpu_description, exit_text, model_file, tinyloop_isas, tinyloop_model,
                    write_results)
from tinyloop.config import ModelConfig
from tinyloop.quickbench import speed

TILE_PEAK_C = Path(__file__).resolve().parent / "tile_peak.c"
CPU_FLAGS = ("avx2", "avx512_vnni", "amx_int8")       # the flags the notes report
STREAM_BYTES = 2 ** 30
MIB = 2 ** 20


# --- the machine ------------------------------------------------------------------------------

def stream_bandwidth(threads, repeats=3):
    """Streaming read GB/s of `threads` Python threads, each reducing its part of 1 GiB."""
    parts = np.array_split(np.ones(STREAM_BYTES, np.int8), threads)
    best = math.inf
    for _ in range(repeats):
        workers = [threading.Thread(target=part.max) for part in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return STREAM_BYTES / best / 1e9


def tile_peak(thread_counts, flags):
    """({threads: AMX int8 T MAC/s}, None) from bench/tile_peak.c, or ({}, why not)."""
    if "amx_int8" not in flags:
        return {}, "the CPU has no AMX-INT8 (lscpu flags)"
    cc = shutil.which("cc")
    if cc is None:
        return {}, "no C compiler: cc is not on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "tile_peak"
        build = subprocess.run([cc, "-O2", "-mamx-tile", "-mamx-int8", "-pthread",
                                str(TILE_PEAK_C), "-o", str(exe)], capture_output=True, text=True)
        if build.returncode:
            return {}, f"cc could not build {TILE_PEAK_C.name}: {build.stderr.strip()[-300:]}"
        peaks = {}
        for n in thread_counts:
            run = subprocess.run([str(exe), str(n)], capture_output=True, text=True)
            if run.returncode:
                return {}, (f"{exe.name} {n} ended with {exit_text(run.returncode)}: "
                            f"{run.stderr.strip()}")
            peaks[n] = float(run.stdout)
    return peaks, None


# --- the model's work -------------------------------------------------------------------------

def linear_work(config):
    """(multiply-adds per prefill token in the blocks' linears, multiply-adds of one head row,
    bytes of weights one decode step reads) of a ModelConfig: the core's linears (its blocks
    and adapter) count L times, the prelude's and coda's once."""
    tensors = config.required_tensors()

    def uses(linear):
        return config.default_loops if linear.startswith("core.") else 1

    def nbytes(linear):                 # a linear's stored parts: weights, multipliers, scales
        return sum(math.prod(tensors[part][1]) * tensors[part][0].itemsize
                   for part in (f"{linear}.w", f"{linear}.m", f"{linear}.s") if part in tensors)

    linears = config.linear_shapes()
    linears.pop("head", None)
    head = "tok_emb" if config.tied_head else "head"
    per_token = sum(rows * cols * uses(name) for name, (rows, cols) in linears.items())
    step_bytes = sum(nbytes(name) * uses(name) for name in linears) + nbytes(head)
    return per_token, config.vocab_size * config.d_model, step_bytes


# --- the bench --------------------------------------------------------------------------------

def baseline_isa(isas):
    """The path the ratios divide by: the last (best) non-AMX one of `isas` (in ISAS order,
    slowest first), when there is also another path to compare; else None."""
    others = [isa for isa in isas if isa != "amx"]
    return others[-1] if others and len(isas) > 1 else None


def measure(shape, fmt, isas, args, directory, machine):
    """The rows of one weight format: each kernel path, measured in alternating rounds."""
    path = model_file(shape, fmt, directory, progress=print)
    P, D = args.prefill, args.decode
    models, tokens, best = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for isa in isas:
            model = stack.enter_context(tinyloop_model(path, isa, args.threads))
            ran = model.runtime()["isa"]
            if ran != isa:
                print(f"TINYLOOP_ISA={isa} ran the {ran} kernels (this libtinyloop does not read "
                      "TINYLOOP_ISA)", file=sys.stderr)
            models.setdefault(ran, model)
        config = ModelConfig.from_dict(next(iter(models.values())).config())
        for round_ in range(args.repeats):
            for isa, model in models.items():
                print(f"{shape} {fmt} {isa}: round {round_ + 1} of {args.repeats}", flush=True)
                tokens[isa], pre, dec = speed(model, P, D)
                best[isa] = tuple(map(max, best.get(isa, (0.0, 0.0)), (pre, dec)))
    load = os.getloadavg()[0]
    per_token, head_macs, step_bytes = linear_work(config)
    baseline = best.get(baseline_isa(best))
    reference = next(iter(tokens.values()))
    peak = machine["tile peak"].get(args.threads)
    rows = []
    for isa, (pre, dec) in best.items():
        gmacs = (P * per_token + head_macs) * pre / P / 1e9
        gbs = step_bytes * dec / 1e9
        rows.append({"shape": shape, "format": fmt, "isa": isa, f"pp{P} tok/s": pre,
                     f"tg{D} tok/s": dec,
                     "pp ratio": pre / baseline[0] if baseline else None,
                     "tg ratio": dec / baseline[1] if baseline else None,
                     "prefill GMAC/s": gmacs,
                     "% of tile peak": gmacs / (10 * peak) if peak else None,
                     "weights MiB": step_bytes / MIB, "decode GB/s": gbs,
                     "% of stream": 100 * gbs / machine["stream GB/s"],
                     "same tokens": tokens[isa] == reference, "load avg": load})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--scalar", action="store_true", help="also the scalar path (slow)")
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    args = ap.parse_args(argv)
    isas = (["scalar"] if args.scalar else []) + tinyloop_isas("")
    cpu, flags = cpu_description()
    print(f"CPU: {cpu}; kernel paths: {', '.join(isas)}", flush=True)
    machine = {"stream GB/s": stream_bandwidth(args.threads)}
    print(f"streaming read: {machine['stream GB/s']:.1f} GB/s on {args.threads} thread(s)",
          flush=True)
    machine["tile peak"], no_peak = tile_peak(sorted({1, args.threads}), flags)
    print(f"AMX tile peak: {no_peak or machine['tile peak']} (threads: T MAC/s)", flush=True)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats.split(","):
            for row in measure(args.shape, fmt, isas, args, args.dir or scratch, machine):
                print(row, flush=True)
                rows.append(row)
    peaks = ", ".join(f"{peak:.2f} T MAC/s on {n} thread(s)"
                      for n, peak in machine["tile peak"].items()) or f"not measured: {no_peak}"
    cpu_flags = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    baseline = baseline_isa(list(dict.fromkeys(row["isa"] for row in rows)))
    notes = (f"CPU: {cpu} ({cpu_flags}). "
             f"{args.threads} threads, best of {args.repeats} alternating rounds; prefill "
             f"{args.prefill} tokens in one chunk, decode {args.decode} greedy tokens. Streaming "
             f"read {machine['stream GB/s']:.1f} GB/s on {args.threads} thread(s); AMX tile peak "
             f"{peaks}. Ratios vs {baseline or 'none (one path only)'}.")
    print(write_results(f"isa-{args.shape}", rows, list(rows[0]), notes))
    return 0 if all(row["same tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
