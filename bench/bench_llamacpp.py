"""TinyLoop (native, at each CPU kernel path) vs llama.cpp with and without its AMX path, on the
CPU at equal per-token compute (issue #7 point 4, issue #17 item 6).

    pip install gguf diskcache jinja2     # the bench's writer of GGUF files, llama_cpp's imports
    python bench/bench_llamacpp.py --build-llama     # once: compiles the llama.cpp builds below
    python bench/bench_llamacpp.py [--full] [--threads 2] [--repeats 5] [--flash-attn] [--dir DIR]
                                   [--isas avx2,amx] [--llama-dir DIR]

llama.cpp builds. --build-llama compiles llama-cpp-python 0.3.36 (llama.cpp 0c1e570) from its
source package into one folder per build under --llama-dir (default ~/.cache/tinyloop-bench),
skipping the folders already there. Each build took 20-25 minutes on 2 cores shared with other
jobs (about 3 on 2 idle cores). It runs:

    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF \
        -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
        -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \
        pip install --no-deps --no-cache-dir --target ~/.cache/tinyloop-bench/llama-cpp-noamx \
        llama-cpp-python==0.3.36
    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
        pip install --no-deps --no-cache-dir --target ~/.cache/tinyloop-bench/llama-cpp-amx \
        llama-cpp-python==0.3.36

--no-cache-dir keeps pip's wheel cache from handing the second install the first one's build.
"noamx" is tuned for this CPU (-march=native) but without AMX: in a native build ggml ignores its
GGML_AMX_* options, so the compiler flags turn AMX off (GCC keeps an explicit -mno-* over
-march=native). "amx" is plain native, which on a CPU with AMX-INT8 compiles ggml's AMX kernels;
--build-llama builds it only on such a CPU. Each build is named in the table by what its ggml
reports (llama_print_system_info: AMX_INT8 = 1 or not). LLAVA_BUILD=OFF skips the multimodal
library, which the bench does not load. When neither folder exists, the bench runs the
llama_cpp this Python imports (pip install '.[llamacpp]') as its one llama.cpp build.

Each llama.cpp build runs in a worker process of its own (this script with --worker): llama.cpp
0c1e570 built with AMX crashes in ggml_backend_amx_mul_mat on Q8_0 and Q4_0 models on the
Sapphire Rapids machines we measured (SIGILL at a tileloadd through llama-cpp-python, SIGSEGV in
llama-bench), and a crashed worker becomes a row "crashed (signal 4, SIGILL) in its AMX path"
instead of the end of the bench. The workers inherit the environment: under load from other
processes, OMP_WAIT_POLICY=passive keeps llama.cpp's spinning OpenMP threads from collapsing
(quick Q8_0 decode at load 6.7: 2-3 tok/s by default, 35-68 passive).

Both engines run a random-weight model of the same shape (the "quick" shape, or the "full" one
with --full): TinyLoop's looped model (n_pre 2 blocks + a loop block applied L = 8 times) and a
LLaMA of n_pre + L = 10 layers with the same d_model, ffn, heads and vocab, so every token costs
the same compute. The LLaMA is written with the `gguf` package in F16, then quantized with
llama_cpp's llama_model_quantize to Q8_0 and to Q4_0, both "pure" (token_embd and output.weight
get the same type; without it Q4_0 keeps output.weight at Q6_K). Pairs: TinyLoop int8 vs
llama.cpp Q8_0, TinyLoop int4 vs llama.cpp Q4_0.

TinyLoop runs once per CPU kernel path this CPU and libtinyloop have (tinyloop.backend_features
"native-avx2", "native-avx512-vnni", "native-amx"), or the ones --isas names: a Model opened with
TINYLOOP_ISA set to it. The "kernels" column is the path the Model reports it runs
(Model.runtime()["isa"]); a libtinyloop that ignores TINYLOOP_ISA runs its best path, which
the bench says on stderr.

pp512: tokens/s of prefilling 512 random tokens in one batch into an empty cache.
tg32: tokens/s of 32 greedy single-token steps after those 512 tokens.
TinyLoop: tinyloop.quickbench.speed on Model(backend="native", threads=2, prefix_cache_bytes=0).
llama.cpp: llama_cpp.Llama(n_threads=2, n_batch=512, n_ctx=1024; F16 KV, OpenMP threads, flash
attention off unless --flash-attn) through the Python API, not llama-bench: Llama.eval of the
512-token prompt after reset(), then 32 Llama.eval calls of one token each, each token the argmax
of the previous logits; timed inside the worker.
All engines of a format stay loaded and run in alternating rounds (each TinyLoop path, then each
llama.cpp build, again, ...); each figure is the best of --repeats rounds, so a burst of load
from other processes does not land on one engine only. ratio = the row / llama.cpp without AMX.
The weights MiB column is the model file: the looped model stores 3 distinct blocks (plus
embedding and head), the LLaMA 10 layers. load avg: the 1-minute load average after the format's
rounds (about 2 = this bench alone on the 2 cores; more = other processes competing, which slows
llama.cpp's OpenMP barriers far more than TinyLoop's pool).

Writes bench/results/llamacpp-<shape>.{json,md}. Exits with code 2 when gguf, or every llama.cpp
build, is missing.
"""
import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from common import (DEFAULT_LLAMA_DIR, LLAMA_CPP_PYTHON, LLAMA_QUANT, NO_AMX_FLAGS, SHAPES,
                    exit_text, gguf, model_file, tinyloop_isas, tinyloop_model, write_f16_gguf,
                    write_results)
from tinyloop.quickbench import speed, timed

MIB = 2 ** 20

# What --build-llama installs (common.LLAMA_CPP_PYTHON), per build folder under --llama-dir: its
# CMake arguments.
LLAMA_BUILDS = {
    "llama-cpp-noamx": f"-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='{NO_AMX_FLAGS}' "
                       f"-DCMAKE_CXX_FLAGS='{NO_AMX_FLAGS}'",
    "llama-cpp-amx": "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF",
}


def gguf_model(shape, quant, directory, threads, build):
    """Path of the `quant` LLaMA GGUF of `shape`, written once into `directory`; `build` (a
    LlamaBuild) quantizes it."""
    directory = Path(directory)
    f16, path = directory / f"{shape}-F16.gguf", directory / f"{shape}-{quant}.gguf"
    if not path.exists():
        if not f16.exists():
            write_f16_gguf(f16, shape)
        with LlamaWorker(build) as worker:
            worker.call("quantize", source=str(f16), target=str(path), quant=quant,
                        threads=threads)
    return path


# --- llama.cpp builds, each served by a worker process ----------------------------------------

class LlamaServer:
    """The worker's side: one llama_cpp module and at most one loaded model."""

    def __init__(self, llama_cpp):
        self.lib = llama_cpp
        self.llm = None

    def info(self):
        features = self.lib.llama_print_system_info().decode()
        return {"version": self.lib.__version__, "module": self.lib.__file__,
                "amx": "AMX_INT8 = 1" in features, "system_info": features.strip()}

    def quantize(self, source, target, quant, threads):
        """llama_model_quantize `source` to a pure `quant` (e.g. "Q4_0") model at `target`."""
        params = self.lib.llama_model_quantize_default_params()
        params.ftype = getattr(self.lib, f"LLAMA_FTYPE_MOSTLY_{quant}")
        params.pure = True
        params.nthread = threads
        if self.lib.llama_model_quantize(source.encode(), target.encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize {source} -> {quant} failed")

    def load(self, path, threads, n_batch, n_ctx, flash_attn):
        self.llm = self.lib.Llama(path, n_threads=threads, n_threads_batch=threads,
                                  n_batch=n_batch, n_ctx=n_ctx, flash_attn=flash_attn,
                                  verbose=False)

    def speed(self, n_prompt, n_decode):
        """[prefill tok/s, decode tok/s] of one run: n_prompt random tokens into an empty cache,
        then n_decode greedy single-token steps."""
        llm = self.llm
        prompt = np.random.default_rng(1).integers(0, llm.n_vocab(), n_prompt).tolist()
        llm.reset()
        _, t_prefill = timed(lambda: llm.eval(prompt))

        def decode():
            for _ in range(n_decode):
                logits = self.lib.llama_get_logits_ith(llm.ctx, -1)
                llm.eval([int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))])

        _, t_decode = timed(decode)
        return [n_prompt / t_prefill, n_decode / t_decode]


def worker(directory):
    """--worker: serve the llama_cpp found in `directory` (or, for "", the one this Python
    imports) to the bench, one JSON object a line each way: {"call": name, ...arguments} on stdin,
    {"result": ...} or {"error": text} on stdout. stdout becomes stderr for the worker's own
    prints (llama.cpp's C code included), so that only replies reach the bench."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(**message):
        print(json.dumps(message), file=replies, flush=True)

    if directory:
        sys.path.insert(0, directory)
    try:
        import llama_cpp
    except ImportError as exc:
        reply(error=f"cannot import llama_cpp from {directory or sys.path}: {exc}")
        return 1
    server = LlamaServer(llama_cpp)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = getattr(server, request.pop("call"))(**request)
        except Exception as exc:    # the bench reports it; the worker serves on
            reply(error=f"{type(exc).__name__}: {exc}")
        else:
            reply(result=result)
    return 0


class LlamaCrashed(Exception):
    """A llama.cpp worker ended without replying (e.g. killed by SIGSEGV)."""


class LlamaBuild:
    """One llama.cpp build: the folder holding its llama_cpp (None = the one this Python imports)
    and what its ggml reports (LlamaServer.info)."""

    def __init__(self, directory):
        self.directory = directory
        with LlamaWorker(self) as probe:
            self.info = probe.call("info")
        self.name = "AMX" if self.info["amx"] else "no AMX"


class LlamaWorker:
    """A worker process serving one LlamaBuild; call() raises LlamaCrashed when it died."""

    def __init__(self, build):
        self.build = build
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(build.directory or "")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, name, **arguments):
        try:
            self.process.stdin.write(json.dumps({"call": name, **arguments}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass                    # it already died; the empty read below says how
        line = self.process.stdout.readline()
        if not line:
            raise LlamaCrashed(exit_text(self.process.wait()))
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker ({self.build.directory or 'this Python'}), "
                               f"{name}: {reply['error']}")
        return reply["result"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


def find_llama_builds(llama_dir):
    """The LlamaBuilds to bench: those in llama_dir's build folders, no-AMX first and each name
    once, or else the llama_cpp this Python imports; [] when there is none."""
    folders = [llama_dir / name for name in LLAMA_BUILDS
               if (llama_dir / name / "llama_cpp").is_dir()]
    if not folders and importlib.util.find_spec("llama_cpp") is None:
        return []
    builds = {}
    for build in sorted(map(LlamaBuild, folders or [None]), key=lambda b: b.info["amx"]):
        builds.setdefault(build.name, build)
    return list(builds.values())


def cpu_has_amx_int8():
    """Whether /proc/cpuinfo lists amx_int8 (False where there is no /proc/cpuinfo)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def build_llama(llama_dir, jobs):
    """pip install each missing build folder of LLAMA_BUILDS into llama_dir (the AMX one only on a
    CPU with AMX-INT8), compiling llama.cpp with jobs parallel jobs."""
    for name, cmake_args in LLAMA_BUILDS.items():
        target = llama_dir / name
        if (target / "llama_cpp").is_dir() or (name == "llama-cpp-amx" and not cpu_has_amx_int8()):
            continue
        env = {**os.environ, "CMAKE_ARGS": cmake_args}
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(jobs))
        # --no-cache-dir: pip's wheel cache would hand the second build the first one's wheel
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
                   "--target", str(target), LLAMA_CPP_PYTHON]
        print(f"building {name}: CMAKE_ARGS=\"{cmake_args}\" pip {' '.join(command[3:])}",
              flush=True)
        _, seconds = timed(lambda: subprocess.run(command, env=env, check=True))
        print(f"built {name} in {seconds / 60:.1f} min", flush=True)


# --- the bench --------------------------------------------------------------------------------

def best_rounds(engines, repeats):
    """Per engine, the best [prefill tok/s, decode tok/s] over `repeats` rounds, each round
    running every engine once in turn, so a burst of load from other processes hits all of them;
    or, for an engine that crashed, its LlamaCrashed (it runs no more rounds)."""
    best = {name: [0.0, 0.0] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            if isinstance(best[name], LlamaCrashed):
                continue
            try:
                best[name] = list(map(max, best[name], run()))
            except LlamaCrashed as crash:
                best[name] = crash
    return best


def compare(shape, fmt, args, directory, builds):
    """The table rows of one weight format: TinyLoop at each kernel path, then each llama.cpp
    build; the ratios are against llama.cpp without AMX."""
    quant = LLAMA_QUANT[fmt]
    ours = model_file(shape, fmt, directory)
    theirs = gguf_model(shape, quant, directory, args.threads, builds[0])
    P, D = args.prefill, args.decode
    engines, crashes, files = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for isa in args.isas:
            model = stack.enter_context(tinyloop_model(ours, isa, args.threads))
            ran = model.runtime()["isa"]
            if ran != isa:
                print(f"TinyLoop: TINYLOOP_ISA={isa} ran the {ran} kernels (this libtinyloop does "
                      "not read TINYLOOP_ISA)", file=sys.stderr)
            key = (f"TinyLoop {fmt}", ran)
            engines.setdefault(key, lambda model=model: speed(model, P, D)[1:])
            files[key] = ours
        for build in builds:
            worker = stack.enter_context(LlamaWorker(build))
            key = (f"llama.cpp {quant}", build.name)
            files[key] = theirs
            try:
                worker.call("load", path=str(theirs), threads=args.threads, n_batch=P,
                            n_ctx=max(1024, P + D), flash_attn=args.flash_attn)
            except LlamaCrashed as crash:
                crashes[key] = crash
            else:
                engines[key] = functools.partial(worker.call, "speed", n_prompt=P, n_decode=D)
        best = {**best_rounds(engines, args.repeats), **crashes}
    load = os.getloadavg()[0]
    baseline = best.get((f"llama.cpp {quant}", "no AMX"))
    baseline = None if isinstance(baseline, LlamaCrashed) else baseline
    rows = []
    for key in files:                   # TinyLoop's paths, then the llama.cpp builds, in order
        engine, kernels = key
        crashed = isinstance(best[key], LlamaCrashed)
        pre, dec = (None, None) if crashed else best[key]
        status = f"crashed ({best[key]})" if crashed else "ok"
        if crashed and kernels == "AMX" and baseline:
            status += " in its AMX path"
        rows.append({"shape": shape, "engine": engine, "kernels": kernels,
                     "weights MiB": files[key].stat().st_size / MIB,
                     f"pp{P} tok/s": pre, f"tg{D} tok/s": dec,
                     f"pp{P} ratio": pre / baseline[0] if pre and baseline else None,
                     f"tg{D} ratio": dec / baseline[1] if dec and baseline else None,
                     "status": status, "load avg": load})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the d2048 shape instead of the quick one")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--isas", default="", help="TinyLoop kernel paths, comma-separated (default: "
                    "every one this CPU has but scalar)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA_DIR,
                    help=f"the llama.cpp build folders (default {DEFAULT_LLAMA_DIR})")
    ap.add_argument("--build-llama", action="store_true",
                    help="first pip install the missing llama.cpp builds into --llama-dir")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    if gguf is None:
        print("bench_llamacpp: the module 'gguf' is not installed; pip install gguf",
              file=sys.stderr)
        return 2
    args.isas = tinyloop_isas(args.isas)
    if args.build_llama:
        build_llama(args.llama_dir, args.threads)
    builds = find_llama_builds(args.llama_dir)
    if not builds:
        print(f"bench_llamacpp: no llama.cpp: no build in {args.llama_dir} (make them with "
              "--build-llama) and no llama_cpp module (pip install llama-cpp-python)",
              file=sys.stderr)
        return 2
    for build in builds:
        print(f"llama.cpp {build.name}: llama-cpp-python {build.info['version']} from "
              f"{build.info['module']}", flush=True)
    shape = "full" if args.full else "quick"
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        rows = []
        for fmt in args.formats.split(","):
            for row in compare(shape, fmt, args, args.dir or scratch, builds):
                print(row, flush=True)
                rows.append(row)
    crashes = sorted({f"{row['engine']} {row['kernels']}: {row['status']}" for row in rows
                      if row["status"] != "ok"})
    notes = (f"{args.threads} threads, best of {args.repeats} alternating rounds, llama.cpp flash "
             f"attention {'on' if args.flash_attn else 'off'}; TinyLoop native n_pre 2 + L 8 at "
             f"each kernel path vs a "
             f"{SHAPES[shape]['n_pre_blocks'] + SHAPES[shape]['default_loops']}-layer LLaMA "
             f"(llama-cpp-python {builds[0].info['version']}, pure quantization, builds: "
             f"{', '.join(build.name for build in builds)}). ratio = the row / llama.cpp without "
             "AMX." + "".join(f" {crash}." for crash in crashes))
    print(write_results(f"llamacpp-{shape}", rows, list(rows[0]), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
