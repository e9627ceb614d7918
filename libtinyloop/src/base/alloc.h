/* alloc.h — the library's one allocator. Every allocation goes through here so that
 * tl_memory_stats_get() is exact and the tests can inject failures (tl_alloc_fail_after).
 * Blocks are 64-byte aligned (SIMD loads) and freed with tl_free (NULL is a no-op). */
#ifndef TL_ALLOC_H
#define TL_ALLOC_H

#include <stddef.h>
#include <stdint.h>

void* tl_alloc(size_t bytes);                   /* uninitialised; NULL on failure            */
void* tl_alloc_zeroed(size_t count, size_t size); /* zeroed; NULL on failure or overflow     */
void tl_free(void* p);
size_t tl_alloc_size(const void* p);             /* the size requested for p                */

/* For tests only (not exported by the shared library; the C tests link the objects): the
 * allocation that comes after `n` more successful ones fails (n = 0: the next one), once;
 * then injection switches itself off. n < 0 switches it off. Process-wide. */
void tl_alloc_fail_after(int64_t n);

/* Buffers laid out one after another in one arena, each at a 64-byte boundary: a layout
 * function takes them all with base NULL to measure (used = the arena's bytes), then again from
 * the arena's base. */
typedef struct tl_carve {
    size_t used;
    char* base;
} tl_carve;

/* The next `bytes` of the arena (NULL while measuring). */
static inline void* tl_take(tl_carve* c, size_t bytes) {
    void* p = c->base ? c->base + c->used : NULL;
    c->used += (bytes + 63) / 64 * 64;
    return p;
}

#endif
