/* generate.c — tl_generate and tl_generate_from_prefix (docs/spec.md §5): validate every
 * parameter before any work, run the prompt (or take the prefix's state), then sample,
 * append, check the stop rules (eos, stop sequences on the emitted tokens, max_tokens) and
 * decode the new token, until a rule stops it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "errors.h"
#include "sampling.h"
#include "seq.h"

TL_API tl_gen_params tl_gen_params_default(void) {
    tl_gen_params p;
    memset(&p, 0, sizeof p);
    p.size = sizeof p;
    p.max_tokens = 32;
    p.temperature = 0.0f;
    p.top_k = 50;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    return p;
}

/* Defaults overlaid with the caller's struct, then every rule checked (in the order of the
 * Python layer's checks). The length rule is checked by the callers, which know n0. */
static tl_status resolve_params(const tl_engine* e, const tl_gen_params* given, tl_gen_params* p) {
    *p = tl_gen_params_default();
    if (given) {
        if (given->size < sizeof(size_t))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_gen_params.size must be set (sizeof(tl_gen_params))");
        memcpy(p, given, given->size < sizeof *p ? given->size : sizeof *p);
    }
    if (p->max_tokens < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_tokens < 1");
    if (p->loops > TL_MAX_LOOPS) return tl_fail(TL_ERR_INVALID_ARGUMENT, "loops > %d", TL_MAX_LOOPS);
    if (!isfinite(p->temperature) || !(p->temperature >= 0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "temperature must be finite and >= 0, got %g",
                       (double)p->temperature);
    if (p->top_k < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k < 0");
    if (!isfinite(p->top_p) || !(p->top_p > 0) || !(p->top_p <= 1))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_p must be finite and > 0 and <= 1, got %g",
                       (double)p->top_p);
    if (!isfinite(p->repetition_penalty) || !(p->repetition_penalty > 0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "repetition_penalty must be finite and > 0, got %g",
                       (double)p->repetition_penalty);
    if (p->n_stop && (!p->stop_tokens || !p->stop_lengths))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_stop > 0 but stop_tokens or stop_lengths is NULL");
    const int32_t* stop = p->stop_tokens;
    for (size_t i = 0; i < p->n_stop; i++) {
        if (p->stop_lengths[i] == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_sequences[%zu] is empty", i);
        char what[48];
        snprintf(what, sizeof what, "stop_sequences[%zu]", i);
        tl_status st = tl_engine_check_tokens(e, stop, p->stop_lengths[i], what);
        if (st != TL_OK) return st;
        stop += p->stop_lengths[i];
    }
    return TL_OK;
}

static tl_status check_length(const tl_config* c, size_t n0, size_t max_tokens) {
    if (max_tokens > c->max_seq_len || n0 > c->max_seq_len - max_tokens) {
        const size_t total = max_tokens > SIZE_MAX - n0 ? SIZE_MAX : n0 + max_tokens;
        return tl_fail(TL_ERR_SEQ_TOO_LONG, "sequence length %zu exceeds max_seq_len %u", total, c->max_seq_len);
    }
    return TL_OK;
}

/* Whether the emitted tokens end with one of the stop sequences. */
static bool ends_with_stop(const tl_gen_params* p, const int32_t* emitted, size_t n) {
    const int32_t* stop = p->stop_tokens;
    for (size_t i = 0; i < p->n_stop; stop += p->stop_lengths[i], i++) {
        const size_t len = p->stop_lengths[i];
        if (len <= n && memcmp(emitted + n - len, stop, len * sizeof *stop) == 0) return true;
    }
    return false;
}

/* The sampling loop from a sequence whose last logits are in `logits`; the history (for the
 * repetition penalty) is the tokens already in the sequence: head[0..n_head) then
 * tail[0..n_tail). */
static tl_status sample_loop(tl_seq* s, const int32_t* head, size_t n_head, const int32_t* tail,
                             size_t n_tail, const tl_gen_params* p, float* logits, int32_t* out_tokens,
                             size_t* n_out, float* out_logits) {
    const tl_config* c = tl_engine_config(s->engine);
    const uint32_t V = c->vocab_size;
    tl_sample_scratch w = {tl_alloc(V * sizeof(float)), tl_alloc(V * sizeof(int32_t)),
                           tl_alloc(V * sizeof(int64_t))};
    uint8_t* seen = tl_alloc_zeroed(V, 1);
    tl_status st = (w.z && w.order && w.weights && seen) ? TL_OK : tl_fail_oom("sampler");
    const tl_sampler sampler = {p->temperature, p->top_k, p->top_p, p->repetition_penalty, p->seed};
    for (size_t i = 0; st == TL_OK && i < n_head; i++) seen[head[i]] = 1;
    for (size_t i = 0; st == TL_OK && i < n_tail; i++) seen[tail[i]] = 1;
    for (size_t i = 0; st == TL_OK && i < p->max_tokens; i++) {
        int32_t token;
        st = tl_sample(&sampler, logits, V, seen, s->n, &w, &token);
        if (st != TL_OK) break;
        out_tokens[i] = token;
        if (out_logits) memcpy(out_logits + i * V, logits, V * sizeof(float));
        seen[token] = 1;
        *n_out = i + 1;
        if ((p->on_token && p->on_token(p->user_data, token) != 0) ||
            (c->eos_id >= 0 && token == c->eos_id) || ends_with_stop(p, out_tokens, i + 1) ||
            i + 1 == p->max_tokens)
            break;
        st = tl_seq_decode(s, token, logits);
    }
    tl_free(w.z);
    tl_free(w.order);
    tl_free(w.weights);
    tl_free(seen);
    return st;
}

static tl_status check_outputs(int32_t* out_tokens, size_t* n_out) {
    if (n_out) *n_out = 0;
    if (!out_tokens || !n_out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens or n_out is NULL");
    return TL_OK;
}

TL_API tl_status tl_generate(tl_model* model, const int32_t* prompt, size_t n, const tl_gen_params* params,
                             int32_t* out_tokens, size_t* n_out, float* out_logits) {
    tl_status st = check_outputs(out_tokens, n_out);
    if (st != TL_OK) return st;
    tl_engine* e;
    st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    tl_gen_params p;
    tl_seq* s = NULL;
    float* logits = NULL;
    if (!prompt || n == 0) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is empty");
    if (st == TL_OK) st = tl_engine_check_tokens(e, prompt, n, "prompt");
    if (st == TL_OK) st = resolve_params(e, params, &p);
    if (st == TL_OK) st = check_length(tl_engine_config(e), n, p.max_tokens);
    uint32_t loops = 0;
    if (st == TL_OK) st = tl_engine_resolve_loops(e, p.loops, &loops);
    if (st == TL_OK) st = tl_seq_new(e, loops, p.cache_window, &s);
    if (st == TL_OK) {
        logits = tl_alloc(tl_engine_config(e)->vocab_size * sizeof(float));
        if (!logits) st = tl_fail_oom("logits");
    }
    if (st == TL_OK) st = tl_seq_run(s, prompt, n, p.prefill_chunk, NULL, logits, NULL);
    if (st == TL_OK) st = sample_loop(s, prompt, n, NULL, 0, &p, logits, out_tokens, n_out, out_logits);
    tl_free(logits);
    tl_seq_free(s);
    tl_engine_unref(e);
    return st;
}

TL_API tl_status tl_generate_from_prefix(const tl_prefix* prefix, const int32_t* suffix, size_t n_suffix,
                                         const tl_gen_params* params, int32_t* out_tokens, size_t* n_out,
                                         float* out_logits) {
    tl_status st = check_outputs(out_tokens, n_out);
    if (st != TL_OK) return st;
    if (!prefix) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix is NULL");
    if (n_suffix && !suffix) return tl_fail(TL_ERR_INVALID_ARGUMENT, "suffix is NULL but n_suffix > 0");
    tl_engine* e = prefix->engine;
    st = tl_engine_check_open(e);
    if (st == TL_OK) st = tl_engine_check_tokens(e, suffix, n_suffix, "suffix");
    tl_gen_params p;
    if (st == TL_OK) st = resolve_params(e, params, &p);
    if (st != TL_OK) return st;
    const uint32_t loops = p.loops ? p.loops : prefix->loops;
    if (loops > prefix->loops)
        return tl_fail(TL_ERR_LOOPS_MISMATCH,
                       "loops mismatch: prefix built at loops=%u, requested %u (a prefix serves loops <= its own)",
                       prefix->loops, loops);
    if (p.cache_window != prefix->window)
        return tl_fail(TL_ERR_WINDOW_MISMATCH, "cache_window mismatch: prefix built with cache_window=%u, requested %u",
                       prefix->window, p.cache_window);
    st = check_length(tl_engine_config(e), prefix->n + n_suffix, p.max_tokens);
    if (st != TL_OK) return st;
    tl_seq* s = NULL;
    float* logits = tl_alloc(tl_engine_config(e)->vocab_size * sizeof(float));
    if (!logits) return tl_fail_oom("logits");
    st = tl_seq_from_prefix(prefix, loops, &s);
    if (st == TL_OK)
        st = n_suffix ? tl_seq_run(s, suffix, n_suffix, p.prefill_chunk, NULL, logits, NULL)
                      : tl_seq_last_logits(s, logits);
    if (st == TL_OK)
        st = sample_loop(s, prefix->tokens, prefix->n, suffix, n_suffix, &p, logits, out_tokens, n_out, out_logits);
    tl_free(logits);
    tl_seq_free(s);
    return st;
}
