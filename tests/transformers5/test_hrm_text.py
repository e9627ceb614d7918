"""HRM-Text against transformers' own HrmTextForCausalLM (transformers >= 5.23, CPU torch).

transformers 5 is not TinyLoop's test dependency (its other references need transformers 4), so
this folder is run on its own by .ci/run's last step in its test environment, after upgrading
that to transformers 5.23.0; `pytest` from the README does not collect it (pyproject's
norecursedirs).

A random-weight HrmTextForCausalLM (its own initialisation, the tiny shape below, two layers per
stack) is saved with save_pretrained, converted to int8 and run on every backend with the
causal mask at two depths (H_cycles 2 and 3); its float32 logits at every position are the
reference, held to the int8 floors of tests/fidelity_floors.py. The prefix-LM mask
(token_type_ids 1 on the first P tokens, TinyLoop's instruction_length P) is checked the same
way at several P on a model initialised at initializer_range = hidden_size ** -0.5, where
attention is sharp enough that the mask moves the logits far (causal against prefix-LM: minimum
cosine about 0.45), so a backend ignoring it fails; at the default 0.02 attention is nearly
uniform and the two masks' logits agree to 0.9998. tests/hf_reference.py's float64
HRM-Text forward, which CI's main run uses, is checked against the same logits here.
"""
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import HrmTextConfig, HrmTextForCausalLM

import tinyloop
from tinyloop.quickbench import backend_kwargs

from fidelity_floors import assert_faithful
from hf_reference import hrm_text_logits

TOKENS = np.random.default_rng(7).integers(0, 96, 48).tolist()
SIZES = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, head_dim=12, H_cycles=2, L_cycles=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.02)


def saved_model(tmp_path_factory, **overrides):
    """(folder, model): a saved random HrmTextForCausalLM and the model itself."""
    assert tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 23)
    torch.manual_seed(11)
    config = HrmTextConfig(attn_implementation="eager", **{**SIZES, **overrides})
    model = HrmTextForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("hrm") / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return saved_model(tmp_path_factory)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The published model at initializer_range = hidden_size ** -0.5: sharp attention."""
    return saved_model(tmp_path_factory, initializer_range=SIZES["hidden_size"] ** -0.5)


def published_logits(model, h_cycles, instruction=0):
    """The published forward's logits; with `instruction` > 0, token_type_ids 1 on the first
    `instruction` tokens (the prefix-LM mask, config.prefix_lm being True by default)."""
    model.config.H_cycles = h_cycles
    types = torch.tensor([[1] * instruction + [0] * (len(TOKENS) - instruction)])
    with torch.no_grad():
        return model(torch.tensor([TOKENS]), use_cache=False,
                     token_type_ids=types if instruction else None).logits[0].double().numpy()


@pytest.mark.parametrize("h_cycles", [2, 3])
def test_int8_conversion_tracks_published_code(tmp_path, backend, published, h_cycles):
    folder, model = published
    config = tinyloop.convert(folder, tmp_path / "m.tinyloop", weight_format="int8")
    assert (config.core_cycles, config.n_core_blocks, config.default_loops) == (2, 4, 2)
    assert config.attn_gate and config.embed_scale == 50.0
    tl = tinyloop.Model(str(tmp_path / "m.tinyloop"), **backend_kwargs(backend))
    assert_faithful(tl.logits(TOKENS, loops=h_cycles), published_logits(model, h_cycles),
                    f"HRM-Text H_cycles={h_cycles}")


@pytest.mark.parametrize("instruction", [1, 17, 47, len(TOKENS)])
def test_prefix_lm_mask_tracks_published_code(tmp_path, backend, sharp, instruction):
    folder, model = sharp
    assert model.config.prefix_lm
    tinyloop.convert(folder, tmp_path / "m.tinyloop", weight_format="int8")
    tl = tinyloop.Model(str(tmp_path / "m.tinyloop"), **backend_kwargs(backend))
    expected = published_logits(model, 2, instruction)
    if instruction > 1:         # the causal logits fail the floors (a block of one is causal)
        with pytest.raises(AssertionError):
            assert_faithful(published_logits(model, 2), expected, "causal")
    assert_faithful(tl.logits(TOKENS, loops=2, instruction_length=instruction, prefill_chunk=5),
                    expected, f"HRM-Text prefix-LM P={instruction}")


@pytest.mark.parametrize("h_cycles, instruction", [(2, 0), (3, 0), (2, 17)])
def test_float64_reference_is_the_published_forward(published, h_cycles, instruction):
    folder, model = published
    with safe_open(folder / "model.safetensors", "np") as saved:     # the fused on-disk names
        tensors = {name: saved.get_tensor(name).astype(np.float64) for name in saved.keys()}
    cfg = {**model.config.to_dict(), "H_cycles": h_cycles}
    reference = hrm_text_logits(tensors, cfg, TOKENS, instruction=instruction)
    expected = published_logits(model, h_cycles, instruction)
    scale = np.abs(expected).max()
    assert np.abs(reference - expected).max() <= 1e-4 * scale, np.abs(reference - expected).max()
