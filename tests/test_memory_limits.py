"""Out of memory under an address-space limit (`ulimit -v`, RLIMIT_AS), on the native and numpy
backends: opening a model, building a prefix, a generation and a scheduler step each fail with
the documented error (RuntimeError("out of memory") from Model's calls, MemoryError from a
Scheduler step, which may be retried) and never abort; once memory is back the same objects
work and give exactly the results of a run that never ran short (no partial state).

Each case runs in a process of its own (the limit is process-wide): it lowers the soft limit to
what the process maps now plus a margin too small for the operation, checks the failure,
raises the limit back and checks the recovery. numba is left out: its JIT compiler aborts the
process when LLVM cannot allocate, which TinyLoop cannot catch.
"""
import json
import subprocess
import sys

import pytest

import tinyloop

from conftest import require_backend

CASE = r"""
import json, resource, sys
import numpy as np
import tinyloop
from tinyloop.quickbench import backend_kwargs

backend, path = sys.argv[1], sys.argv[2]
SOFT, HARD = resource.getrlimit(resource.RLIMIT_AS)
PROMPT = list(range(1, 200))


def mapped():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


class short_of_memory:
    '''The address space limited to what is mapped now plus `margin` bytes.'''
    def __init__(self, margin):
        self.margin = margin
    def __enter__(self):
        resource.setrlimit(resource.RLIMIT_AS, (mapped() + self.margin, HARD))
    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))


def refused(call, errors):
    '''The message of the documented error `call` raises short of memory.'''
    with short_of_memory(2 << 20):
        try:
            call()
        except errors as exc:
            return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{call} did not run out of memory")


def open_model():
    return tinyloop.Model(path, **backend_kwargs(backend), threads=1, prefix_cache_bytes=0)


open_model().close()     # the library mapped (and its devices probed) before any limit
report = {}
report["open"] = refused(open_model, RuntimeError)
model = open_model()                                          # memory back: it opens
want = model.generate(PROMPT, max_tokens=4, return_logits=True)
report["generate"] = refused(lambda: model.generate(PROMPT * 4, max_tokens=4), RuntimeError)
report["prefix"] = refused(lambda: model.build_prefix_cache(PROMPT * 4), RuntimeError)
got = model.generate(PROMPT, max_tokens=4, return_logits=True)
prefix = model.build_prefix_cache(PROMPT[:100])
cont = model.generate_from_prefix_cache(prefix, suffix=PROMPT[100:], max_tokens=4, return_logits=True)
LONG = PROMPT * 4
with tinyloop.Scheduler(model, max_batch=4, step_tokens=2048) as scheduler:
    rid = scheduler.add(LONG, max_tokens=4)
    report["step"] = refused(lambda: [scheduler.step() for _ in range(50)], MemoryError)
    tokens = []
    while True:                                   # the failed step lost nothing: retried
        events = scheduler.step()
        tokens += [e.token for e in events if e.id == rid]
        if any(e.finish for e in events):
            break
report["same"] = (got[0] == want[0] and np.array_equal(np.asarray(got[1]).view(np.uint32),
                                                     np.asarray(want[1]).view(np.uint32))
                  and cont[0] == want[0]
                  and tokens == model.generate(LONG, max_tokens=4)[len(LONG):])
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A model whose weights and activations take tens of MB: more than the margin."""
    path = tmp_path_factory.mktemp("memory") / "big.tinyloop"
    tinyloop.random_model(path, seed=3, vocab_size=4096, d_model=512, n_heads=8, n_kv_heads=2,
                          head_dim=64, ffn_dim=2048, n_pre_blocks=2, default_loops=2,
                          max_seq_len=2048)
    return path


@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_running_short_of_memory_is_an_error_and_memory_back_undoes_it(backend, big_model):
    require_backend(backend)
    run = subprocess.run([sys.executable, "-c", CASE, backend, str(big_model)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    for operation in ("open", "generate", "prefix"):
        assert report[operation] == "RuntimeError: out of memory", report
    assert report["step"].startswith("MemoryError"), report
    assert report["same"], report
