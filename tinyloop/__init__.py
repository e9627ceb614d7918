"""TinyLoop: an inference runtime for looped (depth-recurrent) transformer language models.

Every backend and every execution path returns bit-identical logits and identical tokens
(docs/spec.md). Start with `tinyloop.Model`.
"""
from typing import Any

from . import _source_tree
_source_tree.install_fallback_finder()   # a checkout: tinyloop.fallback is <root>/fallback/

from ._version import __version__
from .backends import backend_available, backend_info, native_memory_stats
from .config import ModelConfig
from .errors import ModelFormatError, PrefixFormatError
from .hf import convert
from .model import Model, PrefixCache
from .modelfile import load_model, save_model
from .prefix_manager import PrefixCacheManager
from .random_model import random_model
from .scheduler import Scheduler, SchedulerEvent

__all__ = ["Model", "ModelConfig", "ModelFormatError", "PrefixCache", "PrefixCacheManager",
           "PrefixFormatError", "Scheduler", "SchedulerEvent", "__version__", "backend",
           "backend_available", "backend_features", "backend_info", "convert", "load_model",
           "native_memory_stats", "random_model", "save_model"]


def __getattr__(name: str) -> Any:
    """`tinyloop.backend` (what backend="auto" opens) and `tinyloop.backend_features`, in the
    style of python-zstandard; computed on first use so importing tinyloop loads nothing."""
    from . import backends as _backends
    if name == "backend":
        return _backends.resolve_backend_name("auto")
    if name == "backend_features":
        return _backends.backend_features()
    raise AttributeError(f"module 'tinyloop' has no attribute {name!r}")
