"""The `tinyloop` command line: `demo` (the main job), `generate` and `info`.

Exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input (argparse convention).
"""
import argparse
import codecs
import sys
import time

from . import Model
from ._version import __version__
from .backends import backend_features, backend_info

SYSTEM_PROMPT = ("In the beginning God created the heaven and the earth. And the earth was "
                 "without form, and void; and darkness was upon the face of the deep.\n")
REQUESTS = ("And God said", "And the LORD spake unto Moses, saying,", "Blessed are they",
            "And Jesus answered and said")


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_demo(args, out):
    """A shared system prompt and several requests, without and with the prefix cache."""
    with Model(args.model, backend=args.backend, threads=args.threads) as model:
        cfg = model.config()
        print(f"model {cfg['name']}: d_model {cfg['d_model']}, {cfg['n_pre_blocks']} pre block(s) "
              f"+ loop block x {cfg['default_loops']}, backend {model.backend}\n", file=out)
        system = model.encode(SYSTEM_PROMPT)
        requests = [model.encode(" " + r if i else r) for i, r in enumerate(REQUESTS)]
        kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        plain, t_plain = _timed(lambda: [model.generate(system + r, **kw) for r in requests])
        prefix, t_build = _timed(lambda: model.build_prefix_cache(system))
        cached, t_cached = _timed(lambda: [model.generate_from_prefix_cache(prefix, suffix=r, **kw)
                                           for r in requests])
        for r, tokens in zip(requests, cached):
            print(f"> {model.decode(r).strip()}{model.decode(tokens[len(system) + len(r):])}\n",
                  file=out)
        reused = len(system) * len(requests)
        total = t_build + t_cached
        print(f"{'run':<24}{'seconds':>9}  prefilled tokens", file=out)
        print(f"{'without prefix cache':<24}{t_plain:>9.3f}  {sum(len(system) + len(r) for r in requests)}",
              file=out)
        print(f"{'with prefix cache':<24}{total:>9.3f}  {len(system) + sum(map(len, requests))}"
              f"   (prefix built once in {t_build:.3f} s)", file=out)
        print(f"speedup {t_plain / total:.2f}x; {reused} prompt tokens reused from one "
              f"{len(system)}-token prefix ({prefix.nbytes} bytes of KV)", file=out)
        same = cached == plain
        print(f"identical tokens with and without the cache: {'yes' if same else 'NO'}", file=out)
        return 0 if same else 1


def run_generate(args, out):
    """Stream the continuation as it is sampled, then one stats line on stderr."""
    with Model(args.model, backend=args.backend, threads=args.threads) as model:
        is_text = model.config()["tokenizer"] == "bytes" and not args.ids
        prompt = model.encode(args.prompt) if is_text else [int(t) for t in args.prompt.split(",")]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = []

        def show(token):
            if not first:
                first.append(time.perf_counter())
            piece = decoder.decode(bytes([token])) if is_text else f"{token} "
            print(piece, end="", file=out, flush=True)

        if is_text:
            print(args.prompt, end="", file=out)
        start = time.perf_counter()
        result = model.generate(
            prompt, max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
            seed=args.seed, on_token=show)
        end = time.perf_counter()
        print(file=out)
        n_new = len(result) - len(prompt)
        prefill = len(prompt) / max(first[0] - start, 1e-9)
        decode = (n_new - 1) / max(end - first[0], 1e-9) if n_new > 1 else float("nan")
        print(f"[backend {model.backend}, prompt {len(prompt)} tokens, reused 0, "
              f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s]", file=sys.stderr)
    return 0


def run_info(args, out):
    info = backend_info(args.backend)
    with Model(args.model, backend=args.backend, threads=args.threads) as model:
        for key, value in model.config().items():
            print(f"{key:>16}: {value}", file=out)
        if model.backend == "native":
            runtime = model._engine.runtime()
            print(f"{'runtime':>16}: {runtime['isa']} kernels, {runtime['threads']} threads, "
                  f"KV blocks of {runtime['kv_block_size']}", file=out)
    print(f"{'backend':>16}: {info['chosen']} ({info['reason'] or 'requested'})", file=out)
    print(f"{'library':>16}: {info['library']} {info['library_version'] or ''}", file=out)
    print(f"{'features':>16}: {', '.join(sorted(backend_features()))}", file=out)
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="tinyloop", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, run, help):
        p = sub.add_parser(name, help=help)
        p.add_argument("--model", default=None, help="a .tinyloop file (default: the demo model)")
        p.add_argument("--backend", default="auto")
        p.add_argument("--threads", type=int, default=None)
        p.set_defaults(run=run)
        return p

    demo = command("demo", run_demo, "shared-prefix requests with and without prefix caching")
    demo.add_argument("--max-tokens", type=int, default=60)
    demo.add_argument("--temperature", type=float, default=0.7)
    demo.add_argument("--seed", type=int, default=1)
    gen = command("generate", run_generate, "generate text (or token ids) from a prompt")
    gen.add_argument("prompt", help="text, or comma-separated token ids with --ids")
    gen.add_argument("--ids", action="store_true", help="the prompt is token ids")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--loops", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    command("info", run_info, "model configuration and the backend chosen")
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
        print("tinyloop: interrupted", file=sys.stderr)
        return 130
