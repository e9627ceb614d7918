"""The fidelity table: each published looped layout TinyLoop converts, held to the float64
reference of its published code, at two depths.

Contract:
    python tools/fidelity_table.py [--backend native] [--weight-format int8 | int4]
                                   [--seed 4] [--positions 60]
        for each layout of tests/hf_reference.py's LOGITS (Ouro, Nanbeige, Huginn-0125, the
        retrofitted-recurrence Llama, HRM-Text, IQuest-Coder Loop): writes the tiny random
        checkpoint tests/hf_folders.py makes for it (seed --seed, in a temporary folder that is
        deleted afterwards), converts it with tinyloop.convert, and prints, as markdown, the
        command line, the CPU, and one row per (layout, depth): the mean and minimum over a
        random prompt's --positions positions of the cosine between TinyLoop's logits (the
        backend's Model.logits) and the reference's, the share of positions whose argmax agrees,
        and which published code the reference restates. Depths: the checkpoint's default and
        one deeper (the retrofitted Llama at 3 and 8, as tests/test_hf_fidelity.py).

The rows are tests/test_hf_fidelity.py's checks, whose floors (tests/fidelity_floors.py: mean
>= 0.998, min >= 0.99, top-1 >= 0.85 for int8) the suite enforces; this prints the numbers.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import tinyloop                                                          # noqa: E402
from tinyloop.quickbench import backend_kwargs                           # noqa: E402

from fidelity_floors import cosines, top1_agreement                     # noqa: E402
from hf_folders import RETROFIT_LLAMA, checkpoint, write_folder         # noqa: E402
from hf_reference import LOGITS                                          # noqa: E402
from fidelity_budget import cpu_name                                     # noqa: E402

# The published code each reference restates (tests/hf_reference.py), and the depths compared.
SOURCES = {
    "OuroForCausalLM": "ByteDance Ouro `modeling_ouro.py`",
    "NanbeigeForCausalLM": "Nanbeige `modeling_nanbeige.py`",
    "RavenForCausalLM": "Huginn-0125 `raven_modeling_minimal.py`",
    RETROFIT_LLAMA: "`raven_modeling_minimal_llama.py` (LoopedLMs/retrofitting-recurrence "
                    "e21042a6)",
    "HrmTextForCausalLM": "transformers 5.23.0 `modeling_hrm_text.py`",
    "IQuestLoopCoderForCausalLM": "vLLM 0.32.0 `iquest_loopcoder.py`",
}
DEEPER = {RETROFIT_LLAMA: 8}


def depths(layout, config):
    """(None: the checkpoint's own depth, a deeper one) for a converted layout's config."""
    return None, DEEPER.get(layout, config.default_loops + 1)


def reference_logits(layout, tensors, cfg, tokens, loops):
    """The reference's float64 logits at depth `loops` (None: the checkpoint's); Nanbeige's
    code takes its depth from the config only."""
    if loops is None:
        return LOGITS[layout](tensors, cfg, tokens)
    if layout == "NanbeigeForCausalLM":
        return LOGITS[layout](tensors, {**cfg, "loop_loss_weights": [], "num_loops": loops},
                              tokens)
    return LOGITS[layout](tensors, cfg, tokens, steps=loops)


def rows(backend, weight_format, seed, positions):
    """One (layout, depth, mean, min, top-1, source) per layout and depth."""
    tokens = np.random.default_rng(5).integers(0, 96, positions).tolist()
    with tempfile.TemporaryDirectory() as work:
        for layout in LOGITS:
            cfg, tensors = checkpoint(layout, seed=seed)
            folder = write_folder(os.path.join(work, layout.replace(":", "-")), cfg, tensors)
            path = os.path.join(work, "m.tinyloop")
            config = tinyloop.convert(folder, path, weight_format=weight_format)
            model = tinyloop.Model(path, **backend_kwargs(backend))
            reference_tensors = {k: v.astype(np.float64) for k, v in tensors.items()}
            for loops in depths(layout, config):
                reference = reference_logits(layout, reference_tensors, cfg, tokens, loops)
                got = model.logits(tokens, loops=loops)
                cos = cosines(got, reference)
                yield (layout, loops or config.default_loops, cos.mean(), cos.min(),
                       top1_agreement(got, reference), SOURCES[layout])
            model.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="native")
    parser.add_argument("--weight-format", default="int8", choices=["int8", "int4"])
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--positions", type=int, default=60)
    args = parser.parse_args(argv)
    print(f"`python tools/fidelity_table.py {' '.join(argv or sys.argv[1:])}`, "
          f"{cpu_name()}, backend {args.backend}, "
          f"{args.weight_format}\n")
    print("| layout | depth | mean cosine | min cosine | top-1 | float64 reference restates |")
    print("|---|---|---|---|---|---|")
    for layout, loops, mean, low, top1, source in rows(args.backend, args.weight_format,
                                                     args.seed, args.positions):
        print(f"| {layout} | {loops} | {mean:.4f} | {low:.4f} | {top1:.3f} | {source} |")


if __name__ == "__main__":
    main()
