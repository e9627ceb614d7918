"""Paged int8 or int4 KV cache with reference-counted blocks (docs/spec.md §4.2).

A cache holds, per layer, a list of blocks of `block_size` positions; each block stores the
quantized keys and values of that many positions for every kv head, as the pool's KV mode
stores a row (kv_bits 8: Q8, D bytes; kv_bits 4: Q4, two values a byte, element 2i in the low
nibble, tinyloop.modelfile.pack_int4):
    kq, vq: (block_size, n_kv_heads, head_dim * kv_bits / 8) int8 (kv_bits 8) or uint8 (4);
    sk, sv: (block_size, n_kv_heads) float32.
Writes take rows already in that form (the kernel sets' split_heads); `KVCache.read` gives
them back as int8 values whatever the mode, so attention is one formula.
Blocks are shared between sequences by reference count. A full block is never written again,
so sharing it is free; a shared partial block is copied before its first write
(copy-on-write). Paging never changes a value: it is a memory layout, not a numerics choice.
"""
import threading
from typing import NamedTuple

import numpy as np

from tinyloop.modelfile import unpack_int4

KV_BITS = {"int8": 8, "int4": 4}     # bits a stored K or V value takes, by KV mode
KV_QMAX = {8: 127, 4: 7}             # the Q of a K or V row (spec §2.2), by kv_bits


class KVRowFormat(NamedTuple):
    """How a KV mode stores one K or V row of head_dim values."""
    qmax: int             # Q(x, qmax) of the row
    row_bytes: int        # head_dim * kv_bits / 8
    dtype: type           # int8 values, or uint8 bytes of two int4 values


def kv_row_format(head_dim, kv_bits):
    if kv_bits not in KV_QMAX:
        raise ValueError(f"kv_bits must be 8 or 4, got {kv_bits!r}")
    return KVRowFormat(KV_QMAX[kv_bits], head_dim * kv_bits // 8,
                       np.int8 if kv_bits == 8 else np.uint8)


class BlockPool:
    """Creates blocks of one geometry and KV mode (kv_bits 8 or 4) and counts the bytes they
    hold."""

    def __init__(self, block_size, n_kv_heads, head_dim, kv_bits=8):
        self.block_size = block_size
        self.kv_bits = kv_bits
        self.row_format = kv_row_format(head_dim, kv_bits)
        self.shape = (block_size, n_kv_heads, self.row_format.row_bytes)   # of kq and vq
        self.block_nbytes = 2 * block_size * n_kv_heads * (self.row_format.row_bytes + 4)
        self.bytes_in_use = 0
        self.n_blocks_created = 0
        # reentrant: a PrefixCache the garbage collector finalizes frees its blocks from
        # whatever code the collection interrupted, which may be this pool's own (under the lock)
        self._lock = threading.RLock()

    def new_block(self):
        block = KVBlock(self)
        with self._lock:
            self.bytes_in_use += self.block_nbytes
            self.n_blocks_created += 1
        return block

    def retain(self, block):
        with self._lock:
            block.refs += 1

    def release(self, block):
        with self._lock:
            block.refs -= 1
            if block.refs == 0:
                self.bytes_in_use -= self.block_nbytes

    def store(self, block, off, kq, sk, vq, sv):
        """Write positions off .. off+n-1 of `block` (n = len(kq))."""
        n = len(kq)
        block.kq[off:off + n] = kq
        block.sk[off:off + n] = sk
        block.vq[off:off + n] = vq
        block.sv[off:off + n] = sv


def host_rows(array):
    """A host numpy copy of block rows, wherever the pool keeps them."""
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.array(array)


class KVBlock:
    __slots__ = ("pool", "kq", "sk", "vq", "sv", "refs")

    def __init__(self, pool):
        self.pool = pool
        self.kq = np.zeros(pool.shape, pool.row_format.dtype)
        self.vq = np.zeros(pool.shape, pool.row_format.dtype)
        self.sk = np.zeros(pool.shape[:2], np.float32)
        self.sv = np.zeros(pool.shape[:2], np.float32)
        self.refs = 1

    def copy(self):
        twin = self.pool.new_block()
        for name in ("kq", "sk", "vq", "sv"):
            getattr(twin, name)[...] = getattr(self, name)
        return twin


def chunk_rows(pos, chunk, left, instruction):
    """The positions of the prefill chunk starting at position `pos`, asked for `chunk` of the
    `left` still to run (spec §4.2): the chunk holding position 0 holds the instruction block
    0 .. P-1 whole, growing past `chunk` when it must; never more than `left`."""
    return min(max(chunk, instruction) if pos == 0 else chunk, left)


def chunk_bounds(pos0, n, chunk, instruction):
    """(start, stop) of each chunk of n tokens fed at positions pos0.. in chunks of `chunk`."""
    bounds, start = [], 0
    while start < n:
        stop = start + chunk_rows(pos0 + start, chunk, n - start, instruction)
        bounds.append((start, stop))
        start = stop
    return bounds


class KVCache:
    """One sequence's cache: `n_layers` lists of blocks (None where a window released one),
    for a sequence with sliding window `window` (0: none) and instruction length
    `instruction` (spec §4.1; 0: causal)."""

    def __init__(self, pool, n_layers, window, instruction=0):
        self.pool = pool
        self.window = window
        self.instruction = instruction
        self.length = 0          # positions written in every layer
        self.layers = [[] for _ in range(n_layers)]

    @property
    def n_layers(self):
        return len(self.layers)

    def write(self, layer, pos0, kq, sk, vq, sv):
        """Store positions pos0 .. pos0+T-1 of one layer. kq, vq: (T, G, R) rows as the pool
        stores them (R bytes, int8 or packed int4); sk, sv: (T, G)."""
        blocks, bs = self.layers[layer], self.pool.block_size
        done = 0
        while done < len(kq):
            pos = pos0 + done
            b, off = divmod(pos, bs)
            if b == len(blocks):
                blocks.append(self.pool.new_block())
            elif blocks[b].refs > 1:            # shared partial block: copy before writing
                twin = blocks[b].copy()
                self.pool.release(blocks[b])
                blocks[b] = twin
            n = min(bs - off, len(kq) - done)
            part = slice(done, done + n)
            self.pool.store(blocks[b], off, kq[part], sk[part], vq[part], sv[part])
            done += n

    def copy_position(self, src, dst, pos):
        """Write position pos of layer `dst` with the rows layer `src` holds there, as stored
        (adaptive depth's last available KV, docs/spec.md §5.7)."""
        b, off = divmod(pos, self.pool.block_size)
        block = self.layers[src][b]
        rows = [host_rows(getattr(block, name)[off:off + 1]) for name in ("kq", "sk", "vq", "sv")]
        self.write(dst, pos, *rows)

    def read(self, layer, lo, hi):
        """Positions lo .. hi-1 of one layer as contiguous (kq, sk, vq, sv), kq and vq
        (hi - lo, G, D) int8 values in either KV mode."""
        bs = self.pool.block_size
        blocks = self.layers[layer][lo // bs:(hi - 1) // bs + 1]
        start = lo - (lo // bs) * bs
        kq, sk, vq, sv = (np.concatenate([getattr(b, name) for b in blocks])[start:start + hi - lo]
                          for name in ("kq", "sk", "vq", "sv"))
        if self.pool.kv_bits == 4:
            kq, vq = unpack_int4(kq), unpack_int4(vq)
        return kq, sk, vq, sv

    def release_outside_window(self):
        """Drop blocks whose positions are all <= length - window (never visible again)."""
        if self.window == 0:
            return
        bs = self.pool.block_size
        n_dead = max(0, self.length - self.window + 1) // bs
        for blocks in self.layers:
            for b in range(min(n_dead, len(blocks))):
                if blocks[b] is not None:
                    self.pool.release(blocks[b])
                    blocks[b] = None

    def truncate(self, length):
        """Commit positions < length: every layer drops its blocks past them (references
        only, nothing copied), whatever was written there (a speculative round writes past
        self.length before it commits), and length becomes the cache's length. A kept partial
        block keeps stale positions past `length`, written again before anything reads them."""
        n_kept = -(-length // self.pool.block_size)
        for blocks in self.layers:
            for blk in blocks[n_kept:]:
                if blk is not None:
                    self.pool.release(blk)
            del blocks[n_kept:]
        self.length = length

    def fork(self, n_layers):
        """A new cache sharing the first n_layers layers' blocks (no copies)."""
        twin = KVCache(self.pool, n_layers, self.window, self.instruction)
        twin.length = self.length
        for mine, theirs in zip(twin.layers, self.layers[:n_layers]):
            for blk in theirs:
                if blk is not None:
                    self.pool.retain(blk)
                mine.append(blk)
        return twin

    def free(self):
        for blocks in self.layers:
            for blk in blocks:
                if blk is not None:
                    self.pool.release(blk)
        self.layers = []

    @property
    def nbytes(self):
        return self.pool.block_nbytes * sum(b is not None for blocks in self.layers for b in blocks)
