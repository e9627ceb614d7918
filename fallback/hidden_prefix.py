"""Hidden-state prefixes (docs/spec.md §5.4.1): a prefix that keeps each layer's input row
instead of its KV, and rebuilds the KV from the rows when a sequence starts from it.

`check_storage` is the refusal of an h build (with the reason); `recorder(rows, kernels, eps)`
is the `capture` a build's pass hands every layer's input to (fallback/forward.py), filling a
`HiddenRows`: h8 keeps the NQ (q, a) the layer's attn_qkv read, h4 the Q4 of the row and the
scale §2.3 steps 2-4 give it. `rebuild` gives a sequence at depth L a cache of its own whose
slots depth L reads hold the KV of every stored position, computed from the rows as the pass
computes it (forward.write_kv). Rows live in host memory on every backend; the kernel set
places each chunk (`table`) and reads rows back (`to_host`), so numba-cuda works too.
Not here: the prefix itself (fallback/engine.py) or its blob (fallback/prefix_blob.py).
"""
from dataclasses import dataclass

import numpy as np

from tinyloop.engine import check_prefix_storage
from tinyloop.modelfile import pack_int4, unpack_int4

from . import kv_records
from .forward import write_kv
from .kvcache import kv_row_format
from .numerics import quantize_rows, root_mean_square


def h_start(n, window):
    """The first stored position: the first the next token of an n-token prefix sees."""
    return 0 if window == 0 else max(0, n - window + 1)


def row_bytes(storage, d):
    """Bytes of one stored row's q: d (h8) or d/2 (h4, packed two a byte)."""
    return d if storage == "h8" else d // 2


def check_storage(config, kv_bits, storage, warm_start):
    """ValueError naming the reason when a prefix of `storage` cannot be built: an unknown
    name, an h prefix with warm start, an h4 row of an odd d_model, an h8 row of a model with
    block activations (§5.4.1), or rows that would take as many bytes as the KV they replace
    (per slot and position: r + 4 against 2G(R + 4))."""
    if check_prefix_storage(storage, warm_start=warm_start) == "kv":
        return
    d, G, D = config.d_model, config.n_kv_heads, config.head_dim
    if storage == "h4" and d % 2:
        raise ValueError(f"h4 prefixes need an even d_model, this model's is {d}: use h8 or kv")
    if storage == "h8" and config.act_block:
        raise ValueError("h8 prefixes need one activation scale per row (act_block 0), this "
                         f"model's act_block is {config.act_block}: use h4 or kv")
    rows, kv = row_bytes(storage, d) + 4, 2 * G * (kv_row_format(D, kv_bits).row_bytes + 4)
    if rows >= kv:
        raise ValueError(f"{storage} prefixes take {rows} bytes per layer and position, the KV "
                         f"{kv} ({G} kv heads of {D}): use the kv storage")


@dataclass
class HiddenRows:
    """The stored rows of an h prefix: positions start .. start + q.shape[1] - 1 of every
    cache slot (n_layers(L_b) of them, every depth's coda slots included).
        q: (n_layers, n - start, r) int8 (h8: r = d) or uint8 (h4: r = d/2, Q4 packed);
        a: (n_layers, n - start) float32, the matmul input scale."""
    storage: str
    start: int
    q: np.ndarray
    a: np.ndarray

    @classmethod
    def empty(cls, storage, n_layers, d, n, window):
        start = h_start(n, window)
        q = np.zeros((n_layers, n - start, row_bytes(storage, d)),
                     np.int8 if storage == "h8" else np.uint8)
        return cls(storage, start, q, np.zeros((n_layers, n - start), np.float32))

    @property
    def nbytes(self):
        return self.q.nbytes + self.a.nbytes


def h4_row(x, eps):
    """x: (T, d) f32 layer inputs -> (q (T, d/2) uint8, Q4 packed; a (T,) f32): (q, s) =
    Q4(x), then a = s / t with §2.3's t of those integers."""
    q, s = quantize_rows(x, 7)
    return pack_int4(q), s / root_mean_square(q, s, eps)


def recorder(rows, kernels, eps):
    """The build's capture(slot, pos0, x, q, a): x (T, d) a layer's input at positions pos0 ..
    pos0+T-1 and (q, a) = NQ(x), in the kernel set's arrays; keeps positions >= rows.start."""
    def record(slot, pos0, x, q, a):
        lo, hi = max(pos0, rows.start), pos0 + x.shape[0]
        if lo >= hi:
            return
        mine, theirs = slice(lo - rows.start, hi - rows.start), slice(lo - pos0, hi - pos0)
        if rows.storage == "h8":
            q, a = kernels.to_host(q)[theirs], kernels.to_host(a)[theirs]
        else:
            q, a = h4_row(kernels.to_host(x)[theirs], eps)
        rows.q[slot, mine], rows.a[slot, mine] = q, a
    return record


def read_slots(config, weights, loops):
    """(slot, block weights) of every slot a sequence at depth `loops` reads: the prelude's,
    the core's of iterations 0 .. loops-1, the coda's of depth `loops`."""
    yield from enumerate(weights.pre_blocks)
    for i in range(loops):
        for j, block in enumerate(weights.core_applied):
            yield config.core_slot(i, j), block
    for c, block in enumerate(weights.coda_blocks):
        yield config.coda_slot(loops, c), block


def rebuild(engine, rows, loops, window, chunk, instruction):
    """A new cache at depth `loops` (window, instruction length) holding the prefix's positions
    0 .. n-1: in every slot depth `loops` reads, the KV of positions rows.start .. n-1 from the
    rows, `chunk` positions a pass; the blocks before rows.start (never visible) are not kept."""
    k, w, n = engine.kernels, engine.weights, rows.start + rows.q.shape[1]
    cache = engine.new_cache(loops, window, instruction)
    try:
        for slot, block in read_slots(engine.config, w, loops):
            cache.layers[slot].extend([None] * (rows.start // cache.pool.block_size))
            for lo in range(rows.start, n, chunk):
                part = slice(lo - rows.start, min(lo + chunk, n) - rows.start)
                q = rows.q[slot, part]
                q = unpack_int4(q) if rows.storage == "h4" else q
                write_kv(k, w, block, cache, slot, k.table(q), k.table(rows.a[slot, part]), lo)
        cache.length = n
        cache.release_outside_window()
    except BaseException:
        cache.free()
        raise
    return cache


# ---- the rows as the prefix blob's records (docs/spec.md §7.2, version 2) ---------------------

def record_dtype(r):
    """One (slot, position) record: q (r bytes: row_bytes), then a (f32); no padding."""
    return np.dtype([("q", "u1", (r,)), ("a", "<f4")])


def to_records(rows):
    """(n_layers, n - start) records of the rows, in blob order."""
    records = np.empty(rows.a.shape, record_dtype(rows.q.shape[2]))
    records["q"], records["a"] = rows.q.view(np.uint8), rows.a
    return records


def from_records(storage, start, records):
    """HiddenRows (own copies) of (n_layers, n - start) records."""
    q = records["q"].astype(np.uint8)
    return HiddenRows(storage, start, q.view(np.int8) if storage == "h8" else q,
                      records["a"].astype(np.float32))


def first_broken(records, storage):
    """None when every record holds §7.4's rules (q never -128, h8, or -8, h4; a not
    negative: NaN and +inf pass); else (index, rule): the first record in order breaking one
    and the first rule it breaks (q, then a) in words."""
    h8, a = storage == "h8", records["a"]
    return kv_records.first_of([(f"row {kv_records.row_rule(h8)}",
                                 kv_records.rows_broken(records["q"], h8)),
                                (lambda i: f"scale {a[i]} is negative", a < 0)])
