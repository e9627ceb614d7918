/* attention.h — exact two-pass attention over the paged KV cache (docs/spec.md §4.1).
 *
 * The driver (attention.c) walks the visible keys segment by segment (a run of consecutive
 * slots of one block) and calls the kernels per segment or per query; the scalar kernels live
 * in attention.c, AVX2 ones in attention_avx2.c, AVX-512 ones in attention_avx512.c. Every
 * kernel computes exact integers or the spec's element-wise f32 operations, so every set gives
 * identical bits. The kernels read int8
 * rows of D bytes: an int4 cache's packed rows (kvcache.h) are unpacked for them first, into the
 * same integers, so the two KV modes share every kernel. */
#ifndef TL_ATTENTION_H
#define TL_ATTENTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/kvcache.h"
#include "cpu/attention_kernels.h"

enum { TL_ATTN_UNPACK_ROWS = 256 }; /* int4 key or value rows tl_attend unpacks at a time, at most */

/* Bytes of scratch->rows that tl_attend needs: none for an int8 cache, whose rows the kernels
 * read in place; TL_ATTN_UNPACK_ROWS rows of D int8 for an int4 one. */
static inline size_t tl_attn_rows_bytes(const tl_kv_geom* g) {
    return g->kv_bits == 8 ? 0 : (size_t)TL_ATTN_UNPACK_ROWS * g->head_dim;
}

/* o[D] = attention of one query head qh[D] (already rotated) at position t over kv head
 * `kv_head` of cache layer `layer`; visible keys j <= e(t) (tl_attn_last_key: t, or
 * instruction - 1 inside the instruction block) and, with window > 0, j > t - window.
 * Every visible key must be in the table. */
void tl_attend(const tl_attn_kernels* kern, const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer,
               uint32_t kv_head, size_t t, uint32_t window, size_t instruction, const float* qh, float* o,
               tl_attn_scratch* scratch);

#endif
