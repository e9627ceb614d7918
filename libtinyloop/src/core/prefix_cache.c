/* prefix_cache.c — the automatic prefix cache (prefix_cache.h, docs/spec.md §4.3).
 *
 * Nodes live in one chained hash table keyed by (parent node, the block's tokens); roots, one
 * per (salt, window), sit in a short list. Eviction scans for the least recently used leaf
 * whose block only the cache holds: O(nodes) per eviction, which is small next to the
 * prefill an eviction is part of. Every node touched by the current call carries the call's
 * tick and is never evicted by it, so the chain being extended stays put. Each lookup and each
 * insert is one tick.
 */
#include "core/prefix_cache.h"

#include <pthread.h>
#include <string.h>

#include "base/alloc.h"

typedef struct node {
    struct node* parent;  /* NULL for a root                                   */
    struct node* next;    /* next node in the hash chain or the root list      */
    tl_kv_block* block;   /* one reference held; NULL for a root               */
    uint64_t hash;
    uint64_t last_used;   /* tick of the last call that used it                */
    size_t n_children;
    uint32_t window;      /* roots                                             */
    char* salt;           /* roots: owned copy                                 */
    int32_t tokens[];     /* [block_size]: the block's tokens (block nodes)    */
} node;

struct tl_pcache {
    pthread_mutex_t lock;
    tl_kv_geom geom;
    size_t budget;
    node* roots;
    node** buckets;       /* [n_buckets], a power of two                       */
    size_t n_buckets, n_nodes;
    uint64_t tick;
    tl_prefix_cache_stats stats;
};

/* ---- nodes ---------------------------------------------------------------------------------- */

static uint64_t block_hash(const node* parent, const int32_t* tokens, uint32_t n) {
    uint64_t h = 0xcbf29ce484222325u ^ (uint64_t)(uintptr_t)parent;
    for (uint32_t i = 0; i < n; i++) h = (h ^ (uint32_t)tokens[i]) * 0x100000001b3u;
    return h ^ (h >> 29);
}

static node** bucket_of(tl_pcache* c, uint64_t hash) { return &c->buckets[hash & (c->n_buckets - 1)]; }

static node* find_child(tl_pcache* c, const node* parent, const int32_t* tokens) {
    const uint32_t bs = c->geom.block_size;
    const uint64_t h = block_hash(parent, tokens, bs);
    for (node* x = *bucket_of(c, h); x; x = x->next)
        if (x->hash == h && x->parent == parent && memcmp(x->tokens, tokens, bs * sizeof *tokens) == 0)
            return x;
    return NULL;
}

static node* find_root(tl_pcache* c, const char* salt, uint32_t window) {
    for (node* r = c->roots; r; r = r->next)
        if (r->window == window && strcmp(r->salt, salt) == 0) return r;
    return NULL;
}

static node* make_root(tl_pcache* c, const char* salt, uint32_t window) {
    node* r = tl_alloc_zeroed(1, sizeof *r);
    const size_t len = strlen(salt) + 1;
    char* copy = r ? tl_alloc(len) : NULL;
    if (!copy) {
        tl_free(r);
        return NULL;
    }
    memcpy(copy, salt, len);
    r->salt = copy;
    r->window = window;
    r->next = c->roots;
    c->roots = r;
    return r;
}

/* Roots exist while they have children: evictions may leave one empty. */
static void drop_childless_roots(tl_pcache* c) {
    for (node** p = &c->roots; *p;) {
        node* r = *p;
        if (r->n_children) {
            p = &r->next;
            continue;
        }
        *p = r->next;
        tl_free(r->salt);
        tl_free(r);
    }
}

/* Double the bucket array when the table is fuller than one node per bucket; keeps the old
 * array if memory is short (chains just get longer). */
static void maybe_grow(tl_pcache* c) {
    if (c->n_nodes < c->n_buckets) return;
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

static node* add_child(tl_pcache* c, node* parent, const int32_t* tokens, tl_kv_block* block) {
    const uint32_t bs = c->geom.block_size;
    node* x = tl_alloc_zeroed(1, sizeof *x + bs * sizeof(int32_t));
    if (!x) return NULL;
    memcpy(x->tokens, tokens, bs * sizeof *tokens);
    x->parent = parent;
    x->hash = block_hash(parent, tokens, bs);
    x->block = block;
    tl_kv_block_retain(block);
    maybe_grow(c);
    node** b = bucket_of(c, x->hash);
    x->next = *b;
    *b = x;
    c->n_nodes++;
    parent->n_children++;
    c->stats.blocks++;
    c->stats.bytes_in_use += block->bytes;
    c->stats.inserted_blocks++;
    return x;
}

/* Unlink a leaf, drop its block and free it. */
static void remove_leaf(tl_pcache* c, node* x) {
    for (node** p = bucket_of(c, x->hash); *p; p = &(*p)->next)
        if (*p == x) {
            *p = x->next;
            break;
        }
    c->n_nodes--;
    c->stats.blocks--;
    c->stats.bytes_in_use -= x->block->bytes;
    tl_kv_block_release(x->block);
    x->parent->n_children--;
    tl_free(x);
}

/* ---- eviction -------------------------------------------------------------------------------- */

static bool evictable(const tl_pcache* c, const node* x) {
    return x->n_children == 0 && x->last_used != c->tick && tl_kv_block_refs(x->block) == 1;
}

static node* least_recently_used(tl_pcache* c) {
    node* best = NULL;
    for (size_t i = 0; i < c->n_buckets; i++)
        for (node* x = c->buckets[i]; x; x = x->next)
            if (evictable(c, x) && (!best || x->last_used < best->last_used)) best = x;
    return best;
}

/* Evict until `extra` more bytes fit in the budget; false if they cannot. */
static bool make_room(tl_pcache* c, size_t extra) {
    if (extra > c->budget) return false;
    while (c->stats.bytes_in_use > c->budget - extra) {
        node* victim = least_recently_used(c);
        if (!victim) return false;
        remove_leaf(c, victim);
        c->stats.evicted_blocks++;
    }
    return true;
}

/* ---- the interface ---------------------------------------------------------------------------- */

tl_pcache* tl_pcache_new(const tl_kv_geom* g, size_t budget_bytes) {
    tl_pcache* c = tl_alloc_zeroed(1, sizeof *c);
    if (!c) return NULL;
    c->n_buckets = 64;
    c->buckets = tl_alloc_zeroed(c->n_buckets, sizeof *c->buckets);
    if (!c->buckets) {
        tl_free(c);
        return NULL;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->geom = *g;
    c->budget = budget_bytes;
    c->stats.budget_bytes = budget_bytes;
    return c;
}

/* Remove every node, leaves first (a node's children precede it in no particular order, so
 * sweep until nothing is left). */
static void remove_all(tl_pcache* c) {
    while (c->n_nodes)
        for (size_t i = 0; i < c->n_buckets; i++)
            for (node *x = c->buckets[i], *next; x; x = next) {
                next = x->next;
                if (x->n_children == 0) remove_leaf(c, x);
            }
    drop_childless_roots(c);
}

void tl_pcache_clear(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    remove_all(c);
    pthread_mutex_unlock(&c->lock);
}

void tl_pcache_free(tl_pcache* c) {
    if (!c) return;
    remove_all(c);
    pthread_mutex_destroy(&c->lock);
    tl_free(c->buckets);
    tl_free(c);
}

static const char* salt_of(const tl_pcache_key* key) { return key->salt ? key->salt : ""; }

void tl_pcache_lookup(tl_pcache* c, const tl_pcache_key* key, const int32_t* tokens, size_t n,
                      tl_kv_table* t, size_t* hit) {
    const uint32_t bs = c->geom.block_size;
    const size_t max_blocks = n ? (n - 1) / bs : 0;
    size_t k = 0;
    pthread_mutex_lock(&c->lock);
    c->tick++;
    c->stats.lookups++;
    node* parent = find_root(c, salt_of(key), key->window);
    while (parent && k < max_blocks) {
        node* x = find_child(c, parent, tokens + k * bs);
        if (!x || x->block->n_layers < key->n_layers) break;
        if (tl_kv_push_shared(t, x->block, (uint32_t)(k * bs), bs) != TL_OK) {
            tl_kv_clear(t);
            k = 0;
            break;
        }
        x->last_used = c->tick;
        parent = x;
        k++;
    }
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
    c->tick++;
    node* parent = find_root(c, salt_of(key), key->window);
    if (!parent) parent = make_root(c, salt_of(key), key->window);
    for (size_t i = 0; parent && i < n / bs; i++) {
        tl_kv_block* mine = aligned_block(t, i, bs);
        if (!mine) break;
        node* x = find_child(c, parent, tokens + i * bs);
        if (x) {
            x->last_used = c->tick;  /* protected from this call's evictions */
            tl_kv_block* theirs = x->block;
            if (theirs->n_layers < mine->n_layers && make_room(c, mine->bytes - theirs->bytes)) {
                c->stats.bytes_in_use += mine->bytes - theirs->bytes;  /* the deeper block serves more */
                tl_kv_block_retain(mine);
                tl_kv_block_release(theirs);
                x->block = mine;
            }
        } else if (make_room(c, mine->bytes)) {
            x = add_child(c, parent, tokens + i * bs, mine);
            if (x) x->last_used = c->tick;
        }
        parent = x;
    }
    drop_childless_roots(c);
    pthread_mutex_unlock(&c->lock);
}

tl_prefix_cache_stats tl_pcache_stats(tl_pcache* c) {
    pthread_mutex_lock(&c->lock);
    tl_prefix_cache_stats stats = c->stats;
    pthread_mutex_unlock(&c->lock);
    stats.size = sizeof stats;
    return stats;
}
