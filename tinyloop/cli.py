"""The `tinyloop` command line: `demo` (the main job) and `generate`.

Exit codes: 0 success, 1 a runtime failure, 2 bad arguments or input (argparse convention).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

from . import Model, random_model
from ._version import __version__

DEMO_SHAPE = dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                  ffn_dim=352, n_pre_blocks=1, default_loops=4, max_seq_len=512,
                  name="random-demo")


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_demo(args, out):
    """A shared prefix and several requests, without and with the prefix cache."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "demo.tinyloop"
        random_model(path, seed=args.seed, **DEMO_SHAPE)
        with Model(path, backend=args.backend) as model:
            shared = [(7 * i + 3) % 512 for i in range(args.prefix_tokens)]
            requests = [[100 + r, 200 + r, 300 + r] for r in range(args.requests)]
            print(f"model: random looped model d_model={DEMO_SHAPE['d_model']}, "
                  f"loops={DEMO_SHAPE['default_loops']}, backend={model.backend}", file=out)
            plain, t_plain = _timed(lambda: [model.generate(shared + r, max_tokens=args.max_tokens)
                                             for r in requests])
            prefix, t_build = _timed(lambda: model.build_prefix_cache(shared))
            cached, t_cached = _timed(lambda: [model.generate_from_prefix_cache(
                prefix, suffix=r, max_tokens=args.max_tokens) for r in requests])
            for r, tokens in zip(requests, cached):
                print(f"request {r}: {tokens[len(shared) + len(r):]}", file=out)
            total = t_build + t_cached
            print(f"\n{'run':<22}{'seconds':>10}", file=out)
            print(f"{'without prefix cache':<22}{t_plain:>10.3f}", file=out)
            print(f"{'with prefix cache':<22}{total:>10.3f}   (build {t_build:.3f})", file=out)
            print(f"speedup {t_plain / total:.2f}x, prefix {len(shared)} tokens reused "
                  f"{len(requests)} times, {prefix.nbytes} bytes of KV", file=out)
            same = cached == plain
            print(f"identical tokens with and without the cache: {same}", file=out)
            return 0 if same else 1


def run_generate(args, out):
    tokens = [int(t) for t in args.tokens.split(",")]
    with Model(args.model, backend=args.backend) as model:
        result = model.generate(tokens, max_tokens=args.max_tokens, loops=args.loops,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed)
    print(" ".join(map(str, result[len(tokens):])), file=out)
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="tinyloop", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shared-prefix requests with and without prefix caching")
    demo.add_argument("--backend", default="auto")
    demo.add_argument("--prefix-tokens", type=int, default=192)
    demo.add_argument("--requests", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=run_demo)
    gen = sub.add_parser("generate", help="generate token ids from a model file")
    gen.add_argument("model")
    gen.add_argument("tokens", help="comma-separated prompt token ids")
    gen.add_argument("--backend", default="auto")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--loops", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(run=run_generate)
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
