"""libtinyloop's CUDA backend on the emulated device (docs/gpu.md, libtinyloop/run_cuda_emulation.sh):
its failure paths, driven by failures the emulation injects on purpose (TINYLOOP_CUDA_EMU_FAIL),
and the device variants only the emulation can make (no device, no memory pools). Each failed call
raises (out of device memory: MemoryError from the engine, so a Scheduler step can be retried;
RuntimeError("out of memory") from Model), and every later answer of the same model is
bit-identical to the CPU's: no failure loses or corrupts state.

These run only against a library built with TINYLOOP_CUDA_EMULATION (TINYLOOP_LIBRARY), and are
skipped elsewhere with that reason; TINYLOOP_REQUIRE_EMULATION=1 (set by the CI script) turns the
skip into a failure."""
import os
import subprocess
import sys

import pytest
from conftest import run_retrying_failed_steps

import tinyloop

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 7, 140, 2, 77, 31, 9, 250, 12, 4, 66]
NEW = 6


def emulated_device():
    """'' when the native CUDA device is the emulation, else why these tests cannot run."""
    info = tinyloop.backend_info("native", "cuda")
    if not info["cuda_available"]:
        return f"no CUDA device ({info['cuda_reason']})"
    return ""


@pytest.fixture(scope="module")
def model_path(model_files):
    why = emulated_device()
    if why and os.environ.get("TINYLOOP_REQUIRE_EMULATION") == "1":
        pytest.fail(f"TINYLOOP_REQUIRE_EMULATION=1 but {why}")
    if why:
        pytest.skip(f"needs libtinyloop built with TINYLOOP_CUDA_EMULATION: {why}")
    path = model_files["int8-gqa"]
    with tinyloop.Model(path, backend="native", device="cuda") as m:
        if "emulation" not in m.runtime()["device_name"]:
            pytest.skip(f"a real GPU ({m.runtime()['device_name']}): failures are injected only "
                        "on the emulation")
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    with tinyloop.Model(model_path, backend="native", device="cpu") as m:
        return m.generate(PROMPT, max_tokens=NEW)


@pytest.fixture
def inject(monkeypatch):
    """inject("call:n,...") makes the n-th use of each named CUDA call fail from now on."""
    return lambda spec: monkeypatch.setenv("TINYLOOP_CUDA_EMU_FAIL", spec)


def test_a_graph_that_cannot_be_instantiated_falls_back_to_plain_launches(model_path, reference,
                                                                          inject):
    with tinyloop.Model(model_path, backend="native", device="cuda") as m:
        inject("cudaGraphInstantiate:1")
        assert m.generate(PROMPT, max_tokens=NEW) == reference
        assert m.generate(PROMPT, max_tokens=NEW) == reference


@pytest.mark.parametrize("call, message", [("cudaMallocFromPoolAsync", "out of memory"),
                                           ("cudaMemcpyAsync", "CUDA cudaMemcpyAsync")])
def test_every_failed_call_of_a_request_raises_and_loses_nothing(model_path, reference, inject,
                                                                 call, message):
    """The n-th use of `call` fails, for every n a request makes: the request raises (or, for a
    use it can do without, as a graph capture, succeeds), and the same model then answers
    exactly."""
    failed = 0
    with tinyloop.Model(model_path, backend="native", device="cuda") as m:
        for n in range(1, 40):
            inject(f"{call}:{n}")
            try:
                got = m.generate(PROMPT, max_tokens=NEW)
            except RuntimeError as e:
                failed += 1
                assert message in str(e), e
            else:
                assert got == reference, n
                if n > 8:
                    break                  # past every use a request makes
            inject("")
            assert m.generate(PROMPT, max_tokens=NEW) == reference, n
    assert failed > 0, f"no use of {call} failed a request"


@pytest.mark.parametrize("passes", ["mixed", "separate"])
def test_a_scheduler_step_out_of_device_memory_raises_memory_error_and_is_retried_exactly(
        model_path, inject, monkeypatch, passes):
    """The Scheduler's contract (a step that raises MemoryError may be retried, and no request
    loses or changes a token) holds when the device runs out of memory mid-step, with one mixed
    pass a step (a mixed pass out of memory leaves its step to separate passes, which may
    preempt or raise in turn) and with separate passes (TINYLOOP_MIXED_PASS=0)."""
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    with tinyloop.Model(model_path, backend="native", device="cpu") as cpu:
        want = [cpu.generate(p, max_tokens=NEW, temperature=0.8, seed=i)[len(p):]
                for i, p in enumerate(prompts)]
    if passes == "separate":
        monkeypatch.setenv("TINYLOOP_MIXED_PASS", "0")

    def schedule(m):
        with tinyloop.Scheduler(m, max_batch=3, step_tokens=8) as s:
            ids = [s.add(p, max_tokens=NEW, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
            got, failed_steps = run_retrying_failed_steps(s, ids)
            return [got[i] for i in ids], failed_steps, s.stats()

    with tinyloop.Model(model_path, backend="native", device="cuda") as m:
        clean = schedule(m)[2]["mixed_passes"]
    assert (clean > 0) == (passes == "mixed")
    failures = raised = 0   # steps that raised, preemptions, mixed passes left to separate ones
    for n in range(1, 21):  # each use of the pool in turn fails, on a fresh model
        with tinyloop.Model(model_path, backend="native", device="cuda") as m:
            inject(f"cudaMallocFromPoolAsync:{n}")
            got, failed_steps, stats = schedule(m)
            inject("")
        assert got == want, n
        raised += failed_steps
        failures += failed_steps + stats["preemptions"] + clean - stats["mixed_passes"]
    assert failures > 0, "no step ran out of device memory"
    assert raised > 0 or passes == "mixed", "no step raised MemoryError"


def run_elsewhere(env, code):
    """Run `code` in a fresh interpreter with the emulation settings `env` (read once a process)."""
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)


def test_with_no_device_cuda_is_refused_with_the_reason(model_path):
    done = run_elsewhere({"TINYLOOP_CUDA_EMU_DEVICES": "0"}, f"""
import tinyloop
info = tinyloop.backend_info("native", "cuda")
assert not info["cuda_available"] and info["cuda_reason"].startswith("no CUDA device"), info
try:
    tinyloop.Model({str(model_path)!r}, backend="native", device="cuda")
except RuntimeError as e:
    assert "no CUDA device" in str(e), e
else:
    raise AssertionError("a model opened on no device")
""")
    assert done.returncode == 0, done.stderr


def test_without_memory_pools_blocks_and_scratch_use_plain_allocations(model_path, reference):
    done = run_elsewhere({"TINYLOOP_CUDA_EMU_POOLS": "0"}, f"""
import tinyloop
with tinyloop.Model({str(model_path)!r}, backend="native", device="cuda") as m:
    print(m.generate({PROMPT!r}, max_tokens={NEW}))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(reference)
