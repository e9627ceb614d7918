"""Hypothesis strategies shared by the suites: small valid model shapes, prompts, sampling
settings, adaptive-depth requests, and the engine settings (threads, KV block size) that must never change a result.

A model shape is a dict of `tinyloop.random_model` keyword arguments; `conftest.ModelZoo` turns
it into a file, written once per shape.
"""
import math

from hypothesis import strategies as st

from conftest import simulated

MAX_PROMPT = 300               # the longest drawn prompt
MAX_NEW = 16                   # room for generated tokens past it
SHORT_PROMPT = 24
LONG_PROMPT_ONE_IN = 5         # one drawn prompt in 5 may be up to MAX_PROMPT tokens long


@st.composite
def model_shapes(draw, tiny=False, v1_like=False):
    """A small valid config: H = G * (heads per kv head), even head_dim, ffn, n_pre, loops,
    int8 or int4 with an even group size dividing every K, tied head or not, an eos id or none
    (and up to 3 more stop ids and an exit gate, version-3 options, unless `v1_like`),
    and the version-2 layout (docs/spec.md §1, §4): k = 1 .. 3 core blocks, 0 .. 2 coda blocks,
    block placement, qkv bias, injection, step and coda norms, an embedding scale; or (version
    3) a two-state core of two stacks with 1 or 2 low cycles, the attention gate, or (one-state,
    ungated) loop attention.
    `tiny`: the smallest widths (for numba's CUDA simulator). `v1_like`: the version-2 fields
    at their version-1 values (one core block, no coda, pre-norm, ...)."""
    n_kv_heads = draw(st.integers(1, 2 if tiny else 3))
    n_heads = n_kv_heads * draw(st.integers(1, 2 if tiny else 3))
    head_dim = draw(st.sampled_from([2, 4, 8] if tiny else [2, 4, 6, 8, 16, 32]))
    d_model = draw(st.sampled_from([8, 16] if tiny else [8, 16, 24, 32, 48]))
    ffn_dim = draw(st.sampled_from([8, 16] if tiny else [8, 16, 24, 40, 64]))
    vocab_size = draw(st.integers(16, 64 if tiny else 300))
    shape = dict(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                 n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
                 n_pre_blocks=draw(st.integers(0, 1 if tiny else 2)),
                 default_loops=draw(st.integers(1, 4)), max_seq_len=MAX_PROMPT + MAX_NEW,
                 tied_head=draw(st.booleans()),
                 eos_id=draw(st.one_of(st.just(-1), st.integers(0, vocab_size - 1))))
    k = math.gcd(d_model, n_heads * head_dim, ffn_dim)
    groups = [g for g in range(2, k + 1, 2) if k % g == 0]
    if draw(st.booleans()):
        shape.update(weight_format="int4", group_size=draw(st.sampled_from(groups)))
    if not v1_like:
        stop_ids = draw(st.lists(st.integers(0, vocab_size - 1), unique=True, max_size=3))
        shape.update(stop_ids=tuple(i for i in stop_ids if i != shape["eos_id"]))
        shape.update(n_core_blocks=draw(st.integers(1, 2 if tiny else 3)),
                     n_coda_blocks=draw(st.integers(0, 1 if tiny else 2)),
                     block_layout=draw(st.sampled_from(["pre", "sandwich", "post"])),
                     qkv_bias=draw(st.booleans()), injection=draw(st.booleans()),
                     step_norm=draw(st.booleans()), coda_norm=draw(st.booleans()),
                     embed_scale=draw(st.sampled_from([1.0, 0.25, math.sqrt(d_model)])))
        if draw(st.booleans()):            # HRM's two-state core (§1), version 3
            shape.update(core_cycles=draw(st.integers(1, 2)), injection=False, step_norm=False,
                         n_core_blocks=2 * draw(st.integers(1, 1 if tiny else 2)))
        shape.update(attn_gate=draw(st.booleans()))    # the attention gate (§4), version 3
        if not shape.get("core_cycles") and not shape["attn_gate"]:    # loop attention (§4)
            shape.update(loop_window=draw(st.sampled_from([0, 1, 2, 5])))
        if draw(st.booleans()):            # block activations (§2.2.1), version 3
            shape.update(act_block=draw(st.sampled_from([b for b in range(1, k + 1) if k % b == 0])))
        if draw(st.booleans()):            # an exit gate (docs/spec.md §5.7), version 3 too
            shape.update(exit_gate=True, exit_threshold=draw(st.sampled_from([0.5, 0.9, 1.0])))
    return shape


def engine_settings():
    """Model keyword arguments that change no result: the thread count and the KV block size."""
    return st.fixed_dictionaries(dict(threads=st.integers(1, 4),
                                      block_size=st.sampled_from([1, 2, 3, 4, 7, 16, 64])))


def drawn_model(data, zoo, backend, v1_like=False):
    """A Model on `backend` of a shape (tiny on the simulator; `v1_like`: see model_shapes),
    thread count and KV block size drawn from `data`."""
    shapes = model_shapes(tiny=simulated(backend), v1_like=v1_like)
    return zoo.open(data.draw(shapes, "shape"), backend, **data.draw(engine_settings(), "engine"))


def logits_requests():
    """Model.logits keyword arguments: a depth, a window (most often none), a chunk size."""
    return st.fixed_dictionaries(dict(loops=st.integers(1, 4),
                                      cache_window=st.sampled_from([0, 0, 1, 3, 7]),
                                      prefill_chunk=st.integers(1, 40)))


@st.composite
def prompts(draw, vocab, min_size=1, max_size=24):
    return draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size))


def prompt_lengths(backend, min_size=1):
    """Mostly up to SHORT_PROMPT tokens, one draw in LONG_PROMPT_ONE_IN up to MAX_PROMPT (short
    only on the simulator). Shrinking leads to the short branch."""
    short = st.integers(min_size, SHORT_PROMPT)
    if simulated(backend):
        return short
    return st.integers(1, LONG_PROMPT_ONE_IN).flatmap(
        lambda r: st.integers(min_size, MAX_PROMPT) if r == LONG_PROMPT_ONE_IN else short)


@st.composite
def long_prompts(draw, vocab, backend, min_size=1):
    """A prompt whose length is drawn by prompt_lengths(backend)."""
    n = draw(prompt_lengths(backend, min_size))
    return draw(prompts(vocab, n, n))


@st.composite
def sampling(draw):
    """Greedy or sampled settings, with a fixed seed."""
    if draw(st.booleans()):
        return dict(temperature=0.0, seed=draw(st.integers(0, 2**64 - 1)))
    return dict(temperature=draw(st.floats(0.05, 2.0)),
                top_k=draw(st.integers(0, 40)),
                top_p=draw(st.floats(0.05, 1.0)),
                repetition_penalty=draw(st.floats(0.5, 2.0)),
                seed=draw(st.integers(0, 2**64 - 1)))


# Thresholds of each rule, from "exits almost never" to "exits as soon as it may".
THRESHOLDS = {"gate": [0.05, 0.3, 0.6, 0.9, 1.0], "latent": [1e-3, 0.05, 0.2, 0.5, 0.9, 1e30],
              "kl": [1e-4, 1e-2, 0.1, 1.0, 1e30], "argmax": [1, 2, 3]}


@st.composite
def exit_kwargs(draw, config):
    """A rule the model has ("gate" only with an exit gate), a threshold, min_loops, loops."""
    loops = draw(st.integers(1, 5))
    rule = draw(st.sampled_from([r for r in THRESHOLDS if r != "gate" or config["exit_gate"]]))
    return dict(loops=loops, exit_rule=rule, exit_threshold=draw(st.sampled_from(THRESHOLDS[rule])),
                min_loops=draw(st.integers(1, loops)))


@st.composite
def adaptive_request(draw, config, max_tokens=8):
    """Sampling settings, an exit rule (exit_kwargs) and max_tokens."""
    return dict(draw(sampling()), **draw(exit_kwargs(config)),
                max_tokens=draw(st.integers(1, max_tokens)))
