"""TinyLoop's CPU speed per kernel path (AVX2, AVX-512 VNNI, AMX; scalar on request), against
this machine's streaming read bandwidth and int8 peak per path (issue #17 item 5, issue #34
point 4).

    python bench/bench_isa.py [--shape quick|full] [--formats int8,int4] [--threads 2]
                              [--repeats 3] [--prefill 512] [--decode 32] [--scalar]
                              [--no-avx2-rows] [--dir DIR]

Kernel paths: every one this CPU and libtinyloop have (tinyloop.backend_features "native-avx2",
"native-avx512-vnni", "native-amx"), plus scalar with --scalar (slow: minutes on the full
shape). Each runs as a Model(path, backend="native", threads=--threads, prefix_cache_bytes=0)
opened with TINYLOOP_ISA set to it; the isa column is the path the Model reports it runs
(Model.runtime()["isa"]), and a libtinyloop that ignores TINYLOOP_ISA is said on stderr.

Method: all paths of a format stay loaded and run tinyloop.quickbench.speed in alternating
rounds (each path once, again, ...), each figure the best of --repeats rounds, so a burst of
load from the other processes on this shared machine lands on every path alike. Every path
must generate the same tokens (checked; the exit code is 1 otherwise).

Row kernels: a path whose row and attention kernels have an AVX-512 form on this CPU (the
AVX-512 VNNI and AMX paths) runs twice, once with them (rows "avx512") and once with their AVX2
forms (rows "avx2": TINYLOOP_ROW_KERNELS=avx2, what those paths ran before issue #34 point 4),
both in the same alternating rounds; --no-avx2-rows leaves the second out.

Columns:
- pp512 tok/s: prefill of --prefill random tokens in one chunk into an empty cache.
- tg32 tok/s: --decode greedy single-token steps after it.
- pp ratio, tg ratio: the row / AVX-512 VNNI (or, without it, the best non-AMX path measured),
  each with its widest row kernels.
- rows pp ratio: the row's prefill / the same path's with AVX2 row kernels.
- prefill GMAC/s: int8 multiply-adds of the linears per second of prefill. Per token and layer
  d*(H + 2*G)*D + H*D*d + d*2*F + F*d (attn_qkv, attn_out, ffn_gate_up, ffn_down; d = d_model,
  H, G = query and kv heads, D = head_dim, F = ffn_dim), times n_pre + L layers (the core's
  blocks L times, plus the adapter's where the model has one), plus the head (V*d) once: the
  logits of the last row only. Attention's own products are not counted.
- % of peak: prefill GMAC/s / the int8 peak of the row's own path at --threads threads (below):
  the AMX tile peak for amx, the VPDPBUSD peak for avx512-vnni; none is measured for avx2.
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
- int8 peaks: bench/int8_peak.c (amx: TDPBSSD on 4 independent 16x16x64 int8 accumulator tiles
  after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); avx512-vnni: VPDPBUSD zmm on 12
  independent accumulators; see its header), compiled here with `cc -O2 -mavx512f -mavx512vnni
  -mamx-tile -mamx-int8 -pthread` into a temporary folder and run per path once on 1 thread and
  once on --threads threads (while other processes hold cores, the --threads figure is low).
  A path without its flag in lscpu's (amx_int8, avx512_vnni), no cc, or a failing program
  leaves that path's peak cells empty, and the notes say why.
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

INT8_PEAK_C = Path(__file__).resolve().parent / "int8_peak.c"
PEAK_FLAGS = {"amx": "amx_int8", "avx512-vnni": "avx512_vnni"}   # path: the lscpu flag it needs
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


def int8_peaks(thread_counts, flags):
    """({path: {threads: int8 T MAC/s}}, {path: why not}) from bench/int8_peak.c for the paths
    of PEAK_FLAGS."""
    peaks, missing = {}, {}
    cc = shutil.which("cc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        build = None if cc is None else subprocess.run(
            [cc, "-O2", "-mavx512f", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-pthread",
             str(INT8_PEAK_C), "-o", str(exe)], capture_output=True, text=True)
        for isa, flag in PEAK_FLAGS.items():
            if flag not in flags:
                missing[isa] = f"the CPU has no {flag} (lscpu flags)"
            elif build is None:
                missing[isa] = "no C compiler: cc is not on PATH"
            elif build.returncode:
                missing[isa] = f"cc could not build {INT8_PEAK_C.name}: {build.stderr.strip()[-300:]}"
            else:
                for n in thread_counts:
                    run = subprocess.run([str(exe), isa, str(n)], capture_output=True, text=True)
                    if run.returncode:
                        missing[isa] = (f"{exe.name} {isa} {n} ended with "
                                        f"{exit_text(run.returncode)}: {run.stderr.strip()}")
                        peaks.pop(isa, None)
                        break
                    peaks.setdefault(isa, {})[n] = float(run.stdout)
    return peaks, missing


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


def row_forms(isa, flags, args):
    """The row kernel forms to measure on path `isa`: its widest, and AVX2 where that is AVX-512
    (the AVX-512 VNNI and AMX paths on a CPU with AVX-512 VNNI) unless --no-avx2-rows."""
    if isa not in ("avx512-vnni", "amx") or "avx512_vnni" not in flags:
        return ["scalar" if isa == "scalar" else "avx2"]
    return ["avx512"] + ([] if args.no_avx2_rows else ["avx2"])


def measure(shape, fmt, isas, args, directory, machine, flags):
    """The rows of one weight format: each kernel path and row form, measured in alternating
    rounds."""
    path = model_file(shape, fmt, directory, progress=print)
    P, D = args.prefill, args.decode
    models, tokens, best = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for isa in isas:
            for rows in row_forms(isa, flags, args):
                model = stack.enter_context(tinyloop_model(path, isa, args.threads,
                                                           row_kernels="avx2" if rows == "avx2" else "auto"))
                ran = model.runtime()["isa"]
                if ran != isa:
                    print(f"TINYLOOP_ISA={isa} ran the {ran} kernels (this libtinyloop does not read "
                          "TINYLOOP_ISA)", file=sys.stderr)
                models.setdefault((ran, rows), model)
        config = ModelConfig.from_dict(next(iter(models.values())).config())
        for round_ in range(args.repeats):
            for (isa, rows), model in models.items():
                print(f"{shape} {fmt} {isa} ({rows} rows): round {round_ + 1} of {args.repeats}", flush=True)
                tokens[isa, rows], pre, dec = speed(model, P, D)
                best[isa, rows] = tuple(map(max, best.get((isa, rows), (0.0, 0.0)), (pre, dec)))
    load = os.getloadavg()[0]
    per_token, head_macs, step_bytes = linear_work(config)
    widest = {}                                  # each path with its first (widest) row form
    for (isa, _), speeds in best.items():
        widest.setdefault(isa, speeds)
    baseline = widest.get(baseline_isa(list(widest)))
    reference = next(iter(tokens.values()))
    out = []
    for (isa, rows), (pre, dec) in best.items():
        gmacs = (P * per_token + head_macs) * pre / P / 1e9
        gbs = step_bytes * dec / 1e9
        peak = machine["int8 peak"].get(isa, {}).get(args.threads)
        narrow = best.get((isa, "avx2"))
        out.append({"shape": shape, "format": fmt, "isa": isa, "rows": rows, f"pp{P} tok/s": pre,
                     f"tg{D} tok/s": dec,
                     "pp ratio": pre / baseline[0] if baseline else None,
                     "tg ratio": dec / baseline[1] if baseline else None,
                     "rows pp ratio": pre / narrow[0] if narrow else None,
                     "prefill GMAC/s": gmacs,
                     "% of peak": gmacs / (10 * peak) if peak else None,
                     "weights MiB": step_bytes / MIB, "decode GB/s": gbs,
                     "% of stream": 100 * gbs / machine["stream GB/s"],
                     "same tokens": tokens[isa, rows] == reference, "load avg": load})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--scalar", action="store_true", help="also the scalar path (slow)")
    ap.add_argument("--no-avx2-rows", action="store_true",
                    help="do not also run the AVX-512 paths with their AVX2 row kernels")
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    args = ap.parse_args(argv)
    isas = (["scalar"] if args.scalar else []) + tinyloop_isas("")
    cpu, flags = cpu_description()
    print(f"CPU: {cpu}; kernel paths: {', '.join(isas)}", flush=True)
    machine = {"stream GB/s": stream_bandwidth(args.threads)}
    print(f"streaming read: {machine['stream GB/s']:.1f} GB/s on {args.threads} thread(s)",
          flush=True)
    machine["int8 peak"], no_peak = int8_peaks(sorted({1, args.threads}), flags)
    print(f"int8 peaks: {machine['int8 peak']} (path: threads: T MAC/s); not measured: {no_peak}",
          flush=True)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats.split(","):
            for row in measure(args.shape, fmt, isas, args, args.dir or scratch, machine, flags):
                print(row, flush=True)
                rows.append(row)
    peaks = "; ".join(
        [f"{isa} " + ", ".join(f"{peak:.2f} T MAC/s on {n} thread(s)" for n, peak in by_threads.items())
         for isa, by_threads in machine["int8 peak"].items()]
        + [f"{isa} not measured: {why}" for isa, why in no_peak.items()])
    cpu_flags = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    baseline = baseline_isa(list(dict.fromkeys(row["isa"] for row in rows)))
    notes = (f"CPU: {cpu} ({cpu_flags}). "
             f"{args.threads} threads, best of {args.repeats} alternating rounds; prefill "
             f"{args.prefill} tokens in one chunk, decode {args.decode} greedy tokens. Streaming "
             f"read {machine['stream GB/s']:.1f} GB/s on {args.threads} thread(s); int8 peaks: "
             f"{peaks}. Ratios vs {baseline or 'none (one path only)'}; rows pp ratio vs the same "
             f"path with AVX2 row kernels (TINYLOOP_ROW_KERNELS=avx2).")
    print(write_results(f"isa-{args.shape}", rows, list(rows[0]), notes))
    return 0 if all(row["same tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
