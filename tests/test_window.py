"""cache_window, the instruction block and loop attention: on every backend, the cached, paged,
chunked engine equals a naive evaluation of the definition of the visible keys (docs/spec.md §4.1:
causal, inside the window, and the first P positions seeing each other) and of loop attention
(§4: later iterations mix iteration 0's keys with their own inside the loop window) written here
with no cache at all, bit for bit, whatever the model shape, thread count, KV block size and
chunking."""
import numpy as np
from hypothesis import strategies as st

from tinyloop.fallback import numerics as N
from tinyloop.fallback.weights import Weights
from tinyloop.modelfile import load_model

from conftest import assert_same_bits, backend_given
from strategies import drawn_model, engine_settings, model_shapes, prompts, simulated


def naive_attention_row(q, keys, values):
    """One head, one query. q: (D,) float32; keys/values: lists of (kq, sk) / (vq, sv)."""
    qq, sq = N.quantize_rows(q[None])
    qq, sq = qq[0].astype(np.int64), sq[0]
    c = sq / np.sqrt(np.float32(len(q)))
    scores = np.array([(np.float32(int(qq @ kq.astype(np.int64))) * c) * sk for kq, sk in keys],
                      np.float32)
    e = N.exp2s((scores - scores.max()) * N.LOG2E)
    den = sum(int(v) for v in np.rint(e * N.TWO_24))
    svmax = max(sv for _, sv in values)
    if svmax == 0:
        return np.zeros(len(q), np.float32)
    kappa = N.TWO_24 / svmax
    num = np.zeros(len(q), np.int64)
    for ej, (vq, sv) in zip(e, values):
        num += int(np.rint(ej * (sv * kappa))) * vq.astype(np.int64)
    return (num.astype(np.float32) / np.float32(den)) * svmax


def naive_loop_mix(q, global_row, local_row, gate, h):
    """Loop attention's gate on one query head h, q (D,) float32, and its mix of the two rows."""
    qq, sq = N.quantize_rows(q[None])
    dot = int(qq[0].astype(np.int64) @ np.asarray(gate.w[h], np.int64))
    g = N.sigmoid(((np.float32(dot) * sq[0]) * gate.s[h]) + gate.b[h])
    return (g * global_row) + ((np.float32(1) - g) * local_row)


def naive_logits(weights, tokens, loops, window, instruction=0):
    """Whole-sequence forward, layer by layer, attention by explicit loops over keys (a
    version-1 shape: one core block, each layer's K/V its own; with loop attention, the core
    layers after the first also read the first one's)."""
    cfg = weights.config
    H, G, D, n = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, len(tokens)
    x = weights.embedding[tokens].astype(np.float32) * weights.embedding_scale[tokens][:, None]
    pos = np.arange(n)
    for layer in range(cfg.n_pre_blocks + loops):
        blk = weights.block(layer)
        z = blk.attn_qkv(*N.rms_quantize(x, cfg.rms_eps))
        cos, sin = weights.rope_cos[pos], weights.rope_sin[pos]
        qh = N.rope(z[:, :H * D].reshape(n, H, D), cos, sin)
        kq, sk = N.quantize_rows(N.rope(z[:, H * D:(H + G) * D].reshape(n, G, D), cos, sin))
        vq, sv = N.quantize_rows(z[:, (H + G) * D:].reshape(n, G, D))
        if layer == cfg.n_pre_blocks:
            first_core = kq, sk, vq, sv                   # iteration 0's keys and values
        looped = cfg.loop_window and layer > cfg.n_pre_blocks
        o = np.zeros((n, H, D), np.float32)
        for t in range(n):
            last = instruction - 1 if t < instruction else t
            seen = [j for j in range(last + 1) if window == 0 or j > t - window]
            for h in range(H):
                g = h // (H // G)
                if not looped:
                    o[t, h] = naive_attention_row(qh[t, h], [(kq[j, g], sk[j, g]) for j in seen],
                                                  [(vq[j, g], sv[j, g]) for j in seen])
                    continue
                near = [j for j in seen if j > t - cfg.loop_window]
                k0, s0, v0, t0 = first_core
                global_row = naive_attention_row(qh[t, h], [(k0[j, g], s0[j, g]) for j in seen],
                                                 [(v0[j, g], t0[j, g]) for j in seen])
                local_row = naive_attention_row(qh[t, h], [(kq[j, g], sk[j, g]) for j in near],
                                                [(vq[j, g], sv[j, g]) for j in near])
                o[t, h] = naive_loop_mix(qh[t, h], global_row, local_row, blk.loop_gate, h)
        x = x + blk.attn_out(*N.quantize_rows(o.reshape(n, H * D)))
        gu = blk.ffn_gate_up(*N.rms_quantize(x, cfg.rms_eps))
        x = x + blk.ffn_down(*N.quantize_rows(N.silu(gu[:, :cfg.ffn_dim]) * gu[:, cfg.ffn_dim:]))
    return weights.head(*N.rms_quantize(x, cfg.rms_eps))


_naive = {}    # the naive logits depend on neither backend nor engine settings: one per case


def naive_logits_of(path, tokens, loops, window, instruction=0):
    key = (path, tuple(tokens), loops, window, instruction)
    if key not in _naive:
        _naive[key] = naive_logits(Weights(*load_model(path)), np.array(tokens), loops, window,
                                   instruction)
    return _naive[key]


@backend_given(data=st.data())
def test_windowed_engine_equals_naive_definition(backend, zoo, data):
    with drawn_model(data, zoo, backend, v1_like=True) as model:     # naive_logits: version 1's model
        prompt = data.draw(prompts(model.config()["vocab_size"], max_size=24))
        window = data.draw(st.sampled_from([0, 1, 2, 5, 17]))
        loops = data.draw(st.integers(1, 3))
        got = model.logits(prompt, loops=loops, cache_window=window,
                           prefill_chunk=data.draw(st.integers(1, 24)))
        assert_same_bits(got, naive_logits_of(model.path, prompt, loops, window))


def test_window_releases_blocks_outside_it(on_backend):
    """A 64-token prompt with window 8 keeps only the blocks a future query can still see."""
    model = on_backend["int8-gqa"]
    prompt = list(range(64))
    full = model.build_prefix_cache(prompt, cache_window=0)
    windowed = model.build_prefix_cache(prompt, cache_window=8)
    assert windowed.nbytes < full.nbytes / 2
    assert model.generate_from_prefix_cache(windowed, max_tokens=4) == \
        model.generate(prompt, max_tokens=4, cache_window=8)


def test_window_changes_results_once_the_context_exceeds_it(on_backend):
    model = on_backend["int8-gqa"]
    prompt = list(range(1, 30))
    assert not np.array_equal(model.logits(prompt, cache_window=4)[-1], model.logits(prompt)[-1])
    assert_same_bits(model.logits(prompt[:4], cache_window=4), model.logits(prompt[:4]))


@backend_given(data=st.data())
def test_loop_attention_equals_naive_definition(backend, zoo, data):
    shape = data.draw(model_shapes(tiny=simulated(backend), v1_like=True), "shape")
    shape.update(loop_window=data.draw(st.integers(1, 6), "loop_window"))
    with zoo.open(shape, backend, **data.draw(engine_settings(), "engine")) as model:
        prompt = data.draw(prompts(model.config()["vocab_size"], max_size=24))
        window = data.draw(st.sampled_from([0, 0, 2, 5]))
        instruction = data.draw(st.sampled_from([0, 0, min(3, len(prompt))]), "instruction")
        loops = data.draw(st.integers(1, 3))
        got = model.logits(prompt, loops=loops, cache_window=window,
                           prefill_chunk=data.draw(st.integers(1, 24)),
                           instruction_length=instruction)
        assert_same_bits(got, naive_logits_of(model.path, prompt, loops, window, instruction))


def test_loop_attention_local_branch_keeps_the_narrower_window(backend, zoo):
    """W' = min(W, W_l) (§4): a sequence window narrower than the loop window cuts the local
    branch too, and a wider one leaves it at W_l."""
    shape = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=16,
                 n_pre_blocks=1, default_loops=3, max_seq_len=64, tied_head=False, loop_window=5)
    with zoo.open(shape, backend, threads=2, block_size=4) as model:
        prompt = [(7 * i + 3) % 64 for i in range(20)]
        for window in (2, 9):
            assert_same_bits(model.logits(prompt, cache_window=window, prefill_chunk=6),
                             naive_logits_of(model.path, prompt, 3, window))


@backend_given(data=st.data())
def test_instruction_block_equals_naive_definition(backend, zoo, data):
    with drawn_model(data, zoo, backend, v1_like=True) as model:
        prompt = data.draw(prompts(model.config()["vocab_size"], max_size=24))
        instruction = data.draw(st.integers(0, len(prompt)), "instruction")
        window = data.draw(st.sampled_from([0, 0, 2, 5]))
        loops = data.draw(st.integers(1, 3))
        got = model.logits(prompt, loops=loops, cache_window=window,
                           prefill_chunk=data.draw(st.integers(1, 24)),
                           instruction_length=instruction)
        assert_same_bits(got, naive_logits_of(model.path, prompt, loops, window, instruction))
