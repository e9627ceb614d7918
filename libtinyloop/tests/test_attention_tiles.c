/* test_attention_tiles.c — cpu/attention_amx.c's tile of queries against cpu/attention.c's
 * tl_attend with the scalar kernels, bit for bit, for every query of the tile: head sizes with
 * and without a multiple of 64 (and of 4), tiles of 1 .. 16 queries, 1 .. 1100 keys, paged
 * tables of several block sizes with short spans (a block shared with another table ends a
 * span early), windows (with the blocks behind them released), other layers and kv heads of
 * the block in the way, extreme keys and values, the top of U's limbs, every branch of
 * docs/spec.md §4.1 (zero value rows, infinite value scales, infinite and NaN scores), non-finite
 * and zero queries, instruction blocks (queries seeing keys past their own position), and a union of 140000 keys that would overflow an int32 accumulator without
 * its flush. Runs the tile with the scalar and (where the CPU has it) the AVX2 per-row kernels;
 * in a TINYLOOP_AMX_EMULATION build on the emulated tiles, else on the real ones (skipped
 * without AMX). On real tiles, also: a sequence whose chunks never reach the tiles holds no
 * tile scratch (exactly the bytes it holds on AVX-512). Every case runs on an int8 and on an int4
 * (packed Q4) cache. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/kvcache.h"
#include "cpu/attention.h"
#include "cpu/isa.h"
#include "cpu/matmul.h"
#include "test_util.h"

enum { LAYERS = 2, KV_HEADS = 2 };

typedef enum {
    FILL_PLAIN,
    FILL_EXTREME,       /* keys -127, values 127, one scale: equal scores, U = 2^24 for every key */
    FILL_FULL_LIMBS,    /* zero keys, values 127, U = 2^21 - 1 (three limbs of 127) but one 2^24 */
    FILL_ZERO_VALUES,   /* the value scales of the first half are 0: the early queries see only zero rows */
    FILL_INF_VALUE,     /* one infinite value scale: the queries that see it give NaN */
    FILL_INF_SCORE,     /* one infinite key scale: scores of +inf, -inf or NaN */
    FILL_NAN_SCORES,    /* NaN key scales at every third position */
    FILL_ODD_QUERIES,   /* a NaN query, an infinite one, a zero one, a tiny one */
    FILL_CASES
} fill_case;

static const char* case_name(fill_case fc) {
    static const char* names[] = {"plain", "extreme", "full limbs", "zero values", "inf value scale", "inf score",
                                  "nan scores", "odd queries"};
    return names[fc];
}

/* A table of n positions in pieces of random length, each piece's last block held once more so
 * that the next piece opens a fresh block (a short span, as after a shared prefix). The extra
 * references go into held[] (*n_held of them). */
static void build_table(const tl_kv_geom* g, size_t n, uint64_t* rng, tl_kv_table* kv, tl_kv_block** held,
                        size_t* n_held) {
    memset(kv, 0, sizeof *kv);
    *n_held = 0;
    for (size_t at = 0; at < n;) {
        size_t piece = (size_t)tu_uniform(rng, 1, 3 * (int32_t)g->block_size + 40);
        if (piece > n - at) piece = n - at;
        CHECK_OK(tl_kv_reserve(kv, g, LAYERS, at, piece));
        at += piece;
        if (tu_uniform(rng, 0, 2) == 0) {
            tl_kv_block* b = kv->spans[kv->n_spans - 1].block;
            tl_kv_block_retain(b);
            held[(*n_held)++] = b;
        }
    }
}

/* Row s of a (layer, kv head)'s keys or values := q[0 .. D), packed in an int4 cache. */
static void store_row(const tl_kv_geom* g, int8_t* rows, size_t s, const int8_t* q) {
    const size_t R = tl_kv_row_bytes(g);
    if (g->kv_bits == 8) memcpy(rows + s * R, q, R);
    else tl_kv_pack4(q, g->head_dim, rows + s * R);
}

/* Every slot of every (layer, kv head) random (Q8 or Q4 values, as the cache holds), then the
 * case's values in (layer, kv_head) for the keys of the tile at p0 .. p0+m-1. */
static void fill(const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer, uint32_t kv_head, size_t p0, size_t m,
                 fill_case fc, uint64_t* rng) {
    const size_t D = g->head_dim, n = p0 + m;
    const int32_t qmax = g->kv_bits == 8 ? 127 : 7;
    int8_t* kq = malloc(D);
    int8_t* vq = malloc(D);
    const size_t special = fc == FILL_FULL_LIMBS ? 0 : (size_t)tu_uniform(rng, 0, (int32_t)n - 1);
    for (size_t i = 0; i < kv->n_spans; i++)
        for (uint32_t l = 0; l < LAYERS; l++)
            for (uint32_t h = 0; h < KV_HEADS; h++) {
                tl_kv_block* b = kv->spans[i].block;
                int8_t* k = tl_kv_keys(g, b, l, h);
                int8_t* v = tl_kv_values(g, b, l, h);
                float* sk = tl_kv_key_scales(g, b, l, h);
                float* sv = tl_kv_value_scales(g, b, l, h);
                for (size_t s = 0; s < kv->spans[i].count; s++) {
                    for (size_t d = 0; d < D; d++) {
                        kq[d] = (int8_t)tu_uniform(rng, -qmax, qmax);
                        vq[d] = (int8_t)tu_uniform(rng, -qmax, qmax);
                    }
                    sk[s] = (float)tu_uniform(rng, 1, 4000) * 1e-5f;
                    sv[s] = (float)tu_uniform(rng, 1, 1000) * 1e-4f;
                    const size_t j = kv->spans[i].start + s;
                    if (l == layer && h == kv_head && (fc == FILL_EXTREME || fc == FILL_FULL_LIMBS))
                        for (size_t d = 0; d < D; d++) {
                            kq[d] = (int8_t)(fc == FILL_EXTREME ? -qmax : 0);
                            vq[d] = (int8_t)qmax;
                        }
                    store_row(g, k, s, kq);
                    store_row(g, v, s, vq);
                    if (l != layer || h != kv_head) continue;
                    if (fc == FILL_EXTREME) sk[s] = 0.01f, sv[s] = 0.5f;
                    if (fc == FILL_FULL_LIMBS) sv[s] = j == special ? 16777216.0f : 2097151.0f;
                    if (fc == FILL_ZERO_VALUES && j < p0 + m / 2) sv[s] = 0.0f;
                    if (fc == FILL_INF_VALUE && j == special) sv[s] = INFINITY;
                    if (fc == FILL_INF_SCORE && j == special) sk[s] = INFINITY;
                    if (fc == FILL_NAN_SCORES && j % 3 == 0) sk[s] = NAN;
                }
            }
    free(kq), free(vq);
}

typedef struct tally {
    size_t compared, finite_nonzero, zero, nan;
} tally;

/* The tile at p0 .. p0+m-1 against tl_attend per query, with each kernel set. */
static void check_tile(const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer, uint32_t kv_head, size_t p0,
                       size_t m, uint32_t window, size_t instruction, const float* q, const char* what, tally* t) {
    const size_t D = g->head_dim, n = tl_attn_last_key(p0 + m - 1, instruction) + 1;
    float* ref = malloc(m * D * sizeof(float));
    float* got = malloc(m * D * sizeof(float));
    tl_attn_scratch rs = {malloc(n * sizeof(float)), malloc(n * sizeof(int32_t)), malloc(D * sizeof(int64_t)),
                          malloc(D), malloc(D * sizeof(int16_t)), NULL, malloc(tl_attn_rows_bytes(g) + 1), 0};
    for (size_t i = 0; i < m; i++)
        tl_attend(&tl_attn_scalar, g, kv, layer, kv_head, p0 + i, window, instruction, q + i * D, ref + i * D, &rs);
    for (size_t i = 0; i < m * D; i++) {
        t->nan += ref[i] != ref[i];
        t->zero += ref[i] == 0.0f;
        t->finite_nonzero += isfinite(ref[i]) && ref[i] != 0.0f;
    }
    const tl_attn_kernels* kernels[] = {&tl_attn_scalar, &tl_attn_avx2, &tl_attn_avx512};
    const char* names[] = {"scalar", "avx2", "avx512"};
    const size_t n_kernels = !tl_isa_available(TL_ISA_AVX2) ? 1 : !tl_isa_available(TL_ISA_AVX512_VNNI) ? 2 : 3;
    tl_attn_scratch ts = {NULL, malloc(n * sizeof(int32_t)), NULL, malloc(D), NULL,
                          aligned_alloc(64, tl_attn_tile_bytes(n, g)), NULL, n};
    for (size_t ki = 0; ki < n_kernels; ki++) {
        memset(got, 0x55, m * D * sizeof(float));
        memset(ts.tile, 0x5a, tl_attn_tile_bytes(n, g));
        tl_attend_tile(kernels[ki], g, kv, layer, kv_head, p0, m, window, instruction, q, D, got, D, 0, &ts);
        for (size_t i = 0; i < m; i++)
            CHECK(tu_same_bits(ref + i * D, got + i * D, D),
                  "%s, %s kernels: query %zu of %zu at %zu (D %zu, block %u, window %u, instruction %zu, kv_bits %u)",
                  what, names[ki], i, m, p0 + i, D, g->block_size, window, instruction, g->kv_bits);
        t->compared++;
    }
    /* the values packed once for all n keys, as a chunk's slice packs them: this tile, and the
     * tile of its first half of queries only, whose last key block then holds later keys' values */
    for (size_t ki = 0; ki < n_kernels && tl_attn_first_key(p0, window) == 0; ki++)
        for (size_t rows = m, last = 0; !last; last = rows == (m + 1) / 2, rows = (m + 1) / 2) {
            memset(ts.tile, 0x5a, tl_attn_tile_bytes(n, g)); /* earlier tiles' leftovers: a tile clears what it reads */
            tl_attn_pack_slice(g, kv, layer, kv_head, n, &ts);
            memset(got, 0x55, m * D * sizeof(float));
            tl_attend_tile(kernels[ki], g, kv, layer, kv_head, p0, rows, window, instruction, q, D, got, D, n, &ts);
            for (size_t i = 0; i < rows; i++)
                CHECK(tu_same_bits(ref + i * D, got + i * D, D),
                      "%s, %s kernels, values packed for %zu keys: query %zu of %zu at %zu (D %zu, block %u, "
                      "instruction %zu, kv_bits %u)", what, names[ki], n, i, rows, p0 + i, D, g->block_size,
                      instruction, g->kv_bits);
            t->compared++;
        }
    free(rs.scores), free(rs.u), free(rs.num), free(rs.qq), free(rs.qq16), free(rs.rows);
    free(ts.u), free(ts.qq), free(ts.tile);
    free(ref), free(got);
}

static void random_queries(float* q, size_t m, size_t D, fill_case fc, uint64_t* rng) {
    for (size_t i = 0; i < m * D; i++) q[i] = (float)tu_uniform(rng, -3000, 3000) * 1e-3f;
    if (fc == FILL_EXTREME || fc == FILL_FULL_LIMBS)
        for (size_t i = 0; i < m * D; i++) q[i] = 1.0f;
    if (fc == FILL_ODD_QUERIES) {
        q[0] = NAN;
        if (m > 1) q[D + D / 2] = INFINITY;
        if (m > 2) memset(q + 2 * D, 0, D * sizeof(float));
        if (m > 3)
            for (size_t d = 0; d < D; d++) q[3 * D + d] = 1e-30f;
    }
}

/* One case: a table of the keys the tile's queries see, p0 + m or the instruction block's, in
 * blocks of bs (an int8 or int4 cache), the tile's keys filled for the case. */
static void run_case(size_t D, uint32_t bs, uint32_t kv_bits, size_t p0, size_t m, uint32_t window,
                     size_t instruction, fill_case fc, uint64_t* rng, tally* t) {
    const tl_kv_geom g = tl_kv_geom_make(bs, KV_HEADS, (uint32_t)D, kv_bits);
    const size_t n = tl_attn_last_key(p0 + m - 1, instruction) + 1;
    tl_kv_table kv;
    tl_kv_block** held = malloc(n * sizeof(tl_kv_block*));
    size_t n_held;
    build_table(&g, n, rng, &kv, held, &n_held);
    const uint32_t layer = (uint32_t)tu_uniform(rng, 0, LAYERS - 1);
    const uint32_t kv_head = (uint32_t)tu_uniform(rng, 0, KV_HEADS - 1);
    fill(&g, &kv, layer, kv_head, p0, m, fc, rng);
    tl_kv_release_outside(&kv, p0, window); /* what a prefill releases before the next chunk */
    float* q = malloc(m * D * sizeof(float));
    random_queries(q, m, D, fc, rng);
    char what[96];
    snprintf(what, sizeof what, "%s, %zu keys", case_name(fc), n);
    check_tile(&g, &kv, layer, kv_head, p0, m, window, instruction, q, what, t);
    free(q);
    tl_kv_clear(&kv);
    for (size_t i = 0; i < n_held; i++) tl_kv_block_release(held[i]);
    free(held);
}

/* The tile scratch grows with the whole history, once per pool thread: a sequence whose chunks
 * are all too short for tiles (one row: decode, chunks of 1) must not carry it, i.e. it holds
 * exactly the bytes it holds on AVX-512. Real tiles only: the emulated build runs every chunk on
 * them (asked of the library: this file does not see its TL_AMX_EMULATION). */
enum { SHORT_CHUNK = 1 };

static size_t bytes_in_use(void) {
    tl_memory_stats st = {.size = sizeof st};
    CHECK_OK(tl_memory_stats_get(&st));
    return st.bytes_in_use;
}

static size_t seq_bytes(const char* path, tl_isa isa) {
    tl_model* m = tu_open(path, 4, isa, 16);
    if (!m) return 0;
    const size_t before = bytes_in_use();
    tl_seq* s;
    CHECK_OK(tl_seq_create(m, 2, 0, &s));
    int32_t tokens[300];
    for (size_t i = 0; i < 300; i++) tokens[i] = (int32_t)(i * 7 % 256);
    CHECK_OK(tl_seq_prefill(s, tokens, 300, SHORT_CHUNK, NULL));
    for (int i = 0; i < 3; i++) CHECK_OK(tl_seq_decode(s, tokens[i], NULL));
    const size_t grown = bytes_in_use() - before;
    tl_seq_free(s);
    tl_model_free(m);
    return grown;
}

static void test_no_tile_scratch_without_tiles(void) {
    if (tl_linear_scratch_bytes(TL_ISA_AMX, SHORT_CHUNK, 64) != 0 || !tl_isa_available(TL_ISA_AVX512_VNNI)) return;
    tu_spec spec = tu_spec_default();
    spec.max_seq = 320;
    const char* path = tu_write_model("no-tiles.tinyloop", &spec);
    const size_t amx = seq_bytes(path, TL_ISA_AMX), avx512 = seq_bytes(path, TL_ISA_AVX512_VNNI);
    CHECK(amx == avx512 && amx > 0, "a sequence without tile chunks holds %zu bytes on AMX, %zu on AVX-512", amx,
          avx512);
}

int main(void) {
    if (!tl_isa_available(TL_ISA_AMX)) {
        printf("test_attention_tiles: skipped (no AMX on this CPU; the emulated build runs it on any CPU with AVX2)\n");
        return tu_finish("test_attention_tiles");
    }
    uint64_t rng = 17;
    static const size_t dims[] = {8, 12, 40, 64, 72, 96, 128, 6};
    static const uint32_t blocks[] = {16, 1, 5, 64};
    const size_t n_dims = sizeof dims / sizeof dims[0], n_blocks = sizeof blocks / sizeof blocks[0];
    tally t = {0};
    for (size_t i = 0; i < n_blocks * n_dims * FILL_CASES; i++) { /* every (D, case) pair once a block size */
        const size_t D = dims[i % n_dims];
        const fill_case fc = (fill_case)(i % FILL_CASES);
        const uint32_t bs = blocks[i / (n_dims * FILL_CASES)];
        const size_t m = i % 5 == 0 ? TL_ATTN_TILE : i % 5 == 1 ? 1 : (size_t)tu_uniform(&rng, 2, TL_ATTN_TILE);
        const size_t p0 = i % 4 == 0 ? (size_t)tu_uniform(&rng, 0, 20) : (size_t)tu_uniform(&rng, 0, 1100 - (int32_t)m);
        const int w = tu_uniform(&rng, 0, 3);
        const uint32_t window = w < 2 ? 0 : w == 2 ? (uint32_t)tu_uniform(&rng, 1, 40)
                                                   : (uint32_t)tu_uniform(&rng, 1, (int32_t)(p0 + m));
        /* an instruction block (docs/spec.md §4.1) every third case: past the tile, inside it or before it */
        const size_t instruction = i % 3 ? 0 : (size_t)tu_uniform(&rng, 1, (int32_t)(p0 + m + 40));
        for (uint32_t kv_bits = 8; kv_bits >= 4; kv_bits -= 4)
            run_case(D, bs, kv_bits, p0, m, window, instruction, fc, &rng, &t);
    }
    /* 140000 keys of three full limbs: 127 * 127 * 140000 > 2^31 without the flush */
    run_case(8, 64, 8, 140000 - TL_ATTN_TILE, TL_ATTN_TILE, 0, 0, FILL_FULL_LIMBS, &rng, &t);
    CHECK(t.compared > 800 && t.finite_nonzero > 50000 && t.zero > 1000 && t.nan > 1000,
          "%zu tiles compared; outputs finite and nonzero %zu, zero %zu, NaN %zu", t.compared, t.finite_nonzero, t.zero,
          t.nan);
    test_no_tile_scratch_without_tiles();
    return tu_finish("test_attention_tiles");
}
