"""The readers-agree check on what the fuzzers produce: for every input a libFuzzer target ran
(its grown corpus), libtinyloop's reader and TinyLoop's Python reader of that format accept it
both, or refuse it both with a message about the same rule (the words before the first ':',
indices dropped, or else the first two words: docs/testing.md, "Fuzzing").

The C side's verdicts come from the harness itself (TINYLOOP_FUZZ_VERDICTS, fuzz_util.h), one
line per input in the order of the file arguments; the Python side reads each input sealed as
the harness seals it (size field at 16, CRC-32 at 24) with the same model:
  model_file   tinyloop.modelfile.decode_model
  prefix_blob  the numpy engine's Model.prefix_from_bytes, into the harness's model
               (corpus/prefix_blob_model.tinyloop), KV mode by the blob's kv_mode field
  block_file   the numpy disk tier's DiskTier.parse for the harness's tier model
               (fuzz_block_model), then the place the file claims (block size, salt)
usage: python readers_agree.py TARGET VERDICTS FILE ...   (run_fuzz.sh runs it)
"""
import os
import re
import struct
import sys
import tempfile
from types import SimpleNamespace

from tinyloop.modelfile import checksum, decode_model

BLOB_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                          "prefix_blob_model.tinyloop")
PREFIXES = ("bad model file: ", "bad prefix blob: ", "bad spilled block file: ")
BLOCK_MODEL = {"checksum": 0x5EED1E55, "file_bytes": 6000, "block_size": 8,
               "config": SimpleNamespace(n_kv_heads=2, head_dim=12, max_seq_len=64, vocab_size=97)}


def sealed(data):
    """The bytes as the harness reads them (fuzz_sealed_copy)."""
    buf = bytearray(data)
    if len(buf) >= 24:
        struct.pack_into("<Q", buf, 16, len(buf))
    if len(buf) >= 28:
        struct.pack_into("<I", buf, 24, 0)
        struct.pack_into("<I", buf, 24, checksum(buf))
    return bytes(buf)


def subject(message):
    """The rule a message is about."""
    for prefix in PREFIXES:
        message = message.removeprefix(prefix)
    words = message.split(":")[0] if ":" in message else " ".join(re.split(r"[\s,]+", message)[:2])
    return re.sub(r"\[\d+\]", "", words)


# Each target's reader: (read(buf), the exceptions that are its refusals).

def model_file_reader():
    def read(buf):
        decode_model(buf)
    return read, (ValueError,)


def prefix_blob_reader():
    import tinyloop
    from tinyloop.errors import PrefixFormatError
    models = {mode: tinyloop.Model(BLOB_MODEL, backend="numpy", kv_mode=mode,
                                   block_size=4) for mode in ("int8", "int4")}

    def read(buf):
        int4 = len(buf) >= 44 and struct.unpack_from("<I", buf, 40)[0] == 1
        models["int4" if int4 else "int8"].prefix_from_bytes(buf)
    return read, (PrefixFormatError,)


def block_file_reader():
    from tinyloop.fallback.pcache_disk import BlockFileError, DiskTier
    directory = tempfile.mkdtemp(prefix="tinyloop-agree-")
    tiers = {bits: DiskTier(directory, 0, BLOCK_MODEL["config"],
                            SimpleNamespace(kv_bits=bits, block_size=BLOCK_MODEL["block_size"]),
                            None, (BLOCK_MODEL["checksum"], BLOCK_MODEL["file_bytes"]))
             for bits in (8, 4)}

    def read(buf):
        int4 = len(buf) >= 44 and struct.unpack_from("<I", buf, 40)[0] == 1
        h, salt, _tokens, _records = tiers[4 if int4 else 8].parse(buf)
        if h.block_size != BLOCK_MODEL["block_size"]:       # the place the file claims
            raise BlockFileError(f"block_size: {h.block_size}, this model's "
                                 f"{BLOCK_MODEL['block_size']}")
        if b"\0" in salt:                                   # a C string ends at its first NUL
            raise BlockFileError("salt: not the request's")
    return read, (BlockFileError,)


READERS = {"model_file": model_file_reader, "prefix_blob": prefix_blob_reader,
           "block_file": block_file_reader}


def main(target, verdicts, files):
    with open(verdicts, encoding="utf-8", errors="replace") as f:
        native = [line.rstrip("\n") for line in f]
    if len(native) != len(files):
        sys.exit(f"{target}: {len(native)} verdicts for {len(files)} inputs")
    read, refusals = READERS[target]()
    disagree = []
    for path, c_verdict in zip(files, native):
        with open(path, "rb") as f:
            buf = sealed(f.read())
        try:
            read(buf)
            python = "accepted"
        except refusals as exc:
            python = str(exc)
        c_rule = "accepted" if c_verdict == "accepted" else subject(c_verdict)
        python_rule = "accepted" if python == "accepted" else subject(python)
        if c_rule != python_rule:
            disagree.append(f"{path}: C {c_verdict!r}, Python {python!r}")
    accepted = sum(v == "accepted" for v in native)
    print(f"{target}: the readers agree on {len(files) - len(disagree)} of {len(files)} inputs "
          f"({accepted} accepted by C)")
    for line in disagree[:20]:
        print("  disagree:", line)
    return 1 if disagree else 0


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in READERS:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
