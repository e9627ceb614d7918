"""IQuest-Coder Loop: the float64 reference (tests/hf_reference.py's iquest_loop_logits) held
to vLLM itself, whose iquest_loopcoder.py it restates, on vLLM's CPU backend.

Contract:
    python tools/iquest_vllm_check.py [--vllm-python /work/vllm/venv/bin/python]
                                      [--vllm-env /work/vllm/env.sh] [--loops 2 3]
                                      [--seed 4] [--positions 60] [--tol 1e-3]
        run with the project's python (numpy only). For each loop_num of --loops: writes the
        tiny random IQuestLoopCoderForCausalLM checkpoint of tests/hf_folders.py (seed --seed),
        widened to hidden 128 (4 heads of 32, 2 KV heads: vLLM's CPU attention kernels reject
        head_dim 8), to a temporary folder deleted afterwards; runs vLLM offline on it in a
        subprocess of --vllm-python (after sourcing --vllm-env when that file exists; dtype
        float32, eager) on a prompt of --positions token ids below 96 (numpy default_rng(5)) with
        prompt_logprobs over the full vocabulary; and prints one markdown row: the largest
        |logprob difference| between vLLM's prompt logprobs at position p and the reference's
        log_softmax row p - 1, over every p >= 1 and every token, and the share of positions
        whose top-1 agrees. Exits 1 when a difference exceeds --tol or a top-1 disagrees.

config.json gets two keys vLLM needs beyond hf_folders': model_type "llama" (transformers
must know the config class; vLLM's registry maps the architecture name to its model) and
torch_dtype "float32". Each vLLM start takes about a minute on a 2-core box.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, HEAD_DIM = 128, 32         # the smallest head_dim vLLM's CPU attention supports is 32
sys.path.insert(0, os.path.join(ROOT, "tests"))


def tiny_checkpoint(seed, loop_num):
    """hf_folders' IQuest checkpoint with hidden WIDTH and head_dim HEAD_DIM."""
    from hf_folders import checkpoint
    return checkpoint("IQuestLoopCoderForCausalLM", seed=seed, loop_num=loop_num,
                      hidden_size=WIDTH, head_dim=HEAD_DIM, model_type="llama",
                      torch_dtype="float32")


def vllm_prompt_logprobs(folder, tokens, out):
    """(In the vLLM venv.) Writes {version, rows: per prompt position {token id: logprob}
    (None at 0)} to `out`."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=folder, dtype="float32", max_model_len=len(tokens) + 4, max_logprobs=-1,
              enforce_eager=True, enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1)
    result = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    rows = [None if row is None else {str(k): v.logprob for k, v in row.items()}
            for row in result.prompt_logprobs]
    with open(out, "w") as f:
        json.dump({"version": vllm.__version__, "rows": rows}, f)


def run_vllm(args, folder, tokens, out):
    command = [args.vllm_python, os.path.abspath(__file__), "--worker", folder,
               ",".join(map(str, tokens)), out]
    line = shlex.join(command)
    if os.path.exists(args.vllm_env):
        line = f"source {shlex.quote(args.vllm_env)} && {line}"
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"vLLM failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def compare(rows, logits):
    """(max |vLLM logprob - reference logprob| over p >= 1 and the tokens vLLM returned,
    top-1 agreements, positions compared)."""
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    worst, agree, n = 0.0, 0, 0
    for p, row in enumerate(rows):
        if p == 0 or row is None:
            continue
        ids = np.array([int(k) for k in row])
        got = np.array(list(row.values()))
        worst = max(worst, float(np.abs(got - ref[p - 1, ids]).max()))
        agree += int(ids[got.argmax()] == ref[p - 1].argmax())
        n += 1
    return worst, agree, n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/work/vllm/venv/bin/python")
    parser.add_argument("--vllm-env", default="/work/vllm/env.sh")
    parser.add_argument("--loops", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--positions", type=int, default=60)
    parser.add_argument("--tol", type=float, default=1e-3)
    args = parser.parse_args()
    from hf_folders import write_folder
    from hf_reference import iquest_loop_logits

    tokens = [int(i) for i in np.random.default_rng(5).integers(0, 96, args.positions)]
    print(f"`{shlex.join(['python', 'tools/iquest_vllm_check.py'] + sys.argv[1:])}`\n")
    print("| loop_num | vLLM | positions | logprobs per position | max abs logprob diff "
          "| top-1 agree |")
    print("|---|---|---|---|---|---|")
    ok = True
    for loop_num in args.loops:
        config, tensors = tiny_checkpoint(args.seed, loop_num)
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_folder(os.path.join(tmp, "model"), config, tensors)
            got = run_vllm(args, folder, tokens, os.path.join(tmp, "logprobs.json"))
        t64 = {k: v.astype(np.float64) for k, v in tensors.items()}
        worst, agree, n = compare(got["rows"], iquest_loop_logits(t64, config, tokens))
        width = len(got["rows"][1])
        print(f"| {loop_num} | {got['version']} | {n} | {width} | {worst:.2e} | {agree}/{n} |",
              flush=True)
        ok &= worst <= args.tol and agree == n
    sys.exit(0 if ok else 1)


if __name__ == "__main__":     # guarded: vLLM's CPU workers start by spawn and re-import this
    if sys.argv[1:2] == ["--worker"]:
        vllm_prompt_logprobs(sys.argv[2], [int(i) for i in sys.argv[3].split(",")], sys.argv[4])
    else:
        main()
