"""Loop speculation on the published looped models' shapes, with trained models' predictions.

    python bench/bench_loop_speculation.py --predictions-from SHAPE=MODEL [..]
        [--configs SHAPE:LdxK,auto,..] [--tokens 32] [--prompt 64] [--repeats 1] [--threads 0]
        [--record-prompts 8] [--record-tokens 64] [--name loop-speculation]

Random weights draft nothing right, so their speed at a real acceptance needs that acceptance
from elsewhere. For each SHAPE (ouro-1.4b, huginn-0125) MODEL is a tiny model of its layout
trained so that its shallow loops mean something (tools/train_ouro_tiny.py --objective ouro:
a loss on every loop; tools/train_huginn_tiny.py: a random depth every step), a .tinyloop
file or a Hugging Face folder. At the shape's depth L it records the *predictions*: greedy plain
decoding of --record-tokens tokens from each of --record-prompts held-out prompts
(tools/demo_corpus.py), and for each emitted token its argmax at every depth 1 .. L at the
position before it (teacher-forced: Model.logits, by depth nesting every position's logits at
that depth).

Then for the shape (bench_real_shapes.py writes it, random int8 weights) it times greedy
decoding of --tokens tokens from a PrefixCache of a --prompt-token prompt (no prefill timed):
plain, then for each --configs setting (L_d x K, or `auto`: the wave chooses L_d) speculative
rounds (docs/spec.md §5.6; not for auto) and the wave (§5.6.1), with every decision the
schedules make (does a draft agree with the verifier, a deeper sample with a draft) taken on
the recorded ids through TINYLOOP_BENCH_PREDICTIONS (the library's bench-only hook). The
timings are real, the acceptance is real, only their pairing is synthetic. Each row also gives
the schedule's ideal speed-up with those predictions, were every pass as cheap as one row's:
plain decoding runs L loops a token, a round K' L_d + (L - L_d), the wave one loop a step (its
steps simulated as the library schedules them; tests/test_bench_loop_speculation.py holds the
simulation to the library's counts). And the wave's tokens, without the hook, are checked to
equal plain decoding's (the bench exits 1 otherwise).
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tinyloop
from bench_real_shapes import SHAPES, write_shape
from common import write_results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from demo_corpus import split_corpus  # noqa: E402

PREDICTIONS = "TINYLOOP_BENCH_PREDICTIONS"


def record_predictions(path, loops, prompts, tokens):
    """[(id at depth 1, .., id at depth L)] for each token greedy decoding of the model at
    `path` emits at depth `loops` from held-out prompts, teacher-forced."""
    val = split_corpus()[1]
    predicted = []
    with tinyloop.Model(path) as model:
        for i in range(prompts):
            prompt = list(val[i * 4096:i * 4096 + 32])
            out = model.generate(prompt, max_tokens=tokens, loops=loops, temperature=0.0)
            by_depth = [model.logits(out[:-1], loops=d).argmax(axis=1)[len(prompt) - 1:]
                        for d in range(1, loops + 1)]
            predicted += [tuple(int(ids[j]) for ids in by_depth) for j in range(len(by_depth[0]))]
    return predicted


def encode(predicted):
    """The TINYLOOP_BENCH_PREDICTIONS value of a list of per-token id tuples."""
    return ";".join(",".join(str(i) for i in group) for group in predicted)


def acceptance(predicted, depth):
    """The share of tokens whose depth-`depth` prediction is the full-depth one."""
    return sum(g[depth - 1] == g[-1] for g in predicted) / len(predicted)


def weight_reads(config):
    """(C, P, X): the parameters one core iteration, one position's entry (prelude, injection)
    and one ending (coda, head) read, as docs/spec.md §5.6.1 counts them; config a dict."""
    c = config
    d = float(c["d_model"])
    block = (d * (float(c["n_heads"]) + 2.0 * c["n_kv_heads"]) * c["head_dim"]
             + float(c["n_heads"]) * c["head_dim"] * d + 3.0 * c["ffn_dim"] * d)
    adapter = d * d if c.get("injection") else 0.0
    return (c["n_core_blocks"] * block + adapter, c.get("n_pre_blocks", 0) * block + adapter,
            c.get("n_coda_blocks", 0) * block + float(c["vocab_size"]) * d)


def choose_depth(loops, verified, agreed, reads):
    """The wave's automatic draft depth (docs/spec.md §5.6.1): the L_d with the fewest expected
    weight reads a token, s C + P + s X / L_d for s = L - (L - L_d) (agreed + 1) / (verified +
    1) expected steps, the first on a tie (the library's f64 operations, in its order)."""
    core, entry, end = reads
    best, least = 0, 0.0
    for d in range(1, loops):
        agree = float(agreed[d] + 1) / float(verified[d] + 1)
        steps = float(loops) - float(loops - d) * agree
        cost = steps * core + entry + steps * end / float(d)
        if best == 0 or cost < least:
            best, least = d, cost
    return best


def simulate_rounds(predicted, loops, draft_loops, n_draft, tokens):
    """(loops run, drafted, accepted) of speculative rounds decoding `tokens` tokens (the first
    from the prefix) on the recorded predictions, each pass costed as one row's."""
    emitted, cost, drafted, accepted = 1, 0, 0, 0
    while emitted < tokens:
        k = min(n_draft, tokens - emitted)
        m = 0
        while m < k:
            group = predicted[(emitted + m) % len(predicted)]
            agree = group[draft_loops - 1] == group[-1]
            m += 1
            accepted += agree
            if not agree:
                break
        cost += k * draft_loops + loops - draft_loops
        drafted += k
        emitted += m
    return cost, drafted, accepted


def simulate_wave(predicted, loops, draft_loops, n_draft, tokens, reads=(1.0, 0.0, 0.0)):
    """(steps, drafted, accepted) of the wave decoding `tokens` tokens (the first from the
    prefix) on the recorded predictions, scheduled as libtinyloop's speculate_wave.c schedules
    it: a step runs one loop of every position in flight. draft_loops 0: chosen as the library
    chooses it for a model whose weight_reads are `reads`."""
    def seen(index, depth):
        return predicted[index % len(predicted)][depth - 1]

    verified, agreed = [0] * loops, [0] * loops
    depth = draft_loops or choose_depth(loops, verified, agreed, reads)
    flight = [[0, seen(0, loops)]]  # each position in flight: [iterations done, seen as]
    emitted, steps, drafted, accepted = 1, 0, 0, 0
    while emitted < tokens:
        steps += 1
        k = len(flight)
        ends = flight[0][0] + 1 == loops
        samples = [f[0] + 1 < loops and (f[0] + 1) % depth == 0
                   and (j + 1 < k or (k <= n_draft and emitted + k < tokens))
                   for j, f in enumerate(flight)]
        for f in flight:
            f[0] += 1
        dropped, shift = False, 0
        if ends:
            final = seen(emitted, loops)
            emitted += 1
            checked = emitted < tokens and k > 1
            dropped = not (checked and flight[1][1] == final)
            if checked and not draft_loops:
                verified[depth] += 1
                agreed[depth] += not dropped
            if not dropped:
                flight.pop(0)
                accepted += 1
            else:
                depth = draft_loops or choose_depth(loops, verified, agreed, reads)
                flight = [[0, final]] if emitted < tokens else []
            shift = 1
        at = 0
        while not dropped and at < len(flight):
            if samples[at + shift]:
                sample = seen(emitted + at, flight[at][0])
                if not (at + 1 < len(flight) and flight[at + 1][1] == sample):
                    flight = flight[:at + 1] + [[0, sample]]
                    drafted += 1
                    break
            at += 1
    return steps, drafted, accepted


def ideal(schedule, predicted, loops, draft_loops, n_draft, tokens, reads=(1.0, 0.0, 0.0)):
    """Plain decoding's loops over the schedule's, every pass costed as one row's."""
    if schedule == "wave":
        steps = simulate_wave(predicted, loops, draft_loops, n_draft, tokens, reads)[0]
    else:
        steps = simulate_rounds(predicted, loops, draft_loops, n_draft, tokens)[0]
    return (tokens - 1) * loops / steps


def decode(model, prefix, tokens, **kw):
    """(emitted tokens, seconds, draft stats) of greedy decoding from prefix."""
    stats = {}
    t0 = time.perf_counter()
    out = model.generate_from_prefix_cache(prefix, suffix=[], max_tokens=tokens, temperature=0.0,
                                           draft_stats=stats, **kw)
    return out[len(prefix):], time.perf_counter() - t0, stats


def fastest(model, prefix, tokens, repeats, predictions=None, **kw):
    if predictions is not None:
        os.environ[PREDICTIONS] = predictions
    try:
        runs = [decode(model, prefix, tokens, **kw) for _ in range(repeats)]
    finally:
        os.environ.pop(PREDICTIONS, None)
    return min(runs, key=lambda r: r[1])


def settings(text):
    """'SHAPE:LdxK,auto,..' -> (shape, [(Ld, K), ..]), auto as (0, 64)."""
    shape, items = text.split(":")
    return shape, [(0, 64) if item == "auto" else tuple(int(v) for v in item.split("x"))
                   for item in items.split(",")]


def measure_shape(shape, pairs, predicted, args, workdir):
    path = os.path.join(workdir, f"{shape}.tinyloop")
    config = write_shape(path, shape, "int8", 0, args.prompt + args.tokens + 64)
    L = config.default_loops
    rows, encoded = [], encode(predicted)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, args.prompt).tolist()
    with tinyloop.Model(path, backend="native", threads=args.threads) as model:
        prefix = model.build_prefix_cache(prompt, loops=L)
        plain, plain_s, _ = fastest(model, prefix, args.tokens, args.repeats, loops=L)
        base = (args.tokens - 1) / plain_s
        rows.append(dict(shape=shape, schedule="plain", L=L, L_d="", K="", acceptance="",
                         tok_s=base, speedup=1.0, ideal=1.0))
        print(f"{shape}: plain {base:.3f} tok/s", flush=True)
        for draft_loops, n_draft in pairs:
            depth = draft_loops or "auto"
            short = min(8, args.tokens)
            same, _, _ = decode(model, prefix, short, loops=L, draft_loops=depth,
                                n_draft=n_draft, draft_wave=True)
            if same != plain[:short]:
                sys.exit(f"{shape} L_d {depth} K {n_draft}: the wave's tokens are not plain "
                         "decoding's")
            for schedule in ("rounds", "wave") if draft_loops else ("wave",):
                _, seconds, stats = fastest(model, prefix, args.tokens, args.repeats, encoded,
                                            loops=L, draft_loops=depth, n_draft=n_draft,
                                            draft_wave=schedule == "wave")
                bound = ideal(schedule, predicted, L, draft_loops, n_draft, args.tokens,
                              weight_reads(model.config()))
                tok_s = (args.tokens - 1) / seconds
                rows.append(dict(shape=shape, schedule=schedule, L=L, L_d=depth, K=n_draft,
                                 acceptance=stats["acceptance_rate"], tok_s=tok_s,
                                 speedup=tok_s / base, ideal=bound))
                print(f"{shape} {schedule} L_d {depth} K {n_draft}: {tok_s:.3f} tok/s, "
                      f"x{tok_s / base:.2f} (ideal x{bound:.2f}), acceptance "
                      f"{stats['acceptance_rate']:.2f}", flush=True)
    os.unlink(path)
    return rows


def model_file(source, workdir, shape):
    """A .tinyloop path: the file itself, or a Hugging Face folder converted to int8."""
    if not os.path.isdir(source):
        return source
    path = os.path.join(workdir, f"tiny-{shape}.tinyloop")
    tinyloop.convert(source, path, weight_format="int8")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictions-from", action="append", required=True,
                    type=lambda t: tuple(t.split("=", 1)), metavar="SHAPE=MODEL")
    ap.add_argument("--configs", action="append", default=[], type=settings,
                    help="SHAPE:LdxK[,LdxK|auto..], the draft settings timed on that shape")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="default: the library's")
    ap.add_argument("--record-prompts", type=int, default=8)
    ap.add_argument("--record-tokens", type=int, default=64)
    ap.add_argument("--name", default="loop-speculation")
    args = ap.parse_args(argv)
    defaults = {"ouro-1.4b": [(1, 4), (2, 2), (0, 64)], "huginn-0125": [(4, 8), (8, 4), (0, 64)]}
    chosen = dict(args.configs)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for shape, source in args.predictions_from:
            L = SHAPES[shape]["default_loops"]
            predicted = record_predictions(model_file(source, workdir, shape), L,
                                           args.record_prompts, args.record_tokens)
            rates = ", ".join(f"{d}: {acceptance(predicted, d):.2f}" for d in range(1, L))
            print(f"{shape}: {Path(source).name} at depth {L}, acceptance by draft depth {rates}",
                  flush=True)
            notes.append(f"{shape}: predictions of {Path(source).name} at depth {L} "
                         f"({len(predicted)} tokens; teacher-forced acceptance by L_d {rates})")
            rows += measure_shape(shape, chosen.get(shape, defaults[shape]), predicted, args,
                                  workdir)
    text = (f"Greedy decoding of {args.tokens} tokens from a {args.prompt}-token PrefixCache, "
            f"random int8 weights, native backend, fastest of {args.repeats}; every draft "
            "decision replayed from a trained tiny model's recorded predictions (real timings, "
            "real acceptance, a synthetic pairing). " + "; ".join(notes) + ". `ideal` = the "
            "schedule's speed-up with those predictions were every pass one row's cost.")
    print(write_results(args.name, rows, ["shape", "schedule", "L", "L_d", "K", "acceptance",
                                          "tok_s", "speedup", "ideal"], text))


if __name__ == "__main__":
    main()
