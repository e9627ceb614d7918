/* block_file.c — the spilled block file of docs/spec.md §7.6 (block_file.h). */
#include "core/block_file.h"

#include <stdio.h>
#include <string.h>

#include "base/errors.h"
#include "base/frame.h"
#include "base/le.h"
#include "core/kv_records.h"

enum { VERSION = 1, MAX_BLOCK_SIZE = 65536, INSTRUCTION_AT = 76, RESERVED_AT = 80 };

static const tl_frame frame = {"spilled block file", "the file", "file_bytes", "TLPBLOCK", VERSION, VERSION};

#define bad(...) tl_fail_bad_file(frame.what, __VA_ARGS__)

static const char* mode_name(uint32_t kv_mode) { return kv_mode == TL_KV_INT4 ? "int4" : "int8"; }

/* ---- the name -------------------------------------------------------------------------------- */

static uint64_t fnv_bytes(uint64_t h, const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3u;
    return h;
}

uint64_t tl_block_name_start(const tl_block_model* m, const tl_block_place* at, size_t salt_bytes) {
    uint8_t key[36]; /* the header's key fields, in order (§4.3.1); instruction only when > 0 */
    wr_u32(key, m->checksum);
    wr_u64(key + 4, m->file_bytes);
    wr_u32(key + 12, tl_kv_geom_mode(&m->geom));
    wr_u32(key + 16, at->window);
    wr_u32(key + 20, at->tree_depth);
    wr_u32(key + 24, m->geom.block_size);
    wr_u32(key + 28, (uint32_t)salt_bytes);
    wr_u32(key + 32, at->instruction);
    const size_t key_bytes = at->instruction ? 36 : 32;
    return fnv_bytes(fnv_bytes(0xcbf29ce484222325u, key, key_bytes), (const uint8_t*)at->salt, salt_bytes);
}

uint64_t tl_block_name_more(uint64_t h, const int32_t* tokens, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint8_t t[4];
        wr_u32(t, (uint32_t)tokens[i]);
        h = fnv_bytes(h, t, sizeof t);
    }
    return h;
}

void tl_block_name_format(uint64_t h, char out[32]) { snprintf(out, 32, "%016llx.tlblock", (unsigned long long)h); }

/* ---- the layout ------------------------------------------------------------------------------ */

/* Bytes of the records of one layer: bs positions of G records. */
static size_t layer_bytes(const tl_kv_geom* g) { return (size_t)g->block_size * g->n_kv_heads * tl_kv_record_bytes(g); }

size_t tl_block_file_size(const tl_block_model* m, size_t salt_bytes, uint32_t index, uint32_t n_layers) {
    const size_t tokens = ((size_t)index + 1) * m->geom.block_size;
    return TL_BLOCK_HEADER_BYTES + salt_bytes + 4 * tokens + (size_t)n_layers * layer_bytes(&m->geom);
}

/* Where the tokens and the records start in a file with this salt, block size and block index. */
static size_t tokens_at(size_t salt_bytes) { return TL_BLOCK_HEADER_BYTES + salt_bytes; }
static size_t records_at(size_t salt_bytes, uint32_t bs, uint32_t index) {
    return tokens_at(salt_bytes) + 4 * ((size_t)index + 1) * bs;
}

/* ---- write ----------------------------------------------------------------------------------- */

tl_status tl_block_file_encode(const tl_block_model* m, const tl_block_place* at, tl_kv_block* b, void* stage,
                               uint8_t* out) {
    const tl_kv_geom* g = &m->geom;
    const size_t salt_bytes = strlen(at->salt), n_tokens = ((size_t)at->index + 1) * g->block_size;
    const size_t bytes = tl_block_file_size(m, salt_bytes, at->index, b->n_layers);
    tl_frame_begin(&frame, out, VERSION, bytes);
    wr_u32(out + 28, m->checksum);
    wr_u64(out + 32, m->file_bytes);
    wr_u32(out + 40, tl_kv_geom_mode(g));
    wr_u32(out + 44, at->window);
    wr_u32(out + 48, at->tree_depth);
    wr_u32(out + 52, g->block_size);
    wr_u32(out + 56, (uint32_t)salt_bytes);
    wr_u32(out + 60, at->index);
    wr_u32(out + 64, b->n_layers);
    wr_u32(out + 68, g->n_kv_heads);
    wr_u32(out + 72, g->head_dim);
    wr_u32(out + INSTRUCTION_AT, at->instruction);
    memcpy(out + TL_BLOCK_HEADER_BYTES, at->salt, salt_bytes);
    for (size_t i = 0; i < n_tokens; i++) wr_u32(out + tokens_at(salt_bytes) + 4 * i, (uint32_t)at->tokens[i]);
    uint8_t* records = out + records_at(salt_bytes, g->block_size, at->index);
    for (uint32_t l = 0; l < b->n_layers; l++) {
        const tl_status st = tl_kv_records_write(g, b, l, b->start, (uint64_t)b->start + g->block_size, stage,
                                                 records + l * layer_bytes(g), "prefix cache spill");
        if (st != TL_OK) return st;
    }
    tl_frame_seal(out, bytes);
    return TL_OK;
}

/* ---- read ------------------------------------------------------------------------------------ */

/* The model and kv_mode, the geometry, the ranges, the reserved bytes and the size. */
static tl_status check_header(const tl_block_model* m, const uint8_t* b) {
    const tl_kv_geom* g = &m->geom;
    if (rd_u32(b + 28) != m->checksum)
        return bad("this block was spilled by another model (checksum 0x%08x, this model 0x%08x)", rd_u32(b + 28),
                   m->checksum);
    if (rd_u64(b + 32) != m->file_bytes)
        return bad("this block was spilled by another model (file_bytes %llu, this model %llu)",
                   (unsigned long long)rd_u64(b + 32), (unsigned long long)m->file_bytes);
    const uint32_t kv_mode = rd_u32(b + 40);
    if (kv_mode != TL_KV_INT8 && kv_mode != TL_KV_INT4) return bad("kv_mode: unknown %u (0 = int8, 1 = int4)", kv_mode);
    if (kv_mode != tl_kv_geom_mode(g))
        return bad("this block was spilled with kv_mode %s; this model runs %s", mode_name(kv_mode),
                   mode_name(tl_kv_geom_mode(g)));
    if (rd_u32(b + 68) != g->n_kv_heads) return bad("n_kv_heads: %u, this model has %u", rd_u32(b + 68), g->n_kv_heads);
    if (rd_u32(b + 72) != g->head_dim) return bad("head_dim: %u, this model has %u", rd_u32(b + 72), g->head_dim);
    const uint32_t bs = rd_u32(b + 52), salt_bytes = rd_u32(b + 56), index = rd_u32(b + 60), n_layers = rd_u32(b + 64);
    if (bs < 1 || bs > MAX_BLOCK_SIZE) return bad("block_size: %u, must be 1 .. %d", bs, MAX_BLOCK_SIZE);
    if (salt_bytes > TL_BLOCK_MAX_SALT) return bad("salt_bytes: %u, must be <= %d", salt_bytes, TL_BLOCK_MAX_SALT);
    if (((uint64_t)index + 1) * bs > m->max_seq_len)
        return bad("block_index: %u, block %u ends past max_seq_len %u", index, index, m->max_seq_len);
    if (n_layers < 1 || n_layers > TL_BLOCK_MAX_LAYERS)
        return bad("n_layers: %u, must be 1 .. %d", n_layers, TL_BLOCK_MAX_LAYERS);
    for (int k = RESERVED_AT; k < TL_BLOCK_HEADER_BYTES; k++)
        if (b[k]) return bad("reserved: header bytes %d .. %d must be zero", RESERVED_AT, TL_BLOCK_HEADER_BYTES - 1);
    const uint64_t tokens = ((uint64_t)index + 1) * bs; /* < 2^49: none of the sums below before kv overflows */
    uint64_t records, kv, bytes;
    if (__builtin_mul_overflow((uint64_t)bs * n_layers, (uint64_t)g->n_kv_heads, &records) ||
        __builtin_mul_overflow(records, (uint64_t)tl_kv_record_bytes(g), &kv) ||
        __builtin_add_overflow(TL_BLOCK_HEADER_BYTES + (uint64_t)salt_bytes + 4 * tokens, kv, &bytes))
        return bad("file_bytes: block_size, salt_bytes, block_index and n_layers make more than 2^64 bytes");
    if (bytes != rd_u64(b + 16))
        return bad("file_bytes: %llu, but block_size, salt_bytes, block_index and n_layers make %llu",
                   (unsigned long long)rd_u64(b + 16), (unsigned long long)bytes);
    return TL_OK;
}

/* The tokens, then every record's values. */
static tl_status check_values(const tl_block_model* m, const uint8_t* b) {
    const tl_kv_geom* g = &m->geom;
    const uint32_t bs = rd_u32(b + 52), salt_bytes = rd_u32(b + 56), index = rd_u32(b + 60), n_layers = rd_u32(b + 64);
    const uint64_t n_tokens = ((uint64_t)index + 1) * bs;
    for (uint64_t i = 0; i < n_tokens; i++) {
        const int32_t t = (int32_t)rd_u32(b + tokens_at(salt_bytes) + 4 * i);
        if (t < 0 || (uint32_t)t >= m->vocab_size)
            return bad("tokens[%llu]: %d, outside 0 .. %u", (unsigned long long)i, t, m->vocab_size - 1);
    }
    const size_t R = tl_kv_row_bytes(g), record = tl_kv_record_bytes(g);
    const uint8_t* r = b + records_at(salt_bytes, bs, index); /* the file's bs: the model's is checked later */
    char why[64];
    for (uint32_t l = 0; l < n_layers; l++)
        for (uint32_t t = 0; t < bs; t++)
            for (uint32_t h = 0; h < g->n_kv_heads; h++, r += record)
                if (tl_kv_record_bad(r, R, g->kv_bits == 4, why, sizeof why))
                    return bad("kv: layer %u, position %llu, kv head %u: %s", l, (unsigned long long)index * bs + t, h,
                               why);
    return TL_OK;
}

/* The place and depth a lookup (or a spill's check) needs. */
static tl_status check_place(const tl_block_model* m, const uint8_t* b, const tl_block_place* at, uint32_t n_layers) {
    const size_t salt_bytes = strlen(at->salt);
    if (rd_u32(b + 44) != at->window) return bad("window: %u, the request's %u", rd_u32(b + 44), at->window);
    if (rd_u32(b + 48) != at->tree_depth)
        return bad("tree_depth: %u, the request's %u", rd_u32(b + 48), at->tree_depth);
    if (rd_u32(b + 52) != m->geom.block_size)
        return bad("block_size: %u, this model's %u", rd_u32(b + 52), m->geom.block_size);
    if (rd_u32(b + INSTRUCTION_AT) != at->instruction)
        return bad("instruction: %u, the request's %u", rd_u32(b + INSTRUCTION_AT), at->instruction);
    if (rd_u32(b + 56) != salt_bytes || memcmp(b + TL_BLOCK_HEADER_BYTES, at->salt, salt_bytes) != 0)
        return bad("salt: not the request's");
    if (rd_u32(b + 60) != at->index) return bad("block_index: %u, the request's %u", rd_u32(b + 60), at->index);
    const size_t n_tokens = ((size_t)at->index + 1) * m->geom.block_size;
    for (size_t i = 0; i < n_tokens; i++)
        if ((int32_t)rd_u32(b + tokens_at(salt_bytes) + 4 * i) != at->tokens[i])
            return bad("tokens[%zu]: %d, the request's %d", i, (int32_t)rd_u32(b + tokens_at(salt_bytes) + 4 * i),
                       at->tokens[i]);
    if (!tl_block_serves(rd_u32(b + 64), at->tree_depth, n_layers))
        return bad("n_layers: %u does not serve a request of %u", rd_u32(b + 64), n_layers);
    return TL_OK;
}

tl_status tl_block_file_check(const tl_block_model* m, const uint8_t* buf, size_t n, const tl_block_place* at,
                              uint32_t n_layers) {
    tl_status st = tl_frame_check(&frame, buf, n);
    if (st == TL_OK) st = check_header(m, buf);
    if (st == TL_OK) st = check_values(m, buf);
    if (st == TL_OK) st = check_place(m, buf, at, n_layers);
    return st;
}

uint32_t tl_block_file_layers(const uint8_t* buf) { return rd_u32(buf + 64); }

tl_status tl_block_file_decode(const tl_block_model* m, const uint8_t* buf, tl_kv_block* b, void* stage) {
    const tl_kv_geom* g = &m->geom;
    const uint8_t* records = buf + records_at(rd_u32(buf + 56), g->block_size, rd_u32(buf + 60));
    for (uint32_t l = 0; l < b->n_layers; l++) {
        const tl_status st = tl_kv_records_read(g, b, l, b->start, (uint64_t)b->start + g->block_size, stage,
                                                records + l * layer_bytes(g), "prefix cache read");
        if (st != TL_OK) return st;
    }
    return TL_OK;
}
