"""Backend selection: which engine runs a Model, and why.

`backend=` (or the TINYLOOP_BACKEND variable when the argument is "auto") names one of
BACKENDS. This release ships the numpy reference engine; the others are refused with a clear
message rather than silently replaced.
"""
import os

BACKENDS = ("auto", "native", "numpy", "numba", "numba-cuda")


def resolve_backend_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = os.environ.get("TINYLOOP_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"TINYLOOP_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}")
    return "numpy" if backend == "auto" else backend


def open_engine(backend, config, tensors, *, block_size, threads):
    """Returns (engine, backend name)."""
    name = resolve_backend_name(backend)
    if name != "numpy":
        raise RuntimeError(f"backend {name!r} is not available in this build; use 'numpy'")
    from .fallback import NumpyEngine
    return NumpyEngine(config, tensors, block_size=block_size), name
