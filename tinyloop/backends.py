"""Backend selection: which engine runs a Model, and why.

`backend=` (or TINYLOOP_BACKEND when the argument is "auto") names one of BACKENDS. "auto"
takes the first of AUTO_ORDER that can open here: the native library when it loads, else numba
when it imports (3-6x faster than numpy once its kernels are compiled), else numpy; a fallback
says why in one FallbackWarning per process. An explicitly named backend that cannot be opened
is refused with the reason, never silently replaced. cffi and numba are imported only when a
backend needs them (or "auto" looks for one), so `import tinyloop` and the numpy backend work
without either.

`open_engine` is the one place that names a backend's engine: it returns an object of the
engine interface (tinyloop/engine.py), and the caller needs to know nothing else.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

from .engine import Engine

if TYPE_CHECKING:
    from pathlib import Path

    from cffi import FFI

BACKENDS = ("auto", "native", "numpy", "numba", "numba-cuda")
AUTO_ORDER = ("native", "numba", "numpy")   # what "auto" tries, in order; numpy always opens
DEVICES = ("auto", "cpu", "cuda")

_native: dict[str, Any] = {}  # memo of the one library load: {"loaded": ...} or {"error": ...}
_native_lock = threading.Lock()
_warned_fallback: list[bool] = []


class FallbackWarning(RuntimeWarning):
    """backend="auto" runs on a Python backend (numba or numpy) because libtinyloop is
    unavailable; issued once per process."""


def requested_backend(backend: str) -> str:
    """The backend asked for: the argument, or TINYLOOP_BACKEND when the argument is 'auto'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = os.environ.get("TINYLOOP_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"TINYLOOP_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


def native_library() -> tuple[FFI, Any, Path, str]:
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
    loaded: tuple[FFI, Any, Path, str] = _native["loaded"]
    return loaded


def backend_available(name: str) -> tuple[bool, str]:
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


def resolve_backend_name(backend: str) -> str:
    """The concrete backend `backend` means here ('auto': the first of AUTO_ORDER that opens)."""
    backend = requested_backend(backend)
    if backend != "auto":
        return backend
    return next(name for name in AUTO_ORDER if backend_available(name)[0])


def _auto_reason(chosen: str) -> str:
    """Why backend "auto" chose `chosen`, in one sentence fragment."""
    if chosen == "native":
        return "the native library loaded"
    reason = f"the native library is unavailable ({backend_available('native')[1]})"
    if chosen == "numba":
        return (f"{reason}; using numba, whose kernels compile on the first call (once: "
                "they are cached on disk for later runs)")
    return f"{reason} and {backend_available('numba')[1]}; using numpy"


def check_device(device: str) -> str:
    """`device` if it is one of DEVICES, else ValueError."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    return device


def requested_device(device: str) -> tuple[str, bool]:
    """(device, from_env): the argument, or TINYLOOP_DEVICE when the argument is 'auto'."""
    check_device(device)
    if device != "auto":
        return device, False
    device = os.environ.get("TINYLOOP_DEVICE", "auto") or "auto"
    if device not in DEVICES:
        raise ValueError(f"TINYLOOP_DEVICE={device!r} is not one of {', '.join(DEVICES)}")
    return device, device != "auto"


def cuda_device_status() -> tuple[bool, str]:
    """(True, "") if libtinyloop can run models on a CUDA device here, else (False, why not)."""
    try:
        ffi, lib, _, _ = native_library()
    except ImportError as exc:
        return False, f"the native library is unavailable ({exc})"
    if lib.tl_device_check(lib.TL_DEVICE_CUDA) != lib.TL_OK:
        return False, ffi.string(lib.tl_last_error()).decode("utf-8", "replace")
    return True, ""


def placement(backend: str, device: str) -> tuple[str, str]:
    """(backend, device) as `backend` and `device` together mean them: device "cuda" runs on
    the native backend, so it turns "auto" into "native"; TINYLOOP_DEVICE steers native models
    only. Raises ValueError for device="cuda" with a Python backend."""
    requested = requested_backend(backend)
    device, from_env = requested_device(device)
    if device == "cuda" and requested not in ("auto", "native"):
        if not from_env:
            raise ValueError(f"device='cuda' runs on the native backend, not {requested!r} "
                             "(backend='numba-cuda' runs the numba kernels on a GPU)")
        device = "auto"
    return ("native" if device == "cuda" else requested), device


def backend_info(backend: str = "auto", device: str = "auto") -> dict[str, Any]:
    """What `backend` and `device` resolve to here, and why: a dict for humans and tests.
    The device is where the chosen backend runs its forward pass: "cuda" for numba-cuda, and
    for native with device "cuda"; "auto" is the CPU until libtinyloop's CUDA backend has been
    verified on a GPU (docs/install.md)."""
    placed, device = placement(backend, device)
    chosen = resolve_backend_name(placed)
    ok, why = backend_available(chosen)
    info = {"requested": requested_backend(backend), "chosen": chosen, "available": ok,
            "reason": why, "library": None, "origin": None, "library_version": None}
    native_ok, native_why = backend_available("native")
    if native_ok:
        ffi, lib, path, origin = native_library()
        info.update(library=str(path), origin=origin,
                    library_version=ffi.string(lib.tl_version_string()).decode())
    if placed == "auto":
        info["reason"] = _auto_reason(chosen)
    cuda_ok, cuda_why = cuda_device_status() if native_ok else (False, native_why)
    on_cuda = chosen == "numba-cuda" or device == "cuda"
    info.update(device="cuda" if on_cuda else "cpu", cuda_available=cuda_ok, cuda_reason=cuda_why,
                isas=native_isas())
    return info


def native_isas() -> tuple[str, ...]:
    """The CPU kernel paths libtinyloop can run on this machine, slowest first, as TINYLOOP_ISA
    names them (e.g. ('scalar', 'avx2', 'avx512-vnni', 'amx')); () without the library. A
    native model runs the fastest, or the one TINYLOOP_ISA names."""
    if not backend_available("native")[0]:
        return ()
    from .native import ISAS
    lib = native_library()[1]
    return tuple(name for isa, name in ISAS.items() if lib.tl_cpu_supports(isa))


def backend_features() -> frozenset[str]:
    """The set of features this install has, e.g. {'numpy', 'native', 'native-avx2', 'numba'}:
    'native-<isa>' for each of native_isas() but scalar."""
    features = {"numpy"}
    if backend_available("native")[0]:
        features.add("native")
        features.update(f"native-{isa}" for isa in native_isas() if isa != "scalar")
        if cuda_device_status()[0]:
            features.add("native-cuda")
    for name in ("numba", "numba-cuda"):
        if backend_available(name)[0]:
            features.add(name)
    return frozenset(features)


def _warn_fallback_once(chosen: str) -> None:
    if not _warned_fallback:
        _warned_fallback.append(True)
        warnings.warn(f"tinyloop: {_auto_reason(chosen)}", FallbackWarning, stacklevel=4)


def native_memory_stats(reset_peak: bool = False) -> dict[str, int]:
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


def open_engine(backend: str, path: str | os.PathLike[str], *, block_size: int,
                threads: int | None, prefix_cache_bytes: int = 0,
                device: str = "auto", kv_mode: str = "int8",
                prefix_cache_dir: str | None = None,
                prefix_cache_disk_bytes: int = 0) -> Engine[Any]:
    """Open the model file at `path` with `backend` on `device`, its KV cache in `kv_mode`
    ("int8" or "int4", as Model checked it), its prefix cache backed by the disk tier in
    `prefix_cache_dir` (None: none) under `prefix_cache_disk_bytes` (0: no limit; both checked
    by Model: a dir only with prefix_cache_bytes > 0); its `runtime()` says which backend and device
    it runs on. device="cuda" needs the native backend (backend "auto" or
    "native") and a usable GPU."""
    requested, device = placement(backend, device)
    name = resolve_backend_name(requested)
    if requested == "auto" and name != "native":
        _warn_fallback_once(name)
    ok, why = backend_available(name)
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {why}")
    if name == "native":
        from .native import NativeEngine
        return NativeEngine(native_library(), path, block_size=block_size, threads=threads,
                            prefix_cache_bytes=prefix_cache_bytes, device=device,
                            kv_mode=kv_mode, prefix_cache_dir=prefix_cache_dir,
                            prefix_cache_disk_bytes=prefix_cache_disk_bytes)
    from .fallback import Engine as PythonEngine
    from .modelfile import load_identified_model
    config, tensors, identity = load_identified_model(path)
    if name == "numba":
        from .fallback.numba_cpu import NumbaKernels
        kernels = NumbaKernels(threads)
    elif name == "numba-cuda":
        from .fallback.numba_cuda import CudaKernels
        kernels = CudaKernels()
    else:
        from .fallback.forward import NumpyKernels
        kernels = NumpyKernels
    engine: Engine[Any] = PythonEngine(config, tensors, block_size, kernels, prefix_cache_bytes,
                                        model_identity=identity, kv_mode=kv_mode,
                                        prefix_cache_dir=prefix_cache_dir,
                                        prefix_cache_disk_bytes=prefix_cache_disk_bytes)
    return engine
