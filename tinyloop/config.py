"""Model configuration: the model fields of the `.tinyloop` header (docs/spec.md §1, §6.1, §6.3).

`ModelConfig.validate()` checks exactly the header rules of §6.1 (and the value rules of the
`stop_ids` tensor, which the config carries too) and `required_tensors()` lists the tensor set
of §6.3 that a file with this config holds, the exit gate's among them when it has one.
Nothing here knows about bytes: the file layout is `modelfile.py`'s job.
"""
import dataclasses
import math
import numbers
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np

from .errors import ModelFormatError

F32 = np.dtype("<f4")
I8 = np.dtype("i1")
U8 = np.dtype("u1")
I32 = np.dtype("<i4")

WEIGHT_FORMATS = ("int8", "int4")
TOKENIZERS = ("none", "bytes", "hf")
BLOCK_LAYOUTS = ("pre", "sandwich", "post")                           # §4, file codes 0, 1, 2
LINEAR_PARTS = ("attn_qkv", "attn_out", "ffn_gate_up", "ffn_down")   # per block, §6.3
# The optional UTF-8 texts of §6.3 (u8 [n], n >= 1); meta.tokenizer_json is present exactly
# when tokenizer == "hf".
META_TENSORS = ("meta.architecture", "meta.tokenizer_json", "meta.tokenizer_config")
MAX_CACHE_LAYERS = 2**16                                              # n_layers(L) bound, §1
NAME_MAX_BYTES = 63                                                    # char[64], one NUL kept
MAX_STOP_IDS = 16                                                      # stop_ids [n], §6.3
# The exit gate of adaptive depth (§5.7), present all three or none (version 3, §6.3).
EXIT_GATE_TENSORS = ("exit_gate.w", "exit_gate.s", "exit_gate.b")
# A tensor of the §6.3 set: (dtype, shape); the shape (None,) is a u8 text of any length >= 1.
TensorSpec = Tuple[np.dtype[Any], Tuple[Optional[int], ...]]
# The required order of §6.3 as _layout() gives it: (name, (kind, shape)).
LayoutEntry = Tuple[str, Tuple[str, Tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model fields of a .tinyloop header. Construction does not check: call validate()."""

    vocab_size: int          # V, token ids 0 .. V-1; 2 .. 2^20
    d_model: int             # d, residual width; 1 .. 2^16
    n_heads: int             # H, query heads; >= 1
    n_kv_heads: int          # G, key/value heads; divides H
    head_dim: int            # D, per head, even; 2 .. 1024, H * D <= 2^16
    ffn_dim: int             # F, SwiGLU hidden width; 1 .. 2^16
    n_pre_blocks: int        # prelude blocks before the core; 0 .. 64
    default_loops: int       # core iterations (the depth L) when a call gives none; 1 .. 256
    max_seq_len: int         # positions (and RoPE table rows); 1 .. 2^20
    weight_format: str       # "int8" | "int4"
    group_size: int          # int4 weights per multiplier, even, divides every K; 0 for int8
    tied_head: bool          # True: the LM head is the embedding (no "head" tensors)
    bos_id: int = -1         # beginning-of-sequence id; -1 = none
    eos_id: int = -1         # generation stops on this id; -1 = none
    tokenizer: str = "none"  # "none" | "bytes" (ids 0..255 are bytes; needs V >= 256) | "hf"
    rope_theta: float = 1e4  # RoPE base, informational (the tables count); f32-rounded
    rms_eps: float = 1e-5    # RMSNorm epsilon (spec §2.3); f32-rounded
    name: str = ""           # free text, <= 63 UTF-8 bytes, no NUL
    # version 2 (§6.1 offsets 184 ..); the defaults are what a version-1 file means (§6.5)
    n_core_blocks: int = 1   # k, the core's blocks, applied L times; 1 .. 256
    n_coda_blocks: int = 0   # blocks after the core; 0 .. 64
    block_layout: str = "pre"   # "pre" | "sandwich" (Ouro) | "post" (Huginn), §4
    qkv_bias: bool = False   # attn_qkv has a bias (attn_qkv.b)
    injection: bool = False  # the adapter (§4.4) starts every iteration
    step_norm: bool = False  # RN(x, core.step_norm) before iterations 1 .. L-1
    embed_scale: float = 1.0  # the embedding's multiplier; f32-rounded, finite > 0
    coda_norm: bool = False  # RN(x, coda.input_norm) after the last iteration
    # version 3 (§6.3's `stop_ids` tensor): the ids besides eos_id that end generation (§5.3)
    stop_ids: Tuple[int, ...] = ()
    # version 3 (§6.3's `exit_gate.*` tensors, §6.1 offset 216): adaptive depth's gate (§5.7)
    exit_gate: bool = False  # the file holds exit_gate.w, .s, .b
    exit_threshold: float = 0.0  # the gate rule's default q; 0 without the gate, else in (0, 1]
    # version 3 (§6.1 offsets 220, 224): HRM's two-state core (§1) and attention gate (§4)
    core_cycles: int = 0     # 0: one state; C >= 1: the low stack's cycles per iteration
    attn_gate: bool = False  # attn_qkv ends with H * D gate rows: o *= sig(gate)
    # version 3 (§6.1 offset 228): IQuest's loop attention (§4), W_l; 0 = none, 1 .. 2^20
    loop_window: int = 0
    # version 3 (§6.1 offset 232): block activations (§2.2.1), B; 0 = one scale per row
    act_block: int = 0

    def __post_init__(self) -> None:
        for field in ("rope_theta", "rms_eps", "embed_scale", "exit_threshold"):
            object.__setattr__(self, field, _f32(getattr(self, field)))
        if isinstance(self.stop_ids, list):         # from_dict of a JSON config
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))

    @property
    def file_version(self) -> int:
        """The version a writer gives this model's file: the lowest that holds it (§6.5)."""
        return 3 if (self.stop_ids or self.exit_gate or self.core_cycles or self.attn_gate
                     or self.loop_window or self.act_block) else 2

    def stop_token_ids(self) -> FrozenSet[int]:
        """Every id whose emission ends generation (§5.3): eos_id (when >= 0) and stop_ids."""
        return frozenset((*self.stop_ids, *((self.eos_id,) if self.eos_id >= 0 else ())))

    def validate(self, version: Optional[int] = None) -> None:
        """Raise ModelFormatError naming the first field (in header order) that breaks §6.1,
        then the first stop id that breaks §6.3's `stop_ids` rules, then the exit gate's fields
        (exit_threshold as step 8 of §6.3 checks it).

        `version` (default: file_version) 1 applies §6.5's narrower tokenizer rule (0 or 1) of
        a version-1 file; stop ids and the exit gate need version 3.
        """
        version = self.file_version if version is None else version
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
                 "must be 'none', 'bytes' or 'hf' (file codes 0, 1, 2)", self.tokenizer)
        if version == 1:
            _require(self.tokenizer != "hf", "tokenizer",
                     "'hf' (file code 2) needs a version-2 file", self.tokenizer)
        _require(self.tokenizer != "bytes" or self.vocab_size >= 256, "tokenizer",
                 "'bytes' needs vocab_size >= 256", self.vocab_size)
        for field in ("rope_theta", "rms_eps"):
            self._positive_float(field)
        self._int_range("n_core_blocks", 1, 256)
        self._int_range("n_coda_blocks", 0, 64)
        one_state = self.n_pre_blocks + self.default_loops * (self.n_core_blocks
                                                              + self.n_coda_blocks)
        _require(one_state <= MAX_CACHE_LAYERS,
                 "n_pre_blocks + default_loops * (n_core_blocks + n_coda_blocks)",
                 f"must be <= {MAX_CACHE_LAYERS}", one_state)
        _require(self.block_layout in BLOCK_LAYOUTS, "block_layout",
                 "must be 'pre', 'sandwich' or 'post' (file codes 0, 1, 2)", self.block_layout)
        for field in ("qkv_bias", "injection", "step_norm"):
            _require(isinstance(getattr(self, field), bool), field,
                     "must be a bool (file: 0 or 1)", getattr(self, field))
        self._positive_float("embed_scale")
        _require(isinstance(self.coda_norm, bool), "coda_norm", "must be a bool (file: 0 or 1)",
                 self.coda_norm)
        self._check_core_cycles(version)
        _require(isinstance(self.attn_gate, bool), "attn_gate", "must be a bool (file: 0 or 1)",
                 self.attn_gate)
        _require(version >= 3 or not self.attn_gate, "attn_gate", "needs a version-3 file",
                 self.attn_gate)
        self._check_loop_window(version)
        self._check_act_block(version)
        self._check_name()
        _require(isinstance(self.stop_ids, tuple), "stop_ids", "must be a tuple of token ids",
                 self.stop_ids)
        _require(version >= 3 or not self.stop_ids, "stop_ids", "need a version-3 file",
                 self.stop_ids)
        self.check_stop_ids(self.stop_ids)
        _require(isinstance(self.exit_gate, bool), "exit_gate",
                 "must be a bool (file: the exit_gate.* tensors present or not)", self.exit_gate)
        _require(version >= 3 or not self.exit_gate, "exit_gate", "needs a version-3 file",
                 self.exit_gate)
        self.check_exit_threshold()

    def check_exit_threshold(self) -> None:
        """§6.1's exit_threshold rule, step 8 of §6.3: 0 (all four bytes zero) without the
        exit gate, else a finite float in (0, 1] (the same words as libtinyloop's loader)."""
        q = self.exit_threshold
        if not self.exit_gate:
            _require(isinstance(q, float) and q == 0 and math.copysign(1.0, q) > 0,
                     "exit_threshold", "must be 0 without an exit gate", q)
        else:
            _require(isinstance(q, float) and math.isfinite(q) and 0 < q <= 1, "exit_threshold",
                     "must be a finite float in (0, 1] with an exit gate", q)

    def check_stop_ids(self, ids: Sequence[object]) -> None:
        """§6.3's value rules of the `stop_ids` tensor: at most MAX_STOP_IDS token ids, none
        repeated or equal to eos_id (the same words as libtinyloop's loader)."""
        where = "tensor 'stop_ids'"
        if len(ids) > MAX_STOP_IDS:
            raise ModelFormatError(f"{where}: at most {MAX_STOP_IDS} ids, got {len(ids)}")
        for k, i in enumerate(ids):
            if (not isinstance(i, numbers.Integral) or isinstance(i, bool)
                    or not 0 <= int(i) < self.vocab_size):
                raise ModelFormatError(f"{where}: ids must be in 0 .. {self.vocab_size - 1}, "
                                       f"found {i}")
            if i == self.eos_id:
                raise ModelFormatError(f"{where}: ids must differ from eos_id, found {i}")
            if i in ids[:k]:
                raise ModelFormatError(f"{where}: ids must not repeat, found {i} twice")

    @property
    def core_width(self) -> int:
        """w, the core's layers per iteration (§1): k, or (C + 1) * k/2 for a two-state core."""
        if self.core_cycles:
            return (self.core_cycles + 1) * (self.n_core_blocks // 2)
        return self.n_core_blocks

    def core_applications(self) -> List[int]:
        """The core block each application a = 0 .. w-1 of an iteration runs (§1): j, or for a
        two-state core the low stack's blocks C times, then the high stack's."""
        if not self.core_cycles:
            return list(range(self.n_core_blocks))
        n = self.n_core_blocks // 2
        return list(range(n)) * self.core_cycles + list(range(n, 2 * n))

    def n_layers(self, loops: int) -> int:
        """Cache slots of a sequence at depth `loops` (§1): n_pre + L * (w + n_coda)."""
        return self.n_pre_blocks + loops * (self.core_width + self.n_coda_blocks)

    def core_slot(self, iteration: int, j: int) -> int:
        """The cache slot of core application j in iteration `iteration` (0-based), §1."""
        return self.n_pre_blocks + iteration * (self.core_width + self.n_coda_blocks) + j

    def coda_slot(self, loops: int, c: int) -> int:
        """The cache slot of coda block c at depth `loops`, §1."""
        return self.core_slot(loops - 1, self.core_width + c)

    @property
    def carries_injected(self) -> bool:
        """Rows carry a second f32 vector between iterations: injection's term (§4.4) or a
        two-state core's low state (§1); a warm-start prefix keeps it (§5.4, §7.2)."""
        return bool(self.injection or self.core_cycles)

    @property
    def qkv_rows(self) -> int:
        """R of attn_qkv: (H + 2G) * D, and H * D gate rows more with attn_gate (§6.3)."""
        heads = self.n_heads + 2 * self.n_kv_heads + (self.n_heads if self.attn_gate else 0)
        return heads * self.head_dim

    def block_prefixes(self) -> List[str]:
        """Tensor-name prefixes of the blocks in file order: pre.*, core.*, coda.* (§6.3)."""
        return ([f"pre.{i}" for i in range(self.n_pre_blocks)]
                + [f"core.{j}" for j in range(self.n_core_blocks)]
                + [f"coda.{c}" for c in range(self.n_coda_blocks)])

    def linear_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """{linear name: (R, K)} for every linear of §6.3, in the required order."""
        return {name: shape for name, (kind, shape) in self._layout() if kind == "linear"}

    def required_tensors(self) -> Dict[str, TensorSpec]:
        """{tensor name: (numpy dtype, shape)}: exactly the required tensors of §6.3, in the
        required order (the optional META_TENSORS are not listed; meta.tokenizer_json is
        required when tokenizer == "hf", its length being free).

        Only meaningful for a config that passes validate().
        """
        tensors: Dict[str, TensorSpec] = {}
        for name, (kind, shape) in self._layout():
            if kind in ("f32", "i8"):
                tensors[name] = (F32 if kind == "f32" else I8, shape)
            elif self.weight_format == "int8":
                R, K = shape
                tensors[name + ".w"] = (I8, (R, K))
                tensors[name + ".s"] = (F32, (R,))                          # row scales
            else:
                R, K = shape
                tensors[name + ".w"] = (U8, (R, K // 2))                 # two int4 per byte
                tensors[name + ".m"] = (U8, (R, K // self.group_size))  # group multipliers
                tensors[name + ".s"] = (F32, (R,))
        if self.tokenizer == "hf":
            tensors["meta.tokenizer_json"] = (U8, (None,))              # any length >= 1
        return tensors

    def _layout(self) -> List[LayoutEntry]:
        """[(name, (kind, shape))] in the required order of §6.3: kind "linear" with shape
        (R, K) (stored as .w, .m, .s), or "i8" / "f32" for a tensor stored as it is."""
        V, d, S, D = self.vocab_size, self.d_model, self.max_seq_len, self.head_dim
        H, G, F = self.n_heads, self.n_kv_heads, self.ffn_dim
        post = self.block_layout != "pre"
        out: List[LayoutEntry] = [("tok_emb.w", ("i8", (V, d))), ("tok_emb.s", ("f32", (V,))),
               ("rope.cos", ("f32", (S, D // 2))), ("rope.sin", ("f32", (S, D // 2)))]
        for b in self.block_prefixes():
            out.append((f"{b}.attn_qkv", ("linear", (self.qkv_rows, d))))
            if self.qkv_bias:
                out.append((f"{b}.attn_qkv.b", ("f32", (self.qkv_rows,))))
            out.append((f"{b}.attn_out", ("linear", (d, H * D))))
            if post:
                out.append((f"{b}.attn_post_norm", ("f32", (d,))))
            out.append((f"{b}.ffn_gate_up", ("linear", (2 * F, d))))
            out.append((f"{b}.ffn_down", ("linear", (d, F))))
            if post:
                out.append((f"{b}.ffn_post_norm", ("f32", (d,))))
            if self.loop_window and b.startswith("core."):    # int8 whatever weight_format
                out += [(f"{b}.loop_gate.w", ("i8", (H, D))), (f"{b}.loop_gate.s", ("f32", (H,))),
                        (f"{b}.loop_gate.b", ("f32", (H,)))]
        if self.injection:
            out += [("core.adapter_state", ("linear", (d, d))),
                    ("core.adapter_inject", ("linear", (d, d)))]
        if self.step_norm:
            out.append(("core.step_norm", ("f32", (d,))))
        if self.coda_norm:
            out.append(("coda.input_norm", ("f32", (d,))))
        if not self.tied_head:
            out.append(("head", ("linear", (V, d))))
        if self.exit_gate:      # int8 whatever weight_format: one row of d weights, scale, bias
            w, s, b = EXIT_GATE_TENSORS
            out += [(w, ("i8", (1, d))), (s, ("f32", (1,))), (b, ("f32", (1,)))]
        return out

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (what Model.config() returns)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
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

    def _positive_float(self, field: str) -> None:
        value = getattr(self, field)
        _require(isinstance(value, float) and math.isfinite(value) and value > 0, field,
                 "must be a finite float > 0", value)

    def _int_range(self, field: str, lo: int, hi: Optional[int]) -> None:
        value = getattr(self, field)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        ok = ok and lo <= value and (hi is None or value <= hi)
        rule = f"must be an int >= {lo}" if hi is None else f"must be an int in {lo} .. {hi}"
        _require(ok, field, rule, value)

    def _check_group_size(self) -> None:
        if self.weight_format == "int8":
            _require(self.group_size == 0, "group_size", "must be 0 for int8", self.group_size)
            return
        self._int_range("group_size", 2, None)
        _require(self.group_size % 2 == 0, "group_size", "must be even for int4", self.group_size)
        for field, k in (("d_model", self.d_model), ("n_heads * head_dim",
                         self.n_heads * self.head_dim), ("ffn_dim", self.ffn_dim)):
            _require(k % self.group_size == 0, "group_size", f"must divide {field} ({k})",
                     self.group_size)

    def _check_loop_window(self, version: int) -> None:
        """§6.1's loop_window rules: 0 .. 2^20; loop attention (>= 1) needs a version-3 file,
        a one-state core (core_cycles 0), then no attention gate."""
        self._int_range("loop_window", 0, 2**20)
        if not self.loop_window:
            return
        _require(version >= 3, "loop_window", "needs a version-3 file", self.loop_window)
        _require(self.core_cycles == 0, "loop_window", "needs core_cycles 0 (a one-state core)",
                 self.core_cycles)
        _require(not self.attn_gate, "loop_window", "excludes the attention gate (attn_gate 1)",
                 self.attn_gate)

    def _check_act_block(self, version: int) -> None:
        """§6.1's act_block rules: 0 .. 2^16; block activations (>= 1) need a version-3 file
        and a B dividing every linear's input width (the same words as libtinyloop's loader)."""
        self._int_range("act_block", 0, 2**16)
        if not self.act_block:
            return
        _require(version >= 3, "act_block", "needs a version-3 file", self.act_block)
        for field, k in (("d_model", self.d_model), ("n_heads * head_dim",
                         self.n_heads * self.head_dim), ("ffn_dim", self.ffn_dim)):
            _require(k % self.act_block == 0, "act_block", f"must divide {field} ({k})",
                     self.act_block)

    def loop_global_slot(self, slot: int) -> Optional[int]:
        """With loop attention, the iteration-0 slot the layer of cache slot `slot` reads its
        global attention from when that layer is a core application of an iteration >= 1
        (§4); else None."""
        if not self.loop_window or slot < self.n_pre_blocks:
            return None
        i, j = divmod(slot - self.n_pre_blocks, self.core_width + self.n_coda_blocks)
        return self.core_slot(0, j) if i >= 1 and j < self.core_width else None

    def _check_core_cycles(self, version: int) -> None:
        """§6.1's core_cycles rules: 0 .. 256; a two-state core (>= 1) needs a version-3
        file, an even n_core_blocks, no injection and no step norm, and fits n_layers."""
        self._int_range("core_cycles", 0, 256)
        if not self.core_cycles:
            return
        _require(version >= 3, "core_cycles", "needs a version-3 file", self.core_cycles)
        _require(self.n_core_blocks % 2 == 0, "n_core_blocks",
                 "must be even with core_cycles >= 1 (two stacks)", self.n_core_blocks)
        for field in ("injection", "step_norm"):
            _require(not getattr(self, field), field, "must be 0 with core_cycles >= 1",
                     getattr(self, field))
        _require(self.n_layers(self.default_loops) <= MAX_CACHE_LAYERS,
                 "n_pre_blocks + default_loops * ((core_cycles + 1) * n_core_blocks / 2 + "
                 "n_coda_blocks)", f"must be <= {MAX_CACHE_LAYERS}",
                 self.n_layers(self.default_loops))

    def _check_name(self) -> None:
        ok = isinstance(self.name, str) and "\0" not in self.name
        try:
            ok = ok and len(self.name.encode("utf-8")) <= NAME_MAX_BYTES
        except UnicodeEncodeError:      # lone surrogates
            ok = False
        _require(ok, "name", f"must be a str of <= {NAME_MAX_BYTES} UTF-8 bytes without NUL",
                 self.name)


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ModelFormatError(f"{field}: {rule}, got {value!r}")


def _f32(x: object) -> object:
    """x rounded to the nearest binary32, as the file stores it (+-inf beyond its range)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return x                                    # validate() rejects it
    try:
        x = float(x)
    except OverflowError:                           # an int beyond the float64 range
        x = math.inf if cast(int, x) > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(x))
