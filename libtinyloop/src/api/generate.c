/* generate.c — tl_generate and tl_generate_from_prefix (docs/spec.md §5): validate every
 * parameter before any work, run the prompt (through the automatic prefix cache) or take the
 * prefix's state, then sample, append, check the stop rules (stop ids, stop sequences on the
 * emitted tokens, max_tokens) and decode the new token (a batched pass of one row, under the
 * request's exit rule, docs/spec.md §5.7), until a rule stops it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/forward.h"
#include "core/generate.h"
#include "core/speculate.h"

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

/* The instruction block (docs/spec.md §4.1): at most the prompt's n tokens; from a prefix none
 * (the prefix's own applies). */
static tl_status check_instruction(const tl_prefix* prefix, size_t n, size_t instruction_length) {
    if (prefix && instruction_length)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a generation from a prefix takes the prefix's instruction length "
                       "(%zu): instruction_length must be 0, got %zu", prefix->instruction, instruction_length);
    if (!prefix && instruction_length > n)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "instruction_length %zu exceeds the prompt's %zu tokens",
                       instruction_length, n);
    return TL_OK;
}

/* Every rule but the draft's, which needs the resolved depth. */
static tl_status check_request(const tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n,
                               const tl_gen_params* given, tl_gen_params* p) {
    tl_status st = tl_engine_check_open(e);
    if (st != TL_OK) return st;
    if (prefix && prefix->engine != e)
        return tl_fail(TL_ERR_WRONG_MODEL, "the prefix was built by another model");
    if (n && !prompt) return tl_fail(TL_ERR_INVALID_ARGUMENT, prefix ? "suffix is NULL but n_suffix > 0" : "prompt is NULL");
    if (!prefix && n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is empty");
    st = tl_engine_check_tokens(e, prompt, n, prefix ? "suffix" : "prompt");
    if (st == TL_OK) st = resolve_params(e, given, p);
    if (st == TL_OK) st = check_instruction(prefix, n, p->instruction_length);
    if (st != TL_OK) return st;
    if (!prefix) {
        st = check_length(tl_engine_config(e), n, p->max_tokens);
        if (st == TL_OK) st = tl_engine_resolve_loops(e, p->loops, &p->loops);
        return st == TL_OK ? tl_seq_check_depth(e, p->loops) : st;
    }
    if (p->loops == 0) p->loops = prefix->loops;
    st = tl_prefix_check_loops(prefix, p->loops);
    if (st != TL_OK) return st;
    if (p->cache_window != prefix->window)
        return tl_fail(TL_ERR_WINDOW_MISMATCH, "cache_window mismatch: prefix built with cache_window=%u, requested %u",
                       prefix->window, p->cache_window);
    return check_length(tl_engine_config(e), prefix->n + n, p->max_tokens);
}

/* Self-speculative decoding's parameters against the resolved depth p->loops. */
static tl_status check_draft(const tl_gen_params* p) {
    if (p->n_draft > TL_MAX_DRAFT) return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_draft > %d", TL_MAX_DRAFT);
    if (p->draft_wave > 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_wave must be 0 or 1, got %u", p->draft_wave);
    const bool chosen = p->draft_loops == 0 && p->draft_wave && p->loops >= 2; /* the wave picks L_d */
    if (p->n_draft > 0 && !chosen && (p->draft_loops < 1 || p->draft_loops >= p->loops))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_loops must be in 1 .. loops-1 (loops=%u) when n_draft > 0, got %u",
                       p->loops, p->draft_loops);
    return TL_OK;
}

/* Adaptive depth's parameters (docs/spec.md §5.7) against the resolved depth p->loops:
 * min_loops (0 = 1) and, with a rule, its threshold (0 = the rule's default) resolved. */
static tl_status check_exit(const tl_engine* e, tl_gen_params* p) {
    const tl_config* c = tl_engine_config(e);
    const float q = p->exit_threshold;
    if (p->exit_rule > TL_EXIT_ARGMAX)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "unknown exit_rule %u (0 none, 1 gate, 2 latent, 3 kl, 4 argmax)",
                       p->exit_rule);
    if (p->min_loops > p->loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_loops must be in 1 .. loops (loops=%u), got %u", p->loops,
                       p->min_loops);
    if (p->min_loops == 0) p->min_loops = 1;
    if (p->exit_rule == TL_EXIT_NONE) return TL_OK;
    if (p->exit_rule == TL_EXIT_GATE) {
        if (!c->exit_gate) return tl_fail(TL_ERR_INVALID_ARGUMENT, "exit_rule gate: the model has no exit gate");
        if (q == 0) p->exit_threshold = c->exit_threshold;
        else if (!(q > 0 && q <= 1))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "exit_threshold must be in (0, 1] for exit_rule gate, got %g",
                           (double)q);
    } else if (p->exit_rule == TL_EXIT_ARGMAX) { /* a count of steps */
        if (q == 0) p->exit_threshold = TL_EXIT_ARGMAX_DEFAULT;
        else if (!(q >= 1 && q <= TL_EXIT_ARGMAX_MAX && q == floorf(q)))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "exit_threshold must be an integer in 1 .. %d for exit_rule "
                           "argmax, got %.9g", TL_EXIT_ARGMAX_MAX, (double)q);
    } else {
        const char* name = p->exit_rule == TL_EXIT_LATENT ? "latent" : "kl";
        if (q == 0) p->exit_threshold = p->exit_rule == TL_EXIT_LATENT ? TL_EXIT_LATENT_DEFAULT : TL_EXIT_KL_DEFAULT;
        else if (!isfinite(q) || !(q > 0))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "exit_threshold must be finite and > 0 for exit_rule %s, got %g",
                           name, (double)q);
    }
    if (p->n_draft > 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "an exit_rule (adaptive depth) cannot be combined with "
                       "self-speculative decoding (n_draft > 0)");
    if (!tl_has_adaptive_pass(e))
        return tl_fail(TL_ERR_UNSUPPORTED, "adaptive depth (exit_rule) is not on the CUDA backend yet");
    return TL_OK;
}

tl_status tl_gen_check(const tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n,
                       const tl_gen_params* given, tl_gen_params* p) {
    tl_status st = check_request(e, prefix, prompt, n, given, p);
    if (st == TL_OK) st = check_draft(p);
    if (st == TL_OK) st = check_exit(e, p);
    /* a backend without a part pass decodes plainly: the same tokens, nothing drafted (§5.6) */
    if (st == TL_OK && !tl_has_part_pass(e)) p->n_draft = 0;
    if (st == TL_OK && p->draft_stats) *p->draft_stats = (tl_draft_stats){0, 0};
    if (st == TL_OK && p->depth_stats) *p->depth_stats = (tl_depth_stats){0, 0};
    return st;
}

tl_pcache_key tl_gen_cache_key(const tl_engine* e, const tl_seq* s, const tl_gen_params* p) {
    /* with a coda a block's coda slots hold its own depth only: one tree per depth (§4.3) */
    const uint32_t tree_depth = tl_engine_config(e)->n_coda_blocks ? s->loops : 0;
    return (tl_pcache_key){p->cache_salt, p->cache_window, s->n_layers, tree_depth, (uint32_t)s->instruction};
}

/* Run the prompt into the empty sequence s, reusing the longest cached prefix of it. */
static tl_status run_prompt(tl_engine* e, tl_seq* s, const int32_t* prompt, size_t n, const tl_gen_params* p,
                            tl_run_opts* opts) {
    if (!e->pcache) return tl_seq_run(s, prompt, n, p->prefill_chunk, opts);
    const tl_pcache_key key = tl_gen_cache_key(e, s, p);
    size_t hit;
    tl_pcache_lookup(e->pcache, &key, prompt, n, &s->kv, &hit);
    s->n = hit;
    opts->progress->done = hit;
    opts->keep_window = true;
    tl_status st = tl_seq_run(s, prompt + hit, n - hit, p->prefill_chunk, opts);
    if (st != TL_OK || opts->progress->stopped) return st;
    tl_pcache_insert(e->pcache, &key, prompt, n, &s->kv);
    tl_kv_release_outside(&s->kv, s->n, s->window);
    return TL_OK;
}

tl_status tl_gen_start(tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n, tl_stream* stream) {
    const tl_gen_params* p = stream->p;
    tl_progress progress = {p->on_prefill, p->user_data, prefix ? prefix->n : 0, (prefix ? prefix->n : 0) + n, false};
    tl_run_opts opts = {.logits_last = stream->logits, .progress = &progress};
    tl_seq* s = NULL;
    tl_status st = prefix ? tl_seq_from_prefix(prefix, p->loops, &s) : tl_seq_new(e, p->loops, p->cache_window, &s);
    if (st == TL_OK) {
        if (!prefix) s->instruction = p->instruction_length;
        if (!prefix) st = run_prompt(e, s, prompt, n, p, &opts);
        else if (n) st = tl_seq_run(s, prompt, n, p->prefill_chunk, &opts);
        else st = tl_seq_last_logits(s, stream->logits);
    }
    if (st != TL_OK) {
        tl_seq_free(s);
        s = NULL;
    }
    stream->seq = s;
    stream->done = progress.stopped;
    if (progress.stopped) stream->finish = TL_FINISH_STOP;
    return st;
}

/* Run the stream's last emitted token (at position s->seq->n) into s->logits: a batched pass of
 * one row, under the request's exit rule. */
static tl_status decode_one(tl_engine* e, tl_stream* s, int32_t token) {
    tl_status st = tl_engine_check_open(e);
    if (st != TL_OK) return st;
    tl_exit rule = tl_gen_exit(s->p);
    uint32_t depth;
    tl_kv_mark mark;
    tl_decode_rows row = {.seqs = &s->seq, .tokens = &token, .logits = &s->logits, .exits = &rule, .depths = &depth,
                          .marks = &mark};
    st = tl_gen_run_rows(e, &row, 1);
    if (st == TL_OK) tl_depth_count(s->p->depth_stats, depth);
    return st;
}

/* The whole of one request, decoded alone: token by token, in speculative rounds, or in the
 * wave schedule. */
static tl_status generate_one(tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n,
                              const tl_gen_params* params, int32_t* out_tokens, size_t* n_out, float* out_logits) {
    if (n_out) *n_out = 0;
    if (!out_tokens || !n_out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens or n_out is NULL");
    tl_gen_params p;
    tl_status st = tl_gen_check(e, prefix, prompt, n, params, &p);
    if (st != TL_OK) return st;
    tl_stream s;
    tl_spec spec = {0};
    st = tl_stream_init(&s, e, &p, out_tokens, out_logits, n_out);
    if (st != TL_OK) return st;
    if (p.n_draft) st = tl_spec_init(&spec, e, &p, p.draft_wave);
    if (st == TL_OK) st = tl_gen_start(e, prefix, prompt, n, &s);
    if (prefix) tl_stream_see(&s, prefix->tokens, prefix->n);
    tl_stream_see(&s, prompt, n);
    int32_t token;
    if (st == TL_OK && !s.done) st = tl_stream_sample(&s, &token);
    while (st == TL_OK && !s.done) {
        if (spec.wave) st = tl_spec_wave(&spec, &s, &token);
        else if (p.n_draft) st = tl_spec_round(&spec, &s, &token, 0);
        else if ((st = decode_one(e, &s, token)) == TL_OK) st = tl_stream_sample(&s, &token);
    }
    tl_spec_free(&spec);
    tl_stream_free(&s);
    return st;
}

TL_API tl_status tl_generate(tl_model* model, const int32_t* prompt, size_t n, const tl_gen_params* params,
                             int32_t* out_tokens, size_t* n_out, float* out_logits) {
    tl_engine* e;
    tl_status st = tl_model_acquire(model, &e);
    if (st != TL_OK) {
        if (n_out) *n_out = 0;
        return st;
    }
    st = generate_one(e, NULL, prompt, n, params, out_tokens, n_out, out_logits);
    tl_engine_unref(e);
    return st;
}

TL_API tl_status tl_generate_from_prefix(const tl_prefix* prefix, const int32_t* suffix, size_t n_suffix,
                                         const tl_gen_params* params, int32_t* out_tokens, size_t* n_out,
                                         float* out_logits) {
    if (!prefix) {
        if (n_out) *n_out = 0;
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix is NULL");
    }
    return generate_one(prefix->engine, prefix, suffix, n_suffix, params, out_tokens, n_out, out_logits);
}
