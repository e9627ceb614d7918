"""The automatic prefix cache (docs/spec.md §4.3) for the Python engine: libtinyloop's
prefix_cache.c in Python, with the same decisions.

A tree per key (the caller's: (salt, window, instruction length), plus the depth for a model
with a coda): a node
per full, block-aligned block of some earlier prompt, keyed by the block's tokens under the node
of the block before it. A node holds one reference to the block's per-layer KV blocks
(`blocks[layer]`, n_layers of them; None for a slot its request never wrote, the coda slots of
other depths; counted in no byte total) and serves any request of its tree needing that many
layers or fewer. Unreferenced leaves are evicted least recently used first when an insert would
pass the byte budget; every node a call touches carries that call's tick and is safe from that
call's evictions. Each lookup and each insert is one tick.

With a disk tier (fallback/pcache_disk.py, §4.3.1) an evicted node is spilled to its file, and
so is every node still cached at `close`; a lookup whose walk finds no node serving the request
reads the block's file and, when valid, adds it as a node (evicting to fit), then walks on.
"""
import threading

import numpy as np

from tinyloop.engine import CACHE_STAT_NAMES


class _Node:
    __slots__ = ("parent", "key", "blocks", "children", "last_used", "index")

    def __init__(self, parent, key, blocks):
        self.parent = parent
        self.index = -1 if parent is None else parent.index + 1     # its block's; a root -1
        self.key = key              # the block's tokens (a tuple); a root: its tree key
        self.blocks = blocks        # [n_layers] KVBlock or None (unwritten); None for a root
        self.children = {}
        self.last_used = 0

    @property
    def n_layers(self):
        return len(self.blocks)

    def held(self):
        """The KV blocks the node holds (every written slot's)."""
        return [b for b in self.blocks if b is not None]

    def chain(self):
        """(tree key, (positions,) int32 tokens of every block from the root's to this one)."""
        keys, node = [], self
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return node.key, np.array([t for key in reversed(keys) for t in key], np.int32)


class PrefixCache:
    """An index over a BlockPool's full blocks, with a budget of `budget_bytes`, backed by
    `disk` (a pcache_disk.DiskTier, or None)."""

    def __init__(self, pool, budget_bytes, disk=None):
        self.pool = pool
        self.disk = disk
        self.block_size = pool.block_size
        self.budget = budget_bytes
        self._roots = {}            # tree key -> root node
        self._tick = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(CACHE_STAT_NAMES, 0)
        self._stats["budget_bytes"] = budget_bytes

    def stats(self):
        with self._lock:
            stats = dict(self._stats)
            if self.disk is not None:
                stats.update(self.disk.stats())
            return stats

    def _node_bytes(self, node):
        return len(node.held()) * self.pool.block_nbytes

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, tree, cache, tokens):
        """Share into the empty `cache` the longest chain of tokens' blocks, cached or on disk,
        that serves cache.n_layers, leaving at least one token; returns the positions
        shared."""
        bs, need = self.block_size, cache.n_layers
        with self._lock:
            self._tick += 1
            self._stats["lookups"] += 1
            node = self._roots.get(tree)
            if node is None and self.disk is not None:
                node = self._roots[tree] = _Node(None, tree, None)
            names = self.disk.names(tree, tokens) if self.disk is not None else None
            k = 0
            while k < (len(tokens) - 1) // bs:
                key = tuple(tokens[k * bs:(k + 1) * bs].tolist())
                name = next(names) if names is not None else None
                child = node.children.get(key) if node is not None else None
                if child is not None and child.n_layers >= need:
                    self._share(cache, child.blocks)
                    child.last_used = self._tick
                else:
                    read = self.disk.read(name, tree, tokens, k, need) if name else None
                    if read is None:
                        break
                    child = self._adopt(node, key, child, read)
                    self._share(cache, read)
                    for b in read:              # the reader's references
                        if b is not None:
                            self.pool.release(b)
                node, k = child, k + 1
            if k * bs < cache.instruction:        # short of the instruction block: none serve
                self._unshare(cache)
                k = 0
            cache.length = k * bs
            self._stats["hit_tokens"] += k * bs
            self._stats["prefilled_tokens"] += len(tokens) - k * bs
            self._drop_childless_roots()
        return k * bs

    def _share(self, cache, blocks):
        for layer, held in enumerate(cache.layers):
            if blocks[layer] is not None:           # else a slot the request never writes
                self.pool.retain(blocks[layer])
                held.append(blocks[layer])

    def _unshare(self, cache):
        for held in cache.layers:
            for b in held:
                self.pool.release(b)
            held.clear()

    def _adopt(self, parent, key, shallower, blocks):
        """Cache the blocks read from disk as insert would (replacing the shallower node when
        the extra bytes fit, else adding a node when they fit); returns the node the walk goes
        on under (None: off the tree)."""
        if shallower is not None:
            shallower.last_used = self._tick
            if self._make_room((len(blocks) - shallower.n_layers) * self.pool.block_nbytes):
                self._replace(shallower, blocks)
            return shallower
        if parent is None or not self._make_room(
                sum(b is not None for b in blocks) * self.pool.block_nbytes):
            return None
        return self._add(parent, key, blocks, inserted=False)

    # -- insert ------------------------------------------------------------------------------
    def insert(self, tree, cache, tokens):
        """Offer the cache's full blocks holding positions of `tokens` (its prompt); a slot
        with no blocks at all is one the request never wrote."""
        bs = self.block_size
        with self._lock:
            self._tick += 1
            parent = self._roots.setdefault(tree, _Node(None, tree, None))
            for i in range(len(tokens) // bs):
                mine = [blocks[i] if blocks else None for blocks in cache.layers]
                if any(blocks and blocks[i] is None for blocks in cache.layers):
                    break                           # released by the window
                key = tuple(tokens[i * bs:(i + 1) * bs].tolist())
                node = parent.children.get(key)
                if node is not None:
                    node.last_used = self._tick
                    if node.n_layers < len(mine) and self._make_room(
                            (len(mine) - node.n_layers) * self.pool.block_nbytes):
                        self._replace(node, mine)
                elif self._make_room(sum(b is not None for b in mine) * self.pool.block_nbytes):
                    node = self._add(parent, key, mine)
                parent = node
                if parent is None:
                    break
            self._drop_childless_roots()

    def _add(self, parent, key, blocks, inserted=True):
        node = _Node(parent, key, blocks)
        for b in node.held():
            self.pool.retain(b)
        node.last_used = self._tick
        parent.children[key] = node
        self._stats["blocks"] += 1
        self._stats["bytes_in_use"] += self._node_bytes(node)
        self._stats["inserted_blocks"] += inserted
        return node

    def _replace(self, node, deeper):
        """The deeper blocks serve more requests."""
        self._stats["bytes_in_use"] -= self._node_bytes(node)
        for b in deeper:
            self.pool.retain(b)
        for b in node.held():
            self.pool.release(b)
        node.blocks = deeper
        self._stats["bytes_in_use"] += self._node_bytes(node)

    # -- eviction ----------------------------------------------------------------------------
    def _evictable(self, node):
        return (not node.children and node.last_used != self._tick
                and all(b.refs == 1 for b in node.held()))

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def _make_room(self, extra):
        """Evict until `extra` more bytes fit; False if they cannot."""
        if extra > self.budget:
            return False
        while self._stats["bytes_in_use"] > self.budget - extra:
            victims = [n for n in self._nodes() if self._evictable(n)]
            if not victims:
                return False
            victim = min(victims, key=lambda n: n.last_used)
            if self.disk is not None:
                self.disk.spill(*victim.chain(), victim.blocks)
            self._remove(victim)
            self._stats["evicted_blocks"] += 1
        return True

    def _remove(self, node):
        del node.parent.children[node.key]
        for b in node.held():
            self.pool.release(b)
        self._stats["blocks"] -= 1
        self._stats["bytes_in_use"] -= self._node_bytes(node)

    def _drop_childless_roots(self):
        for key in [k for k, root in self._roots.items() if not root.children]:
            del self._roots[key]

    def close(self):
        """Spill every cached node, then drop them all: a later process on the disk tier's
        directory starts warm. The order is libtinyloop's use list: least recently used
        first and, among the nodes of one tick (one chain), the deepest first, so that under a
        tight disk budget the shallow blocks, the ones a lookup's walk needs first, are the
        files written last and kept."""
        with self._lock:            # one step: no insert between the spills and the drop
            if self.disk is not None:
                for node in sorted(self._nodes(), key=lambda n: (n.last_used, -n.index)):
                    self.disk.spill(*node.chain(), node.blocks)
            self._drop_all()

    def clear(self):
        """Drop every node (blocks in use elsewhere live on there); the counters stay."""
        with self._lock:
            self._drop_all()

    def _drop_all(self):
        for node in list(self._nodes()):
            for b in node.held():
                self.pool.release(b)
        self._roots.clear()
        self._stats["blocks"] = self._stats["bytes_in_use"] = 0
