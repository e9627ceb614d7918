/* attention_kernels.h — the contract between the attention driver (attention.c, attention.h)
 * and the per-ISA kernels (the scalar ones in attention.c, attention_avx2.c, the AMX tile kernel
 * attention_amx.c): the scratch and the value rows the kernels work on, the table of one path's
 * kernels, the walk over the visible keys' segments (attention.c) that the tile kernel shares
 * with the driver, and the tile kernel's entry point. The kernel files include this header, not
 * the driver's. */
#ifndef TL_ATTENTION_KERNELS_H
#define TL_ATTENTION_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/attn_mask.h"
#include "core/kvcache.h"
#include "tinyloop.h"

/* Scratch for one query (and one tile of queries: tl_attend_tile). */
typedef struct tl_attn_scratch {
    float* scores;   /* [max_keys]                     */
    int32_t* u;      /* [max_keys] U_j                 */
    int64_t* num;    /* [D]                            */
    int8_t* qq;      /* [D]                            */
    int16_t* qq16;   /* [D] qq widened (SIMD kernels)  */
    void* tile;      /* tl_attn_tile_bytes(tile_keys, g) bytes, 64-byte aligned (tl_attend_tile only) */
    int8_t* rows;    /* tl_attn_rows_bytes(g) bytes: an int4 cache's rows unpacked (tl_attend only) */
    size_t tile_keys; /* the keys `tile` holds: at least every tile's union and every packing's */
} tl_attn_scratch;

/* The value rows of one segment: n rows of D bytes, consecutive. */
typedef struct tl_attn_rows {
    const int8_t* v;
    size_t n;
} tl_attn_rows;

/* The kernels of one path. `scores` and `weights` work on one segment of n keys (rows of D
 * bytes, consecutive); `accumulate_segments` on consecutive segments; the others on one query. */
typedef struct tl_attn_kernels {
    /* (qq, sq) = Q8(qh), the query quantizer (docs/spec.md §2.2) */
    float (*quantize)(const float* x, size_t n, int qmax, int8_t* q);
    /* scores[j] = ((f32)(qq . k_j) * c) * sk[j] */
    void (*scores)(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D, float c,
                   float* scores);
    /* the NaN-ignoring maximum of acc and x[0 .. n) (tl_fmax; acc is never NaN). A zero result
     * may carry either sign: no output depends on it (the driver uses svmax only when it is
     * > 0, and S_j - M for M = ±0 differs at most in the sign of a zero, which exp2s maps to 1). */
    float (*max)(const float* x, size_t n, float acc);
    /* u[j] = rint(e_j * (sv[j] * kappa)), e_j = exp2s((scores[j] - M) * LOG2E); returns Σ rint(e_j * 2^24)
     * and sets *nan_weight if some u is NaN (only when an sv is infinite). */
    int64_t (*weights)(const float* scores, const float* sv, size_t n, float M, float kappa, int32_t* u,
                       bool* nan_weight);
    /* num[d] += Σ_j u[j] * v_j[d], exact, over the rows of n_segs segments, u running on from one
     * segment to the next (SIMD paths flush their narrow partial sums once per call, not per block) */
    void (*accumulate_segments)(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D,
                                int64_t* num);
    /* o[d] = ((f32)num[d] / (f32)den) * svmax */
    void (*output)(const int64_t* num, size_t D, int64_t den, float svmax, float* o);
} tl_attn_kernels;

extern const tl_attn_kernels tl_attn_scalar;
extern const tl_attn_kernels tl_attn_avx2;   /* only where the CPU has AVX2                        */
extern const tl_attn_kernels tl_attn_avx512; /* only where tl_isa_available(TL_ISA_AVX512_VNNI)    */

/* The attention kernels of row form `row_isa` (row_kernels.h; kernel_tables.c). */
const tl_attn_kernels* tl_attn_kernels_for(tl_isa row_isa);

/* attention_avx2.c's scores, which the AVX-512 scores fall back to for head sizes past 512. */
void tl_attn_scores_avx2(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D, float c,
                         float* scores);

/* A run of visible keys: slots [from, to) of one block. */
typedef struct tl_attn_segment {
    tl_kv_block* block;
    size_t from, to;
} tl_attn_segment;

/* The next segment of positions [lo, hi] from span *si on (start with *si = tl_kv_find(kv, lo)):
 * its length, 0 when none is left. */
size_t tl_attn_next_segment(const tl_kv_table* kv, size_t* si, size_t lo, size_t hi, tl_attn_segment* seg);

/* ---- tiles of queries (attention_amx.c) ------------------------------------------------------ */

enum { TL_ATTN_TILE = 16 }; /* queries per tl_attend_tile call, at most */

/* Bytes of scratch->tile that tl_attend_tile needs when a tile's queries see at most max_keys
 * keys together (max_keys >= tl_attn_last_key of the last query + 1 always suffices). */
size_t tl_attn_tile_bytes(size_t max_keys, const tl_kv_geom* g);

/* For i < m (1 .. TL_ATTN_TILE): o + i * o_stride = tl_attend(kern, g, kv, layer, kv_head, p0 + i,
 * window, instruction, q + i * q_stride), bit for bit: the m queries of one head at consecutive
 * positions, as in a prefill chunk, with the scores and the value sums computed on AMX tiles
 * (real or emulated, amx_tiles.h) and every other step by kern's per-query kernels. Uses
 * scratch->u, scratch->qq and scratch->tile. packed_keys: the keys the last tl_attn_pack_slice
 * on this scratch packed for this (kv, layer, kv_head), 0 for none; a tile whose queries see
 * keys 0 .. hi (hi = tl_attn_last_key(p0+m-1, instruction), the last any of them sees) with
 * hi < packed_keys uses them, any other packs its own (and leaves the packing unusable: pack
 * again before relying on it). */
void tl_attend_tile(const tl_attn_kernels* kern, const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer,
                    uint32_t kv_head, size_t p0, size_t m, uint32_t window, size_t instruction, const float* q,
                    size_t q_stride, float* o, size_t o_stride, size_t packed_keys, tl_attn_scratch* scratch);

/* Packs the values of keys 0 .. n-1 (1 <= n <= scratch->tile_keys, all in the table) of kv head
 * `kv_head` of cache layer `layer` into scratch->tile for the tiles that follow, and from an int4
 * cache unpacks their keys there too. */
void tl_attn_pack_slice(const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer, uint32_t kv_head, size_t n,
                        tl_attn_scratch* scratch);

#endif
