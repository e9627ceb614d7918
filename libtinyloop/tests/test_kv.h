/* test_kv.h — KV comparisons shared by the internal tests (those linking the library's objects). */
#ifndef TL_TEST_KV_H
#define TL_TEST_KV_H

#include <string.h>

#include "core/seq.h"

/* Positions [from, n) of a and b hold the same keys, values and scales (int8 or int4 rows) in
 * every layer a pass at their depth writes and, with `all_depths`, in every other depth's coda
 * slots too (their tables cover the same positions with the same spans). */
static inline int tu_same_seq_kv(const tl_seq* a, const tl_seq* b, size_t from, size_t n, int all_depths) {
    const tl_kv_geom* g = &a->engine->kv_geom;
    const tl_config* c = tl_engine_config(a->engine);
    const size_t R = tl_kv_row_bytes(g);
    for (size_t pos = from; pos < n; pos++) {
        const tl_kv_span* sa = &a->kv.spans[tl_kv_find(&a->kv, pos)];
        const tl_kv_span* sb = &b->kv.spans[tl_kv_find(&b->kv, pos)];
        const size_t slot = pos - sa->start;
        if (sb->start != sa->start) return 0;
        for (uint32_t l = 0; l < a->n_layers; l++) {
            const uint32_t coda_depth = tl_slot_at(c, l).coda_depth;
            if (!all_depths && coda_depth != 0 && coda_depth != a->loops) continue; /* never written */
            for (uint32_t h = 0; h < g->n_kv_heads; h++) {
                tl_kv_block *x = sa->block, *y = sb->block;
                if (memcmp(tl_kv_keys(g, x, l, h) + slot * R, tl_kv_keys(g, y, l, h) + slot * R, R) ||
                    memcmp(tl_kv_values(g, x, l, h) + slot * R, tl_kv_values(g, y, l, h) + slot * R, R) ||
                    memcmp(&tl_kv_key_scales(g, x, l, h)[slot], &tl_kv_key_scales(g, y, l, h)[slot], 4) ||
                    memcmp(&tl_kv_value_scales(g, x, l, h)[slot], &tl_kv_value_scales(g, y, l, h)[slot], 4))
                    return 0;
            }
        }
    }
    return 1;
}

#endif
