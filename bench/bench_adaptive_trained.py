"""Adaptive depth on trained looped models: what each exit threshold costs and saves.

    python bench/bench_adaptive_trained.py [--ouro [LABEL=]OURO ..] [--huginn [LABEL=]HUGINN ..]
        [--backend numba]
        [--gate-thresholds 0.3,0.5,0.7,0.9,1.0] [--latent-thresholds 0.01,0.03,0.1,0.3]
        [--kl-thresholds 0.001,0.01,0.1]
        [--huginn-loops L[,L2..]] [--windows 8] [--prompts 4] [--tokens 64]
        [--repeats 2] [--name adaptive-trained]

OURO is an Ouro-layout model with a trained exit gate and HUGINN a Huginn-layout one (each a
.tinyloop file, or a Hugging Face folder that is converted to int8 first; each option may be
given again for more models, LABEL naming its rows), as
tools/train_ouro_tiny.py --objective ouro and tools/train_huginn_tiny.py make them
(docs/performance.md, "Adaptive depth on trained models", has the commands). OURO is measured
under the `gate` rule at --gate-thresholds, HUGINN under the `latent` rule at
--latent-thresholds and the `kl` rule at --kl-thresholds (docs/spec.md §5.7), each at its depth L (the file's default_loops, or
each of --huginn-loops), and both at every fixed depth 1..L for comparison. On the demo corpus's
held-out split (tools/demo_corpus.py: every 40th chapter of the KJV), from its start:

  teacher-forced (tf)  --windows windows of 256 bytes, each byte predicted from the bytes
                       before it in its window (positions 1..255 scored). Every position runs
                       all L iterations; its exit U is where the rule stops on its own states
                       (the rule's own code, fallback/exit_rules.py, on the engine's states),
                       and it is scored with its depth-U logits (Model.logits(loops=U): depth
                       nesting makes them every position's logits at depth U). So `tf loops` is
                       the mean U and `tf bpb` the bits per byte of the adaptive model when
                       every earlier position is depth-complete.
  decoded (dec)        the same windows, fed as generation feeds them: the
                       window's first byte is the prompt, then each true byte is a decoded
                       token (the engine's own decode pass, the exit rule applied: earlier
                       tokens' skipped iterations read their last computed KV, spec §5.7) and
                       its logits score the next true byte. This is the loss of actual adaptive
                       decoding, the text forced to the held-out one. Where the rule cannot
                       fire (gate at 1) it is plain decoding, and the bench checks that it
                       scores exactly the teacher-forced full-depth bits.
  greedy               --prompts prompts (the first 32 bytes of a held-out window each), a
                       prefix built from each, then --tokens greedy tokens generated from it
                       with the rule: depth_stats' mean loops per decoded token and decode
                       tok/s (decode passes / seconds, best of --repeats, all prompts
                       together), and the speed-up over full depth L.

Fixed-depth rows ("fixed", loops U) run every token at depth U (no rule): their tf and dec
bpb are the same number by depth nesting. The rules' decisions use the engine's exact
arithmetic and so do not depend on the backend; --backend only sets whose decode speed is
timed (the numbers in docs name it and the CPU).
"""
import argparse
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import tinyloop                                                       # noqa: E402
from common import cpu_description, write_results                    # noqa: E402
from demo_corpus import split_corpus                                  # noqa: E402
from tinyloop.quickbench import backend_kwargs, best_of               # noqa: E402

WINDOW = 256
PROMPT_BYTES = 32


def python_engine(path, backend):
    """A Python engine of the file, with the backend's kernels (numpy's for native): the
    forward pass's pieces (tinyloop.fallback.forward) run on it directly."""
    from tinyloop.fallback import Engine
    from tinyloop.modelfile import load_identified_model
    config, tensors, identity = load_identified_model(path)
    if backend == "numba":
        from tinyloop.fallback.numba_cpu import NumbaKernels
        kernels = NumbaKernels(None)
    else:
        from tinyloop.fallback.forward import NumpyKernels
        kernels = NumpyKernels
    return Engine(config, tensors, 16, kernels, 0, model_identity=identity)


def rule_params(rule, threshold, loops):
    """What fallback/exit_rules.exit_rule reads of a request."""
    return types.SimpleNamespace(exit_rule=rule, exit_threshold=float(np.float32(threshold)),
                                 min_loops=1, loops=loops)


def iteration_states(engine, tokens, loops):
    """(state entering iteration 0 (T, d), [state after iteration i (T, d)] for i < loops),
    on the host, of a full-depth pass over tokens at positions 0..T-1."""
    from tinyloop.fallback.forward import core_iteration, prelude
    k, w = engine.kernels, engine.weights
    cache = engine.new_cache(loops, 0)
    try:
        x, injected = prelude(k, w, cache, np.asarray(tokens, np.int32), 0)
        entry, states = k.to_host(x), []
        for i in range(loops):
            x, injected = core_iteration(k, w, cache, i, x, injected, 0)
            states.append(k.to_host(x))
    finally:
        cache.free()
    return entry, states


def exits(engine, entry, states, logits, rule, threshold, loops):
    """Each position's exit U (1..loops) under the rule, judged by fallback/exit_rules.py on
    its own full-depth states (and, for the rules that probe, its logits at each depth:
    logits[i] (T, V) at depth i + 1)."""
    from tinyloop.fallback.exit_rules import exit_rule
    judge_rule = exit_rule(rule_params(rule, threshold, loops), engine.weights)
    if judge_rule is None:
        return np.full(len(entry), loops)
    out = np.full(len(entry), loops)
    for p in range(len(entry)):
        judge = judge_rule.start(entry[p])
        for i in range(loops - 1):
            if judge.exits(i, states[i][p], logits[i][p] if judge.probes else None):
                out[p] = i + 1
                break
    return out


def bits(logits, targets):
    """-log2 p(target) per row, from f32 logits with a float64 softmax."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    logp = z[np.arange(len(targets)), targets] - np.log(np.exp(z).sum(axis=-1))
    return -logp / np.log(2)


def forced_decode(engine, window, rule, threshold, loops):
    """(bits of bytes 2.. of window (W-2,), exit depth of each decoded token): window[0] is the
    prompt, window[1..W-2] are fed as decoded tokens through the engine's decode pass under the
    rule, each pass's logits scoring the next byte."""
    from tinyloop.fallback.exit_rules import exit_rule
    from tinyloop.fallback.forward import decode_pass, head_logits
    k, w = engine.kernels, engine.weights
    judge_rule = exit_rule(rule_params(rule, threshold, loops), w) if rule else None
    cache = engine.new_cache(loops, 0)
    logits, depths = [], []
    try:
        engine.prefill(cache, np.asarray(window[:1], np.int32), WINDOW)
        for token in window[1:-1]:
            x, depth = decode_pass(k, w, cache, int(token), judge_rule)
            logits.append(head_logits(k, w, x)[0])
            depths.append(depth)
    finally:
        cache.free()
    return bits(np.stack(logits), np.asarray(window[2:])), np.asarray(depths)


def greedy(model, prompts, loops, tokens, repeats, rule=None, threshold=None):
    """(mean loops per decoded token, decode tok/s) of greedy generation from each prompt's
    prefix, all prompts together, best of `repeats`."""
    prefixes = [model.build_prefix_cache(p, loops=loops) for p in prompts]
    kwargs = dict(max_tokens=tokens + 1, loops=loops, temperature=0.0)
    if rule:
        kwargs.update(exit_rule=rule, exit_threshold=threshold)

    def run():
        total = {"tokens": 0, "loops": 0}
        for prefix in prefixes:
            stats = {}
            model.generate_from_prefix_cache(prefix, depth_stats=stats, **kwargs)
            for key in total:
                total[key] += stats[key]
        return total
    total, seconds = best_of(run, repeats)
    if not total["tokens"]:                 # every generation stopped at once (an eos id)
        return None, None
    return total["loops"] / total["tokens"], total["tokens"] / seconds


def measure(name, path, rule, thresholds, loops, val, args):
    """The rows of one model: fixed depths 1..loops, then the rule at each threshold."""
    engine = python_engine(path, args.backend)
    windows = [np.frombuffer(val[i * WINDOW:(i + 1) * WINDOW + 1], np.uint8).astype(np.int64)
               for i in range(args.windows)]
    prompts = [wd[:PROMPT_BYTES] for wd in windows[:args.prompts]]
    rows = []
    with tinyloop.Model(path, prefix_cache_bytes=0, **backend_kwargs(args.backend)) as model:
        print(f"{name}: logits at every depth, states of every iteration ...", flush=True)
        depth_bits = np.zeros((loops, len(windows), WINDOW - 1))     # [U-1, window, position]
        runs = []
        for j, wd in enumerate(windows):
            logits = [model.logits(wd[:WINDOW], loops=u) for u in range(1, loops + 1)]
            for u in range(1, loops + 1):
                depth_bits[u - 1, j] = bits(logits[u - 1][1:], wd[2:])
            runs.append(iteration_states(engine, wd[:WINDOW], loops) + (logits,))
        full_speed = None
        for u in list(range(loops, 0, -1)):
            print(f"{name}: fixed depth {u} ...", flush=True)
            mean_loops, speed = greedy(model, prompts, u, args.tokens, args.repeats)
            full_speed = full_speed or speed
            tf = float(depth_bits[u - 1].mean())
            rows.append(row(name, loops, "fixed", "", u, tf, u, tf, mean_loops, speed,
                            full_speed))
        rows.reverse()
        for q in thresholds:
            print(f"{name}: {rule} at {q} ...", flush=True)
            tf_loops, tf_bits = [], []
            for j, (entry, states, logits) in enumerate(runs):
                u = exits(engine, entry, states, logits, rule, q, loops)[1:]
                tf_loops.append(u)
                tf_bits.append(depth_bits[u - 1, j, np.arange(WINDOW - 1)])
            dec_bits, dec_loops = [], []
            for j, wd in enumerate(windows):
                b, d = forced_decode(engine, wd, rule, q, loops)
                if (d == loops).all():          # no exit: plain decoding, = depth L's logits
                    assert np.allclose(b, depth_bits[loops - 1, j], rtol=0, atol=1e-9), q
                dec_bits.append(b)
                dec_loops.append(d)
            mean_loops, speed = greedy(model, prompts, loops, args.tokens, args.repeats, rule, q)
            rows.append(row(name, loops, rule, q, float(np.mean(tf_loops)), float(np.mean(tf_bits)),
                            float(np.mean(np.concatenate(dec_loops))),
                            float(np.mean(np.concatenate(dec_bits))), mean_loops, speed,
                            full_speed))
        runtime = model.runtime()
    return rows, runtime


def row(model, loops, rule, q, tf_loops, tf_bpb, dec_loops, dec_bpb, greedy_loops, speed,
        full):
    return {"model": model, "L": loops, "rule": rule, "threshold": q, "tf loops": tf_loops,
            "tf bpb": tf_bpb, "dec loops": dec_loops, "dec bpb": dec_bpb,
            "greedy loops": greedy_loops, "decode tok/s": speed,
            "speed-up": speed / full if speed and full else None}


def model_file(source, workdir, label):
    """A .tinyloop path: the file itself, or a Hugging Face folder converted to int8."""
    if os.path.isdir(source):
        path = os.path.join(workdir, f"{label}.tinyloop")
        tinyloop.convert(source, path, weight_format="int8")
        return path
    return source


def labelled(option, default):
    """(label, source) of a [LABEL=]SOURCE option."""
    label, _, source = option.rpartition("=")
    return label or default, source


def floats(text):
    return [float(v) for v in text.split(",") if v]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ouro", action="append", default=[],
                    help="[LABEL=]Ouro-layout model with an exit gate (file or HF folder)")
    ap.add_argument("--huginn", action="append", default=[],
                    help="[LABEL=]Huginn-layout model (file or HF folder)")
    ap.add_argument("--backend", default="numba", choices=("numpy", "numba", "native"))
    ap.add_argument("--gate-thresholds", type=floats, default=[0.3, 0.5, 0.7, 0.9, 1.0])
    ap.add_argument("--latent-thresholds", type=floats, default=[0.01, 0.03, 0.1, 0.3])
    ap.add_argument("--kl-thresholds", type=floats, default=[],
                    help="also run HUGINN under the kl rule at these (default: none)")
    ap.add_argument("--huginn-loops", type=lambda t: [int(v) for v in t.split(",")],
                    default=None, help="depths L to run the Huginn model at (default: its own)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="adaptive-trained")
    args = ap.parse_args(argv)
    if not (args.ouro or args.huginn):
        ap.error("give --ouro and/or --huginn")
    val = split_corpus()[1]
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        runs = ([labelled(s, "ouro") + ("gate", args.gate_thresholds) for s in args.ouro]
                + [labelled(s, "huginn") + (rule, thresholds) for s in args.huginn
                   for rule, thresholds in (("latent", args.latent_thresholds),
                                            ("kl", args.kl_thresholds)) if thresholds])
        for n, (label, source, rule, thresholds) in enumerate(runs):
            path = model_file(source, tmp, f"{n}-{label}")
            with tinyloop.Model(path, backend="numpy") as probe:
                config = probe.config()
            depths = (args.huginn_loops if rule != "gate" and args.huginn_loops
                      else [config["default_loops"]])
            for loops in depths:
                got, runtime = measure(label, path, rule, thresholds, loops, val, args)
                rows += got
            notes.append(f"{label}: {config['n_pre_blocks']} + {config['n_core_blocks']} x L "
                         f"+ {config['n_coda_blocks']} blocks, d {config['d_model']}, int8, "
                         f"rule {rule}")
    cpu = cpu_description()[0]
    note = (f"CPU {cpu}, backend {args.backend} ({runtime['device_name']}, "
            f"{runtime['threads']} threads). " + "; ".join(notes) + ". Held-out KJV: "
            f"tf = teacher-forced, dec = forced decoding, over the same {args.windows} x 255 "
            f"bytes; greedy = {args.prompts} prompts of "
            f"{PROMPT_BYTES} bytes + {args.tokens} tokens, best of {args.repeats}.")
    formats = {"threshold": "g", "tf bpb": ".3f", "dec bpb": ".3f", "decode tok/s": ".0f"}
    print(write_results(args.name, rows, list(rows[0]), note, formats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
