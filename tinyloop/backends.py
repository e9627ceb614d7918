"""Backend selection: which engine runs a Model, and why.

`backend=` (or TINYLOOP_BACKEND when the argument is "auto") names one of BACKENDS. "auto"
takes the native library when it loads, otherwise numpy, after one warning line saying why.
An explicitly named backend that cannot be opened is refused with the reason, never silently
replaced. cffi and numba are imported only when a backend needs them, so `import tinyloop` and
the numpy backend work without either.
"""
import os
import threading
import warnings

BACKENDS = ("auto", "native", "numpy", "numba", "numba-cuda")

_native = {}                  # memo of the one library load: {"loaded": ...} or {"error": ...}
_native_lock = threading.Lock()
_warned_fallback = []


class FallbackWarning(RuntimeWarning):
    """backend="auto" runs on the pure-Python fallback because libtinyloop is unavailable."""


def requested_backend(backend):
    """The backend asked for: the argument, or TINYLOOP_BACKEND when the argument is 'auto'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = os.environ.get("TINYLOOP_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"TINYLOOP_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


def native_library():
    """(ffi, lib, path, origin) of libtinyloop, loaded once; raises LibraryUnavailable."""
    from ._library import load_library
    with _native_lock:
        if not _native:
            try:
                _native["loaded"] = load_library()
            except ImportError as exc:
                _native["error"] = exc
    if "error" in _native:
        raise _native["error"]
    return _native["loaded"]


def backend_available(name):
    """(True, "") if backend `name` can be opened here, else (False, the reason why not)."""
    name = resolve_backend_name(name)
    if name == "numpy":
        return True, ""
    if name == "native":
        try:
            native_library()
        except ImportError as exc:
            return False, str(exc)
        return True, ""
    try:
        import numba
    except ImportError as exc:
        return False, f"numba cannot be imported ({exc}); pip install numba"
    if name == "numba":
        return True, ""
    from numba import cuda
    if numba.config.ENABLE_CUDASIM or cuda.is_available():
        return True, ""
    return False, ("numba.cuda finds no usable CUDA device or driver "
                   "(NUMBA_ENABLE_CUDASIM=1 runs its simulator instead)")


def resolve_backend_name(backend):
    """The concrete backend `backend` means here ('auto' -> native if it loads, else numpy)."""
    backend = requested_backend(backend)
    if backend != "auto":
        return backend
    ok, _ = backend_available("native")
    return "native" if ok else "numpy"


def backend_info(backend="auto"):
    """What `backend` resolves to here, and why: a dict for humans and tests."""
    requested = requested_backend(backend)
    chosen = resolve_backend_name(requested)
    ok, why = backend_available(chosen)
    info = {"requested": requested, "chosen": chosen, "available": ok, "reason": why,
            "library": None, "origin": None, "library_version": None}
    native_ok, native_why = backend_available("native")
    if native_ok:
        ffi, lib, path, origin = native_library()
        info.update(library=str(path), origin=origin,
                    library_version=ffi.string(lib.tl_version_string()).decode())
    if requested == "auto":
        info["reason"] = ("the native library loaded" if chosen == "native" else
                          f"the native library is unavailable ({native_why}); using numpy")
    return info


def backend_features():
    """The set of features this install has, e.g. {'numpy', 'native', 'native-avx2', 'numba'}."""
    features = {"numpy"}
    if backend_available("native")[0]:
        ffi, lib, _, _ = native_library()
        features.add("native")
        for isa, label in ((lib.TL_ISA_AVX2, "avx2"), (lib.TL_ISA_AVX512_VNNI, "avx512-vnni")):
            if lib.tl_cpu_supports(isa):
                features.add(f"native-{label}")
    for name in ("numba", "numba-cuda"):
        if backend_available(name)[0]:
            features.add(name)
    return frozenset(features)


def _warn_fallback_once():
    if not _warned_fallback:
        _warned_fallback.append(True)
        reason = backend_info("auto")["reason"]
        warnings.warn(f"tinyloop: {reason}", FallbackWarning, stacklevel=4)


def native_memory_stats(reset_peak=False):
    """The native library's own allocation counters (docs/c-api.md, tl_memory_stats):
    {'bytes_in_use', 'peak_bytes', 'n_allocs'}, over every model in this process. With
    reset_peak=True the peak restarts from the current use after the snapshot. Raises
    RuntimeError when the native library is not available."""
    try:
        ffi, lib, _, _ = native_library()
    except ImportError as exc:
        raise RuntimeError(f"the native library is not available: {exc}") from None
    stats = ffi.new("tl_memory_stats*")
    stats.size = ffi.sizeof("tl_memory_stats")
    if lib.tl_memory_stats_get(stats) != lib.TL_OK:
        raise RuntimeError(ffi.string(lib.tl_last_error()).decode())
    if reset_peak:
        lib.tl_memory_reset_peak()
    return {"bytes_in_use": int(stats.bytes_in_use), "peak_bytes": int(stats.peak_bytes),
            "n_allocs": int(stats.n_allocs)}


def open_engine(backend, path, *, block_size, threads, prefix_cache_bytes=0):
    """Open the model file at `path` with `backend`; returns (engine, backend name)."""
    requested = requested_backend(backend)
    name = resolve_backend_name(requested)
    if requested == "auto" and name == "numpy":
        _warn_fallback_once()
    ok, why = backend_available(name)
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {why}")
    if name == "native":
        from .native import NativeEngine
        return NativeEngine(native_library(), path, block_size=block_size, threads=threads,
                            prefix_cache_bytes=prefix_cache_bytes), name
    from .fallback import Engine
    from .modelfile import load_model
    config, tensors = load_model(path)
    if name == "numba":
        from .fallback.numba_cpu import NumbaKernels
        kernels = NumbaKernels(threads)
    elif name == "numba-cuda":
        from .fallback.numba_cuda import CudaKernels
        kernels = CudaKernels()
    else:
        from .fallback.forward import NumpyKernels
        kernels = NumpyKernels
    return Engine(config, tensors, block_size, kernels, prefix_cache_bytes), name
