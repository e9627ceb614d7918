"""Pure-Python backends of TinyLoop (installed as `tinyloop.fallback`).

`Engine` with the default `NumpyKernels` is the reference: the executable form of
docs/spec.md that every other backend is tested against. It needs nothing but numpy. The numba
kernel sets (numba_cpu, numba_cuda) are imported only by the backend that opens them.

`Engine` implements tinyloop.engine.Engine. The reference does not import its consumer: from
tinyloop it takes only the engine seam (tinyloop.engine: the request types, the stop rule, the
cache counters' names) and the file format (tinyloop.modelfile), never tinyloop.model,
tinyloop.backends or the CLI (tests/test_engine_seam.py checks every import).
"""
from .engine import Engine, Prefix
from .sampling import NumericError

__all__ = ["Engine", "NumericError", "Prefix"]
