"""Pure-Python backends of TinyLoop (installed as `tinyloop.fallback`).

`Engine` with the default `NumpyKernels` is the reference: the executable form of
docs/spec.md that every other backend is tested against. It needs nothing but numpy. The numba
kernel sets (numba_cpu, numba_cuda) are imported only by the backend that opens them.
"""
from .engine import Engine, Prefix
from .sampling import NumericError

__all__ = ["Engine", "NumericError", "Prefix"]
