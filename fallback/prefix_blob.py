"""The prefix blob (docs/spec.md §7): a Python engine's prefix as bytes, and back.

`save(engine, prefix)` writes the blob of a fallback.engine.Prefix, the bytes libtinyloop's
tl_prefix_save writes for the same prefix: the header, the tokens, the loop states, every
cache slot's KV from `kv_start` (the first position of the first block a window kept) to the
last token as (slot, position, kv head) records, and a warm start's states. `load(engine,
blob)` checks a blob in the spec's order, every rule before anything is allocated, raising
PrefixFormatError naming the field of the first rule broken, and builds the prefix it was
saved from, paged into the engine's own block size. Block arrays are read with the kernel
set's `to_host` and written through the pool's `store`, so the numpy pool, the numba arena and
numba-cuda's device arena all work. Not here: the prefix's semantics
(fallback/engine.py) or the native engine's blob (libtinyloop's api/prefix_blob.c).
"""
import math
import struct
import zlib
from collections import namedtuple

import numpy as np

from tinyloop.errors import PrefixFormatError

MAGIC = b"TLPREFIX"
VERSION = 1
HEADER = struct.Struct("<8sIIQIIQIIIIQQIIII8s")
Header = namedtuple("Header", "magic version header_bytes blob_bytes checksum model_checksum "
                              "model_file_bytes kv_mode loops window flags n_tokens kv_start "
                              "n_layers n_kv_heads head_dim d_model reserved")
CHECKSUM_AT = 24
KV_MODE_CODES = {8: 0, 4: 1}              # pool.kv_bits -> the header's kv_mode
KV_MODE_NAMES = {0: "int8", 1: "int4"}
WARM_START, STATES = 1, 2                 # flags bits
MAX_LOOPS = 1024                          # the API's bound on loops (tinyloop.params)
MAX_LAYERS = 65536
KV_ARRAYS = ("kq", "vq", "sk", "sv")
assert HEADER.size == 96


def record_dtype(row_bytes):
    """One (slot, position, kv head) record: kq, vq (row_bytes each), sk, sv; no padding."""
    return np.dtype([("kq", "u1", (row_bytes,)), ("vq", "u1", (row_bytes,)),
                     ("sk", "<f4"), ("sv", "<f4")])


def _row_bytes(config, kv_bits):
    return config.head_dim * kv_bits // 8


def _checksum(blob):
    """CRC-32 of the blob with its checksum field read as zero."""
    mv = memoryview(blob)
    return zlib.crc32(mv[CHECKSUM_AT + 4:], zlib.crc32(bytes(4), zlib.crc32(mv[:CHECKSUM_AT])))


# ---- writer ------------------------------------------------------------------------------

def _kv_start(cache, n):
    """The first position stored: the start of the first block every slot keeps, or n when
    the window sees none of the prefix's positions (window 1, where libtinyloop releases the
    last, partial block too)."""
    if cache.window == 1:
        return n
    first = max(next((i for i, b in enumerate(blocks) if b is not None), len(blocks))
                for blocks in cache.layers)
    return first * cache.pool.block_size


def _records(engine, cache, n, kv_start):
    """The (n_layers, n - kv_start, G) records of positions kv_start .. n-1 of every slot."""
    to_host, bs = engine.kernels.to_host, cache.pool.block_size
    records = np.empty((cache.n_layers, n - kv_start, engine.config.n_kv_heads),
                       record_dtype(_row_bytes(engine.config, cache.pool.kv_bits)))
    if n == kv_start:
        return records
    for layer, blocks in zip(records, cache.layers):
        kept = blocks[kv_start // bs:]
        for name in KV_ARRAYS:
            rows = np.concatenate([to_host(getattr(b, name)) for b in kept])[:n - kv_start]
            layer[name] = rows.view(np.uint8) if name in ("kq", "vq") else rows
    return records


def save(engine, prefix):
    """The blob of `prefix` (its lock held by the caller), as bytes."""
    config, cache, n = engine.config, prefix.cache, len(prefix.tokens)
    kv_start = _kv_start(cache, n)
    flags = (WARM_START if prefix.warm_start else 0) | (STATES if prefix.states is not None else 0)
    loop_states = np.concatenate([engine.kernels.to_host(s) for s in prefix.loop_states])
    parts = [prefix.tokens.astype("<i4"), loop_states.astype("<f4"),
             _records(engine, cache, n, kv_start)]
    if prefix.states is not None:
        parts += [a.astype("<f4") for a in (prefix.states, prefix.injected) if a is not None]
    body = b"".join(part.tobytes() for part in parts)
    checksum, file_bytes = engine.model_identity
    header = Header(MAGIC, VERSION, HEADER.size, HEADER.size + len(body), 0, checksum,
                    file_bytes, KV_MODE_CODES[cache.pool.kv_bits], prefix.loops,
                    prefix.cache_window, flags, n, kv_start, cache.n_layers, config.n_kv_heads,
                    config.head_dim, config.d_model, bytes(8))
    blob = bytearray(HEADER.pack(*header) + body)
    struct.pack_into("<I", blob, CHECKSUM_AT, _checksum(blob))
    return bytes(blob)


# ---- reader ------------------------------------------------------------------------------

def _fail(message):
    raise PrefixFormatError(message)


def _check_header(engine, mv):
    """The header of blob `mv`, after every rule on it (size to ranges) holds."""
    config, size = engine.config, mv.nbytes
    if size < HEADER.size:
        _fail(f"blob too small: {size} bytes < {HEADER.size}-byte header")
    h = Header._make(HEADER.unpack_from(mv))
    if h.magic != MAGIC:
        _fail(f"bad magic {h.magic!r}, expected {MAGIC!r}")
    if h.version != VERSION:
        _fail(f"version: unsupported {h.version}, expected {VERSION}")
    if h.header_bytes != HEADER.size:
        _fail(f"header_bytes: must be {HEADER.size}, got {h.header_bytes}")
    if h.blob_bytes != size:
        _fail(f"blob_bytes: header says {h.blob_bytes}, blob has {size} bytes")
    crc = _checksum(mv)
    if crc != h.checksum:
        _fail(f"checksum mismatch: header 0x{h.checksum:08x}, computed 0x{crc:08x}")
    checksum, file_bytes = engine.model_identity
    if h.model_checksum != checksum:
        _fail(f"this prefix was saved from another model (checksum 0x{h.model_checksum:08x}, "
              f"this model 0x{checksum:08x})")
    if h.model_file_bytes != file_bytes:
        _fail(f"this prefix was saved from another model (file_bytes {h.model_file_bytes}, "
              f"this model {file_bytes})")
    mode = KV_MODE_CODES[engine.pool.kv_bits]
    if h.kv_mode != mode:
        saved = KV_MODE_NAMES.get(h.kv_mode, f"{h.kv_mode} (unknown)")
        _fail(f"kv_mode: this prefix was saved with kv_mode {saved}; this model runs "
              f"{KV_MODE_NAMES[mode]}")
    for field, want in (("n_kv_heads", config.n_kv_heads), ("head_dim", config.head_dim),
                        ("d_model", config.d_model)):
        if getattr(h, field) != want:
            _fail(f"{field}: {getattr(h, field)}, this model's is {want}")
    if not 1 <= h.loops <= MAX_LOOPS or config.n_layers(h.loops) > MAX_LAYERS:
        _fail(f"loops: {h.loops} out of range (1 .. {MAX_LOOPS}, with at most {MAX_LAYERS} "
              "cache slots)")
    if h.n_layers != config.n_layers(h.loops):
        _fail(f"n_layers: {h.n_layers}, but loops={h.loops} needs {config.n_layers(h.loops)}")
    if h.flags & ~(WARM_START | STATES):
        _fail(f"flags: unknown bits 0x{h.flags & ~(WARM_START | STATES):x}")
    if h.flags & STATES and not h.flags & WARM_START:
        _fail("flags: states present (bit 1) without warm start (bit 0)")
    n = h.n_tokens
    if not 1 <= n <= config.max_seq_len:
        _fail(f"n_tokens: {n} out of range (1 .. max_seq_len={config.max_seq_len})")
    if h.window == 0 and h.kv_start != 0:
        _fail(f"kv_start: {h.kv_start}, must be 0 with window 0")
    if h.kv_start > min(n, max(0, n - h.window + 1)):
        _fail(f"kv_start: {h.kv_start} past position {max(0, n - h.window + 1)}, the first "
              f"that window={h.window} still sees after {n} tokens")
    if any(h.reserved):
        _fail("reserved: bytes 88 .. 95 must be zero")
    want = _expected_size(config, h, engine.pool.kv_bits)
    if h.blob_bytes != want:
        _fail(f"blob_bytes: {h.blob_bytes}, but the header's fields describe {want} bytes")
    return h


def _expected_size(config, h, kv_bits):
    n, d = h.n_tokens, config.d_model
    record = record_dtype(_row_bytes(config, kv_bits)).itemsize
    kv = h.n_layers * (n - h.kv_start) * h.n_kv_heads * record
    states = 4 * n * d * (2 if config.injection else 1) if h.flags & STATES else 0
    return HEADER.size + 4 * n + 4 * h.loops * d + kv + states


def _sections(engine, mv, h):
    """(tokens, loop_states, records, states, injected) viewing the blob (None: absent)."""
    config, n, d = engine.config, h.n_tokens, engine.config.d_model
    dtype = record_dtype(_row_bytes(config, engine.pool.kv_bits))
    at = HEADER.size
    tokens = np.frombuffer(mv, "<i4", n, at)
    at += tokens.nbytes
    loop_states = np.frombuffer(mv, "<f4", h.loops * d, at).reshape(h.loops, d)
    at += loop_states.nbytes
    shape = (h.n_layers, n - h.kv_start, h.n_kv_heads)
    records = np.frombuffer(mv, dtype, math.prod(shape), at).reshape(shape)
    at += records.nbytes
    states = injected = None
    if h.flags & STATES:
        states = np.frombuffer(mv, "<f4", n * d, at).reshape(n, d)
        if config.injection:
            injected = np.frombuffer(mv, "<f4", n * d, at + states.nbytes).reshape(n, d)
    return tokens, loop_states, records, states, injected


def _where(h, index):
    slot, pos, g = (int(i) for i in index)
    return f"slot {slot}, position {h.kv_start + pos}, kv head {g}"


def _check_values(engine, h, tokens, records):
    """The tokens, then the records in blob order: the first record breaking a rule is named,
    with the first of its rules it breaks in §7.4's order (kq, vq, then the scales)."""
    vocab = engine.config.vocab_size
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        _fail(f"tokens: token {bad[0]} is {tokens[bad[0]]}, not in 0 .. {vocab - 1}")
    int8 = engine.pool.kv_bits == 8
    row_rule = "holds -128" if int8 else "holds a -8 nibble"

    def rule_broken(name, a):           # per record (slot, position, kv head)
        if name in ("sk", "sv"):
            return ~(a >= 0)
        return (a == 0x80 if int8 else ((a & 0x0F) == 0x08) | ((a >> 4) == 0x08)).any(axis=-1)

    broken = {name: rule_broken(name, records[name]) for name in KV_ARRAYS}
    any_broken = np.logical_or.reduce(list(broken.values()))
    if not any_broken.any():
        return
    index = np.unravel_index(np.argmax(any_broken), any_broken.shape)
    name = next(name for name in KV_ARRAYS if broken[name][index])
    what = "key" if name in ("kq", "sk") else "value"
    rule = (f"{what} row {row_rule}" if name in ("kq", "vq") else
            f"{what} scale {records[name][index]} (must be >= 0, not NaN)")
    _fail(f"kv: {_where(h, index)}: {rule}")


def _fill_cache(engine, cache, records, n, kv_start):
    """Page positions kv_start .. n-1 of every slot into new blocks of the engine's pool,
    written through the pool's `store` (an arena pool's lock: a growth racing the write on
    another thread cannot lose it); the positions before kv_start in the first block are
    zeros (never visible)."""
    pool = engine.pool
    bs = pool.block_size
    first, n_blocks = kv_start // bs, -(-n // bs)
    for layer, blocks in zip(records, cache.layers):
        blocks.extend([None] * first)
        for b in range(first, n_blocks):
            block = pool.new_block()
            blocks.append(block)
            lo, hi = max(b * bs, kv_start), min((b + 1) * bs, n)
            host = {"kq": np.zeros(pool.shape, pool.row_format.dtype),
                    "vq": np.zeros(pool.shape, pool.row_format.dtype),
                    "sk": np.zeros(pool.shape[:2], np.float32),
                    "sv": np.zeros(pool.shape[:2], np.float32)}
            for name, rows in host.items():
                stored = rows.view(np.uint8) if name in ("kq", "vq") else rows
                stored[lo - b * bs:hi - b * bs] = layer[name][lo - kv_start:hi - kv_start]
            pool.store(block, 0, host["kq"], host["sk"], host["vq"], host["sv"])
    cache.length = n
    cache.release_outside_window()


def load(engine, blob):
    """The fields of the fallback.engine.Prefix saved in `blob` (a contiguous buffer), after
    every rule of the blob holds: tokens, loops, cache_window, cache, loop_states, warm_start,
    states, injected (all the engine's own copies)."""
    mv = memoryview(blob).cast("B")
    h = _check_header(engine, mv)
    tokens, loop_states, records, states, injected = _sections(engine, mv, h)
    _check_values(engine, h, tokens, records)
    cache = engine.new_cache(h.loops, h.window)
    try:
        _fill_cache(engine, cache, records, h.n_tokens, h.kv_start)
    except BaseException:
        cache.free()
        raise
    table = engine.kernels.table
    return dict(tokens=tokens.astype(np.int32), loops=h.loops, cache_window=h.window,
                cache=cache, warm_start=bool(h.flags & WARM_START),
                loop_states=[table(loop_states[i:i + 1].astype(np.float32))
                             for i in range(h.loops)],
                states=None if states is None else states.astype(np.float32),
                injected=None if injected is None else injected.astype(np.float32))
