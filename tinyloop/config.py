"""Model configuration: the model fields of the `.tinyloop` header (docs/spec.md §6.1, §6.3).

`ModelConfig.validate()` checks exactly the header rules of §6.1 and `required_tensors()` lists
the tensor set of §6.3 that a file with this config holds. Nothing here knows about bytes: the
file layout is `modelfile.py`'s job.
"""
import dataclasses
import math
import numbers

import numpy as np

from .errors import ModelFormatError

F32 = np.dtype("<f4")
I8 = np.dtype("i1")
U8 = np.dtype("u1")

WEIGHT_FORMATS = ("int8", "int4")
TOKENIZERS = ("none", "bytes")
LINEAR_PARTS = ("attn_qkv", "attn_out", "ffn_gate_up", "ffn_down")   # per block, §6.3
NAME_MAX_BYTES = 63                                                    # char[64], one NUL kept


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model fields of a .tinyloop header. Construction does not check: call validate()."""

    vocab_size: int          # V, token ids 0 .. V-1; 2 .. 2^20
    d_model: int             # d, residual width; 1 .. 2^16
    n_heads: int             # H, query heads; >= 1
    n_kv_heads: int          # G, key/value heads; divides H
    head_dim: int            # D, per head, even; 2 .. 1024, H * D <= 2^16
    ffn_dim: int             # F, SwiGLU hidden width; 1 .. 2^16
    n_pre_blocks: int        # ordinary blocks before the loop block; 0 .. 64
    default_loops: int       # loop-block applications when a call gives none; 1 .. 256
    max_seq_len: int         # positions (and RoPE table rows); 1 .. 2^20
    weight_format: str       # "int8" | "int4"
    group_size: int          # int4 weights per multiplier, even, divides every K; 0 for int8
    tied_head: bool          # True: the LM head is the embedding (no "head" tensors)
    bos_id: int = -1         # beginning-of-sequence id; -1 = none
    eos_id: int = -1         # generation stops on this id; -1 = none
    tokenizer: str = "none"  # "none" | "bytes" (ids 0..255 are bytes; needs V >= 256)
    rope_theta: float = 1e4  # RoPE base, informational (the tables count); f32-rounded
    rms_eps: float = 1e-5    # RMSNorm epsilon (spec §2.3); f32-rounded
    name: str = ""           # free text, <= 63 UTF-8 bytes, no NUL

    def __post_init__(self):
        object.__setattr__(self, "rope_theta", _f32(self.rope_theta))
        object.__setattr__(self, "rms_eps", _f32(self.rms_eps))

    def validate(self):
        """Raise ModelFormatError naming the first field (in header order) that breaks §6.1."""
        self._int_range("vocab_size", 2, 2**20)
        self._int_range("d_model", 1, 2**16)
        self._int_range("n_heads", 1, None)
        self._int_range("n_kv_heads", 1, None)
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                 f"must divide n_heads ({self.n_heads})", self.n_kv_heads)
        self._int_range("head_dim", 2, 1024)
        _require(self.head_dim % 2 == 0, "head_dim", "must be even", self.head_dim)
        _require(self.n_heads * self.head_dim <= 2**16, "n_heads * head_dim",
                 "must be <= 65536", self.n_heads * self.head_dim)
        self._int_range("ffn_dim", 1, 2**16)
        self._int_range("n_pre_blocks", 0, 64)
        self._int_range("default_loops", 1, 256)
        self._int_range("max_seq_len", 1, 2**20)
        _require(self.weight_format in WEIGHT_FORMATS, "weight_format",
                 "must be 'int8' or 'int4' (file codes 1, 2)", self.weight_format)
        self._check_group_size()
        _require(isinstance(self.tied_head, bool), "tied_head", "must be a bool (file: 0 or 1)",
                 self.tied_head)
        for field in ("bos_id", "eos_id"):
            self._int_range(field, -1, self.vocab_size - 1)
        _require(self.tokenizer in TOKENIZERS, "tokenizer",
                 "must be 'none' or 'bytes' (file codes 0, 1)", self.tokenizer)
        _require(self.tokenizer != "bytes" or self.vocab_size >= 256, "tokenizer",
                 "'bytes' needs vocab_size >= 256", self.vocab_size)
        for field in ("rope_theta", "rms_eps"):
            value = getattr(self, field)
            _require(isinstance(value, float) and math.isfinite(value) and value > 0, field,
                     "must be a finite float > 0", value)
        self._check_name()

    def block_prefixes(self):
        """Tensor-name prefixes of the blocks in layer order: pre.0 .. pre.<n-1>, then loop."""
        return [f"pre.{i}" for i in range(self.n_pre_blocks)] + ["loop"]

    def linear_shapes(self):
        """{linear name: (R, K)} for every linear of §6.3, in block order, then head."""
        d, H, G, D, F = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim
        per_block = {"attn_qkv": ((H + 2 * G) * D, d), "attn_out": (d, H * D),
                     "ffn_gate_up": (2 * F, d), "ffn_down": (d, F)}
        shapes = {f"{b}.{part}": per_block[part] for b in self.block_prefixes()
                  for part in LINEAR_PARTS}
        if not self.tied_head:
            shapes["head"] = (self.vocab_size, d)
        return shapes

    def required_tensors(self):
        """{tensor name: (numpy dtype, shape)}: exactly the tensors of §6.3, in a fixed order.

        Only meaningful for a config that passes validate().
        """
        V, d, S, D = self.vocab_size, self.d_model, self.max_seq_len, self.head_dim
        tensors = {"tok_emb.w": (I8, (V, d)), "tok_emb.s": (F32, (V,)),
                   "rope.cos": (F32, (S, D // 2)), "rope.sin": (F32, (S, D // 2))}
        for name, (R, K) in self.linear_shapes().items():
            if self.weight_format == "int8":
                tensors[name + ".w"] = (I8, (R, K))
            else:
                tensors[name + ".w"] = (U8, (R, K // 2))                 # two int4 per byte
                tensors[name + ".m"] = (U8, (R, K // self.group_size))  # group multipliers
            tensors[name + ".s"] = (F32, (R,))                          # row scales
        return tensors

    def to_dict(self):
        """The fields as a plain dict (what Model.config() returns)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """The inverse of to_dict(), validated; unknown or missing keys raise ModelFormatError."""
        fields = dataclasses.fields(cls)
        unknown = sorted(set(d) - {f.name for f in fields})
        missing = [f.name for f in fields
                   if f.default is dataclasses.MISSING and f.name not in d]
        if unknown or missing:
            raise ModelFormatError(f"config: unknown keys {unknown}, missing keys {missing}")
        config = cls(**d)
        config.validate()
        return config

    def _int_range(self, field, lo, hi):
        value = getattr(self, field)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        ok = ok and lo <= value and (hi is None or value <= hi)
        rule = f"must be an int >= {lo}" if hi is None else f"must be an int in {lo} .. {hi}"
        _require(ok, field, rule, value)

    def _check_group_size(self):
        if self.weight_format == "int8":
            _require(self.group_size == 0, "group_size", "must be 0 for int8", self.group_size)
            return
        self._int_range("group_size", 2, None)
        _require(self.group_size % 2 == 0, "group_size", "must be even for int4", self.group_size)
        for field, k in (("d_model", self.d_model), ("n_heads * head_dim",
                         self.n_heads * self.head_dim), ("ffn_dim", self.ffn_dim)):
            _require(k % self.group_size == 0, "group_size", f"must divide {field} ({k})",
                     self.group_size)

    def _check_name(self):
        ok = isinstance(self.name, str) and "\0" not in self.name
        try:
            ok = ok and len(self.name.encode("utf-8")) <= NAME_MAX_BYTES
        except UnicodeEncodeError:      # lone surrogates
            ok = False
        _require(ok, "name", f"must be a str of <= {NAME_MAX_BYTES} UTF-8 bytes without NUL",
                 self.name)


def _require(ok, field, rule, value):
    if not ok:
        raise ModelFormatError(f"{field}: {rule}, got {value!r}")


def _f32(x):
    """x rounded to the nearest binary32, as the file stores it (+-inf beyond its range)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return x                                    # validate() rejects it
    try:
        x = float(x)
    except OverflowError:                           # an int beyond the float64 range
        x = math.inf if x > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(x))
