"""Pure-Python backends of TinyLoop (installed as `tinyloop.fallback`).

`NumpyEngine` is the reference: the executable form of docs/spec.md that every other backend
is tested against. It needs nothing but numpy.
"""
from .engine import NumpyEngine, Prefix
from .sampling import NumericError

__all__ = ["NumpyEngine", "NumericError", "Prefix"]
