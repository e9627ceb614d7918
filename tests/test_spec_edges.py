"""Rules of docs/spec.md whose outcome follows from the rule itself, checked on every backend
without the numpy reference (which would share a slip with the others): the zero state
entering core iteration 0 with injection (§1, §4.4), and the sampler's answer when `z / T`
overflows to +inf or, every logit being negative, to -inf (§5.1 step 5).
"""
import numpy as np
import pytest

import tinyloop
from tinyloop.modelfile import load_model, save_model
from tinyloop.quickbench import backend_kwargs

from conftest import assert_same_bits, same_bits

SHAPE = dict(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=24,
             n_pre_blocks=1, default_loops=2, max_seq_len=32)
PROMPT = [5, 17, 3]
TINY_T = 1e-30        # a temperature under which |z| > 3.4e8 makes z / T overflow


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


def one_signed_head(src, dst, sign):
    """A copy of `src` whose head rows are all one int8 row, with distinct row scales near
    1e9: the last prompt position's logits are (acc * a) * s_v, all of the sign of acc * a,
    which the row's sign picks (found on the numpy reference), and large enough for z / T to
    overflow (the test checks it)."""
    scales = (np.random.default_rng(1).permutation(SHAPE["vocab_size"]) + 8).astype(np.float32)
    scales *= np.float32(1e8)

    def edit(t, row_sign):
        t["head.w"] = np.tile(row_sign * t["head.w"][0], (SHAPE["vocab_size"], 1))
        t["head.s"] = scales

    edited(src, dst, lambda t: edit(t, 1))
    with tinyloop.Model(dst, backend="numpy") as model:
        flip = np.sign(model.logits(PROMPT)[-1, 0]) != sign
    return edited(src, dst, lambda t: edit(t, -1 if flip else 1))


@pytest.mark.parametrize("sign", [1, -1], ids=["to+inf", "to-inf"])
@pytest.mark.parametrize("top_k", [0, 5])
def test_z_over_t_overflowing_gives_the_first_candidate(backend, tmp_path, sign, top_k):
    """m = z / T of the first candidate is +inf or -inf (then every weight would be 0 and the
    draw would divide by zero): the token is the first candidate, whatever the seed."""
    src = tmp_path / "m.tinyloop"
    tinyloop.random_model(src, seed=5, **SHAPE)
    path = one_signed_head(src, tmp_path / f"signed{sign}.tinyloop", sign)
    with opened(path, backend) as model:
        z = model.logits(PROMPT)[-1]
        assert np.all(np.sign(z) == sign) and np.isfinite(z).all()
        with np.errstate(over="ignore"):
            assert np.float32(z.max()) / np.float32(TINY_T) == sign * np.inf
        first = int(np.argmax(z))               # the smallest id with the largest logit
        for seed in range(4):
            out = model.generate(PROMPT, max_tokens=1, temperature=TINY_T, top_k=top_k,
                                 seed=seed)
            assert out == PROMPT + [first], (seed, out)
