"""Shared bench helpers: result files in bench/results/, (from tinyloop.quickbench) the standard
shapes, their model files and timing, and the llama.cpp side of the comparisons: the release
the benches build and a random LLaMA GGUF equal in compute to a shape."""
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.backends import native_isas

from tinyloop.quickbench import SHAPES, best_of, bench_model as model_file

try:
    import gguf
except ImportError:
    gguf = None

__all__ = ["DEFAULT_LLAMA_DIR", "LLAMA_CPP_PYTHON", "LLAMA_QUANT", "NO_AMX_FLAGS", "RESULTS",
           "SHAPES", "best_of", "cpu_text", "exit_text", "gguf", "machine", "model_file", "tinyloop_isas",
           "tinyloop_model", "vocabulary", "vocabulary_tokens", "wordlevel_tokenizer", "write_f16_gguf",
           "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"

# The llama.cpp the benches compare with: the llama-cpp-python release whose AMX crash we
# measured (its source package vendors llama.cpp 0c1e570), built under DEFAULT_LLAMA_DIR, tuned
# for this CPU without AMX by NO_AMX_FLAGS (GCC keeps an explicit -mno-* over -march=native).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
DEFAULT_LLAMA_DIR = Path.home() / ".cache" / "tinyloop-bench"
LLAMA_QUANT = {"int8": "Q8_0", "int4": "Q4_0"}    # TinyLoop weight format -> llama.cpp type
WEIGHT_STD = 0.02


def cpu_description():
    """(lscpu's model name, the set of its CPU flags); ("unknown (why)", set()) without lscpu."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        return f"unknown (lscpu: {err})", set()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return fields.get("Model name", "unknown").strip(), set(fields.get("Flags", "").split())


PEER_FLAGS = ("avx2", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")  # what peers use


def cpu_text():
    """The CPU as the benches' notes name it: lscpu's model name, the flags that decide which
    kernels TinyLoop and its peers run (yes/no each), and the CPU count."""
    name, flags = cpu_description()
    have = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in PEER_FLAGS)
    return f"{name} ({have}), {os.cpu_count()} CPUs"


def machine():
    return f"{platform.machine()} {platform.processor() or platform.system()}, python {platform.python_version()}"


def write_results(name, rows, columns, notes="", formats=None):
    """Write bench/results/<name>.json and .md; returns the markdown table. `formats` maps a
    column to its format spec in the table (floats default to two decimals)."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"bench": name, "date": stamp, "machine": machine(), "notes": notes}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {name}", "", f"{stamp}, {machine()}. {notes}".rstrip(), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c], (formats or {}).get(c)) for c in columns)
                     + " |")
    table = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(table)
    return table


def _fmt(value, spec=None):
    if value is None:                   # a figure the row has not got (e.g. a crashed engine)
        return "—"
    if isinstance(value, float):
        return format(value, spec or ".2f")
    return str(value)


def exit_text(returncode):
    """How a worker process ended: 'signal 11, SIGSEGV' or 'exit code 1'."""
    if returncode < 0:
        return f"signal {-returncode}, {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def tinyloop_isas(wanted):
    """The TinyLoop kernel paths to bench: those named in `wanted` (comma-separated), or every one
    this CPU and libtinyloop have but scalar."""
    have = [isa for isa in native_isas() if isa != "scalar"]
    if not wanted:
        return have
    isas = wanted.split(",")
    if not set(isas) <= set(have) | {"scalar"}:
        raise SystemExit(f"--isas {wanted}: this CPU and libtinyloop run "
                         f"{', '.join(['scalar', *have])}")
    return isas


@contextlib.contextmanager
def tinyloop_model(path, isa, threads, row_kernels="auto"):
    """tinyloop.Model on `path` opened with TINYLOOP_ISA=isa and TINYLOOP_ROW_KERNELS=row_kernels
    (both read when a Model opens)."""
    forced = {"TINYLOOP_ISA": isa, "TINYLOOP_ROW_KERNELS": row_kernels}
    saved = {name: os.environ.get(name) for name in forced}
    os.environ.update(forced)
    try:
        model = tinyloop.Model(path, backend="native", threads=threads, prefix_cache_bytes=0)
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    with model:
        yield model


# --- the random LLaMA -----------------------------------------------------------------------

def llama_layers(shape):
    """Tensor shapes, numpy (out, in), of one LLaMA layer equal in compute to a TinyLoop block."""
    s = SHAPES[shape]
    d, f = s["d_model"], s["ffn_dim"]
    q, kv = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
            "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}


def vocabulary_tokens(size):
    """The tokens of a dummy SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
    then fillers t0, t1, ..."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    return tokens + [f"t{i}" for i in range(size - len(tokens))]


def vocabulary(size):
    """vocabulary_tokens(size) and their GGUF token types (needs gguf)."""
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.BYTE] * 256
    return vocabulary_tokens(size), types + [gguf.TokenType.NORMAL] * (size - len(types))


def wordlevel_tokenizer(size):
    """A Hugging Face `tokenizers.Tokenizer` (WordLevel, whitespace-split) whose tokens are
    vocabulary_tokens(size): every engine given it spells an id as the GGUF does, and decodes each
    generated id to some text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokens = vocabulary_tokens(size)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(tokens[:3])
    return tokenizer


def write_f16_gguf(path, shape, seed=0):
    """A random-weight F16 LLaMA GGUF with n_pre + L layers of `shape`."""
    s = SHAPES[shape]
    n_layers, d, vocab = s["n_pre_blocks"] + s["default_loops"], s["d_model"], s["vocab_size"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(s["max_seq_len"])
    writer.add_embedding_length(d)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(s["ffn_dim"])
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, types = vocabulary(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), np.float32) * WEIGHT_STD).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, d))
    for layer in range(n_layers):
        for name, dims in llama_layers(shape).items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", matrix(*dims))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(d, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    writer.add_tensor("output.weight", matrix(vocab, d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
