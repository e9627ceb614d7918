/* kv_records.c — KV blocks to and from §7.2 / §7.6 records (kv_records.h). */
#include "core/kv_records.h"

#include <stdio.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "base/le.h"

static size_t slot_bytes(const tl_kv_geom* g) { return (size_t)g->n_kv_heads * g->head_bytes; }

/* Slot `slot` of block b (its n_kv_heads (kq, vq, sk, sv) arrays, kvcache.h's layout) as a
 * one-layer block in host memory: b's own data, or `stage` for a device block. */
static tl_kv_block slot_view(const tl_kv_geom* g, tl_kv_block* b, uint32_t slot, void* stage) {
    void* data = b->device ? stage : (void*)tl_kv_keys(g, b, slot, 0);
    return (tl_kv_block){.start = b->start, .n_layers = 1, .data = data};
}

tl_status tl_kv_stage_new(const tl_kv_geom* g, const char* what, void** stage) {
    *stage = NULL;
    if (!g->device) return TL_OK;
    if (!g->device->download || !g->device->upload)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: this backend's KV blocks cannot be copied to the host", what);
    *stage = tl_alloc(slot_bytes(g));
    return *stage ? TL_OK : tl_fail_oom("KV record staging");
}

tl_status tl_kv_records_write(const tl_kv_geom* g, tl_kv_block* b, uint32_t slot, uint64_t from, uint64_t to,
                              void* stage, uint8_t* out, const char* what) {
    tl_kv_block v = slot_view(g, b, slot, stage);
    if (stage && g->device->download(g->device->ctx, stage, tl_kv_keys(g, b, slot, 0), slot_bytes(g)))
        return tl_fail(TL_ERR_INTERNAL, "%s: copying a KV block from the device failed", what);
    const size_t R = tl_kv_row_bytes(g), record = tl_kv_record_bytes(g);
    for (uint64_t pos = from; pos < to; pos++) {
        const size_t t = pos - b->start;
        for (uint32_t h = 0; h < g->n_kv_heads; h++) {
            uint8_t* r = out + ((pos - from) * g->n_kv_heads + h) * record;
            memcpy(r, tl_kv_keys(g, &v, 0, h) + t * R, R);
            memcpy(r + R, tl_kv_values(g, &v, 0, h) + t * R, R);
            wr_f32(r + 2 * R, tl_kv_key_scales(g, &v, 0, h)[t]);
            wr_f32(r + 2 * R + 4, tl_kv_value_scales(g, &v, 0, h)[t]);
        }
    }
    return TL_OK;
}

tl_status tl_kv_records_read(const tl_kv_geom* g, tl_kv_block* b, uint32_t slot, uint64_t from, uint64_t to,
                             void* stage, const uint8_t* in, const char* what) {
    tl_kv_block v = slot_view(g, b, slot, stage);
    memset(v.data, 0, slot_bytes(g));
    const size_t R = tl_kv_row_bytes(g), record = tl_kv_record_bytes(g);
    for (uint64_t pos = from; pos < to; pos++) {
        const size_t t = pos - b->start;
        for (uint32_t h = 0; h < g->n_kv_heads; h++) {
            const uint8_t* r = in + ((pos - from) * g->n_kv_heads + h) * record;
            memcpy(tl_kv_keys(g, &v, 0, h) + t * R, r, R);
            memcpy(tl_kv_values(g, &v, 0, h) + t * R, r + R, R);
            tl_kv_key_scales(g, &v, 0, h)[t] = rd_f32(r + 2 * R);
            tl_kv_value_scales(g, &v, 0, h)[t] = rd_f32(r + 2 * R + 4);
        }
    }
    if (stage && g->device->upload(g->device->ctx, tl_kv_keys(g, b, slot, 0), stage, slot_bytes(g)))
        return tl_fail(TL_ERR_INTERNAL, "%s: copying a KV block to the device failed", what);
    return TL_OK;
}

const char* tl_kv_row_bad(const uint8_t* q, size_t R, bool int4) {
    for (size_t i = 0; i < R; i++) {
        if (!int4 && q[i] == 0x80) return "holds -128";
        if (int4 && ((q[i] & 0x0f) == 0x08 || (q[i] & 0xf0) == 0x80)) return "holds the nibble -8";
    }
    return NULL;
}

bool tl_kv_record_bad(const uint8_t* r, size_t R, bool int4, char* why, size_t cap) {
    static const char* const what[2] = {"key", "value"};
    for (int k = 0; k < 2; k++) { /* §7.4: kq, vq, then the scales */
        const char* bad = tl_kv_row_bad(r + k * R, R, int4);
        if (bad) {
            snprintf(why, cap, "the %s row %s", what[k], bad);
            return true;
        }
    }
    for (int k = 0; k < 2; k++) {
        const float scale = rd_f32(r + 2 * R + 4 * k);
        if (!(scale >= 0.0f)) {
            snprintf(why, cap, "the %s scale is %g, must be >= 0", what[k], (double)scale);
            return true;
        }
    }
    return false;
}
