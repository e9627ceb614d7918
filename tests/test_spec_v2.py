"""The version-2 model of docs/spec.md (§1, §4, §4.3, §4.4, §5.4) on the numpy reference.

`spec_logits` below is §1's program written out once more, whole-sequence and cache-free, from
the spec's primitives (fallback/numerics.py, fallback/attention.py): the engine's orchestration
(fallback/forward.py: slots, chunks, prefixes, the prefix cache) must equal it bit for bit. The
other tests pin what the slot layout promises: depth nesting through a prefix built with its
coda at every depth, chunking invariance, the prefix cache's per-depth trees when there is a
coda, and that a version-1 file means the version-2 model it describes.
"""
import numpy as np
import pytest

import tinyloop
from tinyloop.fallback import numerics as N
from tinyloop.fallback.attention import attend, visible_keys
from tinyloop.fallback.weights import Weights
from tinyloop.modelfile import load_model

from conftest import assert_same_bits, write_random_models
from test_modelfile import as_version_1

SHAPE = dict(vocab_size=97, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=24,
             max_seq_len=64)
# Each version-2 feature on in some model, every placement, with and without a coda.
MODELS = {
    "huginn-like": dict(n_pre_blocks=2, n_core_blocks=2, n_coda_blocks=2, block_layout="post",
                        injection=True, coda_norm=True, qkv_bias=True, embed_scale=4.0),
    "ouro-like": dict(n_pre_blocks=0, n_core_blocks=3, block_layout="sandwich", step_norm=True,
                      weight_format="int4", group_size=4, tied_head=True),
    "coda-pre": dict(n_pre_blocks=1, n_core_blocks=1, n_coda_blocks=1, step_norm=True,
                     injection=True, embed_scale=0.5),
    "all-on": dict(n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1, block_layout="sandwich",
                   qkv_bias=True, injection=True, step_norm=True, coda_norm=True),
}
CODA_MODELS = [name for name, fields in MODELS.items() if fields.get("n_coda_blocks")]
PROMPT = [5, 17, 3, 88, 42, 42, 9, 0, 61, 77, 12, 30, 2]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_random_models(tmp_path_factory.mktemp("v2"), MODELS, default_loops=3, **SHAPE)


def numpy_model(path, **kwargs):
    return tinyloop.Model(path, backend="numpy", **kwargs)


def spec_block(w, block, x):
    """One layer of §4 over the whole sequence (its own keys and values, causal)."""
    cfg = w.config
    H, G, D, n = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, len(x)
    eps, cos, sin = cfg.rms_eps, w.rope_cos[:n], w.rope_sin[:n]

    def residual(x, y, gain):
        if cfg.block_layout == "pre":
            return x + y
        if cfg.block_layout == "sandwich":
            return x + N.rms_norm(y, gain, eps)
        return N.rms_norm(x + y, gain, eps)

    z = block.attn_qkv(*N.rms_quantize(x, eps))
    qh = N.rope(z[:, :H * D].reshape(n, H, D), cos, sin)
    kq, sk = N.quantize_rows(N.rope(z[:, H * D:(H + G) * D].reshape(n, G, D), cos, sin))
    vq, sv = N.quantize_rows(z[:, (H + G) * D:].reshape(n, G, D))
    o = attend(qh, kq, sk, vq, sv, visible_keys(np.arange(n), np.arange(n), 0))
    x = residual(x, block.attn_out(*N.quantize_rows(o)), block.attn_post_norm)
    gu = block.ffn_gate_up(*N.rms_quantize(x, eps))
    h = N.silu(gu[:, :cfg.ffn_dim]) * gu[:, cfg.ffn_dim:]
    return residual(x, block.ffn_down(*N.quantize_rows(h)), block.ffn_post_norm)


def spec_logits(w, tokens, loops):
    """§1's program: embedding, prelude, L iterations (step norm, adapter), coda norm, coda,
    head."""
    cfg, eps = w.config, w.config.rms_eps
    x = (w.embedding[tokens].astype(np.float32) * w.embedding_scale[tokens][:, None]) \
        * np.float32(cfg.embed_scale)
    for block in w.pre_blocks:
        x = spec_block(w, block, x)
    e = x
    if cfg.injection:
        x = np.zeros_like(e)
    for i in range(loops):
        if cfg.step_norm and i >= 1:
            x = N.rms_norm(x, w.step_norm, eps)
        if cfg.injection:
            x = w.adapter_state(*N.quantize_rows(x)) + w.adapter_inject(*N.quantize_rows(e))
        for block in w.core_blocks:
            x = spec_block(w, block, x)
    if cfg.coda_norm:
        x = N.rms_norm(x, w.coda_norm, eps)
    for block in w.coda_blocks:
        x = spec_block(w, block, x)
    return w.head(*N.rms_quantize(x, eps))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("loops", [1, 2, 4])
def test_engine_equals_the_spec_program(paths, name, loops):
    weights = Weights(*load_model(paths[name]))
    want = spec_logits(weights, np.array(PROMPT), loops)
    with numpy_model(paths[name]) as model:
        for chunk in (1, 4, len(PROMPT)):
            assert_same_bits(model.logits(PROMPT, loops=loops, prefill_chunk=chunk), want)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefix_serves_every_depth_up_to_its_own(paths, name):
    """§5.4: a prefix built at L_b (its coda run at every depth) gives, at each L <= L_b, with
    and without a suffix, exactly generate(prompt + suffix, loops=L); L > L_b is refused."""
    run = dict(max_tokens=6, temperature=0.8, seed=11, return_logits=True)
    with numpy_model(paths[name], block_size=4) as model:
        prefix = model.build_prefix_cache(PROMPT, loops=4)
        for loops in (1, 2, 3, 4):
            for suffix in ([], [7, 1, 60]):
                got, got_logits = model.generate_from_prefix_cache(
                    prefix, suffix=suffix, loops=loops, prefill_chunk=2, **run)
                want, want_logits = model.generate(PROMPT + suffix, loops=loops, **run)
                assert got == want
                for a, b in zip(got_logits, want_logits, strict=True):
                    assert_same_bits(a, b)
        with pytest.raises(RuntimeError, match="loops mismatch"):
            model.generate_from_prefix_cache(prefix, loops=5)


@pytest.mark.parametrize("name", CODA_MODELS)
def test_a_pass_writes_only_its_own_depths_coda_slots(paths, name):
    """§1: a plain pass at depth L writes the coda slots of depth L only; a prefix build
    writes those of every depth, in the slots coda_slot(L, c)."""
    with numpy_model(paths[name]) as model:
        engine = model._engine
        config = engine.config
        cache = engine.new_cache(3, 0)
        engine.prefill(cache, np.array(PROMPT, np.int32), 5)
        written = [bool(blocks) for blocks in cache.layers]
        coda = {config.coda_slot(L, c): L for L in (1, 2, 3)
                for c in range(config.n_coda_blocks)}
        assert len(written) == config.n_layers(3)
        assert written == [coda.get(slot, 3) == 3 for slot in range(config.n_layers(3))]
        cache.free()
        prefix = engine.build_prefix(np.array(PROMPT, np.int32), 3, 0, 5)
        assert all(prefix.cache.layers) and len(prefix.loop_states) == 3
        prefix.free()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_automatic_prefix_cache_serves_depths_as_the_spec_keys_them(paths, name):
    """§4.3: with a coda the depth is part of the tree key (a block serves its own depth
    only); without, a deeper block serves a shallower request. Results never change."""
    prompt = PROMPT + [4, 4, 8, 15, 16, 23, 42]     # 20 tokens: 5 full blocks of 4 inserted,
    has_coda = MODELS[name].get("n_coda_blocks", 0) > 0
    with numpy_model(paths[name], block_size=4, prefix_cache_bytes=1 << 24) as model, \
            numpy_model(paths[name]) as plain:
        def hits(loops):
            before = model.cache_stats()["hit_tokens"]
            got = model.generate(prompt, loops=loops, max_tokens=3, return_logits=True)
            want = plain.generate(prompt, loops=loops, max_tokens=3, return_logits=True)
            assert got[0] == want[0]
            for a, b in zip(got[1], want[1], strict=True):
                assert_same_bits(a, b)
            return model.cache_stats()["hit_tokens"] - before

        assert hits(3) == 0
        assert hits(2) == (0 if has_coda else 16)  # of which a lookup shares 4 (1 token left)
        assert hits(3) == 16
        assert hits(2) == 16
        assert model.cache_stats()["blocks"] == (10 if has_coda else 5)


def test_version_1_and_version_2_files_of_the_same_weights_agree(tmp_path):
    """§6.5: a version-1 file is the version-2 model with k = 1, no coda, pre-norm, ...: same
    config, same tensors (loop.* = core.0.*), bit-identical logits and tokens."""
    v2 = tmp_path / "v2.tinyloop"
    tinyloop.random_model(v2, seed=5, n_pre_blocks=1, default_loops=3, **SHAPE)
    v1 = tmp_path / "v1.tinyloop"
    v1.write_bytes(as_version_1(v2.read_bytes()))
    assert v1.read_bytes()[8] == 1 and v2.read_bytes()[8] == 2
    (c1, t1), (c2, t2) = load_model(v1), load_model(v2)
    assert c1 == c2 and list(t1) == list(t2)
    assert all(np.array_equal(t1[n], t2[n]) for n in t1)
    with numpy_model(v1) as m1, numpy_model(v2) as m2:
        for loops in (1, 3):
            assert_same_bits(m1.logits(PROMPT, loops=loops), m2.logits(PROMPT, loops=loops))
        run = dict(max_tokens=8, temperature=0.9, seed=3)
        assert m1.generate(PROMPT, **run) == m2.generate(PROMPT, **run)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_random_models_stay_sane_at_depth(paths, name):
    """tinyloop.random_model keeps activations in range however deep a model loops."""
    with numpy_model(paths[name]) as model:
        for loops in (1, 16, 64):
            logits = model.logits(PROMPT, loops=loops)
            assert np.isfinite(logits).all()
            assert 0.5 < float(logits.std()) < 20, (loops, float(logits.std()))
