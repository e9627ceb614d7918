/* seq.c — tl_seq: create, prefill (chunked, all-or-nothing), decode, last logits, fork, free.
 * A sequence is used by one thread at a time; it shares the engine and KV blocks by reference
 * count with forks and prefixes. */
#include "core/seq.h"

#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/forward.h"

tl_status tl_scratch_fit(tl_scratch* s, size_t bytes, const char* what) {
    if (bytes <= s->bytes) return TL_OK;
    void* grown = tl_alloc(bytes);
    if (!grown) return tl_fail_oom(what);
    tl_free(s->base);
    *s = (tl_scratch){grown, bytes};
    return TL_OK;
}

tl_status tl_seq_check_depth(const tl_engine* e, uint32_t loops) {
    const size_t n_layers = tl_n_layers(tl_engine_config(e), loops);
    if (n_layers <= TL_MAX_CACHE_LAYERS) return TL_OK;
    return tl_fail(TL_ERR_INVALID_ARGUMENT, "loops=%u needs %zu cache layers, more than %d", loops, n_layers,
                   TL_MAX_CACHE_LAYERS);
}

tl_status tl_seq_new(tl_engine* e, uint32_t loops, uint32_t window, tl_seq** out) {
    *out = NULL;
    tl_status st = tl_seq_check_depth(e, loops);
    if (st != TL_OK) return st;
    tl_seq* s = tl_alloc_zeroed(1, sizeof *s);
    float* hidden = tl_alloc_zeroed(tl_engine_config(e)->d_model, sizeof(float));
    float* next = tl_alloc_zeroed(tl_engine_config(e)->d_model, sizeof(float));
    if (!s || !hidden || !next) {
        tl_free(s);
        tl_free(hidden);
        tl_free(next);
        return tl_fail_oom("sequence");
    }
    tl_engine_ref(e);
    s->engine = e;
    s->loops = loops;
    s->n_layers = (uint32_t)tl_n_layers(tl_engine_config(e), loops);
    s->window = window;
    s->last_hidden = hidden;
    s->next_hidden = next;
    *out = s;
    return TL_OK;
}

TL_API tl_status tl_seq_create(tl_model* model, uint32_t loops, uint32_t cache_window, tl_seq** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    tl_engine* e;
    tl_status st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    st = tl_engine_resolve_loops(e, loops, &loops);
    if (st == TL_OK) st = tl_seq_new(e, loops, cache_window, out);
    tl_engine_unref(e);
    return st;
}

tl_status tl_seq_check_instruction(const tl_seq* s, size_t n) {
    if (s->n > 0 || n >= s->instruction) return TL_OK;
    return tl_fail(TL_ERR_INVALID_ARGUMENT,
                   "the first prefill must hold the instruction block: %zu tokens, instruction length %zu", n,
                   s->instruction);
}

/* Report one more chunk; true if the callback asks to stop. */
static bool report(tl_progress* progress, size_t T) {
    if (!progress || !progress->fn) return false;
    progress->done += T;
    progress->stopped = progress->fn(progress->user_data, progress->done, progress->total) != 0;
    return progress->stopped;
}

tl_status tl_seq_run(tl_seq* s, const int32_t* tokens, size_t n, size_t chunk, const tl_run_opts* opts) {
    tl_engine* e = s->engine;
    const tl_config* c = tl_engine_config(e);
    tl_status st = tl_engine_check_open(e);
    if (st != TL_OK) return st;
    if (n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "no tokens given (n = 0)");
    if (!tokens) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL");
    st = tl_engine_check_tokens(e, tokens, n, "tokens");
    if (st == TL_OK) st = tl_seq_check_instruction(s, n);
    if (st != TL_OK) return st;
    if (n > c->max_seq_len - s->n)
        return tl_fail(TL_ERR_SEQ_TOO_LONG, "sequence length %zu exceeds max_seq_len %u", s->n + n,
                       c->max_seq_len);
    if (chunk == 0 || chunk > n) chunk = n;

    float* hidden = s->next_hidden;
    const size_t n_before = s->n;
    const tl_kv_mark start = tl_kv_mark_now(&s->kv);
    bool stopped = false;
    for (size_t off = 0, T; off < n && st == TL_OK && !stopped; off += T) {
        T = tl_chunk_rows(s->instruction, s->n, chunk, n - off);
        st = tl_kv_reserve(&s->kv, &e->kv_geom, s->n_layers, s->n, T);
        const bool last = off + T == n;
        /* a prefix build's every chunk writes every depth's coda slots; the last one's states stay */
        if (st == TL_OK)
            st = tl_forward(s, tokens + off, T, opts->logits_all ? opts->logits_all + off * c->vocab_size : NULL,
                            last ? opts->logits_last : NULL, hidden, opts->loop_states);
        if (st == TL_OK) {
            s->n += T;
            stopped = report(opts->progress, T);
        }
    }
    if (st != TL_OK || stopped) {
        tl_kv_rollback(&s->kv, start);
        s->n = n_before;
    } else {
        s->next_hidden = s->last_hidden;
        s->last_hidden = hidden;
        if (!opts->keep_window) tl_kv_release_outside(&s->kv, s->n, s->window);
    }
    return st;
}

TL_API tl_status tl_seq_prefill(tl_seq* seq, const int32_t* tokens, size_t n, size_t chunk,
                                float* logits_out) {
    if (!seq) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq is NULL");
    const tl_run_opts opts = {.logits_last = logits_out};
    return tl_seq_run(seq, tokens, n, chunk, &opts);
}

TL_API tl_status tl_seq_prefill_all(tl_seq* seq, const int32_t* tokens, size_t n, size_t chunk,
                                    float* logits_all) {
    if (!seq) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq is NULL");
    if (!logits_all) return tl_fail(TL_ERR_INVALID_ARGUMENT, "logits_all is NULL");
    const tl_run_opts opts = {.logits_all = logits_all};
    return tl_seq_run(seq, tokens, n, chunk, &opts);
}

TL_API tl_status tl_seq_decode(tl_seq* seq, int32_t token, float* logits_out) {
    if (!seq) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq is NULL");
    const tl_run_opts opts = {.logits_last = logits_out};
    return tl_seq_run(seq, &token, 1, 0, &opts);
}

TL_API tl_status tl_seq_last_logits(const tl_seq* seq, float* logits_out) {
    if (!seq || !logits_out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq or logits_out is NULL");
    tl_status st = tl_engine_check_open(seq->engine);
    if (st != TL_OK) return st;
    if (seq->n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the sequence is empty: no last token");
    return tl_head_logits(seq->engine, seq->last_hidden, logits_out);
}

TL_API tl_status tl_seq_fork(const tl_seq* seq, tl_seq** out) {
    if (!seq || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq or out is NULL");
    *out = NULL;
    tl_status st = tl_engine_check_open(seq->engine);
    if (st != TL_OK) return st;
    tl_seq* s;
    st = tl_seq_new(seq->engine, seq->loops, seq->window, &s);
    if (st != TL_OK) return st;
    st = tl_kv_share(&s->kv, &seq->kv);
    if (st != TL_OK) {
        tl_seq_free(s);
        return st;
    }
    s->n = seq->n;
    s->instruction = seq->instruction;
    memcpy(s->last_hidden, seq->last_hidden, tl_engine_config(seq->engine)->d_model * sizeof(float));
    *out = s;
    return TL_OK;
}

TL_API tl_status tl_seq_set_instruction(tl_seq* seq, size_t instruction_length) {
    if (!seq) return tl_fail(TL_ERR_INVALID_ARGUMENT, "seq is NULL");
    if (seq->n > 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "the instruction length is set on an empty sequence only (this one holds %zu tokens)", seq->n);
    seq->instruction = instruction_length;
    return TL_OK;
}

TL_API size_t tl_seq_instruction(const tl_seq* seq) { return seq ? seq->instruction : 0; }

TL_API size_t tl_seq_length(const tl_seq* seq) { return seq ? seq->n : 0; }

TL_API void tl_seq_shape(const tl_seq* seq, uint32_t* loops, uint32_t* cache_window) {
    if (loops) *loops = seq ? seq->loops : 0;
    if (cache_window) *cache_window = seq ? seq->window : 0;
}

TL_API void tl_seq_free(tl_seq* seq) {
    if (!seq) return;
    tl_kv_clear(&seq->kv);
    tl_free(seq->scratch.base);
    tl_free(seq->last_hidden);
    tl_free(seq->next_hidden);
    tl_engine_unref(seq->engine);
    tl_free(seq);
}
