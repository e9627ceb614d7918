"""The command line: the demo (main job), generate, info and bench, exit codes for scripts, the
checks that run before any output, and help that states every default."""
import io
import os
import re
import subprocess
import sys

import pytest

import tinyloop
from tinyloop import quickbench
from tinyloop.cli import build_parser, main

COMMANDS = ("demo", "generate", "chat", "info", "bench")


def run(*argv):
    """(exit code, stdout) of `tinyloop argv`; argparse's own exits give their code too."""
    out = io.StringIO()
    try:
        return main(list(argv), out=out), out.getvalue()
    except SystemExit as exc:
        return exc.code, out.getvalue()


def run_on_one_stream(monkeypatch, *argv):
    """(exit code, stdout and stderr interleaved as a terminal shows them)."""
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    try:
        code = main(list(argv), out=stream)
    except SystemExit as exc:
        code = exc.code
    return code, stream.getvalue()


@pytest.fixture(scope="module")
def small(model_files):
    """(path, config) of a small random model (no tokenizer: prompts are token ids)."""
    path = str(model_files["int8-gqa"])
    with tinyloop.Model(path, backend="numpy") as model:
        return path, model.config()


def test_demo_shows_answers_timings_and_identical_tokens():
    code, text = run("demo", "--max-tokens", "6", "--backend", "numpy")
    assert code == 0
    assert "> And God said" in text and "speedup" in text
    for row in ("no prefix cache", "PrefixCache (explicit)", "automatic prefix cache"):
        assert row in text
    hits = int(text.split("prompt tokens were cache hits")[0].split()[-1])
    assert hits > 0
    assert "identical tokens with and without the cache: yes" in text


def test_generate_text_and_ids(small):
    code, text = run("generate", "The ", "--max-tokens", "5", "--seed", "1", "--backend", "numpy")
    assert code == 0 and text.startswith("The ")
    code, text = run("generate", "1,2 3", "--ids", "--model", small[0], "--max-tokens", "4",
                     "--temperature", "0", "--backend", "numpy")
    assert code == 0 and len(text.split()) == 4


def test_generate_prefix_lm_runs_the_prompt_as_an_instruction_block(small):
    prompt = [1, 7, 2, 9, 4, 3]
    code, text = run("generate", ",".join(map(str, prompt)), "--ids", "--prefix-lm", "--model",
                     small[0], "--max-tokens", "6", "--temperature", "0", "--backend", "numpy")
    with tinyloop.Model(small[0], backend="numpy") as model:
        want = model.generate(prompt, max_tokens=6, instruction_length=len(prompt))[len(prompt):]
        assert want != model.generate(prompt, max_tokens=6)[len(prompt):]   # the flag matters
    assert code == 0 and [int(t) for t in text.split()] == want


def test_info_names_model_and_backend():
    code, text = run("info", "--backend", "numpy")
    assert code == 0 and "tinyloop-demo" in text and "backend: numpy" in text


def test_info_lists_the_cpu_isas_and_the_one_the_model_runs(monkeypatch):
    """Each ISA path the library runs here, scalar first, as TINYLOOP_ISA names them; the
    runtime line names the one in use, which TINYLOOP_ISA forces."""
    if "native" not in tinyloop.backend_features:
        pytest.skip("no native library: info lists no ISA")
    monkeypatch.delenv("TINYLOOP_ISA", raising=False)
    code, text = run("info", "--backend", "native")
    assert code == 0
    isas = re.search(r"^ +cpu isas: (.+)$", text, re.M).group(1).split(", ")
    assert isas[0] == "scalar" and len(set(isas)) == len(isas)
    features = {f for f in tinyloop.backend_features if f.startswith("native-")} - {"native-cuda"}
    assert {f"native-{isa}" for isa in isas[1:]} == features
    in_use = re.search(r"^ +runtime: ([\w-]+) kernels, ", text, re.M).group(1)
    assert in_use in isas
    monkeypatch.setenv("TINYLOOP_ISA", "scalar")
    code, text = run("info", "--backend", "native")
    assert code == 0 and re.search(r"^ +runtime: scalar kernels, ", text, re.M), text
    listed = re.escape(", ".join(isas))
    assert re.search(rf"^ +cpu isas: {listed} \(TINYLOOP_ISA=scalar forces the native path\)$",
                     text, re.M), text


# (arguments, the message): "SMALL" stands for --model of the `small` model, and the message's
# {fields} are that model's config; without SMALL the command runs the bundled demo model.
BAD_INPUTS = [
    (["generate", "1,abc", "--ids", "SMALL"],
     "the prompt: 'abc' is not a token id; give integers separated by commas or spaces"),
    (["generate", "1 2 {vocab_size}", "SMALL"],
     "the prompt: token id {vocab_size} at index 2 is out of range [0, {vocab_size})"),
    (["generate", "1,-1", "SMALL"], "the prompt: token id -1 at index 1 is out of range"),
    (["generate", " , ", "SMALL"], "the prompt is empty"),
    (["generate", "1,2", "--stop", "3,x", "SMALL"], "--stop '3,x': 'x' is not a token id"),
    (["generate", "1,2", "--stop", "", "SMALL"], "--stop '' is empty"),
    (["generate", "1,2", "--max-tokens", "{max_seq_len}", "SMALL"],
     "the prompt (2 tokens) plus --max-tokens {max_seq_len} exceeds the model's max_seq_len {max_seq_len}"),
    (["generate", "x" * 1000],
     "the prompt (1000 tokens) plus --max-tokens 64 exceeds the model's max_seq_len 1024"),
    (["generate", "1", "--loops", "0", "SMALL"],
     "argument --loops: must be an integer from 1 to 1024, got 0"),
    (["generate", "1", "--loops", "1025", "SMALL"], "argument --loops: must be an integer from 1 to 1024"),
    (["generate", "1", "--max-tokens", "0", "SMALL"],
     "argument --max-tokens: must be an integer >= 1, got 0"),
    (["generate", "1", "--max-tokens", "1.5", "SMALL"], "argument --max-tokens: '1.5' is not an integer"),
    (["generate", "1", "--temperature", "-1", "SMALL"],
     "argument --temperature: must be a finite number >= 0, got -1"),
    (["generate", "1", "--temperature", "nan", "SMALL"], "argument --temperature: must be a finite number"),
    (["generate", "1", "--temperature", "hot", "SMALL"], "argument --temperature: 'hot' is not a number"),
    (["generate", "1", "--top-k", "-1", "SMALL"], "argument --top-k: must be an integer >= 0, got -1"),
    (["generate", "1", "--top-p", "1.5", "SMALL"],
     "argument --top-p: must be a finite number > 0 and <= 1, got 1.5"),
    (["generate", "1", "--top-p", "0", "SMALL"], "argument --top-p: must be a finite number > 0"),
    (["generate", "1", "--repetition-penalty", "0", "SMALL"],
     "argument --repetition-penalty: must be a finite number > 0"),
    (["generate", "1", "--cache-window", "-1", "SMALL"], "argument --cache-window: must be an integer >= 0"),
    (["generate", "1", "--seed", str(1 << 64), "SMALL"], "argument --seed: must be an integer from 0 to"),
    (["generate", "1", "--draft-loops", "3", "SMALL"],
     "draft_loops must be in 1 .. loops-1 (loops=3), got 3"),
    (["generate", "1", "--draft-loops", "0", "SMALL"],
     "argument --draft-loops: must be an integer from 1 to 1024, got 0"),
    (["generate", "1", "--n-draft", "2", "SMALL"], "n_draft > 0 needs draft_loops"),
    (["generate", "1", "--draft-loops", "1", "--n-draft", "65", "SMALL"],
     "argument --n-draft: must be an integer from 0 to 64, got 65"),
    (["generate", "1", "--threads", "0", "SMALL"], "argument --threads: must be an integer >= 1, got 0"),
    (["generate", "1", "--backend", "nope", "SMALL"], "argument --backend: invalid choice: 'nope'"),
    (["generate", "1", "--model", "/nonexistent.tinyloop"],
     "argument --model: no such file: '/nonexistent.tinyloop'"),
    (["info", "--model", "/"], "argument --model: '/' is a directory, not a .tinyloop file"),
    (["demo", "--max-tokens", "900"], "--max-tokens 900: the longest demo prompt"),
    (["bench", "--n", "0", "SMALL"], "argument --n: must be an integer >= 1, got 0"),
    (["bench", "--prefill", "8", "--prefix", "{max_seq_len}", "--decode", "1", "SMALL"],
     "--prefix {max_seq_len} plus --decode 1 exceeds the model's max_seq_len {max_seq_len}"),
    (["bench", "--prefill", "{max_seq_len}", "SMALL"], "--prefill {max_seq_len} plus --decode 32 exceeds"),
    (["nonsense"], "argument command: invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a)[:40] for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_a_message_before_any_output(monkeypatch, small, argv, message):
    path, cfg = small
    model = ["--model", path] if "SMALL" in argv else []
    argv = [a.format(**cfg) for a in argv if a != "SMALL"]
    if argv[0] != "nonsense":
        argv += model + ["--backend", "numpy"]
    code, text = run_on_one_stream(monkeypatch, *argv)
    assert code == 2
    assert message.format(**cfg) in text
    # Nothing but bench's progress lines comes before the error, so it starts its own line.
    first, *_ = [line for line in text.splitlines() if not line.startswith("bench: ")]
    assert first.startswith(("usage: tinyloop", "tinyloop: error: ")), text


def test_a_failure_after_output_is_on_its_own_line_and_exits_1(monkeypatch):
    def fails_after_one_token(self, prompt, on_token=None, **kwargs):
        on_token(ord("!"))
        raise RuntimeError("the device went away")

    monkeypatch.setattr(tinyloop.Model, "generate", fails_after_one_token)
    code, text = run_on_one_stream(monkeypatch, "generate", "Hi", "--backend", "numpy")
    assert code == 1
    assert text == "Hi!\ntinyloop: error: the device went away\n"


def test_generate_stops_reads_stdin_and_reports_reuse(small, monkeypatch, capsys):
    common = ("--ids", "--model", small[0], "--temperature", "0", "--backend", "numpy")
    _, text = run("generate", "1,2,3", "--max-tokens", "6", *common)
    first = text.split()[0]
    code, text = run("generate", "1,2,3", "--max-tokens", "6", "--stop", first, *common)
    assert code == 0 and text.split() == [first]
    monkeypatch.setattr("sys.stdin", io.StringIO("1,2,3"))
    code, text = run("generate", "-", "--max-tokens", "6", *common)
    assert code == 0 and text.split()[0] == first
    assert "reused 0," in capsys.readouterr().err


def test_generate_drafts_with_draft_loops_and_reports_the_acceptance(small, capsys):
    common = ("1,2,3", "--ids", "--model", small[0], "--max-tokens", "9", "--temperature", "1",
              "--seed", "4", "--backend", "numpy")
    code, plain = run("generate", *common)
    assert code == 0 and "draft" not in capsys.readouterr().err
    code, text = run("generate", *common, "--loops", "3", "--draft-loops", "2", "--n-draft", "3")
    assert code == 0 and text == plain
    report = re.search(r"^\[draft loops 2: drafted (\d+), accepted (\d+), acceptance rate "
                       r"(\d\.\d\d)\]$", capsys.readouterr().err, re.M)
    drafted, accepted, rate = int(report[1]), int(report[2]), float(report[3])
    assert 8 <= drafted <= 24 and accepted <= 8 and rate == round(accepted / drafted, 2)


def test_generate_shows_prefill_progress_then_the_prompt(monkeypatch):
    prompt = "The" * 300
    code, text = run_on_one_stream(monkeypatch, "generate", prompt, "--max-tokens", "1",
                                   "--progress", "always", "--backend", "numpy", "--seed", "0")
    assert code == 0
    assert text.startswith("prefill 256/900 tokens\n")
    # The prompt is echoed once the prefill is done: on a terminal, the progress line is
    # rewritten in place and would overwrite the prompt's last line.
    assert text.index("prefill 900/900 tokens\n") < text.index(prompt)


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tinyloop.Model, "generate", interrupted)
    code, _ = run("generate", "The", "--backend", "numpy")
    assert code == 130 and "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["info"], ["generate", "And God said", "--max-tokens", "4"]])
def test_a_closed_pipe_exits_quietly(argv):
    """`tinyloop info | head`: the reader is gone before the first write. The command exits
    with 128 + SIGPIPE and writes no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "tinyloop", *argv, "--backend", "numpy"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def help_entries(text):
    """{option: its help text, whitespace collapsed} from an argparse --help page."""
    entries, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            current = match.group(1)
            entries[current] = ""
        if current:
            entries[current] += " " + line
    return {option: " ".join(entry.split()) for option, entry in entries.items()}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_every_default(command, capsys):
    code, _ = run(command, "--help")
    entries = help_entries(capsys.readouterr().out)
    required = ["prompt"] if command == "generate" else []
    defaults = vars(build_parser().parse_args([command, *required]))
    assert "--model" in entries and len(entries) > 4
    for option, entry in entries.items():
        if option == "-h":
            continue
        assert "(default: " in entry, entry
        default = defaults[option.lstrip("-").replace("-", "_")]
        if default is not None and not isinstance(default, (bool, list)):
            assert f"(default: {default})" in entry, entry
    assert code == 0


def test_top_level_help_lists_every_command_with_its_purpose(capsys):
    code, _ = run("--help")
    text = capsys.readouterr().out
    assert code == 0
    for command in COMMANDS:
        line = next(line for line in text.splitlines() if line.split()[:1] == [command])
        assert len(line.split()) > 2, line


def test_bench_names_its_model_shows_progress_and_checks_tokens(small, capsys):
    path, cfg = small
    code, text = run("bench", "--model", path, "--backend", "numpy", "--prefill", "8",
                     "--decode", "2", "--prefix", "8", "--n", "2")
    err = capsys.readouterr().err
    assert code == 0
    assert text.startswith(f"model {cfg['name']}: d_model {cfg['d_model']}, ")
    assert f"({path}), backend numpy" in text.splitlines()[0]
    assert "prefill 8 tokens" in text and "SHARED" in text and "identical tokens: yes" in text
    stages = [line.split(":")[1].strip() for line in err.splitlines() if line.startswith("bench: ")]
    assert stages == ["opening " + path, "prefill speed", "decode speed", "bound", "bound",
                      "no_cache", "shared", "batched"]


def test_bench_without_a_model_says_it_writes_a_random_one(monkeypatch, capsys):
    monkeypatch.delenv("TINYLOOP_BENCH_MODELS", raising=False)
    monkeypatch.setitem(quickbench.SHAPES, "quick", dict(
        vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
        n_pre_blocks=1, default_loops=2, max_seq_len=64))
    code, text = run("bench", "--backend", "numpy", "--prefill", "4", "--decode", "1",
                     "--prefix", "4", "--n", "1")
    err = capsys.readouterr().err
    assert code == 0
    assert text.startswith("model bench-quick-int8: d_model 16, ")
    assert "(random weights, the quick shape)" in text.splitlines()[0]
    assert err.startswith("bench: writing a random quick-shape int8 model to ")


def test_info_without_the_native_library_says_none(monkeypatch):
    from tinyloop._library import LibraryUnavailable
    monkeypatch.setattr("tinyloop.backends._native", {"error": LibraryUnavailable("not here")})
    code, text = run("info", "--backend", "numpy")
    assert code == 0
    assert re.search(r"^ +library: none$", text, re.M), text
    assert re.search(r"^ +cuda: not here$", text, re.M), text


def test_bench_refuses_lengths_beyond_the_quick_shape_before_writing_its_model(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the random model was written before the check")

    monkeypatch.setattr("tinyloop.cli.bench_model", no_model)
    limit = quickbench.SHAPES["quick"]["max_seq_len"]
    code, text = run_on_one_stream(monkeypatch, "bench", "--prefix", str(limit), "--decode", "1",
                                   "--backend", "numpy")
    assert code == 2
    assert text == (f"tinyloop: error: --prefix {limit} plus --decode 1 exceeds the model's "
                    f"max_seq_len {limit}\n")


# -- convert (a Hugging Face folder, docs/models.md) and the architecture lines of info -----
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random Ouro-layout folder (tests/hf_folders.py)."""
    from hf_folders import checkpoint, write_folder
    config, tensors = checkpoint("OuroForCausalLM")
    return write_folder(tmp_path_factory.mktemp("hf") / "ouro-tiny", config, tensors)


def test_convert_shows_progress_then_info_shows_the_architecture(hf_folder, tmp_path, capsys):
    out = str(tmp_path / "ouro.tinyloop")
    code, text = run("convert", hf_folder, out, "--format", "int4", "--group-size", "16",
                     "--loops", "2")
    progress = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("convert ")]
    assert code == 0 and text.startswith(f"wrote {out}: ouro-tiny, int4, prelude 0 + core 3 x 2")
    total = len(progress)
    assert progress[0].startswith(f"convert 1/{total}: final_norm <- model.norm.weight")
    assert progress[-1].startswith(f"convert {total}/{total}: exit_gate_bias <- "
                                   "model.early_exit_gate.bias")
    code, text = run("info", "--model", out, "--backend", "numpy")
    assert code == 0
    for line in ("architecture: OuroForCausalLM",
                 "layers: prelude 0, core 3 x 2 loops, coda 0: 6 cache layers at depth 2",
                 "blocks: sandwich norms, no bias, 4 heads x 8, 2 kv heads",
                 "activations: int8 in blocks of 32 (integer multipliers of one row scale)",
                 "iterations: no injection, step norm, no coda norm, embed scale 1",
                 "tokenizer: hf", "exit_gate: True", "exit_threshold: 1.0"):
        assert re.search(rf"^ +{re.escape(line)}$", text, re.M), (line, text)
    code, text = run("generate", "1 2 3", "--ids", "--model", out, "--max-tokens", "3",
                     "--temperature", "0", "--backend", "numpy")
    assert code == 0 and len(text.split()) == 3


def test_info_shows_a_two_state_core_and_the_attention_gate(tmp_path):
    from hf_folders import checkpoint, write_folder
    config, tensors = checkpoint("HrmTextForCausalLM")
    src = write_folder(tmp_path / "hrm-tiny", config, tensors)
    out = str(tmp_path / "hrm.tinyloop")
    code, text = run("convert", src, out)
    assert code == 0 and text.startswith(f"wrote {out}: hrm-tiny, int8, prelude 0 + core 4 x 2")
    code, text = run("info", "--model", out, "--backend", "numpy")
    assert code == 0
    for line in ("architecture: HrmTextForCausalLM",
                 "layers: prelude 0, core of two stacks of 2 (2 low cycles, then the high "
                 "stack) x 2 loops, coda 0: 12 cache layers at depth 2",
                 "blocks: pre norms, no bias, 4 heads x 8, 4 kv heads, attention gate",
                 "iterations: no injection, no step norm, no coda norm, embed scale 50"):
        assert re.search(rf"^ +{re.escape(line)}$", text, re.M), (line, text)


def test_info_shows_loop_attention(tmp_path):
    from hf_folders import checkpoint, write_folder
    config, tensors = checkpoint("IQuestLoopCoderForCausalLM")
    src = write_folder(tmp_path / "iquest-tiny", config, tensors)
    out = str(tmp_path / "iquest.tinyloop")
    assert run("convert", src, out)[0] == 0
    code, text = run("info", "--model", out, "--backend", "numpy")
    assert code == 0
    for line in ("architecture: IQuestLoopCoderForCausalLM",
                 "layers: prelude 0, core 3 x 2 loops, coda 0: 6 cache layers at depth 2",
                 "blocks: pre norms, no bias, 4 heads x 8, 2 kv heads, loop attention (window 8)"):
        assert re.search(rf"^ +{re.escape(line)}$", text, re.M), (line, text)


def test_info_of_a_model_made_by_tinyloop():
    code, text = run("info", "--backend", "numpy")
    assert code == 0
    assert re.search(r"^ +architecture: not recorded \(made by TinyLoop\)$", text, re.M), text
    assert re.search(r"^ +layers: prelude \d+, core 1 x \d+ loops, coda 0: ", text, re.M), text


@pytest.mark.parametrize("argv, block, line", [
    (["--act-block", "8"], 8, "int8 in blocks of 8 (integer multipliers of one row scale)"),
    (["--act-block", "0"], 0, "int8, one scale per row")])
def test_convert_act_block_overrides_the_default(hf_folder, tmp_path, argv, block, line):
    out = str(tmp_path / "ouro-act.tinyloop")
    assert run("convert", hf_folder, out, *argv)[0] == 0
    code, text = run("info", "--model", out, "--backend", "numpy")
    assert code == 0 and re.search(rf"^ +activations: {re.escape(line)}$", text, re.M), text
    with tinyloop.Model(out, backend="numpy") as model:
        assert model.config()["act_block"] == block


@pytest.mark.parametrize("argv, message", [
    (["--act-block", "7"], "act_block: must divide d_model"),
    (["--act-block", "-1"], "argument --act-block: must be an integer from 0 to 65536"),
    (["--core", "3"], "argument --core: '3' is not START:END"),
    (["--core", "0:2"], "--core applies to plain LLaMA-family models only"),
    (["--group-size", "16"], "group_size 16 applies to int4 only"),
    (["--loops", "0"], "argument --loops: must be an integer from 1"),
])
def test_convert_errors_exit_2_and_write_nothing(hf_folder, tmp_path, capsys, argv, message):
    out = tmp_path / "m.tinyloop"
    code, text = run("convert", hf_folder, str(out), *argv)
    assert code == 2 and text == "" and message in capsys.readouterr().err
    assert not out.exists()


def test_convert_help_states_every_default(capsys):
    code, _ = run("convert", "--help")
    entries = help_entries(capsys.readouterr().out)
    assert code == 0 and set(entries) >= {"--format", "--group-size", "--loops", "--core",
                                          "--max-seq-len", "--act-block"}
    for option, entry in entries.items():
        assert option == "-h" or "(default: " in entry, entry
