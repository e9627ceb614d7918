"""The vLLM side of bench_vllm.py: run by the vLLM install's own Python (bench/vllm_peer.py),
never by TinyLoop's. Opens `vllm.LLM` once on a model folder, then times the jobs of a JSON
file and writes what it measured to another.

    python vllm_offline.py JOBS.json OUT.json

JOBS.json: {"model": folder, "max_model_len": n, "jobs": [{"name": str, "max_tokens": n,
"runs": [[prompt ids, ...], ...]}]}. Each run is one LLM.generate call on all its prompts
(greedy, ignore_eos, no detokenizing: token ids in, token ids out); every run of a job uses
fresh prompts, so the prefix cache reuses only what a run shares within itself. The first run
of each job is a warm-up and is not timed. OUT.json: {"startup s": s, "jobs": {name: {"walls":
[s per timed run], "tokens": [ids of the last run, per prompt]}}}.

The __main__ guard is needed: vLLM's CPU backend starts its workers with spawn.
"""
import json
import sys
import time


def main(jobs_path, out_path):
    from vllm import LLM, SamplingParams      # only in the vLLM install's venv

    spec = json.loads(open(jobs_path).read())
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], seed=0)
    measured = {"startup s": time.perf_counter() - start, "jobs": {}}
    for job in spec["jobs"]:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                                detokenize=False)
        walls, tokens = [], None
        for i, prompts in enumerate(job["runs"]):
            began = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            if i:
                walls.append(time.perf_counter() - began)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
        measured["jobs"][job["name"]] = {"walls": walls, "tokens": tokens}
    with open(out_path, "w") as out:
        json.dump(measured, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
