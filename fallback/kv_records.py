"""The KV record (docs/spec.md §7.2): one (slot, position, kv head)'s `kq`, `vq` (R bytes each,
as the pool stores a row) then `sk`, `sv` (f32), 2R + 8 bytes with no padding. The prefix blob
(fallback/prefix_blob.py) and the spilled block file of the prefix cache's disk tier
(fallback/pcache_disk.py, §7.6) both hold arrays of them. Here: their dtype, the gather of a
slot's records out of its blocks (read with the kernel set's `to_host`), the value rules of §7.4
(which record breaks one first, and how; `rows_broken` and `first_of` serve a hidden-state
prefix's records too, fallback/hidden_prefix.py), and the write of records into a block
through the pool's `store` (so the numpy pool, the numba arena and numba-cuda's device arena
all work). Not here: the files' headers, layouts and checks.
"""
import numpy as np

KV_ARRAYS = ("kq", "vq", "sk", "sv")


def record_dtype(row_bytes):
    """One (slot, position, kv head) record: kq, vq (row_bytes each), sk, sv; no padding."""
    return np.dtype([("kq", "u1", (row_bytes,)), ("vq", "u1", (row_bytes,)),
                     ("sk", "<f4"), ("sv", "<f4")])


def row_bytes(config, kv_bits):
    return config.head_dim * kv_bits // 8


def gather(to_host, blocks, out):
    """Fill `out` ((count, G) records of one slot) with the first `count` positions of the
    consecutive `blocks`."""
    count = len(out)
    for name in KV_ARRAYS:
        rows = np.concatenate([to_host(getattr(b, name)) for b in blocks])[:count]
        out[name] = rows.view(np.uint8) if name in ("kq", "vq") else rows


def rows_broken(rows, int8):
    """rows: (..., r) uint8 -> (...) bool, whether each row breaks §7.4's rule on stored
    integers: an int8 value -128 (0x80), or (int8 False: Q4 packed two a byte) a -8 nibble."""
    return (rows == 0x80 if int8 else ((rows & 0x0F) == 0x08) | ((rows >> 4) == 0x08)).any(axis=-1)


def row_rule(int8):
    """rows_broken's rule in words."""
    return "holds -128" if int8 else "holds a -8 nibble"


def first_of(rules):
    """rules: in §7.4's order, (rule in words, or a function of a record's index giving them;
    bool array, one per record, set where the record breaks it). None when no record breaks
    one, else (index, words): the first record in order breaking any, and its first rule."""
    broken = np.logical_or.reduce([where for _, where in rules])
    if not broken.any():
        return None
    index = np.unravel_index(np.argmax(broken), broken.shape)
    words = next(words for words, where in rules if where[index])
    return index, words(index) if callable(words) else words


def first_broken(records, kv_bits):
    """None when every record holds §7.4's value rules; else (index, rule): the index (into
    `records`, any shape) of the first record in order breaking one, and the first rule it
    breaks (its kq, its vq, then the scales) in words."""
    int8 = kv_bits == 8

    def scale(what, name):
        return (lambda i: f"{what} scale {records[name][i]} (must be >= 0, not NaN)",
                ~(records[name] >= 0))

    return first_of([(f"key row {row_rule(int8)}", rows_broken(records["kq"], int8)),
                     (f"value row {row_rule(int8)}", rows_broken(records["vq"], int8)),
                     scale("key", "sk"), scale("value", "sv")])


def store(pool, block, rows, at):
    """Write `rows` ((k, G) records) to positions at .. at+k-1 of the new `block`, the
    block's other positions zeros, through the pool's `store` (an arena pool's lock: a growth
    racing the write on another thread cannot lose it)."""
    host = {"kq": np.zeros(pool.shape, pool.row_format.dtype),
            "vq": np.zeros(pool.shape, pool.row_format.dtype),
            "sk": np.zeros(pool.shape[:2], np.float32),
            "sv": np.zeros(pool.shape[:2], np.float32)}
    for name, arr in host.items():
        stored = arr.view(np.uint8) if name in ("kq", "vq") else arr
        stored[at:at + len(rows)] = rows[name]
    pool.store(block, 0, host["kq"], host["sk"], host["vq"], host["sv"])
