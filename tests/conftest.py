"""Shared test setup: Hypothesis profiles and small random models.

HYPOTHESIS_PROFILE selects `dev` (quick), `ci` (the default in .ci/run) or `deep` (>= 2000
examples per property; see docs/testing.md).

Backends are skipped by declared availability (`tinyloop.backend_available`), never silently:
the skip says why, and a backend named in TINYLOOP_REQUIRE_BACKENDS (comma-separated; CI names
native and numba) fails instead of skipping.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tinyloop
from tinyloop.quickbench import backend_kwargs

settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Small models covering the shape space: GQA or not, n_pre 0..2, int8 / int4, tied head,
# odd vocabularies, eos ids. Keyed by a short name used in test ids.
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
                     weight_format="int4", group_size=16, eos_id=7),
}


@pytest.fixture(scope="session")
def model_files(tmp_path_factory):
    """name -> path of a random model file for every entry of MODEL_SHAPES."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for seed, (name, shape) in enumerate(sorted(MODEL_SHAPES.items())):
        paths[name] = root / f"{name}.tinyloop"
        tinyloop.random_model(paths[name], seed=seed, **shape)
    return paths


@pytest.fixture(scope="session")
def models(model_files):
    """name -> an open numpy-backend Model for every entry of MODEL_SHAPES."""
    opened = {name: tinyloop.Model(path, backend="numpy") for name, path in model_files.items()}
    yield opened
    for model in opened.values():
        model.close()


def env_names(variable, default=""):
    return [name for name in os.environ.get(variable, default).split(",") if name]


def require_backend(name):
    """Skip (or, if TINYLOOP_REQUIRE_BACKENDS names it, fail) when `name` cannot open here."""
    if name == "native-cuda":
        from tinyloop.backends import cuda_device_status
        ok, why = cuda_device_status()
    else:
        ok, why = tinyloop.backend_available(name)
    if not ok:
        message = f"backend {name!r} is not available: {why}"
        if name in env_names("TINYLOOP_REQUIRE_BACKENDS"):
            pytest.fail(message + " (required by TINYLOOP_REQUIRE_BACKENDS)")
        pytest.skip(message)


def same_bits(a, b):
    """Arrays equal bit for bit (float32 compared through their uint32 patterns)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


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


@pytest.fixture
def small_model(models):
    return models["int8-gqa"]
