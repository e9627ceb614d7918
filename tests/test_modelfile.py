"""Tests of the .tinyloop reader/writer (tinyloop/modelfile.py) and ModelConfig (docs/spec.md §6).

The spec's byte offsets are restated here independently of modelfile.py, so the tests read and
patch files on their own: a layout bug in the writer cannot hide behind the same bug in the reader.
Every hostile file must raise ModelFormatError naming the broken rule, and nothing else.
Version-1 files (§6.5) are made here by hand from version-2 ones (`as_version_1`): the library
writes only versions 2 and 3.
"""
import dataclasses
import functools
import gc
import math
import mmap
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tinyloop.config import ModelConfig
from tinyloop.errors import ModelFormatError
from tinyloop.modelfile import (decode_model, encode_model, load_model, meta_tensor, pack_int4,
                                read_meta, save_model, unpack_int4)

# §6.1 / §6.2 layout, restated: field -> (offset, struct format).
HEADER = {"magic": (0, "8s"), "version": (8, "<I"), "header_bytes": (12, "<I"),
          "file_bytes": (16, "<Q"), "checksum": (24, "<I"), "n_tensors": (28, "<I"),
          "table_offset": (32, "<Q"), "data_offset": (40, "<Q"), "vocab_size": (48, "<I"),
          "d_model": (52, "<I"), "n_heads": (56, "<I"), "n_kv_heads": (60, "<I"),
          "head_dim": (64, "<I"), "ffn_dim": (68, "<I"), "n_pre_blocks": (72, "<I"),
          "default_loops": (76, "<I"), "max_seq_len": (80, "<I"), "weight_format": (84, "<I"),
          "group_size": (88, "<I"), "tied_head": (92, "<I"), "bos_id": (96, "<i"),
          "eos_id": (100, "<i"), "tokenizer": (104, "<I"), "rope_theta": (108, "<f"),
          "rms_eps": (112, "<f"), "flags": (116, "<I"), "name": (120, "64s"),
          "n_core_blocks": (184, "<I"), "n_coda_blocks": (188, "<I"), "block_layout": (192, "<I"),
          "qkv_bias": (196, "<I"), "injection": (200, "<I"), "step_norm": (204, "<I"),
          "embed_scale": (208, "<f"), "coda_norm": (212, "<I"), "exit_threshold": (216, "<f"),
          "core_cycles": (220, "<I"), "attn_gate": (224, "<I"), "loop_window": (228, "<I"),
          "act_block": (232, "<I"), "reserved": (236, "20s")}
V2_RESERVED = (216, "40s")     # §6.5: in version 2 exit_threshold .. act_block are reserved
V1_RESERVED = (184, "72s")                  # §6.5: in version 1 the version-2 fields are reserved
ENTRY = {"name": (0, "48s"), "dtype": (48, "<I"), "ndim": (52, "<I"), "dims": (56, "<4Q"),
         "offset": (88, "<Q")}
ENTRY_FORMAT = "<48sII4QQ"
ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 4}


# ---- building valid models ---------------------------------------------------------------

def small_config(**changes):
    config = ModelConfig(vocab_size=300, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8,
                         ffn_dim=24, n_pre_blocks=1, default_loops=2, max_seq_len=32,
                         weight_format="int8", group_size=0, tied_head=False, bos_id=1,
                         eos_id=2, tokenizer="bytes", name="tiny ✓")
    return dataclasses.replace(config, **changes)


def int4_config(**changes):
    return small_config(weight_format="int4", group_size=8, **changes)


def v2_config(**changes):
    """Every version-2 feature on: k = 2, a coda block, post placement, qkv bias, injection,
    step and coda norms, an embedding scale."""
    return small_config(**{**dict(n_core_blocks=2, n_coda_blocks=1, block_layout="post",
                                  qkv_bias=True, injection=True, step_norm=True, coda_norm=True,
                                  embed_scale=4.0), **changes})


TOKENIZER_JSON = '{"model": {"type": "BPE", "vocab": {"é": 0, "✓": 1}}}'


def random_tensors(config, seed=0, max_m=255):
    """Random tensors of config's required shapes: scales, biases and gains in [0, 1), RoPE in
    [-1, 1), and a tokenizer.json text when the config needs one."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (dtype, shape) in config.required_tensors().items():
        if name == "meta.tokenizer_json":
            tensors[name] = meta_tensor(TOKENIZER_JSON)
        elif dtype == np.float32:
            low = -1.0 if name.startswith("rope.") else 0.0
            tensors[name] = rng.uniform(low, 1.0, shape).astype(np.float32)
        elif name.endswith(".m"):
            tensors[name] = rng.integers(0, max_m, shape, dtype=np.uint8, endpoint=True)
        else:
            info = np.iinfo(dtype)
            tensors[name] = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return tensors


CONFIGS = {"int8": small_config(), "int8-tied": small_config(tied_head=True),
           "int4": int4_config(), "int4-tied": int4_config(tied_head=True),
           "no-pre": small_config(n_pre_blocks=0, tokenizer="none", bos_id=-1, eos_id=-1,
                                  name=""),
           "v2": v2_config(),
           "v2-int4-sandwich": int4_config(n_pre_blocks=0, n_core_blocks=3, n_coda_blocks=2,
                                           block_layout="sandwich", step_norm=True,
                                           tied_head=True, embed_scale=0.5),
           "hf": v2_config(tokenizer="hf", block_layout="pre", qkv_bias=False),
           "v3-stop-ids": v2_config(stop_ids=(5, 299, 0)),
           # Ouro's shape with int4 weights, its int8 exit gate, and a stop id
           "v3-exit-gate": int4_config(n_pre_blocks=0, n_core_blocks=2, block_layout="sandwich",
                                       step_norm=True, stop_ids=(7,), exit_gate=True,
                                       exit_threshold=0.75),
           # HRM-Text's shape: a two-state core of two 2-block stacks, 3 low cycles, gated
           "v3-two-state": int4_config(n_pre_blocks=0, n_core_blocks=4, core_cycles=3,
                                       attn_gate=True, qkv_bias=True, n_coda_blocks=1),
           # IQuest-Coder Loop's shape, int4 weights (its int8 gates), a prelude and a coda
           "v3-loop": int4_config(n_core_blocks=2, n_coda_blocks=1, loop_window=5),
           # block activations (§2.2.1) in blocks of 2: d 16, H * D 12 and F 18 all differ
           "v3-act-block": small_config(head_dim=6, ffn_dim=18, n_core_blocks=2, injection=True,
                                        act_block=2)}
# Version-1 files of the version-2 kinds that version 1 can express (§6.5).
V1_KINDS = {"v1-int8": "int8", "v1-int4-tied": "int4-tied", "v1-no-pre": "no-pre"}
CONFIGS.update({v1: CONFIGS[v2] for v1, v2 in V1_KINDS.items()})
V2_KINDS = sorted(set(CONFIGS) - set(V1_KINDS))
# Optional meta.* texts written with a kind, beside those its config requires.
EXTRA_META = {"hf": {"meta.architecture": "LlamaForCausalLM",
                     "meta.tokenizer_config": '{"add_bos_token": true, "bos_token": "<s>"}'}}


def kind_tensors(kind, seed=0):
    """The tensors of a valid model of `kind` (a version-2 kind)."""
    tensors = random_tensors(CONFIGS[kind], seed)
    tensors.update({name: meta_tensor(text) for name, text in EXTRA_META.get(kind, {}).items()})
    return tensors


def as_version_1(buf):
    """A version-2 file of a version-1-expressible model rewritten as version 1 (§6.5):
    version 1, bytes 184 .. 255 zero, the core block's tensors named `loop.*`."""
    b = bytearray(buf)
    struct.pack_into("<I", b, 8, 1)
    b[184:256] = bytes(72)
    for name, at in table(buf).items():
        if name.startswith("core.0."):
            struct.pack_into("48s", b, at, ("loop." + name[len("core.0."):]).encode())
    return with_crc(b)


@functools.cache
def valid_file(kind="int8"):
    if kind in V1_KINDS:
        return as_version_1(valid_file(V1_KINDS[kind]))
    return encode_model(CONFIGS[kind], kind_tensors(kind))


def assert_same_model(got, want):
    """Same config and tensors; the tensors in the required order, the meta.* texts last."""
    (got_config, got_tensors), (want_config, want_tensors) = got, want
    assert got_config == want_config
    required = [n for n in want_config.required_tensors() if not n.startswith("meta.")]
    assert list(got_tensors)[:len(required)] == required
    assert set(got_tensors) == set(want_tensors)
    for name, want_array in want_tensors.items():
        a = got_tensors[name]
        assert a.dtype == want_array.dtype and a.shape == want_array.shape, name
        assert np.array_equal(a, want_array), name


# ---- reading and patching files independently of modelfile.py -----------------------------

def with_crc(buf):
    b = bytearray(buf)
    b[24:28] = bytes(4)
    struct.pack_into("<I", b, 24, zlib.crc32(b))
    return bytes(b)


def patch(buf, offset, fmt, *values, crc=True):
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, *values)
    return with_crc(b) if crc else bytes(b)


def header(buf, field):
    offset, fmt = HEADER[field]
    return struct.unpack_from(fmt, buf, offset)[0]


def set_header(buf, field, *values):
    offset, fmt = HEADER[field]
    return patch(buf, offset, fmt, *values)


def table(buf):
    """{tensor name: offset of its table entry}."""
    start = header(buf, "table_offset")
    rows = (start + 96 * i for i in range(header(buf, "n_tensors")))
    return {struct.unpack_from("48s", buf, at)[0].rstrip(b"\0").decode(): at for at in rows}


def entry(buf, tensor, field):
    offset, fmt = ENTRY[field]
    return struct.unpack_from(fmt, buf, table(buf)[tensor] + offset)


def set_entry(buf, tensor, field, *values):
    offset, fmt = ENTRY[field]
    return patch(buf, table(buf)[tensor] + offset, fmt, *values)


def set_value(buf, tensor, fmt, value, index=0):
    """Overwrite element `index` of a tensor's data."""
    (offset,) = entry(buf, tensor, "offset")
    return patch(buf, offset + index * struct.calcsize(fmt), fmt, value)


def rebuild(buf, drop=(), extra=(), reverse=False):
    """buf re-laid out by hand: its tensors minus `drop`, plus `extra` (name, dtype code, dims,
    payload) rows, table reversed if asked, 128-byte gaps between tensors."""
    rows = []
    for name, at in table(buf).items():
        raw_name, code, ndim, *dims, offset = struct.unpack_from(ENTRY_FORMAT, buf, at)
        nbytes = math.prod(dims[:ndim]) * ITEMSIZE[code]
        if name not in drop:
            rows.append((raw_name, code, ndim, dims, buf[offset:offset + nbytes]))
    for name, code, dims, payload in extra:
        rows.append((name.encode(), code, len(dims), [*dims, 0, 0, 0, 0][:4], payload))
    if reverse:
        rows.reverse()
    data_offset = -(-(256 + 96 * len(rows)) // 64) * 64 + 64
    entries, data = b"", bytearray()
    for raw_name, code, ndim, dims, payload in rows:
        data += bytes(-len(data) % 64 + 128)
        entries += struct.pack(ENTRY_FORMAT, raw_name, code, ndim, *dims, data_offset + len(data))
        data += payload
    head = bytearray(buf[:256])
    struct.pack_into("<I", head, 28, len(rows))
    struct.pack_into("<Q", head, 40, data_offset)
    struct.pack_into("<Q", head, 16, data_offset + len(data))
    return with_crc(head + entries + bytes(data_offset - 256 - len(entries)) + data)


def assert_rejected(buf, *substrings):
    with pytest.raises(ModelFormatError) as info:
        decode_model(buf)
    for s in substrings:
        assert s in str(info.value)


# ---- round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", V2_KINDS)
def test_round_trip_through_bytes_is_bit_exact(kind):
    config = CONFIGS[kind]
    tensors = kind_tensors(kind)
    buf = encode_model(config, tensors)
    decoded = decode_model(buf)
    assert_same_model(decoded, (config, tensors))
    assert encode_model(*decoded) == buf


@pytest.mark.parametrize("kind", V2_KINDS)
def test_round_trip_through_a_file_is_bit_exact(tmp_path, kind):
    config = CONFIGS[kind]
    tensors = kind_tensors(kind)
    path = tmp_path / "m.tinyloop"
    save_model(path, config, tensors)
    assert path.read_bytes() == encode_model(config, tensors)
    loaded = load_model(path)
    assert_same_model(loaded, (config, tensors))
    assert encode_model(*loaded) == path.read_bytes()


def test_stop_ids_make_a_version_3_file_and_read_back_into_the_config():
    buf = valid_file("v3-stop-ids")
    assert header(buf, "version") == 3
    assert entry(buf, "stop_ids", "dtype") == (4,) and entry(buf, "stop_ids", "ndim") == (1,)
    (offset,) = entry(buf, "stop_ids", "offset")
    assert struct.unpack_from("<3i", buf, offset) == (5, 299, 0)
    config, tensors = decode_model(buf)
    assert config.stop_ids == (5, 299, 0) and "stop_ids" not in tensors
    assert config.stop_token_ids() == {2, 5, 299, 0}
    # without stop ids a writer writes version 2, which older readers still read
    assert header(valid_file("v2"), "version") == 2


def test_stop_ids_are_written_from_the_config_only():
    with pytest.raises(ModelFormatError, match="written from ModelConfig.stop_ids"):
        encode_model(CONFIGS["v2"], {**kind_tensors("v2"), "stop_ids": np.array([5], "<i4")})


@pytest.mark.parametrize("stop_ids, version, message", [
    ((5, 5), None, "ids must not repeat, found 5 twice"),
    ((2,), None, "ids must differ from eos_id, found 2"),
    ((True,), None, "ids must be in 0 .. 299, found True"),
    (tuple(range(3, 20)), None, "at most 16 ids, got 17"),
    ((5,), 2, "stop_ids: need a version-3 file"),
    ("5", None, "stop_ids: must be a tuple of token ids"),
])
def test_config_stop_ids_rules(stop_ids, version, message):
    with pytest.raises(ModelFormatError, match=message):
        small_config(stop_ids=stop_ids).validate(version)


def test_a_json_list_of_stop_ids_is_a_tuple():
    config = ModelConfig.from_dict({**small_config().to_dict(), "stop_ids": [7, 8]})
    assert config.stop_ids == (7, 8) and config.file_version == 3


EXIT_GATE = ["exit_gate.w", "exit_gate.s", "exit_gate.b"]


def test_an_exit_gate_makes_a_version_3_file_with_its_tensors_and_threshold():
    buf = valid_file("v3-exit-gate")
    assert (header(buf, "version"), header(buf, "exit_threshold")) == (3, 0.75)
    assert header(buf, "reserved") == bytes(20)
    # int8 beside int4 linears: one row of d weights, its scale and bias f32 [1]
    assert [entry(buf, name, "dtype") for name in EXIT_GATE] == [(2,), (1,), (1,)]
    assert [entry(buf, name, "dims") for name in EXIT_GATE] == [(1, 16, 0, 0), (1, 0, 0, 0),
                                                                (1, 0, 0, 0)]
    config, tensors = decode_model(buf)
    assert config.exit_gate and config.exit_threshold == 0.75 and config.stop_ids == (7,)
    assert list(tensors)[-4:] == ["head.s", *EXIT_GATE]         # the required order
    # without a gate exit_threshold is 0, in a version-3 file as in a version-2 one
    assert header(valid_file("v3-stop-ids"), "exit_threshold") == 0.0
    assert not decode_model(valid_file("v3-stop-ids"))[0].exit_gate
    assert small_config(exit_gate=True, exit_threshold=1.0).file_version == 3


@pytest.mark.parametrize("changes, version, message", [
    (dict(exit_gate=True), None,
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got 0.0"),
    (dict(exit_gate=True, exit_threshold=1.5), None,
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got 1.5"),
    (dict(exit_gate=True, exit_threshold=math.nan), None,
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got nan"),
    (dict(exit_gate=True, exit_threshold=-0.25), None,
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got -0.25"),
    (dict(exit_gate=True, exit_threshold="0.5"), None,
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got '0.5'"),
    (dict(exit_threshold=0.5), None, "exit_threshold: must be 0 without an exit gate, got 0.5"),
    (dict(exit_threshold=-0.0), None, "exit_threshold: must be 0 without an exit gate, got -0.0"),
    (dict(exit_threshold=False), None,
     "exit_threshold: must be 0 without an exit gate, got False"),
    (dict(exit_gate=1, exit_threshold=0.5), None,
     "exit_gate: must be a bool (file: the exit_gate.* tensors present or not), got 1"),
    (dict(exit_gate=True, exit_threshold=0.5), 2, "exit_gate: needs a version-3 file, got True"),
])
def test_config_exit_gate_rules(changes, version, message):
    with pytest.raises(ModelFormatError) as info:
        small_config(**changes).validate(version)
    assert str(info.value) == message


def test_config_exit_threshold_limits_are_inclusive():
    for q in (1.0, 2.0**-149, 0.5):
        small_config(exit_gate=True, exit_threshold=q).validate()
    assert small_config(exit_gate=True, exit_threshold=0.1).exit_threshold == float(
        np.float32(0.1))                                        # f32-rounded, as the file holds


def test_layout_matches_the_spec():
    buf = valid_file("int4")
    config, tensors = decode_model(buf)
    assert header(buf, "magic") == b"TINYLOOP"
    assert (header(buf, "version"), header(buf, "header_bytes")) == (2, 256)
    assert header(buf, "file_bytes") == len(buf)
    assert header(buf, "checksum") == zlib.crc32(buf[:24] + bytes(4) + buf[28:])
    assert header(buf, "table_offset") == 256 and header(buf, "flags") == 0
    assert struct.unpack_from(V2_RESERVED[1], buf, V2_RESERVED[0])[0] == bytes(40)
    assert [header(buf, f) for f in ("n_core_blocks", "n_coda_blocks", "block_layout", "qkv_bias",
                                     "injection", "step_norm", "embed_scale", "coda_norm")] == \
        [1, 0, 0, 0, 0, 0, 1.0, 0]
    assert header(buf, "name") == "tiny ✓".encode().ljust(64, b"\0")
    assert (header(buf, "weight_format"), header(buf, "group_size")) == (2, 8)
    assert (header(buf, "tokenizer"), header(buf, "bos_id"), header(buf, "eos_id")) == (1, 1, 2)
    assert header(buf, "rms_eps") == config.rms_eps
    data_offset = header(buf, "data_offset")
    assert data_offset % 64 == 0 and data_offset >= 256 + 96 * len(tensors)
    names = list(table(buf))
    assert names == sorted(tensors)
    end = data_offset
    for name in names:
        (offset,) = entry(buf, name, "offset")
        a = tensors[name]
        assert offset % 64 == 0 and buf[end:offset] == bytes(offset - end)   # zero padding
        assert entry(buf, name, "dims")[:a.ndim] == a.shape
        assert buf[offset:offset + a.nbytes] == a.tobytes()
        end = offset + a.nbytes
    assert end == len(buf)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decode_accepts_buffer_objects(wrap):
    buf = valid_file()
    assert_same_model(decode_model(wrap(buf)), decode_model(buf))


def test_decode_accepts_an_mmap(tmp_path):
    path = tmp_path / "m.tinyloop"
    path.write_bytes(valid_file())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert_same_model(decode_model(mapping), decode_model(valid_file()))


def test_reader_accepts_any_table_order_and_gaps():
    buf = valid_file("int4-tied")
    assert_same_model(decode_model(rebuild(buf, reverse=True)), decode_model(buf))


def test_loaded_arrays_are_read_only_and_outlive_the_file(tmp_path):
    path = tmp_path / "m.tinyloop"
    config, tensors = CONFIGS["int8"], random_tensors(CONFIGS["int8"])
    save_model(path, config, tensors)
    _, loaded = load_model(path)
    scale = loaded["core.0.ffn_down.s"]
    del loaded
    gc.collect()
    path.write_bytes(bytes(path.stat().st_size))     # rewritten in place: the copy is unaffected
    path.unlink()
    assert np.array_equal(scale, tensors["core.0.ffn_down.s"])
    assert not scale.flags.writeable
    with pytest.raises(ValueError):
        scale[0] = 1.0
    _, from_bytearray = decode_model(bytearray(encode_model(config, tensors)))
    assert not from_bytearray["tok_emb.w"].flags.writeable


def test_save_model_replaces_atomically_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "m.tinyloop"
    path.write_bytes(b"old")
    config = CONFIGS["int8"]
    save_model(str(path), config, random_tensors(config))
    assert os.listdir(tmp_path) == ["m.tinyloop"]
    assert path.read_bytes() == valid_file("int8")
    bad = random_tensors(config)
    bad["tok_emb.s"][0] = np.nan
    with pytest.raises(ModelFormatError, match="tok_emb.s"):
        save_model(path, config, bad)
    assert os.listdir(tmp_path) == ["m.tinyloop"]
    assert path.read_bytes() == valid_file("int8")


def test_load_model_missing_empty_and_tiny_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "absent.tinyloop")
    for content in (b"", b"TINYLOOP", valid_file()[:255]):
        (tmp_path / "small").write_bytes(content)
        with pytest.raises(ModelFormatError, match="file too small"):
            load_model(tmp_path / "small")


# ---- version 1 (§6.5) and the meta.* texts ------------------------------------------------

@pytest.mark.parametrize("kind", sorted(V1_KINDS))
def test_version_1_file_reads_as_the_version_2_model_it_describes(kind):
    v2 = V1_KINDS[kind]
    buf = valid_file(kind)
    assert header(buf, "version") == 1 and struct.unpack_from("72s", buf, 184)[0] == bytes(72)
    assert any(name.startswith("loop.") for name in table(buf))
    decoded = decode_model(buf)
    assert_same_model(decoded, (CONFIGS[v2], kind_tensors(v2)))
    assert encode_model(*decoded) == valid_file(v2)       # written back as version 2


def test_version_1_reader_ignores_what_version_2_fields_would_say():
    """A version-1 header's bytes 184 .. 255 are reserved, never read as n_core_blocks etc.:
    a nonzero one is a reserved-bytes error, not a config error, whatever its offset."""
    for at in (184, 192, 208, 212, 216):
        assert_rejected(patch(valid_file("v1-int4-tied"), at, "<B", 2),
                        "reserved: header bytes 184 .. 255")


def test_meta_texts_round_trip_and_read_meta_reads_only_them(tmp_path):
    buf = valid_file("hf")
    config, tensors = decode_model(buf)
    assert config.tokenizer == "hf"
    texts = {"meta.tokenizer_json": TOKENIZER_JSON, **EXTRA_META["hf"]}
    assert {n: a.tobytes().decode() for n, a in tensors.items() if n.startswith("meta.")} == texts
    assert list(tensors)[-3:] == sorted(texts)              # after the weights, in table order
    path = tmp_path / "m.tinyloop"
    path.write_bytes(buf)
    assert read_meta(path) == texts
    # no checksum pass and no weight read: damage past the table and texts goes unseen
    damaged = bytearray(buf)
    (offset,) = entry(buf, "tok_emb.s", "offset")
    damaged[offset:offset + 8] = struct.pack("<2f", NAN, -1.0)
    path.write_bytes(damaged)
    assert read_meta(path) == texts
    with pytest.raises(ModelFormatError, match="checksum"):
        load_model(path)


@pytest.mark.parametrize("kind", ["int8", "v1-int8", "v2"])
def test_read_meta_of_a_file_without_texts_is_empty(tmp_path, kind):
    path = tmp_path / "m.tinyloop"
    path.write_bytes(valid_file(kind))
    assert read_meta(path) == {}


@pytest.mark.parametrize("mutate, expected", [
    (lambda b: b[:255], "file too small"),
    (lambda b: set_header(b, "magic", b"TINYLOOQ"), "bad magic"),
    (lambda b: b + b"\0", "file_bytes"),
    (lambda b: set_header(b, "n_tensors", 2**32 - 1), "tensor table"),
    (lambda b: set_entry(b, "meta.architecture", "offset", 2**64 - 64), "past the end"),
    (lambda b: set_value(b, "meta.tokenizer_config", "<B", 0xFF, 1), "not valid UTF-8"),
])
def test_read_meta_rejects_a_broken_header_table_or_text(tmp_path, mutate, expected):
    path = tmp_path / "m.tinyloop"
    path.write_bytes(mutate(valid_file("hf")))
    with pytest.raises(ModelFormatError, match=expected):
        read_meta(path)


def test_meta_tensor_is_the_utf8_bytes():
    a = meta_tensor("é✓x")
    assert a.dtype == np.uint8 and a.shape == (6,) and a.tobytes() == "é✓x".encode()


@st.composite
def configs(draw):
    n_kv_heads = draw(st.integers(1, 3))
    weight_format = draw(st.sampled_from(["int8", "int4"]))
    group_size = 2 * draw(st.integers(1, 4)) if weight_format == "int4" else 0
    unit = group_size or 1                      # every K must be a multiple of the group size
    head_dim = 2 * unit * draw(st.integers(1, 3)) if group_size else 2 * draw(st.integers(1, 8))
    vocab_size = draw(st.integers(2, 300))
    tokenizer = draw(st.sampled_from(["none", "hf", "bytes"] if vocab_size >= 256
                                     else ["none", "hf"]))
    name = draw(st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0"),
                        max_size=30).filter(lambda s: len(s.encode()) <= 63))
    exit_gate = draw(st.booleans())
    exit_threshold = draw(st.floats(0.0, 1.0, exclude_min=True, width=32)) if exit_gate else 0.0
    return ModelConfig(
        vocab_size=vocab_size, d_model=unit * draw(st.integers(1, 5)),
        n_heads=n_kv_heads * draw(st.integers(1, 3)), n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn_dim=unit * draw(st.integers(1, 5)), n_pre_blocks=draw(st.integers(0, 2)),
        default_loops=draw(st.integers(1, 256)), max_seq_len=draw(st.integers(1, 16)),
        weight_format=weight_format, group_size=group_size, tied_head=draw(st.booleans()),
        bos_id=draw(st.integers(-1, vocab_size - 1)), eos_id=draw(st.integers(-1, vocab_size - 1)),
        tokenizer=tokenizer, rope_theta=draw(st.floats(2.0**-20, 2.0**30, width=32)),
        rms_eps=draw(st.floats(2.0**-40, 1.0, width=32)), name=name,
        n_core_blocks=draw(st.integers(1, 3)), n_coda_blocks=draw(st.integers(0, 2)),
        block_layout=draw(st.sampled_from(["pre", "sandwich", "post"])),
        qkv_bias=draw(st.booleans()), injection=draw(st.booleans()),
        step_norm=draw(st.booleans()), coda_norm=draw(st.booleans()),
        embed_scale=draw(st.floats(2.0**-20, 2.0**20, width=32)), exit_gate=exit_gate,
        exit_threshold=exit_threshold)


@settings(deadline=None)
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_round_trip_of_random_models(config, seed):
    config.validate()
    tensors = random_tensors(config, seed)
    buf = encode_model(config, tensors)
    decoded = decode_model(buf)
    assert_same_model(decoded, (config, tensors))
    assert encode_model(*decoded) == buf


# ---- damaged and hostile files -------------------------------------------------------------

def test_every_truncation_is_rejected():
    buf = valid_file("int4")
    for n in range(len(buf)):
        with pytest.raises(ModelFormatError, match="file too small" if n < 256 else "file_bytes"):
            decode_model(buf[:n])


def test_truncations_with_fixed_up_size_and_checksum_are_rejected():
    buf = valid_file("int4")
    table_end = header(buf, "data_offset") + 64
    for n in [*range(256, table_end), *range(table_end, len(buf), 61), len(buf) - 1]:
        with pytest.raises(ModelFormatError):
            decode_model(patch(buf[:n], 16, "<Q", n))


def decodes_or_is_rejected(buf):
    """The only two outcomes allowed for any bytes: ModelFormatError, or a model that passes
    the writer's checks and round-trips."""
    try:
        decoded = decode_model(buf)
    except ModelFormatError:
        return
    assert_same_model(decode_model(encode_model(*decoded)), decoded)


positions = st.one_of(st.integers(0, 256 + 96 * 40),               # header and table
                      st.integers(0, len(valid_file("int4")) - 1))  # anywhere


@given(edits=st.lists(st.tuples(positions, st.integers(0, 255)), min_size=1, max_size=8),
       fix_checksum=st.booleans())
def test_random_byte_edits_are_rejected_or_decode_to_a_valid_model(edits, fix_checksum):
    buf = bytearray(valid_file("int4"))
    for at, value in edits:
        buf[at] = value
    decodes_or_is_rejected(with_crc(buf) if fix_checksum else bytes(buf))


@given(field=st.sampled_from(sorted(set(HEADER) - {"magic", "name", "reserved", "checksum"})),
       value=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2, 255, 256, 2**31])),
       kind=st.sampled_from(sorted(CONFIGS)))
def test_random_header_values_are_rejected_or_decode_to_a_valid_model(field, value, kind):
    offset, fmt = HEADER[field]
    size = struct.calcsize(fmt)
    if fmt == "<f":
        raw = (value % 2**32).to_bytes(4, "little")           # any bit pattern, NaNs included
    else:
        raw = (value % 2**(8 * size)).to_bytes(size, "little")
    buf = bytearray(valid_file(kind))
    buf[offset:offset + size] = raw
    decodes_or_is_rejected(with_crc(buf))


@given(index=st.integers(0, 30), field=st.sampled_from(["dtype", "ndim", "dims", "offset"]),
       values=st.lists(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 70)),
                       min_size=4, max_size=4))
def test_random_table_values_are_rejected_or_decode_to_a_valid_model(index, field, values):
    buf = valid_file("int8")
    at = list(table(buf).values())[index % header(buf, "n_tensors")]
    offset, fmt = ENTRY[field]
    count = 4 if field == "dims" else 1
    limit = 2**64 if fmt.endswith("Q") else 2**32
    decodes_or_is_rejected(patch(buf, at + offset, fmt, *(v % limit for v in values[:count])))


NAN = float("nan")
HOSTILE = [
    # header, in validation order
    ("magic", "int8", lambda b: set_header(b, "magic", b"TINYLOOQ"), "bad magic"),
    # a colon in the bad bytes: the message must not quote them raw (readers-agree cuts at ':')
    ("magic-with-a-colon", "int8", lambda b: set_header(b, "magic", b"TLP\x00-\x00\x00:"), "bad magic"),
    ("version 4", "int8", lambda b: set_header(b, "version", 4), "version: unsupported 4"),
    ("version 0", "int8", lambda b: set_header(b, "version", 0), "version"),
    ("header_bytes", "int8", lambda b: set_header(b, "header_bytes", 255), "header_bytes"),
    ("file_bytes +1", "int8", lambda b: set_header(b, "file_bytes", len(b) + 1), "file_bytes"),
    ("file_bytes 2^64-1", "int8", lambda b: set_header(b, "file_bytes", 2**64 - 1), "file_bytes"),
    ("checksum", "int8", lambda b: patch(b, 1000, "<B", b[1000] ^ 1, crc=False),
     "checksum mismatch"),
    ("vocab 1", "int8", lambda b: set_header(b, "vocab_size", 1), "vocab_size"),
    ("vocab 2^20+1", "int8", lambda b: set_header(b, "vocab_size", 2**20 + 1), "vocab_size"),
    ("d_model 0", "int8", lambda b: set_header(b, "d_model", 0), "d_model"),
    ("d_model 2^16+1", "int8", lambda b: set_header(b, "d_model", 2**16 + 1), "d_model"),
    ("n_heads 0", "int8", lambda b: set_header(b, "n_heads", 0), "n_heads"),
    ("n_kv_heads 0", "int8", lambda b: set_header(b, "n_kv_heads", 0), "n_kv_heads"),
    ("n_kv_heads 3 of 2", "int8", lambda b: set_header(b, "n_kv_heads", 3), "n_kv_heads"),
    ("head_dim odd", "int8", lambda b: set_header(b, "head_dim", 7), "head_dim"),
    ("head_dim 0", "int8", lambda b: set_header(b, "head_dim", 0), "head_dim"),
    ("head_dim 1026", "int8", lambda b: set_header(b, "head_dim", 1026), "head_dim"),
    ("n_heads*head_dim", "int8", lambda b: set_header(b, "n_heads", 8193), "n_heads * head_dim"),
    ("ffn_dim 0", "int8", lambda b: set_header(b, "ffn_dim", 0), "ffn_dim"),
    ("n_pre_blocks 65", "int8", lambda b: set_header(b, "n_pre_blocks", 65), "n_pre_blocks"),
    ("default_loops 0", "int8", lambda b: set_header(b, "default_loops", 0), "default_loops"),
    ("default_loops 257", "int8", lambda b: set_header(b, "default_loops", 257), "default_loops"),
    ("max_seq_len 0", "int8", lambda b: set_header(b, "max_seq_len", 0), "max_seq_len"),
    ("max_seq_len 2^20+1", "int8", lambda b: set_header(b, "max_seq_len", 2**20 + 1),
     "max_seq_len"),
    ("weight_format 3", "int8", lambda b: set_header(b, "weight_format", 3), "weight_format"),
    ("group_size for int8", "int8", lambda b: set_header(b, "group_size", 8), "group_size"),
    ("group_size 0", "int4", lambda b: set_header(b, "group_size", 0), "group_size"),
    ("group_size odd", "int4", lambda b: set_header(b, "group_size", 1), "group_size"),
    ("group_size 6 not dividing", "int4", lambda b: set_header(b, "group_size", 6), "group_size"),
    ("group_size 32 > d_model", "int4", lambda b: set_header(b, "group_size", 32), "group_size"),
    ("tied_head 2", "int8", lambda b: set_header(b, "tied_head", 2), "tied_head"),
    ("bos_id V", "int8", lambda b: set_header(b, "bos_id", 300), "bos_id"),
    ("bos_id -2", "int8", lambda b: set_header(b, "bos_id", -2), "bos_id"),
    ("eos_id V", "int8", lambda b: set_header(b, "eos_id", 300), "eos_id"),
    ("tokenizer 2", "int8", lambda b: set_header(b, "tokenizer", 2), "tokenizer"),
    ("bytes tokenizer, vocab 200", "int8", lambda b: set_header(b, "vocab_size", 200),
     "tokenizer"),
    ("rope_theta NaN", "int8", lambda b: set_header(b, "rope_theta", NAN), "rope_theta"),
    ("rope_theta inf", "int8", lambda b: set_header(b, "rope_theta", math.inf), "rope_theta"),
    ("rope_theta 0", "int8", lambda b: set_header(b, "rope_theta", 0.0), "rope_theta"),
    ("rms_eps -1", "int8", lambda b: set_header(b, "rms_eps", -1.0), "rms_eps"),
    ("rms_eps NaN", "int8", lambda b: set_header(b, "rms_eps", NAN), "rms_eps"),
    ("tokenizer 3", "int8", lambda b: set_header(b, "tokenizer", 3),
     "tokenizer: must be 'none', 'bytes' or 'hf' (file codes 0, 1, 2), got 3"),
    ("n_core_blocks 0", "int8", lambda b: set_header(b, "n_core_blocks", 0),
     "n_core_blocks: must be an int in 1 .. 256, got 0"),
    ("n_core_blocks 257", "int8", lambda b: set_header(b, "n_core_blocks", 257), "n_core_blocks"),
    ("n_coda_blocks 65", "int8", lambda b: set_header(b, "n_coda_blocks", 65),
     "n_coda_blocks: must be an int in 0 .. 64, got 65"),
    ("n_layers(default_loops) 65537", "int8",
     lambda b: set_header(set_header(b, "default_loops", 256), "n_core_blocks", 256),
     "n_pre_blocks + default_loops * (n_core_blocks + n_coda_blocks): must be <= 65536, "
     "got 65537"),
    ("block_layout 3", "int8", lambda b: set_header(b, "block_layout", 3),
     "block_layout: must be 'pre', 'sandwich' or 'post' (file codes 0, 1, 2), got 3"),
    ("qkv_bias 2", "int8", lambda b: set_header(b, "qkv_bias", 2), "qkv_bias: must be a bool"),
    ("injection 2", "v2", lambda b: set_header(b, "injection", 2), "injection: must be a bool"),
    ("step_norm 2^32-1", "int8", lambda b: set_header(b, "step_norm", 2**32 - 1), "step_norm"),
    ("embed_scale 0", "int8", lambda b: set_header(b, "embed_scale", 0.0),
     "embed_scale: must be a finite float > 0, got 0.0"),
    ("embed_scale -inf", "v2", lambda b: set_header(b, "embed_scale", -math.inf), "embed_scale"),
    ("embed_scale NaN", "int8", lambda b: set_header(b, "embed_scale", NAN), "embed_scale"),
    ("coda_norm 2", "int8", lambda b: set_header(b, "coda_norm", 2), "coda_norm: must be a bool"),
    ("core_cycles 257", "v3-stop-ids", lambda b: set_header(b, "core_cycles", 257),
     "core_cycles: must be an int in 0 .. 256, got 257"),
    ("core_cycles with a step norm", "v3-exit-gate", lambda b: set_header(b, "core_cycles", 1),
     "step_norm: must be 0 with core_cycles >= 1"),
    ("core_cycles with an odd core", "v3-two-state", lambda b: set_header(b, "n_core_blocks", 3),
     "n_core_blocks: must be even with core_cycles >= 1 (two stacks), got 3"),
    ("core_cycles past 65536 layers", "v3-two-state",
     lambda b: set_header(set_header(b, "default_loops", 256), "core_cycles", 255),
     "n_pre_blocks + default_loops * ((core_cycles + 1) * n_core_blocks / 2 + n_coda_blocks): "
     "must be <= 65536, got 131328"),
    ("attn_gate 2", "v3-two-state", lambda b: set_header(b, "attn_gate", 2),
     "attn_gate: must be a bool"),
    ("attn_gate off", "v3-two-state", lambda b: set_header(b, "attn_gate", 0),
     "tensor 'coda.0.attn_qkv.b': shape (48,) != expected (32,)"),
    ("loop_window 2^20 + 1", "v3-loop", lambda b: set_header(b, "loop_window", 2**20 + 1),
     "loop_window: must be an int in 0 .. 1048576, got 1048577"),
    ("loop_window with a two-state core", "v3-two-state",
     lambda b: set_header(b, "loop_window", 4),
     "loop_window: needs core_cycles 0 (a one-state core), got 3"),
    ("loop_window with the attention gate", "v3-loop", lambda b: set_header(b, "attn_gate", 1),
     "loop_window: excludes the attention gate (attn_gate 1), got True"),
    ("act_block 2^16 + 1", "v3-act-block", lambda b: set_header(b, "act_block", 2**16 + 1),
     "act_block: must be an int in 0 .. 65536, got 65537"),
    ("act_block not dividing d_model", "v3-act-block", lambda b: set_header(b, "act_block", 32),
     "act_block: must divide d_model (16), got 32"),
    ("act_block not dividing n_heads * head_dim", "v3-act-block",
     lambda b: set_header(b, "act_block", 8), "act_block: must divide n_heads * head_dim (12), got 8"),
    ("act_block not dividing ffn_dim", "v3-act-block", lambda b: set_header(b, "act_block", 4),
     "act_block: must divide ffn_dim (18), got 4"),
    ("loop_window off", "v3-loop", lambda b: set_header(b, "loop_window", 0),
     "unexpected tensor 'core.0.loop_gate."),
    ("version-1 tokenizer 2", "v1-int8", lambda b: set_header(b, "tokenizer", 2),
     "tokenizer: 'hf' (file code 2) needs a version-2 file, got 'hf'"),
    ("name not UTF-8", "int8", lambda b: set_header(b, "name", b"\xff\xfe"),
     "name: not valid UTF-8"),
    ("name without NUL", "int8", lambda b: set_header(b, "name", b"n" * 64), "name: no NUL"),
    ("name junk after NUL", "int8", lambda b: set_header(b, "name", b"ab\0c"), "name: nonzero"),
    # table bounds
    ("n_tensors 2^32-1", "int8", lambda b: set_header(b, "n_tensors", 2**32 - 1), "tensor table"),
    ("n_tensors - 1", "int8", lambda b: set_header(b, "n_tensors", header(b, "n_tensors") - 1),
     "missing tensor"),
    ("table_offset 2^64-1", "int8", lambda b: set_header(b, "table_offset", 2**64 - 1),
     "table_offset"),
    ("table_offset 320", "int8", lambda b: set_header(b, "table_offset", 320), "table_offset"),
    ("data_offset misaligned", "int8",
     lambda b: set_header(b, "data_offset", header(b, "data_offset") + 1), "data_offset"),
    ("data_offset inside table", "int8", lambda b: set_header(b, "data_offset", 256),
     "data_offset"),
    # table entries
    ("name not printable", "int8", lambda b: set_entry(b, "tok_emb.w", "name", b"tok\x01emb.w"),
     "not printable ASCII"),
    ("entry name without NUL", "int8", lambda b: set_entry(b, "tok_emb.w", "name", b"t" * 48),
     "no NUL"),
    ("duplicate name", "int8",
     lambda b: set_entry(b, "core.0.attn_out.s", "name", b"core.0.attn_out.w"), "duplicate name"),
    ("dtype code 5", "int8", lambda b: set_entry(b, "tok_emb.w", "dtype", 5),
     "dtype code must be 1, 2, 3 or 4, got 5"),
    ("dtype code 0", "int8", lambda b: set_entry(b, "tok_emb.w", "dtype", 0), "dtype code"),
    ("ndim 0", "int8", lambda b: set_entry(b, "tok_emb.w", "ndim", 0), "ndim"),
    ("ndim 5", "int8", lambda b: set_entry(b, "tok_emb.w", "ndim", 5), "ndim"),
    ("dim 0", "int8", lambda b: set_entry(b, "tok_emb.w", "dims", 0, 16, 0, 0), "dims"),
    ("dim after ndim", "int8", lambda b: set_entry(b, "tok_emb.w", "dims", 300, 16, 1, 0), "dims"),
    ("dims product 2^126", "int8",
     lambda b: set_entry(b, "tok_emb.w", "dims", 2**63, 2**63, 0, 0), "past the end"),
    ("dims all 2^64-1", "int8",
     lambda b: set_entry(set_entry(b, "tok_emb.w", "ndim", 4), "tok_emb.w", "dims",
                         *[2**64 - 1] * 4), "past the end"),
    ("offset misaligned", "int8",
     lambda b: set_entry(b, "rope.cos", "offset", entry(b, "rope.cos", "offset")[0] + 4),
     "not a multiple of 64"),
    ("offset 0", "int8", lambda b: set_entry(b, "rope.cos", "offset", 0), "< data_offset"),
    ("offset 2^64-64", "int8", lambda b: set_entry(b, "rope.cos", "offset", 2**64 - 64),
     "past the end"),
    ("overlap", "int8",
     lambda b: set_entry(b, "core.0.attn_out.s", "offset", entry(b, "tok_emb.w", "offset")[0]),
     "overlap"),
    # required set
    ("unexpected name", "int8", lambda b: set_entry(b, "tok_emb.s", "name", b"bogus.s"),
     "unexpected tensor 'bogus.s'"),
    ("extra tensor", "int8", lambda b: rebuild(b, extra=[("extra.s", 1, (4,), bytes(16))]),
     "unexpected tensor 'extra.s'"),
    ("missing tensor", "int8", lambda b: rebuild(b, drop=["core.0.ffn_down.s"]),
     "missing tensor 'core.0.ffn_down.s'"),
    ("missing adapter", "v2", lambda b: rebuild(b, drop=["core.adapter_inject.w"]),
     "missing tensor 'core.adapter_inject.w'"),
    ("missing bias", "v2", lambda b: rebuild(b, drop=["coda.0.attn_qkv.b"]),
     "missing tensor 'coda.0.attn_qkv.b'"),
    ("missing post norm", "v2-int4-sandwich", lambda b: rebuild(b, drop=["core.2.ffn_post_norm"]),
     "missing tensor 'core.2.ffn_post_norm'"),
    ("missing step norm", "v2", lambda b: rebuild(b, drop=["core.step_norm"]),
     "missing tensor 'core.step_norm'"),
    ("missing coda norm", "v2", lambda b: rebuild(b, drop=["coda.input_norm"]),
     "missing tensor 'coda.input_norm'"),
    ("missing loop gate", "v3-loop", lambda b: rebuild(b, drop=["core.1.loop_gate.s"]),
     "missing tensor 'core.1.loop_gate.s'"),
    ("loop gate wrong shape", "v3-loop",
     lambda b: set_entry(b, "core.0.loop_gate.b", "dims", 3, 0, 0, 0),
     "tensor 'core.0.loop_gate.b': shape (3,) != expected (2,)"),
    ("coda tensors with n_coda_blocks 0", "v2", lambda b: set_header(b, "n_coda_blocks", 0),
     "unexpected tensor 'coda.0."),
    ("adapter without injection", "v2", lambda b: set_header(b, "injection", 0),
     "unexpected tensor 'core.adapter_"),
    ("bias without qkv_bias", "v2", lambda b: set_header(b, "qkv_bias", 0),
     "unexpected tensor 'c"),
    ("post norms with layout pre", "v2", lambda b: set_header(b, "block_layout", 0),
     "_post_norm'"),
    ("bias wrong shape", "v2", lambda b: set_entry(b, "core.1.attn_qkv.b", "dims", 31, 0, 0, 0),
     "tensor 'core.1.attn_qkv.b': shape (31,) != expected (32,)"),
    ("loop.* in version 2", "int8",
     lambda b: set_entry(b, "core.0.attn_out.s", "name", b"loop.attn_out.s"),
     "unexpected tensor 'loop.attn_out.s'"),
    ("core.0.* in version 1", "v1-int8",
     lambda b: set_entry(b, "loop.attn_out.s", "name", b"core.0.attn_out.s"),
     "unexpected tensor 'core.0.attn_out.s'"),
    ("version-1 missing loop tensor", "v1-int8", lambda b: rebuild(b, drop=["loop.ffn_down.w"]),
     "missing tensor 'loop.ffn_down.w'"),
    # meta.* texts
    ("hf without tokenizer_json", "hf", lambda b: rebuild(b, drop=["meta.tokenizer_json"]),
     "missing tensor 'meta.tokenizer_json'"),
    ("tokenizer_json without hf", "int8",
     lambda b: rebuild(b, extra=[("meta.tokenizer_json", 3, (2,), b"{}")]),
     "unexpected tensor 'meta.tokenizer_json'"),
    ("unknown meta", "hf", lambda b: rebuild(b, extra=[("meta.license", 3, (3,), b"MIT")]),
     "unexpected tensor 'meta.license'"),
    ("meta in version 1", "v1-int8",
     lambda b: rebuild(b, extra=[("meta.architecture", 3, (3,), b"abc")]),
     "unexpected tensor 'meta.architecture'"),
    ("meta dtype i8", "hf", lambda b: set_entry(b, "meta.architecture", "dtype", 2),
     "tensor 'meta.architecture': dtype int8 != expected uint8"),
    ("meta 2-D", "hf", lambda b: set_entry(set_entry(b, "meta.tokenizer_config", "ndim", 2),
                                           "meta.tokenizer_config", "dims", 1,
                                           entry(b, "meta.tokenizer_config", "dims")[0], 0, 0),
     "tensor 'meta.tokenizer_config': shape (1, "),
    ("head present though tied", "int8-tied",
     lambda b: rebuild(b, extra=[("head.s", 1, (300,), bytes(1200))]),
     "unexpected tensor 'head.s'"),
    ("wrong dtype", "int8", lambda b: set_entry(b, "core.0.attn_out.s", "dtype", 3),
     "tensor 'core.0.attn_out.s': dtype uint8 != expected float32"),
    ("wrong shape", "int8", lambda b: set_entry(b, "tok_emb.w", "dims", 16, 300, 0, 0),
     "tensor 'tok_emb.w': shape (16, 300) != expected (300, 16)"),
    ("int4 shape", "int4", lambda b: set_entry(b, "core.0.attn_out.w", "dims", 8, 16, 0, 0),
     "tensor 'core.0.attn_out.w': shape (8, 16) != expected (16, 8)"),
    # values
    ("NaN scale", "int8", lambda b: set_value(b, "core.0.attn_qkv.s", "<f", NAN, 3),
     "tensor 'core.0.attn_qkv.s': scales must be finite and >= 0, found nan"),
    ("inf scale", "int4", lambda b: set_value(b, "tok_emb.s", "<f", math.inf), "tok_emb.s"),
    ("negative scale", "int8", lambda b: set_value(b, "head.s", "<f", -1.0),
     "tensor 'head.s': scales must be finite and >= 0, found -1.0"),
    ("rope 2.0", "int8", lambda b: set_value(b, "rope.cos", "<f", 2.0, 5),
     "tensor 'rope.cos': values must be finite with |v| <= 1, found 2.0"),
    ("rope NaN", "int8", lambda b: set_value(b, "rope.sin", "<f", NAN), "rope.sin"),
    ("bias NaN", "v2", lambda b: set_value(b, "pre.0.attn_qkv.b", "<f", NAN, 7),
     "tensor 'pre.0.attn_qkv.b': values must be finite, found nan"),
    ("post norm inf", "v2-int4-sandwich",
     lambda b: set_value(b, "core.1.attn_post_norm", "<f", -math.inf, 2),
     "tensor 'core.1.attn_post_norm': values must be finite, found -inf"),
    ("step norm NaN", "v2", lambda b: set_value(b, "core.step_norm", "<f", NAN), "core.step_norm"),
    ("coda norm inf", "v2", lambda b: set_value(b, "coda.input_norm", "<f", math.inf, 15),
     "tensor 'coda.input_norm': values must be finite, found inf"),
    ("adapter scale -1", "v2", lambda b: set_value(b, "core.adapter_state.s", "<f", -1.0),
     "tensor 'core.adapter_state.s': scales must be finite and >= 0"),
    ("loop gate scale -1", "v3-loop", lambda b: set_value(b, "core.1.loop_gate.s", "<f", -1.0, 1),
     "tensor 'core.1.loop_gate.s': scales must be finite and >= 0, found -1.0"),
    ("loop gate bias NaN", "v3-loop", lambda b: set_value(b, "core.0.loop_gate.b", "<f", NAN, 1),
     "tensor 'core.0.loop_gate.b': values must be finite, found nan"),
    ("stop id past the vocabulary", "v3-stop-ids", lambda b: set_value(b, "stop_ids", "<i", 300, 1),
     "tensor 'stop_ids': ids must be in 0 .. 299, found 300"),
    ("negative stop id", "v3-stop-ids", lambda b: set_value(b, "stop_ids", "<i", -1, 2),
     "tensor 'stop_ids': ids must be in 0 .. 299, found -1"),
    ("stop id equal to eos_id", "v3-stop-ids", lambda b: set_value(b, "stop_ids", "<i", 2),
     "tensor 'stop_ids': ids must differ from eos_id, found 2"),
    ("stop id repeated", "v3-stop-ids", lambda b: set_value(b, "stop_ids", "<i", 5, 2),
     "tensor 'stop_ids': ids must not repeat, found 5 twice"),
    ("17 stop ids", "v3-stop-ids",
     lambda b: rebuild(b, drop=["stop_ids"], extra=[("stop_ids", 4, (17,),
                                                     np.arange(10, 27, dtype="<i4").tobytes())]),
     "tensor 'stop_ids': at most 16 ids, got 17"),
    ("stop ids before the coda norm's values", "v3-stop-ids",
     lambda b: set_value(set_value(b, "stop_ids", "<i", 300), "coda.input_norm", "<f", NAN),
     "tensor 'coda.input_norm'"),
    ("stop ids before the meta texts' values", "v3-stop-ids",
     lambda b: set_value(rebuild(b, extra=[("meta.architecture", 3, (2,), b"\xff\xfe")]),
                         "stop_ids", "<i", 2),
     "tensor 'stop_ids': ids must differ from eos_id"),
    ("exit gate scale negative", "v3-exit-gate", lambda b: set_value(b, "exit_gate.s", "<f", -1.0),
     "tensor 'exit_gate.s': scales must be finite and >= 0, found -1.0"),
    ("exit gate scale NaN", "v3-exit-gate", lambda b: set_value(b, "exit_gate.s", "<f", NAN),
     "tensor 'exit_gate.s': scales must be finite and >= 0, found nan"),
    ("exit gate bias NaN", "v3-exit-gate", lambda b: set_value(b, "exit_gate.b", "<f", NAN),
     "tensor 'exit_gate.b': values must be finite, found nan"),
    ("exit gate bias -inf", "v3-exit-gate",
     lambda b: set_value(b, "exit_gate.b", "<f", -math.inf),
     "tensor 'exit_gate.b': values must be finite, found -inf"),
    ("head before the exit gate's values", "v3-exit-gate",
     lambda b: set_value(set_value(b, "exit_gate.s", "<f", NAN), "head.s", "<f", NAN, 9),
     "tensor 'head.s'"),
    ("stop ids before the exit gate's values", "v3-exit-gate",
     lambda b: set_value(set_value(b, "exit_gate.s", "<f", NAN), "stop_ids", "<i", 2),
     "tensor 'stop_ids': ids must differ from eos_id, found 2"),
    ("exit gate scale before its bias", "v3-exit-gate",
     lambda b: set_value(set_value(b, "exit_gate.b", "<f", NAN), "exit_gate.s", "<f", -2.0),
     "tensor 'exit_gate.s'"),
    ("exit gate before the meta texts' values", "v3-exit-gate",
     lambda b: set_value(rebuild(b, extra=[("meta.architecture", 3, (2,), b"\xff\xfe")]),
                         "exit_gate.b", "<f", math.inf),
     "tensor 'exit_gate.b'"),
    # exit_threshold (§6.1), checked after the values and before the reserved bytes (step 8)
    ("exit_threshold 0 with the gate", "v3-exit-gate",
     lambda b: set_header(b, "exit_threshold", 0.0),
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got 0.0"),
    ("exit_threshold just above 1", "v3-exit-gate",
     lambda b: patch(b, 216, "<I", 0x3F800001),
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got 1.0000001192"),
    ("exit_threshold NaN", "v3-exit-gate", lambda b: set_header(b, "exit_threshold", NAN),
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got nan"),
    ("exit_threshold inf", "v3-exit-gate", lambda b: set_header(b, "exit_threshold", math.inf),
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got inf"),
    ("exit_threshold negative", "v3-exit-gate",
     lambda b: set_header(b, "exit_threshold", -0.5),
     "exit_threshold: must be a finite float in (0, 1] with an exit gate, got -0.5"),
    ("exit_threshold without the gate", "v3-exit-gate", lambda b: rebuild(b, drop=EXIT_GATE),
     "exit_threshold: must be 0 without an exit gate, got 0.75"),
    ("exit_threshold in a version-3 file without a gate", "v3-stop-ids",
     lambda b: set_header(b, "exit_threshold", 1.0),
     "exit_threshold: must be 0 without an exit gate, got 1.0"),
    ("exit_threshold -0.0 without a gate", "v3-stop-ids",
     lambda b: set_header(b, "exit_threshold", -0.0),
     "exit_threshold: must be 0 without an exit gate, got -0.0"),
    ("exit gate values before exit_threshold", "v3-exit-gate",
     lambda b: set_value(set_header(b, "exit_threshold", 0.0), "exit_gate.s", "<f", NAN),
     "tensor 'exit_gate.s'"),
    ("exit_threshold before the reserved bytes", "v3-exit-gate",
     lambda b: patch(set_header(b, "exit_threshold", 2.0), 240, "<B", 1), "exit_threshold"),
    ("exit_threshold before flags", "v3-stop-ids",
     lambda b: set_header(set_header(b, "exit_threshold", 0.5), "flags", 1), "exit_threshold"),
    ("stop ids in version 2", "v3-stop-ids", lambda b: set_header(b, "version", 2),
     "unexpected tensor 'stop_ids'"),
    ("stop ids as int8", "v3-stop-ids", lambda b: set_entry(b, "stop_ids", "dtype", 2),
     "tensor 'stop_ids': dtype int8 != expected int32"),
    ("stop ids 2-D", "v3-stop-ids", lambda b: set_entry(set_entry(b, "stop_ids", "ndim", 2),
                                                        "stop_ids", "dims", 1, 3, 0, 0),
     "tensor 'stop_ids': shape (1, 3)"),
    # the exit gate: all three tensors or none (§6.3), int8 weights [1, d], f32 [1] scale, bias
    ("exit gate weights alone", "v3-exit-gate", lambda b: rebuild(b, drop=EXIT_GATE[1:]),
     "missing tensor 'exit_gate.s'"),
    ("exit gate without its weights", "v3-exit-gate", lambda b: rebuild(b, drop=EXIT_GATE[:1]),
     "missing tensor 'exit_gate.w'"),
    ("exit gate without its bias", "v3-exit-gate", lambda b: rebuild(b, drop=EXIT_GATE[2:]),
     "missing tensor 'exit_gate.b'"),
    ("exit gate bias alone", "v3-exit-gate", lambda b: rebuild(b, drop=EXIT_GATE[:2]),
     "missing tensor 'exit_gate.w'"),
    ("exit gate in version 2", "v3-exit-gate",
     lambda b: set_header(rebuild(b, drop=["stop_ids"]), "version", 2),
     "unexpected tensor 'exit_gate.b'"),
    ("exit gate in version 1", "v1-int8",
     lambda b: rebuild(b, extra=[("exit_gate.w", 2, (1, 16), bytes(16))]),
     "unexpected tensor 'exit_gate.w'"),
    ("unexpected before a missing exit gate tensor", "v3-exit-gate",
     lambda b: rebuild(b, drop=["exit_gate.s"], extra=[("zz", 1, (1,), bytes(4))]),
     "unexpected tensor 'zz'"),
    ("exit gate weights as uint8", "v3-exit-gate",
     lambda b: set_entry(b, "exit_gate.w", "dtype", 3),
     "tensor 'exit_gate.w': dtype uint8 != expected int8"),
    ("exit gate weights 1-D", "v3-exit-gate",
     lambda b: set_entry(set_entry(b, "exit_gate.w", "ndim", 1), "exit_gate.w", "dims",
                         16, 0, 0, 0),
     "tensor 'exit_gate.w': shape (16,) != expected (1, 16)"),
    ("exit gate weights transposed", "v3-exit-gate",
     lambda b: set_entry(b, "exit_gate.w", "dims", 16, 1, 0, 0),
     "tensor 'exit_gate.w': shape (16, 1) != expected (1, 16)"),
    ("exit gate scale [2]", "v3-exit-gate",
     lambda b: set_entry(b, "exit_gate.s", "dims", 2, 0, 0, 0),
     "tensor 'exit_gate.s': shape (2,) != expected (1,)"),
    ("exit gate bias as int32", "v3-exit-gate", lambda b: set_entry(b, "exit_gate.b", "dtype", 4),
     "tensor 'exit_gate.b': dtype int32 != expected float32"),
    ("meta not UTF-8", "hf", lambda b: set_value(b, "meta.tokenizer_json", "<B", 0xFF, 3),
     "tensor 'meta.tokenizer_json': not valid UTF-8 (byte 3)"),
    ("meta surrogate", "hf",
     lambda b: rebuild(b, drop=["meta.architecture"],
                       extra=[("meta.architecture", 3, (3,),
                               "\ud800".encode("utf-8", "surrogatepass"))]),
     "tensor 'meta.architecture': not valid UTF-8 (byte 0)"),
    ("meta values in table order", "hf",
     lambda b: set_value(set_value(b, "meta.tokenizer_json", "<B", 0xC0),
                         "meta.architecture", "<B", 0xC0),
     "tensor 'meta.architecture': not valid UTF-8"),
    # header leftovers, checked last
    ("reserved", "int8", lambda b: patch(b, 250, "<B", 1),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("reserved 216", "v2", lambda b: patch(b, 216, "<B", 1), "reserved"),
    ("version-1 reserved 184", "v1-int8", lambda b: patch(b, 184, "<B", 1),
     "reserved: header bytes 184 .. 255 must be zero"),
    ("version-1 reserved 255", "v1-no-pre", lambda b: patch(b, 255, "<B", 1), "reserved"),
    ("version-2 exit_threshold is reserved", "v2", lambda b: set_header(b, "exit_threshold", 0.5),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("version-3 reserved 236", "v3-exit-gate", lambda b: patch(b, 236, "<B", 1),
     "reserved: header bytes 236 .. 255 must be zero"),
    ("version-3 reserved 255", "v3-stop-ids", lambda b: patch(b, 255, "<B", 1),
     "reserved: header bytes 236 .. 255 must be zero"),
    ("version-2 loop_window is reserved", "v2", lambda b: set_header(b, "loop_window", 1),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("version-2 act_block is reserved", "v2", lambda b: set_header(b, "act_block", 4),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("version-2 core_cycles is reserved", "v2", lambda b: set_header(b, "core_cycles", 1),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("version-2 attn_gate is reserved", "v2", lambda b: set_header(b, "attn_gate", 1),
     "reserved: header bytes 216 .. 255 must be zero"),
    ("flags", "int8", lambda b: set_header(b, "flags", 1), "flags"),
]


@pytest.mark.parametrize("kind, mutate, expected",
                         [pytest.param(*case[1:], id=case[0]) for case in HOSTILE])
def test_hostile_file_is_rejected_with_a_message_naming_the_rule(kind, mutate, expected):
    assert_rejected(mutate(valid_file(kind)), expected)


# ---- the int4 accumulator bound (§3): 127 * 8 * K * max(m) <= 2^31 - 1 --------------------

def test_int4_accumulator_bound_is_enforced_exactly():
    # ffn_down has K = ffn_dim = 8320: max(m) = 254 fits the bound, 255 breaks it.
    config = int4_config(ffn_dim=8320)
    assert 127 * 8 * 8320 * 254 <= 2**31 - 1 < 127 * 8 * 8320 * 255
    tensors = random_tensors(config, max_m=254)
    tensors["core.0.ffn_down.m"][0, 0] = 254
    buf = encode_model(config, tensors)
    decode_model(buf)
    assert_rejected(set_value(buf, "core.0.ffn_down.m", "<B", 255, 7),
                    "tensor 'core.0.ffn_down.m': int4 accumulator bound", "8320 * 255")
    tensors["pre.0.ffn_down.m"][3, 1] = 255
    with pytest.raises(ModelFormatError, match="'pre.0.ffn_down.m': int4 accumulator bound"):
        encode_model(config, tensors)


# ---- the writer applies the reader's checks ---------------------------------------------

def broken(change):
    config = CONFIGS["int8"]
    tensors = random_tensors(config)
    change(tensors)
    return config, tensors


@pytest.mark.parametrize("config, tensors, expected", [
    pytest.param(small_config(vocab_size=1), {}, "vocab_size", id="bad config"),
    pytest.param(*broken(lambda t: t.pop("core.0.ffn_down.w")), "missing tensor 'core.0.ffn_down.w'",
                 id="missing"),
    pytest.param(*broken(lambda t: t.update(extra=np.zeros(4, np.float32))),
                 "unexpected tensor 'extra'", id="extra"),
    pytest.param(*broken(lambda t: t.update({"tok_emb.s": t["tok_emb.s"].astype(np.float64)})),
                 "tensor 'tok_emb.s': dtype float64 != expected float32", id="dtype"),
    pytest.param(*broken(lambda t: t.update({"tok_emb.w": t["tok_emb.w"].T})),
                 "tensor 'tok_emb.w': shape (16, 300) != expected (300, 16)", id="shape"),
    pytest.param(*broken(lambda t: t.update({"tok_emb.s": list(t["tok_emb.s"])})),
                 "not a numpy array", id="not an array"),
    pytest.param(*broken(lambda t: t["core.0.attn_out.s"].__setitem__(2, NAN)),
                 "core.0.attn_out.s': scales must be finite", id="NaN scale"),
    pytest.param(*broken(lambda t: t["core.0.attn_out.s"].__setitem__(2, -0.5)),
                 "found -0.5", id="negative scale"),
    pytest.param(*broken(lambda t: t["rope.sin"].__setitem__((1, 1), 2.0)),
                 "tensor 'rope.sin': values must be finite", id="rope 2.0"),
    pytest.param(*broken(lambda t: t.update({"meta.architecture": meta_tensor("")})),
                 "tensor 'meta.architecture': shape (0,) != expected (n,), n >= 1",
                 id="empty meta"),
    pytest.param(*broken(lambda t: t.update({"meta.architecture": np.array([0xC3], np.uint8)})),
                 "tensor 'meta.architecture': not valid UTF-8 (byte 0)", id="meta not UTF-8"),
    pytest.param(*broken(lambda t: t.update({"meta.tokenizer_json": meta_tensor("{}")})),
                 "unexpected tensor 'meta.tokenizer_json'", id="tokenizer_json without hf"),
    pytest.param(CONFIGS["hf"], {n: a for n, a in random_tensors(CONFIGS["hf"]).items()
                                 if n != "meta.tokenizer_json"},
                 "missing tensor 'meta.tokenizer_json'", id="hf without tokenizer_json"),
    pytest.param(CONFIGS["v2"], {**random_tensors(CONFIGS["v2"]),
                                 "core.step_norm": np.full(16, np.inf, np.float32)},
                 "tensor 'core.step_norm': values must be finite, found inf", id="step norm inf"),
    pytest.param(CONFIGS["v3-exit-gate"], {n: a for n, a in kind_tensors("v3-exit-gate").items()
                                           if n not in EXIT_GATE},
                 "missing tensor 'exit_gate.w'", id="gate without its tensors"),
    pytest.param(CONFIGS["v3-stop-ids"], {**kind_tensors("v3-stop-ids"),
                                          "exit_gate.w": np.zeros((1, 16), np.int8)},
                 "unexpected tensor 'exit_gate.w'", id="gate tensor without the gate"),
    pytest.param(CONFIGS["v3-exit-gate"], {**kind_tensors("v3-exit-gate"),
                                           "exit_gate.w": np.zeros((1, 16), np.float32)},
                 "tensor 'exit_gate.w': dtype float32 != expected int8", id="float gate"),
    pytest.param(CONFIGS["v3-exit-gate"], {**kind_tensors("v3-exit-gate"),
                                           "exit_gate.s": np.full(1, -1, np.float32)},
                 "tensor 'exit_gate.s': scales must be finite and >= 0, found -1.0",
                 id="negative gate scale"),
    pytest.param(dataclasses.replace(CONFIGS["v3-exit-gate"], exit_threshold=0.0),
                 kind_tensors("v3-exit-gate"), "exit_threshold: must be a finite float in (0, 1]",
                 id="gate threshold 0"),
])
def test_writer_rejects_what_the_reader_rejects(config, tensors, expected):
    with pytest.raises(ModelFormatError) as info:
        encode_model(config, tensors)
    assert expected in str(info.value)


def test_writer_accepts_non_contiguous_arrays():
    config = CONFIGS["int8"]
    tensors = random_tensors(config)
    tensors["tok_emb.w"] = np.asfortranarray(tensors["tok_emb.w"])
    assert encode_model(config, tensors) == valid_file("int8")


# ---- int4 packing --------------------------------------------------------------------------

def test_pack_unpack_int4_round_trips_every_pair_of_values():
    values = np.arange(-8, 8, dtype=np.int8)
    low, high = np.meshgrid(values, values, indexing="ij")
    w = np.stack([low.ravel(), high.ravel()], axis=1).reshape(16, 32)   # (R, K), every pair
    packed = pack_int4(w)
    assert packed.dtype == np.uint8 and packed.shape == (16, 16)
    unpacked = unpack_int4(packed)
    assert unpacked.dtype == np.int8 and np.array_equal(unpacked, w)
    assert np.array_equal(pack_int4(unpack_int4(np.arange(256, dtype=np.uint8)[None])),
                          np.arange(256, dtype=np.uint8)[None])


def test_pack_int4_nibble_order():
    # element 2i in the low nibble, 2i+1 in the high nibble, 4-bit two's complement
    w = np.array([[1, -1, -8, 7]], np.int8)
    assert pack_int4(w).tolist() == [[0xF1, 0x78]]
    assert unpack_int4(np.array([[0xF1, 0x78]], np.uint8)).tolist() == w.tolist()


@pytest.mark.parametrize("w", [np.array([[8, 0]], np.int8), np.array([[-9, 0]], np.int8),
                               np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int16)])
def test_pack_int4_rejects_bad_input(w):
    with pytest.raises(ValueError):
        pack_int4(w)


# ---- ModelConfig -------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    ({"vocab_size": 1}, "vocab_size"), ({"vocab_size": 2**20 + 1}, "vocab_size"),
    ({"vocab_size": 300.0}, "vocab_size"), ({"vocab_size": True}, "vocab_size"),
    ({"d_model": 0}, "d_model"), ({"n_heads": 0}, "n_heads"),
    ({"n_kv_heads": 0}, "n_kv_heads"), ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"head_dim": 7}, "head_dim"), ({"head_dim": 1026}, "head_dim"),
    ({"n_heads": 128, "head_dim": 1024}, "n_heads * head_dim"),
    ({"ffn_dim": 2**16 + 1}, "ffn_dim"), ({"n_pre_blocks": -1}, "n_pre_blocks"),
    ({"default_loops": 0}, "default_loops"), ({"max_seq_len": 0}, "max_seq_len"),
    ({"weight_format": "fp16"}, "weight_format"), ({"group_size": 8}, "group_size"),
    ({"weight_format": "int4", "group_size": 0}, "group_size"),
    ({"weight_format": "int4", "group_size": 3}, "group_size"),
    ({"weight_format": "int4", "group_size": 32}, "group_size"),
    ({"tied_head": 1}, "tied_head"), ({"bos_id": 300}, "bos_id"), ({"eos_id": -2}, "eos_id"),
    ({"tokenizer": "bpe"}, "tokenizer"), ({"vocab_size": 255}, "tokenizer"),
    ({"rope_theta": NAN}, "rope_theta"), ({"rope_theta": 1e39}, "rope_theta"),
    ({"rms_eps": 0.0}, "rms_eps"), ({"rms_eps": "1e-5"}, "rms_eps"),
    ({"name": "x" * 64}, "name"), ({"name": "é" * 32}, "name"), ({"name": "a\0b"}, "name"),
    ({"name": "\udc80"}, "name"), ({"name": b"bytes"}, "name"),
    ({"tokenizer": 2}, "tokenizer"), ({"n_core_blocks": 0}, "n_core_blocks"),
    ({"n_core_blocks": 257}, "n_core_blocks"), ({"n_coda_blocks": -1}, "n_coda_blocks"),
    ({"n_coda_blocks": 65}, "n_coda_blocks"),
    ({"default_loops": 256, "n_core_blocks": 200, "n_coda_blocks": 56},
     "n_pre_blocks + default_loops * (n_core_blocks + n_coda_blocks)"),
    ({"block_layout": "postnorm"}, "block_layout"), ({"block_layout": 1}, "block_layout"),
    ({"qkv_bias": 1}, "qkv_bias"), ({"injection": None}, "injection"),
    ({"step_norm": "yes"}, "step_norm"), ({"embed_scale": 0.0}, "embed_scale"),
    ({"embed_scale": math.inf}, "embed_scale"), ({"embed_scale": "1"}, "embed_scale"),
    ({"coda_norm": 0}, "coda_norm"),
])
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(ModelFormatError) as info:
        small_config(**changes).validate()
    assert str(info.value).startswith(field + ":")


def test_config_version_1_rule_for_the_tokenizer():
    small_config(tokenizer="hf").validate()
    with pytest.raises(ModelFormatError, match="needs a version-2 file, got 'hf'"):
        small_config(tokenizer="hf").validate(version=1)
    small_config(tokenizer="bytes").validate(version=1)


def test_config_limits_are_inclusive():
    small_config(name="é" * 31 + "x", vocab_size=2**20, bos_id=2**20 - 1,
                 n_pre_blocks=64, default_loops=256, max_seq_len=2**20,
                 n_heads=64, n_kv_heads=64, head_dim=1024).validate()
    small_config(vocab_size=2, tokenizer="none", bos_id=-1, eos_id=1, d_model=1,
                 ffn_dim=1, n_pre_blocks=0).validate()
    small_config(n_pre_blocks=0, default_loops=256, n_core_blocks=192, n_coda_blocks=64,
                 embed_scale=2.0**-126).validate()              # n_layers = 65536 exactly
    small_config(n_pre_blocks=64, default_loops=1, n_core_blocks=256, n_coda_blocks=0).validate()


def test_config_names_and_shapes():
    config = int4_config()
    assert config.block_prefixes() == ["pre.0", "core.0"]
    assert small_config(n_pre_blocks=0).block_prefixes() == ["core.0"]
    shapes = config.linear_shapes()
    assert list(shapes) == ["pre.0.attn_qkv", "pre.0.attn_out", "pre.0.ffn_gate_up",
                            "pre.0.ffn_down", "core.0.attn_qkv", "core.0.attn_out",
                            "core.0.ffn_gate_up", "core.0.ffn_down", "head"]
    assert shapes["core.0.attn_qkv"] == ((2 + 2) * 8, 16) and shapes["head"] == (300, 16)
    assert shapes["core.0.attn_out"] == (16, 16) and shapes["core.0.ffn_gate_up"] == (48, 16)
    assert shapes["core.0.ffn_down"] == (16, 24)
    assert "head" not in int4_config(tied_head=True).linear_shapes()
    required = config.required_tensors()
    assert required["core.0.ffn_down.w"] == (np.dtype(np.uint8), (16, 12))
    assert required["core.0.ffn_down.m"] == (np.dtype(np.uint8), (16, 3))
    assert required["core.0.ffn_down.s"] == (np.dtype(np.float32), (16,))
    assert required["rope.cos"] == (np.dtype(np.float32), (32, 4))
    assert small_config().required_tensors()["head.w"] == (np.dtype(np.int8), (300, 16))
    assert len(small_config().required_tensors()) == 4 + 9 * 2
    assert len(config.required_tensors()) == 4 + 9 * 3


def test_config_version_2_names_slots_and_shapes():
    config = v2_config(n_pre_blocks=2, n_core_blocks=3, n_coda_blocks=2)
    assert config.block_prefixes() == ["pre.0", "pre.1", "core.0", "core.1", "core.2",
                                       "coda.0", "coda.1"]
    assert config.n_layers(4) == 2 + 4 * 5
    # §1: iteration i owns k + n_coda slots, its core blocks, then depth i+1's coda slots
    assert [config.core_slot(1, j) for j in range(3)] == [7, 8, 9]
    assert [config.coda_slot(2, c) for c in range(2)] == [10, 11]
    assert config.coda_slot(1, 0) == 5 and config.core_slot(0, 0) == 2
    required = config.required_tensors()
    names = list(required)
    block = [n for n in names if n.startswith("core.1.")]
    assert block == ["core.1.attn_qkv.w", "core.1.attn_qkv.s", "core.1.attn_qkv.b",
                     "core.1.attn_out.w", "core.1.attn_out.s", "core.1.attn_post_norm",
                     "core.1.ffn_gate_up.w", "core.1.ffn_gate_up.s", "core.1.ffn_down.w",
                     "core.1.ffn_down.s", "core.1.ffn_post_norm"]
    assert names[-8:] == ["core.adapter_state.w", "core.adapter_state.s", "core.adapter_inject.w",
                          "core.adapter_inject.s", "core.step_norm", "coda.input_norm",
                          "head.w", "head.s"]
    assert required["core.1.attn_qkv.b"] == (np.dtype(np.float32), ((2 + 2) * 8,))
    assert required["core.adapter_inject.w"] == (np.dtype(np.int8), (16, 16))
    assert required["coda.input_norm"] == (np.dtype(np.float32), (16,))
    assert v2_config(tokenizer="hf").required_tensors()["meta.tokenizer_json"] == \
        (np.dtype(np.uint8), (None,))


def test_config_dict_round_trip_and_f32_rounding():
    config = small_config(rope_theta=500000, rms_eps=1e-6)
    assert config.rms_eps == float(np.float32(1e-6)) and config.rope_theta == 500000.0
    d = config.to_dict()
    assert d["default_loops"] == 2 and d["weight_format"] == "int8"
    assert ModelConfig.from_dict(d) == config
    with pytest.raises(ModelFormatError, match="unknown keys \\['extra'\\]"):
        ModelConfig.from_dict({**d, "extra": 1})
    with pytest.raises(ModelFormatError, match="missing keys \\['vocab_size'\\]"):
        ModelConfig.from_dict({k: v for k, v in d.items() if k != "vocab_size"})
    with pytest.raises(ModelFormatError, match="vocab_size"):
        ModelConfig.from_dict({**d, "vocab_size": 1})
