"""Reader and writer of the `.tinyloop` model file, version 3 (docs/spec.md §6).

`encode_model` / `save_model` write a file (version 3 when the config has stop ids or an exit
gate, else version 2: the lowest version that holds the model); `decode_model` / `load_model`
read one back, version 3, 2 or 1 (§6.5: a version-1 file is returned as the version-2 model it
describes, its `loop.*` tensors named `core.0.*`), as read-only numpy arrays viewing the bytes
(`load_model` reads the file once into memory of its own, so a later change to the file changes
nothing, as in libtinyloop). The optional `meta.*` texts are ordinary u8 1-D tensors of the
dict; `meta_tensor` makes one and `read_meta` reads only them (header, table and their bytes)
of a file another reader already validated. The `stop_ids` tensor is not in the dict: it is the
config's `stop_ids`, written from it and read into it. The `exit_gate.*` tensors are in it, as
required tensors, exactly when `config.exit_gate` (a file read has the gate when it has one of
them). Writer and reader apply the same tensor checks. The reader checks every rule of §6 in
one fixed order and raises ModelFormatError naming the first rule broken, whatever the input
bytes: sizes and offsets are Python ints (no overflow), and no byte outside the buffer is read
or allocated for.
`pack_int4` / `unpack_int4` convert int4 weights to and from their stored form; `checksum` is
the CRC-32 of §6.1, which the prefix blob (§7.1) and the spilled block file (§7.6) share.
Not here: quantization, or any interpretation of the weights.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import struct
import zlib
from typing import (TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Tuple, TypedDict,
                    cast)

import numpy as np

from .config import (BLOCK_LAYOUTS as LAYOUT_NAMES, EXIT_GATE_TENSORS, I32, META_TENSORS,
                     ModelConfig, TensorSpec, U8)
from .config import TOKENIZERS as TOKENIZER_NAMES
from .errors import ModelFormatError

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer

MAGIC = b"TINYLOOP"
VERSIONS = (1, 2, 3)
HEADER_BYTES = 256
ENTRY_BYTES = 96
ALIGN = 64
MAX_NDIM = 4
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<f4"), 2: np.dtype("i1"),
                                    3: np.dtype("u1"), 4: np.dtype("<i4")}   # §6.2 codes
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
WEIGHT_FORMATS = {1: "int8", 2: "int4"}                                # §6.1 codes
TOKENIZERS = dict(enumerate(TOKENIZER_NAMES))                          # §6.1 codes
BLOCK_LAYOUTS = dict(enumerate(LAYOUT_NAMES))                          # §6.1 codes
BOOLS = {0: False, 1: True}
I32_MAX = 2**31 - 1
V1_CORE, V2_CORE = "loop.", "core.0."                                   # §6.5 block names
STOP_IDS = "stop_ids"                                                    # §6.3, version 3

# §6.1: magic, version, header_bytes, file_bytes, checksum, n_tensors, table_offset,
# data_offset | 17 config fields, vocab_size .. rms_eps | flags, name | 8 version-2 fields,
# n_core_blocks .. coda_norm | exit_threshold, core_cycles, attn_gate, loop_window, act_block
# (version 3) | reserved.
HEADER = struct.Struct("<8sIIQIIQQ" "12I2iI2f" "I64s" "6IfI" "fIIII20s")
V1_VALUES = 27                   # HEADER's values up to the name; version 1 reserves the rest
CHECKSUM_AT = 24
V2_FIELDS_AT = 184
V3_FIELDS_AT = 216               # exit_threshold .. act_block; version 2 reserves them
# §6.2: name, dtype, ndim, dims[4], offset.
ENTRY = struct.Struct("<48sII4QQ")
assert HEADER.size == HEADER_BYTES and ENTRY.size == ENTRY_BYTES
# A table entry as the reader keeps it: (dtype, shape, offset).
TableEntry = Tuple[np.dtype[Any], Tuple[int, ...], int]


class HeaderFields(TypedDict):
    """The header fields _parse_header_start returns, `config` the 25 config fields in
    ModelConfig's order (a version-1 header's last 8 the §6.5 values), `exit_threshold` 0.0
    and `core` (core_cycles, attn_gate, loop_window, act_block) (0, 0, 0, 0) in versions 1 and 2
    (whose `reserved` bytes hold their place)."""
    checksum: int
    n_tensors: int
    table_offset: int
    data_offset: int
    file_bytes: int
    flags: int
    config: Tuple[Any, ...]
    name: bytes
    exit_threshold: float
    core: Tuple[Any, Any, Any, Any]  # unchecked codes, as config's
    reserved: bytes


def checksum(buf: Buffer) -> int:
    """CRC-32 of `buf` (any buffer) with its 4 bytes at CHECKSUM_AT read as zero: a model
    file's (§6.1), a prefix blob's (§7.1) or a spilled block file's (§7.6) checksum field."""
    mv = memoryview(buf).cast("B")
    return zlib.crc32(mv[CHECKSUM_AT + 4:], zlib.crc32(bytes(4), zlib.crc32(mv[:CHECKSUM_AT])))


# ---- writer ------------------------------------------------------------------------------

def encode_model(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> bytes:
    """The .tinyloop bytes of a model; raises ModelFormatError if it breaks §6."""
    return b"".join(_file_parts(config, tensors))


def save_model(path: str | os.PathLike[str], config: ModelConfig,
               tensors: Mapping[str, np.ndarray]) -> None:
    """Write the model to `path` atomically (a temp file beside it, then os.replace)."""
    parts = _file_parts(config, tensors)
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def meta_tensor(text: str) -> np.ndarray:
    """A `meta.*` tensor (§6.3): the UTF-8 bytes of `text` as a u8 1-D array."""
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def _file_parts(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> list[Buffer]:
    """Check a model, then lay it out: header, table sorted by name, 64-byte aligned data.

    Returns the file as a list of bytes-like parts with the checksum filled in.
    """
    config.validate()
    for name, a in tensors.items():
        if not isinstance(a, np.ndarray):
            raise ModelFormatError(f"tensor '{name}': not a numpy array")
    if STOP_IDS in tensors:
        raise ModelFormatError(f"tensor '{STOP_IDS}': written from ModelConfig.stop_ids, not "
                               "passed as a tensor")
    if config.stop_ids:
        tensors = {**tensors, STOP_IDS: np.array(config.stop_ids, I32)}
    names = sorted(tensors)
    version = config.file_version
    required, optional = _tensor_set(config, version)
    _check_layout(required, optional, {name: (tensors[name].dtype, tensors[name].shape)
                                       for name in names})
    _check_values(config, {name: tensors[name] for name in _value_order(required, names)})

    table_end = HEADER_BYTES + ENTRY_BYTES * len(names)
    data_offset = _align(table_end)
    table: list[bytes]
    data: list[Buffer]
    table, data, end = [], [], data_offset
    for name in names:
        a = tensors[name]
        offset = _align(end)
        dims = a.shape + (0,) * (MAX_NDIM - a.ndim)
        table.append(ENTRY.pack(name.encode("ascii"), DTYPE_CODES[a.dtype], a.ndim, *dims, offset))
        data += [bytes(offset - end),   # numpy's stubs make an ndarray a Buffer from 3.12 on
                 cast("Buffer", np.ascontiguousarray(a).reshape(-1).view(np.uint8))]
        end = offset + a.nbytes

    c = config
    header = bytearray(HEADER.pack(
        MAGIC, version, HEADER_BYTES, end, 0, len(names), HEADER_BYTES, data_offset,
        c.vocab_size, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.n_pre_blocks,
        c.default_loops, c.max_seq_len, _code(WEIGHT_FORMATS, c.weight_format), c.group_size,
        int(c.tied_head), c.bos_id, c.eos_id, _code(TOKENIZERS, c.tokenizer), c.rope_theta,
        c.rms_eps, 0, c.name.encode("utf-8"),
        c.n_core_blocks, c.n_coda_blocks, _code(BLOCK_LAYOUTS, c.block_layout), int(c.qkv_bias),
        int(c.injection), int(c.step_norm), c.embed_scale, int(c.coda_norm), c.exit_threshold,
        c.core_cycles, int(c.attn_gate), c.loop_window, c.act_block, bytes(20)))
    parts: list[Buffer] = [header, *table, bytes(data_offset - table_end), *data]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    struct.pack_into("<I", header, CHECKSUM_AT, crc)
    return parts


def _code(codes: Mapping[int, str], value: str) -> int:
    return next(code for code, v in codes.items() if v == value)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---- reader ------------------------------------------------------------------------------

def load_model(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, tensors) of the file at `path`, tensors viewing a private copy of its bytes.

    The file is read once and never again: it may be rewritten, truncated or deleted afterwards
    (a mapping would let that change validated weights under a running model, or fault).
    """
    return load_identified_model(path)[:2]


def load_identified_model(path: str | os.PathLike[str]
                          ) -> tuple[ModelConfig, dict[str, np.ndarray], tuple[int, int]]:
    """load_model's (config, tensors) and, from the same one read, the file's identity: its
    header checksum and file_bytes, what a prefix blob names its model by (docs/spec.md §7)."""
    with open(path, "rb") as f:
        buf = f.read()
    config, tensors = decode_model(buf)
    return config, tensors, (struct.unpack_from("<I", buf, CHECKSUM_AT)[0], len(buf))


def decode_model(buf: Buffer) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, {name: read-only array viewing buf}) of .tinyloop bytes (any buffer object).

    Checks, in order (§6.3): size, magic, version, header_bytes, file_bytes, checksum, the
    config, table bounds, each table entry, overlaps, the tensor set, tensor values,
    exit_threshold, reserved bytes, flags. The first rule broken raises ModelFormatError. The
    tensors are the required ones in the required order, then the meta.* texts in table order;
    a version-1 file's `loop.*` tensors are returned as `core.0.*`; a version-3 file's stop_ids
    are the config's, and so are its exit gate (present with its tensors) and exit_threshold.
    """
    mv = memoryview(buf).cast("B")
    size = mv.nbytes
    if size < HEADER_BYTES:
        raise ModelFormatError(f"file too small: {size} bytes < {HEADER_BYTES}-byte header")
    version, fields = _parse_header_start(mv, size)
    crc = checksum(mv)
    if crc != fields["checksum"]:
        raise ModelFormatError(f"checksum mismatch: header 0x{fields['checksum']:08x}, "
                               f"computed 0x{crc:08x}")
    config = _parse_config(version, fields)
    entries = _parse_table(mv, fields["n_tensors"], fields["table_offset"],
                           fields["data_offset"], fields["file_bytes"])
    # §6.3: a version-3 file has the exit gate when it has one of its tensors, then all three
    gate = version >= 3 and any(name in entries for name in EXIT_GATE_TENSORS)
    config = dataclasses.replace(config, exit_gate=gate)
    required, optional = _tensor_set(config, version)
    _check_layout(required, optional,
                  {name: (dtype, shape) for name, (dtype, shape, _) in entries.items()})
    found: dict[str, np.ndarray] = {}
    for name in _value_order(required, entries):
        dtype, shape, offset = entries[name]
        a = np.frombuffer(mv, dtype, math.prod(shape), offset).reshape(shape)
        a.flags.writeable = False
        found[name] = a
    _check_values(config, found)
    config = dataclasses.replace(config, exit_threshold=fields["exit_threshold"])
    config.check_exit_threshold()
    if any(fields["reserved"]):
        raise ModelFormatError(f"reserved: header bytes {HEADER_BYTES - len(fields['reserved'])}"
                               f" .. {HEADER_BYTES - 1} must be zero")
    if fields["flags"] != 0:
        raise ModelFormatError(f"flags: must be 0, got {fields['flags']}")
    if STOP_IDS in found:
        config = dataclasses.replace(config, stop_ids=tuple(map(int, found.pop(STOP_IDS))))
    return config, {_v2_name(name) if version == 1 else name: a for name, a in found.items()}


def read_meta(path: str | os.PathLike[str]) -> dict[str, str]:
    """{name: text} of the meta.* tensors of the file at `path` (§6.3), in table order.

    Reads only the header, the tensor table and those tensors' bytes: no checksum pass, no
    config or weight check, for a file that another reader (libtinyloop) already validated.
    The parts it does read are checked as decode_model checks them (table entries, UTF-8).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise ModelFormatError(f"file too small: {len(head)} bytes < {HEADER_BYTES}-byte "
                                   "header")
        _, fields = _parse_header_start(memoryview(head), size)
        n, table_offset = fields["n_tensors"], fields["table_offset"]
        if table_offset != HEADER_BYTES or table_offset + ENTRY_BYTES * n > size:
            table = b""                 # _parse_table names the broken bound, reading nothing
        else:
            table = f.read(ENTRY_BYTES * n)
        entries = _parse_table(memoryview(head + table), n, table_offset,
                               fields["data_offset"], fields["file_bytes"])
        texts: dict[str, str] = {}
        for name, (dtype, shape, offset) in entries.items():
            if name.startswith("meta."):
                f.seek(offset)
                texts[name] = _meta_text(name, f.read(math.prod(shape) * dtype.itemsize))
        return texts


def _parse_header_start(mv: memoryview, size: int) -> tuple[int, HeaderFields]:
    """(version, {header field: value}) after checking magic, version, header_bytes and
    file_bytes (step 1 of §6.3 but the checksum). A version-1 header's bytes 184 .. 255 are
    all reserved and its version-2 fields take the §6.5 values; a version-2 header's bytes
    216 .. 255 are reserved, its exit_threshold is 0 and its core one-state, ungated."""
    values = HEADER.unpack_from(mv)
    (magic, version, header_bytes, file_bytes, checksum, n_tensors, table_offset, data_offset,
     *config_fields, flags, name_field) = values[:V1_VALUES]
    if magic != MAGIC:
        raise ModelFormatError(f"bad magic {magic.hex()}, expected {MAGIC!r}")
    if version not in VERSIONS:
        raise ModelFormatError(f"version: unsupported {version}, expected 1, 2 or 3")
    if header_bytes != HEADER_BYTES:
        raise ModelFormatError(f"header_bytes: must be {HEADER_BYTES}, got {header_bytes}")
    if file_bytes != size:
        raise ModelFormatError(f"file_bytes: header says {file_bytes}, file has {size} bytes")
    v2_fields: Sequence[float]
    core = (0, 0, 0, 0)
    if version == 1:
        v2_fields = (1, 0, 0, 0, 0, 0, 1.0, 0)
        exit_threshold, reserved = 0.0, bytes(mv[V2_FIELDS_AT:HEADER_BYTES])
    else:
        *v2_fields, exit_threshold, core_cycles, attn_gate, loop_window, act_block, reserved = \
            values[V1_VALUES:]
        if version == 2:
            exit_threshold, reserved = 0.0, bytes(mv[V3_FIELDS_AT:HEADER_BYTES])
        else:
            core = (core_cycles, attn_gate, loop_window, act_block)
    return version, dict(checksum=checksum, n_tensors=n_tensors, table_offset=table_offset,
                         data_offset=data_offset, file_bytes=file_bytes, flags=flags,
                         config=(*config_fields, *v2_fields), name=name_field,
                         exit_threshold=exit_threshold, core=core, reserved=reserved)


def _parse_config(version: int, fields: HeaderFields) -> ModelConfig:
    """A validated ModelConfig from the header's config fields (the name's bytes checked first).

    Unknown codes (weight_format, the 0-or-1 fields, tokenizer, block_layout) pass through for
    validate() to reject.
    """
    (vocab_size, d_model, n_heads, n_kv_heads, head_dim, ffn_dim, n_pre_blocks, default_loops,
     max_seq_len, weight_format, group_size, tied_head, bos_id, eos_id, tokenizer, rope_theta,
     rms_eps, n_core_blocks, n_coda_blocks, block_layout, qkv_bias, injection, step_norm,
     embed_scale, coda_norm) = fields["config"]
    core_cycles, attn_gate, loop_window, act_block = fields["core"]
    config = ModelConfig(
        vocab_size, d_model, n_heads, n_kv_heads, head_dim, ffn_dim, n_pre_blocks,
        default_loops, max_seq_len, WEIGHT_FORMATS.get(weight_format, weight_format),
        group_size, BOOLS.get(tied_head, tied_head), bos_id, eos_id,
        TOKENIZERS.get(tokenizer, tokenizer), rope_theta, rms_eps,
        _header_name(fields["name"]), n_core_blocks, n_coda_blocks,
        BLOCK_LAYOUTS.get(block_layout, block_layout), BOOLS.get(qkv_bias, qkv_bias),
        BOOLS.get(injection, injection), BOOLS.get(step_norm, step_norm), embed_scale,
        BOOLS.get(coda_norm, coda_norm), core_cycles=core_cycles,
        attn_gate=BOOLS.get(attn_gate, attn_gate), loop_window=loop_window, act_block=act_block)
    config.validate(version)
    return config


def _header_name(field: bytes) -> str:
    raw = _nul_padded(field, "name")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFormatError(f"name: not valid UTF-8: {raw!r}") from None


def _parse_table(mv: memoryview, n_tensors: int, table_offset: int, data_offset: int,
                 file_bytes: int) -> dict[str, TableEntry]:
    """{name: (dtype, shape, offset)} of the tensor table, every §6.2 rule checked.

    Entries are read from `mv` at table_offset; the data bounds are checked against
    file_bytes (the data itself is not read)."""
    if table_offset != HEADER_BYTES:
        raise ModelFormatError(f"table_offset: must be {HEADER_BYTES}, got {table_offset}")
    table_end = table_offset + ENTRY_BYTES * n_tensors
    if table_end > file_bytes:
        raise ModelFormatError(f"tensor table: {n_tensors} entries end at byte {table_end}, "
                               f"past the end of the file ({file_bytes} bytes)")
    if data_offset % ALIGN:
        raise ModelFormatError(f"data_offset: must be a multiple of {ALIGN}, got {data_offset}")
    if data_offset < table_end:
        raise ModelFormatError(f"data_offset: must be >= {table_end} (end of the tensor "
                               f"table), got {data_offset}")
    entries: dict[str, TableEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for i in range(n_tensors):
        raw_name, code, ndim, *dims, offset = ENTRY.unpack_from(mv, table_offset + i * ENTRY_BYTES)
        raw = _nul_padded(raw_name, f"tensor {i} name")
        if not all(0x20 <= b <= 0x7E for b in raw):
            raise ModelFormatError(f"tensor {i} name: not printable ASCII: {raw!r}")
        name = raw.decode("ascii")
        where = f"tensor {i} '{name}'"
        if name in entries:
            raise ModelFormatError(f"{where}: duplicate name")
        if code not in DTYPES:
            raise ModelFormatError(f"{where}: dtype code must be 1, 2, 3 or 4, got {code}")
        if not 1 <= ndim <= MAX_NDIM:
            raise ModelFormatError(f"{where}: ndim must be 1 .. {MAX_NDIM}, got {ndim}")
        if min(dims[:ndim]) < 1 or any(dims[ndim:]):
            raise ModelFormatError(f"{where}: dims {dims} must be >= 1 for the first {ndim} "
                                   "and 0 after")
        if offset % ALIGN:
            raise ModelFormatError(f"{where}: offset {offset} not a multiple of {ALIGN}")
        if offset < data_offset:
            raise ModelFormatError(f"{where}: offset {offset} < data_offset {data_offset}")
        nbytes = math.prod(dims[:ndim]) * DTYPES[code].itemsize
        if offset + nbytes > file_bytes:
            raise ModelFormatError(f"{where}: data [{offset}, {offset + nbytes}) runs past "
                                   f"the end of the file ({file_bytes} bytes)")
        entries[name] = (DTYPES[code], tuple(dims[:ndim]), offset)
        spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ModelFormatError(f"tensors '{a}' and '{b}' overlap")
    return entries


def _nul_padded(field: bytes, what: str) -> bytes:
    """The bytes before the first NUL of a NUL-padded field (at least one NUL, zeros after)."""
    end = field.find(b"\0")
    if end < 0:
        raise ModelFormatError(f"{what}: no NUL terminator")
    if any(field[end:]):
        raise ModelFormatError(f"{what}: nonzero bytes after the NUL terminator")
    return field[:end]


def _v1_name(name: str) -> str:
    return V1_CORE + name[len(V2_CORE):] if name.startswith(V2_CORE) else name


def _v2_name(name: str) -> str:
    return V2_CORE + name[len(V1_CORE):] if name.startswith(V1_CORE) else name


# ---- checks shared by writer and reader --------------------------------------------------

def _tensor_set(config: ModelConfig, version: int
                ) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """(required, optional) {file name: (dtype, shape)} of §6.3 for a file of `version`, the
    required in the required order: version 1 names the core block `loop` and has no meta.*
    texts; meta.tokenizer_json is required with tokenizer "hf" and allowed with no other;
    stop_ids (i32 [n]) is allowed from version 3 on."""
    required = config.required_tensors()
    if version == 1:
        return {_v1_name(name): spec for name, spec in required.items()}, {}
    optional: dict[str, TensorSpec] = {STOP_IDS: (I32, (None,))} if version >= 3 else {}
    optional.update((name, (U8, (None,))) for name in META_TENSORS
                    if name not in required and name != "meta.tokenizer_json")
    return required, optional


def _check_layout(required: Mapping[str, TensorSpec], optional: Mapping[str, TensorSpec],
                  found: Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]]) -> None:
    """found {name: (dtype, shape)} is exactly the required set with its dtypes and shapes,
    plus optional ones (stop_ids, meta.* texts); a shape (None,) is any length >= 1."""
    for name, (dtype, shape) in found.items():
        if name in required:
            want_dtype, want_shape = required[name]
        elif name in optional:
            want_dtype, want_shape = optional[name]
        else:
            raise ModelFormatError(f"unexpected tensor '{name}'")
        if dtype != want_dtype:
            raise ModelFormatError(f"tensor '{name}': dtype {dtype} != expected {want_dtype}")
        if want_shape == (None,):
            if len(shape) != 1 or shape[0] < 1:
                raise ModelFormatError(f"tensor '{name}': shape {shape} != expected (n,), "
                                       "n >= 1")
        elif shape != want_shape:
            raise ModelFormatError(f"tensor '{name}': shape {shape} != expected {want_shape}")
    for name in required:
        if name not in found:
            raise ModelFormatError(f"missing tensor '{name}'")


def _value_order(required: Iterable[str], names: Iterable[str]) -> list[str]:
    """The file's tensor names (table order) in §6.3's required order: the required tensors
    but the exit gate's and the meta.* texts, then stop_ids and the exit gate's tensors (those
    present), then the meta.* texts in table order."""
    names = list(names)
    return [*(n for n in required if not n.startswith("meta.") and n not in EXIT_GATE_TENSORS),
            *(n for n in (STOP_IDS, *EXIT_GATE_TENSORS) if n in names),
            *(n for n in names if n.startswith("meta."))]


def _check_values(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """§6.3 value rules, tensor by tensor in `tensors`' order (_value_order): scales finite
    and >= 0, RoPE tables finite with |v| <= 1, biases and gains finite, meta.* texts valid
    UTF-8, the int4 accumulator bound of §3 (int8's 127 * 128 * K bound holds for every
    valid K), and the stop ids."""
    linears = config.linear_shapes()
    for name, a in tensors.items():
        if name == STOP_IDS:
            config.check_stop_ids([int(i) for i in a])
        elif name.startswith("meta."):
            _meta_text(name, a.tobytes())
        elif name.endswith(".s"):
            _require_all(name, a, np.isfinite(a) & (a >= 0), "scales must be finite and >= 0")
        elif name.startswith("rope."):
            _require_all(name, a, np.isfinite(a) & (np.abs(a) <= 1),
                         "values must be finite with |v| <= 1")
        elif name.endswith((".b", "norm")):
            _require_all(name, a, np.isfinite(a), "values must be finite")
        elif name.endswith(".m"):
            K, m = linears[_v2_name(name[:-2])][1], int(a.max())
            if 127 * 8 * K * m > I32_MAX:
                raise ModelFormatError(
                    f"tensor '{name}': int4 accumulator bound broken: 127 * 8 * K * max(m) = "
                    f"127 * 8 * {K} * {m} > 2^31 - 1")


def _meta_text(name: str, raw: bytes) -> str:
    """The text of a meta.* tensor's bytes; ModelFormatError if they are not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"tensor '{name}': not valid UTF-8 (byte {exc.start})") from None


def _require_all(name: str, a: np.ndarray, ok: npt.NDArray[np.bool_], rule: str) -> None:
    if not ok.all():
        raise ModelFormatError(f"tensor '{name}': {rule}, found {a[~ok][0]}")


# ---- int4 packing ------------------------------------------------------------------------

def pack_int4(w: np.ndarray) -> np.ndarray:
    """(..., K) int8 in [-8, 7], K even -> (..., K/2) uint8; element 2i in the low nibble."""
    w = np.asarray(w)
    if w.dtype != np.int8 or w.ndim == 0 or w.shape[-1] % 2:
        raise ValueError(f"pack_int4: need int8 (..., K) with K even, got {w.dtype} {w.shape}")
    if w.size and (w.min() < -8 or w.max() > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    nibbles = w.view(np.uint8) & 0x0F                # 4-bit two's complement
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(p: np.ndarray) -> np.ndarray:
    """(..., K/2) uint8 -> (..., K) int8 in [-8, 7]; the inverse of pack_int4."""
    p = np.asarray(p)
    if p.dtype != np.uint8 or p.ndim == 0:
        raise ValueError(f"unpack_int4: need uint8 (..., K/2), got {p.dtype} {p.shape}")
    nibbles = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.int8)
    nibbles[..., 0::2] = p & 0x0F
    nibbles[..., 1::2] = p >> 4
    return (nibbles ^ 8) - 8                         # 0..7 stay, 8..15 -> -8..-1
