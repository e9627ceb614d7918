"""The command line: the demo (main job), generate, info and bench, and exit codes for scripts."""
import io

import pytest

import tinyloop
from tinyloop.cli import main


def run(*argv):
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_demo_shows_answers_timings_and_identical_tokens():
    code, text = run("demo", "--max-tokens", "6", "--backend", "numpy")
    assert code == 0
    assert "> And God said" in text and "speedup" in text
    for row in ("no prefix cache", "PrefixCache (explicit)", "automatic prefix cache"):
        assert row in text
    hits = int(text.split("prompt tokens were cache hits")[0].split()[-1])
    assert hits > 0
    assert "identical tokens with and without the cache: yes" in text


def test_generate_text_and_ids(model_files):
    code, text = run("generate", "The ", "--max-tokens", "5", "--seed", "1", "--backend", "numpy")
    assert code == 0 and text.startswith("The ")
    code, text = run("generate", "1,2,3", "--ids", "--model", str(model_files["int8-gqa"]),
                     "--max-tokens", "4", "--temperature", "0", "--backend", "numpy")
    assert code == 0 and len(text.split()) == 4


def test_info_names_model_and_backend():
    code, text = run("info", "--backend", "numpy")
    assert code == 0 and "tinyloop-demo" in text and "backend: numpy" in text


def test_bad_input_exits_2_with_a_message(capsys, model_files):
    code, _ = run("generate", "1,2,999", "--ids", "--model", str(model_files["int8-gqa"]),
                  "--backend", "numpy")
    assert code == 2 and "token id 999" in capsys.readouterr().err
    code, _ = run("generate", "x", "--model", "/nonexistent.tinyloop")
    assert code == 2
    with pytest.raises(SystemExit) as exit_info:
        run("nonsense")
    assert exit_info.value.code == 2


def test_generate_stops_reads_stdin_and_reports_reuse(model_files, monkeypatch, capsys):
    model = str(model_files["int8-gqa"])
    common = ("--ids", "--model", model, "--temperature", "0", "--backend", "numpy")
    _, text = run("generate", "1,2,3", "--max-tokens", "6", *common)
    first = text.split()[0]
    code, text = run("generate", "1,2,3", "--max-tokens", "6", "--stop", first, *common)
    assert code == 0 and text.split() == [first]
    monkeypatch.setattr("sys.stdin", io.StringIO("1,2,3"))
    code, text = run("generate", "-", "--max-tokens", "6", *common)
    assert code == 0 and text.split()[0] == first
    assert "reused 0," in capsys.readouterr().err


def test_generate_shows_prefill_progress(capsys):
    code, _ = run("generate", "The" * 300, "--max-tokens", "1", "--progress", "always",
                  "--backend", "numpy", "--seed", "0")
    err = capsys.readouterr().err
    assert code == 0
    assert "prefill 256/900 tokens" in err and "prefill 900/900 tokens" in err


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tinyloop.Model, "generate", interrupted)
    code, _ = run("generate", "The", "--backend", "numpy")
    assert code == 130 and "interrupted" in capsys.readouterr().err


def test_bench_measures_and_checks_tokens(model_files):
    code, text = run("bench", "--model", str(model_files["int8-gqa"]), "--backend", "numpy",
                     "--prefill", "32", "--decode", "3", "--prefix", "40", "--n", "3")
    assert code == 0
    assert "prefill 32 tokens" in text and "SHARED" in text and "identical tokens: yes" in text
