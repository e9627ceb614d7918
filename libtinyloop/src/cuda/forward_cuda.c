/* forward_cuda.c — the forward pass on a CUDA engine: describe the rows (token, position,
 * depth, window, where the row's K/V goes) and each sequence's visible KV spans for
 * tl_cuda_forward, then hand its outputs back in the CPU path's shapes. Rows arrive in the
 * order forward.c runs them (deepest first); rows of one sequence share one span range. */
#include "cuda/forward_cuda.h"

#include <string.h>

#include "base/alloc.h"
#include "cuda/cuda_backend.h"
#include "base/errors.h"

size_t tl_cuda_count_spans(tl_seq* const* seqs, size_t T) {
    size_t n = 0;
    for (size_t t = 0; t < T; t++)
        if (t == 0 || seqs[t] != seqs[t - 1]) n += seqs[t]->kv.n_spans - seqs[t]->kv.first_live;
    return n;
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
        const tl_kv_span* write = &s->kv.spans[tl_kv_find(&s->kv, pos[t])];
        rows[t] = (tl_cuda_row){tokens[t], (uint32_t)pos[t], s->n_layers, s->window, write->block->data,
                                (uint32_t)(pos[t] - write->start), (uint32_t)first, (uint32_t)count};
        if (pos[t] + 1 > *max_keys) *max_keys = (uint32_t)(pos[t] + 1);
    }
    return n_spans;
}

/* Rows t < T: token tokens[t] of seqs[t] at position pos[t] (KV reserved), deepest first.
 * Writes hidden [T][d], logits [T][V], logits_last [V] of row T-1 and loop_states of row T-1
 * (each output but hidden may be NULL). */
static tl_status run_rows(tl_seq* const* seqs, const size_t* pos, const int32_t* tokens, size_t T,
                          float* hidden, float* logits, float* logits_last, float* loop_states) {
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
                                 hidden, logits, logits_last, loop_states};
    const tl_status st = tl_cuda_forward(e->cuda, &batch);
    tl_free(rows);
    tl_free(spans);
    return st;
}

tl_status tl_forward_cuda_chunk(tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
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
        st = run_rows(seqs, pos, tokens, T, hidden, logits_all, logits_last, loop_states);
    }
    if (st == TL_OK) memcpy(last_hidden, hidden + (T - 1) * d, d * sizeof(float));
    tl_free(seqs);
    tl_free(pos);
    tl_free(hidden);
    return st;
}

tl_status tl_forward_batch_cuda(tl_seq* const* seqs, const int32_t* tokens, const size_t* order, size_t B,
                                float* const* logits) {
    const tl_config* c = tl_engine_config(seqs[0]->engine);
    const size_t d = c->d_model, V = c->vocab_size;
    tl_seq** sorted = tl_alloc(B * sizeof *sorted);
    size_t* pos = tl_alloc(B * sizeof *pos);
    int32_t* sorted_tokens = tl_alloc(B * sizeof *sorted_tokens);
    float* hidden = tl_alloc(B * d * sizeof(float));
    float* sorted_logits = tl_alloc(B * V * sizeof(float));
    tl_status st = sorted && pos && sorted_tokens && hidden && sorted_logits ? TL_OK : tl_fail_oom("CUDA batch scratch");
    if (st == TL_OK) {
        for (size_t r = 0; r < B; r++) {
            sorted[r] = seqs[order[r]];
            pos[r] = sorted[r]->n;
            sorted_tokens[r] = tokens[order[r]];
        }
        st = run_rows(sorted, pos, sorted_tokens, B, hidden, sorted_logits, NULL, NULL);
    }
    for (size_t r = 0; st == TL_OK && r < B; r++) {
        memcpy(sorted[r]->last_hidden, hidden + r * d, d * sizeof(float));
        memcpy(logits[order[r]], sorted_logits + r * V, V * sizeof(float));
    }
    tl_free(sorted);
    tl_free(pos);
    tl_free(sorted_tokens);
    tl_free(hidden);
    tl_free(sorted_logits);
    return st;
}
