/* kvcache.h — the paged quantized KV cache (docs/spec.md §4.2), reference-counted blocks.
 *
 * A block holds `block_size` consecutive positions starting at `start`, for `n_layers` cache
 * layers; per (layer, kv head) it stores kq[bs][R], vq[bs][R], sk[bs] f32, sv[bs] f32 (the
 * scales 4-byte aligned, tl_kv_scales_offset) with rows
 * of R = tl_kv_row_bytes bytes: D int8 values (kv_bits 8), or D Q4 values packed two per byte
 * (kv_bits 4: element 2i in the low nibble of byte i, 2i+1 in the high one, two's complement).
 * A table (one per sequence or prefix) is an ordered list of spans covering positions 0 .. n-1
 * contiguously: span i uses the first `count` slots of its block. Blocks are shared between
 * tables by reference count; a table writes only into a block it holds alone (refs == 1), so
 * a shared block is immutable and forking or continuing a prefix copies no block: the new
 * position simply opens a fresh block. Block memory is released when the last table drops it.
 * A new block's values are all zero, so the slots a pass never writes (with a coda, those of
 * shallower depths' codas) hold zeros when the block is saved or spilled (docs/spec.md §7.6).
 * Paging never changes a value: attention reads exactly the (kq, sk, vq, sv) that were written. */
#ifndef TL_KVCACHE_H
#define TL_KVCACHE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

/* Where block data lives when not in host memory: a backend's device allocator (backend.h).
 * alloc returns `bytes` of zero-filled device memory, or NULL when out of memory. download and
 * upload copy `bytes` between host memory and device data (after the writes already queued on
 * it), returning 0 on success; NULL where the device offers no copy (a prefix blob then cannot
 * be saved or loaded). copy does the same between two device data (NULL: a warm-start prefix
 * then keeps no states, core/seq.h). Every call is thread-safe. */
typedef struct tl_kv_allocator {
    void* (*alloc)(void* ctx, size_t bytes);
    void (*free)(void* ctx, void* data);
    void* ctx;
    int (*download)(void* ctx, void* host, const void* device, size_t bytes);
    int (*upload)(void* ctx, void* device, const void* host, size_t bytes);
    int (*copy)(void* ctx, void* dst, const void* src, size_t bytes);
} tl_kv_allocator;

typedef struct tl_kv_geom {
    uint32_t block_size, n_kv_heads, head_dim;
    uint32_t kv_bits;               /* 8 (int8 rows) or 4 (Q4 rows, two per byte)            */
    size_t head_bytes;              /* one (layer, kv head) of a block, 64-byte multiple      */
    const tl_kv_allocator* device;  /* block data comes from it; NULL = host memory          */
} tl_kv_geom;

typedef struct tl_kv_block {
    atomic_uint refs;
    uint32_t start;    /* first position */
    uint32_t n_layers;
    size_t bytes;      /* header + data, for accounting */
    void* data;        /* host: right after this 64-byte header; device: a device allocation */
    const tl_kv_allocator* device; /* owner of device data; NULL for host blocks */
} tl_kv_block;

typedef struct tl_kv_span {
    tl_kv_block* block; /* NULL once released by the window */
    uint32_t start, count;
} tl_kv_span;

typedef struct tl_kv_table {
    tl_kv_span* spans;
    size_t n_spans, cap;
    size_t first_live;  /* spans before it were released */
} tl_kv_table;

/* Where a table stood before a reservation, to roll back to. */
typedef struct tl_kv_mark {
    size_t n_spans;
    uint32_t last_count;
} tl_kv_mark;

/* Host-memory geometry; set .device afterwards to place block data on a device. */
tl_kv_geom tl_kv_geom_make(uint32_t block_size, uint32_t n_kv_heads, uint32_t head_dim, uint32_t kv_bits);

/* The KV mode (tinyloop.h) a geometry stores. */
static inline tl_kv_mode tl_kv_geom_mode(const tl_kv_geom* g) { return g->kv_bits == 4 ? TL_KV_INT4 : TL_KV_INT8; }

/* The table's current extent, to roll back to after later reservations. */
tl_kv_mark tl_kv_mark_now(const tl_kv_table* t);
/* Make room for positions n .. n+T-1 in n_layers layers. On failure (out of memory) the
 * table is unchanged. */
tl_status tl_kv_reserve(tl_kv_table* t, const tl_kv_geom* g, uint32_t n_layers, size_t n, size_t T);
void tl_kv_rollback(tl_kv_table* t, tl_kv_mark mark);
/* Release the blocks whose positions are all <= n - window (window > 0). */
void tl_kv_release_outside(tl_kv_table* t, size_t n, uint32_t window);
/* Append a span of `count` positions from `start` that shares block b (one more reference). */
tl_status tl_kv_push_shared(tl_kv_table* t, tl_kv_block* b, uint32_t start, uint32_t count);
/* dst (empty) shares every live block of src. */
tl_status tl_kv_share(tl_kv_table* dst, const tl_kv_table* src);
void tl_kv_clear(tl_kv_table* t);
/* Bytes of the live blocks the table references. */
size_t tl_kv_bytes(const tl_kv_table* t);
/* Bytes of one block of n_layers layers (header and data, as tl_kv_block.bytes). */
size_t tl_kv_block_bytes(const tl_kv_geom* g, uint32_t n_layers);
/* The live blocks the table holds alone (refs == 1): their count, and their bytes. */
size_t tl_kv_alone_bytes(const tl_kv_table* t, size_t* n_blocks);
/* Blocks tl_kv_reserve(t, g, n_layers, n, T) would allocate. */
size_t tl_kv_new_blocks(const tl_kv_table* t, const tl_kv_geom* g, uint32_t n_layers, size_t n, size_t T);
/* Index of the span holding position pos (which must be covered). */
size_t tl_kv_find(const tl_kv_table* t, size_t pos);
/* The first n_layers layers of block src's data into block dst's (each has at least that many):
 * a memcpy in host memory, the allocator's copy on a device (which must have one);
 * TL_ERR_INTERNAL when that copy fails. */
tl_status tl_kv_copy_block_layers(const tl_kv_geom* g, tl_kv_block* dst, const tl_kv_block* src, uint32_t n_layers);
/* Position pos's keys, values and their scales of layer `from` copied into layer `to`, every kv
 * head (int8 and int4 rows alike; docs/spec.md §5.7's "last available" KV of a token that exits
 * early). Host blocks only; pos must be covered by a block the table holds alone. */
void tl_kv_copy_layer(const tl_kv_geom* g, const tl_kv_table* t, size_t pos, uint32_t from, uint32_t to);

/* A block's reference count, for holders other than tables (the prefix cache). */
static inline void tl_kv_block_retain(tl_kv_block* b) { atomic_fetch_add(&b->refs, 1); }
static inline unsigned tl_kv_block_refs(const tl_kv_block* b) { return atomic_load(&b->refs); }
void tl_kv_block_release(tl_kv_block* b);

/* Bytes of one key or value row: D (int8) or D / 2 (int4, packed; D is even). */
static inline size_t tl_kv_row_bytes(const tl_kv_geom* g) { return (size_t)g->head_dim * g->kv_bits / 8; }

/* Per-(layer, kv head) arrays of a block: rows of tl_kv_row_bytes bytes, packed for int4 (device
 * addresses for a device block: only the backend that allocated them may dereference those). */
static inline int8_t* tl_kv_keys(const tl_kv_geom* g, tl_kv_block* b, uint32_t layer, uint32_t h) {
    return (int8_t*)b->data + ((size_t)layer * g->n_kv_heads + h) * g->head_bytes;
}
static inline int8_t* tl_kv_values(const tl_kv_geom* g, tl_kv_block* b, uint32_t layer, uint32_t h) {
    return tl_kv_keys(g, b, layer, h) + (size_t)g->block_size * tl_kv_row_bytes(g);
}
/* Offset of the key scales in a (layer, kv head)'s bytes: after both rows arrays, rounded up to
 * a float's alignment (int4 rows of an odd block size can end on an even, not a 4-byte, offset;
 * the rounding never changes head_bytes). */
static inline size_t tl_kv_scales_offset(const tl_kv_geom* g) {
    return (2 * (size_t)g->block_size * tl_kv_row_bytes(g) + 3) / 4 * 4;
}
static inline float* tl_kv_key_scales(const tl_kv_geom* g, tl_kv_block* b, uint32_t layer, uint32_t h) {
    return (float*)((char*)tl_kv_keys(g, b, layer, h) + tl_kv_scales_offset(g));
}
static inline float* tl_kv_value_scales(const tl_kv_geom* g, tl_kv_block* b, uint32_t layer, uint32_t h) {
    return tl_kv_key_scales(g, b, layer, h) + g->block_size;
}

/* Q4 values q[0 .. n) (each -8 .. 7, n even) into n / 2 bytes: q[2i] & 15 | (q[2i+1] & 15) << 4. */
static inline void tl_kv_pack4(const int8_t* q, size_t n, int8_t* out) {
    for (size_t i = 0; i < n / 2; i++)
        out[i] = (int8_t)(uint8_t)(((uint8_t)q[2 * i] & 15u) | ((uint8_t)q[2 * i + 1] & 15u) << 4);
}
/* The inverse: n values (n even) from n / 2 packed bytes, each nibble sign-extended. */
static inline void tl_kv_unpack4(const int8_t* packed, size_t n, int8_t* q) {
    for (size_t i = 0; i < n / 2; i++) {
        const uint8_t b = (uint8_t)packed[i];
        q[2 * i] = (int8_t)((int8_t)(uint8_t)(b << 4) >> 4);
        q[2 * i + 1] = (int8_t)((int8_t)b >> 4);
    }
}

#endif
