"""The two readers of a .tinyloop file agree: for every mutation of a valid file (each hostile
file of test_modelfile.py, every header field at its edge values, truncations, flipped bytes),
libtinyloop's loader (a native Model open) and the Python reader (tinyloop.modelfile.load_model)
both accept it, or both reject it with the same error type and a message about the same rule.

Native only: the C loader is one of the two readers.
"""
import re
import struct

import pytest
from hypothesis import given, strategies as st

import tinyloop
from tinyloop.modelfile import load_model

from test_modelfile import CONFIGS, HEADER, HOSTILE, header, patch, valid_file, with_crc

pytestmark = pytest.mark.usefixtures("require_native")

NATIVE_PREFIX = "bad model file: "        # libtinyloop's ModelFormatError messages start so


def subject(message):
    """The rule a reader's message is about: the words before its first ':', or else its first
    two words ("bad magic", "missing tensor")."""
    message = message.removeprefix(NATIVE_PREFIX)
    return message.split(":")[0] if ":" in message else " ".join(re.split(r"[\s,]+", message)[:2])


def outcome(open_file, path):
    try:
        open_file(path)
    except Exception as exc:            # the outcome is compared, whatever it is
        return type(exc).__name__, subject(str(exc))
    return "accepted", ""


def open_native(path):
    tinyloop.Model(path, backend="native", prefix_cache_bytes=0).close()


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    """agree(buf): asserts both readers give the same outcome for the file holding `buf`;
    returns it."""
    path = tmp_path_factory.mktemp("agree") / "m.tinyloop"

    def check(buf):
        path.write_bytes(buf)
        python, native = outcome(load_model, path), outcome(open_native, path)
        assert native == python, f"C reader: {native}, Python reader: {python}"
        return python
    return check


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_both_accept_every_valid_file(agree, kind):
    assert agree(valid_file(kind)) == ("accepted", "")


@pytest.mark.parametrize("kind, mutate", [pytest.param(case[1], case[2], id=case[0])
                                          for case in HOSTILE])
def test_both_reject_each_hostile_file_for_the_same_rule(agree, kind, mutate):
    assert agree(mutate(valid_file(kind)))[0] == "ModelFormatError"


EDGE_VALUES = (0, 1, 2, 255, 256, 2**16, 2**16 + 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31,
               2**32 - 1, 2**63, 2**64 - 1)


@pytest.mark.parametrize("field", sorted(set(HEADER) - {"magic", "name", "reserved"}))
@pytest.mark.parametrize("kind", ["int8", "int4-tied"])
def test_every_header_field_at_its_edges(agree, field, kind):
    """Each value at the edges of the field's width, the valid value +- 1 and its bit flips,
    with the checksum fixed up (checksum itself: left as written)."""
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


def test_truncations(agree):
    """Cut anywhere (through the header, table, gaps and data), as is and with file_bytes and
    the checksum fixed up to the shorter length."""
    buf = valid_file("int4")
    table_end = header(buf, "data_offset")
    cuts = {*range(0, 300, 7), *range(table_end - 100, table_end + 100, 3),
            *range(table_end, len(buf), 97), len(buf) - 1}
    for n in sorted(cuts):
        assert agree(buf[:n])[0] == "ModelFormatError"
        if n >= 256:
            assert agree(patch(buf[:n], 16, "<Q", n))[0] == "ModelFormatError"


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
