/* prefix_cache.c — the automatic prefix cache (prefix_cache.h, docs/spec.md §4.3).
 *
 * Nodes live in one chained hash table keyed by (parent node, the block's tokens), beside the
 * roots, one per (salt, window, tree depth, instruction length) keyed by those; a root goes with its last child. Each lookup
 * and each insert is one tick; every node it touches carries that tick and is never evicted
 * by it, so the chain being extended stays put. A lookup or an insert costs expected O(1) per
 * block of the prompt, whatever the number of nodes or tenants, plus its evictions (below).
 *
 * Eviction order. Every block node is on the use list, least recently used first, and comes
 * after all of its descendants there: a call touches a chain from its root downwards, putting
 * the first node at the new end and each deeper one just before its parent, and a new node
 * enters just before its parent too. So the list is sorted by last use, the nodes sharing a
 * tick form one chain with at most one leaf among them, and the least recently used leaf
 * nobody else holds (the victim) is the first node of the list that is a leaf with refs == 1.
 * A block's refs drop outside the cache without telling it, so that is checked when the walk
 * gets there: an insert's evictions are one walk from the old end, skipping nodes that are held
 * or lead to a held block, stopping at the first node of the current tick, and each eviction
 * goes on from where the previous one stopped. That is exact: a node the walk passed was held
 * or had a child it passed, and under the mutex neither changes except by touch (which makes
 * it current, hence ineligible for this insert) or by a release racing the insert (which may
 * or may not be seen, as with any read of refs). The walk only moves forward (an evicted
 * node's parent lies ahead of it), so an insert that evicts k blocks visits at most k + h
 * nodes, h being the cached nodes whose subtree holds a block some sequence, prefix or fork
 * holds: O(1) per evicted block when no cached block is held elsewhere, O(h) more per insert
 * that evicts otherwise, and never a scan of the whole cache. The h term is the price of the
 * exact order (docs/spec.md §4.3): any held node older than the victim may have been released
 * since the last insert, which would make it the victim, and only reading its refs tells.
 * Clearing removes the list from its old end: each node is a leaf by then.
 *
 * The disk tier (§4.3.1). A victim is spilled just before it goes; a lookup reads a block's
 * file where no cached child serves it, and the block it reads joins the tree as an insert's
 * block does (offer), counted in disk_hit_blocks (not in inserted_blocks). A file's
 * name hashes every token up to its block's end: a lookup hashes them as its walk goes on.
 */
#include "core/prefix_cache.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "base/alloc.h"

typedef struct node {
    struct node* parent;  /* NULL for a root                                   */
    struct node* next;    /* next entry in the hash chain                      */
    struct node* older;   /* neighbours on the use list (block nodes)          */
    struct node* newer;
    tl_kv_block* block;   /* one reference held; NULL for a root               */
    uint64_t hash;
    uint64_t last_used;   /* tick of the last call that used it                */
    size_t n_children;
    uint32_t window;      /* roots                                             */
    uint32_t tree_depth;  /* roots: the key's tree_depth                       */
    uint32_t instruction; /* roots: the key's instruction length               */
    char* salt;           /* roots: owned copy                                 */
    int32_t tokens[];     /* [block_size]: the block's tokens (block nodes)    */
} node;

struct tl_pcache {
    pthread_mutex_t lock;
    tl_kv_geom geom;
    size_t budget;
    node** buckets;       /* [n_buckets], a power of two: roots and block nodes */
    size_t n_buckets, n_entries;
    node* inserting_root; /* the root of the insert under way, kept while empty */
    node* oldest;         /* the use list, least recently used first           */
    node* newest;
    node* walk;           /* the insert under way: where its eviction walk is  */
    uint64_t tick;
    bool closed;          /* set by tl_pcache_close: nothing is served or added */
    tl_pdisk* disk;       /* the disk tier; NULL = none                        */
    uint64_t eviction_visits;
    tl_prefix_cache_stats stats;
};

/* ---- the hash table ------------------------------------------------------------------------ */

/* FNV-1a over 32-bit words, then a final mix of the high bits into the bucket bits. */
static uint64_t mix(uint64_t h, uint32_t word) { return (h ^ word) * 0x100000001b3u; }
static uint64_t finish(uint64_t h) { return h ^ (h >> 29); }

static uint64_t block_hash(const node* parent, const int32_t* tokens, uint32_t n) {
    uint64_t h = 0xcbf29ce484222325u ^ (uint64_t)(uintptr_t)parent;
    for (uint32_t i = 0; i < n; i++) h = mix(h, (uint32_t)tokens[i]);
    return finish(h);
}

static const char* salt_of(const tl_pcache_key* key) { return key->salt ? key->salt : ""; }

static uint64_t root_hash(const tl_pcache_key* key) {
    uint64_t h = mix(mix(mix(0xcbf29ce484222325u, key->window), key->tree_depth), key->instruction);
    for (const char* p = salt_of(key); *p; p++) h = mix(h, (unsigned char)*p);
    return finish(h);
}

static node** bucket_of(tl_pcache* c, uint64_t hash) { return &c->buckets[hash & (c->n_buckets - 1)]; }

/* Double the bucket array when the table is fuller than one entry per bucket; keeps the old
 * array if memory is short (chains just get longer). */
static void maybe_grow(tl_pcache* c) {
    if (c->n_entries < c->n_buckets) return;
    const size_t n = c->n_buckets * 2;
    node** buckets = tl_alloc_zeroed(n, sizeof *buckets);
    if (!buckets) return;
    for (size_t i = 0; i < c->n_buckets; i++)
        for (node *x = c->buckets[i], *next; x; x = next) {
            next = x->next;
            x->next = buckets[x->hash & (n - 1)];
            buckets[x->hash & (n - 1)] = x;
        }
    tl_free(c->buckets);
    c->buckets = buckets;
    c->n_buckets = n;
}

static void table_add(tl_pcache* c, node* x) {
    maybe_grow(c);
    node** b = bucket_of(c, x->hash);
    x->next = *b;
    *b = x;
    c->n_entries++;
}

static void table_remove(tl_pcache* c, node* x) {
    for (node** p = bucket_of(c, x->hash); *p; p = &(*p)->next)
        if (*p == x) {
            *p = x->next;
            break;
        }
    c->n_entries--;
}

/* ---- the use list --------------------------------------------------------------------------- */

static void unlink_use(tl_pcache* c, node* x) {
    if (c->walk == x) c->walk = x->newer; /* the insert's walk goes on at the next node */
    *(x->older ? &x->older->newer : &c->oldest) = x->newer;
    *(x->newer ? &x->newer->older : &c->newest) = x->older;
    x->older = x->newer = NULL;
}

/* Put x (not on the list) just before `at`, or at the new end when `at` is NULL. */
static void link_use_before(tl_pcache* c, node* x, node* at) {
    x->newer = at;
    x->older = at ? at->older : c->newest;
    *(x->older ? &x->older->newer : &c->oldest) = x;
    *(at ? &at->older : &c->newest) = x;
}

/* Mark x used by the current call and move it to its place: just before its parent, which
 * this call touched already, or at the new end for a child of a root. Keeps the list sorted by
 * last use with every node after its descendants. */
static void touch(tl_pcache* c, node* x) {
    x->last_used = c->tick;
    unlink_use(c, x);
    link_use_before(c, x, x->parent->block ? x->parent : NULL);
}

/* ---- nodes ------------------------------------------------------------------------------------ */

static node* find_child(tl_pcache* c, const node* parent, const int32_t* tokens) {
    const uint32_t bs = c->geom.block_size;
    const uint64_t h = block_hash(parent, tokens, bs);
    for (node* x = *bucket_of(c, h); x; x = x->next)
        if (x->hash == h && x->parent == parent && memcmp(x->tokens, tokens, bs * sizeof *tokens) == 0)
            return x;
    return NULL;
}

static node* find_root(tl_pcache* c, const tl_pcache_key* key) {
    const uint64_t h = root_hash(key);
    for (node* r = *bucket_of(c, h); r; r = r->next)
        if (r->hash == h && !r->parent && r->window == key->window && r->tree_depth == key->tree_depth &&
            r->instruction == key->instruction && strcmp(r->salt, salt_of(key)) == 0)
            return r;
    return NULL;
}

static node* make_root(tl_pcache* c, const tl_pcache_key* key) {
    node* r = tl_alloc_zeroed(1, sizeof *r);
    const size_t len = strlen(salt_of(key)) + 1;
    char* copy = r ? tl_alloc(len) : NULL;
    if (!copy) {
        tl_free(r);
        return NULL;
    }
    memcpy(copy, salt_of(key), len);
    r->salt = copy;
    r->window = key->window;
    r->tree_depth = key->tree_depth;
    r->instruction = key->instruction;
    r->hash = root_hash(key);
    table_add(c, r);
    return r;
}

static void remove_root(tl_pcache* c, node* r) {
    table_remove(c, r);
    tl_free(r->salt);
    tl_free(r);
}

static node* add_child(tl_pcache* c, node* parent, const int32_t* tokens, tl_kv_block* block) {
    const uint32_t bs = c->geom.block_size;
    node* x = tl_alloc_zeroed(1, sizeof *x + bs * sizeof(int32_t));
    if (!x) return NULL;
    memcpy(x->tokens, tokens, bs * sizeof *tokens);
    x->parent = parent;
    x->hash = block_hash(parent, tokens, bs);
    x->block = block;
    tl_kv_block_retain(block);
    x->last_used = c->tick;
    link_use_before(c, x, parent->block ? parent : NULL);
    table_add(c, x);
    parent->n_children++;
    c->stats.blocks++;
    c->stats.bytes_in_use += block->bytes;
    return x;
}

/* Unlink a leaf, drop its block and free it; a root left childless goes too, unless an insert
 * is about to add under it. */
static void remove_leaf(tl_pcache* c, node* x) {
    node* parent = x->parent;
    table_remove(c, x);
    unlink_use(c, x);
    c->stats.blocks--;
    c->stats.bytes_in_use -= x->block->bytes;
    tl_kv_block_release(x->block);
    tl_free(x);
    if (--parent->n_children == 0 && !parent->block && parent != c->inserting_root) remove_root(c, parent);
}

/* ---- the disk tier ---------------------------------------------------------------------------- */

/* Write block node x to its file (spilled_blocks += 1 when written): its place from its root,
 * the tokens of its chain. Out of memory: not spilled. */
static void spill(tl_pcache* c, const node* x) {
    if (!c->disk) return;
    const uint32_t bs = c->geom.block_size;
    uint32_t index = 0;
    const node* root = x->parent;
    for (; root->block; root = root->parent) index++;
    const size_t n = ((size_t)index + 1) * bs;
    int32_t* tokens = tl_alloc(n * sizeof *tokens);
    if (!tokens) return;
    size_t at = n;
    for (const node* y = x; y->block; y = y->parent) {
        at -= bs;
        memcpy(tokens + at, y->tokens, bs * sizeof *tokens);
    }
    const tl_block_place place = {root->salt, root->window, root->tree_depth, index, tokens, root->instruction};
    const uint64_t start = tl_block_name_start(tl_pdisk_model(c->disk), &place, strlen(root->salt));
    if (tl_pdisk_spill(c->disk, &place, tl_block_name_more(start, tokens, n), x->block)) c->stats.spilled_blocks++;
    tl_free(tokens);
}

/* A lookup's walk over the disk tier: the name hash of the tokens hashed so far. */
typedef struct disk_walk {
    uint64_t name;
    size_t hashed; /* tokens in `name`; 0 before the key fields are */
} disk_walk;

/* Block k of the request (tokens[0 .. (k+1)*bs) under key) from its file into a new block
 * appended to t, whose k spans end at k * bs; false on a miss. */
static bool read_block(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t k, disk_walk* w,
                       tl_kv_table* t) {
    const uint32_t bs = c->geom.block_size;
    const char* salt = salt_of(key);
    const tl_block_place place = {salt, key->window, key->tree_depth, (uint32_t)k, tokens, key->instruction};
    if (!w->hashed) w->name = tl_block_name_start(tl_pdisk_model(c->disk), &place, strlen(salt));
    w->name = tl_block_name_more(w->name, tokens + w->hashed, (k + 1) * bs - w->hashed);
    w->hashed = (k + 1) * bs;
    return tl_pdisk_fetch(c->disk, &place, w->name, key->n_layers, t);
}

/* ---- eviction -------------------------------------------------------------------------------- */

/* Evict until `extra` more bytes fit in the budget; false if they cannot. The walk goes on
 * from where the insert's previous one stopped, skips nodes held elsewhere or leading to such
 * a node and stops at the current tick (see top). */
static bool make_room(tl_pcache* c, size_t extra) {
    if (extra > c->budget) return false;
    while (c->stats.bytes_in_use > c->budget - extra) {
        node* x = c->walk;
        for (; x && x->last_used != c->tick; x = x->newer) {
            c->eviction_visits++;
            if (x->n_children == 0 && tl_kv_block_refs(x->block) == 1) break;
        }
        c->walk = x;
        if (!x || x->last_used == c->tick) return false;
        spill(c, x);
        remove_leaf(c, x); /* moves the walk on to the next node */
        c->stats.evicted_blocks++;
    }
    return true;
}

/* ---- the interface ---------------------------------------------------------------------------- */

tl_pcache* tl_pcache_new(const tl_kv_geom* g, size_t budget_bytes, tl_pdisk* disk) {
    tl_pcache* c = tl_alloc_zeroed(1, sizeof *c);
    node** buckets = c ? tl_alloc_zeroed(64, sizeof *buckets) : NULL;
    if (!buckets) {
        tl_free(c);
        tl_pdisk_free(disk);
        return NULL;
    }
    c->n_buckets = 64;
    c->buckets = buckets;
    c->disk = disk;
    pthread_mutex_init(&c->lock, NULL);
    c->geom = *g;
    c->budget = budget_bytes;
    c->stats.budget_bytes = budget_bytes;
    if (disk) c->stats.disk_budget_bytes = tl_pdisk_budget(disk);
    return c;
}

/* Remove every node: the oldest is always a leaf (its descendants come before it), and each
 * root goes with its last child. */
static void remove_all(tl_pcache* c) {
    while (c->oldest) remove_leaf(c, c->oldest);
}

void tl_pcache_clear(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    remove_all(c);
    pthread_mutex_unlock(&c->lock);
}

void tl_pcache_close(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    c->closed = true;
    /* least recently used first; the nodes of one tick form one chain, deepest first (see top) */
    for (const node* x = c->oldest; x; x = x->newer) spill(c, x);
    remove_all(c);
    pthread_mutex_unlock(&c->lock);
}

void tl_pcache_free(tl_pcache* c) {
    if (!c) return;
    remove_all(c);
    pthread_mutex_destroy(&c->lock);
    tl_pdisk_free(c->disk);
    tl_free(c->buckets);
    tl_free(c);
}

/* Offer block b for the position under `parent` whose tokens are `tokens`, as §4.3's insert
 * does: a child with those tokens is used (its block replaced by b when b is deeper and the
 * extra bytes fit), else b becomes a new child when it fits (*added += 1, if added is not
 * NULL). The node now holding the position, or NULL (b is not cached). */
static node* offer(tl_pcache* c, node* parent, const int32_t* tokens, tl_kv_block* b, uint64_t* added) {
    node* x = find_child(c, parent, tokens);
    if (!x) {
        x = make_room(c, b->bytes) ? add_child(c, parent, tokens, b) : NULL;
        if (x && added) (*added)++;
        return x;
    }
    touch(c, x); /* protected from this call's evictions */
    tl_kv_block* theirs = x->block;
    if (theirs->n_layers < b->n_layers && make_room(c, b->bytes - theirs->bytes)) {
        c->stats.bytes_in_use += b->bytes - theirs->bytes; /* the deeper block serves more */
        tl_kv_block_retain(b);
        tl_kv_block_release(theirs);
        x->block = b;
    }
    return x;
}

void tl_pcache_lookup(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t n,
                      tl_kv_table* t, size_t* hit) {
    const uint32_t bs = c->geom.block_size;
    const size_t max_blocks = n ? (n - 1) / bs : 0;
    size_t k = 0;
    disk_walk walk = {0, 0};
    pthread_mutex_lock(&c->lock);
    c->tick++;
    c->stats.lookups++;
    node* root = c->closed ? NULL : find_root(c, key);
    c->inserting_root = root; /* a disk hit may evict its other children */
    c->walk = c->oldest;
    node* parent = root; /* the node of block k - 1 (the root for k = 0); NULL off the tree */
    while (!c->closed && k < max_blocks) {
        node* x = parent ? find_child(c, parent, tokens + k * bs) : NULL;
        if (x && x->block->n_layers >= key->n_layers) {
            if (tl_kv_push_shared(t, x->block, (uint32_t)(k * bs), bs) != TL_OK) {
                tl_kv_clear(t);
                k = 0;
                break;
            }
            touch(c, x);
        } else if (c->disk && read_block(c, key, tokens, k, &walk, t)) {
            if (k == 0 && !root) parent = root = c->inserting_root = make_root(c, key);
            x = parent ? offer(c, parent, tokens + k * bs, t->spans[k].block, NULL) : NULL;
            c->stats.disk_hit_blocks++;
        } else {
            break;
        }
        parent = x;
        k++;
    }
    if (k * bs < key->instruction) { /* the instruction block is computed whole (§4.2, §4.3) */
        tl_kv_clear(t);
        k = 0;
    }
    c->inserting_root = NULL;
    c->walk = NULL;
    if (root && root->n_children == 0) remove_root(c, root);
    c->stats.hit_tokens += k * bs;
    c->stats.prefilled_tokens += n - k * bs;
    pthread_mutex_unlock(&c->lock);
    *hit = k * bs;
}

/* The block of `t` holding exactly positions [i * bs, (i + 1) * bs), or NULL. */
static tl_kv_block* aligned_block(const tl_kv_table* t, size_t i, uint32_t bs) {
    if (i >= t->n_spans || i < t->first_live) return NULL;
    const tl_kv_span* s = &t->spans[i];
    return s->block && s->start == i * bs && s->count == bs ? s->block : NULL;
}

void tl_pcache_insert(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t n,
                      const tl_kv_table* t) {
    const uint32_t bs = c->geom.block_size;
    pthread_mutex_lock(&c->lock);
    if (c->closed) { /* a request still running when its model was closed */
        pthread_mutex_unlock(&c->lock);
        return;
    }
    c->tick++;
    node* root = find_root(c, key);
    if (!root) root = make_root(c, key);
    c->inserting_root = root;
    c->walk = c->oldest;
    node* parent = root;
    for (size_t i = 0; parent && i < n / bs; i++) {
        tl_kv_block* mine = aligned_block(t, i, bs);
        parent = mine ? offer(c, parent, tokens + i * bs, mine, &c->stats.inserted_blocks) : NULL;
    }
    c->inserting_root = NULL;
    c->walk = NULL;
    if (root && root->n_children == 0) remove_root(c, root);
    pthread_mutex_unlock(&c->lock);
}

tl_prefix_cache_stats tl_pcache_stats(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    tl_prefix_cache_stats stats = c->stats;
    if (c->disk) stats.disk_bytes = tl_pdisk_bytes(c->disk), stats.disk_write_failures = tl_pdisk_failed_writes(c->disk);
    pthread_mutex_unlock(&c->lock);
    stats.size = sizeof stats;
    return stats;
}

size_t tl_pcache_use_order(tl_pcache* c, const tl_kv_block** out, size_t cap) {
    pthread_mutex_lock(&c->lock);
    size_t n = 0;
    for (const node* x = c->oldest; x; x = x->newer, n++)
        if (n < cap) out[n] = x->block;
    pthread_mutex_unlock(&c->lock);
    return n;
}

uint64_t tl_pcache_eviction_visits(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    const uint64_t visits = c->eviction_visits;
    pthread_mutex_unlock(&c->lock);
    return visits;
}
