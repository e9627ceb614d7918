"""The `tinyloop` command line: `demo` (the main job), `generate`, `info` and `bench`.

Exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input (argparse convention),
130 interrupted (Ctrl-C, also during a long prefill).
"""
import argparse
import codecs
import sys
import tempfile
import time

import numpy as np

from . import Model
from ._version import __version__
from .backends import backend_features, backend_info
from .demo import run_demo
from .quickbench import bench_model, shared_prefix, speed

PROGRESS_CHUNK = 256       # prompt tokens per chunk when a progress display is on
PROGRESS_MIN_TOKENS = 1024  # "auto" shows progress for prompts at least this long


class PrefillProgress:
    """An on_prefill callback printing "prefill done/total tokens" on stderr: rewritten in
    place on a terminal, one line per chunk otherwise (--progress always)."""

    def __init__(self, mode, n_prompt, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = mode == "always" or (mode == "auto" and self.tty and n_prompt >= PROGRESS_MIN_TOKENS)

    def __call__(self, done, total):
        if self.tty:
            end = "\r\033[K" if done == total else ""
            print(f"\rprefill {done}/{total} tokens", end=end, file=self.stream, flush=True)
        else:
            print(f"prefill {done}/{total} tokens", file=self.stream, flush=True)


def _open(args, **kwargs):
    return Model(args.model, backend=args.backend, threads=args.threads, device=args.device, **kwargs)


def run_generate(args, out):
    """Stream the continuation as it is sampled, then one stats line on stderr."""
    with _open(args) as model:
        is_text = model.config()["tokenizer"] == "bytes" and not args.ids
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        parse = model.encode if is_text else (lambda s: [int(t) for t in s.split(",")])
        prompt = parse(text)
        stops = [parse(s) for s in args.stop]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = []

        def show(token):
            if not first:
                first.append(time.perf_counter())
            piece = decoder.decode(bytes([token])) if is_text else f"{token} "
            print(piece, end="", file=out, flush=True)

        progress = PrefillProgress(args.progress, len(prompt))
        if is_text:
            print(text, end="", file=out, flush=True)
        hits_before = model.cache_stats()["hit_tokens"]
        start = time.perf_counter()
        result = model.generate(
            prompt, max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
            cache_window=args.cache_window, stop_sequences=stops, seed=args.seed, on_token=show,
            on_prefill=progress if progress.enabled else None,
            prefill_chunk=PROGRESS_CHUNK if progress.enabled else None)
        end = time.perf_counter()
        print(file=out)
        n_new = len(result) - len(prompt)
        prefill = len(prompt) / max(first[0] - start, 1e-9) if first else float("nan")
        decode = (n_new - 1) / max(end - first[0], 1e-9) if n_new > 1 else float("nan")
        print(f"[backend {model.backend}, prompt {len(prompt)} tokens, "
              f"reused {model.cache_stats()['hit_tokens'] - hits_before}, "
              f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s]", file=sys.stderr)
    return 0


def run_info(args, out):
    info = backend_info(args.backend, args.device)
    with _open(args) as model:
        for key, value in model.config().items():
            print(f"{key:>16}: {value}", file=out)
        if model.backend == "native":
            runtime = model._engine.runtime()
            print(f"{'runtime':>16}: {runtime['isa']} kernels, {runtime['threads']} threads, "
                  f"KV blocks of {runtime['kv_block_size']}", file=out)
            print(f"{'device':>16}: {runtime['device_name']}", file=out)
    print(f"{'backend':>16}: {info['chosen']} ({info['reason'] or 'requested'})", file=out)
    print(f"{'library':>16}: {info['library']} {info['library_version'] or ''}", file=out)
    print(f"{'cuda':>16}: " + ("available" if info["cuda_available"] else info["cuda_reason"]), file=out)
    print(f"{'features':>16}: {', '.join(sorted(backend_features()))}", file=out)
    return 0


def run_bench(args, out):
    """Prefill/decode speed and the shared-prefix table on one model (bench/ has the full suite)."""
    with tempfile.TemporaryDirectory() as directory:
        path = args.model or bench_model("quick", args.format, directory)
        print(f"model {path if args.model else 'quick shape, ' + args.format} (written once, random)",
              file=out)
        with Model(path, backend=args.backend, threads=args.threads, prefix_cache_bytes=0,
                   device=args.device) as model:
            _, prefill, decode = speed(model, args.prefill, args.decode)
            print(f"backend {model.backend}: prefill {args.prefill} tokens {prefill:.0f} tok/s, "
                  f"decode {decode:.0f} tok/s", file=out)
            vocab = model.config()["vocab_size"]
            prompt = np.random.default_rng(0).integers(0, vocab, args.prefix).tolist()
            loops = min(8, model.config()["default_loops"])
            row = shared_prefix(model, prompt, args.n, args.decode, loops)
    print(f"{args.n} requests sharing a {args.prefix}-token prompt, {args.decode} new tokens each:",
          file=out)
    for name in ("no_cache", "shared", "batched"):
        print(f"  {name:<9}{row[name + ' s']:>8.3f} s", file=out)
    print(f"  SHARED {row['shared x']:.2f}x (bound {row['bound x']:.2f}x), "
          f"BATCHED {row['batched x']:.2f}x; identical tokens: {'yes' if row['same tokens'] else 'NO'}",
          file=out)
    return 0 if row["same tokens"] else 1


def build_parser():
    parser = argparse.ArgumentParser(prog="tinyloop", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, run, help):
        p = sub.add_parser(name, help=help)
        p.add_argument("--model", default=None, help="a .tinyloop file (default: the demo model)")
        p.add_argument("--backend", default="auto")
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="where the native backend runs (auto: the CPU for now)")
        p.set_defaults(run=run)
        return p

    demo = command("demo", lambda a, out: run_demo(lambda budget: _open(a, prefix_cache_bytes=budget),
                                                   a.max_tokens, a.temperature, a.seed, out),
                   "shared-prefix requests with and without prefix caching")
    demo.add_argument("--max-tokens", type=int, default=80)
    demo.add_argument("--temperature", type=float, default=0.5)
    demo.add_argument("--seed", type=int, default=1)
    gen = command("generate", run_generate, "generate text (or token ids) from a prompt")
    gen.add_argument("prompt", help="text, comma-separated token ids with --ids, or - for stdin")
    gen.add_argument("--ids", action="store_true", help="the prompt and stops are token ids")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--loops", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--cache-window", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                     help=f"prefill progress on stderr (auto: on a terminal, prompts >= "
                          f"{PROGRESS_MIN_TOKENS} tokens)")
    command("info", run_info, "model configuration and the backend chosen")
    bench = command("bench", run_bench, "a quick speed run (default: random quick-shape model)")
    bench.add_argument("--format", default="int8", choices=["int8", "int4"])
    bench.add_argument("--prefill", type=int, default=512)
    bench.add_argument("--decode", type=int, default=32)
    bench.add_argument("--prefix", type=int, default=500)
    bench.add_argument("--n", type=int, default=10)
    return parser


def main(argv=None, out=sys.stdout):
    args = build_parser().parse_args(argv)
    try:
        return args.run(args, out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntinyloop: interrupted", file=sys.stderr)
        return 130
