"""The two readers of a .tinyloop file agree: for every mutation of a valid file (each hostile
file of test_modelfile.py, every header field at its edge values, truncations, flipped bytes),
libtinyloop's loader (a native Model open) and the Python reader (tinyloop.modelfile.load_model)
both accept it, or both reject it with the same error type and a message about the same rule.
Versions 3, 2 and 1 alike (docs/spec.md §6, §6.5): the version-2 and -3 header fields, each
tensor of every version-2 option and of the exit gate dropped or renamed, bad values in its
biases, gains and scales, and
meta.* texts of arbitrary bytes, where the two messages must agree word for word (the byte
offset of the first invalid UTF-8 sequence included).

Native only: the C loader is one of the two readers.
"""
import itertools
import re
import struct

import numpy as np
import pytest
from hypothesis import given, strategies as st

import tinyloop
from tinyloop.modelfile import load_model

from test_modelfile import (CONFIGS, EXIT_GATE, HEADER, HOSTILE, V1_KINDS, V2_KINDS, entry,
                            header, patch, rebuild, set_entry, set_header, set_value, table,
                            valid_file, with_crc)

pytestmark = pytest.mark.usefixtures("require_native")

NATIVE_PREFIX = "bad model file: "        # libtinyloop's ModelFormatError messages start so
# Version-2 kinds with every kind of tensor between them: biases, post and step norms, the
# adapter, a coda and its norm, int4 weights, the meta.* texts.
RICH_KINDS = ("v2", "v2-int4-sandwich", "hf", "v3-stop-ids", "v3-exit-gate")


def subject(message):
    """The rule a reader's message is about: the words before its first ':', or else its first
    two words ("bad magic", "missing tensor")."""
    message = message.removeprefix(NATIVE_PREFIX)
    return message.split(":")[0] if ":" in message else " ".join(re.split(r"[\s,]+", message)[:2])


def outcome(open_file, path):
    """(exception type name or "accepted", the exception's message without the native prefix)."""
    try:
        open_file(path)
    except Exception as exc:            # the outcome is compared, whatever it is
        return type(exc).__name__, str(exc).removeprefix(NATIVE_PREFIX)
    return "accepted", ""


def open_native(path):
    tinyloop.Model(path, backend="native", prefix_cache_bytes=0).close()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """outcomes(buf): (Python reader's outcome, C reader's outcome) for the file holding buf."""
    path = tmp_path_factory.mktemp("agree") / "m.tinyloop"

    def both(buf):
        path.write_bytes(buf)
        return outcome(load_model, path), outcome(open_native, path)
    return both


@pytest.fixture(scope="module")
def agree(outcomes):
    """agree(buf): asserts both readers give the same outcome for the file holding `buf`, by
    error type and the rule the message names; returns (type, rule)."""
    def check(buf):
        (python_type, python), (native_type, native) = outcomes(buf)
        assert (native_type, subject(native)) == (python_type, subject(python)), \
            f"C reader: {native_type}: {native!r}, Python reader: {python_type}: {python!r}"
        return python_type, subject(python)
    return check


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_both_accept_every_valid_file(agree, kind):
    assert agree(valid_file(kind)) == ("accepted", "")


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_both_read_the_same_config(tmp_path, kind):
    """Every field, the version-2 ones included, through tl_model_config_get and the Python
    reader alike (a version-1 file's as §6.5 says)."""
    path = tmp_path / "m.tinyloop"
    path.write_bytes(valid_file(kind))
    with tinyloop.Model(path, backend="native", prefix_cache_bytes=0) as model:
        assert model.config() == load_model(path)[0].to_dict() == CONFIGS[kind].to_dict()


@pytest.mark.parametrize("kind, mutate", [pytest.param(case[1], case[2], id=case[0])
                                          for case in HOSTILE])
def test_both_reject_each_hostile_file_for_the_same_rule(agree, kind, mutate):
    assert agree(mutate(valid_file(kind)))[0] == "ModelFormatError"


EDGE_VALUES = (0, 1, 2, 255, 256, 2**16, 2**16 + 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31,
               2**32 - 1, 2**63, 2**64 - 1)


@pytest.mark.parametrize("field", sorted(set(HEADER) - {"magic", "name", "reserved"}))
@pytest.mark.parametrize("kind", ["int8", "int4-tied", "v2", "hf", "v1-int8", "v3-stop-ids",
                                  "v3-exit-gate"])
def test_every_header_field_at_its_edges(agree, field, kind):
    """Each value at the edges of the field's width, the valid value +- 1 and its bit flips,
    with the checksum fixed up (checksum itself: left as written). In a version-1 file the
    version-2 fields are reserved bytes, in versions 1 and 2 exit_threshold; in version 3
    exit_threshold must be 0 without the exit gate, in (0, 1] with it (NaNs among the bit
    patterns)."""
    buf = valid_file(kind)
    offset, fmt = HEADER[field]
    size = struct.calcsize(fmt)
    valid = int.from_bytes(buf[offset:offset + size], "little")
    values = {v % 2**(8 * size) for v in (*EDGE_VALUES, valid - 1, valid + 1,
                                          *(valid ^ 1 << bit for bit in range(8 * size)))}
    for value in sorted(values - {valid}):
        raw = bytearray(buf)
        raw[offset:offset + size] = value.to_bytes(size, "little")
        agree(bytes(raw) if field == "checksum" else with_crc(raw))


@pytest.mark.parametrize("kind", ["int4", "hf", "v1-int4-tied"])
def test_truncations(agree, kind):
    """Cut anywhere (through the header, table, gaps and data), as is and with file_bytes and
    the checksum fixed up to the shorter length."""
    buf = valid_file(kind)
    table_end = header(buf, "data_offset")
    cuts = {*range(0, 300, 7), *range(table_end - 100, table_end + 100, 3),
            *range(table_end, len(buf), 97), len(buf) - 1}
    for n in sorted(cuts):
        assert agree(buf[:n])[0] == "ModelFormatError"
        if n >= 256:
            assert agree(patch(buf[:n], 16, "<Q", n))[0] == "ModelFormatError"


@pytest.mark.parametrize("kind", [*RICH_KINDS, *sorted(V1_KINDS)])
def test_each_tensor_dropped_or_renamed(agree, kind):
    """Every tensor of the file left out (only the optional texts may be), and renamed to a
    name of another option (a version-1 name in version 2 and the reverse, a coda block that
    is not there, a meta.* text the spec does not list): both readers name the same missing
    or unexpected tensor."""
    buf = valid_file(kind)
    optional = {"meta.architecture", "meta.tokenizer_config", "stop_ids"}
    renames = {"core.": "loop.", "loop.": "core.0.", "coda.0.": "coda.9.", "meta.": "meta.x"}
    for name, at in table(buf).items():
        want = "accepted" if name in optional else "ModelFormatError"
        assert agree(rebuild(buf, drop=[name]))[0] == want, name
        new = next((name.replace(old, to, 1) for old, to in renames.items() if old in name),
                   name + "x")
        raw = bytearray(buf)
        raw[at:at + 48] = new.encode().ljust(48, b"\0")
        assert agree(with_crc(raw))[0] == "ModelFormatError", name


@pytest.mark.parametrize("threshold", [0.0, 0.75])
@pytest.mark.parametrize("kept", [kept for n in range(4)
                                  for kept in itertools.combinations(EXIT_GATE, n)])
def test_exit_gate_subsets(outcomes, kept, threshold):
    """§6.3: the exit gate's tensors all three or none, and exit_threshold 0 exactly without
    them (step 8): every subset, with a threshold of 0 or not, and both readers say the same
    words (the value aside, which C prints with %g). Only all three with 0.75 and none with 0
    are valid."""
    buf = set_header(valid_file("v3-exit-gate"), "exit_threshold", threshold)
    results = outcomes(rebuild(buf, drop=[name for name in EXIT_GATE if name not in kept]))
    python, native = ((kind, message.split(", got ")[0]) for kind, message in results)
    assert python == native, results
    valid = len(kept) == 3 if threshold else not kept
    assert (results[0] == ("accepted", "")) == valid, results


# dims whose nbytes (§6.2) does not fit u64; the first two wrap to exactly 0 (mod 2^64) for
# an i8 tensor, the third to 2 (i8) or 8 (f32) bytes: a reader that multiplied without
# checking would see a tiny tensor.
OVERFLOWING_DIMS = [(2**63, 2**63, 1, 1), (2**32, 2**32, 1, 1), (2**63 + 1, 2, 1, 1),
                    (2**64 - 1,) * 4]


@pytest.mark.parametrize("tensor", ["tok_emb.w", "tok_emb.s"])     # i8, f32
@pytest.mark.parametrize("dims", OVERFLOWING_DIMS,
                         ids=["2^63*2^63", "2^32*2^32", "(2^63+1)*2", "(2^64-1)^4"])
def test_an_overflowing_size_runs_past_the_end_of_the_file(outcomes, tensor, dims):
    """§6.2: both readers report a tensor whose size overflows as its data running past the
    end of the file, naming the same tensor."""
    buf = set_entry(set_entry(valid_file("int8"), tensor, "ndim", 4), tensor, "dims", *dims)
    results = outcomes(buf)
    for kind, message in results:
        assert kind == "ModelFormatError", results
        assert "runs past the end of the file" in message, results
    assert len({subject(message) for _, message in results}) == 1, results


def f32_tensors(kind):
    return sorted(name for name in table(valid_file(kind))
                  if entry(valid_file(kind), name, "dtype")[0] == 1)


@given(data=st.data(), kind=st.sampled_from(RICH_KINDS),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, -0.0, 2.0,
                              3e38, 1e-45]))
def test_bad_values_in_every_f32_tensor(agree, data, kind, value):
    """One value of an f32 tensor (a scale, bias, gain or RoPE table) set to a value that some
    rule forbids (or none does): the same outcome, the same tensor named."""
    buf = valid_file(kind)
    name = data.draw(st.sampled_from(f32_tensors(kind)))
    (n0, n1, *_), ndim = entry(buf, name, "dims"), entry(buf, name, "ndim")[0]
    index = data.draw(st.integers(0, n0 * (n1 if ndim == 2 else 1) - 1))
    agree(set_value(buf, name, "<f", value, index))


META_NAMES = sorted(n for n in table(valid_file("hf")) if n.startswith("meta."))


def check_meta_text(outcomes, name, text):
    """Meta text `name` replaced by the bytes `text`: both readers accept it exactly when it
    is UTF-8, and otherwise give the same message, the offset of the first bad sequence
    included."""
    buf = valid_file("hf")
    mutated = rebuild(buf, drop=[name], extra=[(name, 3, (len(text),), text)])
    python, native = outcomes(mutated)
    assert native == python
    try:
        text.decode("utf-8")
        assert python == ("accepted", "")
    except UnicodeDecodeError as exc:
        assert python == ("ModelFormatError",
                          f"tensor '{name}': not valid UTF-8 (byte {exc.start})")


@given(name=st.sampled_from(META_NAMES), text=st.binary(min_size=1, max_size=40))
def test_meta_texts_of_any_bytes(outcomes, name, text):
    check_meta_text(outcomes, name, text)


@pytest.mark.parametrize("text", [
    # broken in each way the strict decoder refuses: truncated at the end after valid text,
    # overlong, a surrogate, above U+10FFFF, a bad continuation, a lone continuation, 0xff
    b"ok\xe2\x82", b"\xf0\x9f\x98", b"\xc3", b"a\xc0\x80", b"\xe0\x80\x80", b"\xf0\x80\x80\x80",
    b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x28\xa1", b"\x80", b"\xff", b"\xf5\x80\x80\x80",
    # valid: long, every sequence length, the edges around the surrogates and U+10FFFF, NUL
    *(t.encode("utf-8") for t in ("a" * 5000, "é✓😀" * 100, "\0", "\U0010ffff",
                                  "\ud7ff\ue000"))])
def test_meta_texts_at_the_edges_of_utf8(outcomes, text):
    check_meta_text(outcomes, "meta.tokenizer_json", text)


positions = st.one_of(st.integers(0, 256 + 96 * 40),               # header and table
                      st.integers(0, len(valid_file("int4")) - 1))  # anywhere


@given(kind=st.sampled_from(sorted(CONFIGS)),
       edits=st.lists(st.tuples(positions, st.integers(1, 255)), min_size=1, max_size=6),
       fix_checksum=st.booleans())
def test_flipped_bytes(agree, kind, edits, fix_checksum):
    """Bytes xor-ed anywhere; with the checksum fixed up, the edit reaches the later checks."""
    buf = bytearray(valid_file(kind))
    for at, mask in edits:
        buf[at % len(buf)] ^= mask
    agree(with_crc(buf) if fix_checksum else bytes(buf))


def test_v2_kinds_are_covered():
    """The kinds above exist and hold what they are here for (a guard against a silent change
    of test_modelfile's kinds)."""
    assert set(RICH_KINDS) <= set(V2_KINDS)
    names = set().union(*(table(valid_file(kind)) for kind in RICH_KINDS))
    for needed in ("pre.0.attn_qkv.b", "core.1.attn_post_norm", "core.adapter_state.w",
                   "core.step_norm", "coda.input_norm", "coda.0.ffn_down.s", "core.0.ffn_down.m",
                   "meta.tokenizer_json", "meta.architecture", "meta.tokenizer_config",
                   "stop_ids", "exit_gate.w", "exit_gate.s", "exit_gate.b"):
        assert needed in names, needed
    assert np.uint32(header(valid_file("v1-int8"), "version")) == 1
