"""Shared test setup: Hypothesis profiles, the backends every suite runs on, small random models.

HYPOTHESIS_PROFILE selects `dev` (quick, the default), `ci` (what .ci/run uses) or `deep`
(>= 2000 examples per property; see docs/testing.md).

Backends (the python-zstandard way): the `backend` fixture runs a test once per backend in
TINYLOOP_TEST_BACKENDS (comma-separated; default all of BACKENDS). A backend is skipped only when
its feature is missing from `tinyloop.backend_features`, and the skip says why; a backend named
in TINYLOOP_REQUIRE_BACKENDS (CI names native and numba) fails instead of skipping.
`backend_given` runs a Hypothesis property with the examples that backend affords.
"""
import functools
import inspect
import os
import threading
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import tinyloop
from tinyloop.quickbench import backend_kwargs

settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
# the libtinyloop CUDA backend on the CPU emulation of the device (libtinyloop/run_cuda_emulation.sh):
# a pass costs a second or more there
settings.register_profile("emulated", max_examples=3, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def env_names(variable, default=""):
    return [name for name in os.environ.get(variable, default).split(",") if name]


# Every backend a Model can run on: the engines of tinyloop.backends.BACKENDS, and
# "native-cuda" = libtinyloop's CUDA backend, Model(backend="native", device="cuda"). Each name
# is also the feature `tinyloop.backend_features` declares when that backend can run here.
BACKENDS = ("numpy", "native", "numba", "numba-cuda", "native-cuda")
TEST_BACKENDS = env_names("TINYLOOP_TEST_BACKENDS", ",".join(BACKENDS))
# The CPU kernel paths libtinyloop picks from at run time (feature "native-<isa>"); the scalar
# path runs everywhere. TINYLOOP_ISA (read by the library when a model opens) forces one of them
# on every native model of a run: docs/testing.md.
ISA_PATHS = ("avx2", "avx512-vnni", "amx")


@functools.cache
def backend_features():
    return tinyloop.backend_features


def unavailable_reason(name):
    """Why backend `name` cannot run here (its feature is missing), or None when it can."""
    if name in backend_features():
        return None
    if name == "native-cuda":
        from tinyloop.backends import cuda_device_status
        return cuda_device_status()[1]
    return tinyloop.backend_available(name)[1]


def require_backend(name):
    """Skip (or, if TINYLOOP_REQUIRE_BACKENDS names it, fail) when `name` cannot open here."""
    why = unavailable_reason(name)
    if why is not None:
        message = f"backend {name!r} is not available: {why}"
        if name in env_names("TINYLOOP_REQUIRE_BACKENDS"):
            pytest.fail(message + " (required by TINYLOOP_REQUIRE_BACKENDS)")
        pytest.skip(message)


def pytest_report_header(config):
    features = backend_features()
    if "native" not in features:
        isa_line = f"all ({unavailable_reason('native')})"
    else:
        isa_line = ", ".join(isa for isa in ISA_PATHS if f"native-{isa}" not in features) or "none"
    forced = os.environ.get("TINYLOOP_ISA")
    path = f"TINYLOOP_ISA={forced}" if forced else "the fastest ISA path (TINYLOOP_ISA unset)"
    return [f"tinyloop: backends here: {', '.join(b for b in BACKENDS if b in features)}; "
            f"features: {', '.join(sorted(features))}",
            f"tinyloop: ISA paths not run on this CPU: {isa_line}",
            f"tinyloop: native models run {path}"]


def backend_fixture(names):
    """A module-scoped `backend` fixture over `names`, each skipped only when it cannot run
    here. A suite comparing backends with the numpy reference defines its own as
    `backend = backend_fixture(COMPARED_BACKENDS)`."""
    @pytest.fixture(scope="module", params=names, name="backend")
    def fixture(request):
        require_backend(request.param)
        return request.param
    return fixture


# Each backend under test (TINYLOOP_TEST_BACKENDS).
backend = backend_fixture(TEST_BACKENDS)
# The backends under test but the numpy reference they are compared with.
COMPARED_BACKENDS = [name for name in TEST_BACKENDS if name != "numpy"]


def simulated(backend):
    """True for numba-cuda on numba's CPU simulator, where each GPU thread is a Python thread."""
    if backend != "numba-cuda":
        return False
    from numba import config
    return bool(config.ENABLE_CUDASIM)


SIMULATOR_EXAMPLES = 2     # per property: a simulated example costs tens of seconds

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    import cudasim_shared      # the simulator's shared arrays race between a block's threads
    cudasim_shared.install()


def examples(backend):
    """The Hypothesis settings of a property on `backend`: the profile's, with at most
    SIMULATOR_EXAMPLES on the numba-cuda simulator."""
    if simulated(backend):
        return settings(max_examples=min(settings.default.max_examples, SIMULATOR_EXAMPLES))
    return settings()


def backend_given(**strategies):
    """`hypothesis.given` for a test that takes the `backend` fixture: the drawn arguments are
    the keywords of `strategies`, the others are fixtures, and the examples are run with
    `examples(backend)`. Under a derandomized profile (ci) every backend gets the same examples:
    Hypothesis seeds them from the test's source, not from the backend."""
    def decorate(test):
        signature = inspect.signature(test)
        fixtures = [p for p in signature.parameters.values() if p.name not in strategies]
        drawn = [p.replace(kind=p.KEYWORD_ONLY) for p in signature.parameters.values()
                 if p.name in strategies]

        @functools.wraps(test)
        def run(**values):
            @functools.wraps(test)            # Hypothesis keys its seed by the test's source
            def example(**draws):
                test(**values, **draws)
            example.__signature__ = signature.replace(parameters=drawn)
            examples(values["backend"])(given(**strategies)(example))()

        run.__signature__ = signature.replace(parameters=fixtures)
        return run
    return decorate


def generate_on_threads(model, calls, n_threads=4):
    """model.generate(prompt, **kwargs) for each (prompt, kwargs) of `calls`, spread over
    `n_threads` threads racing on the one model; the results in call order."""
    got = [None] * len(calls)

    def work(worker):
        for i in range(worker, len(calls), n_threads):
            got[i] = model.generate(calls[i][0], **calls[i][1])

    threads = [threading.Thread(target=work, args=(w,)) for w in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return got


def run_retrying_failed_steps(scheduler, ids):
    """Step `scheduler` until it has no work, stepping again after each step that raises
    MemoryError (the Scheduler's contract: such a step may be retried). Returns ({id: tokens
    emitted}, the number of steps that raised)."""
    got, raised = {i: [] for i in ids}, 0
    while scheduler.has_work:
        try:
            events = scheduler.step()
        except MemoryError:
            raised += 1
            continue
        for e in events:
            got[e.id].append(e.token)
    return got, raised


def same_bits(a, b):
    """Arrays equal bit for bit (float32 compared through their uint32 patterns)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def assert_same_bits(got, want):
    """float32 arrays identical bit for bit: -0.0 differs from 0.0, a NaN equals the same NaN."""
    assert got.dtype == want.dtype == np.float32, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(f"{int(differ.sum())} of {differ.size} values differ; first at "
                             f"{first}: {got[first]!r} != {want[first]!r}")


def assert_same_generation(got, want):
    """Two (tokens, logits) results of return_logits=True: the same tokens, the logits bit for bit."""
    (got_tokens, got_logits), (want_tokens, want_logits) = got, want
    assert got_tokens == want_tokens
    assert_same_bits(got_logits, want_logits)


# Small models covering the shape space: GQA or not, n_pre 0..2, int8 / int4, tied head,
# odd vocabularies, eos and stop ids, an exit gate. Keyed by a short name used in test ids.
MODEL_SHAPES = {
    "int8-gqa": dict(vocab_size=263, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                     ffn_dim=48, n_pre_blocks=1, default_loops=3, max_seq_len=96),
    "int4-mha": dict(vocab_size=300, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16,
                     ffn_dim=64, n_pre_blocks=2, default_loops=2, max_seq_len=96,
                     weight_format="int4", group_size=8),
    "int8-tied-nopre": dict(vocab_size=257, d_model=24, n_heads=3, n_kv_heads=1, head_dim=8,
                            ffn_dim=40, n_pre_blocks=0, default_loops=4, max_seq_len=96,
                            tied_head=True),
    "int4-eos": dict(vocab_size=129, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8,
                     ffn_dim=32, n_pre_blocks=1, default_loops=2, max_seq_len=96,
                     weight_format="int4", group_size=16, eos_id=7, stop_ids=(11, 40)),
    # version-2 layouts (docs/spec.md §1): Huginn's (prelude, adapter, coda, post norms, biases,
    # embedding scale) and Ouro's (a sandwich core with the step norm, and its exit gate), small
    "int8-v2-coda": dict(vocab_size=270, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                         ffn_dim=48, n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1,
                         default_loops=2, max_seq_len=96, block_layout="post", injection=True,
                         coda_norm=True, qkv_bias=True, embed_scale=2.0),
    "int4-v2-sandwich": dict(vocab_size=260, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16,
                             ffn_dim=64, n_pre_blocks=0, n_core_blocks=2, default_loops=3,
                             max_seq_len=96, block_layout="sandwich", step_norm=True,
                             weight_format="int4", group_size=8, exit_gate=True,
                             exit_threshold=0.9),
}


def write_random_models(root, shapes, **common):
    """name -> path of a random model in `root` for each {name: config fields} of `shapes`
    (plus `common`), seeded by its place in name order."""
    paths = {}
    for seed, (name, shape) in enumerate(sorted(shapes.items())):
        paths[name] = root / f"{name}.tinyloop"
        tinyloop.random_model(paths[name], seed=seed, **common, **shape)
    return paths


@pytest.fixture(scope="session")
def model_files(tmp_path_factory):
    """name -> path of a random model file for every entry of MODEL_SHAPES."""
    return write_random_models(tmp_path_factory.mktemp("models"), MODEL_SHAPES)


class ModelZoo:
    """Model files of drawn shapes (strategies.model_shapes), each written once: Hypothesis
    draws the same shape many times, on every backend. The weights' seed is a hash of the shape,
    so a shape always has the same weights, whatever was drawn before it."""

    def __init__(self, root):
        self.root, self.paths = root, {}

    def path(self, shape):
        key = repr(sorted(shape.items()))
        if key not in self.paths:
            self.paths[key] = self.root / f"{len(self.paths)}.tinyloop"
            tinyloop.random_model(self.paths[key], seed=zlib.crc32(key.encode()), **shape)
        return self.paths[key]

    def open(self, shape, backend, **kwargs):
        """A Model of `shape` on `backend` (kwargs: Model's, e.g. threads and block_size)."""
        return tinyloop.Model(self.path(shape), **backend_kwargs(backend), **kwargs)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return ModelZoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def models(model_files):
    """name -> an open numpy-backend Model for every entry of MODEL_SHAPES."""
    opened = {name: tinyloop.Model(path, backend="numpy") for name, path in model_files.items()}
    yield opened
    for model in opened.values():
        model.close()


def open_models(model_files, backend, **kwargs):
    """name -> a Model of every file in model_files opened with `backend` and kwargs."""
    return {name: tinyloop.Model(path, **backend_kwargs(backend), **kwargs) for name, path in model_files.items()}


@pytest.fixture(scope="module", params=["numpy", "native"])
def numpy_or_native(request):
    """Each of the two engines that implement every feature natively (not numba's reuse)."""
    require_backend(request.param)
    return request.param


@pytest.fixture
def require_native():
    require_backend("native")


@pytest.fixture(scope="session")
def models_by_backend(model_files):
    """backend name -> {shape name -> open Model}; opened on first use, closed at the end."""
    opened = {}

    def get(backend):
        require_backend(backend)
        if backend not in opened:
            opened[backend] = open_models(model_files, backend)
        return opened[backend]

    yield get
    for models in opened.values():
        for model in models.values():
            model.close()


@pytest.fixture(scope="module")
def on_backend(backend, model_files):
    """name -> a Model of MODEL_SHAPES[name] on the backend under test (module lifetime)."""
    opened = open_models(model_files, backend)
    yield opened
    for model in opened.values():
        model.close()


@pytest.fixture(scope="module")
def on_fast_backend(backend, request):
    """on_backend, skipped on numba's CUDA simulator, where a token of these models costs tens
    of seconds: for the example tests of a module whose properties (tiny shapes) run it."""
    if simulated(backend):
        pytest.skip("MODEL_SHAPES models take tens of seconds a token on the CUDA simulator; "
                    "this module's properties run its kernels")
    return request.getfixturevalue("on_backend")


@pytest.fixture
def small_model(models):
    return models["int8-gqa"]
