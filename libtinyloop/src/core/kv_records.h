/* kv_records.h — KV blocks as the on-disk records of docs/spec.md §7.2 (the prefix blob) and §7.6
 * (the spilled block file): per (slot, position, kv head) one record of 2R + 8 bytes, kq (R
 * bytes), vq (R bytes), sk f32, sv f32, little-endian, the integers exactly as the block stores
 * them. A run of records covers positions from .. to-1 of one slot of one block, position-major
 * then kv head: record (pos, h) at ((pos - from) * G + h) * tl_kv_record_bytes.
 *
 * Device blocks (kvcache.h's allocator) go through its download / upload hooks, one slot at a
 * time, via a staging buffer of one slot (tl_kv_stage_new; NULL for host blocks). */
#ifndef TL_KV_RECORDS_H
#define TL_KV_RECORDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/kvcache.h"

/* Bytes of one (slot, position, kv head) record: 2R + 8. */
static inline size_t tl_kv_record_bytes(const tl_kv_geom* g) { return 2 * tl_kv_row_bytes(g) + 8; }

/* A staging buffer for one slot of g's device blocks (*stage NULL and TL_OK for host blocks);
 * `what` ("prefix save") names the operation in the error. Free it with tl_free. */
tl_status tl_kv_stage_new(const tl_kv_geom* g, const char* what, void** stage);

/* The records of positions from .. to-1 (absolute, inside b) of b's slot `slot` into
 * out[(to - from) * G * record]. */
tl_status tl_kv_records_write(const tl_kv_geom* g, tl_kv_block* b, uint32_t slot, uint64_t from, uint64_t to,
                              void* stage, uint8_t* out, const char* what);

/* b's slot `slot` zeroed, then positions from .. to-1 from the records at in (checked ones). */
tl_status tl_kv_records_read(const tl_kv_geom* g, tl_kv_block* b, uint32_t slot, uint64_t from, uint64_t to,
                             void* stage, const uint8_t* in, const char* what);

/* Why a stored row of R bytes breaks §7.4 ("holds -128", "holds the nibble -8"; NULL when it
 * does not): int8 values never -128, int4 nibbles never -8. */
const char* tl_kv_row_bad(const uint8_t* q, size_t R, bool int4);

/* Whether record r (rows of R bytes) breaks §7.4, checked kq, vq, then the scales (each >= 0,
 * not NaN); if so the reason ("the key row holds -128") goes to why[cap]. */
bool tl_kv_record_bad(const uint8_t* r, size_t R, bool int4, char* why, size_t cap);

#endif
