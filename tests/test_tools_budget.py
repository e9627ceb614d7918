"""tools/fidelity_budget.py's stage machinery on tiny Ouro- and Huginn-layout checkpoints.

The tool's numbers are only worth reading if its simulated stages are the computations they
name: stage 0 (its own float forward of the converted layout) is the published reference,
stage 1 (the file's int8 weights) costs something but little, the simulation of everything
TinyLoop quantizes (stage 4) lands next to TinyLoop itself (stage 5, which adds only the
fixed-point softmax and f32 arithmetic) at a depth of a few layers (deeper, a quantizer's
rounding that f32 and float64 decide differently compounds like any other perturbation, so
the tiny Huginn runs one recurrence), stage 5 is the model's own logits, and the planted
outliers do stand out in the residual stream and hurt per-row activation scales. A few seconds
on the native backend; needs torch and safetensors (the bf16 checkpoint).
"""
import os
import sys

import numpy as np
import pytest

import tinyloop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import fidelity_budget as budget                                # noqa: E402

TINY = {"ouro-1.4b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, head_dim=16, intermediate_size=128,
                          vocab_size=256, total_ut_steps=3),
        "huginn-0125": dict(n_embd=64, n_heads=4, num_key_value_heads=4, head_dim=16,
                            intermediate_size=128, vocab_size=256, padded_vocab_size=256,
                            mean_recurrence=1, bos_token_id=1, eos_token_id=2,
                            init_values={"std": 0.079, "out_proj": 0.079, "embedding": 0.079,
                                         "embed_scale": 8.0})}
# (Huginn's: takase's std for n_embd 64; out_proj not shrunk for depth, so that these narrow
# sublayers write into the stream about as much, relative to it, as the published width's do)
TOKENS = np.random.default_rng(3).integers(0, 256, 12).tolist()
CHANNELS = (5, 40)


def tiny_run(tmp_path, model, channels=(), name="m", weight_format="int8"):
    shape = budget.MODELS[model]
    recipe = budget.Recipe(shape.init, shape.residual_writers, shape.residual_readers, 0,
                           channels, 50.0)
    folder = budget.write_checkpoint(str(tmp_path / name), {**shape.config, **TINY[model]},
                                     recipe)
    return budget.run_stages(folder, weight_format, TOKENS, "native")


def require_torch_and_native():
    pytest.importorskip("torch")
    if "native" not in tinyloop.backend_features:
        pytest.skip("the native backend is not built here")


@pytest.fixture(scope="module", params=sorted(TINY))
def runs(request, tmp_path_factory):
    require_torch_and_native()
    tmp = tmp_path_factory.mktemp("budget")
    return (tiny_run(tmp, request.param, name="plain"),
            tiny_run(tmp, request.param, CHANNELS, name="outliers"),
            tiny_run(tmp, request.param, name="int4", weight_format="int4"))


def test_stages_measure_what_they_name(runs):
    run = runs[0]
    table = budget.summary(run)["stages"]
    assert run.stage0_error < 1e-9
    assert 0.9 < table["1"]["cosine_mean"] < 1 - 1e-7       # int8 weights cost, but little
    for simulated, engine in (("4", "5"), ("4'", "5'")):
        assert budget.cosines(run.logits[simulated], run.logits[engine]).min() > 0.999
    assert not np.array_equal(run.logits["5"], run.logits["5'"])


def test_tinyloop_stage_is_the_models_own_logits(runs):
    run = runs[0]
    for label, kv_mode in (("5", "int8"), ("5'", "int4")):
        with tinyloop.Model(run.path, backend="native", kv_mode=kv_mode) as m:
            np.testing.assert_array_equal(run.logits[label], m.logits(TOKENS))


def test_block_activation_stages_are_an_act_block_files_own_logits(runs):
    run = runs[0]
    path = run.path.replace(".tinyloop", f".act{budget.BLOCK}.tinyloop")
    with tinyloop.Model(path, backend="native") as m:
        assert m.config()["act_block"] == budget.BLOCK
        np.testing.assert_array_equal(run.logits["6"], m.logits(TOKENS))
    assert not np.array_equal(run.logits["5"], run.logits["6"])


def test_block_activations_recover_what_planted_outliers_cost(tmp_path):
    # Huginn's tiny shape: its post-normed stream keeps the comparison out of the noise that
    # 12 positions of the tiny chaotic Ouro carry (there int8 KV alone moves the cosine 0.015)
    require_torch_and_native()
    planted = budget.summary(tiny_run(tmp_path, "huginn-0125", CHANNELS), CHANNELS)["stages"]
    loss = {label: 1 - planted[label]["cosine_mean"] for label in ("5", "6")}
    assert loss["6"] < loss["5"] / 2, loss


def test_int4_weights_cost_more_than_int8(runs):
    int8, int4 = (budget.summary(run)["stages"]["1"]["cosine_mean"] for run in (runs[0], runs[2]))
    assert 0.9 < int4 < int8, (int4, int8)


def test_planted_outliers_stand_out_and_cost_per_row_scales(runs):
    plain, planted = runs[:2]
    assert budget.summary(planted, CHANNELS)["outlier_ratio"] > 10
    loss = {name: 1 - budget.summary(run)["stages"]["A"]["cosine_mean"]
            for name, run in (("plain", plain), ("planted", planted))}
    assert loss["planted"] > 3 * loss["plain"], loss


def test_quantize_rows_and_blocks():
    x = np.array([[1.0, -0.5, 0.25, 0.0, 100.0, 3.0]])
    np.testing.assert_array_equal(budget.quantize(x, 127),
                                  np.rint(x * 127 / 100) * (100 / 127))
    blocks = budget.quantize(x, 7, block=4)                  # blocks [0:4] and [4:6] (padded)
    np.testing.assert_array_equal(blocks[:, :4], budget.quantize(x[:, :4], 7))
    np.testing.assert_array_equal(blocks[:, 4:], budget.quantize(x[:, 4:], 7))
    np.testing.assert_array_equal(budget.quantize(np.zeros((2, 3)), 127), np.zeros((2, 3)))


def test_markdown_has_a_row_per_stage(runs):
    plain, planted = runs[:2]
    result = {"model": "tiny", "weight_format": "int8", "backend": "native", "seed": 0,
              "positions": len(TOKENS), "outlier_channels": list(CHANNELS), "outlier_scale": 50.0,
              "depths": {"full": budget.summary(planted, CHANNELS),
                         "2 layers": budget.summary(plain, CHANNELS)}}
    lines = budget.markdown(result, "python tools/fidelity_budget.py", "a CPU", 1.0).splitlines()
    rows = [line for line in lines if line.startswith("| ") and "stage" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [label for label, _, _ in budget.STAGES]
    assert "planted outlier channels [5, 40] x 50" in lines[2]
