"""bench/bench_llamacpp.py's llama.cpp workers, run on stand-in llama_cpp modules (no llama.cpp
needed): a build is named by what its ggml reports, a build that dies by a signal becomes a
crash the bench reports while the other engines run on, and an error inside a worker names the
call that failed."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_llamacpp as bench  # noqa: E402

# A llama_cpp stand-in: the calls LlamaServer makes; its eval dies by SIGSEGV when CRASH is set,
# as llama.cpp's AMX path does on some CPUs.
STAND_IN = '''
import ctypes, os, signal
__version__ = "0-stand-in"
CRASH = {crash}
_logits = (ctypes.c_float * 16)()

def llama_print_system_info():
    return b"CPU : AVX2 = 1 | {features}"

def llama_get_logits_ith(ctx, i):
    return _logits

class Llama:
    def __init__(self, path, **params):
        self.ctx = None

    def n_vocab(self):
        return len(_logits)

    def reset(self):
        pass

    def eval(self, tokens):
        if CRASH:
            os.kill(os.getpid(), signal.SIGSEGV)
'''


def stand_in_builds(root):
    """root with the two build folders of bench.LLAMA_BUILDS, holding stand-ins: the no-AMX one
    runs, the AMX one crashes."""
    for name, amx in (("llama-cpp-noamx", False), ("llama-cpp-amx", True)):
        package = root / name / "llama_cpp"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(STAND_IN.format(
            crash=amx, features="AMX_INT8 = 1 | " if amx else ""))
    return root


@pytest.fixture
def builds(tmp_path):
    return bench.find_llama_builds(stand_in_builds(tmp_path))


def test_builds_are_named_by_what_their_ggml_reports(builds, tmp_path):
    assert [(build.name, build.directory.name) for build in builds] == [
        ("no AMX", "llama-cpp-noamx"), ("AMX", "llama-cpp-amx")]
    assert all(build.info["module"].startswith(str(tmp_path)) for build in builds)


def test_a_crashing_build_is_reported_and_the_others_run_on(builds):
    runs = {"no AMX": 0, "AMX": 0}
    with bench.LlamaWorker(builds[0]) as good, bench.LlamaWorker(builds[1]) as bad:
        def engine(name, worker):
            def run():
                runs[name] += 1
                return worker.call("speed", n_prompt=8, n_decode=2)
            return run

        for worker in (good, bad):
            worker.call("load", path="model.gguf", threads=1, n_batch=8, n_ctx=16,
                        flash_attn=False)
        best = bench.best_rounds({"no AMX": engine("no AMX", good),
                                  "AMX": engine("AMX", bad)}, repeats=3)
    assert isinstance(best["AMX"], bench.LlamaCrashed)
    assert str(best["AMX"]) == "signal 11, SIGSEGV"
    assert min(best["no AMX"]) > 0
    assert runs == {"no AMX": 3, "AMX": 1}


def test_an_error_inside_a_worker_names_the_call(builds):
    with bench.LlamaWorker(builds[0]) as worker:
        with pytest.raises(RuntimeError, match="speed: AttributeError"):
            worker.call("speed", n_prompt=8, n_decode=2)       # before any load
        assert worker.call("info")["amx"] is False              # and it serves on
