"""The prefix blob (docs/spec.md §7): a Python engine's prefix as bytes, and back.

`save(engine, prefix)` writes the blob of a fallback.engine.Prefix, the bytes libtinyloop's
tl_prefix_save writes for the same prefix: the header, the tokens, the loop states, every
cache slot's KV from `kv_start` (the first position of the first block a window kept) to the
last token as (slot, position, kv head) records, and a warm start's states; a hidden-state
prefix (§5.4.1) as version 2, its rows from `kv_start = h_start` as (slot, position) records
(fallback/hidden_prefix.py) in place of the KV. `load(engine,
blob)` checks a blob in the spec's order, every rule before anything is allocated, raising
PrefixFormatError naming the field of the first rule broken, and builds the prefix it was
saved from, paged into the engine's own block size. Block arrays are read with the kernel
set's `to_host` and written through the pool's `store`, so the numpy pool, the numba arena and
numba-cuda's device arena all work. Not here: the prefix's semantics
(fallback/engine.py) or the native engine's blob (libtinyloop's api/prefix_blob.c).
"""
import math
import struct
from collections import namedtuple

import numpy as np

from tinyloop.errors import PrefixFormatError
from tinyloop.modelfile import CHECKSUM_AT, checksum

from . import hidden_prefix, kv_records
from .kv_records import record_dtype, row_bytes

MAGIC = b"TLPREFIX"
VERSIONS = (1, 2)                         # 1: a kv prefix, 2: an h prefix
HEADER = struct.Struct("<8sIIQIIQIIIIQQIIIIII")
Header = namedtuple("Header", "magic version header_bytes blob_bytes checksum model_checksum "
                              "model_file_bytes kv_mode loops window flags n_tokens kv_start "
                              "n_layers n_kv_heads head_dim d_model storage instruction")
KV_MODE_CODES = {8: 0, 4: 1}              # pool.kv_bits -> the header's kv_mode
KV_MODE_NAMES = {0: "int8", 1: "int4"}
WARM_START, STATES = 1, 2                 # flags bits
STORAGE_CODES = {"kv": 0, "h8": 1, "h4": 2}   # the header's storage (version 2: h8, h4)
STORAGE_NAMES = {code: name for name, code in STORAGE_CODES.items()}
MAX_LOOPS = 1024                          # the API's bound on loops (tinyloop.params)
MAX_LAYERS = 65536
assert HEADER.size == 96


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
    bs = cache.pool.block_size
    records = np.empty((cache.n_layers, n - kv_start, engine.config.n_kv_heads),
                       record_dtype(row_bytes(engine.config, cache.pool.kv_bits)))
    if n == kv_start:
        return records
    for layer, blocks in zip(records, cache.layers):
        kv_records.gather(engine.kernels.to_host, blocks[kv_start // bs:], layer)
    return records


def save(engine, prefix):
    """The blob of `prefix` (its lock held by the caller), as bytes."""
    config, n, rows = engine.config, len(prefix.tokens), prefix.hidden
    if rows is None:
        kv_start = _kv_start(prefix.cache, n)
        records = _records(engine, prefix.cache, n, kv_start)
    else:
        kv_start, records = rows.start, hidden_prefix.to_records(rows)
    flags = (WARM_START if prefix.warm_start else 0) | (STATES if prefix.states is not None else 0)
    loop_states = np.concatenate([engine.kernels.to_host(s) for s in prefix.loop_states])
    parts = [prefix.tokens.astype("<i4"), loop_states.astype("<f4"), records]
    if prefix.states is not None:
        parts += [a.astype("<f4") for a in (prefix.states, prefix.injected) if a is not None]
    body = b"".join(part.tobytes() for part in parts)
    model_checksum, file_bytes = engine.model_identity
    header = Header(MAGIC, 1 if rows is None else 2, HEADER.size, HEADER.size + len(body), 0,
                    model_checksum, file_bytes, KV_MODE_CODES[engine.pool.kv_bits], prefix.loops,
                    prefix.cache_window, flags, n, kv_start, config.n_layers(prefix.loops),
                    config.n_kv_heads, config.head_dim, config.d_model,
                    STORAGE_CODES[prefix.storage], prefix.instruction)
    blob = bytearray(HEADER.pack(*header) + body)
    struct.pack_into("<I", blob, CHECKSUM_AT, checksum(blob))
    return bytes(blob)


# ---- reader ------------------------------------------------------------------------------

def _fail(message):
    raise PrefixFormatError(message)


def _check_header(engine, mv):
    """The header of blob `mv`, after every rule on it (size to ranges) holds."""
    config, size = engine.config, mv.nbytes
    if size < HEADER.size:
        _fail(f"too small: {size} bytes < the {HEADER.size}-byte header")
    h = Header._make(HEADER.unpack_from(mv))
    if h.magic != MAGIC:
        _fail(f"bad magic {h.magic.hex()}, expected {MAGIC!r}")
    if h.version not in VERSIONS:
        _fail(f"version: unsupported {h.version}, expected 1 or 2")
    if h.header_bytes != HEADER.size:
        _fail(f"header_bytes: must be {HEADER.size}, got {h.header_bytes}")
    if h.blob_bytes != size:
        _fail(f"blob_bytes: header says {h.blob_bytes}, blob has {size} bytes")
    crc = checksum(mv)
    if crc != h.checksum:
        _fail(f"checksum mismatch: header 0x{h.checksum:08x}, computed 0x{crc:08x}")
    model_checksum, file_bytes = engine.model_identity
    if h.model_checksum != model_checksum:
        _fail(f"this prefix was saved from another model (checksum 0x{h.model_checksum:08x}, "
              f"this model 0x{model_checksum:08x})")
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
    if h.version == 2 and h.flags:
        _fail(f"flags: 0x{h.flags:x}, an h prefix (version 2) has no warm start or states")
    n = h.n_tokens
    if not 1 <= n <= config.max_seq_len:
        _fail(f"n_tokens: {n} out of range (1 .. max_seq_len={config.max_seq_len})")
    if h.window == 0 and h.kv_start != 0:
        _fail(f"kv_start: {h.kv_start}, must be 0 with window 0")
    if h.kv_start > min(n, max(0, n - h.window + 1)):
        _fail(f"kv_start: {h.kv_start} past position {max(0, n - h.window + 1)}, the first "
              f"that window={h.window} still sees after {n} tokens")
    if h.version == 2 and h.kv_start != hidden_prefix.h_start(n, h.window):
        _fail(f"kv_start: {h.kv_start}, but an h prefix stores from position "
              f"{hidden_prefix.h_start(n, h.window)} (window={h.window}, {n} tokens)")
    if h.instruction > n:
        _fail(f"instruction: {h.instruction} exceeds the prefix's {n} tokens")
    if h.version == 1 and h.storage:
        _fail(f"storage: {h.storage}, must be 0 (kv) in a version-1 blob")
    if h.version == 2:
        _check_storage(config, h)
    want = _expected_size(config, h, engine.pool.kv_bits)
    if h.blob_bytes != want:
        _fail(f"blob_bytes: {h.blob_bytes}, but the header's fields describe {want} bytes")
    return h


def _check_storage(config, h):
    """A version 2 blob's storage: 1 h8, 2 h4 (h4 only of an even d_model)."""
    if h.storage not in (1, 2):
        _fail(f"storage: unknown {h.storage} (1 = h8, 2 = h4)")
    if h.storage == 2 and config.d_model % 2:
        _fail(f"storage: h4 needs an even d_model, this model's is {config.d_model}")


def _record_dtype(config, h, kv_bits):
    """The dtype of the blob's records: (slot, position, kv head) KV, or (slot, position) rows."""
    if h.version == 1:
        return record_dtype(row_bytes(config, kv_bits))
    return hidden_prefix.record_dtype(hidden_prefix.row_bytes(STORAGE_NAMES[h.storage],
                                                              config.d_model))


def _expected_size(config, h, kv_bits):
    n, d = h.n_tokens, config.d_model
    heads = h.n_kv_heads if h.version == 1 else 1          # records per (slot, position)
    kv = h.n_layers * (n - h.kv_start) * heads * _record_dtype(config, h, kv_bits).itemsize
    states = 4 * n * d * (2 if config.carries_injected else 1) if h.flags & STATES else 0
    return HEADER.size + 4 * n + 4 * h.loops * d + kv + states


def _sections(engine, mv, h):
    """(tokens, loop_states, records, states, injected) viewing the blob (None: absent)."""
    config, n, d = engine.config, h.n_tokens, engine.config.d_model
    dtype = _record_dtype(config, h, engine.pool.kv_bits)
    at = HEADER.size
    tokens = np.frombuffer(mv, "<i4", n, at)
    at += tokens.nbytes
    loop_states = np.frombuffer(mv, "<f4", h.loops * d, at).reshape(h.loops, d)
    at += loop_states.nbytes
    shape = (h.n_layers, n - h.kv_start) + ((h.n_kv_heads,) if h.version == 1 else ())
    records = np.frombuffer(mv, dtype, math.prod(shape), at).reshape(shape)
    at += records.nbytes
    states = injected = None
    if h.flags & STATES:
        states = np.frombuffer(mv, "<f4", n * d, at).reshape(n, d)
        if config.carries_injected:
            injected = np.frombuffer(mv, "<f4", n * d, at + states.nbytes).reshape(n, d)
    return tokens, loop_states, records, states, injected


def _where(h, index):
    slot, pos, *g = (int(i) for i in index)
    return f"slot {slot}, position {h.kv_start + pos}" + (f", kv head {g[0]}" if g else "")


def _check_values(engine, h, tokens, records):
    """The tokens, then the records in blob order: the first record breaking a rule is named,
    with the first of its rules it breaks in §7.4's order (kq, vq, then the scales; an h
    prefix's q, then a)."""
    vocab = engine.config.vocab_size
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        _fail(f"tokens: token {bad[0]} is {tokens[bad[0]]}, not in 0 .. {vocab - 1}")
    if h.version == 1:
        broken, field = kv_records.first_broken(records, engine.pool.kv_bits), "kv"
    else:
        broken = hidden_prefix.first_broken(records, STORAGE_NAMES[h.storage])
        field = "hidden"
    if broken is not None:
        index, rule = broken
        _fail(f"{field}: {_where(h, index)}: {rule}")


def _fill_cache(engine, cache, records, n, kv_start):
    """Page positions kv_start .. n-1 of every slot into new blocks of the engine's pool; the
    positions before kv_start in the first block are zeros (never visible)."""
    pool = engine.pool
    bs = pool.block_size
    first, n_blocks = kv_start // bs, -(-n // bs)
    for layer, blocks in zip(records, cache.layers):
        blocks.extend([None] * first)
        for b in range(first, n_blocks):
            block = pool.new_block()
            blocks.append(block)
            lo, hi = max(b * bs, kv_start), min((b + 1) * bs, n)
            kv_records.store(pool, block, layer[lo - kv_start:hi - kv_start], lo - b * bs)
    cache.length = n
    cache.release_outside_window()


def load(engine, blob):
    """The fields of the fallback.engine.Prefix saved in `blob` (a contiguous buffer), after
    every rule of the blob holds: tokens, loops, cache_window, instruction, cache, loop_states, warm_start,
    states, injected, hidden (all the engine's own copies; an h prefix: cache None and its
    rows in hidden)."""
    mv = memoryview(blob).cast("B")
    h = _check_header(engine, mv)
    tokens, loop_states, records, states, injected = _sections(engine, mv, h)
    _check_values(engine, h, tokens, records)
    cache = hidden = None
    if h.version == 2:
        hidden = hidden_prefix.from_records(STORAGE_NAMES[h.storage], h.kv_start, records)
    else:
        cache = engine.new_cache(h.loops, h.window, h.instruction)
        try:
            _fill_cache(engine, cache, records, h.n_tokens, h.kv_start)
        except BaseException:
            cache.free()
            raise
    table = engine.kernels.table
    return dict(tokens=tokens.astype(np.int32), loops=h.loops, cache_window=h.window,
                instruction=h.instruction, cache=cache, hidden=hidden, warm_start=bool(h.flags & WARM_START),
                loop_states=[table(loop_states[i:i + 1].astype(np.float32))
                             for i in range(h.loops)],
                states=None if states is None else states.astype(np.float32),
                injected=None if injected is None else injected.astype(np.float32))
