/* prefix.c — tl_prefix: a prompt run once at depth L_b (docs/spec.md §5.4). It keeps the KV
 * blocks of all n_layers(L_b) slots, with the coda slots of every depth 1 .. L_b written, and
 * the last token's final state at each depth; a sequence at depth L <= L_b starts from it by
 * sharing the blocks (no copy) and taking state L-1 as its last hidden state.
 *
 * Warm start (TL_PREFIX_WARM_START): the build also keeps every token's state after iteration
 * L_b-1 (and its injected term, or a two-state core's low state), so tl_prefix_extend deepens
 * the prefix to L > L_b by running only iterations L_b .. L-1 of every token from those states,
 * into new blocks of n_layers(L) slots whose first n_layers(L_b) are the old blocks' (copied):
 * the result is bit for bit the prefix a build at L makes, its kept states (and low states)
 * those after iteration L-1. Each row's iterations depend only on its own state, its injected
 * term or low state and earlier layers' KV, so resuming is the whole pass; the coda slots of
 * each new depth are written on a copy of the state, as a build writes them. With a window the
 * extension computes every position (the released ones in temporary blocks) and releases
 * outside the window at the end, as a build does; with loop attention (docs/spec.md §4) the
 * later iterations of a released position read iteration 0's KV, which went with its block, so
 * there it runs every iteration from the tokens instead (the build's result, at its cost). The old layers are copied where the blocks
 * live (on a device, by its allocator's copy). A backend without a part pass, or without that copy, keeps
 * no states: its extension rebuilds the prefix from its tokens (same result, full cost).
 *
 * Hidden-state storage (TL_PREFIX_STORE_H8 / _H4, docs/spec.md §5.4.1): the build's sequence
 * captures every layer's input rows (core/hidden.h), the prefix keeps those instead of the KV
 * blocks, and each sequence started from it rebuilds its own KV from them. h8 rows are NQ's, so
 * a model with block activations (act_block, whose layers read NQB) refuses them.
 *
 * Instruction block (docs/spec.md §5.4): a prefix built with one keeps its length P; the build,
 * an extension and every sequence from it run with that P (their first chunk holds 0 .. P-1).
 *
 * Concurrency: core/seq.h (struct tl_prefix). */
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/forward.h"
#include "core/seq.h"

bool tl_prefix_can_resume(const tl_engine* e) {
    return tl_has_part_pass(e) && (!e->kv_geom.device || e->kv_geom.device->copy);
}

static void free_buffers(tl_prefix* p) {
    tl_hidden_free(p->hidden);
    tl_free(p->tokens);
    tl_free(p->loop_states);
    tl_free(p->states);
    tl_free(p->injects);
}

tl_prefix* tl_prefix_new(tl_engine* e, size_t n, uint32_t loops, uint32_t window, bool warm_start, bool states) {
    const tl_config* c = tl_engine_config(e);
    const size_t d = c->d_model;
    const bool injects = states && tl_has_inject(c);
    tl_prefix* p = tl_alloc_zeroed(1, sizeof *p);
    if (!p) return NULL;
    p->tokens = tl_alloc(n * sizeof(int32_t));
    p->loop_states = tl_alloc_zeroed((size_t)loops * d, sizeof(float));
    if (states) p->states = tl_alloc(n * d * sizeof(float));
    if (injects) p->injects = tl_alloc(n * d * sizeof(float));
    const bool allocated = p->tokens && p->loop_states && (!states || p->states) && (!injects || p->injects);
    if (allocated && pthread_rwlock_init(&p->lock, NULL) == 0) {
        if (pthread_mutex_init(&p->extending, NULL) == 0) {
            tl_engine_ref(e);
            p->engine = e;
            p->n = n;
            p->loops = loops;
            p->window = window;
            p->warm_start = warm_start;
            return p;
        }
        pthread_rwlock_destroy(&p->lock);
    }
    free_buffers(p);
    tl_free(p);
    return NULL;
}

/* Readers of a const prefix still take its lock. */
static void read_lock(const tl_prefix* p) { pthread_rwlock_rdlock((pthread_rwlock_t*)&p->lock); }
static void read_unlock(const tl_prefix* p) { pthread_rwlock_unlock((pthread_rwlock_t*)&p->lock); }

/* Rows 0 .. n-1 of s (positions 0 .. n-1, their KV reserved) through the part pass `whole` in
 * chunks of `chunk` rows (0 = all at once; the first holds the instruction block): each chunk runs whole with its rows of the per-row
 * arrays. Then the blocks outside the window are released, as tl_seq_run does. */
static tl_status run_chunks(tl_seq* s, const int32_t* tokens, size_t n, size_t chunk, const tl_part* whole) {
    const size_t d = tl_engine_config(s->engine)->d_model;
    if (chunk == 0 || chunk > n) chunk = n;
    tl_status st = TL_OK;
    for (size_t off = 0, T; off < n && st == TL_OK; off += T) {
        T = tl_chunk_rows(s->instruction, off, chunk, n - off);
        tl_part part = *whole;
        part.state_in = whole->state_in ? whole->state_in + off * d : NULL;
        part.inject_in = whole->inject_in ? whole->inject_in + off * d : NULL;
        part.state_out = whole->state_out ? whole->state_out + off * d : NULL;
        part.inject_out = whole->inject_out ? whole->inject_out + off * d : NULL;
        st = tl_forward_part(s, tokens ? tokens + off : NULL, T, off, &part);
    }
    if (st == TL_OK) tl_kv_release_outside(&s->kv, n, s->window);
    return st;
}

/* A warm-start build's run of tokens[0..p->n) into the empty sequence s at the prefix's depth:
 * its KV, and p's loop states, states and injected terms. */
static tl_status run_keeping_states(tl_seq* s, const int32_t* tokens, size_t chunk, tl_prefix* p) {
    tl_engine* e = s->engine;
    tl_status st = tl_engine_check_tokens(e, tokens, p->n, "tokens");
    if (st == TL_OK) st = tl_kv_reserve(&s->kv, &e->kv_geom, s->n_layers, 0, p->n);
    const tl_part whole = {.depth = s->loops, .state_out = p->states, .inject_out = p->injects,
                           .loop_states = p->loop_states};
    return st == TL_OK ? run_chunks(s, tokens, p->n, chunk, &whole) : st;
}

tl_status tl_prefix_check_storage(const tl_engine* e, tl_prefix_storage storage) {
    if (storage == TL_STORE_KV) return TL_OK;
    const tl_config* c = tl_engine_config(e);
    const char* name = storage == TL_STORE_H8 ? "h8" : "h4";
    if (!e->backend->iface->kv_from_rows)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s prefixes need a backend that rebuilds the KV from rows, and this "
                       "model's has none: use the kv storage", name);
    if (storage == TL_STORE_H4 && c->d_model % 2)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "h4 prefixes need an even d_model, this model's is %u: use h8 or kv",
                       c->d_model);
    if (storage == TL_STORE_H8 && c->act_block) /* NQB's p (docs/spec.md §2.2.1) does not fit h8's i8 row */
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "h8 prefixes need one activation scale per row (act_block 0), this "
                       "model's act_block is %u: use h4 or kv", c->act_block);
    const size_t rows = (storage == TL_STORE_H8 ? c->d_model : c->d_model / 2) + sizeof(float);
    const size_t kv = 2 * (size_t)c->n_kv_heads * (tl_kv_row_bytes(&e->kv_geom) + sizeof(float));
    if (rows < kv) return TL_OK;
    return tl_fail(TL_ERR_INVALID_ARGUMENT,
                   "%s prefixes take %zu bytes per layer and position, the KV %zu (%u kv heads of %u): use the kv "
                   "storage", name, rows, kv, c->n_kv_heads, c->head_dim);
}

/* The storage flags ask for, or TL_ERR_INVALID_ARGUMENT naming what is wrong with them. */
static tl_status flags_storage(uint32_t flags, tl_prefix_storage* out) {
    const uint32_t known = TL_PREFIX_WARM_START | TL_PREFIX_STORE_H8 | TL_PREFIX_STORE_H4;
    if (flags & ~known) return tl_fail(TL_ERR_INVALID_ARGUMENT, "unknown prefix flags 0x%x", flags & ~known);
    const bool h8 = flags & TL_PREFIX_STORE_H8, h4 = flags & TL_PREFIX_STORE_H4;
    if (h8 && h4)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "TL_PREFIX_STORE_H8 and TL_PREFIX_STORE_H4 exclude each other");
    if ((h8 || h4) && (flags & TL_PREFIX_WARM_START))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a hidden-state prefix (TL_PREFIX_STORE_%s) has no warm start: "
                       "drop TL_PREFIX_WARM_START or use the kv storage", h8 ? "H8" : "H4");
    *out = h8 ? TL_STORE_H8 : h4 ? TL_STORE_H4 : TL_STORE_KV;
    return TL_OK;
}

TL_API tl_status tl_prefix_build_instruction(tl_model* model, const int32_t* tokens, size_t n,
                                             size_t instruction_length, uint32_t loops, uint32_t cache_window,
                                             size_t chunk, uint32_t flags, tl_prefix** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    tl_prefix_storage storage = TL_STORE_KV;
    tl_status st = flags_storage(flags, &storage);
    if (st != TL_OK) return st;
    tl_engine* e;
    st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    const tl_config* c = tl_engine_config(e);
    tl_seq* s = NULL;
    tl_prefix* p = NULL;
    st = tl_engine_resolve_loops(e, loops, &loops);
    if (st == TL_OK && n == 0) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is empty");
    if (st == TL_OK && !tokens) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL");
    if (st == TL_OK && n > c->max_seq_len) /* before the copy of n tokens is allocated */
        st = tl_fail(TL_ERR_SEQ_TOO_LONG, "sequence length %zu exceeds max_seq_len %u", n, c->max_seq_len);
    if (st == TL_OK && instruction_length > n)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "instruction_length %zu exceeds the prompt's %zu tokens",
                     instruction_length, n);
    if (st == TL_OK) st = tl_prefix_check_storage(e, storage);
    if (st == TL_OK) st = tl_seq_new(e, loops, cache_window, &s);
    if (st == TL_OK) {
        const bool warm_start = flags & TL_PREFIX_WARM_START;
        p = tl_prefix_new(e, n, loops, cache_window, warm_start, warm_start && tl_prefix_can_resume(e));
        if (!p) st = tl_fail_oom("prefix");
    }
    if (st == TL_OK) s->instruction = p->instruction = instruction_length;
    if (st == TL_OK && storage != TL_STORE_KV) {
        s->capture = p->hidden = tl_hidden_new(storage, s->n_layers, c->d_model, n, cache_window, c->rms_eps);
        if (!p->hidden) st = tl_fail_oom("hidden-state rows");
    }
    if (st == TL_OK) {
        const tl_run_opts opts = {.loop_states = p->loop_states};
        st = p->states ? run_keeping_states(s, tokens, chunk, p) : tl_seq_run(s, tokens, n, chunk, &opts);
    }
    if (st == TL_OK) {
        memcpy(p->tokens, tokens, n * sizeof(int32_t));
        if (!p->hidden) {
            p->kv = s->kv; /* the blocks move from the temporary sequence; an h prefix drops them */
            memset(&s->kv, 0, sizeof s->kv);
        }
        *out = p;
        p = NULL;
    }
    tl_prefix_free(p);
    tl_seq_free(s);
    tl_engine_unref(e);
    return st;
}

TL_API tl_status tl_prefix_build_ex(tl_model* model, const int32_t* tokens, size_t n, uint32_t loops,
                                    uint32_t cache_window, size_t chunk, uint32_t flags, tl_prefix** out) {
    return tl_prefix_build_instruction(model, tokens, n, 0, loops, cache_window, chunk, flags, out);
}

TL_API tl_status tl_prefix_build(tl_model* model, const int32_t* tokens, size_t n, uint32_t loops,
                                 uint32_t cache_window, size_t chunk, tl_prefix** out) {
    return tl_prefix_build_ex(model, tokens, n, loops, cache_window, chunk, 0, out);
}

tl_status tl_prefix_check_loops(const tl_prefix* p, uint32_t loops) {
    const uint32_t built = p->loops;
    if (loops <= built) return TL_OK;
    return tl_fail(TL_ERR_LOOPS_MISMATCH,
                   "loops mismatch: prefix built at loops=%u, requested %u (a prefix serves loops <= its own; %s)",
                   built, loops,
                   p->warm_start ? "tl_prefix_extend deepens it" : "build it with TL_PREFIX_WARM_START to extend it");
}

/* Whether the window released blocks of p whose iteration-0 KV its extension would read: with
 * loop attention (docs/spec.md §4) every later iteration of an old position attends globally
 * over iteration 0's keys up to it, and a released block kept none. */
static bool lost_iteration_zero(const tl_prefix* p) {
    if (!tl_engine_config(p->engine)->loop_window) return false;
    for (size_t i = 0; i < p->kv.n_spans; i++)
        if (!p->kv.spans[i].block) return true;
    return false;
}

/* The extension of p to depth `loops` (> p->loops, p warm-start, `extending` held) in the empty
 * sequence s at that depth: s gets the KV, loop_states [loops][d] the last token's final states
 * and, when p keeps states, states [n][d] every token's state after iteration loops-1 and, when
 * it keeps injects, injects [n][d] their injected terms or low states then. Without states, or
 * where the old layers it would read are gone (lost_iteration_zero), it rebuilds from the tokens. */
static tl_status deepen(tl_prefix* p, tl_seq* s, size_t chunk, float* loop_states, float* states, float* injects) {
    if (!p->states) {
        const tl_run_opts opts = {.loop_states = loop_states};
        return tl_seq_run(s, p->tokens, p->n, chunk, &opts);
    }
    const tl_kv_geom* g = &s->engine->kv_geom;
    tl_status st = tl_kv_reserve(&s->kv, g, s->n_layers, 0, p->n);
    if (st != TL_OK) return st;
    tl_part whole = {.depth = s->loops, .state_out = states, .inject_out = injects, .loop_states = loop_states};
    if (lost_iteration_zero(p)) return run_chunks(s, p->tokens, p->n, chunk, &whole);
    /* Both tables span positions 0 .. n-1 as reserving them from 0 lays them out (block i from
     * position i * block_size; a build, or an earlier extension, made the old one so), and a
     * block's data is [layer][kv head][head_bytes], so the old layers are a byte prefix of the
     * new block's. A block for positions the window had released gets no old layers: only the
     * new ones are read before run_chunks releases it again. */
    for (size_t i = 0; st == TL_OK && i < s->kv.n_spans; i++) {
        const tl_kv_block* old = p->kv.spans[i].block;
        if (old) st = tl_kv_copy_block_layers(g, s->kv.spans[i].block, old, old->n_layers);
    }
    if (st != TL_OK) return st;
    const size_t d = tl_engine_config(s->engine)->d_model;
    memcpy(loop_states, p->loop_states, (size_t)p->loops * d * sizeof(float));
    whole.first_iter = p->loops, whole.state_in = p->states, whole.inject_in = p->injects;
    return run_chunks(s, NULL, p->n, chunk, &whole);
}

/* tl_prefix_extend past the checks, `extending` held: all or nothing. */
static tl_status extend(tl_prefix* p, uint32_t loops, size_t chunk) {
    const size_t d = tl_engine_config(p->engine)->d_model;
    float* loop_states = NULL;
    float* states = NULL;
    float* injects = NULL; /* a two-state core's low states change with the depth */
    tl_seq* s;
    tl_status st = tl_seq_new(p->engine, loops, p->window, &s);
    if (st == TL_OK) {
        s->instruction = p->instruction;
        loop_states = tl_alloc((size_t)loops * d * sizeof(float));
        if (p->states) states = tl_alloc(p->n * d * sizeof(float));
        if (p->injects) injects = tl_alloc(p->n * d * sizeof(float));
        if (!loop_states || (p->states && !states) || (p->injects && !injects)) st = tl_fail_oom("prefix extension");
    }
    if (st == TL_OK) st = deepen(p, s, chunk, loop_states, states, injects);
    if (st == TL_OK) { /* swap the new in; the old go with s and the buffers */
        pthread_rwlock_wrlock(&p->lock);
        const tl_kv_table kv = p->kv;
        p->kv = s->kv;
        s->kv = kv;
        float* const old_loop_states = p->loop_states;
        p->loop_states = loop_states;
        loop_states = old_loop_states;
        float* const old_states = p->states;
        p->states = states;
        states = old_states;
        float* const old_injects = p->injects;
        p->injects = injects;
        injects = old_injects;
        p->loops = loops;
        pthread_rwlock_unlock(&p->lock);
    }
    tl_free(loop_states);
    tl_free(states);
    tl_free(injects);
    tl_seq_free(s);
    return st;
}

TL_API tl_status tl_prefix_extend(tl_prefix* p, uint32_t loops, size_t chunk) {
    if (!p) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix is NULL");
    tl_status st = tl_engine_check_open(p->engine);
    if (st == TL_OK && loops > TL_MAX_LOOPS) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "loops > %d", TL_MAX_LOOPS);
    if (st != TL_OK) return st;
    pthread_mutex_lock(&p->extending);
    if (loops > p->loops) st = p->warm_start ? extend(p, loops, chunk) : tl_prefix_check_loops(p, loops);
    pthread_mutex_unlock(&p->extending);
    return st;
}

TL_API int tl_prefix_warm_start(const tl_prefix* p) { return p && p->warm_start; }

TL_API tl_prefix_storage tl_prefix_storage_get(const tl_prefix* p) {
    return p && p->hidden ? p->hidden->storage : TL_STORE_KV;
}

TL_API void tl_prefix_info(const tl_prefix* p, size_t* n_tokens, uint32_t* loops, uint32_t* cache_window,
                           size_t* nbytes) {
    if (n_tokens) *n_tokens = p ? p->n : 0;
    if (cache_window) *cache_window = p ? p->window : 0;
    if (!p) {
        if (loops) *loops = 0;
        if (nbytes) *nbytes = 0;
        return;
    }
    const size_t d = tl_engine_config(p->engine)->d_model;
    read_lock(p);
    if (loops) *loops = p->loops;
    if (nbytes) {
        const size_t rows = p->loops + (p->states ? p->n : 0) + (p->injects ? p->n : 0);
        *nbytes = tl_kv_bytes(&p->kv) + (p->hidden ? tl_hidden_bytes(p->hidden) : 0) + sizeof(float) * rows * d +
                  sizeof(int32_t) * p->n;
    }
    read_unlock(p);
}

TL_API size_t tl_prefix_instruction(const tl_prefix* p) { return p ? p->instruction : 0; }

TL_API const int32_t* tl_prefix_tokens(const tl_prefix* p, size_t* n) {
    if (n) *n = p ? p->n : 0;
    return p ? p->tokens : NULL;
}

TL_API void tl_prefix_free(tl_prefix* p) {
    if (!p) return;
    tl_kv_clear(&p->kv);
    free_buffers(p);
    pthread_rwlock_destroy(&p->lock);
    pthread_mutex_destroy(&p->extending);
    tl_engine_unref(p->engine);
    tl_free(p);
}

TL_API tl_status tl_seq_from_prefix(const tl_prefix* p, uint32_t loops, tl_seq** out) {
    if (!p || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix or out is NULL");
    *out = NULL;
    tl_status st = tl_engine_check_open(p->engine);
    if (st != TL_OK) return st;
    read_lock(p);
    if (loops == 0) loops = p->loops;
    tl_seq* s = NULL;
    st = tl_prefix_check_loops(p, loops);
    if (st == TL_OK) st = tl_seq_new(p->engine, loops, p->window, &s);
    if (st == TL_OK) s->instruction = p->instruction;
    if (st == TL_OK) st = p->hidden ? tl_hidden_rebuild(p->hidden, s) : tl_kv_share(&s->kv, &p->kv);
    if (st == TL_OK) {
        const size_t d = tl_engine_config(p->engine)->d_model;
        s->n = p->n;
        memcpy(s->last_hidden, p->loop_states + (size_t)(loops - 1) * d, d * sizeof(float));
    }
    read_unlock(p);
    if (st != TL_OK) {
        tl_seq_free(s);
        s = NULL;
    }
    *out = s;
    return st;
}
