/* attention.c — one query head against the KV cache, exactly as docs/spec.md §4.1, and
 * the scalar kernels. Pass 1 computes every visible score S_j (an exact integer dot product,
 * then two f32 multiplies) and the NaN-ignoring maxima M and svmax; pass 2 turns the
 * exponentials into integers E_j and U_j (kept for every key) and sums E_j and U_j * vq_j
 * exactly in i64, the latter over batches of segments. Keys are visited segment by segment in
 * position order, but any order gives the same sums. An int4 cache's rows are unpacked into
 * scratch->rows (at most TL_ATTN_UNPACK_ROWS at a time, so a long segment runs in pieces) and
 * go through the same kernels: the same integers, so the same formulas. */
#include "cpu/attention.h"

#include <math.h>

#include "core/numerics.h"
#include "cpu/quant.h"

/* ---- scalar kernels ---------------------------------------------------------------------- */

static void scores_scalar(const tl_attn_scratch* s, const int8_t* k, const float* sk, size_t n, size_t D,
                          float c, float* scores) {
    for (size_t j = 0; j < n; j++) {
        int32_t dot = 0;
        for (size_t d = 0; d < D; d++) dot += (int32_t)s->qq[d] * k[j * D + d];
        scores[j] = ((float)dot * c) * sk[j];
    }
}

static int64_t weights_scalar(const float* scores, const float* sv, size_t n, float M, float kappa,
                              int32_t* u, bool* nan_weight) {
    int64_t den = 0;
    for (size_t j = 0; j < n; j++) {
        const float e = tl_exp2s((scores[j] - M) * TL_LOG2E);
        den += (int64_t)tl_rint(e * 16777216.0f);   /* E_j = rint(e_j * 2^24) <= 2^24 */
        const float uf = tl_rint(e * (sv[j] * kappa)); /* <= 2^24 + 2, or NaN if sv[j] = inf */
        *nan_weight |= uf != uf;
        u[j] = uf == uf ? (int32_t)uf : 0;
    }
    return den;
}

static void accumulate_scalar(const int32_t* u, const int8_t* v, size_t n, size_t D, int64_t* num) {
    for (size_t j = 0; j < n; j++)
        for (size_t d = 0; d < D; d++) num[d] += (int64_t)u[j] * v[j * D + d];
}

static void accumulate_segments_scalar(const int32_t* u, const tl_attn_rows* segs, size_t n_segs, size_t D,
                                       int64_t* num) {
    for (size_t i = 0; i < n_segs; u += segs[i].n, i++) accumulate_scalar(u, segs[i].v, segs[i].n, D, num);
}

static float max_scalar(const float* x, size_t n, float acc) {
    for (size_t j = 0; j < n; j++) acc = tl_fmax(acc, x[j]);
    return acc;
}

static void output_scalar(const int64_t* num, size_t D, int64_t den, float svmax, float* o) {
    const float fden = (float)den;
    for (size_t d = 0; d < D; d++) o[d] = ((float)num[d] / fden) * svmax;
}

const tl_attn_kernels tl_attn_scalar = {.quantize = tl_quantize_row,
                                        .scores = scores_scalar,
                                        .max = max_scalar,
                                        .weights = weights_scalar,
                                        .accumulate_segments = accumulate_segments_scalar,
                                        .output = output_scalar};

/* ---- driver --------------------------------------------------------------------------------- */

enum { BATCH = 64 }; /* segments per accumulate_segments call */

size_t tl_attn_next_segment(const tl_kv_table* kv, size_t* si, size_t lo, size_t hi, tl_attn_segment* seg) {
    while (*si < kv->n_spans) {
        const tl_kv_span* sp = &kv->spans[(*si)++];
        if (sp->start > hi) return 0;
        seg->block = sp->block;
        seg->from = lo > sp->start ? lo - sp->start : 0;
        seg->to = hi - sp->start + 1 < sp->count ? hi - sp->start + 1 : sp->count;
        if (seg->to > seg->from) return seg->to - seg->from;
    }
    return 0;
}

/* Rows [from, from + n) of a segment's keys or values (`base`: its block's array) as int8 rows
 * of D bytes: an int8 cache's own, or an int4 cache's unpacked into `to`. */
static const int8_t* int8_rows(const tl_kv_geom* g, const int8_t* base, size_t from, size_t n, int8_t* to) {
    const size_t D = g->head_dim, R = tl_kv_row_bytes(g);
    if (g->kv_bits == 8) return base + from * D;
    for (size_t j = 0; j < n; j++) tl_kv_unpack4(base + (from + j) * R, D, to + j * D);
    return to;
}

/* The value rows gathered for one accumulate_segments call, and where their U_j start. */
typedef struct value_batch {
    tl_attn_rows rows[BATCH];
    size_t n;               /* entries                                   */
    size_t u_first, u_end;  /* U index of the first entry's first row, and past the last's */
    size_t unpacked;        /* rows of the entries in scratch->rows (int4) */
} value_batch;

static void flush_values(const tl_attn_kernels* kern, value_batch* b, size_t D, tl_attn_scratch* s) {
    if (b->n) kern->accumulate_segments(s->u + b->u_first, b->rows, b->n, D, s->num);
    b->n = b->unpacked = 0;
    b->u_first = b->u_end;
}

void tl_attend(const tl_attn_kernels* kern, const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer,
               uint32_t kv_head, size_t t, uint32_t window, size_t instruction, const float* qh, float* o,
               tl_attn_scratch* s) {
    const size_t D = g->head_dim;
    const bool packed = g->kv_bits != 8;
    const size_t piece = packed ? TL_ATTN_UNPACK_ROWS : SIZE_MAX; /* rows per kernel call, at most */
    const size_t lo = tl_attn_first_key(t, window), hi = tl_attn_last_key(t, instruction);
    const float sq = kern->quantize(qh, D, 127, s->qq);
    for (size_t d = 0; d < D; d++) s->qq16[d] = s->qq[d];
    const float c = sq / sqrtf((float)D);
    float svmax = -INFINITY;
    tl_attn_segment seg;
    size_t si = tl_kv_find(kv, lo), index = 0, n;
    while ((n = tl_attn_next_segment(kv, &si, lo, hi, &seg))) {
        const int8_t* keys = tl_kv_keys(g, seg.block, layer, kv_head);
        const float* sk = tl_kv_key_scales(g, seg.block, layer, kv_head) + seg.from;
        for (size_t j0 = 0; j0 < n; j0 += piece) {
            const size_t m = n - j0 < piece ? n - j0 : piece;
            kern->scores(s, int8_rows(g, keys, seg.from + j0, m, s->rows), sk + j0, m, D, c, s->scores + index + j0);
        }
        svmax = kern->max(tl_kv_value_scales(g, seg.block, layer, kv_head) + seg.from, n, svmax);
        index += n;
    }
    if (!(svmax > 0.0f)) { /* every visible value row is zero */
        for (size_t d = 0; d < D; d++) o[d] = 0.0f;
        return;
    }
    const float M = kern->max(s->scores, index, -INFINITY);
    const float kappa = 16777216.0f / svmax; /* 2^24 / svmax */
    for (size_t d = 0; d < D; d++) s->num[d] = 0;
    int64_t den = 0;
    bool nan_weight = false;
    si = tl_kv_find(kv, lo);
    index = 0;
    value_batch batch = {.n = 0};
    while ((n = tl_attn_next_segment(kv, &si, lo, hi, &seg))) {
        den += kern->weights(s->scores + index, tl_kv_value_scales(g, seg.block, layer, kv_head) + seg.from, n, M,
                             kappa, s->u + index, &nan_weight);
        const int8_t* values = tl_kv_values(g, seg.block, layer, kv_head);
        for (size_t j0 = 0; j0 < n; j0 += piece) {
            const size_t m = n - j0 < piece ? n - j0 : piece;
            if (packed && batch.unpacked + m > TL_ATTN_UNPACK_ROWS) flush_values(kern, &batch, D, s);
            int8_t* to = packed ? s->rows + batch.unpacked * D : NULL;
            batch.rows[batch.n++] = (tl_attn_rows){int8_rows(g, values, seg.from + j0, m, to), m};
            if (packed) batch.unpacked += m;
            batch.u_end += m;
            if (batch.n == BATCH) flush_values(kern, &batch, D, s);
        }
        index += n;
    }
    flush_values(kern, &batch, D, s);
    if (nan_weight)
        for (size_t d = 0; d < D; d++) o[d] = NAN;
    else
        kern->output(s->num, D, den, svmax, o);
}
