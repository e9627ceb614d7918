/* backend_cuda.c — the CUDA backend: the forward pass of a CUDA engine described for
 * tl_cuda_forward (each row's token, position, depth, window and where its K/V goes; each
 * sequence's visible KV spans), its outputs handed back in the CPU pass's shapes, and KV block
 * data allocated on the device. Rows run deepest first (tl_sort_deepest_first); rows of one
 * sequence share one span range. The head of a saved hidden state (tl_head_logits) runs on the
 * host with the one linear the backend repacks there (cpu/forward.h): a pass computes its own
 * logits on the device. A part pass (core/forward.h's tl_part: a draft, its verification, a
 * warm-start prefix's build and extension) is a pass of one sequence whose rows run to the
 * part's depth, resumed from and keeping states in host memory (tl_cuda_batch's part fields);
 * the whole pass is its whole part. A hidden-state prefix (docs/spec.md §5.4.1) is built by chunk
 * passes that hand each block's input rows to the sequence's capture, and rebuilt through
 * kv_from_rows, the K/V write of one slot from given rows (tl_cuda_kv_from_rows). The host arrays
 * of a call live in its sequence's scratch (the stage below): no allocation per pass. */
#include "cuda/backend_cuda.h"

#include <stdio.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/attn_mask.h"
#include "core/engine.h"
#include "core/exit_rule.h"
#include "cpu/forward.h"

typedef struct cuda_backend {
    tl_backend base;
    tl_kv_allocator kv; /* device memory of c */
    tl_cuda* c;
    tl_linear head;     /* the head repacked for the host, for tl_head_logits */
} cuda_backend;

size_t tl_cuda_count_spans(tl_seq* const* seqs, size_t T) {
    size_t n = 0;
    for (size_t t = 0; t < T; t++)
        if (t == 0 || seqs[t] != seqs[t - 1]) n += seqs[t]->kv.n_spans - seqs[t]->kv.first_live;
    return n;
}

/* The row of token `token` of s at position pos (reserved): where its K/V goes, and its spans. */
static tl_cuda_row row_at(const tl_seq* s, size_t pos, int32_t token, uint32_t first_span, uint32_t n_spans) {
    const tl_kv_span* write = &s->kv.spans[tl_kv_find(&s->kv, pos)];
    return (tl_cuda_row){token, (uint32_t)pos, s->loops, s->window, write->block->data,
                         (uint32_t)(pos - write->start), first_span, n_spans, (uint32_t)s->instruction};
}

size_t tl_cuda_describe(tl_seq* const* seqs, const size_t* pos, const int32_t* tokens, size_t T,
                        tl_cuda_row* rows, tl_cuda_span* spans, uint32_t* max_keys) {
    size_t n_spans = 0, first = 0, count = 0;
    *max_keys = 0;
    for (size_t t = 0; t < T; t++) {
        const tl_seq* s = seqs[t];
        if (t == 0 || s != seqs[t - 1]) {
            first = n_spans;
            for (size_t i = s->kv.first_live; i < s->kv.n_spans; i++) {
                const tl_kv_span* sp = &s->kv.spans[i];
                if (sp->block) spans[n_spans++] = (tl_cuda_span){sp->block->data, sp->start, sp->count};
            }
            count = n_spans - first;
        }
        rows[t] = row_at(s, pos[t], tokens[t], (uint32_t)first, (uint32_t)count);
        const size_t keys = tl_attn_last_key(pos[t], s->instruction) + 1;
        if (keys > *max_keys) *max_keys = (uint32_t)keys;
    }
    return n_spans;
}

/* Where a chunk pass of a hidden-state prefix build hands its layer inputs: its sequence, and
 * the position of its first row. */
typedef struct capture_at {
    const tl_seq* s;
    size_t pos0;
} capture_at;

/* tl_cuda_batch.capture of such a pass: its layer inputs to the hidden-state rows it builds
 * (docs/spec.md §5.4.1). */
static void capture_rows(void* ctx, uint32_t slot, size_t row0, size_t n, const float* x) {
    const capture_at* at = ctx;
    tl_hidden_capture(at->s->capture, slot, at->pos0 + row0, n, x);
}

bool tl_cuda_describe_writes(const tl_seq* s, size_t pos0, size_t T, tl_cuda_row* rows) {
    const tl_kv_table* kv = &s->kv; /* live spans: [first_live, n_spans), consecutive, each with its block */
    if (kv->first_live >= kv->n_spans || kv->spans[kv->first_live].start > pos0) return false;
    const tl_kv_span* last = &kv->spans[kv->n_spans - 1];
    if (pos0 + T > (size_t)last->start + last->count) return false;
    for (size_t t = 0; t < T; t++) rows[t] = row_at(s, pos0 + t, 0, 0, 0);
    return true;
}

/* ---- host scratch ------------------------------------------------------------------------- */

/* The host arrays of one call, laid out in its sequence's scratch (a batch: its first
 * sequence's, as the CPU pass borrows it; core/seq.h), which grows to the largest call so far
 * and is never freed per pass. A sequence has one user at a time, so the scratch needs no lock
 * while the device calls serialize on the tl_cuda's. */
typedef struct stage {
    tl_seq** seqs;         /* [T] each row's sequence                                  */
    size_t* pos;           /* [T] its position                                          */
    int32_t* tokens;       /* [T] its token                                             */
    tl_cuda_row* rows;     /* [T] the rows tl_cuda_describe writes                      */
    tl_cuda_span* spans;   /* [n_spans] and their spans                                 */
    float* hidden;         /* [T][d] the rows' final states                             */
    size_t* order;         /* [S] a batch of S spans: the spans deepest first            */
    size_t* first;         /* [S] span b's first token in the caller's tokens            */
    uint32_t* logit_rows;  /* [S] the rows whose logits the batch wants (spans' last)    */
    size_t* logit_span;    /* [S] logit row h is span logit_span[h]'s                    */
    float* logits;         /* [S][V] their logits                                        */
} stage;

static void lay_out(stage* st, tl_carve* c, const tl_config* cfg, size_t T, size_t n_spans, size_t S) {
    st->seqs = tl_take(c, T * sizeof *st->seqs);
    st->pos = tl_take(c, T * sizeof *st->pos);
    st->tokens = tl_take(c, T * sizeof *st->tokens);
    st->rows = tl_take(c, T * sizeof *st->rows);
    st->spans = tl_take(c, n_spans * sizeof *st->spans);
    st->hidden = tl_take(c, T * cfg->d_model * sizeof(float));
    st->order = tl_take(c, S * sizeof *st->order);
    st->first = tl_take(c, S * sizeof *st->first);
    st->logit_rows = tl_take(c, S * sizeof *st->logit_rows);
    st->logit_span = tl_take(c, S * sizeof *st->logit_span);
    st->logits = tl_take(c, S * cfg->vocab_size * sizeof(float));
}

/* The stage of T rows (a batch: of S spans; else S = 0) whose sequences have at most n_spans live
 * spans, in `scratch` (grown first if it does not fit: the call's only allocation; on failure
 * nothing has changed). */
static tl_status stage_begin(stage* st, tl_scratch* scratch, const tl_config* cfg, size_t T, size_t n_spans,
                             size_t S) {
    tl_carve arena = {0, NULL};
    lay_out(st, &arena, cfg, T, n_spans, S);
    const tl_status status = tl_scratch_fit(scratch, arena.used, "CUDA pass scratch");
    if (status != TL_OK) return status;
    arena = (tl_carve){0, scratch->base};
    lay_out(st, &arena, cfg, T, n_spans, S);
    return TL_OK;
}

/* ---- passes ------------------------------------------------------------------------------- */

/* Rows t < T of the stage (seqs, pos, tokens filled; deepest first) described into its rows and
 * spans, then b (its outputs and part set; hidden the stage's unless given) run on the device.
 * `depth` (0: each sequence's) overrides every row's loops: the depth a part runs to. */
static tl_status run_rows(tl_cuda* c, stage* st, size_t T, uint32_t depth, tl_cuda_batch* b) {
    const tl_engine* e = st->seqs[0]->engine;
    uint32_t max_keys;
    b->n_spans = tl_cuda_describe(st->seqs, st->pos, st->tokens, T, st->rows, st->spans, &max_keys);
    for (size_t t = 0; depth && t < T; t++) st->rows[t].loops = depth;
    b->T = T;
    b->rows = st->rows;
    b->spans = st->spans;
    b->max_keys = max_keys;
    b->block_size = e->kv_geom.block_size;
    b->head_bytes = e->kv_geom.head_bytes;
    b->kv_bits = e->kv_geom.kv_bits;
    if (!b->hidden) b->hidden = st->hidden;
    return tl_cuda_forward(c, b);
}

/* tl_forward_part of s on the device, and with last_hidden (NULL or [d]) the last row's final
 * state too: tl_forward is the whole part (first_iter 0, depth s->loops) at pos0 = s->n. */
static tl_status run_part(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0, const tl_part* part,
                          float* last_hidden) {
    const tl_config* cfg = tl_engine_config(s->engine);
    const uint32_t coda_depth = part->coda_depth ? part->coda_depth : part->depth;
    if (part->first_iter >= part->depth || part->depth > s->loops || coda_depth > s->loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA part pass: first_iter %u, depth %u, coda_depth %u on a "
                       "sequence of depth %u", part->first_iter, part->depth, coda_depth, s->loops);
    stage st;
    tl_status status = stage_begin(&st, &s->scratch, cfg, T, tl_cuda_count_spans(&s, 1), 0);
    if (status != TL_OK) return status;
    for (size_t t = 0; t < T; t++) {
        st.seqs[t] = s;
        st.pos[t] = pos0 + t;
        st.tokens[t] = part->first_iter ? 0 : tokens[t]; /* a resumed part runs no embedding */
    }
    capture_at at = {s, pos0};
    tl_cuda_batch batch = {.hidden = part->hidden_all, .logits = part->logits_all, .logits_last = part->logits_last,
                           .loop_states = part->loop_states, .first_iter = part->first_iter,
                           .coda_depth = part->coda_depth, .state_in = part->state_in, .inject_in = part->inject_in,
                           .state_out = part->state_out, .inject_out = part->inject_out,
                           .capture = s->capture ? capture_rows : NULL, .capture_ctx = &at};
    status = run_rows(((cuda_backend*)b)->c, &st, T, part->depth, &batch);
    const size_t d = cfg->d_model;
    if (status == TL_OK && last_hidden) memcpy(last_hidden, batch.hidden + (T - 1) * d, d * sizeof(float));
    return status;
}

static tl_status cuda_forward(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                              float* logits_last, float* last_hidden, float* loop_states) {
    const tl_part whole = {.depth = s->loops, .logits_all = logits_all, .logits_last = logits_last,
                           .loop_states = loop_states};
    return run_part(b, s, tokens, T, s->n, &whole, last_hidden);
}

static tl_status cuda_forward_part(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0,
                                   const tl_part* part) {
    return run_part(b, s, tokens, T, pos0, part, NULL);
}

/* Spans of S sequences (counts NULL: one token each, the batched decode) in one pass, each span
 * counts[b] rows at consecutive positions, the spans deepest first. Without exit rules (adaptive
 * is false: tl_gen_check refuses them here), every row runs to its depth. The head runs on the
 * spans' last rows that want logits only (tl_cuda_batch.logit_rows). */
static tl_status cuda_forward_spans(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, const size_t* counts,
                                    size_t S, float* const* logits, const tl_exit* exits, uint32_t* depths) {
    for (size_t r = 0; exits && r < S; r++)
        if (tl_exit_active(&exits[r], seqs[r]->loops))
            return tl_fail(TL_ERR_UNSUPPORTED, "adaptive depth (exit_rule) is not on the CUDA backend yet");
    const tl_config* c = tl_engine_config(seqs[0]->engine);
    const size_t d = c->d_model, V = c->vocab_size;
    size_t T = 0, widest = 0;
    for (size_t k = 0; k < S; k++) {
        T += counts ? counts[k] : 1;
        if (counts && counts[k] > counts[widest]) widest = k;
    }
    /* the spans of the callers' sequences bound the sorted rows' (a sequence's rows stay
     * together); the widest span's arena, the one a prefill's own chunks grow anyway */
    stage st;
    tl_status status = stage_begin(&st, &seqs[widest]->scratch, c, T, tl_cuda_count_spans(seqs, S), S);
    if (status != TL_OK) return status;
    for (size_t k = 0, t = 0; k < S; t += counts ? counts[k] : 1, k++) st.first[k] = t;
    tl_sort_deepest_first(seqs, S, st.order);
    size_t r = 0, n_logits = 0;
    for (size_t k = 0; k < S; k++) {
        const size_t at = st.order[k], n = counts ? counts[at] : 1;
        for (size_t i = 0; i < n; i++, r++) {
            st.seqs[r] = seqs[at];
            st.pos[r] = seqs[at]->n + i;
            st.tokens[r] = tokens[st.first[at] + i];
        }
        if (logits[at]) {
            st.logit_rows[n_logits] = (uint32_t)(r - 1);
            st.logit_span[n_logits++] = at;
        }
    }
    tl_cuda_batch batch = {.logits = n_logits ? st.logits : NULL, .logit_rows = n_logits ? st.logit_rows : NULL,
                           .n_logit_rows = n_logits};
    status = run_rows(((cuda_backend*)b)->c, &st, T, 0, &batch);
    for (size_t k = 0, last = 0; status == TL_OK && k < S; k++) {
        const size_t at = st.order[k];
        last += counts ? counts[at] : 1;
        memcpy(seqs[at]->last_hidden, st.hidden + (last - 1) * d, d * sizeof(float));
        if (depths) depths[at] = seqs[at]->loops;
    }
    for (size_t h = 0; status == TL_OK && h < n_logits; h++)
        memcpy(logits[st.logit_span[h]], st.logits + h * V, V * sizeof(float));
    return status;
}

static tl_status cuda_forward_batch(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                    float* const* logits, const tl_exit* exits, uint32_t* depths) {
    return cuda_forward_spans(b, seqs, tokens, NULL, B, logits, exits, depths);
}

static tl_status cuda_kv_from_rows(tl_backend* b, tl_seq* s, uint32_t slot, size_t pos0, size_t T, const int8_t* q,
                                   const float* a) {
    const tl_engine* e = s->engine;
    if (T == 0) return TL_OK;
    if (slot >= s->n_layers)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: slot %u of a sequence of %u", slot, s->n_layers);
    tl_status st = tl_scratch_fit(&s->scratch, T * sizeof(tl_cuda_row), "CUDA KV rows"); /* the rows, as a pass's */
    if (st != TL_OK) return st;
    tl_cuda_row* rows = s->scratch.base;
    if (!tl_cuda_describe_writes(s, pos0, T, rows))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: positions %zu .. %zu are not reserved", pos0,
                       pos0 + T - 1);
    const tl_cuda_kv_rows batch = {T, rows, slot, e->kv_geom.block_size, e->kv_geom.head_bytes, e->kv_geom.kv_bits,
                                   q, a};
    return tl_cuda_kv_from_rows(((cuda_backend*)b)->c, &batch);
}

static tl_status cuda_head_logits(tl_backend* b, const tl_engine* e, const float* x, float* logits) {
    return tl_cpu_head_logits(&((const cuda_backend*)b)->head, e, x, logits);
}

static void cuda_info(const tl_backend* b, tl_backend_info* out) {
    const cuda_backend* cb = (const cuda_backend*)b;
    *out = (tl_backend_info){TL_DEVICE_CUDA, tl_linear_bytes(&cb->head), tl_cuda_weight_bytes(cb->c), {0}};
    snprintf(out->name, sizeof out->name, "%s", tl_cuda_device_name(cb->c));
}

static void cuda_free(tl_backend* b) {
    cuda_backend* cb = (cuda_backend*)b;
    tl_linear_release(&cb->head);
    tl_cuda_free(cb->c);
    tl_free(cb);
}

static void* kv_alloc(void* ctx, size_t bytes) { return tl_cuda_block_alloc(ctx, bytes); }
static void kv_free(void* ctx, void* data) { tl_cuda_block_free(ctx, data); }
static int kv_download(void* ctx, void* host, const void* device, size_t bytes) {
    return tl_cuda_block_download(ctx, host, device, bytes);
}
static int kv_upload(void* ctx, void* device, const void* host, size_t bytes) {
    return tl_cuda_block_upload(ctx, device, host, bytes);
}
static int kv_copy(void* ctx, void* dst, const void* src, size_t bytes) {
    return tl_cuda_block_copy(ctx, dst, src, bytes);
}

/* No exit rules yet (adaptive false): requests with one are refused. */
static const tl_backend_iface cuda_iface = {.forward = cuda_forward,
                                            .forward_batch = cuda_forward_batch,
                                            .forward_spans = cuda_forward_spans,
                                            .head_logits = cuda_head_logits,
                                            .info = cuda_info,
                                            .free = cuda_free,
                                            .forward_part = cuda_forward_part,
                                            .kv_from_rows = cuda_kv_from_rows,
                                            .adaptive = false};

tl_status tl_backend_cuda_new(tl_engine* e, int device, tl_backend** out) {
    *out = NULL;
    cuda_backend* cb = tl_alloc_zeroed(1, sizeof *cb);
    if (!cb) return tl_fail_oom("CUDA backend");
    tl_status st = tl_cuda_create(&e->file, device, &cb->c);
    if (st == TL_OK) st = tl_linear_prepare(&cb->head, &e->file.linears[e->file.n_linears - 1], e->isa);
    if (st != TL_OK) {
        cuda_free(&cb->base);
        return st;
    }
    for (size_t i = 0; i < e->file.n_linears; i++)
        if (i + 1 < e->file.n_linears || !tl_linear_reads_src(&cb->head)) tl_file_release_linear(&e->file, i);
    cb->kv = (tl_kv_allocator){
        .alloc = kv_alloc, .free = kv_free, .ctx = cb->c, .download = kv_download, .upload = kv_upload,
        .copy = kv_copy};
    cb->base = (tl_backend){&cuda_iface, &cb->kv};
    *out = &cb->base;
    return TL_OK;
}
