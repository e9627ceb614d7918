"""Tiny Hugging Face model folders with random weights, in each published layout TinyLoop
converts (config.json, *.safetensors written by the `safetensors` package, tokenizer files).

`checkpoint(arch, **config_overrides)` gives (config dict, {tensor name: float32 array}) laid
out as the architecture's own code names and shapes them (`arch` may also be one of LAYOUTS, a
published layout that shares its architecture name with another); `write_folder` saves one as a
single file, as shards with an index, or as bf16. Every weight is a bfloat16 value, so a bf16
and an fp32 folder of the same checkpoint hold the same numbers.
"""
import json
import math
import os

import numpy as np

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS, POSITIONS = 32, 4, 2, 8, 64, 270, 3, 64
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "NanbeigeForCausalLM", "OuroForCausalLM", "RavenForCausalLM",
                 "HrmTextForCausalLM", "IQuestLoopCoderForCausalLM")
# A retrofitted-recurrence Llama (McLeish et al. 2025): a RavenForCausalLM with its own layout.
RETROFIT_LLAMA = "RavenForCausalLM:retrofit-llama"
LAYOUTS = ARCHITECTURES + (RETROFIT_LLAMA,)
TOKENIZER_JSON = json.dumps({
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(VOCAB)}, "unk_token": "w0"}})


def bf16(a):
    """a rounded toward zero to the nearest bfloat16 value, as float32."""
    return (np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


class _Draw:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def matrix(self, rows, cols):
        return bf16(self.rng.standard_normal((rows, cols)) / math.sqrt(cols))

    def gain(self, n=D_MODEL):
        return bf16(1 + 0.1 * self.rng.standard_normal(n))

    def vector(self, n):
        return bf16(0.1 * self.rng.standard_normal(n))


def architecture(layout):
    """The architecture name of a layout of LAYOUTS."""
    return layout.split(":")[0]


def checkpoint(arch, seed=0, **overrides):
    """(config.json dict, tensors) of a tiny random model of architecture (or layout) `arch`."""
    if arch in ("RavenForCausalLM", RETROFIT_LLAMA):
        return _raven(_Draw(seed), overrides, retrofitted=arch == RETROFIT_LLAMA)
    if arch == "HrmTextForCausalLM":
        return _hrm_text(_Draw(seed), overrides)
    draw = _Draw(seed)
    config = dict(architectures=[arch], hidden_size=D_MODEL, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=FFN,
                  vocab_size=VOCAB, num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS,
                  rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config.update({"MistralForCausalLM": dict(sliding_window=None),
                   "Qwen2ForCausalLM": dict(use_sliding_window=False, sliding_window=4096),
                   "NanbeigeForCausalLM": dict(num_loops=2, skip_loop_final_norm=False),
                   "OuroForCausalLM": dict(total_ut_steps=3, use_sliding_window=False,
                                           sliding_window=None,
                                           early_exit_threshold=1.0),
                   "IQuestLoopCoderForCausalLM": dict(loop_num=2, loop_window_size=8)
                   }.get(arch, {}))
    config.update(overrides)          # the widths too: the tensors follow the config
    d, H, G, D, F = (config[key] for key in ("hidden_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim",
                                             "intermediate_size"))
    V = config["vocab_size"]
    t = {"model.embed_tokens.weight": draw.matrix(V, d), "model.norm.weight": draw.gain(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = draw.gain(d)
        t[p + "post_attention_layernorm.weight"] = draw.gain(d)
        for part, heads in (("q", H), ("k", G), ("v", G)):
            t[f"{p}self_attn.{part}_proj.weight"] = draw.matrix(heads * D, d)
            if arch == "Qwen2ForCausalLM":
                t[f"{p}self_attn.{part}_proj.bias"] = draw.vector(heads * D)
        t[p + "self_attn.o_proj.weight"] = draw.matrix(d, H * D)
        t[p + "mlp.gate_proj.weight"] = draw.matrix(F, d)
        t[p + "mlp.up_proj.weight"] = draw.matrix(F, d)
        t[p + "mlp.down_proj.weight"] = draw.matrix(d, F)
        if arch == "OuroForCausalLM":
            t[p + "input_layernorm_2.weight"] = draw.gain(d)
            t[p + "post_attention_layernorm_2.weight"] = draw.gain(d)
    if arch == "IQuestLoopCoderForCausalLM":      # gate logits about unit size, off centre
        for i in range(config["num_hidden_layers"]):
            t[f"model.gate_projections.{i}.weight"] = draw.matrix(H, D)
            t[f"model.gate_projections.{i}.bias"] = bf16(0.5 + draw.vector(H) * 5)
    if arch == "OuroForCausalLM":
        t["model.early_exit_gate.weight"] = draw.matrix(1, d)
        t["model.early_exit_gate.bias"] = draw.vector(1)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = draw.matrix(V, d)
    return config, t


def _raven(draw, overrides, retrofitted):
    """Huginn's layout (recpre/raven_modeling_minimal.py): prelude 2, core 2, coda 1 here. With
    `retrofitted`, a Llama retrofitted with recurrence as McLeish et al.'s convert_llama.py saves
    it (raven_modeling_minimal_llama.py runs it): Huginn's config with the Llama's keys written
    over it (GQA, no q/k bias, untied head, embed_scale 1, rope_theta and llama3 rope_scaling; a
    stale rope_base, block_size and n_layers), Wqkv rows [q; k; v] of n_heads then
    num_key_value_heads heads, norm_1 and norm_2 only, no freqs_cis buffer."""
    config = dict(architectures=["RavenForCausalLM"], n_embd=D_MODEL, n_heads=HEADS,
                  n_layers_in_prelude=2, n_layers_in_recurrent_block=2, n_layers_in_coda=1,
                  mean_recurrence=3, intermediate_size=FFN, vocab_size=VOCAB,
                  padded_vocab_size=VOCAB, norm_eps=1e-6, rope_base=50000.0,
                  block_size=POSITIONS, tie_embeddings=True, qk_bias=True, bias=False,
                  injection_type="linear", bos_token_id=3, eos_token_id=4)
    if retrofitted:
        config.update(
            num_key_value_heads=KV_HEADS, head_dim=D_MODEL // HEADS, qk_bias=False,
            tie_embeddings=False, tie_word_embeddings=False, norm_eps=1e-5, rope_base=500000.0,
            rope_theta=10000.0, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=16),
            max_position_embeddings=POSITIONS, block_size=4096, n_layers=16,
            init_values=dict(std=0.0087, embed_scale=1.0), test_time_noise=0,
            block_class_name="SandwichBlock", mlp_class_name="GatedMLP", nonlin_name="SiLU",
            bos_token_id=1, eos_token_id=2)
    config.update(overrides)
    d, H, D, F, V = D_MODEL, HEADS, D_MODEL // HEADS, FFN, config["padded_vocab_size"]
    G = config.get("num_key_value_heads", H)
    t = {"transformer.wte.weight": draw.matrix(V, d), "transformer.ln_f.weight": draw.gain(),
         "transformer.adapter.weight": draw.matrix(d, 2 * d)}
    if not retrofitted:
        t["freqs_cis"] = np.zeros((1, POSITIONS, 1, D // 2, 2), np.float32)
    parts = [("prelude", config["n_layers_in_prelude"]),
             ("core_block", config["n_layers_in_recurrent_block"]),
             ("coda", config["n_layers_in_coda"])]
    for part, n in parts:
        for i in range(n):
            p = f"transformer.{part}.{i}."
            for norm in (1, 2) if retrofitted else (1, 2, 3, 4):
                t[f"{p}norm_{norm}.weight"] = draw.gain()
            t[p + "attn.Wqkv.weight"] = draw.matrix((H + 2 * G) * D, d)
            if config["qk_bias"]:
                t[p + "attn.qk_bias"] = draw.vector(2 * H * D).reshape(2, 1, H, D)
            t[p + "attn.proj.weight"] = draw.matrix(d, H * D)
            t[p + "mlp.fc.weight"] = draw.matrix(2 * F, d)
            t[p + "mlp.proj.weight"] = draw.matrix(d, F)
    if not config["tie_embeddings"]:
        t["lm_head.weight"] = draw.matrix(V, d)
    return config, t


def _hrm_text(draw, overrides):
    """HRM-Text's layout (transformers' HrmTextForCausalLM as save_pretrained writes it, its
    conversion mapping fusing gate, q, k, v into attn.gqkv_proj and gate, up into
    mlp.gate_up_proj, as the published checkpoint stores them): two stacks of 2 layers,
    H_cycles 2 x L_cycles 2, multi-head attention with a gate, no norm weights, the zero
    z_L_init; config.json with the per-stack count and the inflated num_hidden_layers
    (2 * 2 * (2 + 1)) that HrmTextConfig serialises."""
    config = dict(architectures=["HrmTextForCausalLM"], model_type="hrm_text",
                  hidden_size=D_MODEL, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                  intermediate_size=FFN, vocab_size=VOCAB, num_layers_per_stack=2,
                  num_hidden_layers=12, H_cycles=2, L_cycles=2, L_bp_cycles=[2],
                  max_position_embeddings=POSITIONS, rms_norm_eps=1e-6, hidden_act="silu",
                  initializer_range=0.02, embedding_scale=50.0, prefix_lm=True,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                  attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    config.update(overrides)
    d, H, D, F, V = D_MODEL, HEADS, HEAD_DIM, FFN, config["vocab_size"]
    t = {"model.embed_tokens.weight": bf16(draw.matrix(V, d) * np.float32(0.02)),
         "model.z_L_init": np.zeros(d, np.float32)}
    for stack in ("L_module", "H_module"):
        for j in range(config["num_layers_per_stack"]):
            p = f"model.{stack}.layers.{j}."
            t[p + "attn.gqkv_proj.weight"] = draw.matrix(4 * H * D, d)     # gate, q, k, v
            t[p + "attn.o_proj.weight"] = draw.matrix(d, H * D)
            t[p + "mlp.gate_up_proj.weight"] = draw.matrix(2 * F, d)
            t[p + "mlp.down_proj.weight"] = draw.matrix(d, F)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = draw.matrix(V, d)
    return config, t


def write_folder(folder, config, tensors, *, shards=1, dtype="float32", tokenizer=True,
                 tokenizer_config=None, chat_template=None, generation_config=None):
    """Write a Hugging Face model folder; returns its path. shards > 1 splits the tensors
    over that many files listed in model.safetensors.index.json; dtype "bfloat16" saves
    through torch (skipped by the caller when torch is missing). `tokenizer`: True for
    TOKENIZER_JSON, or a tokenizer.json text."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    files = ["model.safetensors"] if shards == 1 else [
        f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for file, group in zip(files, groups):
        _save({n: tensors[n] for n in group}, os.path.join(folder, file), dtype)
    if shards > 1:
        weight_map = {n: file for file, group in zip(files, groups) for n in group}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if tokenizer:
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write(TOKENIZER_JSON if tokenizer is True else tokenizer)
    if tokenizer_config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)
    if chat_template is not None:
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(chat_template)
    if generation_config is not None:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
    return str(folder)


def tokenizer_json_with(special):
    """A word-level tokenizer.json whose {id: text} `special` tokens are special added tokens at
    those ids (a real model's sit at the top of a large vocabulary, or at its start) and whose
    every other id below the largest (and below VOCAB) is a word w<id>."""
    tokenizer = json.loads(TOKENIZER_JSON)
    size = max(VOCAB, max(special) + 1)
    tokenizer["model"]["vocab"] = {special.get(i, f"w{i}"): i for i in range(size)}
    tokenizer["added_tokens"] = [dict(id=i, content=text, single_word=False, lstrip=False,
                                      rstrip=False, normalized=False, special=True)
                                 for i, text in sorted(special.items())]
    return json.dumps(tokenizer)


def _save(tensors, path, dtype):
    if dtype == "bfloat16":
        import torch
        from safetensors.torch import save_file
        save_file({n: torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16)
                   for n, a in tensors.items()}, path)
    else:
        from safetensors.numpy import save_file
        save_file({n: np.ascontiguousarray(a, dtype if a.dtype.kind == "f" else a.dtype)
                   for n, a in tensors.items()}, path)
