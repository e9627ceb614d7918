"""Rules of docs/spec.md whose outcome follows from the rule itself, checked on every backend
without the numpy reference (which would share a slip with the others): the zero state
entering core iteration 0 with injection (§1, §4.4).
"""
import numpy as np

import tinyloop
from tinyloop.modelfile import load_model, save_model
from tinyloop.quickbench import backend_kwargs

from conftest import assert_same_bits, same_bits

SHAPE = dict(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=24,
             n_pre_blocks=1, default_loops=2, max_seq_len=32)
PROMPT = [5, 17, 3]


def edited(src, dst, edit):
    """A copy at `dst` of the model file `src` with edit(tensors) applied to its tensors."""
    config, tensors = load_model(src)
    tensors = {name: np.array(a) for name, a in tensors.items()}
    edit(tensors)
    save_model(dst, config, tensors)
    return dst


def opened(path, backend):
    return tinyloop.Model(path, **backend_kwargs(backend))


def test_the_state_entering_iteration_0_is_zero(backend, tmp_path):
    """x = 0 entering iteration 0 quantizes to zeros with scale 0, so core.adapter_state adds
    exactly 0 there: negating its weights leaves the depth-1 logits bit for bit (they would
    move if iteration 0 started from adapter(e, e)) and moves those of depth 2."""
    base = tmp_path / "a.tinyloop"
    tinyloop.random_model(base, seed=3, injection=True, **SHAPE)
    flipped = edited(base, tmp_path / "b.tinyloop",
                     lambda t: t.update({"core.adapter_state.w": -t["core.adapter_state.w"]}))
    with opened(base, backend) as a, opened(flipped, backend) as b:
        assert_same_bits(b.logits(PROMPT, loops=1), a.logits(PROMPT, loops=1))
        assert not same_bits(b.logits(PROMPT, loops=2), a.logits(PROMPT, loops=2))
