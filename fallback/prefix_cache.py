"""The automatic prefix cache (docs/spec.md §4.3) for the Python engine: libtinyloop's
prefix_cache.c in Python, with the same decisions.

A tree per key (the caller's: (salt, window), plus the depth for a model with a coda): a node
per full, block-aligned block of some earlier prompt, keyed by the block's tokens under the node
of the block before it. A node holds one reference to the block's per-layer KV blocks
(`blocks[layer]`, n_layers of them; None for a slot its request never wrote, the coda slots of
other depths; counted in no byte total) and serves any request of its tree needing that many
layers or fewer. Unreferenced leaves are evicted least recently used first when an insert would
pass the byte budget; every node a call touches carries that call's tick and is safe from that
call's evictions. Each lookup and each insert is one tick.
"""
import threading

from tinyloop.engine import CACHE_STAT_NAMES


class _Node:
    __slots__ = ("parent", "key", "blocks", "children", "last_used")

    def __init__(self, parent, key, blocks):
        self.parent = parent
        self.key = key              # the block's tokens (a tuple); None for a root
        self.blocks = blocks        # [n_layers] KVBlock or None (unwritten); None for a root
        self.children = {}
        self.last_used = 0

    @property
    def n_layers(self):
        return len(self.blocks)

    def held(self):
        """The KV blocks the node holds (every written slot's)."""
        return [b for b in self.blocks if b is not None]


class PrefixCache:
    """An index over a BlockPool's full blocks, with a budget of `budget_bytes`."""

    def __init__(self, pool, budget_bytes):
        self.pool = pool
        self.block_size = pool.block_size
        self.budget = budget_bytes
        self._roots = {}            # tree key -> root node
        self._tick = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(CACHE_STAT_NAMES, 0)
        self._stats["budget_bytes"] = budget_bytes

    def stats(self):
        with self._lock:
            return dict(self._stats)

    def _node_bytes(self, node):
        return len(node.held()) * self.pool.block_nbytes

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, tree, cache, tokens):
        """Share into the empty `cache` the longest cached chain of tokens' blocks that serves
        cache.n_layers, leaving at least one token; returns the positions shared."""
        bs, need = self.block_size, cache.n_layers
        with self._lock:
            self._tick += 1
            self._stats["lookups"] += 1
            node = self._roots.get(tree)
            k = 0
            while node is not None and k < (len(tokens) - 1) // bs:
                child = node.children.get(tuple(tokens[k * bs:(k + 1) * bs].tolist()))
                if child is None or child.n_layers < need:
                    break
                for layer, blocks in enumerate(cache.layers):
                    if child.blocks[layer] is not None:     # else a slot it never writes
                        self.pool.retain(child.blocks[layer])
                        blocks.append(child.blocks[layer])
                child.last_used = self._tick
                node, k = child, k + 1
            cache.length = k * bs
            self._stats["hit_tokens"] += k * bs
            self._stats["prefilled_tokens"] += len(tokens) - k * bs
        return k * bs

    # -- insert ------------------------------------------------------------------------------
    def insert(self, tree, cache, tokens):
        """Offer the cache's full blocks holding positions of `tokens` (its prompt); a slot
        with no blocks at all is one the request never wrote."""
        bs = self.block_size
        with self._lock:
            self._tick += 1
            parent = self._roots.setdefault(tree, _Node(None, None, None))
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

    def _add(self, parent, key, blocks):
        node = _Node(parent, key, blocks)
        for b in node.held():
            self.pool.retain(b)
        node.last_used = self._tick
        parent.children[key] = node
        self._stats["blocks"] += 1
        self._stats["bytes_in_use"] += self._node_bytes(node)
        self._stats["inserted_blocks"] += 1
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
            self._remove(min(victims, key=lambda n: n.last_used))
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

    def clear(self):
        """Drop every node (blocks in use elsewhere live on there); the counters stay."""
        with self._lock:
            for node in list(self._nodes()):
                for b in node.held():
                    self.pool.release(b)
            self._roots.clear()
            self._stats["blocks"] = self._stats["bytes_in_use"] = 0
