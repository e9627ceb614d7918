"""TinyLoop: an inference runtime for looped (depth-recurrent) transformer language models.

Every backend and every execution path returns bit-identical logits and identical tokens
(docs/spec.md). Start with `tinyloop.Model`.
"""
from ._version import __version__
from .config import ModelConfig
from .errors import ModelFormatError
from .model import Model, PrefixCache
from .modelfile import load_model, save_model
from .prefix_manager import PrefixCacheManager
from .random_model import random_model

__all__ = ["Model", "ModelConfig", "ModelFormatError", "PrefixCache", "PrefixCacheManager",
           "__version__", "load_model", "random_model", "save_model"]
