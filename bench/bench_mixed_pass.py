"""One mixed pass per scheduler step against separate passes (issue #34 point 2), offline
through tinyloop.Scheduler on the native backend.

    python bench/bench_mixed_pass.py [--shapes quick,full] [--workloads prompts,questions]
                                     [--requests 32] [--rounds 3] [--threads 2] [--dir DIR]

The workloads: --requests requests (max_batch = all of them, step_tokens 512) of random prompts
(no shared prefix, no prefix cache: every prompt is prefilled), greedy; request i arrives at
step i * every, so new prompts are prefilled while the earlier requests decode, as in serving:
- prompts: 64 to 384 prompt tokens, 32 new tokens each, one arriving every 2 steps;
- questions: 16 to 64 prompt tokens (a question after a cached system prompt), 64 new tokens
  each, one arriving every step.
"mixed" is the default scheduler: a step's decode rows and prompt chunks run as one pass that
reads each weight once; "separate" sets TINYLOOP_MIXED_PASS=0 (read when a Scheduler is made),
so each step runs its decodes in one batched pass and then each prompt chunk alone.

Paired steps: these machines are shared, and a whole schedule's time drifts by 20-40% from run
to run, more than the difference measured. So the two schedulers run the workload in lock-step
on one model, step k of one right after step k of the other (which goes first alternates), each
step timed alone: both see the same requests in the same state, and a burst of load from
elsewhere lands on both. They must emit the same events at every step (checked). --rounds
repeats the whole workload; the figures are medians over the rounds.

Columns: steps; mixed passes (the steps with both decodes and prompt chunks, as the mixed
scheduler counted them); seconds (the sum of the scheduler's step times); tok/s (prompt +
generated tokens over it); mixed-step ms (the mean time of the steps that were mixed passes, and
of the same steps in the separate schedule); ratio = separate's seconds / mixed's (the
speed-up); same tokens (every step emitted the same events in both).

Writes bench/results/mixed-pass.{json,md} (mixed-pass-<N>-requests with another --requests).
"""
import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import tinyloop
from common import SHAPES, cpu_description, model_file, write_results
from tinyloop.backends import native_isas

STEP_TOKENS = 512
MODES = ("mixed", "separate")
WORKLOADS = {"prompts": dict(prompt_min=64, prompt_max=384, max_tokens=32, every=2),
             "questions": dict(prompt_min=16, prompt_max=64, max_tokens=64, every=1)}


@contextlib.contextmanager
def passes(mode):
    """Schedulers made inside run `mode` ("mixed" or "separate") passes."""
    if mode == "separate":
        os.environ["TINYLOOP_MIXED_PASS"] = "0"
    try:
        yield
    finally:
        os.environ.pop("TINYLOOP_MIXED_PASS", None)


def workload(kind, n_requests, vocab_size, seed):
    """[(arrival step, prompt)] of workload `kind`."""
    w = WORKLOADS[kind]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(w["prompt_min"], w["prompt_max"] + 1, n_requests)
    return [(i * w["every"], rng.integers(0, vocab_size, n).tolist()) for i, n in enumerate(lengths)]


def paired_schedule(model, requests, max_tokens):
    """The workload on a mixed and a separate scheduler in lock-step: ({mode: [each step's
    seconds]}, {mode: counters}, [whether each step was a mixed pass], same events)."""
    schedulers = {}
    for mode in MODES:
        with passes(mode):
            schedulers[mode] = tinyloop.Scheduler(model, max_batch=len(requests),
                                                  step_tokens=STEP_TOKENS)
    times = {mode: [] for mode in MODES}
    mixed_steps, same = [], True
    try:
        for step in range(1_000_000):
            for scheduler in schedulers.values():
                for at, prompt in requests:
                    if at == step:
                        scheduler.add(prompt, max_tokens=max_tokens, temperature=0.0)
            events = {}
            before = schedulers["mixed"].stats()["mixed_passes"]
            for mode in (MODES if step % 2 == 0 else MODES[::-1]):
                start = time.perf_counter()
                events[mode] = [tuple(e) for e in schedulers[mode].step()]
                times[mode].append(time.perf_counter() - start)
            mixed_steps.append(schedulers["mixed"].stats()["mixed_passes"] > before)
            same = same and events["mixed"] == events["separate"]
            if step >= requests[-1][0] and not any(s.has_work for s in schedulers.values()):
                return times, {m: s.stats() for m, s in schedulers.items()}, mixed_steps, same
        raise AssertionError("the schedulers did not finish")
    finally:
        for scheduler in schedulers.values():
            scheduler.close()


def bench_workload(model, shape, kind, args):
    """The rows of one shape and workload: each scheduler's medians over the rounds."""
    requests = workload(kind, args.requests, model.config()["vocab_size"], args.seed)
    max_tokens = WORKLOADS[kind]["max_tokens"]
    tokens = sum(len(p) for _, p in requests) + args.requests * max_tokens
    paired_schedule(model, requests[:2], max_tokens)                        # warm-up
    rounds = []
    for _ in range(args.rounds):
        times, stats, mixed_steps, same = paired_schedule(model, requests, max_tokens)
        totals = {mode: sum(t) for mode, t in times.items()}
        at_mixed = {mode: statistics.mean([t for t, m in zip(times[mode], mixed_steps) if m] or [0])
                    for mode in MODES}
        rounds.append((totals, at_mixed, stats, same))
        print(f"{shape} {kind}: mixed {totals['mixed']:.2f} s, separate {totals['separate']:.2f} s"
              f" ({stats['mixed']['steps']} steps, {stats['mixed']['mixed_passes']} mixed passes)",
              flush=True)
    rows = []
    for mode in MODES:
        seconds = statistics.median(r[0][mode] for r in rounds)
        stats = rounds[0][2][mode]
        rows.append({"shape": shape, "workload": kind, "passes": mode, "steps": stats["steps"],
                     "mixed passes": stats["mixed_passes"], "seconds": seconds,
                     "tok/s": tokens / seconds,
                     "mixed-step ms": 1000 * statistics.median(r[1][mode] for r in rounds),
                     "ratio": statistics.median(r[0][mode] / r[0]["mixed"] for r in rounds),
                     "same tokens": "yes" if all(r[3] for r in rounds) else "NO"})
    return rows


def bench_shape(shape, args, directory):
    path = model_file(shape, "int8", directory, print)
    with tinyloop.Model(path, backend="native", threads=args.threads,
                        prefix_cache_bytes=0) as model:
        return [row for kind in args.workloads for row in bench_workload(model, shape, kind, args)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="quick,full")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    args.workloads = args.workloads.split(",")
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes {args.shapes}: the shapes are {', '.join(SHAPES)}")
    if not set(args.workloads) <= set(WORKLOADS):
        ap.error(f"--workloads: the workloads are {', '.join(WORKLOADS)}")
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for shape in shapes for row in bench_shape(shape, args, args.dir or scratch)]
    if any(row["same tokens"] != "yes" for row in rows):
        print("bench_mixed_pass: the mixed and separate schedules emitted different events",
              file=sys.stderr)
        return 1
    notes = (f"CPU: {cpu_description()[0]}; native at its best kernel path of "
             f"{', '.join(native_isas())}, {args.threads} threads, int8. {args.requests} requests "
             f"(max_batch {args.requests}, step_tokens {STEP_TOKENS}), random prompts, no prefix "
             "cache, greedy; prompts: 64-384 prompt + 32 new tokens, one arriving every 2 steps; "
             "questions: 16-64 + 64, one every step. The two schedulers step in lock-step (paired "
             f"steps); median of {args.rounds} rounds; ratio = separate passes' seconds / the "
             "mixed pass's.")
    columns = ["shape", "workload", "passes", "steps", "mixed passes", "seconds", "tok/s",
               "mixed-step ms", "ratio", "same tokens"]
    name = "mixed-pass" if args.requests == 32 else f"mixed-pass-{args.requests}-requests"
    print(write_results(name, rows, columns, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
