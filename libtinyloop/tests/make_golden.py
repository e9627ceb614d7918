#!/usr/bin/env python3
"""Golden vectors for libtinyloop's test_golden, produced by the numpy reference backend.

usage: make_golden.py OUT_DIR       (needs the tinyloop package installed: pip install .)

Writes small random models (int8 and int4, GQA, n_pre 0..2, tied and untied heads, odd
vocabularies, an eos id; and version-2 shapes: several core blocks, a coda, the sandwich and
post block layouts, q/k/v biases, the injection adapter, step and coda norms, an embedding
scale; and version 3's stop ids, exit gate, two-state core, attention gate, loop attention
and block activations) and, for each, expected logits at every position and expected tokens
(greedy, sampled with seeds, penalties, stop sequences, chunked prefill, windows, prefixes at
nested depths) into OUT_DIR, with OUT_DIR/manifest.txt listing the cases one per line:

    <kind> key=value ...

kind is logits | generate | prefix | hprefix (a prefix case's chunk is the prefix build's; an
hprefix case is a hidden-state prefix, storage 1 h8 or 2 h4, with its blob, docs/spec.md §5.4.1
and §7, in *.bin). Arrays are
raw little-endian files: token ids int32 (*.i32), logits float32 bit patterns (*.f32). Float
parameters are written as the hex bits of their float32 value so that C reads exactly the
value numpy used. Every generate/prefix case stores only the emitted tokens (the prompt is in
its own file).
"""
import os
import struct
import sys

import numpy as np

import tinyloop

MODELS = {
    # name: (seed, config overrides)
    "int8_gqa": (11, dict(vocab_size=263, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                          ffn_dim=96, n_pre_blocks=2, default_loops=3, max_seq_len=160,
                          weight_format="int8", tied_head=False)),
    "int4_g32_tied": (12, dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=1, head_dim=16,
                               ffn_dim=128, n_pre_blocks=0, default_loops=4, max_seq_len=160,
                               weight_format="int4", group_size=32, tied_head=True)),
    "int4_g8": (13, dict(vocab_size=257, d_model=48, n_heads=3, n_kv_heads=3, head_dim=16,
                         ffn_dim=80, n_pre_blocks=1, default_loops=2, max_seq_len=160,
                         weight_format="int4", group_size=8, tied_head=False)),
    "int8_tied_mha": (14, dict(vocab_size=256, d_model=40, n_heads=2, n_kv_heads=2, head_dim=20,
                               ffn_dim=72, n_pre_blocks=1, default_loops=2, max_seq_len=160,
                               weight_format="int8", tied_head=True)),
    # version 2 (docs/spec.md §1, §4): Ouro's shape (a sandwich core of 2 blocks, step norm)
    "v2_ouro": (15, dict(vocab_size=259, d_model=48, n_heads=4, n_kv_heads=4, head_dim=12,
                         ffn_dim=80, n_pre_blocks=0, n_core_blocks=2, default_loops=3,
                         max_seq_len=160, weight_format="int8", tied_head=False,
                         block_layout="sandwich", step_norm=True)),
    # Huginn's: prelude, core, coda, post layout, injection, coda norm, biases, scale, tied
    "v2_huginn": (16, dict(vocab_size=256, d_model=48, n_heads=4, n_kv_heads=2, head_dim=12,
                           ffn_dim=64, n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1,
                           default_loops=3, max_seq_len=160, weight_format="int8",
                           tied_head=True, block_layout="post", injection=True, coda_norm=True,
                           qkv_bias=True, embed_scale=6.928203230275509)),
    # int4 with a two-block coda, injection and the step norm, pre layout
    "v2_int4_coda": (17, dict(vocab_size=270, d_model=64, n_heads=4, n_kv_heads=1, head_dim=16,
                              ffn_dim=96, n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=2,
                              default_loops=2, max_seq_len=160, weight_format="int4",
                              group_size=16, tied_head=False, injection=True, step_norm=True,
                              embed_scale=0.75)),
    # version 3 (docs/spec.md §1, §4): HRM-Text's shape, a two-state core of 2 + 2 blocks with 2
    # low cycles and the attention gate
    "v3_hrm": (18, dict(vocab_size=261, d_model=48, n_heads=4, n_kv_heads=2, head_dim=12,
                        ffn_dim=64, n_pre_blocks=0, n_core_blocks=4, core_cycles=2, attn_gate=True,
                        default_loops=2, max_seq_len=160, weight_format="int8", tied_head=False,
                        embed_scale=2.0)),
    # int4, a two-state core of 1 + 1 blocks with 3 low cycles between a prelude and a coda,
    # post blocks with biases, the gate
    "v3_int4_two_state": (19, dict(vocab_size=258, d_model=64, n_heads=4, n_kv_heads=2,
                                   head_dim=16, ffn_dim=96, n_pre_blocks=1, n_core_blocks=2,
                                   core_cycles=3, n_coda_blocks=1, coda_norm=True,
                                   default_loops=2, max_seq_len=160, weight_format="int4",
                                   group_size=16, tied_head=False, block_layout="post",
                                   qkv_bias=True, attn_gate=True)),
    # IQuest-Coder Loop's shape (docs/spec.md §1, §4): loop attention, a local window of 3 over a
    # core of 2 blocks between a prelude and a coda (the prompts are longer than the window)
    "v3_loop": (20, dict(vocab_size=262, d_model=48, n_heads=4, n_kv_heads=2, head_dim=12,
                         ffn_dim=64, n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1,
                         default_loops=3, loop_window=3, max_seq_len=160, weight_format="int8",
                         tied_head=False)),
    # block activations (docs/spec.md §2.2.1) in blocks of 16 over int4 weights, with the
    # injection adapter between a prelude and a coda
    "v3_act_block": (21, dict(vocab_size=263, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                              ffn_dim=96, n_pre_blocks=1, n_coda_blocks=1, default_loops=3,
                              max_seq_len=160, weight_format="int4", group_size=16,
                              tied_head=False, injection=True, act_block=16)),
}


def f32_bits(x):
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


class Writer:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.lines = []
        self.count = 0

    def array(self, stem, values, dtype):
        name = f"{stem}.{'i32' if dtype == np.int32 else 'f32'}"
        np.ascontiguousarray(np.asarray(values, dtype=dtype)).astype(
            np.dtype(dtype).newbyteorder("<")).tofile(os.path.join(self.out_dir, name))
        return name

    def bytes(self, stem, data):
        name = stem + ".bin"
        with open(os.path.join(self.out_dir, name), "wb") as f:
            f.write(data)
        return name

    def case(self, kind, **fields):
        self.lines.append(kind + "".join(f" {k}={v}" for k, v in fields.items()))
        self.count += 1

    def finish(self):
        with open(os.path.join(self.out_dir, "manifest.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


def gen_fields(w, stem, max_tokens, temperature=0.0, top_k=50, top_p=1.0, penalty=1.0, seed=0,
               stops=(), chunk=0):
    fields = dict(max_tokens=max_tokens, temperature=f32_bits(temperature), top_k=top_k,
                  top_p=f32_bits(top_p), penalty=f32_bits(penalty), seed=seed, chunk=chunk)
    if stops:
        fields["stops"] = w.array(stem + ".stops", [t for s in stops for t in s], np.int32)
        fields["stop_lengths"] = ",".join(str(len(s)) for s in stops)
    return fields


def kwargs_of(fields, stops):
    return dict(max_tokens=fields["max_tokens"],
                temperature=float(np.uint32(int(fields["temperature"], 16)).view(np.float32)),
                top_k=fields["top_k"],
                top_p=float(np.uint32(int(fields["top_p"], 16)).view(np.float32)),
                repetition_penalty=float(np.uint32(int(fields["penalty"], 16)).view(np.float32)),
                seed=fields["seed"], stop_sequences=[list(s) for s in stops])


def model_cases(w, name, seed, overrides):
    path = os.path.join(w.out_dir, name + ".tinyloop")
    cfg = tinyloop.random_model(path, seed=seed, **overrides)
    model = tinyloop.Model(path, backend="numpy")
    rng = np.random.default_rng(seed)
    V, L = cfg.vocab_size, cfg.default_loops
    prompt = rng.integers(0, V, 40).astype(np.int32)
    p_file = w.array(f"{name}.prompt", prompt, np.int32)

    # logits at every position
    for i, (loops, window, chunk) in enumerate([(L, 0, 0), (1, 0, 7), (L + 1, 6, 0),
                                                (2, 9, 5), (L, 1, 3)]):
        logits = model.logits(prompt, loops=loops, cache_window=window,
                              prefill_chunk=chunk or None)
        w.case("logits", model=name + ".tinyloop", loops=loops, window=window, chunk=chunk,
               prompt=p_file, expect=w.array(f"{name}.logits{i}", logits, np.float32))

    # generation
    greedy = model.generate(prompt, max_tokens=12)[len(prompt):]
    settings = [
        dict(),
        dict(temperature=0.8, top_k=0, seed=5),
        dict(temperature=1.2, top_k=20, top_p=0.85, penalty=1.3, seed=2**64 - 3),
        dict(temperature=1.0, top_k=0, top_p=0.5, seed=17, chunk=6),
        dict(temperature=0.6, top_k=3, seed=99, penalty=0.7),
        dict(stops=[greedy[3:5], [V - 1, 0, 1]]),
        dict(temperature=1.5, top_k=0, seed=123, stops=[[int(prompt[0])]]),
    ]
    for i, s in enumerate(settings):
        for loops, window in [(L, 0), (2, 5)]:
            stem = f"{name}.gen{i}.L{loops}.W{window}"
            stops = s.get("stops", ())
            fields = gen_fields(w, stem, 12, **s)
            out = model.generate(prompt, loops=loops, cache_window=window,
                                 prefill_chunk=fields["chunk"] or None, **kwargs_of(fields, stops))
            w.case("generate", model=name + ".tinyloop", loops=loops, window=window, prompt=p_file,
                   expect=w.array(stem + ".expect", out[len(prompt):], np.int32), **fields)

    # prefixes: built at depth L+1 (whole, and in chunks of 4), served at depths 1 .. L+1, with
    # and without a window
    head = prompt[:30]
    h_file = w.array(f"{name}.prefix_prompt", head, np.int32)
    for window, chunk in ((0, 0), (7, 4)):
        prefix = model.build_prefix_cache(head, loops=L + 1, cache_window=window,
                                          prefill_chunk=chunk or None)
        for loops in range(1, L + 2):
            for j, s in enumerate([dict(), dict(temperature=0.9, top_k=0, seed=loops * 1000 + 7)]):
                stem = f"{name}.prefix.W{window}.L{loops}.{j}"
                fields = gen_fields(w, stem, 10, chunk=chunk, **s)
                out = model.generate_from_prefix_cache(prefix, loops=loops, cache_window=window,
                                                       **kwargs_of(fields, ()))
                full = model.generate(head, loops=loops, cache_window=window,
                                      **kwargs_of(fields, ()))
                assert out == full, "numpy backend: prefix and full prompt disagree"
                w.case("prefix", model=name + ".tinyloop", prefix_loops=L + 1, loops=loops,
                       window=window, prompt=h_file,
                       expect=w.array(stem + ".expect", out[len(head):], np.int32), **fields)

    # hidden-state prefixes (where the model allows the storage): the blob, and generations
    for storage in ("h8", "h4"):
        for window, chunk in ((0, 0), (7, 4)):
            try:
                prefix = model.build_prefix_cache(head, loops=L, cache_window=window,
                                                  prefill_chunk=chunk or None, storage=storage)
            except ValueError:  # rows as large as the KV (few kv heads)
                continue
            stem = f"{name}.{storage}.W{window}"
            blob = w.bytes(stem, prefix.to_bytes())
            for loops in sorted({1, L}):
                fields = gen_fields(w, f"{stem}.L{loops}", 10, chunk=chunk, temperature=0.9,
                                    top_k=0, seed=loops * 31 + 1)
                out = model.generate_from_prefix_cache(prefix, loops=loops, cache_window=window,
                                                       **kwargs_of(fields, ()))
                w.case("hprefix", model=name + ".tinyloop", prefix_loops=L, loops=loops,
                       window=window, storage=1 if storage == "h8" else 2, prompt=h_file, blob=blob,
                       expect=w.array(f"{stem}.L{loops}.expect", out[len(head):], np.int32),
                       **fields)


def eos_cases(w, name, seed, overrides):
    """The same weights with the 5th greedy token as a stop id, once as eos_id and once as one
    of stop_ids (a version-3 file, beside another one): generation stops there either way."""
    probe = os.path.join(w.out_dir, name + ".tinyloop")
    model = tinyloop.Model(probe, backend="numpy")
    prompt = np.random.default_rng(seed).integers(0, overrides["vocab_size"], 40).astype(np.int32)
    greedy = model.generate(prompt, max_tokens=12)[len(prompt):]
    stop = int(greedy[4])
    unused = [i for i in range(overrides["vocab_size"]) if i not in greedy][:2]
    for suffix, ids in (("_eos", dict(eos_id=stop)),
                        ("_stop_ids", dict(eos_id=unused[0], stop_ids=(unused[1], stop)))):
        stop_name = name + suffix
        path = os.path.join(w.out_dir, stop_name + ".tinyloop")
        tinyloop.random_model(path, seed=seed, **overrides, **ids)
        model = tinyloop.Model(path, backend="numpy")
        p_file = w.array(f"{stop_name}.prompt", prompt, np.int32)
        for i, s in enumerate([dict(), dict(temperature=0.5, top_k=0, seed=3)]):
            stem = f"{stop_name}.gen{i}"
            fields = gen_fields(w, stem, 12, **s)
            out = model.generate(prompt, **kwargs_of(fields, ()))
            assert i or out[-1] == stop, "the greedy run must end on the stop id"
            w.case("generate", model=stop_name + ".tinyloop", loops=overrides["default_loops"],
                   window=0, prompt=p_file, expect=w.array(stem + ".expect", out[len(prompt):],
                                                            np.int32), **fields)


def exit_gate_cases(w, name, seed, overrides):
    """The same weights with an exit gate (a version-3 file, exit_threshold 0.75): plain
    decoding never reads the gate, so it gives the tokens of the model without one."""
    probe = tinyloop.Model(os.path.join(w.out_dir, name + ".tinyloop"), backend="numpy")
    gate_name = name + "_exit_gate"
    path = os.path.join(w.out_dir, gate_name + ".tinyloop")
    tinyloop.random_model(path, seed=seed, **overrides, exit_gate=True, exit_threshold=0.75)
    model = tinyloop.Model(path, backend="numpy")
    assert model.config()["exit_gate"] and model.config()["exit_threshold"] == 0.75
    prompt = np.random.default_rng(seed).integers(0, overrides["vocab_size"], 40).astype(np.int32)
    p_file = w.array(f"{gate_name}.prompt", prompt, np.int32)
    for i, s in enumerate([dict(), dict(temperature=0.9, top_k=0, seed=8)]):
        stem = f"{gate_name}.gen{i}"
        fields = gen_fields(w, stem, 12, **s)
        out = model.generate(prompt, **kwargs_of(fields, ()))
        assert out == probe.generate(prompt, **kwargs_of(fields, ())), "the gate changed plain decoding"
        w.case("generate", model=gate_name + ".tinyloop", loops=overrides["default_loops"],
               window=0, prompt=p_file, expect=w.array(stem + ".expect", out[len(prompt):],
                                                        np.int32), **fields)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    w = Writer(out_dir)
    for name, (seed, overrides) in MODELS.items():
        model_cases(w, name, seed, overrides)
    eos_cases(w, "int8_gqa", *MODELS["int8_gqa"])
    exit_gate_cases(w, "v2_ouro", *MODELS["v2_ouro"])
    w.finish()
    print(f"make_golden: {w.count} cases in {out_dir}")


if __name__ == "__main__":
    main()
