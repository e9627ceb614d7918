"""bench/bench_adaptive_trained.py on tiny random Ouro (with an exit gate) and Huginn checkpoints,
in a small mode (short windows, random "held-out" bytes, the numpy backend): one row per fixed
depth and per threshold, loops within 1..L, fixed depths scoring the same teacher-forced and
decoded, a gate at 1 being full depth. Results go to a temporary folder, not bench/results/."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_folders import checkpoint, write_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_adaptive_trained as bench  # noqa: E402
import common  # noqa: E402


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adaptive")
    ouro = write_folder(tmp / "ouro", *checkpoint("OuroForCausalLM", eos_token_id=None))
    huginn = write_folder(tmp / "huginn", *checkpoint("RavenForCausalLM", eos_token_id=None))
    text = np.random.default_rng(2).integers(0, 256, 200, dtype=np.uint8).tobytes()
    patch = pytest.MonkeyPatch()
    patch.setattr(bench, "WINDOW", 20)
    patch.setattr(bench, "PROMPT_BYTES", 6)
    patch.setattr(bench, "split_corpus", lambda: (b"", text))
    patch.setattr(common, "RESULTS", tmp / "results")
    try:
        assert bench.main(["--ouro", ouro, "--huginn", f"h={huginn}", "--huginn-loops", "2,3",
                           "--backend", "numpy", "--windows", "2", "--prompts", "1",
                           "--tokens", "3", "--repeats", "1", "--gate-thresholds", "0.5,1",
                           "--latent-thresholds", "0.1", "--kl-thresholds", "1e30",
                           "--name", "t"]) == 0
    finally:
        patch.undo()
    return json.loads((tmp / "results" / "t.json").read_text())["rows"]


def test_a_row_per_fixed_depth_and_threshold(table):
    keys = [(r["model"], r["L"], r["rule"], r["threshold"]) for r in table]
    assert keys == ([("ouro", 3, "fixed", "")] * 3
                    + [("ouro", 3, "gate", 0.5), ("ouro", 3, "gate", 1.0)]
                    + [("h", 2, "fixed", "")] * 2 + [("h", 2, "latent", 0.1)]
                    + [("h", 3, "fixed", "")] * 3 + [("h", 3, "latent", 0.1)]
                    + [("h", 2, "fixed", "")] * 2 + [("h", 2, "kl", 1e30)]
                    + [("h", 3, "fixed", "")] * 3 + [("h", 3, "kl", 1e30)])


def test_kl_at_an_infinite_threshold_exits_as_soon_as_it_compares(table):
    """kl compares iteration i with i - 1, so at q = 1e30 every token stops after iteration 1:
    U = 2 at L = 3 (and at L = 2, the last iteration anyway), decoded and teacher-forced."""
    for r in table:
        if r["rule"] == "kl":
            assert r["tf loops"] == r["dec loops"] == r["greedy loops"] == 2, r


def test_loops_and_bits(table):
    for r in table:
        for key in ("tf loops", "dec loops", "greedy loops"):
            assert 1 <= r[key] <= r["L"], r
        assert r["tf bpb"] > 0 and r["dec bpb"] > 0
        if r["rule"] == "fixed":
            assert r["tf bpb"] == r["dec bpb"]
    full = [r for r in table if r["model"] == "ouro" and r["rule"] == "fixed" and r["L"] == 3]
    gate_1 = [r for r in table if r["rule"] == "gate" and r["threshold"] == 1.0][0]
    assert gate_1["tf loops"] == gate_1["dec loops"] == gate_1["greedy loops"] == 3
    assert gate_1["tf bpb"] == full[-1]["tf bpb"]
    assert abs(gate_1["dec bpb"] - full[-1]["tf bpb"]) < 1e-9
