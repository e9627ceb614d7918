"""GPTQ int4 (tinyloop.quantize.quantize_int4 with a Hessian), its calibration forward
(tinyloop.calibrate) and `tinyloop convert --format int4 --gptq [--calibration FILE]`."""
import numpy as np
import pytest

import tinyloop
from hf_folders import checkpoint, write_folder
from hf_reference import LOGITS
from test_cli import run
from tinyloop.calibrate import WINDOW, forward, input_grams, token_windows
from tinyloop.hf import ConvertError, LazyWeights
from tinyloop.hf.architectures import Options, plan_for
from tinyloop.hf.safetensors_reader import Checkpoint
from tinyloop.modelfile import load_model, unpack_int4
from tinyloop.quantize import quantize_int4

GROUP = 16


def dequantized(packed, mult, scale, group_size):
    """The float weights an int4 linear stands for: w * m * ws."""
    w = unpack_int4(packed).astype(np.float64)
    groups = np.repeat(mult.astype(np.float64), group_size, axis=1)
    return w * groups * scale.astype(np.float64)[:, None]


def output_error(w, quantized, x):
    """||(W - Q) X^T||, the error of the linear's outputs on the inputs x (n, K)."""
    return np.linalg.norm((w - dequantized(*quantized, GROUP)) @ x.T)


def weights_and_inputs(correlated, seed=0, rows=48, cols=128, n=4096):
    """(w (rows, cols), inputs (n, cols)); correlated: every input mixes all directions, as in
    a real model (the first n_rows of a larger n are the same rows)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols))
    mix = np.eye(cols) + 3.0 * rng.standard_normal((cols, cols)) / np.sqrt(cols)
    z = rng.standard_normal((n, cols))
    return w, z @ mix if correlated else z


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    w, x = weights_and_inputs(correlated=True)
    rtn = quantize_int4(w, GROUP)
    gptq = quantize_int4(w, GROUP, hessian=x.T @ x)
    assert not np.array_equal(gptq[0], rtn[0])
    assert output_error(w, gptq, x) < 0.8 * output_error(w, rtn, x)
    # held-out inputs of the same distribution: the gain is not fitted to the sample
    held_out = weights_and_inputs(correlated=True, n=8192)[1][4096:]
    assert output_error(w, gptq, held_out) < 0.8 * output_error(w, rtn, held_out)


def test_gptq_keeps_the_int4_format_and_rtn_row_scales():
    w, x = weights_and_inputs(correlated=True)
    packed, mult, scale = quantize_int4(w, GROUP, hessian=x.T @ x)
    rtn_scale = quantize_int4(w, GROUP)[2]
    assert packed.shape == (48, 64) and mult.shape == (48, 128 // GROUP)
    assert np.array_equal(scale.view(np.uint32), rtn_scale.view(np.uint32))
    codes = unpack_int4(packed)
    assert codes.min() >= -7 and codes.max() <= 7 and codes.min() == -7
    assert mult.min() >= 1 and mult.max() <= 255


def test_an_identity_hessian_gives_exactly_rtn():
    w, _ = weights_and_inputs(correlated=False)
    rtn, gptq = quantize_int4(w, GROUP), quantize_int4(w, GROUP, hessian=np.eye(128))
    for a, b in zip(rtn, gptq):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_uncorrelated_equal_variance_inputs_stay_close_to_rtn():
    w, x = weights_and_inputs(correlated=False)
    rtn = quantize_int4(w, GROUP)
    gptq = quantize_int4(w, GROUP, hessian=x.T @ x)
    ratio = output_error(w, gptq, x) / output_error(w, rtn, x)
    assert 0.9 < ratio <= 1.0
    assert np.mean(unpack_int4(gptq[0]) == unpack_int4(rtn[0])) > 0.8


def test_inputs_that_are_always_zero_get_zero_weights():
    w, x = weights_and_inputs(correlated=True)
    x[:, 5] = 0
    packed, mult, scale = quantize_int4(w, GROUP, hessian=x.T @ x)
    codes = unpack_int4(packed)
    assert np.all(codes[:, 5] == 0) and np.any(codes[:, 4] != 0)
    assert np.isfinite(scale).all()


def test_a_hessian_of_the_wrong_shape_is_refused():
    w, _ = weights_and_inputs(correlated=False)
    for hessian in (np.eye(128)[:64], np.eye(64), np.eye(256), np.ones(128)):
        with pytest.raises(ValueError, match=r"must be square, \(128, 128\) for a linear"):
            quantize_int4(w, GROUP, hessian=hessian)


# ---- the calibration forward ------------------------------------------------------------

def plan_and_weights(folder):
    """(config, lazy float weights, inv_freq, checkpoint) of a converted folder's plan."""
    ckpt = Checkpoint(folder)
    _, plan = plan_for(ckpt.config, Options(), frozenset(ckpt))
    return plan.config, LazyWeights(ckpt, plan.recipe, None), plan.inv_freq, ckpt


@pytest.mark.parametrize("arch", sorted(LOGITS))
def test_the_float_forward_matches_the_float64_reference(tmp_path, arch):
    """Ouro (sandwich, step norm, GQA), Nanbeige (pre, step norm), Huginn (post, injection,
    q/k biases, coda and its norm, embedding scale, tied head) and HRM-Text (two-state core,
    attention gate) and IQuest-Coder Loop (loop attention, its window shorter than the windows)
    against tests/hf_reference.py."""
    hf_config, t = checkpoint(arch, **({"loop_window_size": 3}
                                       if arch == "IQuestLoopCoderForCausalLM" else {}))
    folder = write_folder(tmp_path / arch, hf_config, t, tokenizer=False)
    config, weights, inv_freq, ckpt = plan_and_weights(folder)
    reference = {k: v.astype(np.float64) for k, v in t.items()}
    if arch == "RavenForCausalLM":     # the file's embed_scale is sqrt(d) rounded to f32
        hf_config["tie_embeddings"] = False
        reference["lm_head.weight"] = reference["transformer.wte.weight"].copy()
        reference["transformer.wte.weight"] *= config.embed_scale / np.sqrt(config.d_model)
    tokens = np.array([[5, 9, 200, 3, 3, 17, 64, 1], [7, 7, 7, 0, 12, 250, 31, 8]])
    with ckpt:
        x = forward(config, weights, tokens, inv_freq)
        norm = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_eps)
        if config.core_cycles:       # HRM-Text's head reads the closing norm's output as it is
            norm = x
        head = weights["tok_emb" if config.tied_head else "head"].astype(np.float64)
        logits = norm * weights["final_norm"].astype(np.float64) @ head.T
    for window, got in zip(tokens, logits):
        expected = LOGITS[arch](reference, hf_config, list(window))
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


def test_grams_cover_every_linear_and_sum_over_the_iterations(tmp_path):
    hf_config, t = checkpoint("RavenForCausalLM", tie_embeddings=False)
    t["lm_head.weight"] = t["transformer.wte.weight"][::-1].copy()
    folder = write_folder(tmp_path / "raven", hf_config, t, tokenizer=False)
    config, weights, inv_freq, ckpt = plan_and_weights(folder)
    windows = token_windows(np.arange(40) % 250, config.max_seq_len)
    with ckpt:
        grams = input_grams(config, weights, windows, inv_freq)
        seen = []
        forward(config, weights, windows, inv_freq, lambda name, x: seen.append(name))
    out = str(tmp_path / "m.tinyloop")
    tinyloop.convert(folder, out, "int4", group_size=GROUP)
    linears = {name[:-2] for name in load_model(out)[1] if name.endswith(".m")}
    assert set(grams) == linears
    assert seen.count("core.0.attn_qkv") == config.default_loops == 3
    assert seen.count("pre.0.attn_qkv") == seen.count("head") == 1
    for name, gram in grams.items():
        assert np.allclose(gram, gram.T) and np.all(np.diag(gram) >= 0), name


def test_token_windows():
    assert token_windows(np.arange(10), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert token_windows(np.arange(3), 64).tolist() == [[0, 1, 2]]
    assert token_windows(np.arange(2 * WINDOW + 5), 4096).shape == (2, WINDOW)
    with pytest.raises(ValueError, match="no tokens"):
        token_windows(np.arange(0), 64)


# ---- convert --gptq -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ouro_folder(tmp_path_factory):
    config, tensors = checkpoint("OuroForCausalLM")
    return write_folder(tmp_path_factory.mktemp("hf") / "ouro-tiny", config, tensors)


@pytest.fixture(scope="module")
def gptq_file(ouro_folder, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gptq") / "gptq.tinyloop")
    tinyloop.convert(ouro_folder, out, "int4", group_size=GROUP, gptq=True)
    return out


def test_a_gptq_file_differs_from_rtn_only_in_the_int4_linears(ouro_folder, gptq_file, tmp_path):
    rtn_path = str(tmp_path / "rtn.tinyloop")
    tinyloop.convert(ouro_folder, rtn_path, "int4", group_size=GROUP)
    (config, gptq), (rtn_config, rtn) = load_model(gptq_file), load_model(rtn_path)
    assert config == rtn_config and list(gptq) == list(rtn)
    changed = {name for name in gptq if not np.array_equal(gptq[name], rtn[name])}
    assert changed and all(name.endswith((".w", ".m")) and name != "tok_emb.w"
                           for name in changed)
    assert any(name.startswith("core.") for name in changed) and "head.w" in changed


def test_every_backend_runs_a_gptq_file_bit_identically(gptq_file, backend):
    prompt = [5, 6, 7, 200, 31]
    with tinyloop.Model(gptq_file, backend="numpy") as reference:
        expected = reference.logits(prompt)
    with tinyloop.Model(gptq_file, backend=backend) as model:
        got = model.logits(prompt)
    assert np.isfinite(expected).all()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_the_calibration_text_changes_the_result(ouro_folder, gptq_file, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i % 37 + 3}" for i in range(600)))
    out = str(tmp_path / "own.tinyloop")
    tinyloop.convert(ouro_folder, out, "int4", group_size=GROUP, gptq=True, calibration=text)
    own, default = load_model(out)[1], load_model(gptq_file)[1]
    assert not np.array_equal(own["core.0.attn_qkv.w"], default["core.0.attn_qkv.w"])


def test_the_cli_flag_converts_end_to_end(ouro_folder, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(400)))
    out = str(tmp_path / "cli.tinyloop")
    code, printed = run("convert", ouro_folder, out, "--format", "int4", "--group-size",
                        str(GROUP), "--gptq", "--calibration", str(text))
    assert code == 0 and printed.startswith(f"wrote {out}: ouro-tiny, int4")
    api = str(tmp_path / "api.tinyloop")
    tinyloop.convert(ouro_folder, api, "int4", group_size=GROUP, gptq=True, calibration=text)
    with open(out, "rb") as a, open(api, "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("argv, message", [
    (["--gptq"], "gptq applies to int4 weights only (--format int4), not 'int8'"),
    (["--format", "int4", "--calibration", "x.txt"], "a calibration file applies to gptq only"),
    (["--format", "int4", "--gptq", "--calibration", "{tmp}/missing.txt"],
     "calibration file {tmp}/missing.txt does not exist"),
    (["--format", "int4", "--gptq", "--calibration", "{tmp}/empty.txt"],
     "calibration file {tmp}/empty.txt is empty"),
    (["--format", "int4", "--gptq", "--calibration", "{tmp}"], "calibration file {tmp}: "),
])
def test_bad_gptq_options_exit_2_and_write_nothing(ouro_folder, tmp_path, capsys, argv, message):
    (tmp_path / "empty.txt").write_text(" \n")
    out = tmp_path / "m.tinyloop"
    code, text = run("convert", ouro_folder, str(out),
                     *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and text == ""
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not out.exists()


def test_a_model_without_tokenizer_needs_byte_sized_vocab(tmp_path):
    hf_config, t = checkpoint("OuroForCausalLM", vocab_size=200)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:200]
    t["lm_head.weight"] = t["lm_head.weight"][:200]
    folder = write_folder(tmp_path / "small", hf_config, t, tokenizer=False)
    with pytest.raises(ConvertError, match="has no tokenizer and 200 token ids"):
        tinyloop.convert(folder, str(tmp_path / "m.tinyloop"), "int4", gptq=True)
