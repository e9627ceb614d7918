/* hidden.c — the layer input rows of a hidden-state prefix (contract: core/hidden.h; docs/spec.md
 * §5.4.1): recorded from a build's chunk passes with the portable §2 primitives, and turned back
 * into a sequence's KV through the backend's kv_from_rows. Row (slot, p) of q and a is at index
 * slot * (n - start) + (p - start). */
#include "core/hidden.h"

#include <stdbool.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/backend.h"
#include "core/numerics.h"
#include "core/seq.h"

/* Rows per kv_from_rows call: few calls (on CUDA each is uploads and a wait), and the pass's
 * scratch no larger than a prefill chunk of as many tokens makes it (Python's default chunk). */
enum { REBUILD_ROWS = 512 };

tl_hidden_rows* tl_hidden_new(tl_prefix_storage storage, uint32_t n_layers, size_t d, size_t n, uint32_t window,
                              float eps) {
    tl_hidden_rows* h = tl_alloc_zeroed(1, sizeof *h);
    if (!h) return NULL;
    h->storage = storage;
    h->n_layers = n_layers;
    h->d = d;
    h->start = window == 0 || n < window ? 0 : n - window + 1;
    h->n = n;
    h->row_bytes = storage == TL_STORE_H4 ? d / 2 : d;
    h->eps = eps;
    const size_t rows = (size_t)n_layers * (n - h->start);
    h->q = tl_alloc_zeroed(rows, h->row_bytes);
    h->a = tl_alloc_zeroed(rows, sizeof(float));
    if (h->q && h->a) return h;
    tl_hidden_free(h);
    return NULL;
}

void tl_hidden_free(tl_hidden_rows* h) {
    if (!h) return;
    tl_free(h->q);
    tl_free(h->a);
    tl_free(h);
}

size_t tl_hidden_bytes(const tl_hidden_rows* h) {
    return (size_t)h->n_layers * (h->n - h->start) * (h->row_bytes + sizeof(float));
}

/* The stored row of x[d] into q (row_bytes) and *a: h8 NQ(x) (§2.3); h4 Q4(x), packed as an int4
 * cache row, with a = s / t from its q as §2.3 steps 2-4 compute it. */
static void record(const tl_hidden_rows* h, const float* x, int8_t* q, float* a) {
    const bool h4 = h->storage == TL_STORE_H4;
    const float fq = h4 ? 7.0f : 127.0f;
    float r;
    const float s = tl_quantize_begin(x, h->d, fq, &r);
    int64_t ss = 0;
    int8_t pair[2];
    for (size_t i = 0; i < h->d; i++) {
        const int v = s == 0.0f ? 0 : tl_quantize_one(x[i], r, fq);
        ss += v * v;
        if (!h4) q[i] = (int8_t)v;
        pair[i % 2] = (int8_t)v;
        if (h4 && i % 2 == 1) tl_kv_pack4(pair, 2, q + i / 2);
    }
    *a = tl_nq_scale(ss, s, h->d, h->eps);
}

void tl_hidden_capture(tl_hidden_rows* h, uint32_t slot, size_t pos0, size_t T, const float* x) {
    const size_t stored = h->n - h->start;
    for (size_t t = 0; t < T; t++) {
        const size_t p = pos0 + t;
        if (p < h->start) continue;
        const size_t row = (size_t)slot * stored + (p - h->start);
        record(h, x + t * h->d, h->q + row * h->row_bytes, h->a + row);
    }
}

tl_status tl_hidden_rebuild(const tl_hidden_rows* h, tl_seq* s) {
    tl_engine* e = s->engine;
    const tl_config* c = tl_engine_config(e);
    tl_backend* b = e->backend;
    const size_t stored = h->n - h->start, d = h->d;
    const size_t chunk = stored < REBUILD_ROWS ? stored : REBUILD_ROWS;
    int8_t* unpacked = NULL; /* h4: [chunk][d] the rows as i8 */
    if (h->storage == TL_STORE_H4 && chunk > 0 && !(unpacked = tl_alloc(chunk * d)))
        return tl_fail_oom("hidden-state rows");
    /* position-major, as a prefill: a chunk's blocks reserved, every slot read written, then the
     * blocks the window no longer sees released, so at most about W + REBUILD_ROWS positions
     * are held at once (the positions before h_start are reserved and released, never written) */
    tl_status st = TL_OK;
    for (size_t p = 0; st == TL_OK && p < h->n;) {
        const size_t stop = p < h->start ? h->start : h->n, T = stop - p < REBUILD_ROWS ? stop - p : REBUILD_ROWS;
        st = tl_kv_reserve(&s->kv, &e->kv_geom, s->n_layers, p, T);
        for (uint32_t slot = 0; st == TL_OK && p >= h->start && slot < s->n_layers; slot++) {
            const uint32_t depth = tl_slot_at(c, slot).coda_depth;
            if (depth != 0 && depth != s->loops) continue; /* another depth's coda: never read */
            const size_t row = (size_t)slot * stored + (p - h->start);
            const int8_t* q = h->q + row * h->row_bytes;
            if (unpacked) {
                for (size_t t = 0; t < T; t++) tl_kv_unpack4(q + t * h->row_bytes, d, unpacked + t * d);
                q = unpacked;
            }
            st = b->iface->kv_from_rows(b, s, slot, p, T, q, h->a + row);
        }
        p += T;
        if (st == TL_OK) tl_kv_release_outside(&s->kv, p, s->window);
    }
    if (st != TL_OK) tl_kv_clear(&s->kv); /* empty again, as it came */
    tl_free(unpacked);
    return st;
}
