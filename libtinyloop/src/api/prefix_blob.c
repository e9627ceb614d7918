/* prefix_blob.c — tl_prefix_save / tl_prefix_load: a prefix as bytes (docs/spec.md §7).
 *
 * The blob holds what generations and extensions read from a prefix: its tokens and instruction
 * length (offset 92, zero in blobs saved before it), the last token's state at each depth, the KV rows of every cache slot from the first position it still
 * holds, and for warm start the tokens' kept states. Save writes the rows one by one from
 * whatever blocks hold them; load pages them into blocks of this model's kv_block_size laid out
 * as a build lays them out (block i from position i * block_size, those outside the window
 * released; the positions of a kept block before kv_start are zero, never visible), so the
 * loaded prefix generates, extends and saves again as the saved one does. A hidden-state prefix
 * (docs/spec.md §5.4.1) is a version-2 blob: its layer input rows (q, a) per slot and position
 * from h_start in place of the KV records; it loads as a hidden-state prefix.
 *
 * Load checks every rule of §7 on the caller's bytes, in the spec's order, before it allocates
 * anything sized by them; all size arithmetic is overflow-checked and no read goes past
 * buf[0 .. n). The records themselves (and device blocks' staging) are kv_records.h's. */
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "base/frame.h"
#include "base/le.h"
#include "core/kv_records.h"
#include "core/seq.h"

enum { HEADER_BYTES = TL_FRAME_HEADER_BYTES, VERSION_KV = 1, VERSION_HIDDEN = 2, STORAGE_AT = 88, INSTRUCTION_AT = 92 };

static const tl_frame frame = {"prefix blob", "blob", "blob_bytes", "TLPREFIX", VERSION_KV, VERSION_HIDDEN};
enum { FLAG_WARM_START = 1, FLAG_STATES = 2 };

/* Where everything is in a blob, from its header fields (or a prefix's). */
typedef struct layout {
    uint32_t kv_mode, loops, window, flags, n_layers;
    uint32_t storage;    /* tl_prefix_storage: TL_STORE_KV (version 1), h8 or h4 (version 2) */
    uint64_t n, kv_start;
    uint32_t instruction; /* the prefix's instruction length P, 0 .. n                      */
    size_t R, record;    /* kv: bytes of a kq / vq row; of one (slot, position, kv head) record.
                            hidden: bytes of a row q; of one (slot, position) record (R + 4)  */
    uint32_t heads;      /* records per (slot, position): G (kv) or 1 (hidden)              */
    uint64_t loop_states_at, kv_at, states_at, injects_at, bytes;
} layout;

/* The record sizes of a blob of that storage for geometry g (model width d). */
static void set_records(layout* l, const tl_kv_geom* g, size_t d) {
    const bool hidden = l->storage != TL_STORE_KV;
    l->R = !hidden ? tl_kv_row_bytes(g) : l->storage == TL_STORE_H4 ? d / 2 : d;
    l->record = hidden ? l->R + sizeof(float) : tl_kv_record_bytes(g);
    l->heads = hidden ? 1 : g->n_kv_heads;
}

static const char* mode_name(uint32_t kv_mode) { return kv_mode == TL_KV_INT4 ? "int4" : "int8"; }

/* Fills the offsets of l (its counts and records set) for a model of width d; false when a size
 * passes 2^64 bytes. */
static bool place(layout* l, uint64_t d, bool injection) {
    const uint64_t rows = l->n - l->kv_start;
    uint64_t tokens, loop_states, records, kv, states = 0;
    bool over = __builtin_mul_overflow(l->n, 4, &tokens) ||
                __builtin_mul_overflow((uint64_t)l->loops * 4, d, &loop_states) ||
                __builtin_mul_overflow((uint64_t)l->n_layers * l->heads, rows, &records) ||
                __builtin_mul_overflow(records, (uint64_t)l->record, &kv);
    if (l->flags & FLAG_STATES) over = over || __builtin_mul_overflow(tokens, d, &states);
    over = over || __builtin_add_overflow(HEADER_BYTES, tokens, &l->loop_states_at) ||
           __builtin_add_overflow(l->loop_states_at, loop_states, &l->kv_at) ||
           __builtin_add_overflow(l->kv_at, kv, &l->states_at) ||
           __builtin_add_overflow(l->states_at, states, &l->injects_at) ||
           __builtin_add_overflow(l->injects_at, injection ? states : 0, &l->bytes);
    return !over;
}

/* The blob's record of (slot, position, kv head h; h = 0 for a hidden one). */
static uint64_t record_at(const layout* l, uint32_t slot, uint64_t pos, uint32_t h) {
    return l->kv_at + (((uint64_t)slot * (l->n - l->kv_start) + (pos - l->kv_start)) * l->heads + h) * l->record;
}

/* ---- save ----------------------------------------------------------------------------------- */

/* The layout of p's blob (its lock held). */
static layout prefix_layout(const tl_prefix* p) {
    const tl_engine* e = p->engine;
    const tl_config* c = tl_engine_config(e);
    layout l = {.kv_mode = tl_kv_geom_mode(&e->kv_geom), .loops = p->loops, .window = p->window, .n = p->n,
                .instruction = (uint32_t)p->instruction};
    l.flags = (p->warm_start ? FLAG_WARM_START : 0) | (p->states ? FLAG_STATES : 0);
    l.n_layers = (uint32_t)tl_n_layers(c, l.loops);
    l.storage = p->hidden ? p->hidden->storage : TL_STORE_KV;
    const tl_kv_table* t = &p->kv; /* window 1 releases every block: then nothing is stored */
    l.kv_start = p->hidden ? p->hidden->start : t->first_live < t->n_spans ? t->spans[t->first_live].start : p->n;
    set_records(&l, &e->kv_geom, c->d_model);
    place(&l, c->d_model, p->injects != NULL); /* no overflow: it is what p holds */
    return l;
}

static void write_f32s(uint8_t* out, const float* x, size_t n) {
    for (size_t i = 0; i < n; i++) wr_f32(out + 4 * i, x[i]);
}

/* The KV records of the positions >= kv_start of every live block, slot by slot. */
static tl_status write_kv(const tl_prefix* p, const layout* l, uint8_t* blob) {
    const tl_kv_geom* g = &p->engine->kv_geom;
    void* stage;
    tl_status st = tl_kv_stage_new(g, "prefix save", &stage);
    for (size_t i = p->kv.first_live; st == TL_OK && i < p->kv.n_spans; i++) {
        const tl_kv_span* s = &p->kv.spans[i];
        const uint64_t from = s->start > l->kv_start ? s->start : l->kv_start, to = (uint64_t)s->start + s->count;
        for (uint32_t slot = 0; st == TL_OK && slot < l->n_layers; slot++)
            st = tl_kv_records_write(g, s->block, slot, from, to, stage, blob + record_at(l, slot, from, 0),
                                     "prefix save");
    }
    tl_free(stage);
    return st;
}

/* The hidden records: row (slot, p) of the prefix's rows is the blob's record (slot, p). */
static void write_hidden(const tl_hidden_rows* h, const layout* l, uint8_t* blob) {
    const size_t rows = (size_t)h->n_layers * (h->n - h->start);
    for (size_t i = 0; i < rows; i++) {
        uint8_t* r = blob + l->kv_at + i * l->record;
        memcpy(r, h->q + i * h->row_bytes, h->row_bytes);
        wr_f32(r + h->row_bytes, h->a[i]);
    }
}

static tl_status write_blob(const tl_prefix* p, const layout* l, uint8_t* blob) {
    const tl_engine* e = p->engine;
    const tl_config* c = tl_engine_config(e);
    tl_frame_begin(&frame, blob, l->storage == TL_STORE_KV ? VERSION_KV : VERSION_HIDDEN, l->bytes);
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
    wr_u32(blob + STORAGE_AT, l->storage);
    wr_u32(blob + INSTRUCTION_AT, l->instruction);
    for (size_t i = 0; i < l->n; i++) wr_u32(blob + HEADER_BYTES + 4 * i, (uint32_t)p->tokens[i]);
    write_f32s(blob + l->loop_states_at, p->loop_states, (size_t)l->loops * c->d_model);
    tl_status st = TL_OK;
    if (p->hidden) write_hidden(p->hidden, l, blob);
    else st = write_kv(p, l, blob);
    if (st != TL_OK) return st;
    if (p->states) write_f32s(blob + l->states_at, p->states, l->n * c->d_model);
    if (p->injects) write_f32s(blob + l->injects_at, p->injects, l->n * c->d_model);
    tl_frame_seal(blob, l->bytes);
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

#define bad(...) tl_fail_bad_file(frame.what, __VA_ARGS__)

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
    const bool hidden = rd_u32(b + 8) == VERSION_HIDDEN;
    if (hidden && l->flags) return bad("flags: 0x%x, a hidden-state prefix (version 2) has no warm start", l->flags);
    if (l->n < 1 || l->n > c->max_seq_len)
        return bad("n_tokens: %llu, must be 1 .. max_seq_len %u", (unsigned long long)l->n, c->max_seq_len);
    /* a window W keeps positions >= n - W + 1 visible: those must be stored */
    const uint64_t kv_max = l->window == 0 ? 0 : l->n + 1 > l->window ? l->n + 1 - l->window : 0;
    if (l->kv_start > kv_max)
        return bad("kv_start: %llu, must be <= %llu (n_tokens %llu, window %u)", (unsigned long long)l->kv_start,
                   (unsigned long long)kv_max, (unsigned long long)l->n, l->window);
    if (hidden && l->kv_start != kv_max)
        return bad("kv_start: %llu, a hidden-state prefix stores from h_start %llu (n_tokens %llu, window %u)",
                   (unsigned long long)l->kv_start, (unsigned long long)kv_max, (unsigned long long)l->n, l->window);
    l->instruction = rd_u32(b + INSTRUCTION_AT);
    if (l->instruction > l->n)
        return bad("instruction: %u exceeds the prefix's %llu tokens", l->instruction, (unsigned long long)l->n);
    l->storage = hidden ? rd_u32(b + STORAGE_AT) : TL_STORE_KV;
    if (!hidden && rd_u32(b + STORAGE_AT)) /* a kv prefix stores 0 there */
        return bad("storage: %u, must be 0 (kv) in a version-1 blob", rd_u32(b + STORAGE_AT));
    if (hidden && l->storage != TL_STORE_H8 && l->storage != TL_STORE_H4)
        return bad("storage: unknown %u (1 = h8, 2 = h4)", l->storage);
    set_records(l, &e->kv_geom, c->d_model);
    const bool injection = (l->flags & FLAG_STATES) && tl_has_inject(c);
    if (!place(l, c->d_model, injection))
        return bad("blob_bytes: n_tokens, loops, kv_start and flags make more than 2^64 bytes");
    if (l->bytes != rd_u64(b + 16))
        return bad("blob_bytes: %llu, but n_tokens, loops, kv_start and flags make %llu",
                   (unsigned long long)rd_u64(b + 16), (unsigned long long)l->bytes);
    return TL_OK;
}

/* tokens, then every KV record. */
static tl_status check_values(const tl_engine* e, const uint8_t* b, const layout* l) {
    const tl_config* c = tl_engine_config(e);
    for (uint64_t i = 0; i < l->n; i++) {
        const int32_t t = (int32_t)rd_u32(b + HEADER_BYTES + 4 * i);
        if (t < 0 || (uint32_t)t >= c->vocab_size)
            return bad("tokens[%llu]: %d, outside 0 .. %u", (unsigned long long)i, t, c->vocab_size - 1);
    }
    char why[64];
    for (uint32_t slot = 0; slot < l->n_layers; slot++)
        for (uint64_t pos = l->kv_start; pos < l->n; pos++) {
            if (l->storage != TL_STORE_KV) { /* q, then a: never negative (NaN and +inf pass) */
                const uint8_t* r = b + record_at(l, slot, pos, 0);
                const char* row = tl_kv_row_bad(r, l->R, l->storage == TL_STORE_H4);
                if (row) return bad("hidden: slot %u, position %llu: the row %s", slot, (unsigned long long)pos, row);
                if (rd_f32(r + l->R) < 0.0f)
                    return bad("hidden: slot %u, position %llu: the scale is %g", slot, (unsigned long long)pos,
                               (double)rd_f32(r + l->R));
                continue;
            }
            for (uint32_t h = 0; h < c->n_kv_heads; h++)
                if (tl_kv_record_bad(b + record_at(l, slot, pos, h), l->R, l->kv_mode == TL_KV_INT4, why, sizeof why))
                    return bad("kv: slot %u, position %llu, kv head %u: %s", slot, (unsigned long long)pos, h, why);
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
    if (st == TL_OK) st = tl_kv_stage_new(g, "prefix load", &stage);
    for (size_t i = p->kv.first_live; st == TL_OK && i < p->kv.n_spans; i++) {
        const tl_kv_span* s = &p->kv.spans[i];
        const uint64_t from = s->start > l->kv_start ? s->start : l->kv_start, to = (uint64_t)s->start + s->count;
        for (uint32_t slot = 0; st == TL_OK && slot < l->n_layers; slot++)
            st = tl_kv_records_read(g, s->block, slot, from, to, stage, b + record_at(l, slot, from, 0),
                                    "prefix load");
    }
    tl_free(stage);
    return st;
}

/* p's rows from the hidden records of a checked blob. */
static tl_status load_hidden(tl_prefix* p, const uint8_t* b, const layout* l) {
    const tl_config* c = tl_engine_config(p->engine);
    tl_hidden_rows* h = tl_hidden_new(l->storage, l->n_layers, c->d_model, p->n, p->window, c->rms_eps);
    if (!h) return tl_fail_oom("hidden-state rows");
    const size_t rows = (size_t)h->n_layers * (h->n - h->start); /* h->start == l->kv_start: checked */
    for (size_t i = 0; i < rows; i++) {
        const uint8_t* r = b + l->kv_at + i * l->record;
        memcpy(h->q + i * h->row_bytes, r, h->row_bytes);
        h->a[i] = rd_f32(r + h->row_bytes);
    }
    p->hidden = h;
    return TL_OK;
}

/* The prefix of a checked blob. Kept states need a backend that resumes from them; elsewhere
 * the loaded warm-start prefix has none and extends by rebuilding, as one built there. */
static tl_status build(tl_engine* e, const uint8_t* b, const layout* l, tl_prefix** out) {
    const size_t d = tl_engine_config(e)->d_model;
    const bool warm_start = l->flags & FLAG_WARM_START;
    const bool states = (l->flags & FLAG_STATES) && tl_prefix_can_resume(e);
    tl_prefix* p = tl_prefix_new(e, l->n, l->loops, l->window, warm_start, states);
    if (!p) return tl_fail_oom("prefix");
    p->instruction = l->instruction;
    for (size_t i = 0; i < p->n; i++) p->tokens[i] = (int32_t)rd_u32(b + HEADER_BYTES + 4 * i);
    read_f32s(p->loop_states, b + l->loop_states_at, (size_t)l->loops * d);
    if (p->states) read_f32s(p->states, b + l->states_at, p->n * d);
    if (p->injects) read_f32s(p->injects, b + l->injects_at, p->n * d);
    const tl_status st = l->storage != TL_STORE_KV ? load_hidden(p, b, l) : load_kv(p, b, l);
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
    st = tl_frame_check(&frame, buf, n);
    if (st == TL_OK) st = check_header(e, buf, &l);
    if (st == TL_OK) st = check_values(e, buf, &l);
    if (st == TL_OK) st = tl_prefix_check_storage(e, l.storage); /* a valid blob this model cannot rebuild from */
    if (st == TL_OK) st = build(e, buf, &l, out);
    tl_engine_unref(e);
    return st;
}
