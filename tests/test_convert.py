"""tinyloop.convert: Hugging Face folders of every supported architecture (tiny, random, built
here with the `safetensors` package) become .tinyloop files with the right structure, load and
generate bit-identically on every backend; the float weights handed to the quantizer are exactly the checkpoint's tensors in
TinyLoop's places; every unsupported input is refused naming its key or tensor.

Fidelity against the architectures' own forward passes is tests/test_hf_fidelity's job.
"""
import json
import math
import os

import numpy as np
import pytest


import tinyloop  # noqa: E402
from tinyloop.hf import ConvertError, LazyWeights  # noqa: E402
from tinyloop.hf.architectures import Options, _interleaved_to_rotate_half, plan_for  # noqa: E402
from tinyloop.hf.safetensors_reader import Checkpoint  # noqa: E402
from tinyloop.modelfile import load_model, read_meta  # noqa: E402
from tinyloop.quantize import quantize_int8, rope_tables  # noqa: E402

from conftest import assert_same_bits  # noqa: E402
from hf_folders import (D_MODEL, FFN, HEADS, KV_HEADS, LAYERS,  # noqa: E402
                        LAYOUTS, POSITIONS, RETROFIT_LLAMA, TOKENIZER_JSON, VOCAB, architecture,
                        checkpoint, tokenizer_json_with, write_folder)
from hf_reference import llama3_inverse_frequencies  # noqa: E402
from tinyloop.tokenizer import end_of_turn_stops  # noqa: E402

# What each architecture's tiny folder converts to (docs/spec.md §1's published layouts).
EXPECTED = {
    "LlamaForCausalLM": dict(n_pre_blocks=0, n_core_blocks=LAYERS, n_coda_blocks=0,
                             default_loops=1, block_layout="pre", qkv_bias=False),
    "MistralForCausalLM": dict(n_pre_blocks=0, n_core_blocks=LAYERS, default_loops=1),
    "Qwen2ForCausalLM": dict(n_core_blocks=LAYERS, qkv_bias=True, block_layout="pre"),
    "NanbeigeForCausalLM": dict(n_core_blocks=LAYERS, default_loops=2, step_norm=True,
                                block_layout="pre"),
    "OuroForCausalLM": dict(n_pre_blocks=0, n_core_blocks=LAYERS, n_coda_blocks=0,
                            default_loops=3, block_layout="sandwich", step_norm=True,
                            injection=False, qkv_bias=False, exit_gate=True,
                            exit_threshold=1.0),
    "RavenForCausalLM": dict(n_pre_blocks=2, n_core_blocks=2, n_coda_blocks=1, default_loops=3,
                             block_layout="post", qkv_bias=True, injection=True,
                             coda_norm=True, step_norm=False, n_kv_heads=HEADS,
                             embed_scale=float(np.float32(math.sqrt(D_MODEL))),
                             tied_head=False, bos_id=3, eos_id=4),   # untied: ln_f is not 1
    "HrmTextForCausalLM": dict(n_pre_blocks=0, n_core_blocks=4, n_coda_blocks=0,
                               default_loops=2, core_cycles=2, attn_gate=True,
                               block_layout="pre", n_kv_heads=HEADS, embed_scale=50.0,
                               tied_head=False, step_norm=False, injection=False),
    "IQuestLoopCoderForCausalLM": dict(n_pre_blocks=0, n_core_blocks=LAYERS, n_coda_blocks=0,
                                       default_loops=2, loop_window=8, block_layout="pre",
                                       qkv_bias=False, step_norm=False, injection=False,
                                       n_kv_heads=KV_HEADS, head_dim=D_MODEL // HEADS,
                                       tied_head=False, bos_id=1, eos_id=2),
    RETROFIT_LLAMA: dict(n_pre_blocks=2, n_core_blocks=2, n_coda_blocks=1, default_loops=3,
                         block_layout="pre", qkv_bias=False, injection=True, coda_norm=False,
                         step_norm=False, n_kv_heads=KV_HEADS, head_dim=D_MODEL // HEADS,
                         embed_scale=1.0, tied_head=False, rope_theta=10000.0,
                         max_seq_len=POSITIONS, bos_id=1, eos_id=2),
}


def folder(tmp_path, arch, name="model", **overrides):
    config, tensors = checkpoint(arch, **overrides)
    return write_folder(tmp_path / name, config, tensors)


def weights_of(src, **options):
    """(Checkpoint, Plan, LazyWeights) of a folder: the float dict the quantizer is given."""
    ckpt = Checkpoint(src)
    _, plan = plan_for(ckpt.config, Options(**options), frozenset(ckpt))
    return ckpt, plan, LazyWeights(ckpt, plan.recipe, None)


@pytest.mark.parametrize("arch", LAYOUTS)
def test_each_architecture_converts_loads_and_generates(tmp_path, arch):
    src = folder(tmp_path, arch)
    out = str(tmp_path / "m.tinyloop")
    seen = []
    returned = tinyloop.convert(src, out, progress=lambda done, total, what: seen.append(
        (done, total, what)))
    config, tensors = load_model(out)
    assert config == returned
    for field, value in EXPECTED[arch].items():
        assert getattr(config, field) == value, field
    assert (config.vocab_size, config.d_model, config.ffn_dim) == (VOCAB, D_MODEL, FFN)
    assert config.tokenizer == "hf" and config.name == "model"
    meta = read_meta(out)
    assert meta["meta.architecture"] == architecture(arch)
    assert meta["meta.tokenizer_json"] == TOKENIZER_JSON
    # one progress call per float weight, counting up to the total
    assert [done for done, _, _ in seen] == list(range(1, seen[-1][1] + 1))
    with tinyloop.Model(out, backend="numpy") as model:
        tokens = model.generate([5, 6, 7], max_tokens=4)
        assert len(tokens) >= 4 and all(0 <= t < VOCAB for t in tokens)
        deeper = model.logits([5, 6, 7], loops=config.default_loops + 1)
        assert np.isfinite(deeper).all()


def test_llama_core_span_places_layers_in_prelude_core_and_coda(tmp_path):
    src = folder(tmp_path, "LlamaForCausalLM")
    out = str(tmp_path / "m.tinyloop")
    config = tinyloop.convert(src, out, core=(1, 2), loops=4)
    assert (config.n_pre_blocks, config.n_core_blocks, config.n_coda_blocks,
            config.default_loops) == (1, 1, 1, 4)
    assert config.n_layers(4) == 1 + 4 * 2
    ckpt, _, w = weights_of(src, core=(1, 2))
    for block, layer in (("pre.0", 0), ("core.0", 1), ("coda.0", 2)):
        for ours, theirs in (("wq", "self_attn.q_proj"), ("w_down", "mlp.down_proj"),
                             ("attn_norm", "input_layernorm"),
                             ("mlp_norm", "post_attention_layernorm")):
            assert np.array_equal(w[f"{block}.{ours}"],
                                  ckpt.tensor(f"model.layers.{layer}.{theirs}.weight"))
    assert np.array_equal(w["head"], ckpt.tensor("lm_head.weight"))
    ckpt.close()


def test_qwen2_biases_and_ouro_sandwich_and_step_norm_come_from_their_tensors(tmp_path):
    ckpt, _, w = weights_of(folder(tmp_path, "Qwen2ForCausalLM", "q"))
    for part in "qkv":
        assert np.array_equal(w[f"core.1.b{part}"],
                              ckpt.tensor(f"model.layers.1.self_attn.{part}_proj.bias"))
    ckpt.close()
    ckpt, plan, w = weights_of(folder(tmp_path, "OuroForCausalLM", "o"))
    p = "model.layers.2."
    for ours, theirs in (("attn_norm", "input_layernorm"), ("attn_post_norm", "input_layernorm_2"),
                         ("mlp_norm", "post_attention_layernorm"),
                         ("ffn_post_norm", "post_attention_layernorm_2")):
        assert np.array_equal(w[f"core.2.{ours}"], ckpt.tensor(f"{p}{theirs}.weight"))
    norm = ckpt.tensor("model.norm.weight")
    assert np.array_equal(w["core.step_norm"], norm) and np.array_equal(w["final_norm"], norm)
    assert np.array_equal(w["exit_gate"], ckpt.tensor("model.early_exit_gate.weight"))
    assert np.array_equal(w["exit_gate_bias"], ckpt.tensor("model.early_exit_gate.bias"))
    ckpt.close()


def test_ouro_keeps_its_exit_gate_with_the_final_norm_folded_in(tmp_path):
    """The gate scores model.norm(h): its columns carry model.norm's gain (as the head's do),
    quantized by the int8 linears' row quantizer whatever the weight format; the bias is kept
    as f32 (docs/spec.md §6.3, §6.4)."""
    src = folder(tmp_path, "OuroForCausalLM")
    ckpt = Checkpoint(src)
    gate = ckpt.tensor("model.early_exit_gate.weight")
    bias = ckpt.tensor("model.early_exit_gate.bias")
    norm = ckpt.tensor("model.norm.weight").astype(np.float64)
    ckpt.close()
    want_q, want_s = quantize_int8(gate, norm)
    assert not np.array_equal(want_q, quantize_int8(gate)[0])     # the fold changes the codes
    for weight_format in ("int8", "int4"):
        out = str(tmp_path / f"{weight_format}.tinyloop")
        config = tinyloop.convert(src, out, weight_format)
        assert config.exit_gate and config.exit_threshold == 1.0 and config.file_version == 3
        _, tensors = load_model(out)
        assert tensors["exit_gate.w"].dtype == np.int8
        assert np.array_equal(tensors["exit_gate.w"], want_q)
        assert np.array_equal(tensors["exit_gate.s"], want_s)
        assert np.array_equal(tensors["exit_gate.b"], bias)


@pytest.mark.parametrize("overrides, threshold", [
    (dict(early_exit_threshold=0.6), float(np.float32(0.6))),
    (dict(early_exit_threshold=None), 1.0),          # Ouro reads null as no threshold
    (dict(early_exit_threshold=1), 1.0),
])
def test_ouro_exit_threshold_comes_from_config_json(tmp_path, overrides, threshold):
    converted = tinyloop.convert(folder(tmp_path, "OuroForCausalLM", **overrides),
                                 str(tmp_path / "m.tinyloop"))
    assert converted.exit_threshold == threshold
    for backend in ("native", "numpy"):
        with tinyloop.Model(tmp_path / "m.tinyloop", backend=backend) as model:
            assert (model.config()["exit_gate"], model.config()["exit_threshold"]) == \
                (True, threshold)


def test_ouro_without_early_exit_threshold_gets_1(tmp_path):
    config, tensors = checkpoint("OuroForCausalLM")
    del config["early_exit_threshold"]
    src = write_folder(tmp_path / "src", config, tensors)
    assert tinyloop.convert(src, str(tmp_path / "m.tinyloop")).exit_threshold == 1.0


@pytest.mark.parametrize("arch", [a for a in LAYOUTS if a != "OuroForCausalLM"])
def test_only_ouro_has_an_exit_gate(tmp_path, arch):
    converted = tinyloop.convert(folder(tmp_path, arch), str(tmp_path / "m.tinyloop"))
    assert (converted.exit_gate, converted.exit_threshold) == (False, 0.0)
    assert not any(name.startswith("exit_gate.") for name in load_model(tmp_path / "m.tinyloop")[1])


@pytest.mark.parametrize("arch, overrides, act_block, want", [
    ("OuroForCausalLM", {}, None, 32),                       # d, H * D 32 and F 64
    ("OuroForCausalLM", dict(intermediate_size=48), None, 0),    # 32 does not divide F
    ("OuroForCausalLM", {}, 0, 0),
    ("NanbeigeForCausalLM", {}, None, 0),
    ("NanbeigeForCausalLM", {}, 16, 16),
])
def test_block_activations_default_to_32_for_ouro_only(tmp_path, arch, overrides, act_block, want):
    converted = tinyloop.convert(folder(tmp_path, arch, **overrides), str(tmp_path / "m.tinyloop"),
                                 act_block=act_block)
    assert converted.act_block == want
    with tinyloop.Model(tmp_path / "m.tinyloop", backend="numpy") as model:
        assert model.config()["act_block"] == want


def test_nanbeige_skip_loop_final_norm_turns_the_step_norm_off(tmp_path):
    src = folder(tmp_path, "NanbeigeForCausalLM", num_loops=3, skip_loop_final_norm=True)
    config = tinyloop.convert(src, str(tmp_path / "m.tinyloop"))
    assert (config.step_norm, config.default_loops) == (False, 3)


@pytest.mark.parametrize("weights, num_loops, loops, depth", [
    ([1.0, 0.5, 0.25], 2, None, 4),     # a non-empty list: one loop more than its weights
    ([0.5], None, None, 2),             # num_loops is then not read
    ([], 3, None, 3), (None, 3, None, 3),
    ([1.0, 0.5, 0.25], 2, 2, 2),        # the caller's loops= wins
])
def test_nanbeige_default_depth_follows_loop_loss_weights(tmp_path, weights, num_loops, loops,
                                                          depth):
    """Nanbeige's forward runs len(loop_loss_weights) + 1 loops when that list is non-empty,
    else num_loops (its _get_num_loops)."""
    config, tensors = checkpoint("NanbeigeForCausalLM", loop_loss_weights=weights)
    if num_loops is None:
        del config["num_loops"]
    else:
        config["num_loops"] = num_loops
    src = write_folder(tmp_path / "src", config, tensors)
    converted = tinyloop.convert(src, str(tmp_path / "m.tinyloop"), loops=loops)
    assert converted.default_loops == depth


def test_huginn_fused_tensors_split_and_rope_rows_permuted(tmp_path):
    ckpt, _, w = weights_of(folder(tmp_path, "RavenForCausalLM"))
    d, H, D, F = D_MODEL, HEADS, D_MODEL // HEADS, FFN
    p = "transformer.core_block.1."
    qkv, bias = ckpt.tensor(p + "attn.Wqkv.weight"), ckpt.tensor(p + "attn.qk_bias")
    order = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    head_rows = (np.arange(H)[:, None] * D + order[None, :]).reshape(-1)
    assert np.array_equal(w["core.1.wq"], qkv[:d][head_rows])
    assert np.array_equal(w["core.1.wk"], qkv[d:2 * d][head_rows])
    assert np.array_equal(w["core.1.wv"], qkv[2 * d:])
    assert np.array_equal(w["core.1.bq"], bias[0, 0].reshape(-1)[head_rows])
    assert np.array_equal(w["core.1.bk"], bias[1, 0].reshape(-1)[head_rows])
    assert not w["core.1.bv"].any()
    fc = ckpt.tensor(p + "mlp.fc.weight")
    assert np.array_equal(w["core.1.w_gate"], fc[:F]) and np.array_equal(w["core.1.w_up"], fc[F:])
    for ours, norm in (("attn_norm", 1), ("attn_post_norm", 2), ("mlp_norm", 3),
                       ("ffn_post_norm", 4)):
        assert np.array_equal(w[f"core.1.{ours}"], ckpt.tensor(f"{p}norm_{norm}.weight"))
    ln_f = ckpt.tensor("transformer.ln_f.weight")
    assert np.array_equal(w["coda.input_norm"], ln_f) and np.array_equal(w["final_norm"], ln_f)
    assert np.array_equal(w["core.adapter"], ckpt.tensor("transformer.adapter.weight"))
    assert np.array_equal(w["pre.1.wo"], ckpt.tensor("transformer.prelude.1.attn.proj.weight"))
    assert np.array_equal(w["coda.0.w_down"], ckpt.tensor("transformer.coda.0.mlp.proj.weight"))
    assert "head" not in w                      # tied: quantize_model unties it (ln_f != 1)
    ckpt.close()


def test_huginn_untied_head_is_lm_head(tmp_path):
    ckpt, _, w = weights_of(folder(tmp_path, "RavenForCausalLM", tie_embeddings=False))
    assert np.array_equal(w["head"], ckpt.tensor("lm_head.weight"))
    ckpt.close()


def test_retrofitted_llama_splits_fused_tensors_in_place_with_its_rope(tmp_path):
    """Unlike Huginn: no RoPE row permutation, norm_1 / norm_2 are the pre-norms, no coda
    norm, the RoPE tables are llama3's of rope_theta (not the stale rope_base)."""
    src = folder(tmp_path, RETROFIT_LLAMA)
    ckpt, plan, w = weights_of(src)
    d, H, G, D, F = D_MODEL, HEADS, KV_HEADS, D_MODEL // HEADS, FFN
    p = "transformer.core_block.1."
    qkv = ckpt.tensor(p + "attn.Wqkv.weight")
    assert qkv.shape == ((H + 2 * G) * D, d)
    assert np.array_equal(w["core.1.wq"], qkv[:H * D])
    assert np.array_equal(w["core.1.wk"], qkv[H * D:(H + G) * D])
    assert np.array_equal(w["core.1.wv"], qkv[(H + G) * D:])
    fc = ckpt.tensor(p + "mlp.fc.weight")
    assert np.array_equal(w["core.1.w_gate"], fc[:F]) and np.array_equal(w["core.1.w_up"], fc[F:])
    assert np.array_equal(w["core.1.attn_norm"], ckpt.tensor(p + "norm_1.weight"))
    assert np.array_equal(w["core.1.mlp_norm"], ckpt.tensor(p + "norm_2.weight"))
    assert not [n for n in w if n.endswith(("post_norm", "bq", "bk", "bv"))]
    assert "coda.input_norm" not in w
    assert np.array_equal(w["final_norm"], ckpt.tensor("transformer.ln_f.weight"))
    assert np.array_equal(w["core.adapter"], ckpt.tensor("transformer.adapter.weight"))
    assert np.array_equal(w["head"], ckpt.tensor("lm_head.weight"))
    assert np.array_equal(w["coda.0.w_down"], ckpt.tensor("transformer.coda.0.mlp.proj.weight"))
    ckpt.close()
    out = str(tmp_path / "m.tinyloop")
    config = tinyloop.convert(src, out)
    inv_freq = llama3_inverse_frequencies(10000.0, D, 8.0, 1.0, 4.0, 16)
    cos, sin = rope_tables(config.max_seq_len, D, 0.0, inv_freq)
    tensors = load_model(out)[1]
    assert np.array_equal(tensors["rope.cos"], cos) and np.array_equal(tensors["rope.sin"], sin)


def test_the_rope_permutation_keeps_every_attention_score():
    """Interleaved-pair RoPE on the checkpoint's rows scores like rotate-half RoPE on the
    permuted rows (float64; the identity is exact up to rounding)."""
    rng = np.random.default_rng(1)
    H, D, d = 3, 8, 5
    wq, wk = rng.standard_normal((H * D, d)), rng.standard_normal((H * D, d))
    x = rng.standard_normal((2, d))
    freq = 50000.0 ** (-np.arange(0, D, 2) / D)

    def interleaved(v, p):        # pairs (2i, 2i+1), as Huginn's apply_rotary_emb_complex_like
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = np.cos(p * freq), np.sin(p * freq)
        return np.stack([a * c - b * s, b * c + a * s], -1).reshape(v.shape)

    def rotate_half(v, p):        # pairs (i, i + D/2), spec §2.6
        a, b = v[..., :D // 2], v[..., D // 2:]
        c, s = np.cos(p * freq), np.sin(p * freq)
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def scores(rope, q_w, k_w):
        q = rope((q_w @ x[0]).reshape(H, D), 7)
        k = rope((k_w @ x[1]).reshape(H, D), 3)
        return (q * k).sum(-1)

    permuted = [_interleaved_to_rotate_half(w, H, D) for w in (wq, wk)]
    np.testing.assert_allclose(scores(rotate_half, *permuted), scores(interleaved, wq, wk),
                               rtol=1e-12, atol=1e-12)
    assert not np.allclose(scores(rotate_half, wq, wk), scores(interleaved, wq, wk))


def test_single_sharded_and_bf16_checkpoints_convert_to_the_same_file(tmp_path):
    config, tensors = checkpoint("Qwen2ForCausalLM", seed=3)
    forms = {"single": {}, "sharded": dict(shards=3), "bf16": dict(dtype="bfloat16")}
    files = {}
    for form, kwargs in forms.items():
        src = write_folder(tmp_path / form / "qwen", config, tensors, **kwargs)
        out = tmp_path / f"{form}.tinyloop"
        tinyloop.convert(src, str(out))
        files[form] = out.read_bytes()
    assert len(set(files.values())) == 1, {k: len(v) for k, v in files.items()}
    assert os.path.exists(tmp_path / "sharded" / "qwen" / "model.safetensors.index.json")


def test_fp16_tensors_are_widened_exactly(tmp_path):
    config, tensors = checkpoint("LlamaForCausalLM")
    src = write_folder(tmp_path / "half", config, tensors, dtype="float16")
    with Checkpoint(src) as ckpt:
        for name in ("model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight"):
            got = ckpt.tensor(name)
            assert got.dtype == np.float32
            assert np.array_equal(got, tensors[name].astype(np.float16).astype(np.float32))


def test_int4_and_the_options(tmp_path):
    src = folder(tmp_path, "MistralForCausalLM")
    out = str(tmp_path / "m.tinyloop")
    config = tinyloop.convert(src, out, "int4", group_size=16, loops=2, core=(0, 3),
                              max_seq_len=40)
    assert (config.weight_format, config.group_size, config.default_loops,
            config.max_seq_len) == ("int4", 16, 2, 40)
    assert load_model(out)[1]["rope.cos"].shape == (40, 4)
    assert tinyloop.convert(src, out, "int4").group_size == 32


def test_tokenizer_files_special_ids_and_name(tmp_path):
    config, tensors = checkpoint("LlamaForCausalLM", eos_token_id=[7, 2], bos_token_id=None)
    name = "é" * 40                                               # 80 UTF-8 bytes
    src = write_folder(tmp_path / name, config, tensors,
                       tokenizer_config={"bos_token": "w1", "chat_template": "old"},
                       chat_template="{{ messages }}")
    out = str(tmp_path / "m.tinyloop")
    converted = tinyloop.convert(src, out)
    assert (converted.bos_id, converted.eos_id, converted.stop_ids) == (-1, 7, (2,))
    assert converted.name == "é" * 31                             # 62 bytes, whole characters
    meta = read_meta(out)
    assert json.loads(meta["meta.tokenizer_config"]) == {"bos_token": "w1",
                                                         "chat_template": "{{ messages }}"}
    plain = write_folder(tmp_path / "plain", config, tensors, tokenizer=False)
    converted = tinyloop.convert(plain, out)
    assert converted.tokenizer == "none"
    assert set(read_meta(out)) == {"meta.architecture"}


def _drop(name):
    def mutate(config, tensors):
        del tensors[name]
    return mutate


def _set(**changes):
    def mutate(config, tensors):
        config.update(changes)
    return mutate


def _tensor(name, value):
    def mutate(config, tensors):
        tensors[name] = value
    return mutate


def _drop_key(key):
    def mutate(config, tensors):
        del config[key]
    return mutate


def _olmo_flavour(config, tensors):
    """McLeish et al.'s OLMo-2 retrofit: q_norm / k_norm over the whole q / k projections."""
    for name in [n for n in tensors if n.endswith("attn.Wqkv.weight")]:
        p = name[:-len("Wqkv.weight")]
        tensors[p + "q_norm.weight"] = np.ones(HEADS * 8, np.float32)
        tensors[p + "k_norm.weight"] = np.ones(KV_HEADS * 8, np.float32)


def _sandwich_norms(config, tensors):
    for name in [n for n in tensors if n.endswith("norm_2.weight")]:
        tensors[name.replace("norm_2", "norm_3")] = tensors[name]
        tensors[name.replace("norm_2", "norm_4")] = tensors[name]


REFUSALS = [
    ("LlamaForCausalLM", _set(architectures=["GPT2LMHeadModel"]), {}, ["GPT2LMHeadModel"]),
    ("HrmTextForCausalLM", _tensor("model.z_L_init", np.ones(D_MODEL, np.float32)), {},
     ["model.z_L_init is not zero", "low state at zero"]),
    ("HrmTextForCausalLM", _set(attention_bias=True), {}, ["attention_bias = True"]),
    ("HrmTextForCausalLM", _set(hidden_act="gelu"), {}, ["hidden_act = 'gelu'"]),
    ("HrmTextForCausalLM", _set(L_cycles=0), {}, ["L_cycles (0)", "must be >= 1"]),
    ("IQuestLoopCoderForCausalLM", _set(loop_window_size=0), {},
     ["loop_window_size (0)", "1 .. 2^20"]),
    ("IQuestLoopCoderForCausalLM", _set(hidden_size=30), {},
     ["hidden_size 30 is not a multiple of num_attention_heads 4"]),
    ("LlamaForCausalLM", _set(architectures=None, _class_name="ParcaeConfig"), {},
     ["ParcaeConfig", "diagonal injection"]),
    ("LlamaForCausalLM", _drop("model.layers.1.mlp.up_proj.weight"), {},
     ["missing tensor 'model.layers.1.mlp.up_proj.weight'"]),
    ("LlamaForCausalLM", _tensor("model.layers.0.self_attn.k_proj.weight",
                                 np.zeros((KV_HEADS * 8 + 1, D_MODEL), np.float32)), {},
     ["'model.layers.0.self_attn.k_proj.weight'", "expected shape [16, 32]", "found [17, 32]"]),
    ("LlamaForCausalLM", _tensor("model.layers.0.self_attn.q_norm.weight",
                                 np.ones(8, np.float32)), {},
     ["unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"]),
    ("LlamaForCausalLM", _tensor("model.norm.weight", np.ones(D_MODEL, np.int32)), {},
     ["'model.norm.weight'", "dtype I32"]),
    ("LlamaForCausalLM", _set(rope_scaling={"rope_type": "yarn", "factor": 4.0}), {},
     ["rope_scaling", "'yarn'"]),
    ("LlamaForCausalLM", _set(hidden_act="gelu"), {}, ["hidden_act", "'gelu'"]),
    ("LlamaForCausalLM", _set(attention_bias=True), {}, ["attention_bias"]),
    ("LlamaForCausalLM", _set(partial_rotary_factor=0.5), {}, ["partial_rotary_factor"]),
    ("LlamaForCausalLM", lambda c, t: None, dict(core=(2, 5)), ["--core 2:5"]),
    ("LlamaForCausalLM", lambda c, t: None, dict(group_size=16), ["group_size"]),
    ("MistralForCausalLM", _set(sliding_window=16), {}, ["sliding_window", "--max-seq-len 16"]),
    ("Qwen2ForCausalLM", _set(use_sliding_window=True), {}, ["use_sliding_window"]),
    ("Qwen2ForCausalLM", _set(layer_types=["full_attention", "sliding_attention",
                                           "full_attention"]), {},
     ["layer_types[1]", "sliding_attention"]),
    ("NanbeigeForCausalLM", _set(loop_share_kv=True), {}, ["loop_share_kv", "not supported"]),
    ("NanbeigeForCausalLM", _set(loop_loss_weights=3), {}, ["loop_loss_weights", "got 3"]),
    ("NanbeigeForCausalLM", _set(loop_loss_weights="0.5"), {}, ["loop_loss_weights", "'0.5'"]),
    ("NanbeigeForCausalLM", _set(loop_loss_weights=[0.5, True]), {}, ["loop_loss_weights"]),
    ("NanbeigeForCausalLM", _set(loop_loss_weights={"0": 0.5}), {}, ["loop_loss_weights"]),
    ("OuroForCausalLM", lambda c, t: None, dict(core=(0, 2)), ["--core"]),
    ("OuroForCausalLM", _set(early_exit_threshold=0.0), {},
     ["config.json: early_exit_threshold = 0.0 is not supported", "(0, 1]"]),
    ("OuroForCausalLM", _set(early_exit_threshold=1.5), {}, ["early_exit_threshold = 1.5"]),
    ("OuroForCausalLM", _set(early_exit_threshold="1.0"), {},
     ["early_exit_threshold must be a number, got '1.0'"]),
    ("OuroForCausalLM", _drop("model.early_exit_gate.bias"), {},
     ["missing tensor 'model.early_exit_gate.bias'"]),
    ("OuroForCausalLM", _tensor("model.early_exit_gate.weight",
                                np.zeros((2, D_MODEL), np.float32)), {},
     ["'model.early_exit_gate.weight'", "expected shape [1, 32]"]),
    ("RavenForCausalLM", _set(injection_type="add"), {}, ["injection_type", "'add'"]),
    ("RavenForCausalLM", _drop("transformer.adapter.weight"), {},
     ["missing tensor 'transformer.adapter.weight'"]),
    (RETROFIT_LLAMA, _olmo_flavour, {},
     ["'transformer.coda.0.attn.k_norm.weight'", "OLMo-2 flavour", "no q/k norm",
      "no placement without an input norm"]),
    (RETROFIT_LLAMA, _drop_key("rope_theta"), {},
     ["rope_theta is missing", "no norm_3 / norm_4", "rope_base = 500000.0", "unknown"]),
    (RETROFIT_LLAMA, _sandwich_norms, {},
     ["config.json has rope_theta", "'transformer.coda.0.norm_3.weight'", "cannot be told"]),
    ("RavenForCausalLM", _set(rope_theta=10000.0), {},
     ["'transformer.coda.0.norm_3.weight'", "config.json has rope_theta"]),
    (RETROFIT_LLAMA, _set(head_dim=16), {}, ["head_dim = 16", "n_embd // n_heads = 8"]),
    (RETROFIT_LLAMA, _set(rope_scaling={"rope_type": "yarn", "factor": 4.0}), {},
     ["rope_scaling of rope_type 'yarn'"]),
    (RETROFIT_LLAMA, lambda c, t: None, dict(core=(0, 2)), ["RavenForCausalLM", "--core"]),
]


@pytest.mark.parametrize("arch, mutate, options, phrases", REFUSALS,
                         ids=[r[3][0] for r in REFUSALS])
def test_refusals_name_the_key_or_tensor(tmp_path, arch, mutate, options, phrases):
    config, tensors = checkpoint(arch)
    mutate(config, tensors)
    src = write_folder(tmp_path / "src", config, tensors)
    out = tmp_path / "m.tinyloop"
    with pytest.raises(ConvertError) as info:
        tinyloop.convert(src, str(out), **options)
    for phrase in phrases:
        assert phrase in str(info.value)
    assert not out.exists()


# The published special tokens and settings (facts from the models' own files): Huginn-0125's
# config.json names no special id; its generation_config.json (tomg-group-umd/huginn-0125, the
# same file as seal-rg/recurrent-pretraining's vllm/generation_config.json) lists two eos ids,
# <|end_text|> and <|end_turn|>, which ends every chat turn.
HUGINN_SPECIAL = {65504: "<|begin_text|>", 65505: "<|end_text|>", 65506: "<|begin_header|>",
                  65507: "<|end_header|>", 65508: "<|end_turn|>", 65509: "<|pad|>"}
HUGINN_GENERATION_CONFIG = {"bos_token_id": 65504, "do_sample": True,
                            "eos_token_id": [65505, 65508], "pad_token_id": 65509,
                            "temperature": 0.7, "transformers_version": "4.47.1"}
HUGINN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|begin_header|>"
    "{{ 'Huginn' if message['role'] == 'assistant' else message['role'] }}<|end_header|>\n\n"
    "{{ message['content'] | trim }}<|end_turn|>{% endfor %}{% if add_generation_prompt %}"
    "<|begin_header|>Huginn<|end_header|>\n\n{% else %}<|end_text|>{% endif %}")
# Ouro-1.4B: config.json's bos and eos are 0 (<|endoftext|>), as is its tokenizer's eos_token;
# there is no generation_config.json; the ChatML template ends each turn with <|im_end|> (2).
OURO_SPECIAL = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_huginn_stops_on_both_published_eos_ids_and_a_chat_turn_ends_at_end_turn(tmp_path):
    config, tensors = checkpoint("RavenForCausalLM", vocab_size=65536, padded_vocab_size=65536)
    del config["bos_token_id"], config["eos_token_id"]
    src = write_folder(tmp_path / "huginn-0125", config, tensors,
                       tokenizer=tokenizer_json_with(HUGINN_SPECIAL),
                       tokenizer_config={"bos_token": "<|begin_text|>", "eos_token": "<|end_text|>",
                                         "pad_token": "<|pad|>", "chat_template": HUGINN_TEMPLATE},
                       generation_config=HUGINN_GENERATION_CONFIG)
    out = tmp_path / "huginn.tinyloop"
    converted = tinyloop.convert(src, str(out))
    assert (converted.bos_id, converted.eos_id, converted.stop_ids) == (65504, 65505, (65508,))
    for backend in ("native", "numpy"):
        with tinyloop.Model(out, backend=backend) as model:
            c = model.config()
            assert (c["eos_id"], c["stop_ids"]) == (65505, (65508,))
            assert model.tokenizer.end_of_turn_id == 65508        # the template's
            assert end_of_turn_stops(model.tokenizer, model.stop_token_ids()) == []


@pytest.mark.parametrize("tokenizer_eos, stop_ids, chat_stops", [
    ("<|endoftext|>", (), [2]),       # Ouro-1.4B: only the template knows the end of turn
    ("<|im_end|>", (2,), []),         # a tokenizer_config whose eos_token is <|im_end|>
])
def test_ouro_chats_stop_at_im_end(tmp_path, tokenizer_eos, stop_ids, chat_stops):
    config, tensors = checkpoint("OuroForCausalLM", bos_token_id=0, eos_token_id=0)
    src = write_folder(tmp_path / "Ouro-1.4B", config, tensors,
                       tokenizer=tokenizer_json_with(OURO_SPECIAL),
                       tokenizer_config={"bos_token": "<|endoftext|>", "eos_token": tokenizer_eos,
                                         "chat_template": CHATML_TEMPLATE})
    out = tmp_path / "ouro.tinyloop"
    converted = tinyloop.convert(src, str(out))
    assert (converted.eos_id, converted.stop_ids) == (0, stop_ids)
    with tinyloop.Model(out) as model:
        assert model.tokenizer.end_of_turn_id == 2
        assert end_of_turn_stops(model.tokenizer, model.stop_token_ids()) == chat_stops


def test_eos_ids_outside_the_vocabulary_or_too_many_are_refused(tmp_path):
    config, tensors = checkpoint("LlamaForCausalLM")
    src = write_folder(tmp_path / "far", config, tensors, tokenizer=False,
                       generation_config={"eos_token_id": [2, VOCAB]})
    with pytest.raises(ConvertError, match=rf"generation_config.json: eos_token_id must be token "
                                           rf"ids in 0 .. {VOCAB - 1}"):
        tinyloop.convert(src, str(tmp_path / "m.tinyloop"))
    src = write_folder(tmp_path / "many", config, tensors, tokenizer=False,
                       generation_config={"eos_token_id": list(range(10, 30))})
    with pytest.raises(ConvertError, match="names 21 eos ids"):
        tinyloop.convert(src, str(tmp_path / "m.tinyloop"))


def test_a_mistral_window_covering_max_seq_len_converts(tmp_path):
    src = folder(tmp_path, "MistralForCausalLM", sliding_window=16)
    assert tinyloop.convert(src, str(tmp_path / "m.tinyloop"), max_seq_len=16).max_seq_len == 16


def test_folder_problems_are_named(tmp_path):
    with pytest.raises(ConvertError, match="not a directory"):
        tinyloop.convert(str(tmp_path / "nothing"), str(tmp_path / "m.tinyloop"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="config.json: not found"):
        tinyloop.convert(str(tmp_path / "empty"), str(tmp_path / "m.tinyloop"))
    config, tensors = checkpoint("LlamaForCausalLM")
    src = write_folder(tmp_path / "noweights", config, {})
    os.remove(os.path.join(src, "model.safetensors"))
    with pytest.raises(ConvertError, match="no \\*.safetensors file"):
        tinyloop.convert(src, str(tmp_path / "m.tinyloop"))
    src = write_folder(tmp_path / "broken", config, tensors, shards=2)
    os.remove(os.path.join(src, "model-00002-of-00002.safetensors"))
    with pytest.raises(ConvertError, match="model-00002-of-00002.safetensors: listed in"):
        tinyloop.convert(src, str(tmp_path / "m.tinyloop"))
    with open(os.path.join(src, "model-00002-of-00002.safetensors"), "wb") as f:
        f.write((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConvertError, match="header length 1000000000"):
        tinyloop.convert(src, str(tmp_path / "m.tinyloop"))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_rope_scaling_tables(tmp_path, scaling):
    src = folder(tmp_path, "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500.0)
    out = str(tmp_path / "m.tinyloop")
    config = tinyloop.convert(src, out)
    D = config.head_dim
    base = 500.0 ** (-np.arange(0, D, 2) / D)
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        inv_freq = base / scaling["factor"]
    else:
        inv_freq = llama3_inverse_frequencies(500.0, D, 8.0, 1.0, 4.0, 16)
        assert not np.allclose(inv_freq, base) and not np.allclose(inv_freq, base / 8)
    cos, sin = rope_tables(config.max_seq_len, D, 0.0, inv_freq)
    tensors = load_model(out)[1]
    assert np.array_equal(tensors["rope.cos"], cos) and np.array_equal(tensors["rope.sin"], sin)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{architecture: the .tinyloop file of its tiny folder}."""
    root = tmp_path_factory.mktemp("converted")
    files = {}
    for arch in LAYOUTS:
        config, tensors = checkpoint(arch, seed=7)
        files[arch] = str(root / f"{arch}.tinyloop")
        tinyloop.convert(write_folder(root / arch, config, tensors), files[arch])
    return files


@pytest.mark.parametrize("arch", LAYOUTS)
def test_converted_models_are_bit_identical_on_every_backend(converted, backend, arch):
    prompt = [5, 17, 99, 3, 250, 7]
    with tinyloop.Model(converted[arch], backend="numpy") as model:
        want = model.logits(prompt, loops=2)
        tokens = model.generate(prompt, max_tokens=5, temperature=0.8, seed=3)
    with tinyloop.Model(converted[arch], backend=backend) as model:
        assert_same_bits(model.logits(prompt, loops=2), want)
        assert model.generate(prompt, max_tokens=5, temperature=0.8, seed=3) == tokens
