"""Forward pass of a looped model over a chunk of tokens (docs/spec.md §1, §4), for any kernel
set.

`forward_part` runs T rows at positions pos0 .. pos0+T-1 through part of the model: from the
embedding (the prelude, then core iterations 0 ..) or resuming before core iteration
`first_iter` from each row's kept state (and injected term or low state), up to iteration depth-1, then the
coda norm and the coda in the coda slots of `coda_depth`, writing the KV of every layer it runs;
it returns the rows' final hidden states (the head's input) and their state after iteration
depth-1 with their injected term (Rows). The draft and the verification of self-speculative
decoding (§5.6) and the extension of a warm-start prefix (§5.4) are part passes; `forward_chunk`
is the whole pass at the cache's depth L (its n_layers(L) slots, §1) over the cache's next T
positions, advancing its length. A prefix build (or extension) also runs the coda after each
earlier iteration, on a copy of the state, writing the coda slots of every depth it reaches
(§5.4). Nothing here releases a block: the caller drops blocks a window no longer sees once its
call is done. A hidden-state prefix build (§5.4.1) hands a pass a `capture`, called by every
layer with its input rows; `write_kv` is the K/V of a layer from its NQ rows, which the pass
and an h prefix's rebuild (fallback/hidden_prefix.py) share.

The orchestration here is shared by every Python backend; the arithmetic comes from a *kernel
set*, an object with the attributes of `NumpyKernels` (the reference, the spec in numpy).
Another backend (fallback/numba_cpu.py, fallback/numba_cuda.py) swaps in its own kernels for
the same operations, each of which must give bit-identical results:

    name                                     backend name ("numpy", "numba", ...)
    device, device_name, isa, threads        where and how it runs, for Engine.runtime():
                                             "cpu" or "cuda", e.g. "cpu (numpy)", the
                                             kernel path, the threads a kernel may use
    linear(w, scale, multipliers, group,     a linear layer's weights (bias: (R,) f32 or
           bias=None)                        None); calling it with (q (T, K) int8,
                                             a (T,) f32) gives (T, R) f32, the bias added last
    table(array)                             places a lookup table (embedding, RoPE) or an
                                             f32 vector (biases' and norms' gains, a zero state)
    new_pool(block_size, n_kv_heads, D,      the KV cache's BlockPool (kv_bits 8: int8 KV,
             kv_bits)                        4: int4 KV)
    embed(weights, tokens)                   tokens (T,) int32 -> (T, d) f32:
                                             ((f32) E[t] * es[t]) * weights.embed_scale
    rms_quantize(x, eps, block=0) /          a linear's input rows: NQ / Q8 of every row,
    quantize_rows(x, block=0)                (q int8, scale (rows,) f32); with block B >= 1
                                             NQB / QB (§2.2.1), (p int16, scale); `linear`
                                             takes either
    rms_norm(x, gain, eps)                   RN (§2.7) of every row: (T, d) -> (T, d) f32
    split_heads(z, cos, sin, config,         z (T, (H + 2G) * D) -> qh (T, H, D) after RoPE,
                kv_bits)                     and Q8 (kv_bits 8) or Q4 (4) of K (after RoPE)
                                             and V as the cache stores them (kv_row): kq,
                                             vq (T, G, D * kv_bits / 8), sk, sv (T, G)
    attend(qh, cache, layer, pos0,           (T, H, D) queries over one cache layer -> (T, H * D),
           window=None)                      through the cache's window or `window`
    loop_mix(qh, global_out, local_out,      loop attention's gated mix (§4) of two attend
             gate)                           outputs (T, H * D) by a LoopGate -> (T, H * D)
    swiglu(gu)                               (T, 2F) gate|up -> (T, F)
    gate(o, z, at)                           attn_gate: o (T, H * D) times sig of
                                             z[:, at : at + H * D] (§4), a new (T, H * D)
    add(x, y)                                the residual addition
    copy(x)                                  a copy of a (T, d) state (a prefix build's coda)
    last_row(x)                              (T, d) -> a (1, d) copy of the last row
    to_host(y)                               a numpy array of y
    sample(logits, history, params, pos)     spec §5.1 on host logits (V,)
"""
from typing import Any, NamedTuple

import numpy as np

from tinyloop.modelfile import pack_int4

from .attention import attend_cached, local_window, loop_mix
from .kvcache import BlockPool, kv_row_format
from .numerics import (F32, quantize_input, quantize_rows, rms_norm, rms_quantize_input, rope,
                       sigmoid, silu)
from .sampling import sample
from .weights import Linear


def embed(weights, tokens):
    """tokens: (T,) int -> (T, d) float32, times the model's embed_scale (§4)."""
    rows = weights.embedding[tokens].astype(F32) * weights.embedding_scale[tokens][:, None]
    return rows * weights.embed_scale


def kv_row(x, kv_bits):
    """The KV cache's (rows, scales) of K or V head rows x (T, G, D) float32: Q8 as int8, or
    Q4 (values -7 .. 7) packed two a byte, (T, G, D/2) uint8."""
    q, s = quantize_rows(x, kv_row_format(x.shape[-1], kv_bits).qmax)
    return (q if kv_bits == 8 else pack_int4(q)), s


def split_heads(z, cos, sin, config, kv_bits):
    """z: (T, (H + 2G) * D) (the gate's columns after) -> qh (T, H, D) float32, (kq, sk,
    vq, sv) for the KV cache."""
    n_tok, H, G, D = len(z), config.n_heads, config.n_kv_heads, config.head_dim
    qh = rope(z[:, :H * D].reshape(n_tok, H, D), cos, sin)
    kh = rope(z[:, H * D:(H + G) * D].reshape(n_tok, G, D), cos, sin)
    vh = z[:, (H + G) * D:(H + 2 * G) * D].reshape(n_tok, G, D)
    return qh, kv_row(kh, kv_bits) + kv_row(vh, kv_bits)


def swiglu(gu):
    """gu: (T, 2F), gate then up -> silu(gate) * up, (T, F) float32."""
    ffn = gu.shape[1] // 2
    return silu(gu[:, :ffn]) * gu[:, ffn:]


def gate(o, z, at):
    """o: (T, H * D) attention output -> o * sig(z[:, at : at + H * D]) (§4, §2.5)."""
    return o * sigmoid(z[:, at:at + o.shape[1]])


class NumpyKernels:
    """The reference kernel set: every operation of the forward pass in numpy."""
    name = "numpy"
    device = "cpu"
    device_name = "cpu (numpy)"
    isa = "numpy"             # exact integer matmuls as float64 BLAS products (weights.Linear)
    threads = 1
    linear = Linear
    table = staticmethod(np.asarray)
    new_pool = BlockPool
    embed = staticmethod(embed)
    rms_quantize = staticmethod(rms_quantize_input)
    quantize_rows = staticmethod(quantize_input)
    rms_norm = staticmethod(rms_norm)
    split_heads = staticmethod(split_heads)
    attend = staticmethod(attend_cached)
    loop_mix = staticmethod(loop_mix)
    swiglu = staticmethod(swiglu)
    gate = staticmethod(gate)
    add = staticmethod(np.add)
    copy = staticmethod(np.copy)
    last_row = staticmethod(lambda x: x[-1:].copy())
    to_host = staticmethod(np.asarray)
    sample = staticmethod(sample)


def cache_depth(config, n_layers):
    """The depth L of a cache of n_layers(L) slots (§1)."""
    return (n_layers - config.n_pre_blocks) // (config.core_width + config.n_coda_blocks)


def residual(kernels, weights, x, y, gain):
    """§4's residual(x, y, g) of the model's block placement."""
    layout, eps = weights.config.block_layout, weights.config.rms_eps
    if layout == "pre":
        return kernels.add(x, y)
    if layout == "sandwich":
        return kernels.add(x, kernels.rms_norm(y, gain, eps))
    return kernels.rms_norm(kernels.add(x, y), gain, eps)


def write_kv(kernels, weights, block, cache, slot, q, a, pos0):
    """The layer's input rows as NQ gives them, q (T, d) int8 and a (T,) f32 -> its query
    heads qh (T, H, D) after RoPE and attn_qkv's output z, writing slot's KV at
    pos0 .. pos0+T-1 (§4). A hidden-state prefix rebuilds its KV through this too
    (fallback/hidden_prefix.py)."""
    cfg = weights.config
    z = block.attn_qkv(q, a)                         # (T, (H + 2G) * D) (+ H * D gate), + bias
    rows = slice(pos0, pos0 + len(z))
    qh, kv = kernels.split_heads(z, weights.rope_cos[rows], weights.rope_sin[rows], cfg,
                                 cache.pool.kv_bits)
    cache.write(slot, pos0, *kv)
    return qh, z


def attention_block(kernels, weights, block, cache, slot, x, pos0, capture=None):
    """x: (T, d) -> residual(x, attention output), writing slot's KV at pos0 .. pos0+T-1;
    capture(slot, pos0, x, q, a), when given, records the rows and their NQ (q, a)."""
    cfg = weights.config
    q, a = kernels.rms_quantize(x, cfg.rms_eps, cfg.act_block)
    if capture is not None:
        capture(slot, pos0, x, q, a)
    qh, z = write_kv(kernels, weights, block, cache, slot, q, a, pos0)
    o = attend_layer(kernels, cfg, block, qh, cache, slot, pos0)   # (T, H * D)
    if cfg.attn_gate:
        o = kernels.gate(o, z, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
    q, s = kernels.quantize_rows(o, cfg.act_block)
    return residual(kernels, weights, x, block.attn_out(q, s), block.attn_post_norm)


def attend_layer(kernels, cfg, block, qh, cache, slot, pos0):
    """The attention of the layer at cache slot `slot`: §4.1's, or with loop attention in a
    core slot of iteration >= 1, the gated mix of the global attention over iteration 0's slot
    and the local one over its own slot through the loop window (§4). Returns (T, H * D)."""
    glob = cfg.loop_global_slot(slot)
    if glob is None:
        return kernels.attend(qh, cache, slot, pos0)
    local = kernels.attend(qh, cache, slot, pos0, local_window(cache.window, cfg.loop_window))
    return kernels.loop_mix(qh, kernels.attend(qh, cache, glob, pos0), local, block.loop_gate)


def mlp_block(kernels, weights, block, x):
    """x: (T, d) -> residual(x, SwiGLU MLP output)."""
    cfg = weights.config
    q, a = kernels.rms_quantize(x, cfg.rms_eps, cfg.act_block)
    h = kernels.swiglu(block.ffn_gate_up(q, a))                # (T, F)
    q, s = kernels.quantize_rows(h, cfg.act_block)
    return residual(kernels, weights, x, block.ffn_down(q, s), block.ffn_post_norm)


def run_block(kernels, weights, block, cache, slot, x, pos0, capture=None):
    """One layer: block's weights, its KV at cache slot `slot` (capture: attention_block)."""
    x = attention_block(kernels, weights, block, cache, slot, x, pos0, capture)
    return mlp_block(kernels, weights, block, x)


def coda(kernels, weights, cache, loops, x, pos0, capture=None):
    """The coda norm, then the coda blocks writing the coda slots of depth `loops`."""
    cfg = weights.config
    if cfg.coda_norm:
        x = kernels.rms_norm(x, weights.coda_norm, cfg.rms_eps)
    for c, block in enumerate(weights.coda_blocks):
        x = run_block(kernels, weights, block, cache, cfg.coda_slot(loops, c), x, pos0, capture)
    return x


def core_iteration(kernels, weights, cache, i, x, injected, pos0, capture=None):
    """Core iteration i (§1) on the state x (T, d) and the rows' injected terms: the step norm
    (i >= 1), the adapter (injection), the k core blocks in iteration i's slots; or a
    two-state core's low and high cycles on (x, injected) = (h, l). Returns the new pair."""
    cfg = weights.config
    if cfg.core_cycles:
        return two_state_iteration(kernels, weights, cache, i, x, injected, pos0, capture)
    if cfg.step_norm and i >= 1:
        x = kernels.rms_norm(x, weights.step_norm, cfg.rms_eps)
    if cfg.injection:
        x = kernels.add(weights.adapter_state(*kernels.quantize_rows(x, cfg.act_block)), injected)
    for j, block in enumerate(weights.core_blocks):
        x = run_block(kernels, weights, block, cache, cfg.core_slot(i, j), x, pos0, capture)
    return x, injected


def two_state_iteration(kernels, weights, cache, i, high, low, pos0, capture=None):
    """A two-state core's iteration i (§1) on high and low states (T, d): the low stack C
    times on low + high, then the high stack on high + low, each closed by the weightless
    norm (a gain of ones). Returns (high, low)."""
    cfg = weights.config
    n = cfg.n_core_blocks // 2
    for c in range(cfg.core_cycles + 1):
        y = kernels.add(low, high)                             # f32 addition commutes
        for a in range(c * n, (c + 1) * n):
            y = run_block(kernels, weights, weights.core_applied[a], cache, cfg.core_slot(i, a),
                          y, pos0, capture)
        y = kernels.rms_norm(y, weights.unit_gain, cfg.rms_eps)
        if c < cfg.core_cycles:
            low = y
        else:
            high = y
    return high, low


def prelude(kernels, weights, cache, tokens, pos0, capture=None):
    """The embedding and the prelude of tokens (T,) int32 at pos0 ..: returns the state
    entering core iteration 0 and, with injection, the rows' injected terms, with a two-state
    core the low states (zero) (else None)."""
    x = kernels.embed(weights, tokens)
    for b, block in enumerate(weights.pre_blocks):
        x = run_block(kernels, weights, block, cache, b, x, pos0, capture)
    if weights.config.core_cycles:      # h = x, l = 0 (§1)
        return x, kernels.table(np.zeros((len(tokens), weights.config.d_model), F32))
    if not weights.config.injection:
        return x, None
    # the injected term, the same in every iteration
    injected = weights.adapter_inject(*kernels.quantize_rows(x, weights.config.act_block))
    return kernels.table(np.zeros((len(tokens), weights.config.d_model), F32)), injected  # §4.4


class Rows(NamedTuple):
    """What a pass returns for its T rows, each (T, d) f32 in the kernels' arrays."""
    hidden: Any        # the final states, the head's input
    state: Any         # the states after the last core iteration run (before the coda)
    injected: Any      # the adapter's injected terms, or a two-state core's low states (else None)


def forward_part(kernels, weights, cache, pos0, tokens=None, first_iter=0, depth=None,
                 coda_depth=None, state=None, injected=None, depth_states=None, capture=None):
    """Rows at positions pos0 .. pos0+T-1 through core iterations first_iter .. depth-1
    (depth: the cache's by default) and the coda in the coda slots of depth `coda_depth`
    (depth's own by default). first_iter == 0 starts from `tokens` (T,) int32 (embedding,
    prelude); first_iter > 0 resumes from `state`, each row's state after iteration
    first_iter-1, and with injection `injected`, its injected term (a two-state core: its low
    state). Writes the KV of every
    layer it runs at those positions; leaves cache.length alone. Returns Rows.

    If `depth_states` is a list (a prefix build or extension, §5.4), the coda also runs after
    every iteration i < depth-1, on a copy of the state, writing the coda slots of depth i + 1,
    and the last row's final state at each depth first_iter+1 .. depth is appended to it as a
    (1, d) row. `capture` (a hidden-state prefix build, §5.4.1) is called by every layer it
    runs with that layer's input rows (attention_block).
    """
    cfg = weights.config
    depth = cache_depth(cfg, cache.n_layers) if depth is None else depth
    if first_iter == 0:
        x, injected = prelude(kernels, weights, cache, tokens, pos0, capture)
    else:
        x = state
    for i in range(first_iter, depth):
        x, injected = core_iteration(kernels, weights, cache, i, x, injected, pos0, capture)
        if depth_states is not None and i < depth - 1:
            out = coda(kernels, weights, cache, i + 1, kernels.copy(x), pos0, capture)
            depth_states.append(kernels.last_row(out))
    hidden = coda(kernels, weights, cache, coda_depth or depth, x, pos0, capture)
    if depth_states is not None:
        depth_states.append(kernels.last_row(hidden))
    return Rows(hidden, x, injected if cfg.carries_injected else None)


def forward_chunk(kernels, weights, cache, tokens, depth_states=None, capture=None):
    """Run tokens (T,) int32 at the cache's next T positions through the whole model at the
    cache's depth, and advance cache.length past them; returns their Rows (forward_part)."""
    rows = forward_part(kernels, weights, cache, cache.length, tokens, depth_states=depth_states,
                        capture=capture)
    cache.length += len(tokens)
    return rows


def decode_adaptive(kernels, weights, cache, token, start_judge):
    """One decoded token (an int) at the cache's next position, stopping after the first core
    iteration i <= L-2 where judge.exits(i, x_i) says so, judge = start_judge(x_entry) with the
    state entering iteration 0 on the host (docs/spec.md §5.7; fallback/exit_rules.py's
    ExitRule.start, or a ForcedExit replaying a recorded exit): the skipped
    iterations' core slots get a copy of the last computed iteration's KV ("last available"),
    the coda runs in depth L's slots (for the kl and argmax rules, a probe of the coda and the
    head after each iteration, whose result an exit keeps). Advances cache.length; returns
    (hidden (1, d), U)."""
    cfg = weights.config
    loops, pos = cache_depth(cfg, cache.n_layers), cache.length
    x, injected = prelude(kernels, weights, cache, np.array([token], np.int32), pos)
    judge = start_judge(kernels.to_host(x)[0])
    depth, hidden = loops, None
    for i in range(loops):
        x, injected = core_iteration(kernels, weights, cache, i, x, injected, pos)
        if i == loops - 1:
            break
        probe = z = None
        if judge.probes:         # kl, argmax: the logits the token has if it stops here
            probe = coda(kernels, weights, cache, loops, kernels.copy(x), pos)
            z = head_logits(kernels, weights, probe)[0]
        if judge.exits(i, kernels.to_host(x)[0], z):
            depth, hidden = i + 1, probe
            break
    for i in range(depth, loops):
        for j in range(cfg.core_width):
            cache.copy_position(cfg.core_slot(depth - 1, j), cfg.core_slot(i, j), pos)
    if hidden is None:           # a probe's coda has run on the exit state already
        hidden = coda(kernels, weights, cache, loops, x, pos)
    cache.length += 1
    return hidden, depth


def decode_pass(kernels, weights, cache, token, rule):
    """One decoded token (an int): the whole depth with no `rule`, else as deep as the rule
    lets it go (decode_adaptive, with rule.start). Returns (hidden (1, d), iterations run)."""
    if rule is None:
        x = forward_chunk(kernels, weights, cache, np.array([token], np.int32)).hidden
        return x, cache_depth(weights.config, cache.n_layers)
    return decode_adaptive(kernels, weights, cache, token, rule.start)


def on_host(kernels, parts):
    """(T_i, d) arrays of the kernel set -> one host (sum T_i, d) array."""
    return np.concatenate([kernels.to_host(a) for a in parts])


def stack_rows(kernels, parts):
    """(T_i, d) arrays of the kernel set -> one (sum T_i, d) array of it."""
    return kernels.table(on_host(kernels, parts))


def head_logits(kernels, weights, x):
    """x: (T, d) final hidden states -> (T, V) float32 logits, on the host."""
    q, a = kernels.rms_quantize(x, weights.config.rms_eps, weights.config.act_block)
    return kernels.to_host(weights.head(q, a))
