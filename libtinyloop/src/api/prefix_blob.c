/* prefix_blob.c — tl_prefix_save / tl_prefix_load: a prefix as bytes (docs/spec.md §7).
 *
 * The blob holds what generations and extensions read from a prefix: its tokens, the last
 * token's state at each depth, the KV rows of every cache slot from the first position it still
 * holds, and for warm start the tokens' kept states. Save writes the rows one by one from
 * whatever blocks hold them; load pages them into blocks of this model's kv_block_size laid out
 * as a build lays them out (block i from position i * block_size, those outside the window
 * released; the positions of a kept block before kv_start are zero, never visible), so the
 * loaded prefix generates, extends and saves again as the saved one does.
 *
 * Load checks every rule of §7 on the caller's bytes, in the spec's order, before it allocates
 * anything sized by them; all size arithmetic is overflow-checked and no read goes past
 * buf[0 .. n). Device blocks (kvcache.h's allocator) go through its download / upload hooks,
 * one cache slot of one block at a time. */
#include <string.h>

#include "base/alloc.h"
#include "base/crc32.h"
#include "base/errors.h"
#include "base/le.h"
#include "core/seq.h"

enum { HEADER_BYTES = 96, VERSION = 1, CHECKSUM_AT = 24 };
enum { FLAG_WARM_START = 1, FLAG_STATES = 2 };

/* Where everything is in a blob, from its header fields (or a prefix's). */
typedef struct layout {
    uint32_t kv_mode, loops, window, flags, n_layers;
    uint64_t n, kv_start;
    size_t R, record;    /* bytes of a kq / vq row; of one (slot, position, kv head) record */
    uint64_t loop_states_at, kv_at, states_at, injects_at, bytes;
} layout;

static const char* mode_name(uint32_t kv_mode) { return kv_mode == TL_KV_INT4 ? "int4" : "int8"; }

/* Fills the offsets of l (its counts set) for a model of kv heads G and width d; false when a
 * size passes 2^64 bytes. */
static bool place(layout* l, uint64_t G, uint64_t d, bool injection) {
    const uint64_t rows = l->n - l->kv_start;
    uint64_t tokens, loop_states, records, kv, states = 0;
    bool over = __builtin_mul_overflow(l->n, 4, &tokens) ||
                __builtin_mul_overflow((uint64_t)l->loops * 4, d, &loop_states) ||
                __builtin_mul_overflow((uint64_t)l->n_layers * G, rows, &records) ||
                __builtin_mul_overflow(records, (uint64_t)l->record, &kv);
    if (l->flags & FLAG_STATES) over = over || __builtin_mul_overflow(tokens, d, &states);
    over = over || __builtin_add_overflow(HEADER_BYTES, tokens, &l->loop_states_at) ||
           __builtin_add_overflow(l->loop_states_at, loop_states, &l->kv_at) ||
           __builtin_add_overflow(l->kv_at, kv, &l->states_at) ||
           __builtin_add_overflow(l->states_at, states, &l->injects_at) ||
           __builtin_add_overflow(l->injects_at, injection ? states : 0, &l->bytes);
    return !over;
}

/* The blob's record of (slot, position, kv head). */
static uint64_t record_at(const layout* l, uint32_t G, uint32_t slot, uint64_t pos, uint32_t h) {
    return l->kv_at + (((uint64_t)slot * (l->n - l->kv_start) + (pos - l->kv_start)) * G + h) * l->record;
}

/* Slot `layer` of block b (its n_kv_heads (kq, vq, sk, sv) arrays, kvcache.h's layout) as a
 * one-layer block in host memory: b's own data, or `stage` for a device block. */
static tl_kv_block slot_view(const tl_kv_geom* g, tl_kv_block* b, uint32_t layer, void* stage) {
    void* data = b->device ? stage : (void*)tl_kv_keys(g, b, layer, 0);
    return (tl_kv_block){.start = b->start, .n_layers = 1, .data = data};
}

static size_t slot_bytes(const tl_kv_geom* g) { return (size_t)g->n_kv_heads * g->head_bytes; }

/* A staging buffer for one slot of a device block (NULL and TL_OK for host blocks). */
static tl_status stage_new(const tl_kv_geom* g, const char* direction, void** stage) {
    *stage = NULL;
    if (!g->device) return TL_OK;
    if (!g->device->download || !g->device->upload)
        return tl_fail(TL_ERR_UNSUPPORTED, "prefix %s: this backend's KV blocks cannot be copied to the host",
                       direction);
    *stage = tl_alloc(slot_bytes(g));
    return *stage ? TL_OK : tl_fail_oom("prefix blob staging");
}

/* ---- save ----------------------------------------------------------------------------------- */

/* The layout of p's blob (its lock held). */
static layout prefix_layout(const tl_prefix* p) {
    const tl_engine* e = p->engine;
    const tl_config* c = tl_engine_config(e);
    layout l = {.kv_mode = tl_kv_geom_mode(&e->kv_geom), .loops = p->loops, .window = p->window, .n = p->n};
    l.flags = (p->warm_start ? FLAG_WARM_START : 0) | (p->states ? FLAG_STATES : 0);
    l.n_layers = (uint32_t)tl_n_layers(c, l.loops);
    const tl_kv_table* t = &p->kv; /* window 1 releases every block: then nothing is stored */
    l.kv_start = t->first_live < t->n_spans ? t->spans[t->first_live].start : p->n;
    l.R = tl_kv_row_bytes(&e->kv_geom);
    l.record = 2 * l.R + 8;
    place(&l, c->n_kv_heads, c->d_model, p->injects != NULL); /* no overflow: it is what p holds */
    return l;
}

static void write_f32s(uint8_t* out, const float* x, size_t n) {
    for (size_t i = 0; i < n; i++) wr_f32(out + 4 * i, x[i]);
}

/* The KV records of the positions >= kv_start of every live block, slot by slot. */
static tl_status write_kv(const tl_prefix* p, const layout* l, uint8_t* blob) {
    const tl_kv_geom* g = &p->engine->kv_geom;
    void* stage;
    tl_status st = stage_new(g, "save", &stage);
    for (size_t i = p->kv.first_live; st == TL_OK && i < p->kv.n_spans; i++) {
        const tl_kv_span* s = &p->kv.spans[i];
        const uint64_t from = s->start > l->kv_start ? s->start : l->kv_start, to = (uint64_t)s->start + s->count;
        for (uint32_t slot = 0; st == TL_OK && slot < l->n_layers; slot++) {
            tl_kv_block v = slot_view(g, s->block, slot, stage);
            if (stage && g->device->download(g->device->ctx, stage, tl_kv_keys(g, s->block, slot, 0), slot_bytes(g)))
                st = tl_fail(TL_ERR_INTERNAL, "prefix save: copying a KV block from the device failed");
            for (uint64_t pos = from; st == TL_OK && pos < to; pos++) {
                const size_t t = pos - s->block->start;
                for (uint32_t h = 0; h < g->n_kv_heads; h++) {
                    uint8_t* r = blob + record_at(l, g->n_kv_heads, slot, pos, h);
                    memcpy(r, tl_kv_keys(g, &v, 0, h) + t * l->R, l->R);
                    memcpy(r + l->R, tl_kv_values(g, &v, 0, h) + t * l->R, l->R);
                    wr_f32(r + 2 * l->R, tl_kv_key_scales(g, &v, 0, h)[t]);
                    wr_f32(r + 2 * l->R + 4, tl_kv_value_scales(g, &v, 0, h)[t]);
                }
            }
        }
    }
    tl_free(stage);
    return st;
}

static tl_status write_blob(const tl_prefix* p, const layout* l, uint8_t* blob) {
    const tl_engine* e = p->engine;
    const tl_config* c = tl_engine_config(e);
    memset(blob, 0, HEADER_BYTES);
    memcpy(blob, "TLPREFIX", 8);
    wr_u32(blob + 8, VERSION);
    wr_u32(blob + 12, HEADER_BYTES);
    wr_u64(blob + 16, l->bytes);
    wr_u32(blob + 28, e->file.checksum);
    wr_u64(blob + 32, e->file.file_bytes);
    wr_u32(blob + 40, l->kv_mode);
    wr_u32(blob + 44, l->loops);
    wr_u32(blob + 48, l->window);
    wr_u32(blob + 52, l->flags);
    wr_u64(blob + 56, l->n);
    wr_u64(blob + 64, l->kv_start);
    wr_u32(blob + 72, l->n_layers);
    wr_u32(blob + 76, c->n_kv_heads);
    wr_u32(blob + 80, c->head_dim);
    wr_u32(blob + 84, c->d_model);
    for (size_t i = 0; i < l->n; i++) wr_u32(blob + HEADER_BYTES + 4 * i, (uint32_t)p->tokens[i]);
    write_f32s(blob + l->loop_states_at, p->loop_states, (size_t)l->loops * c->d_model);
    tl_status st = write_kv(p, l, blob);
    if (st != TL_OK) return st;
    if (p->states) write_f32s(blob + l->states_at, p->states, l->n * c->d_model);
    if (p->injects) write_f32s(blob + l->injects_at, p->injects, l->n * c->d_model);
    wr_u32(blob + CHECKSUM_AT, tl_crc32(0, blob, l->bytes)); /* summed with the field still zero */
    return TL_OK;
}

TL_API tl_status tl_prefix_save(const tl_prefix* p, void* buf, size_t cap, size_t* size) {
    if (!p || !size) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix or size is NULL");
    *size = 0;
    tl_status st = tl_engine_check_open(p->engine);
    if (st != TL_OK) return st;
    pthread_rwlock_rdlock((pthread_rwlock_t*)&p->lock); /* an extension swaps under it */
    const layout l = prefix_layout(p);
    *size = l.bytes;
    if (buf && cap < l.bytes)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "cap: %zu bytes, the prefix blob needs %zu", cap, (size_t)l.bytes);
    else if (buf)
        st = write_blob(p, &l, buf);
    pthread_rwlock_unlock((pthread_rwlock_t*)&p->lock);
    return st;
}

/* ---- load: the checks ----------------------------------------------------------------------- */

#define bad(...) tl_fail_bad_file("prefix blob", __VA_ARGS__)

/* magic .. checksum: the blob is whole. */
static tl_status check_frame(const uint8_t* b, size_t n) {
    if (n < HEADER_BYTES) return bad("too small: %zu bytes < the %d-byte header", n, HEADER_BYTES);
    if (memcmp(b, "TLPREFIX", 8) != 0) return bad("bad magic, expected \"TLPREFIX\"");
    if (rd_u32(b + 8) != VERSION) return bad("version: unsupported %u, expected %d", rd_u32(b + 8), VERSION);
    if (rd_u32(b + 12) != HEADER_BYTES) return bad("header_bytes: must be %d, got %u", HEADER_BYTES, rd_u32(b + 12));
    if (rd_u64(b + 16) != n)
        return bad("blob_bytes: header says %llu, blob has %zu bytes", (unsigned long long)rd_u64(b + 16), n);
    const uint8_t zero[4] = {0};
    uint32_t crc = tl_crc32(0, b, CHECKSUM_AT);
    crc = tl_crc32(crc, zero, sizeof zero);
    crc = tl_crc32(crc, b + CHECKSUM_AT + 4, n - CHECKSUM_AT - 4);
    if (crc != rd_u32(b + CHECKSUM_AT))
        return bad("checksum mismatch: header 0x%08x, computed 0x%08x", rd_u32(b + CHECKSUM_AT), crc);
    return TL_OK;
}

/* model identity, kv_mode, geometry, then the ranges: *l from the header. */
static tl_status check_header(const tl_engine* e, const uint8_t* b, layout* l) {
    const tl_config* c = tl_engine_config(e);
    if (rd_u32(b + 28) != e->file.checksum)
        return bad("this prefix was saved from another model (checksum 0x%08x, this model 0x%08x)", rd_u32(b + 28),
                   e->file.checksum);
    if (rd_u64(b + 32) != e->file.file_bytes)
        return bad("this prefix was saved from another model (file_bytes %llu, this model %llu)",
                   (unsigned long long)rd_u64(b + 32), (unsigned long long)e->file.file_bytes);
    *l = (layout){.kv_mode = rd_u32(b + 40), .loops = rd_u32(b + 44), .window = rd_u32(b + 48),
                  .flags = rd_u32(b + 52), .n = rd_u64(b + 56), .kv_start = rd_u64(b + 64), .n_layers = rd_u32(b + 72)};
    if (l->kv_mode != TL_KV_INT8 && l->kv_mode != TL_KV_INT4)
        return bad("kv_mode: unknown %u (0 = int8, 1 = int4)", l->kv_mode);
    if (l->kv_mode != tl_kv_geom_mode(&e->kv_geom))
        return bad("this prefix was saved with kv_mode %s; this model runs %s", mode_name(l->kv_mode),
                   mode_name(tl_kv_geom_mode(&e->kv_geom)));
    const uint32_t geometry[3] = {c->n_kv_heads, c->head_dim, c->d_model};
    static const char* const names[3] = {"n_kv_heads", "head_dim", "d_model"};
    for (int i = 0; i < 3; i++)
        if (rd_u32(b + 76 + 4 * i) != geometry[i])
            return bad("%s: %u, this model has %u", names[i], rd_u32(b + 76 + 4 * i), geometry[i]);
    if (l->loops < 1 || l->loops > TL_MAX_LOOPS) return bad("loops: %u, must be 1 .. %d", l->loops, TL_MAX_LOOPS);
    const size_t n_layers = tl_n_layers(c, l->loops);
    if (n_layers > TL_MAX_CACHE_LAYERS)
        return bad("loops: %u needs %zu cache layers, more than %d", l->loops, n_layers, TL_MAX_CACHE_LAYERS);
    if (l->n_layers != n_layers) return bad("n_layers: %u, loops=%u makes %zu", l->n_layers, l->loops, n_layers);
    if (l->flags & ~(uint32_t)(FLAG_WARM_START | FLAG_STATES))
        return bad("flags: unknown bits 0x%x", l->flags & ~(uint32_t)(FLAG_WARM_START | FLAG_STATES));
    if ((l->flags & FLAG_STATES) && !(l->flags & FLAG_WARM_START))
        return bad("flags: states (bit 1) without warm start (bit 0)");
    if (l->n < 1 || l->n > c->max_seq_len)
        return bad("n_tokens: %llu, must be 1 .. max_seq_len %u", (unsigned long long)l->n, c->max_seq_len);
    /* a window W keeps positions >= n - W + 1 visible: those must be stored */
    const uint64_t kv_max = l->window == 0 ? 0 : l->n + 1 > l->window ? l->n + 1 - l->window : 0;
    if (l->kv_start > kv_max)
        return bad("kv_start: %llu, must be <= %llu (n_tokens %llu, window %u)", (unsigned long long)l->kv_start,
                   (unsigned long long)kv_max, (unsigned long long)l->n, l->window);
    for (int k = 88; k < HEADER_BYTES; k++)
        if (b[k]) return bad("reserved: header bytes 88 .. %d must be zero", HEADER_BYTES - 1);
    l->R = tl_kv_row_bytes(&e->kv_geom);
    l->record = 2 * l->R + 8;
    const bool injection = (l->flags & FLAG_STATES) && c->injection;
    if (!place(l, c->n_kv_heads, c->d_model, injection))
        return bad("blob_bytes: n_tokens, loops, kv_start and flags make more than 2^64 bytes");
    if (l->bytes != rd_u64(b + 16))
        return bad("blob_bytes: %llu, but n_tokens, loops, kv_start and flags make %llu",
                   (unsigned long long)rd_u64(b + 16), (unsigned long long)l->bytes);
    return TL_OK;
}

/* Why a stored key or value row breaks §7 (NULL when it does not). */
static const char* bad_row(const uint8_t* q, size_t R, bool int4) {
    for (size_t i = 0; i < R; i++) {
        if (!int4 && q[i] == 0x80) return "holds -128";
        if (int4 && ((q[i] & 0x0f) == 0x08 || (q[i] & 0xf0) == 0x80)) return "holds the nibble -8";
    }
    return NULL;
}

/* tokens, then every KV record. */
static tl_status check_values(const tl_engine* e, const uint8_t* b, const layout* l) {
    const tl_config* c = tl_engine_config(e);
    for (uint64_t i = 0; i < l->n; i++) {
        const int32_t t = (int32_t)rd_u32(b + HEADER_BYTES + 4 * i);
        if (t < 0 || (uint32_t)t >= c->vocab_size)
            return bad("tokens[%llu]: %d, outside 0 .. %u", (unsigned long long)i, t, c->vocab_size - 1);
    }
    static const char* const what[2] = {"key", "value"};
    for (uint32_t slot = 0; slot < l->n_layers; slot++)
        for (uint64_t pos = l->kv_start; pos < l->n; pos++)
            for (uint32_t h = 0; h < c->n_kv_heads; h++) {
                const uint8_t* r = b + record_at(l, c->n_kv_heads, slot, pos, h);
                for (int k = 0; k < 2; k++) { /* §7.4: kq, vq, then the scales */
                    const char* why = bad_row(r + k * l->R, l->R, l->kv_mode == TL_KV_INT4);
                    if (why)
                        return bad("kv: slot %u, position %llu, kv head %u: the %s row %s", slot,
                                   (unsigned long long)pos, h, what[k], why);
                }
                for (int k = 0; k < 2; k++) {
                    const float scale = rd_f32(r + 2 * l->R + 4 * k);
                    if (!(scale >= 0.0f))
                        return bad("kv: slot %u, position %llu, kv head %u: the %s scale is %g, must be >= 0", slot,
                                   (unsigned long long)pos, h, what[k], (double)scale);
                }
            }
    return TL_OK;
}

/* ---- load: the prefix ----------------------------------------------------------------------- */

static void read_f32s(float* x, const uint8_t* in, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = rd_f32(in + 4 * i);
}

/* p's KV table laid out as a build's (block i from position i * block_size, released outside
 * the window as soon as reserved, so at most one block more than the prefix keeps is ever
 * held), then every live block's slots filled from the blob: zero where it stores nothing. */
static tl_status load_kv(tl_prefix* p, const uint8_t* b, const layout* l) {
    const tl_kv_geom* g = &p->engine->kv_geom;
    tl_status st = TL_OK;
    for (size_t pos = 0; pos < p->n && st == TL_OK; pos += g->block_size) {
        st = tl_kv_reserve(&p->kv, g, l->n_layers, pos, p->n - pos < g->block_size ? p->n - pos : g->block_size);
        tl_kv_release_outside(&p->kv, p->n, p->window);
    }
    void* stage = NULL;
    if (st == TL_OK) st = stage_new(g, "load", &stage);
    for (size_t i = p->kv.first_live; st == TL_OK && i < p->kv.n_spans; i++) {
        const tl_kv_span* s = &p->kv.spans[i];
        const uint64_t from = s->start > l->kv_start ? s->start : l->kv_start, to = (uint64_t)s->start + s->count;
        for (uint32_t slot = 0; st == TL_OK && slot < l->n_layers; slot++) {
            tl_kv_block v = slot_view(g, s->block, slot, stage);
            memset(v.data, 0, slot_bytes(g));
            for (uint64_t pos = from; pos < to; pos++) {
                const size_t t = pos - s->block->start;
                for (uint32_t h = 0; h < g->n_kv_heads; h++) {
                    const uint8_t* r = b + record_at(l, g->n_kv_heads, slot, pos, h);
                    memcpy(tl_kv_keys(g, &v, 0, h) + t * l->R, r, l->R);
                    memcpy(tl_kv_values(g, &v, 0, h) + t * l->R, r + l->R, l->R);
                    tl_kv_key_scales(g, &v, 0, h)[t] = rd_f32(r + 2 * l->R);
                    tl_kv_value_scales(g, &v, 0, h)[t] = rd_f32(r + 2 * l->R + 4);
                }
            }
            if (stage && g->device->upload(g->device->ctx, tl_kv_keys(g, s->block, slot, 0), stage, slot_bytes(g)))
                st = tl_fail(TL_ERR_INTERNAL, "prefix load: copying a KV block to the device failed");
        }
    }
    tl_free(stage);
    return st;
}

/* The prefix of a checked blob. Kept states need a backend that resumes from them; elsewhere
 * the loaded warm-start prefix has none and extends by rebuilding, as one built there. */
static tl_status build(tl_engine* e, const uint8_t* b, const layout* l, tl_prefix** out) {
    const size_t d = tl_engine_config(e)->d_model;
    const bool warm_start = l->flags & FLAG_WARM_START;
    const bool states = (l->flags & FLAG_STATES) && tl_prefix_can_resume(e);
    tl_prefix* p = tl_prefix_new(e, l->n, l->loops, l->window, warm_start, states);
    if (!p) return tl_fail_oom("prefix");
    for (size_t i = 0; i < p->n; i++) p->tokens[i] = (int32_t)rd_u32(b + HEADER_BYTES + 4 * i);
    read_f32s(p->loop_states, b + l->loop_states_at, (size_t)l->loops * d);
    if (p->states) read_f32s(p->states, b + l->states_at, p->n * d);
    if (p->injects) read_f32s(p->injects, b + l->injects_at, p->n * d);
    const tl_status st = load_kv(p, b, l);
    if (st != TL_OK) {
        tl_prefix_free(p);
        return st;
    }
    *out = p;
    return TL_OK;
}

TL_API tl_status tl_prefix_load(tl_model* model, const void* buf, size_t n, tl_prefix** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!buf) return tl_fail(TL_ERR_INVALID_ARGUMENT, "buf is NULL");
    tl_engine* e;
    tl_status st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    layout l;
    st = check_frame(buf, n);
    if (st == TL_OK) st = check_header(e, buf, &l);
    if (st == TL_OK) st = check_values(e, buf, &l);
    if (st == TL_OK) st = build(e, buf, &l, out);
    tl_engine_unref(e);
    return st;
}
