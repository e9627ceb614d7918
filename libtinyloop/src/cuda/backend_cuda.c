/* backend_cuda.c — the CUDA backend: the forward pass of a CUDA engine described for
 * tl_cuda_forward (each row's token, position, depth, window and where its K/V goes; each
 * sequence's visible KV spans), its outputs handed back in the CPU pass's shapes, and KV block
 * data allocated on the device. Rows run deepest first (tl_sort_deepest_first); rows of one
 * sequence share one span range. The head of a saved hidden state (tl_head_logits) runs on the
 * host with the one linear the backend repacks there (cpu/forward.h): a pass computes its own
 * logits on the device. A hidden-state prefix (docs/spec.md §5.4.1) is built by chunk passes
 * that hand each block's input rows to the sequence's capture, and rebuilt through
 * kv_from_rows, the K/V write of one slot from given rows (tl_cuda_kv_from_rows). */
#include "cuda/backend_cuda.h"

#include <stdio.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
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
                         (uint32_t)(pos - write->start), first_span, n_spans};
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
        if (pos[t] + 1 > *max_keys) *max_keys = (uint32_t)(pos[t] + 1);
    }
    return n_spans;
}

/* tl_cuda_batch.capture of a chunk pass of sequence ctx (rows at positions ctx->n ..): its
 * layer inputs to the hidden-state rows it builds (docs/spec.md §5.4.1). */
static void capture_rows(void* ctx, uint32_t slot, size_t row0, size_t n, const float* x) {
    const tl_seq* s = ctx;
    tl_hidden_capture(s->capture, slot, s->n + row0, n, x);
}

bool tl_cuda_describe_writes(const tl_seq* s, size_t pos0, size_t T, tl_cuda_row* rows) {
    const tl_kv_table* kv = &s->kv; /* live spans: [first_live, n_spans), consecutive, each with its block */
    if (kv->first_live >= kv->n_spans || kv->spans[kv->first_live].start > pos0) return false;
    const tl_kv_span* last = &kv->spans[kv->n_spans - 1];
    if (pos0 + T > (size_t)last->start + last->count) return false;
    for (size_t t = 0; t < T; t++) rows[t] = row_at(s, pos0 + t, 0, 0, 0);
    return true;
}

/* Rows t < T: token tokens[t] of seqs[t] at position pos[t] (KV reserved), deepest first.
 * Writes hidden [T][d], logits [T][V], logits_last [V] of row T-1 and, making the pass a prefix
 * build's, loop_states of row T-1 (each output but hidden may be NULL); with `capture` (a chunk
 * pass of that one sequence, positions capture->n ..), its layer inputs to capture->capture. */
static tl_status run_rows(tl_cuda* c, tl_seq* const* seqs, const size_t* pos, const int32_t* tokens, size_t T,
                          float* hidden, float* logits, float* logits_last, float* loop_states, tl_seq* capture) {
    const tl_engine* e = seqs[0]->engine;
    const size_t n_spans_max = tl_cuda_count_spans(seqs, T);
    tl_cuda_row* rows = tl_alloc_zeroed(T, sizeof *rows);
    tl_cuda_span* spans = tl_alloc_zeroed(n_spans_max ? n_spans_max : 1, sizeof *spans);
    if (!rows || !spans) {
        tl_free(rows);
        tl_free(spans);
        return tl_fail_oom("CUDA batch description");
    }
    uint32_t max_keys;
    const size_t n_spans = tl_cuda_describe(seqs, pos, tokens, T, rows, spans, &max_keys);
    const tl_cuda_batch batch = {T, rows, spans, n_spans, max_keys, e->kv_geom.block_size, e->kv_geom.head_bytes,
                                 e->kv_geom.kv_bits, hidden, logits, logits_last, loop_states,
                                 capture ? capture_rows : NULL, capture};
    const tl_status st = tl_cuda_forward(c, &batch);
    tl_free(rows);
    tl_free(spans);
    return st;
}

static tl_status cuda_forward(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                              float* logits_last, float* last_hidden, float* loop_states) {
    const size_t d = tl_engine_config(s->engine)->d_model;
    tl_seq** seqs = tl_alloc(T * sizeof *seqs);
    size_t* pos = tl_alloc(T * sizeof *pos);
    float* hidden = tl_alloc(T * d * sizeof(float));
    tl_status st = seqs && pos && hidden ? TL_OK : tl_fail_oom("CUDA chunk scratch");
    if (st == TL_OK) {
        for (size_t t = 0; t < T; t++) {
            seqs[t] = s;
            pos[t] = s->n + t;
        }
        st = run_rows(((cuda_backend*)b)->c, seqs, pos, tokens, T, hidden, logits_all, logits_last, loop_states,
                      s->capture ? s : NULL);
    }
    if (st == TL_OK) memcpy(last_hidden, hidden + (T - 1) * d, d * sizeof(float));
    tl_free(seqs);
    tl_free(pos);
    tl_free(hidden);
    return st;
}

/* Without exit rules (adaptive is false: tl_gen_check refuses them here), every row runs to its
 * depth. */
static tl_status cuda_forward_batch(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                    float* const* logits, const tl_exit* exits, uint32_t* depths) {
    for (size_t r = 0; exits && r < B; r++)
        if (tl_exit_active(&exits[r], seqs[r]->loops))
            return tl_fail(TL_ERR_UNSUPPORTED, "adaptive depth (exit_rule) is not on the CUDA backend yet");
    const tl_config* c = tl_engine_config(seqs[0]->engine);
    const size_t d = c->d_model, V = c->vocab_size;
    size_t* order = tl_alloc(B * sizeof *order);
    tl_seq** sorted = tl_alloc(B * sizeof *sorted);
    size_t* pos = tl_alloc(B * sizeof *pos);
    int32_t* sorted_tokens = tl_alloc(B * sizeof *sorted_tokens);
    float* hidden = tl_alloc(B * d * sizeof(float));
    float* sorted_logits = tl_alloc(B * V * sizeof(float));
    tl_status st = order && sorted && pos && sorted_tokens && hidden && sorted_logits
        ? TL_OK : tl_fail_oom("CUDA batch scratch");
    if (st == TL_OK) {
        tl_sort_deepest_first(seqs, B, order);
        for (size_t r = 0; r < B; r++) {
            sorted[r] = seqs[order[r]];
            pos[r] = sorted[r]->n;
            sorted_tokens[r] = tokens[order[r]];
        }
        st = run_rows(((cuda_backend*)b)->c, sorted, pos, sorted_tokens, B, hidden, sorted_logits, NULL, NULL, NULL);
    }
    for (size_t r = 0; st == TL_OK && r < B; r++) {
        memcpy(sorted[r]->last_hidden, hidden + r * d, d * sizeof(float));
        memcpy(logits[order[r]], sorted_logits + r * V, V * sizeof(float));
        if (depths) depths[order[r]] = sorted[r]->loops;
    }
    tl_free(order);
    tl_free(sorted);
    tl_free(pos);
    tl_free(sorted_tokens);
    tl_free(hidden);
    tl_free(sorted_logits);
    return st;
}

static tl_status cuda_kv_from_rows(tl_backend* b, tl_seq* s, uint32_t slot, size_t pos0, size_t T, const int8_t* q,
                                   const float* a) {
    const tl_engine* e = s->engine;
    if (T == 0) return TL_OK;
    tl_cuda_row* rows = tl_alloc(T * sizeof *rows);
    if (!rows) return tl_fail_oom("CUDA KV rows");
    const tl_cuda_kv_rows batch = {T, rows, slot, e->kv_geom.block_size, e->kv_geom.head_bytes, e->kv_geom.kv_bits,
                                   q, a};
    tl_status st;
    if (slot >= s->n_layers)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: slot %u of a sequence of %u", slot, s->n_layers);
    else if (!tl_cuda_describe_writes(s, pos0, T, rows))
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: positions %zu .. %zu are not reserved", pos0,
                     pos0 + T - 1);
    else
        st = tl_cuda_kv_from_rows(((cuda_backend*)b)->c, &batch);
    tl_free(rows);
    return st;
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

/* No part pass yet: speculative requests decode plainly, and tl_prefix_extend rebuilds a prefix.
 * No exit rules yet (adaptive false): requests with one are refused. */
static const tl_backend_iface cuda_iface = {.forward = cuda_forward,
                                            .forward_batch = cuda_forward_batch,
                                            .head_logits = cuda_head_logits,
                                            .info = cuda_info,
                                            .free = cuda_free,
                                            .forward_part = NULL,
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
        .alloc = kv_alloc, .free = kv_free, .ctx = cb->c, .download = kv_download, .upload = kv_upload};
    cb->base = (tl_backend){&cuda_iface, &cb->kv};
    *out = &cb->base;
    return TL_OK;
}
