"""What block activations (act_block, docs/spec.md §2.2.1) cost in speed, per kernel path.

    python bench/bench_act_block.py [--shape ouro-1.4b] [--layers 4] [--format int8|int4]
                                    [--block 32] [--isas avx2,avx512-vnni,amx] [--threads 2]
                                    [--repeats 3] [--prefill 256] [--decode 16] [--dir DIR]

One random file of a published shape (bench/bench_real_shapes.py's writer: quantized codes
straight, no float weights; --layers cuts the core) is written twice, identical but for the
header's act_block: 0 (one activation scale per row) and --block. For each kernel path
(TINYLOOP_ISA; default every one this CPU and libtinyloop have but scalar) both files stay
open and run tinyloop.quickbench.speed in alternating rounds, each figure the best of
--repeats, so a burst of load from other processes lands on both alike.

Columns: prefill tok/s (--prefill random tokens in one chunk) and decode tok/s (--decode
greedy steps after it) for each file, and their ratios block / row: what the finer scales cost
on that path. Results go to bench/results/act_block.{json,md}.
"""
import argparse
import dataclasses
import os
import sys
import tempfile

from bench_real_shapes import INT4_GROUP, SHAPES, random_quantized_tensors
from common import cpu_text, tinyloop_isas, tinyloop_model, write_results
from tinyloop.config import ModelConfig
from tinyloop.modelfile import save_model
from tinyloop.quickbench import speed


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="ouro-1.4b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4, help="core blocks (0: the published count)")
    p.add_argument("--format", default="int8", choices=["int8", "int4"])
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--isas", default="", help="comma-separated kernel paths (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--dir", default=None, help="where the two files go (default: a temporary "
                                               "folder, deleted afterwards)")
    return p.parse_args(argv)


def write_pair(folder, args):
    """(path with act_block 0, path with --block): the same tensors under both headers."""
    fields = dict(SHAPES[args.shape], max_seq_len=args.prefill + args.decode + 1,
                  weight_format=args.format,
                  group_size=INT4_GROUP if args.format == "int4" else 0, tied_head=False,
                  name=f"bench-{args.shape}")
    if args.layers:
        fields["n_core_blocks"] = 2 * args.layers if fields.get("core_cycles") else args.layers
    row = ModelConfig(**fields)
    tensors = random_quantized_tensors(row)
    paths = []
    for block in (0, args.block):
        config = dataclasses.replace(row, act_block=block)
        config.validate()
        paths.append(os.path.join(folder, f"act{block}.tinyloop"))
        save_model(paths[-1], config, tensors)
    return paths


def measure(paths, isa, args):
    """The row of one kernel path: both files' speeds, best of --repeats alternating rounds."""
    best = {block: [0.0, 0.0] for block in (0, args.block)}
    with tinyloop_model(paths[0], isa, args.threads) as row, \
            tinyloop_model(paths[1], isa, args.threads) as blocked:
        for _ in range(args.repeats):
            for block, model in ((0, row), (args.block, blocked)):
                _, prefill, decode = speed(model, args.prefill, args.decode)
                best[block] = [max(best[block][0], prefill), max(best[block][1], decode)]
        ran = row.runtime()["isa"]
    (p0, d0), (pb, db) = best[0], best[args.block]
    return {"isa": ran, "prefill tok/s (row)": p0, f"prefill tok/s (B={args.block})": pb,
            "prefill ratio": pb / p0, "decode tok/s (row)": d0,
            f"decode tok/s (B={args.block})": db, "decode ratio": db / d0}


def main(argv=None):
    args = parse_args(argv)
    folder = args.dir or tempfile.mkdtemp(prefix="bench-act-block-")
    paths = write_pair(folder, args)
    rows = [measure(paths, isa, args) for isa in tinyloop_isas(args.isas)]
    if args.dir is None:
        for path in paths:
            os.remove(path)
        os.rmdir(folder)
    columns = list(rows[0])
    notes = (f"{args.shape} with {args.layers or 'all'} core blocks, {args.format} weights, "
             f"act_block 0 vs {args.block}, {args.threads} threads, best of {args.repeats}; "
             f"prefill {args.prefill} tokens, decode {args.decode}. CPU: {cpu_text()}.")
    print(write_results("act_block", rows, columns, notes,
                        formats={c: ".2f" for c in columns if "ratio" in c}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
