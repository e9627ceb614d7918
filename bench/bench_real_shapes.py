"""Speed and memory on the published looped models' shapes, with random weights.

    python bench/bench_real_shapes.py [--shape ouro-1.4b|huginn-0125|nanbeige-3b|hrm-text-1b]
        [--layers N]
        [--format int8|int4] [--context 4096] [--prefix 1024] [--n 8] [--backend native]

A random file of the shape is written straight in its quantized form (random int8 / int4 codes
and scales sized so activations keep unit scale: no float weights, no clipping search, so a
3B-parameter file takes seconds and bounded memory). Then, on one model:

  speed   prefill tok/s (a 512-token prompt in one chunk) and decode tok/s (32 greedy tokens
          from it);
  prefix  the seed's table for N requests sharing one --prefix-token prompt (no cache vs one
          shared PrefixCache vs one batch of the N continuations; identical tokens checked);
  memory  RSS after loading, after one request of --context tokens (prefill, then 8 decoded;
          its KV is freed again when it returns) and the peak (VmHWM, reached while the request
          holds its KV), against the model's weight bytes plus its KV bytes per token x
          context: `peak / (weights + kv)` is the overhead.

Ouro-1.4B: d 2048, 24 layers x 4 passes (96 cache layers), MHA 16 x 128, ffn 5632, vocab 49152,
sandwich norms, step norm. Huginn-0125: d 5280, 2 prelude + 4 core x 32 + 2 coda blocks, MHA
55 x 96, ffn 17920, vocab 65536, post norms, injection, q/k biases. Nanbeige4.2-3B: d 3072, 22 layers x 2 loops, GQA 48/8 x 128,
ffn 10752, vocab 166144. HRM-Text-1B (transformers' HrmTextConfig defaults, documented for sapientinc/HRM-Text-1B):
d 1536, two stacks of 16 layers, 3 low cycles and 1 high per iteration x 2 iterations (128
cache layers), MHA 12 x 128 with the attention gate, ffn 4096, vocab 151808, weightless norms,
embedding x 50. --layers reduces the layers (of each stack, for HRM-Text) where time or disk
forbids the full model.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

import tinyloop
from common import write_results
from tinyloop.config import ModelConfig
from tinyloop.modelfile import save_model
from tinyloop.quantize import rope_tables
from tinyloop.quickbench import backend_kwargs, shared_prefix, speed

SHAPES = {
    "ouro-1.4b": dict(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128,
                      ffn_dim=5632, n_pre_blocks=0, n_core_blocks=24, default_loops=4,
                      block_layout="sandwich", step_norm=True, rope_theta=1e6, rms_eps=1e-6),
    "huginn-0125": dict(vocab_size=65536, d_model=5280, n_heads=55, n_kv_heads=55, head_dim=96,
                        ffn_dim=17920, n_pre_blocks=2, n_core_blocks=4, n_coda_blocks=2,
                        default_loops=32, block_layout="post", qkv_bias=True, injection=True,
                        coda_norm=True, embed_scale=float(np.sqrt(np.float32(5280))),
                        rope_theta=50000.0, rms_eps=1e-6),
    "nanbeige-3b": dict(vocab_size=166144, d_model=3072, n_heads=48, n_kv_heads=8, head_dim=128,
                        ffn_dim=10752, n_pre_blocks=0, n_core_blocks=22, default_loops=2,
                        block_layout="pre", step_norm=True, rope_theta=7e7, rms_eps=1e-5),
    "hrm-text-1b": dict(vocab_size=151808, d_model=1536, n_heads=12, n_kv_heads=12, head_dim=128,
                        ffn_dim=4096, n_pre_blocks=0, n_core_blocks=32, core_cycles=3,
                        default_loops=2, block_layout="pre", attn_gate=True, embed_scale=50.0,
                        rope_theta=10000.0, rms_eps=1e-6),
}
INT4_GROUP = 64


def random_quantized_tensors(config, seed=0):
    """Random stored tensors for every required tensor of `config` (docs/spec.md §6.3)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
    for name, (dtype, shape) in config.required_tensors().items():
        if name in ("rope.cos", "rope.sin"):
            tensors[name] = cos if name == "rope.cos" else sin
        elif dtype == np.int8:                                   # int8 codes, std ~73
            tensors[name] = rng.integers(-127, 128, size=shape, dtype=np.int8)
        elif name.endswith(".m"):                                # int4 group multipliers
            tensors[name] = rng.integers(8, 17, size=shape, dtype=np.uint8)
        elif dtype == np.uint8:                                  # packed int4 codes
            tensors[name] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        elif name.endswith(".s"):                                # row scales: unit-scale outputs
            tensors[name] = np.full(shape, _row_scale(config, name), np.float32)
        else:                                                    # gains 1, biases 0
            tensors[name] = np.full(shape, 0.0 if name.endswith(".b") else 1.0, np.float32)
    return tensors


def _row_scale(config, name):
    """A row scale making a row of random codes act like weights of std 1/sqrt(K)."""
    if name == "tok_emb.s":
        return 1.0 / 73.0
    K = config.linear_shapes()[name[:-2]][1]
    code_std = 73.0 if config.weight_format == "int8" else 4.6 * 12.0   # int4 code x multiplier
    return 1.0 / (code_std * np.sqrt(K))


def write_shape(path, shape, weight_format, layers, max_seq_len):
    fields = dict(SHAPES[shape], max_seq_len=max_seq_len, weight_format=weight_format,
                  group_size=INT4_GROUP if weight_format == "int4" else 0, tied_head=False,
                  name=f"bench-{shape}")
    if layers:                  # a two-state core has two stacks of that many
        fields["n_core_blocks"] = 2 * layers if fields.get("core_cycles") else layers
    config = ModelConfig(**fields)
    config.validate()
    save_model(path, config, random_quantized_tensors(config))
    return config


def rss_bytes():
    """(current, peak) resident set size of this process, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def memory_row(model, context, config):
    rng = np.random.default_rng(2)
    loaded, _ = rss_bytes()
    runtime = model.runtime()
    prompt = rng.integers(0, config.vocab_size, context - 8).tolist()
    start = time.perf_counter()
    model.generate(prompt, max_tokens=8, temperature=0.0)
    seconds = time.perf_counter() - start
    now, peak = rss_bytes()
    kv_per_token = config.n_layers(config.default_loops) * config.n_kv_heads * 2 * (
        config.head_dim + 4)
    expected = runtime["weight_bytes"] + kv_per_token * context
    return {"context": context, "weights MB": runtime["weight_bytes"] / 1e6,
            "kv KB/token": kv_per_token / 1e3, "weights+kv MB": expected / 1e6,
            "rss loaded MB": loaded / 1e6, "rss after MB": now / 1e6, "peak rss MB": peak / 1e6,
            "after / (weights+kv)": now / expected, "peak / (weights+kv)": peak / expected,
            "prefill+decode s": seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="ouro-1.4b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="core layers (0 = the shape's)")
    ap.add_argument("--format", default="int8", choices=["int8", "int4"])
    ap.add_argument("--backend", default="native")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of speed,prefix,memory to skip")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.tinyloop")
        print(f"writing a random {args.shape} {args.format} model ...", flush=True)
        config = write_shape(path, args.shape, args.format, args.layers, args.context + 64)
        print(f"{os.path.getsize(path) / 1e6:.0f} MB file; loading", flush=True)
        # no automatic prefix cache: the table measures the explicit PrefixCache, and the
        # memory row counts weights + one sequence's KV only
        with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(args.backend)) as model:
            tag = f"{args.shape}{'-' + str(args.layers) if args.layers else ''}-{args.format}"
            notes = (f"{args.shape}, {config.n_core_blocks} layers x {config.default_loops}, "
                     f"{args.format}, {args.backend}, {model.runtime()['device_name']}, "
                     f"{model.runtime()['threads']} threads, random weights.")
            if "memory" not in skip:          # first, so the peak is this row's
                row = memory_row(model, args.context, config)
                print(write_results(f"real-shapes-memory-{tag}", [row], list(row), notes))
            if "speed" not in skip:
                _, prefill, decode = speed(model, progress=lambda s: print(s, flush=True))
                row = {"prefill tok/s": prefill, "decode tok/s": decode}
                print(write_results(f"real-shapes-speed-{tag}", [row], list(row), notes))
            if "prefix" not in skip:
                prompt = np.random.default_rng(3).integers(0, config.vocab_size,
                                                           args.prefix).tolist()
                row = shared_prefix(model, prompt, args.n, max_tokens=16,
                                    loops=config.default_loops,
                                    progress=lambda s: print(s, flush=True))
                print(write_results(f"real-shapes-prefix-{tag}", [row], list(row), notes))
                if not row["same tokens"]:
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
