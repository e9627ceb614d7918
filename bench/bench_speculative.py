"""Self-speculative decoding and prefix warm start (issue #18), on the native backend by default.

    python bench/bench_speculative.py [--smoke] [--models demo,ouro] [--tokens 384] [--rounds 7]
        [--warm-rounds 15] [--draft-depths 1,2,3] [--draft-counts 2,4,8] [--backend native]
        [--threads N] [--ouro-steps 600] [--dir DIR] [--skip decode,warm]

decode  Decode tok/s of plain decoding and of self-speculative decoding (draft_loops L_d,
        n_draft K) at every L_d in {1, 2, L/2} below L (or those of --draft-depths below L) and
        K in {2, 4, 8} (or --draft-counts), greedy and sampled (T 0.7, top-k 50, a fixed seed),
        over the prompts of `tinyloop demo` (KJV text), each decoding --tokens tokens from a
        PrefixCache of its prompt (so no prefill is timed). The plain and speculative runs of a
        row alternate prompt by prompt, their order swapped every round (this machine is shared
        and noisy); a row's tok/s are its total tokens over its fastest round's time, `ratio` =
        spec tok/s / plain tok/s of the same row. drafted / accepted / acceptance: the
        draft_stats of one round's requests summed. `same tokens`: every speculative run
        emitted exactly plain decoding's tokens.
        Models: `demo`, the bundled demo model (tinyloop/data/demo.tinyloop, L 6, trained on
        the KJV, so acceptance is meaningful); `ouro`, an Ouro-layout checkpoint (sandwich norms,
        step norm, MHA; tools/train_ouro_tiny.py's defaults: d 128, 2 layers x 4 passes) briefly
        trained on the same corpus for --ouro-steps steps or as many as --ouro-minutes allow
        (the notes say how many; 0 steps: its random initial weights, whose acceptance means
        nothing), saved under --dir (default ~/.cache/tinyloop-bench) and reused on later
        runs, and converted with tinyloop.convert to int8.

warm    On the demo model, a 512-token prompt (Genesis 1) built at L_b in {1, 2, 3} with
        warm_start=True and then extended in place to L = 6 (PrefixCache.extend), against a
        rebuild at L = 6, alternating: the fastest of --warm-rounds of each, `extend / rebuild`
        next to the share of the work extension should cost: (L - L_b) / L of the loop, and
        `layer share`, the share of the layers a build runs (n_pre + L x (n_core + n_coda):
        a build runs the coda after every depth) that extension runs ((L - L_b) x (n_core +
        n_coda): the prelude is not rerun). `same as rebuilt`: 32 greedy tokens from the
        extended prefix, and from a warm prefix deepened by generate_from_prefix_cache(loops=L),
        equal the rebuilt prefix's, logits bit for bit.

--smoke is the smallest run (one prompt, 24 tokens, L_d 1, K 2, one round, random Ouro
weights) that tests/test_bench_speculative.py runs. The notes of each table name the CPU
(lscpu's model name and CPU count) and the library's thread count; the decode table's notes
say whether the issue's goal, >= 1.8x plain decoding's tok/s on the demo model at temperature
0 with identical tokens, is met. Writes bench/results/speculative-<mode>.{json,md} and
warm-start-<mode>.{json,md} (mode: full or smoke); exits 1 when any run's tokens differ.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tinyloop
from common import DEFAULT_LLAMA_DIR, exit_text, write_results
from tinyloop.bundled import demo_model_path
from tinyloop.demo import REQUESTS, SYSTEM_PROMPT
from tinyloop.quickbench import backend_kwargs

ROOT = Path(__file__).resolve().parent.parent
TRAIN_OURO = ROOT / "tools" / "train_ouro_tiny.py"
TRAINED = "trained.txt"          # beside the checkpoint: the trainer's "trained N steps in Ss"

DRAFT_COUNTS = (2, 4, 8)
SAMPLINGS = {"greedy": dict(temperature=0.0),
             "T 0.7, top-k 50": dict(temperature=0.7, top_k=50, seed=7)}
GOAL_RATIO = 1.8
WARM_DEPTHS = (1, 2, 3)
WARM_CHECK_TOKENS = 32
# Genesis 1:1-10 (KJV), one verse per line as in the demo's corpus; the warm-start prompt is
# its first 512 bytes (the models' tokens are bytes).
GENESIS = (
    "In the beginning God created the heaven and the earth.\n"
    "And the earth was without form, and void; and darkness was upon the face of the deep. "
    "And the Spirit of God moved upon the face of the waters.\n"
    "And God said, Let there be light: and there was light.\n"
    "And God saw the light, that it was good: and God divided the light from the darkness.\n"
    "And God called the light Day, and the darkness he called Night. And the evening and the "
    "morning were the first day.\n"
    "And God said, Let there be a firmament in the midst of the waters, and let it divide the "
    "waters from the waters.\n"
    "And God made the firmament, and divided the waters which were under the firmament from "
    "the waters which were above the firmament: and it was so.\n"
    "And God called the firmament Heaven. And the evening and the morning were the second day.\n"
    "And God said, Let the waters under the heaven be gathered together unto one place, and "
    "let the dry land appear: and it was so.\n"
    "And God called the dry land Earth; and the gathering together of the waters called he "
    "Seas: and God saw that it was good.\n")
WARM_PROMPT_TOKENS = 512


def byte_tokens(text):
    return list(text.encode("ascii"))


def decode_prompts():
    """The prompts of `tinyloop demo`: its system prompt followed by each request."""
    return [byte_tokens(SYSTEM_PROMPT + request) for request in REQUESTS]


def draft_depths(loops):
    """L_d in {1, 2, L/2} below L, in order, each once."""
    return sorted({d for d in (1, 2, loops // 2) if 1 <= d < loops})


def cpu_line(threads):
    """'<lscpu model name>, <n> CPUs; tinyloop on <threads> threads'."""
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
            if ":" in line)
        cpu = f"{fields['Model name'].strip()}, {fields['CPU(s)'].strip()} CPUs (lscpu)"
    except (OSError, subprocess.CalledProcessError, KeyError):
        cpu = f"unknown CPU (no lscpu), {os.cpu_count()} CPUs"
    return f"{cpu}; tinyloop on {threads} thread{'' if threads == 1 else 's'}"




# --- decode ----------------------------------------------------------------------------------

def decode_row(model, prefixes, tokens, rounds, sampling, draft_loops, n_draft):
    """One table row: plain and speculative decoding of `tokens` tokens from every prefix,
    alternating (see the module's docstring)."""
    kw = dict(max_tokens=tokens, **SAMPLINGS[sampling])
    spec_kw = dict(kw, draft_loops=draft_loops, n_draft=n_draft)
    plain_s, spec_s, same = [], [], True
    drafted = accepted = 0
    for r in range(rounds):
        seconds = {"plain": 0.0, "spec": 0.0}
        for prefix in prefixes:
            stats = {}
            runs = {"plain": kw, "spec": dict(spec_kw, draft_stats=stats)}
            out = {}
            for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                start = time.perf_counter()
                out[name] = model.generate_from_prefix_cache(prefix, **runs[name])
                seconds[name] += time.perf_counter() - start
            same = same and out["plain"] == out["spec"]
            if r == 0:
                drafted += stats["drafted"]
                accepted += stats["accepted"]
        plain_s.append(seconds["plain"])
        spec_s.append(seconds["spec"])
    total = tokens * len(prefixes)
    return {"L_d": draft_loops, "K": n_draft, "plain tok/s": total / min(plain_s),
            "spec tok/s": total / min(spec_s), "ratio": min(plain_s) / min(spec_s),
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0, "same tokens": same}


def decode_rows(name, path, args, progress):
    with tinyloop.Model(path, threads=args.threads, **backend_kwargs(args.backend),
                        prefix_cache_bytes=0) as model:
        loops = model.config()["default_loops"]
        prompts = decode_prompts()[:args.prompts]
        prefixes = [model.build_prefix_cache(p) for p in prompts]
        rows = []
        for sampling in SAMPLINGS:
            for draft_loops in ([d for d in args.draft_depths if d < loops]
                                if args.draft_depths else draft_depths(loops)):
                for n_draft in args.draft_counts:
                    progress(f"{name} {sampling}: L_d {draft_loops}, K {n_draft}")
                    row = decode_row(model, prefixes, args.tokens, args.rounds, sampling,
                                     draft_loops, n_draft)
                    rows.append({"model": name, "sampling": sampling, "L": loops, **row})
                    progress(f"  {row}")
        return rows, model.runtime()["threads"]


def ouro_model(args, workdir, progress):
    """(the converted Ouro-layout model's path, how its checkpoint was trained), training the
    checkpoint first when --dir has none for these --ouro-steps."""
    folder = Path(args.dir) / f"ouro-tiny-steps{args.ouro_steps}"
    summary = folder / TRAINED
    if not summary.exists():
        progress(f"training the Ouro-layout checkpoint for {args.ouro_steps} steps into {folder}")
        command = [sys.executable, str(TRAIN_OURO), str(folder), "--steps", str(args.ouro_steps),
                   "--minutes", str(args.ouro_minutes)]
        trained = None
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as run:
            for line in run.stdout:
                progress("  " + line.rstrip())
                if line.startswith("trained "):          # "trained N steps in Ss"
                    trained = line.strip()
        if run.returncode or trained is None:
            raise SystemExit(f"{TRAIN_OURO.name} failed ({exit_text(run.returncode)})")
        summary.write_text(trained + "\n")
    path = Path(workdir) / "ouro.tinyloop"
    tinyloop.convert(str(folder), str(path), weight_format="int8")
    return path, summary.read_text().strip()


def goal(rows):
    """The issue's decode goal on the demo model, met or not, as a sentence."""
    greedy = [r for r in rows if r["model"] == "demo" and r["sampling"] == "greedy"]
    if not greedy:
        return ""
    best = max(greedy, key=lambda r: r["ratio"])
    met = best["ratio"] >= GOAL_RATIO and all(r["same tokens"] for r in greedy)
    return (f"Goal >= {GOAL_RATIO}x plain decoding on the demo model at temperature 0 with "
            f"identical tokens: best {best['ratio']:.2f}x (L_d {best['L_d']}, K {best['K']}), "
            f"{'met' if met else 'not met'}.")


# --- warm start ------------------------------------------------------------------------------

def check_from(model, prefix, **kw):
    """32 greedy tokens from `prefix` and the logits they came from."""
    return model.generate_from_prefix_cache(prefix, max_tokens=WARM_CHECK_TOKENS,
                                            return_logits=True, **kw)


def same_output(a, b):
    return a[0] == b[0] and np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


def layer_share(config, build_loops, loops):
    """The share of a build's layers at `loops` that extending one built at build_loops runs."""
    per_depth = config["n_core_blocks"] + config["n_coda_blocks"]
    return (loops - build_loops) * per_depth / (config["n_pre_blocks"] + loops * per_depth)


def warm_row(model, prompt, build_loops, loops, rounds):
    """One table row: `rounds` warm builds at build_loops extended to `loops`, alternating with
    as many rebuilds at `loops`."""
    seconds = {"build": [], "extend": [], "rebuild": []}

    def warm():
        start = time.perf_counter()
        prefix = model.build_prefix_cache(prompt, loops=build_loops, warm_start=True)
        built = time.perf_counter()
        prefix.extend(loops)
        seconds["build"].append(built - start)
        seconds["extend"].append(time.perf_counter() - built)
        return prefix

    def rebuild():
        start = time.perf_counter()
        prefix = model.build_prefix_cache(prompt, loops=loops)
        seconds["rebuild"].append(time.perf_counter() - start)
        return prefix

    for r in range(rounds):
        if r % 2 == 0:
            extended, rebuilt = warm(), rebuild()
        else:
            rebuilt, extended = rebuild(), warm()
    want = check_from(model, rebuilt)
    deepened_on_use = model.build_prefix_cache(prompt, loops=build_loops, warm_start=True)
    same = (extended.loops == loops and same_output(check_from(model, extended), want)
            and same_output(check_from(model, deepened_on_use, loops=loops), want)
            and deepened_on_use.loops == loops)
    fastest = {step: min(times) for step, times in seconds.items()}
    return {"L_b": build_loops, "L": loops, "build at L_b ms": 1e3 * fastest["build"],
            "extend ms": 1e3 * fastest["extend"], "rebuild at L ms": 1e3 * fastest["rebuild"],
            "extend / rebuild": fastest["extend"] / fastest["rebuild"],
            "(L - L_b) / L": (loops - build_loops) / loops,
            "layer share": layer_share(model.config(), build_loops, loops),
            "same as rebuilt": same}


def warm_rows(args, progress):
    prompt = byte_tokens(GENESIS)[:WARM_PROMPT_TOKENS]
    with tinyloop.Model(demo_model_path(), threads=args.threads, **backend_kwargs(args.backend),
                        prefix_cache_bytes=0) as model:
        loops = model.config()["default_loops"]
        rows = []
        for build_loops in WARM_DEPTHS:
            progress(f"warm start: {len(prompt)} tokens built at L_b {build_loops}, "
                     f"extended to {loops}")
            rows.append(warm_row(model, prompt, build_loops, loops, args.warm_rounds))
            progress(f"  {rows[-1]}")
        return rows, model.runtime()["threads"]


# --- main ------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the smallest run (the test's)")
    ap.add_argument("--models", default="demo,ouro")
    ap.add_argument("--tokens", type=int, default=384, help="tokens decoded per prompt")
    ap.add_argument("--prompts", type=int, default=len(REQUESTS))
    ap.add_argument("--draft-depths", default="", help="L_d values (default: 1, 2, L/2 below L)")
    ap.add_argument("--draft-counts", default=",".join(map(str, DRAFT_COUNTS)), help="K values")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of each decode row")
    ap.add_argument("--warm-rounds", type=int, default=15, help="rounds of each warm-start row")
    ap.add_argument("--backend", default="native", help="a backend, or native-cuda (GPU)")
    ap.add_argument("--threads", type=int, default=None, help="default: the backend's")
    ap.add_argument("--ouro-steps", type=int, default=600,
                    help="training steps of the Ouro-layout model (0: random weights)")
    ap.add_argument("--ouro-minutes", type=float, default=8.0, help="its wall-time cap")
    ap.add_argument("--dir", default=str(DEFAULT_LLAMA_DIR),
                    help="where the trained Ouro checkpoint is kept between runs")
    ap.add_argument("--skip", default="", help="comma list of decode,warm to skip")
    args = ap.parse_args(argv)
    args.mode = "smoke" if args.smoke else "full"
    args.draft_depths = [int(d) for d in args.draft_depths.split(",") if d]
    args.draft_counts = [int(k) for k in args.draft_counts.split(",")]
    if args.smoke:
        args.tokens, args.prompts, args.rounds, args.warm_rounds, args.ouro_steps = 24, 1, 1, 1, 0
        args.draft_depths, args.draft_counts = [1], [2]
    args.models = args.models.split(",")
    if not set(args.models) <= {"demo", "ouro"}:
        ap.error(f"--models {','.join(args.models)}: the models are demo and ouro")
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def main(argv=None):
    args = parse_args(argv)

    def progress(text):
        print(text, flush=True)

    same = True
    if "decode" not in args.skip:
        rows, threads, notes = [], None, []
        with tempfile.TemporaryDirectory() as workdir:
            for name in args.models:
                if name == "demo":
                    path = demo_model_path()
                else:
                    path, trained = ouro_model(args, workdir, progress)
                    notes.append(f"Ouro-layout model {trained}" if args.ouro_steps else
                                 "Ouro-layout model with random weights (acceptance means nothing)")
                model_rows, threads = decode_rows(name, path, args, progress)
                rows += model_rows
        notes = " ".join([f"{cpu_line(threads)}. {args.backend} backend; {args.tokens} tokens "
                          f"decoded from each of {args.prompts} KJV prompt(s), fastest of "
                          f"{args.rounds} round(s).", *(n + "." for n in notes), goal(rows)])
        print(write_results(f"speculative-{args.mode}", rows, list(rows[0]), notes))
        same = all(r["same tokens"] for r in rows)
    if "warm" not in args.skip:
        rows, threads = warm_rows(args, progress)
        notes = (f"{cpu_line(threads)}. {args.backend} backend, demo model, a {WARM_PROMPT_TOKENS}-"
                 f"token prompt, fastest of {args.warm_rounds} round(s).")
        print(write_results(f"warm-start-{args.mode}", rows, list(rows[0]), notes))
        same = same and all(r["same as rebuilt"] for r in rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
