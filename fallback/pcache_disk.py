"""The disk tier of the automatic prefix cache (docs/spec.md §4.3.1) for the Python engine:
one file per block in a directory, named `<key>.tlblock` and laid out as §7.6, the bytes
libtinyloop's tier writes for the same block, so that each reads the other's files.

`DiskTier.spill(tree, tokens, blocks)` writes a block of the tree `tree` (the prefix cache's
key: (salt, window, instruction) or (salt, window, instruction, depth), fallback/engine.py's
Engine._tree) whose chain of
tokens from position 0 is `tokens`, `blocks[slot]` its KV blocks (None for a slot its requests
never write: the coda slots of other depths, stored as zero records). `DiskTier.read(name,
tree, tokens, i, need)` gives back the blocks of block `i` of `tokens` from file `name` (one of
`names(tree, tokens)`), new blocks of the engine's pool, or None: a missing, unreadable or
invalid file, or one that does not serve `need` layers, is a miss, never an error (its body
is read only when the header's sizes are the file's and the request's block's). Blocks are
read with the kernel set's `to_host` and written through the pool's `store`
(fallback/kv_records.py), so every Python backend's pool works.

The index: the tier's files, those found at open (every regular *.tlblock, oldest modification
time first, ties by name) and those read or written since, least recently used first, with
their sizes; a write first removes its least recently used files until the new one fits under
the byte budget (0: no limit), and goes to a temporary file renamed over the name (open
removes the temporary files of writers that no longer run, killed before their rename). Not
thread-safe: the prefix cache calls it under its lock. Not here: which blocks are cached or
evicted (fallback/prefix_cache.py).
"""
import contextlib
import errno
import itertools
import os
import stat
import struct
from collections import OrderedDict, namedtuple

import numpy as np

from tinyloop.modelfile import CHECKSUM_AT, checksum

from . import kv_records
from .kv_records import record_dtype, row_bytes
from .prefix_blob import KV_MODE_CODES, MAX_LAYERS

MAGIC = b"TLPBLOCK"
VERSION = 1
SUFFIX = ".tlblock"
HEADER = struct.Struct("<8sIIQIIQIIIIIIIIII16s")
Header = namedtuple("Header", "magic version header_bytes file_bytes checksum model_checksum "
                              "model_file_bytes kv_mode window tree_depth block_size salt_bytes "
                              "block_index n_layers n_kv_heads head_dim instruction reserved")
KEY_FIELDS = struct.Struct("<IQIIIII")   # model_checksum .. salt_bytes: the name's first bytes
MAX_BLOCK_SIZE = MAX_SALT_BYTES = 65536
FNV_BASIS, FNV_PRIME, U64 = 0xcbf29ce484222325, 0x100000001b3, (1 << 64) - 1
assert HEADER.size == 96 and CHECKSUM_AT == 24


def fnv1a(data, h=FNV_BASIS):
    """64-bit FNV-1a of `data`, continuing from hash state `h`."""
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & U64
    return h


class BlockFileError(ValueError):
    """A block file breaking a rule of §7.6 (the message names the first one)."""


def _fail(message):
    raise BlockFileError(message)


def _tree_fields(tree):
    """(salt as bytes, window, instruction, tree_depth) of a prefix cache tree key."""
    return tree[0].encode("utf-8"), tree[1], tree[2], tree[3] if len(tree) > 3 else 0


class DiskTier:
    """The block files in `directory` of one engine (config, pool, kernel set's to_host,
    model_identity (header checksum, file_bytes)), under `budget` bytes (0: no limit)."""

    def __init__(self, directory, budget, config, pool, to_host, model_identity):
        self.directory = os.fspath(directory)
        self.budget = budget
        self.config, self.pool, self.to_host = config, pool, to_host
        self.model_checksum, self.model_file_bytes = model_identity
        self.kv_mode = KV_MODE_CODES[pool.kv_bits]
        self.record = record_dtype(row_bytes(config, pool.kv_bits))
        self.spilled_blocks = self.disk_hit_blocks = self.disk_write_failures = 0
        self._temp_names = itertools.count()
        _make_directory(self.directory)
        self._files = self._scan()          # name -> bytes, least recently used first
        self.disk_bytes = sum(self._files.values())

    def stats(self):
        return {"spilled_blocks": self.spilled_blocks, "disk_hit_blocks": self.disk_hit_blocks,
                "disk_write_failures": self.disk_write_failures,
                "disk_bytes": self.disk_bytes, "disk_budget_bytes": self.budget}

    def _scan(self):
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if _stale_temp(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    st = entry.stat()
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        return OrderedDict((name, size) for _, name, size in sorted(found))

    def _path(self, name):
        return os.path.join(self.directory, name)

    def _size(self, salt_bytes, block_index, n_layers, bs=None):
        """§7.6's file_bytes of a block file with these header fields (bs: the file's block
        size, this cache's by default)."""
        bs = self.pool.block_size if bs is None else bs
        return (HEADER.size + salt_bytes + 4 * (block_index + 1) * bs
                + n_layers * bs * self.config.n_kv_heads * self.record.itemsize)

    # -- names -------------------------------------------------------------------------------
    def names(self, tree, tokens):
        """The file names of blocks 0, 1, ... of `tokens` ((n,) int32) in `tree`, lazily."""
        salt, window, instruction, depth = _tree_fields(tree)
        key = KEY_FIELDS.pack(self.model_checksum, self.model_file_bytes, self.kv_mode, window,
                              depth, self.pool.block_size, len(salt))
        if instruction:                 # a causal tree's names stay those of TinyLoop 0.7
            key += struct.pack("<I", instruction)
        h = fnv1a(salt, fnv1a(key))
        bs = self.pool.block_size
        for i in range(len(tokens) // bs):
            h = fnv1a(tokens[i * bs:(i + 1) * bs].astype("<i4").tobytes(), h)
            yield f"{h:016x}{SUFFIX}"

    def name(self, tree, tokens):
        """The file name of the block ending `tokens` (a multiple of block_size long)."""
        *_, last = self.names(tree, tokens)
        return last

    # -- writing -----------------------------------------------------------------------------
    def spill(self, tree, tokens, blocks):
        """Write the block ending `tokens`, unless its file already holds a valid block of as
        many layers or more, it is larger than the whole budget or its salt is longer than a
        file may hold (as libtinyloop). True if written."""
        if len(_tree_fields(tree)[0]) > MAX_SALT_BYTES:
            return False
        name = self.name(tree, tokens)
        if self._load(name, tree, tokens, len(blocks)) is not None:
            return False
        data = self._file_bytes(tree, tokens, blocks)
        if self.budget and len(data) > self.budget:
            return False
        old = self._files.get(name, 0)      # the rename replaces it
        for oldest in [n for n in self._files if n != name]:
            if not self.budget or self.disk_bytes - old + len(data) <= self.budget:
                break
            self._remove(oldest)
        if self.budget and self.disk_bytes - old + len(data) > self.budget:
            return False                    # a file that could not be removed
        if not self._write(name, data):
            self.disk_write_failures += 1     # a full disk, an I/O error: memory goes on
            return False
        self.disk_bytes += len(data) - self._files.pop(name, 0)
        self._files[name] = len(data)
        self.spilled_blocks += 1
        return True

    def _file_bytes(self, tree, tokens, blocks):
        salt, window, instruction, depth = _tree_fields(tree)
        bs, g = self.pool.block_size, self.config.n_kv_heads
        records = np.zeros((len(blocks), bs, g), self.record)       # (n_layers, bs, G)
        for slot, block in enumerate(blocks):
            if block is not None:
                kv_records.gather(self.to_host, [block], records[slot])
        index = len(tokens) // bs - 1
        header = Header(MAGIC, VERSION, HEADER.size, self._size(len(salt), index, len(blocks)), 0,
                        self.model_checksum, self.model_file_bytes, self.kv_mode, window, depth,
                        bs, len(salt), index, len(blocks), g,
                        self.config.head_dim, instruction, bytes(16))
        data = bytearray(HEADER.pack(*header) + salt + tokens.astype("<i4").tobytes()
                         + records.tobytes())
        struct.pack_into("<I", data, CHECKSUM_AT, checksum(data))
        return bytes(data)

    def _write(self, name, data):
        """Write `data` to a temporary file, then rename it over `name`; False on an I/O
        error (the file is then unchanged)."""
        temp = self._path(f".{name}.{os.getpid()}.{next(self._temp_names)}.tmp")
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, self._path(name))
            return True
        except OSError:
            try:
                os.remove(temp)
            except OSError:
                pass
            return False

    def _remove(self, name):
        try:
            os.remove(self._path(name))
        except FileNotFoundError:
            pass                            # another process removed it
        except OSError:
            return                          # still there: keep counting it
        self.disk_bytes -= self._files.pop(name)

    # -- reading -----------------------------------------------------------------------------
    def read(self, name, tree, tokens, i, need):
        """Block i of `tokens` in `tree` from file `name`: [n_layers] new blocks of the pool
        (None for a slot never written), or None for a miss. A hit is the most recently used
        file, its modification time set to now."""
        loaded = self._load(name, tree, tokens[:(i + 1) * self.pool.block_size], need)
        if loaded is None:
            return None
        records, size = loaded
        try:
            os.utime(self._path(name))
        except OSError:
            pass
        self.disk_bytes += size - self._files.pop(name, 0)     # counted now, if it was not
        self._files[name] = size
        self.disk_hit_blocks += 1
        return self._blocks(records, _tree_fields(tree)[3])

    def _load(self, name, tree, tokens, need):
        """((n_layers, bs, G) records, file size) of file `name` if it is a valid block ending
        `tokens` in `tree` serving `need` layers, else None. The body is read only once the
        header's sizes are the file's and those of such a block (nothing sized by a bad file);
        a FIFO or a link under the name is no block (never waited on, never followed)."""
        want_salt, window, instruction, depth = _tree_fields(tree)
        place = (len(want_salt), len(tokens) // self.pool.block_size - 1)   # salt_bytes, index
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            with os.fdopen(os.open(self._path(name), flags), "rb") as f:
                st, head = os.fstat(f.fileno()), f.read(HEADER.size)
                if not stat.S_ISREG(st.st_mode) or len(head) < HEADER.size:
                    return None
                h = Header._make(HEADER.unpack(head))
                if ((h.salt_bytes, h.block_index) != place or not 1 <= h.n_layers <= MAX_LAYERS
                        or not h.file_bytes == st.st_size == self._size(*place, h.n_layers)):
                    return None
                body = f.read(h.file_bytes - HEADER.size)
            h, salt, stored, records = self.parse(head + body)
        except (OSError, BlockFileError):
            return None
        if ((h.window, h.tree_depth, h.block_size, h.instruction, salt)
                != (window, depth, self.pool.block_size, instruction, want_salt)):
            return None
        if len(stored) != len(tokens) or not np.array_equal(stored, tokens):
            return None
        serves = h.n_layers == self.config.n_layers(depth) if depth else h.n_layers >= need
        return (records, h.file_bytes) if serves else None

    def parse(self, data):
        """(header, salt bytes, tokens, records) of a block file, after every rule of §7.6
        holds in its order; BlockFileError naming the first broken."""
        config, size = self.config, len(data)
        if size < HEADER.size:
            _fail(f"too small: {size} bytes < the {HEADER.size}-byte header")
        h = Header._make(HEADER.unpack_from(data))
        if h.magic != MAGIC:
            _fail(f"bad magic {h.magic.hex()}, expected {MAGIC!r}")
        if h.version != VERSION:
            _fail(f"version: unsupported {h.version}, expected {VERSION}")
        if h.header_bytes != HEADER.size:
            _fail(f"header_bytes: must be {HEADER.size}, got {h.header_bytes}")
        if h.file_bytes != size:
            _fail(f"file_bytes: header says {h.file_bytes}, file has {size} bytes")
        if checksum(data) != h.checksum:
            _fail("checksum mismatch")
        if (h.model_checksum, h.model_file_bytes) != (self.model_checksum,
                                                       self.model_file_bytes):
            _fail("this block was written by another model")
        if h.kv_mode != self.kv_mode:
            _fail(f"kv_mode: {h.kv_mode}, this model's is {self.kv_mode}")
        for field, want in (("n_kv_heads", config.n_kv_heads), ("head_dim", config.head_dim)):
            if getattr(h, field) != want:
                _fail(f"{field}: {getattr(h, field)}, this model has {want}")
        bs, end = h.block_size, (h.block_index + 1) * h.block_size
        if not 1 <= bs <= MAX_BLOCK_SIZE:
            _fail(f"block_size: {bs} out of range (1 .. {MAX_BLOCK_SIZE})")
        if h.salt_bytes > MAX_SALT_BYTES:
            _fail(f"salt_bytes: {h.salt_bytes} > {MAX_SALT_BYTES}")
        if end > config.max_seq_len:
            _fail(f"block_index: {h.block_index} ends past max_seq_len={config.max_seq_len}")
        if not 1 <= h.n_layers <= MAX_LAYERS:
            _fail(f"n_layers: {h.n_layers} out of range (1 .. {MAX_LAYERS})")
        if any(h.reserved):
            _fail("reserved: bytes 80 .. 95 must be zero")
        want = self._size(h.salt_bytes, h.block_index, h.n_layers, bs)
        if h.file_bytes != want:
            _fail(f"file_bytes: {h.file_bytes}, but the header's fields describe {want} bytes")
        at = HEADER.size
        salt = bytes(data[at:at + h.salt_bytes])
        at += h.salt_bytes
        tokens = np.frombuffer(data, "<i4", end, at)
        at += tokens.nbytes
        records = np.frombuffer(data, self.record, h.n_layers * bs * h.n_kv_heads, at).reshape(
            h.n_layers, bs, h.n_kv_heads)
        bad = np.flatnonzero((tokens < 0) | (tokens >= config.vocab_size))
        if bad.size:
            _fail(f"tokens: token {bad[0]} is {tokens[bad[0]]}, not in 0 .. "
                  f"{config.vocab_size - 1}")
        broken = kv_records.first_broken(records, self.pool.kv_bits)
        if broken is not None:
            (slot, pos, g), rule = broken
            _fail(f"kv: slot {slot}, position {h.block_index * bs + pos}, kv head {g}: {rule}")
        return h, salt, tokens.astype(np.int32), records

    def _blocks(self, records, depth):
        """New pool blocks holding `records` ((n_layers, bs, G)); None for the coda slots of
        depths below `depth` (never written at that depth)."""
        cfg = self.config
        unwritten = {cfg.coda_slot(d, c) for d in range(1, depth) for c in range(cfg.n_coda_blocks)}
        blocks = []
        try:
            for slot, rows in enumerate(records):
                blocks.append(None if slot in unwritten else self.pool.new_block())
                if blocks[-1] is not None:
                    kv_records.store(self.pool, blocks[-1], rows, 0)
        except BaseException:
            for block in blocks:
                if block is not None:
                    self.pool.release(block)
            raise
        return blocks


def _stale_temp(name):
    """Whether `name` is a temporary file ".<name>.<pid>.<n>.tmp" of a writer that no longer
    runs on this host (killed between writing it and renaming it), which open removes."""
    parts = name.split(".")
    if not (name.startswith(".") and len(parts) >= 5 and parts[-1] == "tmp"
            and parts[-2].isdigit() and parts[-3].isdigit() and int(parts[-3]) > 0):
        return False
    try:
        os.kill(int(parts[-3]), 0)
    except ProcessLookupError:
        return True
    except OSError:                       # it runs, as another user
        return False
    return False


def _make_directory(directory):
    """Create `directory` (one level) unless it exists; OSError naming it when it is not a
    directory or cannot be created."""
    try:
        os.mkdir(directory)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OSError(exc.errno, f"prefix_cache_dir cannot be created ({exc.strerror})",
                      directory) from None
    if not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, "prefix_cache_dir is not a directory", directory)
