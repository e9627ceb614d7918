"""vLLM's W8A8 int8 form of a LLaMA folder, for bench/vllm_peer.py: run by the vLLM install's
venv-llmc (bench/vllm_setup.sh --w8a8), never by TinyLoop's Python.

    python vllm_w8a8.py SRC DST

llmcompressor's data-free round to nearest: every Linear but lm_head gets int8 weights with a
scale per output channel and int8 activations with a scale per token computed at run time
(its "W8A8" scheme), saved as compressed-tensors, which vLLM's CPU backend runs on its int8
kernels. The tokenizer files are copied unchanged.
"""
import shutil
import sys
from pathlib import Path


def main(src, dst):
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W8A8",
                                                     ignore=["lm_head"]))
    model.save_pretrained(dst, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, Path(dst) / name)


if __name__ == "__main__":
    main(*sys.argv[1:3])
