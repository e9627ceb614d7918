"""tinyloop.quantize.quantize_model (docs/spec.md §6.4): what it folds, what it stores as it
is, the adapter split, the tensor order and progress reports, and its bounded-memory contract
(one lazily loaded source tensor at a time, float64 only a block of rows at a time)."""
from collections.abc import Mapping

import numpy as np
import pytest

from tinyloop import quantize
from tinyloop.fallback.weights import integer_weights
from tinyloop.modelfile import encode_model
from tinyloop.quantize import quantize_model
from tinyloop.random_model import random_config, random_float_weights

V2 = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
          n_pre_blocks=1, default_loops=2, max_seq_len=16, n_core_blocks=2, n_coda_blocks=1,
          block_layout="post", qkv_bias=True, injection=True, step_norm=True, coda_norm=True,
          embed_scale=2.0)


class LazyWeights(Mapping):
    """A Mapping that loads (copies) a value on each lookup and counts the lookups."""

    def __init__(self, weights):
        self.weights, self.loads = weights, {}

    def __getitem__(self, key):
        self.loads[key] = self.loads.get(key, 0) + 1
        return np.array(self.weights[key])

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)


def dequantized(tensors, name, config):
    """A linear's stored weights as float64 (R, K): integers times row (and group) scales."""
    s = tensors[f"{name}.s"].astype(np.float64)[:, None]
    if config.weight_format == "int8":
        return tensors[f"{name}.w"].astype(np.float64) * s
    m = tensors[f"{name}.m"]
    return integer_weights(tensors[f"{name}.w"], m, config.group_size).astype(np.float64) * s


def assert_close(got, want, rel):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rel, err


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gains_fold_into_the_linears_that_read_them_and_the_rest_is_stored(fmt):
    config = random_config(weight_format=fmt, group_size=8 if fmt == "int4" else 0, **V2)
    w = random_float_weights(config, seed=1)
    config, t = quantize_model(config, w)
    rel = 0.02 if fmt == "int8" else 0.2
    for b in config.block_prefixes():
        qkv = np.concatenate([w[f"{b}.wq"], w[f"{b}.wk"], w[f"{b}.wv"]]) * w[f"{b}.attn_norm"]
        assert_close(dequantized(t, f"{b}.attn_qkv", config), qkv, rel)
        gate_up = np.concatenate([w[f"{b}.w_gate"], w[f"{b}.w_up"]]) * w[f"{b}.mlp_norm"]
        assert_close(dequantized(t, f"{b}.ffn_gate_up", config), gate_up, rel)
        assert_close(dequantized(t, f"{b}.ffn_down", config), w[f"{b}.w_down"], rel)
        bias = np.concatenate([w[f"{b}.bq"], w[f"{b}.bk"], w[f"{b}.bv"]])
        assert t[f"{b}.attn_qkv.b"].dtype == np.float32
        assert np.array_equal(t[f"{b}.attn_qkv.b"], bias)           # a bias is not folded
        for norm in ("attn_post_norm", "ffn_post_norm"):
            assert np.array_equal(t[f"{b}.{norm}"], w[f"{b}.{norm}"])
    d = config.d_model
    assert_close(dequantized(t, "core.adapter_state", config), w["core.adapter"][:, :d], rel)
    assert_close(dequantized(t, "core.adapter_inject", config), w["core.adapter"][:, d:], rel)
    for name in ("core.step_norm", "coda.input_norm"):
        assert np.array_equal(t[name], w[name])
    assert_close(dequantized(t, "head", config), w["head"] * w["final_norm"], rel)
    assert_close(t["tok_emb.w"] * t["tok_emb.s"][:, None].astype(np.float64), w["tok_emb"], 0.02)


def test_tensors_come_in_the_required_order_with_a_progress_report_each():
    config = random_config(**V2)
    reported = []
    config, tensors = quantize_model(config, random_float_weights(config), progress=reported.append)
    assert reported == list(tensors) == list(config.required_tensors())
    encode_model(config, tensors)                                    # a valid file


def test_a_lazy_mapping_is_read_once_per_tensor():
    config = random_config(**V2)
    lazy = LazyWeights(random_float_weights(config))
    quantize_model(config, lazy)
    assert set(lazy.loads) == set(lazy.weights)                      # every tensor used ...
    assert max(lazy.loads.values()) == 1                             # ... and loaded once


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_row_blocks_change_no_value(monkeypatch, fmt):
    """Quantization is per row: blocks of 1 row give the tensors of one block for all."""
    config = random_config(weight_format=fmt, group_size=8 if fmt == "int4" else 0, **V2)
    w = random_float_weights(config, seed=2)
    _, whole = quantize_model(config, w)
    monkeypatch.setattr(quantize, "BLOCK_ELEMENTS", 1)
    _, blocked = quantize_model(config, w)
    assert list(whole) == list(blocked)
    for name, a in whole.items():
        assert a.dtype == blocked[name].dtype and np.array_equal(a, blocked[name]), name


def test_a_tied_head_is_untied_when_the_final_norm_is_not_one():
    config = random_config(**{**V2, "tied_head": True})
    w = random_float_weights(config)
    assert quantize_model(config, w)[0].tied_head
    w["final_norm"] = w["final_norm"] * np.float32(1.5)
    untied, tensors = quantize_model(config, w)
    assert not untied.tied_head and "head.w" in tensors
