"""The `tinyloop` command line: `demo` (the main job), `generate`, `info` and `bench`.

Exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input (argparse convention),
130 interrupted (Ctrl-C, also during a long prefill). Every argument is checked before any
output: a flag's value by its argparse type (the message names the flag), what depends on the
model (token ids, lengths) right after the model opens and before the prompt is echoed.
"""
import argparse
import codecs
import math
import os
import re
import sys
import tempfile
import time

import numpy as np

from . import Model
from . import params as P
from ._version import __version__
from .backends import BACKENDS, DEVICES, backend_features, backend_info
from .demo import run_demo
from .quickbench import SHAPES, bench_model, describe, shared_prefix, speed

PROGRESS_CHUNK = 256       # prompt tokens per chunk when a progress display is on
PROGRESS_MIN_TOKENS = 1024  # "auto" shows progress for prompts at least this long
INTEGER = re.compile(r"-?[0-9]+")  # how a count or a token id is written


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


# -- argument types: each turns a flag's text into its value or says why it cannot ---------
def integer(minimum, maximum=None):
    """An argparse type: a decimal integer in [minimum, maximum]."""
    rule = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"

    def parse(text):
        if not INTEGER.fullmatch(text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give one {rule}")
        value = int(text)
        try:
            return P.check_int("value", value, minimum, maximum)                # the API's rule
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {value}") from None
    return parse


def real(lower, lower_inclusive=True, upper=math.inf):
    """An argparse type: a finite number above `lower` (or equal when inclusive), <= upper."""
    rule = f"{'>=' if lower_inclusive else '>'} {lower:g}" + (
        f" and <= {upper:g}" if math.isfinite(upper) else "")

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {rule}") from None
        try:
            return P.check_real("value", value, lower, lower_inclusive, upper)   # the API's rule
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}, got {text}") from None
    return parse


def model_file(text):
    """An argparse type: the path of an existing file (its contents are checked on open)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory, not a .tinyloop file" if os.path.isdir(text)
            else f"no such file: {text!r}")
    return text


def token_ids(what, text):
    """Token ids written as integers separated by commas and/or whitespace."""
    ids = text.replace(",", " ").split()
    for piece in ids:
        if not INTEGER.fullmatch(piece):
            raise ValueError(f"{what}: {piece!r} is not a token id; give integers separated by "
                             f"commas or spaces")
    return [int(piece) for piece in ids]


# -- the commands ---------------------------------------------------------------------------
def _open(args, **kwargs):
    return Model(args.model, backend=args.backend, threads=args.threads, device=args.device, **kwargs)


def run_generate(args, out):
    """Stream the continuation as it is sampled, then one stats line on stderr."""
    with _open(args) as model:
        cfg = model.config()
        is_text = cfg["tokenizer"] == "bytes" and not args.ids
        text = sys.stdin.read() if args.prompt == "-" else args.prompt

        def read(what, value):
            tokens = model.encode(value) if is_text else token_ids(what, value)
            return P.check_tokens(what, tokens, cfg["vocab_size"])

        prompt = read("the prompt", text)
        stops = [read(f"--stop {stop!r}", stop) for stop in args.stop]
        if len(prompt) + args.max_tokens > cfg["max_seq_len"]:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus --max-tokens {args.max_tokens} "
                             f"exceeds the model's max_seq_len {cfg['max_seq_len']}")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = []

        def show(token):
            # The prompt is echoed with the first token, after the prefill: an in-place progress
            # line on the same terminal would otherwise overwrite its last line.
            if not first:
                first.append(time.perf_counter())
                if is_text:
                    print(text, end="", file=out)
            piece = decoder.decode(bytes([token])) if is_text else f"{token} "
            print(piece, end="", file=out, flush=True)

        progress = PrefillProgress(args.progress, len(prompt))
        hits_before = model.cache_stats()["hit_tokens"]
        start = time.perf_counter()
        try:
            result = model.generate(
                prompt, max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                cache_window=args.cache_window, stop_sequences=stops, seed=args.seed, on_token=show,
                on_prefill=progress if progress.enabled else None,
                prefill_chunk=PROGRESS_CHUNK if progress.enabled else None)
        finally:
            if first:
                print(file=out, flush=True)  # ends the streamed line, also before an error
        end = time.perf_counter()
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
        runtime = model.runtime()
        threads = f"{runtime['threads']} thread{'s' if runtime['threads'] != 1 else ''}"
        print(f"{'runtime':>16}: {runtime['isa']} kernels, {threads}, "
              f"KV blocks of {runtime['kv_block_size']}", file=out)
        print(f"{'device':>16}: {runtime['device_name']}", file=out)
    print(f"{'backend':>16}: {info['chosen']} ({info['reason'] or 'requested'})", file=out)
    library = f"{info['library']} {info['library_version']}" if info["library"] else "none"
    print(f"{'library':>16}: {library}", file=out)
    print(f"{'cuda':>16}: " + ("available" if info["cuda_available"] else info["cuda_reason"]), file=out)
    print(f"{'features':>16}: {', '.join(sorted(backend_features()))}", file=out)
    return 0


def run_bench(args, out):
    """Prefill/decode speed and the shared-prefix table on one model (bench/ has the full
    suite); the model first, a line per stage on stderr while it runs."""
    def stage(text):
        print(f"bench: {text}", file=sys.stderr, flush=True)

    def check_lengths(max_seq_len):
        for flag, n in (("--prefill", args.prefill), ("--prefix", args.prefix)):
            if n + args.decode > max_seq_len:
                raise ValueError(f"{flag} {n} plus --decode {args.decode} exceeds the model's "
                                 f"max_seq_len {max_seq_len}")

    if args.model is None:        # checked before the random model is written (seconds)
        check_lengths(SHAPES["quick"]["max_seq_len"])
    with tempfile.TemporaryDirectory() as directory:
        path = args.model or bench_model("quick", args.format, directory, progress=stage)
        stage(f"opening {path}")
        with Model(path, backend=args.backend, threads=args.threads, prefix_cache_bytes=0,
                   device=args.device) as model:
            cfg = model.config()
            check_lengths(cfg["max_seq_len"])
            source = path if args.model else "random weights, the quick shape"
            print(f"model {describe(cfg)} ({source}), backend {model.backend}", file=out, flush=True)
            _, prefill, decode = speed(model, args.prefill, args.decode, progress=stage)
            print(f"prefill {args.prefill} tokens {prefill:.0f} tok/s, decode {decode:.0f} tok/s",
                  file=out)
            prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], args.prefix).tolist()
            loops = min(8, cfg["default_loops"])
            row = shared_prefix(model, prompt, args.n, args.decode, loops, progress=stage)
    print(f"{args.n} requests sharing a {args.prefix}-token prompt, {args.decode} new tokens each:",
          file=out)
    for name in ("no_cache", "shared", "batched"):
        print(f"  {name:<9}{row[name + ' s']:>8.3f} s", file=out)
    print(f"  SHARED {row['shared x']:.2f}x (bound {row['bound x']:.2f}x), "
          f"BATCHED {row['batched x']:.2f}x; identical tokens: {'yes' if row['same tokens'] else 'NO'}",
          file=out)
    return 0 if row["same tokens"] else 1


def build_parser():
    """The parser; every option's help ends with its default."""
    parser = argparse.ArgumentParser(
        prog="tinyloop", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input, "
               "130 interrupted; `tinyloop COMMAND --help` lists a command's flags")
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name, run, help, model_default="the bundled demo model"):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--model", type=model_file, default=None,
                       help=f"a .tinyloop file (default: {model_default})")
        p.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="the engine that runs the model; auto: TINYLOOP_BACKEND when set, "
                            "else the native library when it loads, else numba, else numpy "
                            "(default: %(default)s)")
        p.add_argument("--threads", type=integer(1), default=None,
                       help="worker threads of the native and numba backends (default: all "
                            "cores)")
        p.add_argument("--device", default="auto", choices=DEVICES,
                       help="where the native backend runs; auto: the CPU for now "
                            "(default: %(default)s)")
        p.set_defaults(run=run)
        return p

    demo = command("demo", lambda a, out: run_demo(lambda budget: _open(a, prefix_cache_bytes=budget),
                                                   a.max_tokens, a.temperature, a.seed, out),
                   "shared-prefix requests with and without prefix caching")
    demo.add_argument("--max-tokens", type=integer(1), default=80,
                      help="tokens each answer has at most (default: %(default)s)")
    demo.add_argument("--temperature", type=real(0.0), default=0.5,
                      help="sampling temperature, 0 = greedy (default: %(default)s)")
    demo.add_argument("--seed", type=integer(0, (1 << 64) - 1), default=1,
                      help="the sampling seed of every request (default: %(default)s)")

    gen = command("generate", run_generate, "generate text (or token ids) from a prompt")
    gen.add_argument("prompt", help="text, token ids with --ids, or - to read it from stdin")
    gen.add_argument("--ids", action="store_true",
                     help="the prompt and --stop are token ids: integers separated by commas or "
                          "spaces (default: text, for a model with the byte tokenizer)")
    gen.add_argument("--max-tokens", type=integer(1), default=64,
                     help="tokens to emit at most (default: %(default)s)")
    gen.add_argument("--loops", type=integer(1, P.MAX_LOOPS), default=None,
                     help="loop-block depth (default: the model's default_loops)")
    gen.add_argument("--temperature", type=real(0.0), default=0.7,
                     help="sampling temperature, 0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=integer(0), default=50,
                     help="sample among the k most likely tokens, 0 = off (default: %(default)s)")
    gen.add_argument("--top-p", type=real(0.0, False, 1.0), default=1.0,
                     help="nucleus sampling mass in (0, 1], 1 = off (default: %(default)s)")
    gen.add_argument("--repetition-penalty", type=real(0.0, False), default=1.0,
                     help="> 0; penalizes tokens already in the sequence, 1 = off "
                          "(default: %(default)s)")
    gen.add_argument("--cache-window", type=integer(0), default=0,
                     help="sliding attention window in tokens, 0 = the whole context "
                          "(default: %(default)s)")
    gen.add_argument("--stop", action="append", default=[],
                     help="stop once the output ends with this text (token ids with --ids); "
                          "repeatable (default: none)")
    gen.add_argument("--seed", type=integer(0, (1 << 64) - 1), default=None,
                     help="the sampling seed (default: a fresh random one)")
    gen.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                     help=f"prefill progress on stderr; auto: on a terminal, for prompts of "
                          f"{PROGRESS_MIN_TOKENS}+ tokens (default: %(default)s)")

    command("info", run_info, "model configuration and the backend chosen")

    bench = command("bench", run_bench, "a quick speed run (bench/ has the full suite)",
                    model_default="a random model of the quick shape")
    bench.add_argument("--format", default="int8", choices=["int8", "int4"],
                       help="weight format of the random model, unused with --model "
                            "(default: %(default)s)")
    bench.add_argument("--prefill", type=integer(1), default=512,
                       help="prompt tokens of the prefill measurement (default: %(default)s)")
    bench.add_argument("--decode", type=integer(1), default=32,
                       help="tokens decoded per measurement and per request (default: %(default)s)")
    bench.add_argument("--prefix", type=integer(1), default=500,
                       help="tokens of the prompt the requests share (default: %(default)s)")
    bench.add_argument("--n", type=integer(1), default=10,
                       help="requests sharing the prompt (default: %(default)s)")
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
