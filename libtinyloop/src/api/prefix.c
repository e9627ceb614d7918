/* prefix.c — tl_prefix: a prompt run once at depth L_b, immutable afterwards (docs/spec.md
 * §5.4). It keeps the KV blocks of all n_layers(L_b) slots, with the coda slots of every depth
 * 1 .. L_b written, and the last token's final state at each depth; a sequence at depth
 * L <= L_b starts from it by sharing the blocks (no copy) and taking state L-1 as its last
 * hidden state. */
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/seq.h"

TL_API tl_status tl_prefix_build(tl_model* model, const int32_t* tokens, size_t n, uint32_t loops,
                                 uint32_t cache_window, size_t chunk, tl_prefix** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    tl_engine* e;
    tl_status st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    const tl_config* c = tl_engine_config(e);
    const size_t d = c->d_model;
    tl_seq* s = NULL;
    tl_prefix* p = NULL;
    st = tl_engine_resolve_loops(e, loops, &loops);
    if (st == TL_OK && n == 0) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is empty");
    if (st == TL_OK && !tokens) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL");
    if (st == TL_OK && n > c->max_seq_len) /* before the copy of n tokens is allocated */
        st = tl_fail(TL_ERR_SEQ_TOO_LONG, "sequence length %zu exceeds max_seq_len %u", n, c->max_seq_len);
    if (st == TL_OK) st = tl_seq_new(e, loops, cache_window, &s);
    if (st == TL_OK) {
        p = tl_alloc_zeroed(1, sizeof *p);
        if (p) p->tokens = tl_alloc(n * sizeof(int32_t));
        if (p) p->loop_states = tl_alloc_zeroed((size_t)loops * d, sizeof(float));
        if (!p || !p->tokens || !p->loop_states) st = tl_fail_oom("prefix");
    }
    if (st == TL_OK) {
        const tl_run_opts opts = {.loop_states = p->loop_states};
        st = tl_seq_run(s, tokens, n, chunk, &opts);
    }
    if (st == TL_OK) {
        memcpy(p->tokens, tokens, n * sizeof(int32_t));
        p->n = n;
        p->loops = loops;
        p->window = cache_window;
        p->kv = s->kv; /* the blocks move from the temporary sequence */
        memset(&s->kv, 0, sizeof s->kv);
        tl_engine_ref(e);
        p->engine = e;
        *out = p;
        p = NULL;
    }
    if (p) {
        tl_free(p->tokens);
        tl_free(p->loop_states);
        tl_free(p);
    }
    tl_seq_free(s);
    tl_engine_unref(e);
    return st;
}

TL_API void tl_prefix_info(const tl_prefix* p, size_t* n_tokens, uint32_t* loops,
                           uint32_t* cache_window, size_t* nbytes) {
    if (n_tokens) *n_tokens = p ? p->n : 0;
    if (loops) *loops = p ? p->loops : 0;
    if (cache_window) *cache_window = p ? p->window : 0;
    if (nbytes)
        *nbytes = p ? tl_kv_bytes(&p->kv) +
                          sizeof(float) * p->loops * tl_engine_config(p->engine)->d_model +
                          sizeof(int32_t) * p->n
                    : 0;
}

TL_API const int32_t* tl_prefix_tokens(const tl_prefix* p, size_t* n) {
    if (n) *n = p ? p->n : 0;
    return p ? p->tokens : NULL;
}

TL_API void tl_prefix_free(tl_prefix* p) {
    if (!p) return;
    tl_kv_clear(&p->kv);
    tl_free(p->tokens);
    tl_free(p->loop_states);
    tl_engine_unref(p->engine);
    tl_free(p);
}

TL_API tl_status tl_seq_from_prefix(const tl_prefix* p, uint32_t loops, tl_seq** out) {
    if (!p || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix or out is NULL");
    *out = NULL;
    tl_status st = tl_engine_check_open(p->engine);
    if (st != TL_OK) return st;
    if (loops == 0) loops = p->loops;
    if (loops > p->loops)
        return tl_fail(TL_ERR_LOOPS_MISMATCH,
                       "loops mismatch: prefix built at loops=%u, requested %u (a prefix serves loops <= its own)",
                       p->loops, loops);
    tl_seq* s;
    st = tl_seq_new(p->engine, loops, p->window, &s);
    if (st != TL_OK) return st;
    st = tl_kv_share(&s->kv, &p->kv);
    if (st != TL_OK) {
        tl_seq_free(s);
        return st;
    }
    const size_t d = tl_engine_config(p->engine)->d_model;
    s->n = p->n;
    memcpy(s->last_hidden, p->loop_states + (size_t)(loops - 1) * d, d * sizeof(float));
    *out = s;
    return TL_OK;
}
