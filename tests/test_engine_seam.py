"""The engine seam (tinyloop/engine.py): both engines implement the one declared interface
(and their schedulers the scheduler's),
`Model` names no backend, every backend reports its runtime, the reference implementation does
not import its consumer, and backend="auto" falls back to numba before numpy."""
import ast
import inspect
import pathlib
import shutil
import warnings

import numpy as np
import pytest

import tinyloop
from tinyloop import backends
from tinyloop.engine import RUNTIME_KEYS, Engine, EnginePrefix, EngineScheduler
from tinyloop.fallback import Engine as PythonEngine
from tinyloop.fallback.scheduler import Scheduler as PythonScheduler
from tinyloop.native import NativeEngine, NativeScheduler
from tinyloop.quickbench import backend_kwargs

from conftest import require_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The interface as declared: methods, then the data attributes (annotations).
PROTOCOL_METHODS = sorted(name for name, member in vars(Engine).items()
                          if callable(member) and not name.startswith("_"))
PROTOCOL_ATTRIBUTES = sorted(Engine.__annotations__)


def shape(signature):
    """A signature without annotations: what a caller relies on."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_the_protocol_declares_the_whole_interface():
    assert PROTOCOL_METHODS == sorted([
        "build_prefix", "cache_stats", "clear_prefix_cache", "close", "extend_prefix",
        "generate", "generate_batch", "generate_from_prefix", "logits", "new_scheduler",
        "prefix_from_bytes", "runtime"])
    assert PROTOCOL_ATTRIBUTES == ["config"]


SCHEDULER_METHODS = sorted(name for name, member in vars(EngineScheduler).items()
                           if callable(member) and not name.startswith("_"))
IMPLEMENTATIONS = [(Engine, NativeEngine, PROTOCOL_METHODS), (Engine, PythonEngine, PROTOCOL_METHODS),
                   (EngineScheduler, NativeScheduler, SCHEDULER_METHODS),
                   (EngineScheduler, PythonScheduler, SCHEDULER_METHODS)]


def test_the_scheduler_protocol_declares_its_whole_interface():
    assert SCHEDULER_METHODS == ["add", "cancel", "depth_counts", "free", "stats", "step"]


@pytest.mark.parametrize("protocol, implementation, method", [
    (protocol, implementation, method) for protocol, implementation, methods in IMPLEMENTATIONS
    for method in methods], ids=lambda value: getattr(value, "__qualname__", value))
def test_signatures_match_the_protocol(protocol, implementation, method):
    declared = inspect.signature(getattr(protocol, method))
    implemented = inspect.signature(getattr(implementation, method))
    assert shape(implemented) == shape(declared), f"{implementation.__name__}.{method}"


def test_an_object_missing_a_method_is_not_an_engine():
    class Partial:
        config = None

    for method in PROTOCOL_METHODS:
        setattr(Partial, method, lambda self: None)
    assert isinstance(Partial(), Engine)
    del Partial.runtime
    assert not isinstance(Partial(), Engine)


@pytest.fixture
def opened(backend, model_files):
    """(backend name, a Model open on it) for every backend under test (conftest.py)."""
    with tinyloop.Model(model_files["int8-gqa"], block_size=8, threads=1,
                        **backend_kwargs(backend)) as model:
        yield backend, model


def test_every_engine_is_an_engine_and_its_prefixes_are_engine_prefixes(opened):
    _, model = opened
    assert isinstance(model._engine, Engine)
    prefix = model.build_prefix_cache([1, 2, 3], loops=1)
    assert isinstance(prefix._state, EnginePrefix)


def test_runtime_says_where_and_how_every_backend_runs(opened):
    name, model = opened
    runtime = model.runtime()
    assert tuple(sorted(runtime)) == tuple(sorted(RUNTIME_KEYS))
    want_backend, want_device = (("native", "cuda") if name == "native-cuda" else
                                 (name, "cuda" if name == "numba-cuda" else "cpu"))
    assert (runtime["backend"], runtime["device"]) == (want_backend, want_device)
    assert (model.backend, model.device) == (want_backend, want_device)
    assert runtime["kv_block_size"] == 8 and runtime["threads"] == 1
    assert isinstance(runtime["isa"], str) and runtime["isa"]
    assert isinstance(runtime["device_name"], str) and runtime["device_name"]
    held = runtime["device_weight_bytes"] if want_device == "cuda" else runtime["weight_bytes"]
    assert held > 0
    if want_device == "cpu":
        assert runtime["device_weight_bytes"] == 0 and runtime["device_name"].startswith("cpu (")
    model.close()
    with pytest.raises(RuntimeError, match="model was closed"):
        model.runtime()


def _string_constants(path):
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_model_names_no_backend():
    named = _string_constants(ROOT / "tinyloop" / "model.py") & (set(backends.BACKENDS) - {"auto"})
    assert not named, f"tinyloop/model.py special-cases {sorted(named)}"


def _tinyloop_imports(path):
    """The tinyloop modules a file imports, absolute or relative (`from . import x` included).
    fallback/ is installed as tinyloop.fallback."""
    package = {"tinyloop": ["tinyloop"], "fallback": ["tinyloop", "fallback"]}[path.parent.name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "tinyloop" or n.startswith("tinyloop."))
    return found


# What each layer may import from tinyloop: the reference takes only the seam and the file
# format; the shared modules take nothing above themselves.
SEAM = {"tinyloop.engine", "tinyloop.config", "tinyloop.errors"}
ALLOWED = {
    **{f"fallback/{p.name}": SEAM | {"tinyloop.modelfile"}
       for p in (ROOT / "fallback").glob("*.py")},
    "tinyloop/engine.py": {"tinyloop.config"},
    "tinyloop/params.py": {"tinyloop.engine", "tinyloop.config"},   # config: a type hint
    "tinyloop/modelfile.py": {"tinyloop.config", "tinyloop.errors"},
    "tinyloop/config.py": {"tinyloop.errors"},
}


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_imports_run_one_way(name):
    path = ROOT / name
    imported = {m for m in _tinyloop_imports(path) if not m.startswith("tinyloop.fallback")}
    assert imported <= ALLOWED[name], f"{name} imports {sorted(imported - ALLOWED[name])}"


def test_the_import_check_sees_relative_and_absolute_imports():
    assert {"tinyloop.engine", "tinyloop.fallback.forward"} <= _tinyloop_imports(
        ROOT / "fallback" / "engine.py")
    assert "tinyloop.fallback.numba_dot" in _tinyloop_imports(ROOT / "fallback" / "numba_cpu.py")
    assert "tinyloop.backends" in _tinyloop_imports(ROOT / "tinyloop" / "model.py")


def test_the_moved_names_stay_importable_where_they_were():
    from tinyloop import engine, params
    moved = ("CACHE_STAT_NAMES", "NO_CALLBACKS", "Callbacks", "GenerationParams", "stop_reached")
    for name in moved:
        assert getattr(params, name) is getattr(engine, name)


def without_native_library(monkeypatch):
    """This process as if libtinyloop were missing, and no FallbackWarning issued yet."""
    monkeypatch.setattr(backends, "_native", {"error": ImportError("no libtinyloop (test)")})
    monkeypatch.setattr(backends, "_warned_fallback", [])
    monkeypatch.delenv("TINYLOOP_BACKEND", raising=False)


def test_auto_without_the_library_takes_numba_and_says_once_that_it_compiles(
        model_files, monkeypatch):
    require_backend("numba")              # before the library is hidden: conftest caches features
    without_native_library(monkeypatch)
    assert tinyloop.backend == "numba"
    info = tinyloop.backend_info()
    assert info["chosen"] == "numba" and info["available"]
    assert info["reason"].startswith("the native library is unavailable (no libtinyloop (test)); "
                                     "using numba") and "compile" in info["reason"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with tinyloop.Model(model_files["int8-gqa"]) as model:
                assert model.backend == "numba"
    fallbacks = [w for w in caught if issubclass(w.category, backends.FallbackWarning)]
    assert [str(w.message) for w in fallbacks] == [f"tinyloop: {info['reason']}"]
    assert fallbacks[0].filename == __file__          # points at the caller's Model(...)


def test_backend_info_places_device_cuda_on_native_as_open_engine_does(model_files, monkeypatch):
    """device="cuda" runs on the native backend, so "auto" with it never means numba."""
    without_native_library(monkeypatch)
    info = tinyloop.backend_info("auto", "cuda")
    assert (info["requested"], info["chosen"], info["device"]) == ("auto", "native", "cuda")
    assert (info["available"], info["reason"]) == (False, "no libtinyloop (test)")
    with pytest.raises(RuntimeError, match=r"backend 'native' is not available: no libtinyloop"):
        tinyloop.Model(model_files["int8-gqa"], device="cuda")
    for call in (lambda: tinyloop.backend_info("numpy", "cuda"),
                 lambda: tinyloop.Model(model_files["int8-gqa"], backend="numpy", device="cuda")):
        with pytest.raises(ValueError, match="device='cuda' runs on the native backend, not 'numpy'"):
            call()


def test_an_open_model_outlives_its_file_on_every_backend(backend, model_files, tmp_path):
    """Each engine reads the file once when it opens: rewriting or deleting it changes
    nothing (docs/api.md, "Model files")."""
    path = tmp_path / "m.tinyloop"
    shutil.copy2(model_files["int8-gqa"], path)
    with tinyloop.Model(path, threads=1, **backend_kwargs(backend)) as model:
        before = model.logits([1, 2, 3], loops=1)
        path.write_bytes(bytes(path.stat().st_size))      # zeros, in place
        path.unlink()
        after = model.logits([1, 2, 3], loops=1)
    assert np.array_equal(before.view(np.uint32), after.view(np.uint32))
