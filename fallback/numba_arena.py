"""A KV block pool whose blocks are rows of one arena, for the numba backends (spec §4.2).

`ArenaBlockPool` is the numpy backend's BlockPool with every block stored as one row of four
arena arrays: kq, vq (n_rows, block_size, G, R) as the pool's KV mode stores a row (R = D
int8, or R = D/2 uint8 packed int4, kvcache.py) and sk, sv (n_rows, block_size, G) float32.
The KV cache's paging, sharing and copy-on-write are unchanged (fallback/kvcache.py writes
through `store`); attention kernels read the keys in place through a block table of
arena rows instead of gathering them (an int4 arena's visible rows: numba_cpu unpacks them
first, numba_cuda reads their nibbles in place). The arena doubles when full (into new arrays); freed rows
are reused. Growing, writing and copying a block all hold the pool's lock, so a write racing a
growth on another thread cannot land in the arena being replaced and be lost; a reader may keep
an old arena, which still holds every row written before it was replaced (its own sequence's
rows, and the full, immutable blocks it shares). numba_cuda.DeviceBlockPool keeps the same arena
in device memory.
"""
import numpy as np

from .kvcache import BlockPool, KVBlock

ARRAYS = ("kq", "sk", "vq", "sv")


def _view(name):
    return property(lambda block: block.pool.arena[name][block.index])


class ArenaBlock(KVBlock):
    """A KV block whose arrays are views of row `index` of its pool's arena."""
    __slots__ = ("index",)

    def __init__(self, pool, index):
        self.pool, self.index, self.refs = pool, index, 1

    kq, sk, vq, sv = (_view(name) for name in ARRAYS)

    def copy(self):
        twin = self.pool.new_block()
        with self.pool._lock:
            for name in ARRAYS:
                self.pool.copy_into(getattr(twin, name), getattr(self, name))
        return twin


class ArenaBlockPool(BlockPool):
    """BlockPool of ArenaBlocks in host memory; subclasses place the arena elsewhere."""
    initial_rows = 4

    def __init__(self, block_size, n_kv_heads, head_dim, kv_bits=8):
        super().__init__(block_size, n_kv_heads, head_dim, kv_bits)
        self.arena = {}
        self.free_rows = []
        self._grow(self.initial_rows)

    # -- where the arena lives ----------------------------------------------------------------
    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def copy_into(dst, src):
        dst[...] = src

    @staticmethod
    def place_table(rows):
        return rows

    # -- blocks -------------------------------------------------------------------------------
    def _grow(self, n_rows):
        old = self.arena
        n_old = len(old["kq"]) if old else 0
        row_type = self.row_format.dtype
        shapes = {"kq": (self.shape, row_type), "vq": (self.shape, row_type),
                  "sk": (self.shape[:2], np.float32), "sv": (self.shape[:2], np.float32)}
        self.arena = {name: self.empty((n_rows,) + shape, dtype)
                      for name, (shape, dtype) in shapes.items()}
        for name, array in old.items():
            self.copy_into(self.arena[name][:n_old], array)
        self.free_rows.extend(range(n_rows - 1, n_old - 1, -1))

    def new_block(self):
        with self._lock:
            if not self.free_rows:
                self._grow(2 * len(self.arena["kq"]))
            block = ArenaBlock(self, self.free_rows.pop())
            self.bytes_in_use += self.block_nbytes
            self.n_blocks_created += 1
        return block

    def release(self, block):
        super().release(block)
        if block.refs == 0:
            with self._lock:
                self.free_rows.append(block.index)

    def store(self, block, off, kq, sk, vq, sv):
        with self._lock:                 # not into an arena a growing thread is replacing
            super().store(block, off, kq, sk, vq, sv)

    def block_table(self, cache, layer, lo, hi):
        """(rows, shift): the arena rows of the blocks holding positions lo .. hi-1 of one
        cache layer. Position j is in row rows[(j - shift) // block_size], at offset
        (j - shift) % block_size."""
        bs = self.block_size
        blocks = cache.layers[layer][lo // bs:(hi - 1) // bs + 1]
        rows = np.array([block.index for block in blocks], np.int32)
        return self.place_table(rows), (lo // bs) * bs
