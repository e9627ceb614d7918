"""TinyLoop (native) vs llama.cpp on the CPU at equal per-token compute (issue #7 point 4).

    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python gguf   # or the extra: '.[llamacpp]';
                                    # compiles llama.cpp from source (~3+ min on 2 cores)
    python bench/bench_llamacpp.py [--full] [--threads 2] [--repeats 5] [--flash-attn] [--dir DIR]

Both engines run a random-weight model of the same shape (the "quick" shape, or the "full" one
with --full): TinyLoop's looped model (n_pre 2 blocks + a loop block applied L = 8 times) and a
LLaMA of n_pre + L = 10 layers with the same d_model, ffn, heads and vocab, so every token costs
the same compute. The LLaMA is written with the `gguf` package in F16, then quantized with
llama-cpp-python's llama_model_quantize to Q8_0 and to Q4_0, both "pure" (token_embd and
output.weight get the same type; without it Q4_0 keeps output.weight at Q6_K).
Pairs: TinyLoop int8 vs llama.cpp Q8_0, TinyLoop int4 vs llama.cpp Q4_0.

pp512: tokens/s of prefilling 512 random tokens in one batch into an empty cache.
tg32: tokens/s of 32 greedy single-token steps after those 512 tokens.
TinyLoop: tinyloop.quickbench.speed on Model(backend="native", threads=2, prefix_cache_bytes=0).
llama.cpp: llama_cpp.Llama(n_threads=2, n_batch=512, n_ctx=1024; F16 KV, OpenMP threads, flash
attention off unless --flash-attn) through the Python API, not llama-bench: Llama.eval of the
512-token prompt after reset(), then 32 Llama.eval calls of one token each, each token the argmax
of the previous logits.
Both engines stay loaded in one process and run in alternating rounds (TinyLoop, llama.cpp,
TinyLoop, ...); each figure is the best of --repeats rounds, so a burst of load from other
processes does not land on one engine only. Compare the ratios (TinyLoop / llama.cpp).
The weights MiB columns are the model files: the looped model stores 3 distinct blocks (plus
embedding and head), the LLaMA 10 layers. load avg: the 1-minute load average after the row
(about 2 = this bench alone on the 2 cores; more = other processes competing, which slows
llama.cpp's OpenMP barriers far more than TinyLoop's pool).

Writes bench/results/llamacpp-<shape>.{json,md}. Exits with code 2 when llama_cpp or gguf is
not installed.
"""
import argparse
import logging
import os
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import numpy as np

import tinyloop
from common import SHAPES, model_file, write_results
from tinyloop.quickbench import speed, timed

try:
    import gguf
    import llama_cpp
except ImportError as exc:
    MISSING = exc.name
else:
    MISSING = None

LLAMA_QUANT = {"int8": "Q8_0", "int4": "Q4_0"}    # TinyLoop weight format -> llama.cpp type
WEIGHT_STD = 0.02
MIB = 2 ** 20


def llama_layers(shape):
    """Tensor shapes, numpy (out, in), of one LLaMA layer equal in compute to a TinyLoop block."""
    s = SHAPES[shape]
    d, f = s["d_model"], s["ffn_dim"]
    q, kv = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
            "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}


def vocabulary(size):
    """A dummy SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then fillers."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(size - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (size - len(types))
    return tokens, types


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


def quantize(source, target, quant, threads):
    """llama_model_quantize `source` to a pure `quant` (e.g. "Q4_0") model at `target`."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.pure = True
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {quant} failed")


def gguf_model(shape, quant, directory, threads):
    """Path of the `quant` LLaMA GGUF of `shape`, written once into `directory`."""
    directory = Path(directory)
    f16, path = directory / f"{shape}-F16.gguf", directory / f"{shape}-{quant}.gguf"
    if not path.exists():
        if not f16.exists():
            write_f16_gguf(f16, shape)
        quantize(f16, path, quant, threads)
    return path


def open_llama(path, args):
    """llama_cpp.Llama on `path` as a context manager, with the bench's threads and batch."""
    return closing(llama_cpp.Llama(
        str(path), n_threads=args.threads, n_threads_batch=args.threads, n_batch=args.prefill,
        n_ctx=max(1024, args.prefill + args.decode), flash_attn=args.flash_attn, verbose=False))


def llama_speed(llm, prompt, n_decode):
    """(prefill tok/s, decode tok/s) of one llama.cpp run: `prompt` into an empty cache, then
    n_decode greedy single-token steps."""
    llm.reset()
    _, t_prefill = timed(lambda: llm.eval(prompt))

    def decode():
        for _ in range(n_decode):
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            llm.eval([int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))])

    _, t_decode = timed(decode)
    return len(prompt) / t_prefill, n_decode / t_decode


def best_rounds(engines, repeats):
    """Per engine, the best (prefill tok/s, decode tok/s) over `repeats` rounds; each round runs
    every engine once in turn, so a burst of load from other processes hits all of them."""
    best = {name: (0.0, 0.0) for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            best[name] = tuple(map(max, best[name], run()))
    return best


def compare(shape, fmt, args, directory):
    """The table row of one weight format: TinyLoop next to llama.cpp."""
    quant = LLAMA_QUANT[fmt]
    ours = model_file(shape, fmt, directory)
    theirs = gguf_model(shape, quant, directory, args.threads)
    P, D = args.prefill, args.decode
    with open_llama(theirs, args) as llm, tinyloop.Model(
            ours, backend="native", threads=args.threads, prefix_cache_bytes=0) as model:
        prompt = np.random.default_rng(1).integers(0, llm.n_vocab(), P).tolist()
        best = best_rounds({"TinyLoop": lambda: speed(model, P, D)[1:],
                            "llama.cpp": lambda: llama_speed(llm, prompt, D)}, args.repeats)
    (tl_pre, tl_dec), (lc_pre, lc_dec) = best["TinyLoop"], best["llama.cpp"]
    pp, tg = f"pp{P}", f"tg{D}"
    return {"shape": shape, "TinyLoop": fmt, "llama.cpp": quant,
            "TinyLoop weights MiB": ours.stat().st_size / MIB,
            "llama.cpp weights MiB": theirs.stat().st_size / MIB,
            f"TinyLoop {pp} tok/s": tl_pre, f"llama.cpp {pp} tok/s": lc_pre,
            f"{pp} ratio": tl_pre / lc_pre,
            f"TinyLoop {tg} tok/s": tl_dec, f"llama.cpp {tg} tok/s": lc_dec,
            f"{tg} ratio": tl_dec / lc_dec,
            "load avg": os.getloadavg()[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the d2048 shape instead of the quick one")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    args = ap.parse_args(argv)
    if MISSING:
        print(f"bench_llamacpp: the module {MISSING!r} is not installed; pip install "
              "llama-cpp-python gguf (or pip install -e '.[llamacpp]')", file=sys.stderr)
        return 2
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)   # llama.cpp's own logs
    shape = "full" if args.full else "quick"
    with tempfile.TemporaryDirectory() as scratch:
        rows = []
        for fmt in args.formats.split(","):
            rows.append(compare(shape, fmt, args, args.dir or scratch))
            print(rows[-1], flush=True)
    notes = (f"{args.threads} threads, best of {args.repeats} alternating rounds, llama.cpp flash "
             f"attention {'on' if args.flash_attn else 'off'}; TinyLoop native n_pre 2 + L 8 vs "
             f"a {SHAPES[shape]['n_pre_blocks'] + SHAPES[shape]['default_loops']}-layer LLaMA "
             f"(llama-cpp-python {llama_cpp.__version__}, pure quantization). "
             "ratio = TinyLoop / llama.cpp.")
    print(write_results(f"llamacpp-{shape}", rows, list(rows[0]), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
