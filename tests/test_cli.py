"""The command line: the demo (main job), generate and info, and exit codes for scripts."""
import io

import pytest

from tinyloop.cli import main


def run(*argv):
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_demo_shows_answers_timings_and_identical_tokens():
    code, text = run("demo", "--max-tokens", "6", "--backend", "numpy")
    assert code == 0
    assert "> And God said" in text and "speedup" in text
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
