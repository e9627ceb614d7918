/* prefix_cache.h — the automatic prefix cache (docs/spec.md §4.3): an index over full,
 * block-aligned KV blocks keyed by (cache salt, window, the tokens of every block up to and
 * including this one), with LRU eviction of blocks nobody else holds under a byte budget.
 *
 * The index is a tree: a root per (salt, window, tree depth, instruction length), a node per
 * cached block whose
 * parent is the node of the block before it. A node holds one reference to its block; the
 * block's depth is its layer count, and a node serves any request of its tree needing that many
 * layers or fewer. A model without a coda has one tree for all depths (tree depth 0: depth
 * nesting); with a coda each depth has its own, whose blocks all have its layer count. Every
 * operation takes the cache's mutex. References to a block rise outside it too (tl_kv_share,
 * for a fork or a sequence from a prefix, retains blocks a table holds), but a block only the
 * cache holds (refs == 1) gains one only under it, so a node whose block has refs == 1 stays
 * evictable for the rest of the call. Eviction takes the least recently used such leaf from a
 * use list (prefix_cache.c), never a scan of the whole cache: an insert that evicts k blocks
 * visits at most k + h nodes, h the cached nodes leading to a block held elsewhere (0 when no
 * running request, prefix or fork holds a cached block).
 *
 * With a disk tier (pcache_disk.h, docs/spec.md §4.3.1) an evicted node's block is spilled to
 * its file, every cached node is spilled at close, and a lookup that finds no cached child
 * serving block i reads block i's file. That file I/O happens under the cache's mutex.
 */
#ifndef TL_PREFIX_CACHE_H
#define TL_PREFIX_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "core/kvcache.h"
#include "core/pcache_disk.h"

typedef struct tl_pcache tl_pcache;

/* A request's place in the index: salt (NUL-terminated; NULL = ""), window, layers needed,
 * its tree: 0 when blocks of every depth serve shallower ones (no coda), else the depth, and
 * its instruction length P (docs/spec.md §4.3: a tree per P). */
typedef struct tl_pcache_key {
    const char* salt;
    uint32_t window;
    uint32_t n_layers;
    uint32_t tree_depth;
    uint32_t instruction;
} tl_pcache_key;

/* A cache with budget `budget_bytes` (> 0) for blocks of geometry g, backed by the disk tier
 * `disk` (NULL = none; the cache owns it, also when this fails). NULL when out of memory. */
tl_pcache* tl_pcache_new(const tl_kv_geom* g, size_t budget_bytes, tl_pdisk* disk);
/* Drop every node (blocks still held elsewhere live on) and free the cache and its disk tier.
 * NULL: no-op. */
void tl_pcache_free(tl_pcache* c);
/* Drop every node, spilling none; the counters are kept. */
void tl_pcache_clear(tl_pcache* c);
/* Spill every node to the disk tier (least recently used first; among the nodes last used at
 * one tick, the deeper block first), then drop them for good (the model was closed): later
 * lookups miss and inserts add nothing, so requests still running add no block that would
 * outlive the close. */
void tl_pcache_close(tl_pcache* c);

/* Share into the empty table `t` the longest chain of cached blocks that are a prefix of
 * tokens[0..n) and serve key->n_layers, leaving at least one token uncached (the last token's
 * logits are always computed), or none when that chain ends before the instruction block does; where no cached block serves, the disk tier's file of the block
 * (read into a new block, cached as an insert caches one when it fits). *hit receives the
 * number of positions shared, a multiple of the block size. Out of memory: *hit = 0 and t
 * stays empty (the request simply misses). */
void tl_pcache_lookup(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t n,
                      tl_kv_table* t, size_t* hit);
/* Offer the full, block-aligned blocks of `t` that hold positions of tokens[0..n) (the
 * request's prompt, run at key->n_layers). Each is added while the budget allows after
 * evicting least recently used leaves nobody else holds; a deeper block replaces a shallower
 * one of the same content. Best effort: no room or no memory stops adding, without an error. */
void tl_pcache_insert(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t n,
                      const tl_kv_table* t);
/* Snapshot of the counters (size = sizeof the struct). */
tl_prefix_cache_stats tl_pcache_stats(tl_pcache* c);

/* For tests. The cached blocks in eviction order, least recently used first: up to `cap` of
 * them into out; returns how many the cache holds. */
size_t tl_pcache_use_order(tl_pcache* c, const tl_kv_block** out, size_t cap);
/* Nodes the eviction walks have examined so far, each one evicted or skipped (prefix_cache.c
 * bounds their number). */
uint64_t tl_pcache_eviction_visits(tl_pcache* c);

#endif
