"""The `tinyloop` command line: `demo` (the main job), `generate`, `chat`, `serve`, `info`, `convert`, `bench`.

Exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input (argparse convention),
130 interrupted (Ctrl-C, also during a long prefill), 141 (128 + SIGPIPE) the reader of the output
went away (`tinyloop info | head`), quietly, as command-line tools do. Every argument is checked before any
output: a flag's value by its argparse type (the message names the flag), what depends on the
model (token ids, lengths) right after the model opens and before the prompt is echoed.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO

import numpy as np

from . import Model
from . import params as P
from ._version import __version__
from .backends import BACKENDS, DEVICES, backend_features, backend_info
from .chat import Chat
from .config import ModelConfig
from .engine import EXIT_RULES
from .bundled import demo_model_path
from .demo import run_demo
from .engine import PREFIX_STORAGES
from .hf import convert
from .model import DEFAULT_PREFIX_CACHE_BYTES, KV_MODES
from .modelfile import read_meta
from .quickbench import SHAPES, bench_model, describe, shared_prefix, speed
from .scheduler import DEFAULT_MAX_QUEUE
from .tokenizer import TextStream

PROGRESS_CHUNK = 256       # prompt tokens per chunk when a progress display is on
PROGRESS_MIN_TOKENS = 1024  # "auto" shows progress for prompts at least this long
INTEGER = re.compile(r"-?[0-9]+")  # how a count or a token id is written


class PrefillProgress:
    """An on_prefill callback printing "prefill done/total tokens" on stderr: rewritten in
    place on a terminal, one line per chunk otherwise (--progress always)."""

    def __init__(self, mode: str, n_prompt: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = mode == "always" or (mode == "auto" and self.tty and n_prompt >= PROGRESS_MIN_TOKENS)

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            end = "\r\033[K" if done == total else ""
            print(f"\rprefill {done}/{total} tokens", end=end, file=self.stream, flush=True)
        else:
            print(f"prefill {done}/{total} tokens", file=self.stream, flush=True)


# -- argument types: each turns a flag's text into its value or says why it cannot ---------
def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a decimal integer in [minimum, maximum]."""
    rule = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"

    def parse(text: str) -> int:
        if not INTEGER.fullmatch(text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give one {rule}")
        value = int(text)
        try:
            return P.check_int("value", value, minimum, maximum)                # the API's rule
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {value}") from None
    return parse


def real(lower: float, lower_inclusive: bool = True,
         upper: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number above `lower` (or equal when inclusive), <= upper."""
    rule = f"{'>=' if lower_inclusive else '>'} {lower:g}" + (
        f" and <= {upper:g}" if math.isfinite(upper) else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {rule}") from None
        try:
            return P.check_real("value", value, lower, lower_inclusive, upper)   # the API's rule
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}, got {text}") from None
    return parse


def model_file(text: str) -> str:
    """An argparse type: the path of an existing file (its contents are checked on open)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory, not a .tinyloop file" if os.path.isdir(text)
            else f"no such file: {text!r}")
    return text


def token_ids(what: str, text: str) -> list[int]:
    """Token ids written as integers separated by commas and/or whitespace."""
    ids = text.replace(",", " ").split()
    for piece in ids:
        if not INTEGER.fullmatch(piece):
            raise ValueError(f"{what}: {piece!r} is not a token id; give integers separated by "
                             f"commas or spaces")
    return [int(piece) for piece in ids]


# -- the commands ---------------------------------------------------------------------------
def _open(args: argparse.Namespace, **kwargs: Any) -> Model:
    return Model(args.model, backend=args.backend, threads=args.threads, device=args.device,
                 kv_mode=args.kv_mode, **kwargs)


def run_generate(args: argparse.Namespace, out: TextIO) -> int:
    """Stream the continuation as it is sampled, then one stats line on stderr (and one for
    self-speculative decoding with --draft-loops, one for adaptive depth with --exit)."""
    with _open(args) as model:
        cfg = model.config()
        is_text = cfg["tokenizer"] != "none" and not args.ids
        text = sys.stdin.read() if args.prompt == "-" else args.prompt

        def read(what: str, value: str, add_special_tokens: bool) -> np.ndarray:
            tokens = (model.encode(value, add_special_tokens) if is_text
                      else token_ids(what, value))
            return P.check_tokens(what, tokens, cfg["vocab_size"])

        prompt = read("the prompt", text, True)
        stops = [read(f"--stop {stop!r}", stop, False) for stop in args.stop]
        if len(prompt) + args.max_tokens > cfg["max_seq_len"]:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus --max-tokens {args.max_tokens} "
                             f"exceeds the model's max_seq_len {cfg['max_seq_len']}")
        stream = TextStream(functools.partial(model.decode, skip_special_tokens=True), prompt)
        first: list[float] = []

        def show(token: int) -> None:
            # The prompt is echoed with the first token, after the prefill: an in-place progress
            # line on the same terminal would otherwise overwrite its last line.
            if not first:
                first.append(time.perf_counter())
                if is_text:
                    print(text, end="", file=out)
            piece = stream.push(token) if is_text else f"{token} "
            print(piece, end="", file=out, flush=True)

        progress = PrefillProgress(args.progress, len(prompt))
        hits_before = model.cache_stats()["hit_tokens"]
        drafts: dict[str, float] = {}
        depths: dict[str, float] = {}
        start = time.perf_counter()
        try:
            result = model.generate(
                prompt, max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                cache_window=args.cache_window, stop_sequences=stops, seed=args.seed, on_token=show,
                on_prefill=progress if progress.enabled else None,
                prefill_chunk=PROGRESS_CHUNK if progress.enabled else None,
                draft_loops=args.draft_loops, n_draft=args.n_draft, draft_stats=drafts,
                exit_rule=args.exit, exit_threshold=args.exit_threshold,
                min_loops=args.min_loops, depth_stats=depths,
                instruction_length=len(prompt) if args.prefix_lm else 0)
        finally:
            if first:                        # ends the streamed line, also before an error
                print(stream.flush() if is_text else "", file=out, flush=True)
        end = time.perf_counter()
        n_new = len(result) - len(prompt)
        prefill = len(prompt) / max(first[0] - start, 1e-9) if first else float("nan")
        decode = (n_new - 1) / max(end - first[0], 1e-9) if n_new > 1 else float("nan")
        print(f"[backend {model.backend}, prompt {len(prompt)} tokens, "
              f"reused {model.cache_stats()['hit_tokens'] - hits_before}, "
              f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s]", file=sys.stderr)
        if args.draft_loops is not None:
            print(f"[draft loops {args.draft_loops}: drafted {drafts['drafted']}, accepted "
                  f"{drafts['accepted']}, acceptance rate {drafts['acceptance_rate']:.2f}]",
                  file=sys.stderr)
        if args.exit is not None:
            print(f"[exit rule {args.exit}: {depths['mean_loops']:.2f} loops per decoded token "
                  f"of {cfg['default_loops'] if args.loops is None else args.loops}]",
                  file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace, out: TextIO) -> int:
    """A user message per stdin line, the reply streamed to `out`, one line per turn on stderr
    saying how much of the prompt the prefix cache served; /exit or end of input ends it."""
    with _open(args) as model:
        chat = Chat(model, system=args.system, max_tokens=args.max_tokens, loops=args.loops,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty, cache_window=args.cache_window,
                    seed=args.seed)
        interactive = sys.stdin.isatty()
        for n in itertools.count(1):
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                break
            try:
                turn = chat.send(line.rstrip("\r\n"),
                                 on_text=lambda piece: print(piece, end="", file=out, flush=True))
            finally:
                print(file=out, flush=True)  # ends the streamed reply, also before an error
            print(f"[turn {n}: prompt {turn.prompt_tokens} tokens, {turn.cached_tokens} from the "
                  f"cache, {turn.prefilled_tokens} prefilled; {turn.new_tokens} new tokens]",
                  file=sys.stderr, flush=True)
    return 0


def run_serve(args: argparse.Namespace, out: TextIO) -> int:
    """The OpenAI-compatible server (docs/serving.md) until Ctrl-C; uvicorn logs on stderr."""
    if args.step_tokens < args.max_batch:        # the Scheduler's rule, checked before serving
        raise ValueError(f"--step-tokens {args.step_tokens} is less than --max-batch "
                         f"{args.max_batch}: every running request decodes a token per step")
    if args.prefix_cache_dir is not None and not args.prefix_cache_bytes:     # Model's rule
        raise ValueError("--prefix-cache-dir needs --prefix-cache-bytes > 0")
    try:
        import uvicorn

        from .serve import create_app
    except ImportError as exc:
        raise RuntimeError(f"tinyloop serve needs the serve extra ({exc.name} is missing): "
                           "pip install 'tinyloop[serve]'") from None
    app = create_app(args.model, model_name=args.model_name, max_batch=args.max_batch,
                     step_tokens=args.step_tokens, kv_budget_bytes=args.kv_budget,
                     max_queue=args.max_queue,
                     prefix_cache_bytes=args.prefix_cache_bytes, backend=args.backend,
                     threads=args.threads, device=args.device, kv_mode=args.kv_mode,
                     prefix_cache_dir=args.prefix_cache_dir,
                     prefix_cache_disk_bytes=args.prefix_cache_disk_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def architecture_lines(cfg: Mapping[str, Any],
                       meta: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """(label, text) lines saying what a model is (docs/spec.md §1), from Model.config() and
    the file's meta.* texts."""
    config = ModelConfig(**cfg)
    L = config.default_loops
    yield "architecture", meta.get("meta.architecture", "not recorded (made by TinyLoop)")
    core = f"core {config.n_core_blocks}"
    if config.core_cycles:      # a two-state core (§1): its low stack C times, then its high one
        core = (f"core of two stacks of {config.n_core_blocks // 2} ({config.core_cycles} low "
                f"cycles, then the high stack)")
    yield "layers", (f"prelude {config.n_pre_blocks}, {core} x {L} loops, "
                     f"coda {config.n_coda_blocks}: {config.n_layers(L)} cache layers at depth {L}")
    yield "blocks", (f"{config.block_layout} norms, {'q/k/v bias' if config.qkv_bias else 'no bias'}"
                     f", {config.n_heads} heads x {config.head_dim}, {config.n_kv_heads} kv heads"
                     f"{', attention gate' if config.attn_gate else ''}"
                     + (f", loop attention (window {config.loop_window})" if config.loop_window
                        else ""))
    yield "activations", (f"int8 in blocks of {config.act_block} (integer multipliers of one "
                          "row scale)" if config.act_block else "int8, one scale per row")
    yield "iterations", ", ".join([
        "injection adapter" if config.injection else "no injection",
        "step norm" if config.step_norm else "no step norm",
        "coda norm" if config.coda_norm else "no coda norm",
        f"embed scale {config.embed_scale:g}"])
    try:
        template = "chat_template" in json.loads(meta.get("meta.tokenizer_config", "{}"))
    except ValueError:
        template = False
    yield "tokenizer", config.tokenizer + (", chat template" if template else "")


def run_info(args: argparse.Namespace, out: TextIO) -> int:
    info = backend_info(args.backend, args.device)
    with _open(args) as model:
        for key, value in model.config().items():
            print(f"{key:>16}: {value}", file=out)
        meta = read_meta(args.model or demo_model_path())
        for label, text in architecture_lines(model.config(), meta):
            print(f"{label:>16}: {text}", file=out)
        runtime = model.runtime()
        threads = f"{runtime['threads']} thread{'s' if runtime['threads'] != 1 else ''}"
        print(f"{'runtime':>16}: {runtime['isa']} kernels, {threads}, "
              f"{runtime['kv_mode']} KV in blocks of {runtime['kv_block_size']}", file=out)
        print(f"{'device':>16}: {runtime['device_name']}", file=out)
    print(f"{'backend':>16}: {info['chosen']} ({info['reason'] or 'requested'})", file=out)
    library = f"{info['library']} {info['library_version']}" if info["library"] else "none"
    print(f"{'library':>16}: {library}", file=out)
    forced = os.environ.get("TINYLOOP_ISA")
    print(f"{'cpu isas':>16}: {', '.join(info['isas']) or 'none'}"
          + (f" (TINYLOOP_ISA={forced} forces the native path)" if forced else ""), file=out)
    print(f"{'cuda':>16}: " + ("available" if info["cuda_available"] else info["cuda_reason"]), file=out)
    print(f"{'features':>16}: {', '.join(sorted(backend_features()))}", file=out)
    return 0


def run_convert(args: argparse.Namespace, out: TextIO) -> int:
    """Convert a Hugging Face folder, a progress line per weight on stderr (rewritten in place
    on a terminal), then one line naming what was written."""
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, what: str) -> None:
        line = f"convert {done}/{total}: {what}"
        if tty:
            print(f"\r\033[K{line}", end="\r\033[K" if done == total else "", file=sys.stderr,
                  flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    config = convert(args.src, args.out, args.format, loops=args.loops, core=args.core,
                     max_seq_len=args.max_seq_len, group_size=args.group_size, progress=progress,
                     gptq=args.gptq, calibration=args.calibration, act_block=args.act_block)
    print(f"wrote {args.out}: {config.name}, {config.weight_format}, prelude "
          f"{config.n_pre_blocks} + core {config.n_core_blocks} x {config.default_loops} + coda "
          f"{config.n_coda_blocks}, vocab {config.vocab_size}, tokenizer {config.tokenizer}",
          file=out)
    return 0


def layer_span(text: str) -> tuple[int, int]:
    """An argparse type: START:END, two layer numbers."""
    start, sep, end = text.partition(":")
    if not sep or not INTEGER.fullmatch(start.strip()) or not INTEGER.fullmatch(end.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END (two layer numbers)")
    return int(start), int(end)


def run_bench(args: argparse.Namespace, out: TextIO) -> int:
    """Prefill/decode speed and the shared-prefix table on one model (bench/ has the full
    suite); the model first, a line per stage on stderr while it runs."""
    def stage(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    def check_lengths(max_seq_len: int) -> None:
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
                   device=args.device, kv_mode=args.kv_mode) as model:
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


def build_parser() -> argparse.ArgumentParser:
    """The parser; every option's help ends with its default."""
    parser = argparse.ArgumentParser(
        prog="tinyloop", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input, "
               "130 interrupted; `tinyloop COMMAND --help` lists a command's flags")
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name: str, run: Callable[[argparse.Namespace, TextIO], int], help: str,
                model_default: str = "the bundled demo model",
                positional: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        model_help = f"a .tinyloop file (default: {model_default})"
        if positional:        # `tinyloop serve MODEL`: the model is what the command is about
            p.add_argument("model", nargs="?", type=model_file, default=None, help=model_help)
        else:
            p.add_argument("--model", type=model_file, default=None, help=model_help)
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
        p.add_argument("--kv-mode", default=None, choices=KV_MODES,
                       help="how the KV cache stores keys and values: int8, or int4 at about "
                            "half the bytes (default: int4 when TINYLOOP_KV_INT4 is set, else "
                            "int8)")
        p.set_defaults(run=run)
        return p

    demo = command("demo", lambda a, out: run_demo(
        lambda budget: _open(a, prefix_cache_bytes=budget, prefix_storage=a.prefix_storage),
        a.max_tokens, a.temperature, a.seed, out),
                   "shared-prefix requests with and without prefix caching")
    demo.add_argument("--max-tokens", type=integer(1), default=80,
                      help="tokens each answer has at most (default: %(default)s)")
    demo.add_argument("--temperature", type=real(0.0), default=0.5,
                      help="sampling temperature, 0 = greedy (default: %(default)s)")
    demo.add_argument("--seed", type=integer(0, (1 << 64) - 1), default=1,
                      help="the sampling seed of every request (default: %(default)s)")
    demo.add_argument("--prefix-storage", default=None, choices=PREFIX_STORAGES,
                      help="what the explicit PrefixCache keeps: its KV, or each layer's input "
                           "row, int8 (h8, the same tokens) or int4 (h4, an approximation) "
                           "(default: kv, or TINYLOOP_KV_H_MODE's)")

    def sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
        p.add_argument("--max-tokens", type=integer(1), default=max_tokens,
                       help="tokens to emit at most (default: %(default)s)")
        p.add_argument("--loops", type=integer(1, P.MAX_LOOPS), default=None,
                       help="loop-block depth (default: the model's default_loops)")
        p.add_argument("--temperature", type=real(0.0), default=0.7,
                       help="sampling temperature, 0 = greedy (default: %(default)s)")
        p.add_argument("--top-k", type=integer(0), default=50,
                       help="sample among the k most likely tokens, 0 = off (default: %(default)s)")
        p.add_argument("--top-p", type=real(0.0, False, 1.0), default=1.0,
                       help="nucleus sampling mass in (0, 1], 1 = off (default: %(default)s)")
        p.add_argument("--repetition-penalty", type=real(0.0, False), default=1.0,
                       help="> 0; penalizes tokens already in the sequence, 1 = off "
                            "(default: %(default)s)")
        p.add_argument("--cache-window", type=integer(0), default=0,
                       help="sliding attention window in tokens, 0 = the whole context "
                            "(default: %(default)s)")
        p.add_argument("--seed", type=integer(0, (1 << 64) - 1), default=None,
                       help="the sampling seed (default: a fresh random one)")

    gen = command("generate", run_generate, "generate text (or token ids) from a prompt")
    gen.add_argument("prompt", help="text, token ids with --ids, or - to read it from stdin")
    gen.add_argument("--ids", action="store_true",
                     help="the prompt and --stop are token ids: integers separated by commas or "
                          "spaces (default: text, for a model with a tokenizer)")
    sampling(gen, max_tokens=64)
    gen.add_argument("--prefix-lm", action="store_true",
                     help="run the whole prompt as an instruction block, its tokens attending to "
                          "each other both ways (prefix-LM models such as HRM-Text: "
                          "token_type_ids 1 on the prompt) (default: causal)")
    gen.add_argument("--stop", action="append", default=[],
                     help="stop once the output ends with this text (token ids with --ids); "
                          "repeatable (default: none)")
    gen.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                     help=f"prefill progress on stderr; auto: on a terminal, for prompts of "
                          f"{PROGRESS_MIN_TOKENS}+ tokens (default: %(default)s)")
    gen.add_argument("--draft-loops", type=integer(1, P.MAX_LOOPS), default=None,
                     help="self-speculative decoding: draft tokens at this depth (1 .. loops-1) "
                          "and verify them at --loops, with exactly the tokens of plain "
                          "decoding; the acceptance rate goes to stderr (default: off)")
    gen.add_argument("--n-draft", type=integer(0, P.MAX_DRAFT), default=None,
                     help=f"tokens drafted per round with --draft-loops, 0 = plain decoding "
                          f"(default: {P.DEFAULT_N_DRAFT} with --draft-loops)")

    gen.add_argument("--exit", choices=[r for r in EXIT_RULES if r != "none"], default=None,
                     help="adaptive depth: each decoded token stops after the first core "
                          "iteration where this rule fires (gate: the model's exit gate; latent: "
                          "the state's relative change; kl: successive output distributions' "
                          "divergence; argmax: the same top token for N more iterations); the "
                          "mean loops per token go to stderr (default: off, every token runs "
                          "--loops)")
    gen.add_argument("--exit-threshold", type=real(0.0, False), default=None,
                     help="the rule's threshold (default: the model's for gate, 0.03 for "
                          "latent, 0.001 for kl, 5 for argmax)")
    gen.add_argument("--min-loops", type=integer(1, P.MAX_LOOPS), default=None,
                     help="iterations every decoded token runs at least with --exit (default: 1)")

    chat = command("chat", run_chat, "a conversation with a chat model: a message per line "
                   "on stdin, /exit or end of input ends it")
    chat.add_argument("--system", default=None,
                      help="the system message that starts the conversation (default: none)")
    sampling(chat, max_tokens=256)

    serve = command("serve", run_serve, "an OpenAI-compatible HTTP server with continuous "
                    "batching (docs/serving.md)", positional=True)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on; 0.0.0.0 for every interface "
                            "(default: %(default)s)")
    serve.add_argument("--port", type=integer(1, 65535), default=8000,
                       help="the TCP port (default: %(default)s)")
    serve.add_argument("--model-name", default=None,
                       help="the model id requests name (default: the model's name, else its "
                            "file name)")
    serve.add_argument("--max-batch", type=integer(1), default=32,
                       help="requests running at once (default: %(default)s)")
    serve.add_argument("--step-tokens", type=integer(1), default=512,
                       help="positions one scheduler step computes at most, >= --max-batch "
                            "(default: %(default)s)")
    serve.add_argument("--max-queue", type=integer(0), default=DEFAULT_MAX_QUEUE,
                       help="requests that may wait beyond --max-batch running; more are answered "
                            "429 with Retry-After (default: %(default)s)")
    serve.add_argument("--kv-budget", type=integer(0), default=0,
                       help="KV bytes the running requests may hold; beyond it the newest is "
                            "preempted and recomputed later, 0 = no limit (default: %(default)s)")
    serve.add_argument("--prefix-cache-bytes", type=integer(0), default=DEFAULT_PREFIX_CACHE_BYTES,
                       help="budget of the automatic prefix cache, 0 = off "
                            "(default: %(default)s)")
    serve.add_argument("--prefix-cache-dir", default=None,
                       help="back the prefix cache with block files in this directory (created "
                            "if missing): evicted blocks and, at shutdown, every cached one are "
                            "written there, so a server restarted on it starts warm")
    serve.add_argument("--prefix-cache-disk-bytes", type=integer(0), default=0,
                       help="budget of the files in --prefix-cache-dir, 0 = no limit "
                            "(default: %(default)s)")

    command("info", run_info, "model configuration, architecture and the backend chosen")

    conv = sub.add_parser("convert", help="convert a Hugging Face model folder to a .tinyloop "
                          "file (docs/models.md)",
                          description="convert a Hugging Face model folder (config.json, "
                          "*.safetensors, tokenizer files) to a .tinyloop file")
    conv.add_argument("src", help="the Hugging Face model folder")
    conv.add_argument("out", help="the .tinyloop file to write")
    conv.add_argument("--format", default="int8", choices=["int8", "int4"],
                      help="weight format (default: %(default)s)")
    conv.add_argument("--group-size", type=integer(2), default=None,
                      help="int4 weights per multiplier, even, dividing every input width "
                           "(default: 32 for int4)")
    conv.add_argument("--act-block", type=integer(0, 2**16), default=None, metavar="B",
                      help="activations in blocks of B, integer multipliers of one row scale "
                           "(docs/spec.md §2.2.1; B divides every input width); 0: one scale "
                           "per row (default: 32 for Ouro where 32 divides every width, else 0)")
    conv.add_argument("--loops", type=integer(1, P.MAX_LOOPS), default=None,
                      help="the default depth L (default: the checkpoint's; 1 for a plain "
                           "LLaMA-family model)")
    conv.add_argument("--core", type=layer_span, default=None, metavar="START:END",
                      help="LLaMA family: loop layers START..END-1, the layers before are the "
                           "prelude, those after the coda (default: all layers are the core)")
    conv.add_argument("--max-seq-len", type=integer(1), default=None,
                      help="positions (default: the checkpoint's max_position_embeddings)")
    conv.add_argument("--gptq", action="store_true",
                      help="int4: quantize by GPTQ, calibrated on a text, docs/models.md "
                           "(default: round-to-nearest)")
    conv.add_argument("--calibration", default=None, metavar="FILE",
                      help="with --gptq: the UTF-8 calibration text (default: a few KB of "
                           "English prose shipped with tinyloop)")
    conv.set_defaults(run=run_convert)

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


def _quiet_after_closed_pipe() -> int:
    """The reader of stdout went away: point stdout at /dev/null so that the flush at exit
    cannot raise again, and return the exit code a process killed by SIGPIPE reports."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # stdout is no file descriptor (an embedding host's)
        pass
    return 128 + 13   # 128 + SIGPIPE


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    try:
        args = build_parser().parse_args(argv)
        status: int = args.run(args, out)
        out.flush()     # a closed pipe is reported here, not by the interpreter at exit
        return status
    except BrokenPipeError:
        if out is not sys.stdout:        # not our reader: someone else's pipe broke
            raise
        return _quiet_after_closed_pipe()
    except (ValueError, FileNotFoundError) as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntinyloop: interrupted", file=sys.stderr)
        return 130
