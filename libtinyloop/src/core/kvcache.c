/* kvcache.c — paged, reference-counted KV blocks and per-sequence span tables (kvcache.h). */
#include "core/kvcache.h"

#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"

_Static_assert(sizeof(tl_kv_block) <= 64, "block header must fit in 64 bytes");

tl_kv_geom tl_kv_geom_make(uint32_t block_size, uint32_t n_kv_heads, uint32_t head_dim, uint32_t kv_bits) {
    tl_kv_geom g = {block_size, n_kv_heads, head_dim, kv_bits, 0, NULL};
    const size_t bytes = tl_kv_scales_offset(&g) + 2 * sizeof(float) * block_size;
    g.head_bytes = (bytes + 63) / 64 * 64;
    return g;
}

size_t tl_kv_block_bytes(const tl_kv_geom* g, uint32_t n_layers) {
    return 64 + (size_t)n_layers * g->n_kv_heads * g->head_bytes;
}

static tl_kv_block* block_new(const tl_kv_geom* g, uint32_t n_layers, uint32_t start) {
    const size_t data_bytes = tl_kv_block_bytes(g, n_layers) - 64;
    tl_kv_block* b = tl_alloc(g->device ? 64 : 64 + data_bytes);
    if (!b) return NULL;
    b->data = g->device ? g->device->alloc(g->device->ctx, data_bytes) : (char*)b + 64;
    if (!b->data) {
        tl_free(b);
        return NULL;
    }
    if (!g->device) memset(b->data, 0, data_bytes); /* as device data: slots a pass never writes read as zero */
    atomic_init(&b->refs, 1);
    b->start = start;
    b->n_layers = n_layers;
    b->bytes = 64 + data_bytes;
    b->device = g->device;
    return b;
}

void tl_kv_block_release(tl_kv_block* b) {
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
    if (b->device) b->device->free(b->device->ctx, b->data);
    tl_free(b);
}

static int grow(tl_kv_table* t, size_t need) {
    if (need <= t->cap) return 1;
    size_t cap = t->cap ? t->cap : 8;
    while (cap < need) cap *= 2;
    tl_kv_span* spans = tl_alloc(cap * sizeof *spans);
    if (!spans) return 0;
    if (t->n_spans) memcpy(spans, t->spans, t->n_spans * sizeof *spans);
    tl_free(t->spans);
    t->spans = spans;
    t->cap = cap;
    return 1;
}

tl_kv_mark tl_kv_mark_now(const tl_kv_table* t) {
    tl_kv_mark mark = {t->n_spans, t->n_spans ? t->spans[t->n_spans - 1].count : 0};
    return mark;
}

/* Positions the table's last span can still take at position n: its block is live, deep
 * enough, held alone and ends at n (else tl_kv_reserve opens a new block). */
static size_t last_span_room(const tl_kv_table* t, const tl_kv_geom* g, uint32_t n_layers, size_t n) {
    const tl_kv_span* last = t->n_spans ? &t->spans[t->n_spans - 1] : NULL;
    if (!last || !last->block || last->count >= g->block_size || last->block->n_layers < n_layers ||
        last->start + last->count != n || atomic_load(&last->block->refs) != 1)
        return 0;
    return g->block_size - last->count;
}

size_t tl_kv_new_blocks(const tl_kv_table* t, const tl_kv_geom* g, uint32_t n_layers, size_t n, size_t T) {
    const size_t room = last_span_room(t, g, n_layers, n);
    return T <= room ? 0 : (T - room + g->block_size - 1) / g->block_size;
}

size_t tl_kv_alone_bytes(const tl_kv_table* t, size_t* n_blocks) {
    size_t bytes = 0, blocks = 0;
    for (size_t i = t->first_live; i < t->n_spans; i++) {
        const tl_kv_block* b = t->spans[i].block;
        if (atomic_load(&b->refs) != 1) continue;
        bytes += b->bytes;
        blocks++;
    }
    if (n_blocks) *n_blocks = blocks;
    return bytes;
}

tl_status tl_kv_reserve(tl_kv_table* t, const tl_kv_geom* g, uint32_t n_layers, size_t n, size_t T) {
    const tl_kv_mark mark = tl_kv_mark_now(t);
    size_t pos = n;
    const size_t end = n + T;
    while (pos < end) {
        size_t take = last_span_room(t, g, n_layers, pos);
        if (take) {
            if (take > end - pos) take = end - pos;
            t->spans[t->n_spans - 1].count += (uint32_t)take;
            pos += take;
            continue;
        }
        tl_kv_block* b = grow(t, t->n_spans + 1) ? block_new(g, n_layers, (uint32_t)pos) : NULL;
        if (!b) {
            tl_kv_rollback(t, mark);
            return tl_fail_oom("KV cache block");
        }
        take = g->block_size < end - pos ? g->block_size : end - pos;
        t->spans[t->n_spans++] = (tl_kv_span){b, (uint32_t)pos, (uint32_t)take};
        pos += take;
    }
    return TL_OK;
}

void tl_kv_rollback(tl_kv_table* t, tl_kv_mark mark) {
    while (t->n_spans > mark.n_spans) tl_kv_block_release(t->spans[--t->n_spans].block);
    if (t->n_spans) t->spans[t->n_spans - 1].count = mark.last_count;
}

void tl_kv_release_outside(tl_kv_table* t, size_t n, uint32_t window) {
    if (window == 0) return;
    while (t->first_live < t->n_spans) {
        tl_kv_span* s = &t->spans[t->first_live];
        /* last position start + count - 1 <= n - window */
        if ((size_t)s->start + s->count + window > n + 1) break;
        tl_kv_block_release(s->block);
        s->block = NULL;
        t->first_live++;
    }
}

tl_status tl_kv_push_shared(tl_kv_table* t, tl_kv_block* b, uint32_t start, uint32_t count) {
    if (!grow(t, t->n_spans + 1)) return tl_fail_oom("KV span table");
    tl_kv_block_retain(b);
    t->spans[t->n_spans++] = (tl_kv_span){b, start, count};
    return TL_OK;
}

tl_status tl_kv_share(tl_kv_table* dst, const tl_kv_table* src) {
    memset(dst, 0, sizeof *dst);
    const size_t live = src->n_spans - src->first_live;
    if (live == 0) return TL_OK;
    if (!grow(dst, live)) return tl_fail_oom("KV span table");
    for (size_t i = 0; i < live; i++) {
        dst->spans[i] = src->spans[src->first_live + i];
        tl_kv_block_retain(dst->spans[i].block);
    }
    dst->n_spans = live;
    return TL_OK;
}

void tl_kv_clear(tl_kv_table* t) {
    for (size_t i = t->first_live; i < t->n_spans; i++) tl_kv_block_release(t->spans[i].block);
    tl_free(t->spans);
    memset(t, 0, sizeof *t);
}

size_t tl_kv_bytes(const tl_kv_table* t) {
    size_t bytes = 0;
    for (size_t i = t->first_live; i < t->n_spans; i++) bytes += t->spans[i].block->bytes;
    return bytes;
}

size_t tl_kv_find(const tl_kv_table* t, size_t pos) {
    size_t lo = t->first_live, hi = t->n_spans; /* spans[lo].start <= pos < end of spans[hi-1] */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->spans[mid].start <= pos) lo = mid;
        else hi = mid;
    }
    return lo;
}

void tl_kv_copy_layer(const tl_kv_geom* g, const tl_kv_table* t, size_t pos, uint32_t from, uint32_t to) {
    const tl_kv_span* span = &t->spans[tl_kv_find(t, pos)];
    const size_t slot = pos - span->start, R = tl_kv_row_bytes(g);
    for (uint32_t h = 0; h < g->n_kv_heads; h++) {
        memcpy(tl_kv_keys(g, span->block, to, h) + slot * R, tl_kv_keys(g, span->block, from, h) + slot * R, R);
        memcpy(tl_kv_values(g, span->block, to, h) + slot * R, tl_kv_values(g, span->block, from, h) + slot * R, R);
        tl_kv_key_scales(g, span->block, to, h)[slot] = tl_kv_key_scales(g, span->block, from, h)[slot];
        tl_kv_value_scales(g, span->block, to, h)[slot] = tl_kv_value_scales(g, span->block, from, h)[slot];
    }
}

tl_status tl_kv_copy_block_layers(const tl_kv_geom* g, tl_kv_block* dst, const tl_kv_block* src, uint32_t n_layers) {
    const size_t bytes = (size_t)n_layers * g->n_kv_heads * g->head_bytes;
    if (!dst->device) {
        memcpy(dst->data, src->data, bytes);
        return TL_OK;
    }
    if (dst->device->copy(dst->device->ctx, dst->data, src->data, bytes) == 0) return TL_OK;
    return tl_fail(TL_ERR_INTERNAL, "copying %zu bytes of KV block data on the device failed", bytes);
}
