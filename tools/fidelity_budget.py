"""The full-depth error budget: how far each of TinyLoop's approximations moves the logits of a
published looped model's shape from its float64 forward, stage by stage.

Contract:
    python tools/fidelity_budget.py [--model ouro-1.4b | huginn-0125] [--loops L]
                                    [--positions N] [--seed S] [--weight-format int8 | int4]
                                    [--outliers] [--outlier-scale A] [--outlier-channels C]
                                    [--backend native] [--workdir DIR] [--json PATH]
        writes a random-weight checkpoint of the model's published shape (bf16 safetensors, in
        --workdir or a temporary folder that is deleted afterwards), converts it with
        tinyloop.convert, and prints, as markdown, the command line, the CPU, and one row per
        stage below: the mean and minimum over the N positions of a random prompt of the
        cosine between that stage's logits and the float64 reference, and the share of
        positions whose argmax agrees with it; once at full depth and once for the same
        checkpoint cut to 2 layer applications. --json also writes the numbers there. Exits
        nonzero (the reason on stderr) when this tool's own float forward (stage 0) disagrees
        with the reference: then every simulated stage would be measured on a wrong forward.

Reference: tests/hf_reference.py's float64 forward of the published code (`ouro_logits`,
`huginn_logits`), reading the checkpoint's own bf16 values. The stages run one float64 forward
of the converted layout (docs/spec.md §1, §4: folded norm gains, sandwich / post placements,
step and coda norms, the injection adapter; RoPE, attention and norms are hf_reference's),
all stages side by side, so each layer's weights are read once per application:

    0  float weights, float activations: this tool's forward, checked against the reference
    A  float weights + int8 activations, one scale per row: TinyLoop's Q8 of every linear's
       input (NQ's row before the norm, the attention output, the SwiGLU product, the
       adapter's inputs), simulated in float (q * s, spec §2.2)
    B  float weights + int8 activations, one scale per block of 32 (llama.cpp's Q8_0 layout)
    1  the .tinyloop file's weights (tinyloop.modelfile.load_model: codes * row scale, int4
       codes * group multiplier * row scale), float activations
    2  1 + int8 activations per row (A's quantizer)
    3  1 + int8 activations per block of 32 (B's): what finer activation scales would recover
    4  2 + what attention reads quantized: the query Q8 per head, keys and values Q8 (or Q4,
       4') per position and kv head, after RoPE; the softmax stays float
    5  TinyLoop itself (the backend's Model.logits, kv_mode int8, and int4 in 5'), which adds
       the fixed-point softmax and exp, f32 RoPE tables, the Q16 norms and f32 arithmetic
    6  TinyLoop with block activations (the same checkpoint converted with act_block 32,
       docs/spec.md §2.2.1: per 32 inputs an integer multiplier 1..255 of one row scale), kv
       int8, and int4 in 6': what the finer activation quantization recovers of stage 5

Shapes (config.json values of the published models; random weights by the published code's
own initialisation, each tensor drawn from its name and --seed so the 2-layer cut shares its
tensors with the full model):
    ouro-1.4b: hidden 2048, 24 layers x total_ut_steps 4, 16 heads (MHA) of 128, intermediate
        5632, vocab 49152, rope_theta 1e6, rms_norm_eps 1e-6, untied head. Init: Ouro's
        _init_weights with initializer_range 0.02: every linear and the embedding N(0, 0.02),
        every norm gain 1. 2 layers: the first 2 layers, total_ut_steps 1.
    huginn-0125: n_embd 5280, 55 heads of 96, intermediate 17920, vocab 65536, prelude 2 /
        core 4 / coda 2, mean_recurrence 32, rope_base 50000, tied embedding. Init: its
        config's init_values (strategy "takase"): Wqkv, fc, the adapter and the embedding
        N(0, 0.0087037), attn.proj and mlp.proj N(0, 0.0005357), qk_bias 0, norm gains 1.
        2 layers: prelude 1, core 1, coda 0, one recurrence.
    --loops replaces the full model's depth (total_ut_steps / mean_recurrence).

--outliers plants outlier channels in the residual stream, after the "massive activations" of
Sun et al. 2024 and the outlier features of Dettmers et al. 2022 (a few fixed residual dimensions
far above the rest, arising inside the network, not in the embedding, and largely ignored by
the layers that read them): C (--outlier-channels, default 4) channels drawn from --seed, and
A (--outlier-scale, default 50). What writes those channels into the residual stream is
multiplied by A: in Ouro the gains of its output norms (input_layernorm_2,
post_attention_layernorm_2: A instead of 1), in Huginn the rows of attn.proj and mlp.proj (its
norms norm_2 and norm_4 act on the stream itself, so a gain there would compound layer after
layer). What reads them from the stream is divided by A: the columns of Ouro's q/k/v_proj,
gate/up_proj and lm_head, Huginn's Wqkv, fc, both halves of the adapter and the tied
embedding. Each sublayer output then carries those channels about A times the others, and
so, at every layer and token, does Ouro's residual stream, whose sublayer outputs are its own
size; Huginn's sublayers write small updates into it, so its stream carries them far less
(2.2x at A = 50; give it --outlier-scale 500). The caption gives the measured ratio. The
layers read those channels at about the others' size. The stored gains are
f32, but the shrunk columns fall to a few int8 levels of their rows' scale, as any column
that a small norm gain folds into does (docs/spec.md §6.4): stage 1 moves too.

Memory: the reference and the float stages read one checkpoint tensor at a time (float64 of
the largest, Huginn's fc, is 1.5 GB); the file's weights are loaded once (1.4 GB for
Ouro-1.4B's int8 file, 3.6 GB for Huginn-0125's) and dequantized one linear at a time. Peak
RSS measured: 3.7 GiB (ouro-1.4b), 8.7 GiB (huginn-0125); time on 2 cores: about 4 and 40
minutes. The work folder holds both checkpoints and both files to the end: about 5 GB and
15 GB.
Requires numpy, safetensors and torch (the bf16 checkpoint is written through torch).
"""
import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tinyloop                                                         # noqa: E402
from hf_folders import write_folder                                     # noqa: E402
from hf_reference import LOGITS, causal_attention, rms_norm, rope_rotate_half  # noqa: E402
from tinyloop.config import ModelConfig                                 # noqa: E402
from tinyloop.hf import LazyWeights                                     # noqa: E402
from tinyloop.hf.architectures import Options, plan_for                 # noqa: E402
from tinyloop.hf.safetensors_reader import Checkpoint                   # noqa: E402
from tinyloop.modelfile import load_model, unpack_int4                  # noqa: E402

STAGE0_MAX_ERROR = 1e-6      # max |logit - reference| / max |reference| of this tool's forward
BLOCK = 32                   # the activation block of stages B, 3 and 6

OURO_1_4B = dict(
    architectures=["OuroForCausalLM"], hidden_size=2048, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=16, head_dim=128, intermediate_size=5632,
    vocab_size=49152, total_ut_steps=4, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=65536, hidden_act="silu", tie_word_embeddings=False,
    initializer_range=0.02, bos_token_id=0, eos_token_id=0)
HUGINN_0125 = dict(
    architectures=["RavenForCausalLM"], n_embd=5280, n_heads=55, num_key_value_heads=55,
    head_dim=96, intermediate_size=17920, vocab_size=65536, padded_vocab_size=65536,
    n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
    mean_recurrence=32, rope_base=50000, norm_eps=1e-6, block_size=4096, tie_embeddings=True,
    qk_bias=True, bias=False, injection_type="linear", init_strategy="takase",
    init_values={"std": 0.008703882797784892, "out_proj": 0.0005356869554443541,
                 "embedding": 0.008703882797784892, "embed_scale": 72.6636084983398},
    bos_token_id=65504, eos_token_id=65505)


@dataclasses.dataclass(frozen=True)
class Engine:
    """A stage TinyLoop runs itself: the KV mode, and the file's act_block (0: the file of
    stages 1-4, one activation scale per row; BLOCK: a second file with block activations)."""

    kv_mode: str
    act_block: int = 0


@dataclasses.dataclass(frozen=True)
class Lane:
    """One simulated stage: whose weights ("float" or "file"), the activation quantizer (None,
    "row" or "block") and the quantizer of what attention reads (None, "int8" or "int4")."""

    weights: str
    activations: Optional[str] = None
    kv: Optional[str] = None


# (label, what it adds, the lane or the TinyLoop KV mode)
STAGES: List[Tuple[str, str, object]] = [
    ("0", "float weights, float activations (this tool's forward)", Lane("float")),
    ("A", "float weights + int8 activations, one scale per row", Lane("float", "row")),
    ("B", "float weights + int8 activations, one scale per 32", Lane("float", "block")),
    ("1", "{w} weights (the file's), float activations", Lane("file")),
    ("2", "1 + int8 activations, one scale per row (TinyLoop's)", Lane("file", "row")),
    ("3", "1 + int8 activations, one scale per 32", Lane("file", "block")),
    ("4", "2 + int8 query, keys and values", Lane("file", "row", "int8")),
    ("4'", "2 + int8 query, int4 keys and values", Lane("file", "row", "int4")),
    ("5", "TinyLoop ({backend}, kv int8)", Engine("int8")),
    ("5'", "TinyLoop ({backend}, kv int4)", Engine("int4")),
    ("6", "5 + block activations, multipliers per 32 (act_block 32)", Engine("int8", BLOCK)),
    ("6'", "5' + block activations, multipliers per 32 (act_block 32)", Engine("int4", BLOCK)),
]


def log(message: str) -> None:
    """Progress on stderr: a published shape takes minutes per step."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Inconsistent(Exception):
    """The measurement contradicts itself; the message says how."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="ouro-1.4b",
                   help="the published shape (default: ouro-1.4b)")
    p.add_argument("--loops", type=int, default=None,
                   help="full-model depth (default: the published total_ut_steps / "
                        "mean_recurrence)")
    p.add_argument("--positions", type=int, default=16, help="prompt length (default 16)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompt and outlier channels")
    p.add_argument("--weight-format", choices=("int8", "int4"), default="int8")
    p.add_argument("--outliers", action="store_true", help="plant outlier channels")
    p.add_argument("--outlier-scale", type=float, default=50.0)
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--backend", default="native", help="TinyLoop backend (default: native)")
    p.add_argument("--workdir", default=None,
                   help="keep the checkpoints and files here (default: a deleted temp dir)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the numbers as JSON")
    return p.parse_args(argv)


# ---- the random checkpoints -------------------------------------------------------------

# A tensor's initialisation: ("normal", std) or ("constant", value).
Init = Tuple[str, float]


def ouro_init(name: str, config: Mapping) -> Init:
    """Ouro's _init_weights: linears and the embedding N(0, initializer_range), norm gains 1."""
    if "norm" in name:
        return "constant", 1.0
    return "normal", config["initializer_range"]


def huginn_init(name: str, config: Mapping) -> Init:
    """Huginn's init_values: attn.proj and mlp.proj out_proj, the embedding embedding, the
    other linears (Wqkv, fc, adapter) std; norm gains 1, qk_bias 0."""
    values = config["init_values"]
    if "norm" in name or "ln_f" in name:
        return "constant", 1.0
    if name.endswith("qk_bias"):
        return "constant", 0.0
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return "normal", values["out_proj"]
    return "normal", values["embedding" if name == "transformer.wte.weight" else "std"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A published model's shape and how this tool draws and cuts it."""

    config: Dict                                 # config.json
    depth_key: str                               # what --loops replaces
    init: Callable[[str, Mapping], Init]
    cut: Dict                                    # config.json changes to 2 layer applications
    residual_writers: Tuple[str, ...]            # name endings: rows (or gains) writing, and
    residual_readers: Tuple[str, ...]            # columns (every d-wide slice) reading the stream


MODELS = {
    "ouro-1.4b": Shape(OURO_1_4B, "total_ut_steps", ouro_init,
                       dict(num_hidden_layers=2, total_ut_steps=1),
                       ("input_layernorm_2.weight", "post_attention_layernorm_2.weight"),
                       ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                        "lm_head.weight")),
    "huginn-0125": Shape(HUGINN_0125, "mean_recurrence", huginn_init,
                         dict(n_layers_in_prelude=1, n_layers_in_recurrent_block=1,
                              n_layers_in_coda=0, mean_recurrence=1),
                         ("attn.proj.weight", "mlp.proj.weight"),
                         ("attn.Wqkv.weight", "mlp.fc.weight", "transformer.adapter.weight",
                          "transformer.wte.weight")),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a random checkpoint is drawn: each tensor from its name and seed."""

    init: Callable[[str, Mapping], Init]
    residual_writers: Tuple[str, ...]
    residual_readers: Tuple[str, ...]
    seed: int
    outlier_channels: Tuple[int, ...] = ()
    outlier_scale: float = 1.0


# plan_for tells RavenForCausalLM's two layouts apart by their tensors, which a checkpoint
# still to be written does not have yet: this tool's Huginn carries Huginn's sandwich norms.
HUGINN_TENSORS = frozenset({"transformer.core_block.0.norm_3.weight"})


class RandomTensors(Mapping):
    """{checkpoint tensor name: float32 array} of a config, each drawn when looked up (so
    hf_folders.write_folder, writing shard by shard, holds one shard at a time). The names
    and shapes are the ones tinyloop.convert's mapper reads."""

    def __init__(self, config: Dict, recipe: Recipe) -> None:
        self.config, self.recipe = config, recipe
        self.shapes = {}
        for source in plan_for(config, Options(), HUGINN_TENSORS)[1].recipe.values():
            self.shapes.update(zip(source.names, source.shapes))

    def __getitem__(self, name: str) -> np.ndarray:
        shape, r = self.shapes[name], self.recipe
        kind, value = r.init(name, self.config)
        if kind == "constant":
            a = np.full(shape, value, np.float32)
        else:
            rng = np.random.default_rng([r.seed, zlib.crc32(name.encode())])
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(value)
        if r.outlier_channels:
            channels = np.asarray(r.outlier_channels)
            if name.endswith(r.residual_writers):
                a[channels] *= np.float32(r.outlier_scale)
            if name.endswith(r.residual_readers):     # every d-wide slice of the columns
                d = self.config.get("hidden_size", self.config.get("n_embd"))
                columns = (channels[None] + d * np.arange(a.shape[1] // d)[:, None]).ravel()
                a[:, columns] /= np.float32(r.outlier_scale)
        return a

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_checkpoint(folder: str, config: Dict, recipe: Recipe) -> str:
    tensors = RandomTensors(config, recipe)
    total = sum(int(np.prod(s)) for s in tensors.shapes.values())
    shards = max(1, min(len(tensors), total // 50_000_000))    # about 50M parameters each
    return write_folder(folder, config, tensors, shards=shards,
                        dtype="bfloat16", tokenizer=False)


# ---- the weights a stage reads -----------------------------------------------------------

class FileWeights:
    """The .tinyloop file's weights as float64: integer codes times their scales."""

    def __init__(self, path: str) -> None:
        self.config, self.t = load_model(path)

    def linear(self, name: str) -> np.ndarray:
        if name == "head" and self.config.tied_head:
            name = "tok_emb"
        if f"{name}.m" in self.t:
            w = unpack_int4(self.t[f"{name}.w"]).astype(np.float64)
            w *= np.repeat(self.t[f"{name}.m"], self.config.group_size, axis=1)
        else:                                    # int8 (the embedding is, in an int4 file too)
            w = self.t[f"{name}.w"].astype(np.float64)
        w *= self.t[f"{name}.s"].astype(np.float64)[:, None]    # in place: Huginn's is 1.5 GB
        return w

    def vector(self, name: str) -> np.ndarray:
        return self.t[name].astype(np.float64)

    def embedding(self, tokens: np.ndarray) -> np.ndarray:
        return self.t["tok_emb.w"][tokens].astype(np.float64) * \
            self.t["tok_emb.s"][tokens].astype(np.float64)[:, None]


# A linear of the file = these float weights of tinyloop.quantize's dict, stacked by rows, with
# this norm gain folded into the input columns (docs/spec.md §6.4).
FOLDS = {"attn_qkv": (("wq", "wk", "wv"), "attn_norm"), "attn_out": (("wo",), None),
         "ffn_gate_up": (("w_gate", "w_up"), "mlp_norm"), "ffn_down": (("w_down",), None)}


class FloatWeights:
    """The checkpoint's float weights in the file's layout, as float64, read one tensor at a
    time through tinyloop.convert's own mapping (its recipe: names, splits, Huginn's RoPE
    row order)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        plan = plan_for(checkpoint.config, Options(), set(checkpoint))[1]
        self.config, self.shapes = plan.config, plan.config.linear_shapes()
        self.w = LazyWeights(checkpoint, plan.recipe, None)

    def _f64(self, key: str) -> np.ndarray:
        return np.asarray(self.w[key], np.float64)

    def linear(self, name: str) -> np.ndarray:
        d = self.config.d_model
        if name == "head":
            w = self._f64("tok_emb" if self.config.tied_head else "head")
            return w * self._f64("final_norm")[None, :]
        if name.startswith("core.adapter_"):
            a = self.w["core.adapter"]
            return np.asarray(a[:, :d] if name.endswith("state") else a[:, d:], np.float64)
        block, kind = name.rsplit(".", 1)
        parts, gain = FOLDS[kind]
        w, at = np.empty(self.shapes[name]), 0        # filled in place: Huginn's fc is 1.5 GB
        for p in parts:
            part = self.w[f"{block}.{p}"]
            np.copyto(w[at:at + len(part)], part)
            at += len(part)
        if gain is not None:
            w *= self._f64(f"{block}.{gain}")[None, :]
        return w

    def vector(self, name: str) -> np.ndarray:
        if name.endswith(".attn_qkv.b"):
            block = name[:-len(".attn_qkv.b")]
            return np.concatenate([self._f64(f"{block}.b{p}") for p in "qkv"])
        return self._f64(name)

    def embedding(self, tokens: np.ndarray) -> np.ndarray:
        return self._f64("tok_emb")[tokens]


# ---- the simulated stages ------------------------------------------------------------------

def quantize(x: np.ndarray, qmax: int, block: Optional[int] = None) -> np.ndarray:
    """x rounded to qmax levels each side of zero, one scale per row (spec §2.2, in float:
    q * s) or per `block` consecutive elements of a row (zero-padded to a whole block)."""
    if block is not None:
        k = x.shape[-1]
        pad = -k % block
        xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,))], axis=-1) if pad else x
        blocks = xp.reshape(x.shape[:-1] + (-1, block))
        return quantize(blocks, qmax).reshape(xp.shape)[..., :k]
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.where(amax < 2.0 ** -64, 0.0, amax / qmax)
    safe = np.where(scale == 0, 1.0, scale)
    return np.rint(np.clip(x / safe, -qmax, qmax)) * scale


KV_QMAX = {"int8": 127, "int4": 7}


class Stages:
    """The lanes' forward passes of the converted layout, side by side: each weight is made
    (dequantized or read) once per layer application for all lanes that use it."""

    def __init__(self, config: ModelConfig, sources: Mapping, lanes: Sequence[Lane]) -> None:
        self.c, self.sources, self.lanes = config, sources, list(lanes)

    def _act(self, x: np.ndarray) -> np.ndarray:
        """Every lane's linear input as its quantizer leaves it."""
        return np.stack([xi if lane.activations is None else
                         quantize(xi, 127, BLOCK if lane.activations == "block" else None)
                         for xi, lane in zip(x, self.lanes)])

    def _normed(self, x: np.ndarray) -> np.ndarray:
        """NQ(x): the row quantized, then divided by its root mean square (gain folded)."""
        return rms_norm(self._act(x), 1.0, self.c.rms_eps)

    def _linear(self, name: str, x: np.ndarray) -> np.ndarray:
        out: List[Optional[np.ndarray]] = [None] * len(self.lanes)
        for source in dict.fromkeys(lane.weights for lane in self.lanes):
            w = self.sources[source].linear(name)
            for i, lane in enumerate(self.lanes):
                if lane.weights == source:
                    out[i] = x[i] @ w.T
            del w
        return np.stack(out)

    def _vector(self, name: str) -> np.ndarray:
        """(lanes, 1, n) of a stored vector, per lane's weights."""
        return np.stack([self.sources[lane.weights].vector(name)[None]
                         for lane in self.lanes])

    def _attention(self, z: np.ndarray) -> np.ndarray:
        c = self.c
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        out = []
        for zi, lane in zip(z, self.lanes):
            n = len(zi)
            q = rope_rotate_half(zi[:, :H * D].reshape(n, H, D), c.rope_theta)
            k = rope_rotate_half(zi[:, H * D:(H + G) * D].reshape(n, G, D), c.rope_theta)
            v = zi[:, (H + G) * D:].reshape(n, G, D)
            if lane.kv is not None:
                q, k, v = quantize(q, 127), quantize(k, KV_QMAX[lane.kv]), \
                    quantize(v, KV_QMAX[lane.kv])
            out.append(causal_attention(q, k, v))
        return np.stack(out)

    def _residual(self, x: np.ndarray, y: np.ndarray, gain: str) -> np.ndarray:
        layout = self.c.block_layout
        if layout == "pre":
            return x + y
        g = self._vector(gain)
        if layout == "sandwich":
            return x + rms_norm(y, g, self.c.rms_eps)
        return rms_norm(x + y, g, self.c.rms_eps)

    def _block(self, b: str, x: np.ndarray) -> np.ndarray:
        z = self._linear(f"{b}.attn_qkv", self._normed(x))
        if self.c.qkv_bias:
            z = z + self._vector(f"{b}.attn_qkv.b")
        o = self._attention(z)
        x = self._residual(x, self._linear(f"{b}.attn_out", self._act(o)), f"{b}.attn_post_norm")
        gu = self._linear(f"{b}.ffn_gate_up", self._normed(x))
        F = self.c.ffn_dim
        h = gu[..., :F] / (1.0 + np.exp(-gu[..., :F])) * gu[..., F:]
        return self._residual(x, self._linear(f"{b}.ffn_down", self._act(h)),
                              f"{b}.ffn_post_norm")

    def forward(self, tokens: Sequence[int], loops: int) -> Tuple[np.ndarray, np.ndarray]:
        """(logits (lanes, n, V), the residual stream entering the final norm (lanes, n, d)),
        in the order of docs/spec.md §1."""
        c, tokens = self.c, np.asarray(tokens)
        x = np.stack([self.sources[lane.weights].embedding(tokens) * c.embed_scale
                      for lane in self.lanes])
        for i in range(c.n_pre_blocks):
            x = self._block(f"pre.{i}", x)
        e = x
        if c.injection:
            x = np.zeros_like(x)
        for i in range(loops):
            if c.step_norm and i >= 1:
                x = rms_norm(x, self._vector("core.step_norm"), c.rms_eps)
            if c.injection:
                x = (self._linear("core.adapter_state", self._act(x))
                     + self._linear("core.adapter_inject", self._act(e)))
            for j in range(c.n_core_blocks):
                x = self._block(f"core.{j}", x)
        if c.coda_norm:
            x = rms_norm(x, self._vector("coda.input_norm"), c.rms_eps)
        for j in range(c.n_coda_blocks):
            x = self._block(f"coda.{j}", x)
        return self._linear("head", self._normed(x)), x


# ---- one measurement ------------------------------------------------------------------------

def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-position cosine of two (n, V) logit arrays, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def agreement(logits: np.ndarray, reference: np.ndarray) -> Dict[str, float]:
    cos = cosines(logits, reference)
    top1 = np.argmax(logits, -1) == np.argmax(reference, -1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "top1": float(top1.mean())}


class CheckpointTensors(Mapping):
    """A checkpoint's tensors by name as float64, read when looked up (hf_reference's `t`)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.checkpoint:
            raise KeyError(name)
        return self.checkpoint.tensor(name).astype(np.float64)

    def __iter__(self):
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return sum(1 for _ in self.checkpoint)


SIMULATED = [label for label, _, lane in STAGES if isinstance(lane, Lane)]


@dataclasses.dataclass
class StageRun:
    """Every stage's logits for one checkpoint and prompt."""

    path: str                      # the converted file
    layers: int                    # layer applications at the file's default depth
    reference: np.ndarray          # (n, V) float64, tests/hf_reference.py
    logits: Dict[str, np.ndarray]  # stage label -> (n, V)
    residual: np.ndarray           # stage 0's residual stream entering the final norm (n, d)
    stage0_error: float            # max |stage 0 - reference| / max |reference|


def run_stages(folder: str, weight_format: str, tokens: Sequence[int],
               backend: str) -> StageRun:
    """Converts the checkpoint in `folder` (the file goes next to it) and runs every stage.
    Raises Inconsistent when stage 0 is off the reference."""
    path = folder.rstrip("/") + f".{weight_format}.tinyloop"
    log(f"converting {folder} to {weight_format}")
    tinyloop.convert(folder, path, weight_format=weight_format, max_seq_len=len(tokens),
                     act_block=0)
    with Checkpoint(folder) as checkpoint:
        config = checkpoint.config
        log("the float64 reference")
        reference = LOGITS[config["architectures"][0]](CheckpointTensors(checkpoint), config,
                                                       tokens)
        file = FileWeights(path)
        c = file.config
        log(f"stages {', '.join(SIMULATED)}")
        stages = Stages(c, {"float": FloatWeights(checkpoint), "file": file},
                        [lane for _, _, lane in STAGES if isinstance(lane, Lane)])
        simulated, residual = stages.forward(tokens, c.default_loops)
        del file, stages
    error = float(np.abs(simulated[0] - reference).max() / np.abs(reference).max())
    if not error <= STAGE0_MAX_ERROR:
        raise Inconsistent(f"{folder}: stage 0 (this tool's float forward) is off the float64 "
                           f"reference by {error:.3g} of its largest logit (> "
                           f"{STAGE0_MAX_ERROR}): the simulated stages would be wrong")
    logits = dict(zip(SIMULATED, simulated))
    paths = {0: path}
    for label, _, engine in STAGES:
        if isinstance(engine, Engine):
            if engine.act_block not in paths:
                paths[engine.act_block] = path.replace(".tinyloop",
                                                       f".act{engine.act_block}.tinyloop")
                log(f"converting {folder} to {weight_format}, act_block {engine.act_block}")
                tinyloop.convert(folder, paths[engine.act_block], weight_format=weight_format,
                                 max_seq_len=len(tokens), act_block=engine.act_block)
            log(f"TinyLoop, kv {engine.kv_mode}, act_block {engine.act_block}")
            with tinyloop.Model(paths[engine.act_block], backend=backend,
                                kv_mode=engine.kv_mode, prefix_cache_bytes=0) as m:
                logits[label] = m.logits(tokens)
    layers = c.n_pre_blocks + c.default_loops * c.n_core_blocks + c.n_coda_blocks
    return StageRun(path, layers, reference, logits, residual[0], error)


def summary(run: StageRun, outlier_channels: Sequence[int] = ()) -> Dict:
    """The numbers of the table: each stage's agreement with the reference, and with planted
    outliers the rms of those channels over the others' in stage 0's residual stream."""
    result = {"layers": run.layers, "stage0_error": run.stage0_error,
              "stages": {label: agreement(run.logits[label], run.reference)
                         for label, _, _ in STAGES}}
    if outlier_channels:
        planted = np.zeros(run.residual.shape[-1], bool)
        planted[list(outlier_channels)] = True
        x = run.residual
        result["outlier_ratio"] = float(np.sqrt(np.mean(x[:, planted] ** 2)
                                                / np.mean(x[:, ~planted] ** 2)))
    return result


def measure(args) -> Dict:
    shape = MODELS[args.model]
    config = shape.config if args.loops is None else {**shape.config, shape.depth_key: args.loops}
    rng = np.random.default_rng(args.seed)
    d = config.get("hidden_size", config.get("n_embd"))
    channels = tuple(sorted(int(c) for c in rng.choice(d, args.outlier_channels, replace=False))) \
        if args.outliers else ()
    recipe = Recipe(shape.init, shape.residual_writers, shape.residual_readers, args.seed,
                    channels, args.outlier_scale)
    tokens = rng.integers(0, config["vocab_size"], args.positions).tolist()
    workdir = args.workdir or tempfile.mkdtemp(prefix="fidelity-budget-")
    try:
        depths = {}
        for depth, cfg in (("full", config), ("2 layers", {**config, **shape.cut})):
            log(f"writing the {depth} checkpoint")
            folder = write_checkpoint(os.path.join(workdir, depth.replace(" ", "-")), cfg,
                                      recipe)
            depths[depth] = summary(run_stages(folder, args.weight_format, tokens,
                                               args.backend), channels)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"model": args.model, "config": config, "weight_format": args.weight_format,
            "backend": args.backend, "seed": args.seed, "positions": args.positions,
            "outlier_channels": list(channels),
            "outlier_scale": args.outlier_scale if channels else None, "depths": depths}


# ---- the report ------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name:")]
    return names[0] if names else "unknown CPU"


def markdown(r: Dict, command: str, cpu: str, seconds: float) -> str:
    full, cut = r["depths"]["full"], r["depths"]["2 layers"]
    planted = (f"; planted outlier channels {r['outlier_channels']} x {r['outlier_scale']:g} "
               f"(residual stream before the final norm, float: those channels' rms "
               f"{full['outlier_ratio']:.1f}x the others' at full depth, "
               f"{cut['outlier_ratio']:.1f}x at 2 layers)" if r["outlier_channels"] else "")
    lines = [f"    {command}", "",
             f"{r['model']} shape, random weights (seed {r['seed']}){planted}; "
             f"{r['weight_format']} weights; {r['positions']} positions of a random prompt; "
             f"full depth {full['layers']} layer applications, cut {cut['layers']}; against "
             f"the float64 reference (tests/hf_reference.py). CPU: {cpu}; {seconds:.0f} s.", "",
             "| stage | what it adds | full: cos mean | cos min | top-1 | "
             "2 layers: cos mean | cos min | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for label, what, _ in STAGES:
        a, b = full["stages"][label], cut["stages"][label]
        what = what.format(w=r["weight_format"], backend=r["backend"])
        lines.append(f"| {label} | {what} | {a['cosine_mean']:.6f} | {a['cosine_min']:.6f} | "
                     f"{100 * a['top1']:.0f}% | {b['cosine_mean']:.6f} | "
                     f"{b['cosine_min']:.6f} | {100 * b['top1']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        result = measure(args)
    except Inconsistent as exc:
        print(exc, file=sys.stderr)
        return 1
    seconds = time.time() - start
    command = " ".join(["python tools/fidelity_budget.py"]
                       + (sys.argv[1:] if argv is None else list(argv)))
    cpu = cpu_name()
    print(markdown(result, command, cpu, seconds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "cpu": cpu, "seconds": seconds, "command": command}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
