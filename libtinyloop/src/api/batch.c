/* batch.c — tl_generate_batch: every request checked, then started (its prompt run alone,
 * through the prefix cache), then all live requests decoded together, one token each per
 * step, through tl_forward_batch (a request with an exit rule runs each token only as deep as
 * its rule lets it, docs/spec.md §5.7). A request leaves the batch when its own stop rule fires;
 * since every row of a batched step is computed exactly as it would be alone, each request
 * gets the tokens and logits it gets from tl_generate. A speculative request (n_draft > 0)
 * runs one round of its own per step instead (core/speculate.h), emitting 1 .. n_draft tokens.
 *
 * The requests come as an array of pointers, each struct read up to its own `size`: no
 * element's address depends on this library's sizeof(tl_request), so a caller compiled
 * against a newer, larger struct still works, and requests need not be contiguous. Each
 * pointer must be distinct (a repeat is refused before anything is written): a request's
 * n_out and out_tokens belong to exactly one stream. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/forward.h"
#include "core/generate.h"
#include "core/speculate.h"

typedef struct batch {
    size_t n;
    tl_gen_params* params;  /* [n] resolved                              */
    tl_stream* streams;     /* [n]                                       */
    tl_spec* specs;         /* [n] the speculative requests' scratch      */
    int32_t* next;          /* [n] a speculative request's last emitted token,
                               which its next round runs                 */
    tl_decode_rows live;    /* [n] the sequences decoded in the current step, their new
                               tokens and their streams' logits buffers */
    size_t* live_index;     /* [n] their requests                        */
} batch;

typedef struct request_ref {
    uintptr_t address;
    size_t index;
} request_ref;

static int by_address_then_index(const void* a, const void* b) {
    const request_ref* x = a;
    const request_ref* y = b;
    if (x->address != y->address) return x->address < y->address ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* No request pointer appears twice: two streams would share one n_out and one out_tokens.
 * Sorts (address, index) pairs, O(n log n); names the earliest repeat, as a scan in index
 * order would: "request j is the same as request i", i < j the first index of that address. */
static tl_status check_distinct(tl_request* const* r, size_t n) {
    if (n < 2) return TL_OK;
    request_ref* refs = tl_alloc_zeroed(n, sizeof *refs);
    if (!refs) return tl_fail_oom("request check");
    for (size_t i = 0; i < n; i++) refs[i] = (request_ref){(uintptr_t)r[i], i};
    qsort(refs, n, sizeof *refs, by_address_then_index);
    size_t first = 0, repeat = SIZE_MAX, original = 0;
    for (size_t k = 1; k < n; k++) {
        if (refs[k].address != refs[first].address) first = k;
        else if (refs[k].index < repeat) {
            repeat = refs[k].index;
            original = refs[first].index;
        }
    }
    tl_free(refs);
    return repeat == SIZE_MAX ? TL_OK
                              : tl_fail(TL_ERR_INVALID_ARGUMENT, "request %zu is the same as request %zu (each "
                                        "element of requests must point to its own tl_request)", repeat, original);
}

/* Each request pointer is set, distinct, and its struct covers this library's tl_request (a
 * newer, larger one is read up to the fields known here); checked before anything is written. */
static tl_status check_layout(tl_request* const* r, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (!r[i]) return tl_fail(TL_ERR_INVALID_ARGUMENT, "request %zu is NULL", i);
        if (r[i]->size < sizeof(tl_request))
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "request %zu: size %zu is less than sizeof(tl_request) = %zu (set it to sizeof(tl_request))",
                           i, r[i]->size, sizeof(tl_request));
    }
    return check_distinct(r, n);
}

static tl_status check_requests(const tl_engine* e, tl_request* const* r, size_t n, tl_gen_params* params) {
    for (size_t i = 0; i < n; i++) {
        const tl_request* q = r[i];
        tl_status st = TL_OK;
        if (!q->out_tokens) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens is NULL");
        else st = tl_gen_check(e, q->prefix, q->prompt, q->n_prompt, q->params, &params[i]);
        if (st != TL_OK) {
            char why[480];
            snprintf(why, sizeof why, "%s", tl_last_error());
            return tl_fail(st, "request %zu: %s", i, why);
        }
    }
    return TL_OK;
}

static tl_status batch_alloc(batch* b, size_t n) {
    memset(b, 0, sizeof *b);
    b->n = n;
    b->params = tl_alloc_zeroed(n, sizeof *b->params);
    b->streams = tl_alloc_zeroed(n, sizeof *b->streams);
    b->specs = tl_alloc_zeroed(n, sizeof *b->specs);
    b->next = tl_alloc_zeroed(n, sizeof *b->next);
    b->live_index = tl_alloc_zeroed(n, sizeof *b->live_index);
    return b->params && b->streams && b->specs && b->next && b->live_index &&
                   tl_decode_rows_alloc(&b->live, n, 0) == TL_OK
               ? TL_OK : tl_fail_oom("batch");
}

static void batch_free(batch* b) {
    for (size_t i = 0; b->streams && i < b->n; i++) tl_stream_free(&b->streams[i]);
    for (size_t i = 0; b->specs && i < b->n; i++) tl_spec_free(&b->specs[i]);
    tl_free(b->params);
    tl_free(b->streams);
    tl_free(b->specs);
    tl_free(b->next);
    tl_decode_rows_free(&b->live);
    tl_free(b->live_index);
}

static tl_status start_all(tl_engine* e, batch* b, tl_request* const* requests) {
    for (size_t i = 0; i < b->n; i++) {
        tl_request* r = requests[i];
        tl_stream* s = &b->streams[i];
        tl_status st = tl_stream_init(s, e, &b->params[i], r->out_tokens, r->out_logits, &r->n_out);
        if (st == TL_OK && b->params[i].n_draft) st = tl_spec_init(&b->specs[i], e, &b->params[i], false);
        if (st == TL_OK) st = tl_gen_start(e, r->prefix, r->prompt, r->n_prompt, s);
        if (st != TL_OK) return st;
        if (r->prefix) tl_stream_see(s, r->prefix->tokens, r->prefix->n);
        tl_stream_see(s, r->prompt, r->n_prompt);
    }
    return TL_OK;
}

/* Sample every live request, but a speculative one only for its first token (its rounds
 * sample the rest); the plain ones not done form the next step's batch, *n_rounds counts the
 * speculative ones not done. */
static tl_status sample_all(batch* b, size_t* n_live, size_t* n_rounds) {
    *n_live = *n_rounds = 0;
    for (size_t i = 0; i < b->n; i++) {
        tl_stream* s = &b->streams[i];
        const bool speculative = b->params[i].n_draft > 0;
        if (s->done) continue;
        if (!speculative || s->n_emitted == 0) {
            tl_status st = tl_stream_sample(s, speculative ? &b->next[i] : &b->live.tokens[*n_live]);
            if (st != TL_OK) return st;
            if (s->done) continue;
        }
        if (speculative) {
            (*n_rounds)++;
            continue;
        }
        b->live.seqs[*n_live] = s->seq;
        b->live.logits[*n_live] = s->logits;
        b->live.exits[*n_live] = tl_gen_exit(&b->params[i]);
        b->live_index[(*n_live)++] = i;
    }
    return TL_OK;
}

/* Every live sequence has room for one more position: tl_gen_check bounds each request's
 * total length, so this guards the RoPE and KV tables should that bound ever be bypassed. */
static tl_status check_room(const tl_engine* e, const batch* b, size_t n_live) {
    const uint32_t max_seq_len = tl_engine_config(e)->max_seq_len;
    for (size_t j = 0; j < n_live; j++)
        if (b->live.seqs[j]->n >= max_seq_len)
            return tl_fail(TL_ERR_SEQ_TOO_LONG, "request %zu: sequence length %zu exceeds max_seq_len %u",
                           b->live_index[j], b->live.seqs[j]->n + 1, max_seq_len);
    return TL_OK;
}

tl_status tl_decode_rows_alloc(tl_decode_rows* rows, size_t capacity, size_t span_tokens) {
    memset(rows, 0, sizeof *rows);
    rows->seqs = tl_alloc_zeroed(capacity, sizeof *rows->seqs);
    rows->tokens = tl_alloc_zeroed(span_tokens ? span_tokens : capacity, sizeof *rows->tokens);
    rows->logits = tl_alloc_zeroed(capacity, sizeof *rows->logits);
    rows->exits = tl_alloc_zeroed(capacity, sizeof *rows->exits);
    rows->depths = tl_alloc_zeroed(capacity, sizeof *rows->depths);
    rows->marks = tl_alloc_zeroed(capacity, sizeof *rows->marks);
    if (span_tokens) rows->counts = tl_alloc_zeroed(capacity, sizeof *rows->counts);
    return rows->seqs && rows->tokens && rows->logits && rows->exits && rows->depths && rows->marks &&
                   (!span_tokens || rows->counts)
               ? TL_OK : tl_fail_oom("decode rows");
}

void tl_decode_rows_free(tl_decode_rows* rows) {
    tl_free(rows->seqs);
    tl_free(rows->tokens);
    tl_free(rows->logits);
    tl_free(rows->exits);
    tl_free(rows->depths);
    tl_free(rows->marks);
    tl_free(rows->counts);
    memset(rows, 0, sizeof *rows);
}

tl_status tl_gen_run_rows(tl_engine* e, tl_decode_rows* rows, size_t n) {
    tl_seq* const* seqs = rows->seqs;
    tl_kv_mark* marks = rows->marks;
    tl_status st = TL_OK;
    size_t tried = 0;  /* tables given a reservation attempt (a failed one changes nothing) */
    for (size_t j = 0; rows->counts && j < n; j++)
        if (rows->counts[j] > 1 && (!tl_has_mixed_pass(e) || tl_exit_active(&rows->exits[j], seqs[j]->loops)))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "row %zu: a span of %zu tokens %s", j, rows->counts[j],
                           tl_has_mixed_pass(e) ? "with an exit rule" : "on a backend without a mixed pass");
    for (; st == TL_OK && tried < n; tried++) {
        tl_seq* s = seqs[tried];
        marks[tried] = tl_kv_mark_now(&s->kv);
        st = tl_kv_reserve(&s->kv, &e->kv_geom, s->n_layers, s->n, rows->counts ? rows->counts[tried] : 1);
    }
    /* spans go through the mixed pass even when each has one token: their logits may be NULL */
    if (st == TL_OK)
        st = rows->counts && tl_has_mixed_pass(e)
                 ? tl_forward_spans(seqs, rows->tokens, rows->counts, n, rows->logits, rows->exits, rows->depths)
                 : tl_forward_batch(seqs, rows->tokens, n, rows->logits, rows->exits, rows->depths);
    if (st != TL_OK) {
        for (size_t j = 0; j < tried; j++) tl_kv_rollback(&seqs[j]->kv, marks[j]);
        return st;
    }
    for (size_t j = 0; j < n; j++) {
        tl_seq* s = seqs[j];
        s->n += rows->counts ? rows->counts[j] : 1;
        if (!rows->keep_window) tl_kv_release_outside(&s->kv, s->n, s->window);
    }
    return TL_OK;
}

/* One batched decode step over the live plain sequences, each under its own exit rule
 * (all-or-nothing on failure), then a round of each live speculative request. */
static tl_status step(tl_engine* e, batch* b, size_t n_live) {
    tl_status st = tl_engine_check_open(e);
    if (st == TL_OK) st = check_room(e, b, n_live);
    if (st == TL_OK && n_live) st = tl_gen_run_rows(e, &b->live, n_live);
    for (size_t j = 0; st == TL_OK && j < n_live; j++)
        tl_depth_count(b->params[b->live_index[j]].depth_stats, b->live.depths[j]);
    for (size_t i = 0; st == TL_OK && i < b->n; i++)
        if (b->params[i].n_draft && !b->streams[i].done)
            st = tl_spec_round(&b->specs[i], &b->streams[i], &b->next[i], 0);
    return st;
}

TL_API tl_status tl_generate_batch(tl_model* model, tl_request* const* requests, size_t n_requests) {
    if (!requests && n_requests) return tl_fail(TL_ERR_INVALID_ARGUMENT, "requests is NULL");
    tl_status st = check_layout(requests, n_requests);
    if (st != TL_OK) return st;
    for (size_t i = 0; i < n_requests; i++) requests[i]->n_out = 0;
    tl_engine* e;
    st = tl_model_acquire(model, &e);
    if (st != TL_OK || n_requests == 0) {
        if (st == TL_OK) tl_engine_unref(e);
        return st;
    }
    batch b;
    st = batch_alloc(&b, n_requests);
    if (st == TL_OK) st = check_requests(e, requests, n_requests, b.params);
    if (st == TL_OK) st = start_all(e, &b, requests);
    size_t n_live = 0, n_rounds = 0;
    while (st == TL_OK && (st = sample_all(&b, &n_live, &n_rounds)) == TL_OK && n_live + n_rounds > 0)
        st = step(e, &b, n_live);
    batch_free(&b);
    tl_engine_unref(e);
    return st;
}
