/* sched.c — the continuous-batching scheduler (tinyloop.h, "Continuous batching").
 *
 * A request's `input` is its prompt followed by the tokens it has emitted; its sequence holds
 * the KV of input[0 .. seq->n). A running request is in one of two phases:
 *  - prefill: seq->n < prefill_end (the input's length when it was admitted); it gets prompt
 *    chunks from the step's token budget, and when the chunk that reaches
 *    prefill_end is done its blocks are offered to the prefix cache and its first token is
 *    sampled from that chunk's logits;
 *  - decode: seq->n == input length - 1 (the last emitted token is not run yet); the decoding
 *    requests run their token in one tl_gen_run_rows pass and sample the next, except the
 *    speculative ones (n_draft > 0 on a backend with a part pass), which each run one round of
 *    self-speculative decoding alone (tl_spec_round: its draft and verify passes are its own)
 *    and emit 1..K' tokens.
 * On a backend with a mixed pass (tl_has_mixed_pass; TINYLOOP_MIXED_PASS=0 turns it off for
 * comparisons) the decode rows and every prefill's prompt chunk run as the spans of one pass
 * (tl_forward_spans), which reads each weight once per step; without one, the decodes run in
 * one batched pass and then each prompt chunk alone (tl_seq_run). Either way every span's
 * logits and KV are those of running it alone.
 * Admission (arrival order) looks the input up in the prefix cache and takes the request while
 * a batch slot is free and the blocks its prefill will write, plus those the decoding requests
 * will open meanwhile, fit the KV budget; a refused head is tried again once the held KV
 * drops or a request leaves. Every chunk offers its full blocks to the prefix cache, so a
 * preempted prefill resumes from it. A step whose blocks would not fit preempts the newest
 * running request: its sequence is freed and it waits at the head of the queue with its input
 * (prompt + emitted), which a later admission prefills again; its sampling state (tl_stream)
 * is kept, so its next token is the one it would have sampled. A decode pass that runs out of
 * memory preempts the newest request and tries once more, so the oldest keeps going; so does a
 * round, which fails all-or-nothing.
 *
 * The step is planned before it runs (plan_step): in running order, each round's K' is capped so
 * that the step's events fit the caller's capacity and its positions fit step_tokens while every
 * other running request keeps room for one; the other decoding requests take one position
 * each, and the prefills what is left. Admission and the budget count those K' positions (an
 * upper bound of the KV a round writes before rolling back to what it keeps). Every computation
 * is one the contract makes bit-identical to running the request alone (any chunking, any
 * batch, any round size), so each request's tokens equal tl_generate's.
 *
 * Requests live in two doubly linked lists, waiting (FIFO, preempted at the head) and running
 * (admission order). A request's fields are written only by the thread using the scheduler.
 *
 * A request with an exit rule (adaptive depth, docs/spec.md §5.7) records the depth U each of its
 * decode passes ran. Its decoded positions are not prompt positions (they may hold KV copied
 * from shallower iterations), so on readmission it looks up and prefills its prompt only, then
 * replays each emitted token but the last, one position of the step's budget each, as a decode
 * pass forced to exit at its recorded U (no sampling): its prefill phase ends one position
 * before its input's end, and the last emitted token is decoded as any other, under its rule. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "base/versioned.h"
#include "core/forward.h"
#include "core/generate.h"
#include "core/speculate.h"

typedef struct sched_req {
    uint64_t id;
    int32_t* input;           /* [n_prompt + max_tokens]: prompt, then the emitted tokens     */
    size_t n_prompt;
    size_t n_out;             /* tokens emitted (the stream's count)                           */
    size_t prefill_end;       /* input positions of the prefill phase                          */
    tl_gen_params p;          /* resolved; its pointers aim at the copies below                */
    int32_t* stop_tokens;     /* owned copies (NULL when none)                                 */
    size_t* stop_lengths;
    char* salt;
    tl_stream stream;         /* stream.seq is NULL while waiting                              */
    bool speculative;         /* decodes by rounds (n_draft > 0 and the backend has a part pass) */
    tl_spec spec;             /* the rounds' scratch and counts, when speculative (else zeroed) */
    size_t round;             /* this step's K', when speculative and decoding (plan_step)     */
    size_t chunk_from, chunk_to; /* this step's prefill positions [from, to), set by collect_rows
                                 (equal when it has none)                                       */
    uint32_t* depths;         /* [max_tokens] with an exit rule that can fire: the U of each
                                 emitted token's decode pass (the replays'); NULL without one  */
    uint32_t pass_depth;      /* the iterations the pass that filled stream.logits ran for its
                                 last token: a decode's U, or the depth of a prefill           */
    struct sched_req *prev, *next;
} sched_req;

typedef struct req_list {
    sched_req *head, *tail;
    size_t n;
} req_list;

struct tl_sched {
    tl_engine* engine;        /* holds a reference                                              */
    tl_sched_params params;
    req_list waiting, running;
    uint64_t next_id;
    bool head_refused;        /* the waiting head did not fit: retried once a request leaves
                                 or the held KV drops below refused_at                          */
    size_t refused_at;
    tl_sched_stats stats;     /* counters; running, waiting and kv_* filled on request         */
    uint64_t depth_counts[TL_MAX_LOOPS]; /* [u - 1]: the decode passes counted that ran u iterations */
    size_t n_depths;          /* the deepest u counted                                          */
    bool mixed;               /* a step's decodes and prompt chunks run as one pass             */
    /* per-step scratch, [max_batch] each */
    tl_decode_rows rows;      /* the step's pass: decode rows, then (mixed) prompt chunk spans;
                                 its tokens [step_tokens]                                       */
    sched_req** row_reqs;     /* its rows' requests                                             */
    sched_req** ready;        /* requests whose logits this step filled, to sample             */
};

/* ---- lists ---------------------------------------------------------------------------------- */

static void list_remove(req_list* l, sched_req* r) {
    if (r->prev) r->prev->next = r->next;
    else l->head = r->next;
    if (r->next) r->next->prev = r->prev;
    else l->tail = r->prev;
    r->prev = r->next = NULL;
    l->n--;
}

static void list_push_back(req_list* l, sched_req* r) {
    r->prev = l->tail;
    r->next = NULL;
    if (l->tail) l->tail->next = r;
    else l->head = r;
    l->tail = r;
    l->n++;
}

static void list_push_front(req_list* l, sched_req* r) {
    r->next = l->head;
    r->prev = NULL;
    if (l->head) l->head->prev = r;
    else l->tail = r;
    l->head = r;
    l->n++;
}

static void req_free(sched_req* r) {
    if (!r) return;
    tl_stream_free(&r->stream);
    tl_spec_free(&r->spec);
    tl_free(r->depths);
    tl_free(r->input);
    tl_free(r->stop_tokens);
    tl_free(r->stop_lengths);
    tl_free(r->salt);
    tl_free(r);
}

static void list_free(req_list* l) {
    for (sched_req* r = l->head; r;) {
        sched_req* next = r->next;
        req_free(r);
        r = next;
    }
    memset(l, 0, sizeof *l);
}

/* ---- create, free --------------------------------------------------------------------------- */

TL_API tl_sched_params tl_sched_params_default(void) {
    tl_sched_params p = {sizeof p, 32, 512, 0};
    return p;
}

static tl_status resolve_sched_params(const tl_sched_params* given, tl_sched_params* p) {
    *p = tl_sched_params_default();
    if (given) {
        if (given->size < sizeof(size_t))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_sched_params.size must be set (sizeof(tl_sched_params))");
        memcpy(p, given, given->size < sizeof *p ? given->size : sizeof *p);
        p->size = sizeof *p;
    }
    if (p->max_batch == 0) p->max_batch = 32;
    if (p->step_tokens == 0) p->step_tokens = 512;
    if (p->max_batch > (1u << 20)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_batch %zu > %u", p->max_batch, 1u << 20);
    if (p->step_tokens < p->max_batch)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "step_tokens %zu < max_batch %zu (every running request may decode a token in a step)",
                       p->step_tokens, p->max_batch);
    return TL_OK;
}

TL_API void tl_sched_free(tl_sched* s) {
    if (!s) return;
    list_free(&s->waiting);
    list_free(&s->running);
    tl_decode_rows_free(&s->rows);
    tl_free(s->row_reqs);
    tl_free(s->ready);
    if (s->engine) tl_engine_unref(s->engine);
    tl_free(s);
}

TL_API tl_status tl_sched_create(tl_model* model, const tl_sched_params* params, tl_sched** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    tl_sched_params p;
    tl_status st = resolve_sched_params(params, &p);
    if (st != TL_OK) return st;
    tl_engine* e;
    st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    tl_sched* s = tl_alloc_zeroed(1, sizeof *s);
    if (!s) {
        tl_engine_unref(e);
        return tl_fail_oom("scheduler");
    }
    s->engine = e;
    s->params = p;
    s->next_id = 1;
    const size_t B = p.max_batch;
    const char* mixed = getenv("TINYLOOP_MIXED_PASS");
    s->mixed = tl_has_mixed_pass(e) && !(mixed && strcmp(mixed, "0") == 0);
    const tl_status rows = tl_decode_rows_alloc(&s->rows, B, p.step_tokens);
    s->rows.keep_window = true;
    s->row_reqs = tl_alloc_zeroed(B, sizeof *s->row_reqs);
    s->ready = tl_alloc_zeroed(B, sizeof *s->ready);
    if (rows != TL_OK || !s->row_reqs || !s->ready) {
        tl_sched_free(s);
        return tl_fail_oom("scheduler");
    }
    *out = s;
    return TL_OK;
}

/* ---- add, cancel ---------------------------------------------------------------------------- */

/* The request's own copies of what params point to (stop sequences, salt). */
static tl_status copy_params(sched_req* r) {
    tl_gen_params* p = &r->p;
    size_t n_stop_tokens = 0;
    for (size_t i = 0; i < p->n_stop; i++) n_stop_tokens += p->stop_lengths[i];
    if (p->n_stop) {
        r->stop_tokens = tl_alloc(n_stop_tokens * sizeof *r->stop_tokens);
        r->stop_lengths = tl_alloc(p->n_stop * sizeof *r->stop_lengths);
        if (!r->stop_tokens || !r->stop_lengths) return tl_fail_oom("scheduler request");
        memcpy(r->stop_tokens, p->stop_tokens, n_stop_tokens * sizeof *r->stop_tokens);
        memcpy(r->stop_lengths, p->stop_lengths, p->n_stop * sizeof *r->stop_lengths);
    }
    p->stop_tokens = r->stop_tokens;
    p->stop_lengths = r->stop_lengths;
    if (p->cache_salt && p->cache_salt[0]) {
        const size_t len = strlen(p->cache_salt) + 1;
        r->salt = tl_alloc(len);
        if (!r->salt) return tl_fail_oom("scheduler request");
        memcpy(r->salt, p->cache_salt, len);
    }
    p->cache_salt = r->salt;
    return TL_OK;
}

/* The request's KV at most: every position of the prompt and its tokens, held alone. */
static tl_status check_budget(const tl_sched* s, const sched_req* r) {
    const size_t budget = s->params.kv_budget_bytes;
    if (budget == 0) return TL_OK;
    const tl_engine* e = s->engine;
    const size_t positions = r->n_prompt + r->p.max_tokens;
    const size_t blocks = (positions + e->kv_geom.block_size - 1) / e->kv_geom.block_size;
    const uint32_t n_layers = (uint32_t)tl_n_layers(tl_engine_config(e), r->p.loops);
    const size_t need = blocks * tl_kv_block_bytes(&e->kv_geom, n_layers);
    if (need <= budget) return TL_OK;
    return tl_fail(TL_ERR_INVALID_ARGUMENT,
                   "the request could need %zu bytes of KV (%zu positions at loops=%u), more than "
                   "kv_budget_bytes %zu", need, positions, r->p.loops, budget);
}

TL_API tl_status tl_sched_add(tl_sched* s, const int32_t* prompt, size_t n, const tl_gen_params* params,
                              uint64_t* id) {
    if (!s || !id) return tl_fail(TL_ERR_INVALID_ARGUMENT, "sched or id is NULL");
    *id = 0;
    tl_engine* e = s->engine;
    sched_req* r = tl_alloc_zeroed(1, sizeof *r);
    if (!r) return tl_fail_oom("scheduler request");
    tl_status st = tl_gen_check(e, NULL, prompt, n, params, &r->p);
    if (st == TL_OK && (r->p.on_token || r->p.on_prefill))
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "a scheduled request takes no callbacks (on_token and on_prefill "
                     "must be NULL): tl_sched_step reports its tokens");
    if (st == TL_OK && r->p.draft_stats)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "a scheduled request takes no draft_stats (it must be NULL): "
                     "tl_sched_stats counts the drafted and accepted tokens");
    if (st == TL_OK && r->p.depth_stats)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "a scheduled request takes no depth_stats (it must be NULL): "
                     "tl_sched_stats counts the decode passes and their loops");
    r->n_prompt = n;
    if (st == TL_OK) st = check_budget(s, r);
    if (st == TL_OK) st = copy_params(r);
    if (st == TL_OK) {
        r->input = tl_alloc((n + r->p.max_tokens) * sizeof *r->input);
        st = r->input ? tl_stream_init(&r->stream, e, &r->p, r->input + n, NULL, &r->n_out)
                      : tl_fail_oom("scheduler request");
    }
    if (st == TL_OK && r->p.n_draft > 0) {
        st = tl_spec_init(&r->spec, e, &r->p, false);
        r->speculative = st == TL_OK;
    }
    const tl_exit rule = tl_gen_exit(&r->p);
    if (st == TL_OK && tl_exit_active(&rule, r->p.loops)) { /* a rule that cannot fire decodes plainly */
        r->depths = tl_alloc_zeroed(r->p.max_tokens, sizeof *r->depths);
        if (!r->depths) st = tl_fail_oom("scheduler request");
    }
    if (st != TL_OK) {
        req_free(r);
        return st;
    }
    memcpy(r->input, prompt, n * sizeof *prompt);
    tl_stream_see(&r->stream, prompt, n);
    r->id = s->next_id++;
    list_push_back(&s->waiting, r);
    *id = r->id;
    return TL_OK;
}

static sched_req* find(const req_list* l, uint64_t id) {
    for (sched_req* r = l->head; r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

TL_API tl_status tl_sched_cancel(tl_sched* s, uint64_t id) {
    if (!s) return tl_fail(TL_ERR_INVALID_ARGUMENT, "sched is NULL");
    req_list* l = &s->running;
    sched_req* r = find(l, id);
    if (!r) r = find(l = &s->waiting, id);
    if (!r)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "no request %llu in the scheduler (never added, finished or "
                       "cancelled)", (unsigned long long)id);
    list_remove(l, r);
    req_free(r);
    s->stats.cancelled++;
    s->head_refused = false;
    return TL_OK;
}

/* ---- the step ------------------------------------------------------------------------------- */

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

static size_t input_length(const sched_req* r) { return r->n_prompt + r->n_out; }

/* The end of r's prefill phase on (re)admission: its whole input; with an exit rule and tokens
 * emitted, one position before (its prompt, then the replays of every emitted token but the
 * last, which it then decodes). */
static size_t phase_end(const sched_req* r) {
    return r->depths && r->n_out ? input_length(r) - 1 : input_length(r);
}

/* The positions of r's prefill phase run as prompt chunks: all of them, but with an exit rule
 * its prompt only (the rest are replays). */
static size_t chunked_end(const sched_req* r) { return r->depths ? r->n_prompt : r->prefill_end; }

static size_t kv_alone(const tl_sched* s, size_t* n_blocks) {
    size_t bytes = 0, blocks = 0;
    for (const sched_req* r = s->running.head; r; r = r->next) {
        size_t b;
        bytes += tl_kv_alone_bytes(&r->stream.seq->kv, &b);
        blocks += b;
    }
    if (n_blocks) *n_blocks = blocks;
    return bytes;
}

/* Bytes of the blocks running `T` positions at the end of r's sequence would allocate. */
static size_t new_bytes(const tl_sched* s, const sched_req* r, size_t T) {
    const tl_seq* q = r->stream.seq;
    const tl_kv_geom* g = &s->engine->kv_geom;
    return tl_kv_new_blocks(&q->kv, g, q->n_layers, q->n, T) * tl_kv_block_bytes(g, q->n_layers);
}

static bool decoding(const sched_req* r) { return r->stream.seq->n >= r->prefill_end; }

/* Positions one decode step of r computes at most: a round's n_draft, else 1. */
static size_t decode_width(const sched_req* r) { return r->speculative ? r->p.n_draft : 1; }

/* Bytes of the blocks the decoding requests open over the next `steps` steps (a round writes
 * K' positions before it rolls back to those it keeps). */
static size_t decode_growth(const tl_sched* s, size_t steps) {
    size_t bytes = 0;
    for (const sched_req* r = s->running.head; r; r = r->next)
        if (decoding(r)) bytes += new_bytes(s, r, min_size(steps * decode_width(r), r->p.max_tokens - r->n_out));
    return bytes;
}

/* Positions the decoding requests compute in a step at most. */
static size_t decode_positions(const tl_sched* s) {
    size_t n = 0;
    for (const sched_req* r = s->running.head; r; r = r->next)
        if (decoding(r)) n += decode_width(r);
    return n;
}

/* Bytes of the blocks the requests in their prefill phase open until it ends. */
static size_t prefill_growth(const tl_sched* s) {
    size_t bytes = 0;
    for (const sched_req* r = s->running.head; r; r = r->next)
        if (!decoding(r)) bytes += new_bytes(s, r, r->prefill_end - r->stream.seq->n);
    return bytes;
}

/* Whether r, looked up (its sequence holds the hit; its prefill_end set), fits the budget beside
 * `used`: its prefill's new blocks, the rest of the other prefills', and what the decoding
 * requests open until r's prefill is done (the prompts ahead of it included; the prefills get
 * what the decodes leave of a step, in order: plan_step keeps room for one position per
 * request). */
static bool fits(const tl_sched* s, const sched_req* r, size_t used) {
    const size_t budget = s->params.kv_budget_bytes;
    if (budget == 0 || s->running.n == 0) return true;
    size_t positions = r->prefill_end - r->stream.seq->n;
    for (const sched_req* q = s->running.head; q; q = q->next)
        if (!decoding(q)) positions += q->prefill_end - q->stream.seq->n;
    const size_t decodes = decode_positions(s);
    const size_t per_step = decodes < s->params.step_tokens ? s->params.step_tokens - decodes : 1;
    const size_t steps = (positions + per_step - 1) / per_step;
    const size_t need = new_bytes(s, r, r->prefill_end - r->stream.seq->n) + prefill_growth(s) +
                        decode_growth(s, steps);
    return used + need <= budget;
}

/* Admit waiting requests in order while a slot is free and they fit the budget (the first one
 * always, when nothing runs: it fits alone, tl_sched_add checked). A refused head waits until
 * a request leaves or the held KV drops, so it is not looked up in the prefix cache again
 * every step. */
static tl_status admit(tl_sched* s) {
    tl_engine* e = s->engine;
    const bool budgeted = s->params.kv_budget_bytes != 0;
    size_t used = budgeted ? kv_alone(s, NULL) : 0;
    if (s->head_refused && s->running.n && used >= s->refused_at) return TL_OK;
    s->head_refused = false;
    while (s->waiting.head && s->running.n < s->params.max_batch) {
        sched_req* r = s->waiting.head;
        tl_seq* q;
        tl_status st = tl_seq_new(e, r->p.loops, r->p.cache_window, &q);
        if (st != TL_OK) return st;
        q->instruction = r->p.instruction_length;
        size_t hit = 0;
        r->prefill_end = phase_end(r);
        if (e->pcache) {
            const tl_pcache_key key = tl_gen_cache_key(e, q, &r->p);
            tl_pcache_lookup(e->pcache, &key, r->input, chunked_end(r), &q->kv, &hit);
            q->n = hit;
        }
        r->stream.seq = q;
        /* admitting allocates no block but those read from the prefix cache's disk tier that
         * the cache had no room for: the request holds them alone */
        const size_t own = budgeted ? tl_kv_alone_bytes(&q->kv, NULL) : 0;
        if (!fits(s, r, used + own)) {
            tl_seq_free(q);
            r->stream.seq = NULL;
            s->head_refused = true;
            s->refused_at = used;
            break;
        }
        used += own;
        s->stats.cached_tokens += hit;
        list_remove(&s->waiting, r);
        list_push_back(&s->running, r);
    }
    return TL_OK;
}

/* The prefill chunk r gets from `budget` positions left in the step: none when none is left,
 * else at most `budget`, but the chunk at position 0 holds the instruction block (tl_chunk_rows). */
static size_t chunk_of(const sched_req* r, size_t budget) {
    const tl_seq* q = r->stream.seq;
    return budget ? tl_chunk_rows(q->instruction, q->n, budget, r->prefill_end - q->n) : 0;
}

/* `budget` less a chunk of T positions (which an instruction block may take past it). */
static size_t budget_after(size_t budget, size_t T) { return T < budget ? budget - T : 0; }

/* Plan the step as it runs. In running order, each decoding request takes its positions: one,
 * or for a speculative one its round's K' (r->round) = min(n_draft, tokens left, room), the
 * room being what the step's events (capacity) and positions (step_tokens) have left once every
 * running request not planned yet keeps one; a round emits at most K' events, any other request
 * at most one. Then the prefills, in order, take chunks of the positions left. Returns the bytes of the new blocks the step would allocate; *decodes receives the
 * positions the decodes take. */
static size_t plan_step(tl_sched* s, size_t capacity, size_t* decodes) {
    const size_t limit = min_size(capacity, s->params.step_tokens);  /* >= max_batch >= running */
    size_t need = 0, used = 0, unplanned = s->running.n;
    for (sched_req* r = s->running.head; r; r = r->next) {
        if (!decoding(r)) continue;
        unplanned--;
        size_t T = 1;
        if (r->speculative) {  /* used + unplanned < limit: the room is >= 1 */
            T = min_size(min_size(decode_width(r), r->p.max_tokens - r->n_out), limit - used - unplanned);
            r->round = T;
        }
        need += new_bytes(s, r, T);
        used += T;
    }
    *decodes = used;
    size_t budget = s->params.step_tokens - used;
    for (const sched_req* r = s->running.head; r && budget; r = r->next)
        if (!decoding(r)) {
            const size_t T = chunk_of(r, budget);
            need += new_bytes(s, r, T);
            budget = budget_after(budget, T);
        }
    return need;
}

/* Free the newest running request's sequence and queue it first, to be prefilled again. */
static void preempt_newest(tl_sched* s) {
    sched_req* victim = s->running.tail;
    tl_seq_free(victim->stream.seq);
    victim->stream.seq = NULL;
    list_remove(&s->running, victim);
    list_push_front(&s->waiting, victim);
    s->stats.preemptions++;
    s->head_refused = false;
}

/* Plan the step, preempting the newest running requests until it fits the KV budget (never
 * the last one). Returns the positions the plan leaves to the prefills. */
static size_t fit_budget(tl_sched* s, size_t capacity) {
    const size_t budget = s->params.kv_budget_bytes;
    for (;;) {
        size_t decodes;
        const size_t need = plan_step(s, capacity, &decodes);
        if (budget == 0 || s->running.n == 1 || kv_alone(s, NULL) + need <= budget)
            return s->params.step_tokens - decodes;
        preempt_newest(s);
    }
}

/* The caller's event arrays, and how many events the step has written. */
typedef struct step_events {
    uint64_t* ids;
    int32_t* tokens;
    uint8_t* finish;
    size_t n;
} step_events;

static void push_event(step_events* ev, const sched_req* r, int32_t token, tl_finish why) {
    ev->ids[ev->n] = r->id;
    ev->tokens[ev->n] = token;
    ev->finish[ev->n++] = (uint8_t)why;
}

/* r ended (a stop rule, or its sampling failed): it leaves the scheduler. */
static void finish_request(tl_sched* s, sched_req* r) {
    s->stats.finished++;
    list_remove(&s->running, r);
    req_free(r);
    s->head_refused = false;
}

/* r's round of K' = r->round positions: each token it emits is an event, the last one with the
 * finish; a sampling failure (non-finite logits) ends r with TL_FINISH_ERROR, as in
 * sample_ready. Any other failure comes before an emission and leaves r as it was. */
static tl_status run_round(tl_sched* s, sched_req* r, step_events* ev) {
    tl_stream* q = &r->stream;
    const size_t emitted = q->n_emitted, drafted = r->spec.drafted, accepted = r->spec.accepted;
    int32_t token = r->input[q->seq->n];
    const tl_status st = tl_spec_round(&r->spec, q, &token, r->round);
    if (st != TL_OK && st != TL_ERR_NUMERIC) return st;
    s->stats.drafted_tokens += r->spec.drafted - drafted;
    s->stats.accepted_tokens += r->spec.accepted - accepted;
    s->stats.generated_tokens += q->n_emitted - emitted;
    const tl_finish why = st != TL_OK ? TL_FINISH_ERROR : q->finish;
    for (size_t i = emitted; i < q->n_emitted; i++)
        push_event(ev, r, q->out_tokens[i], i + 1 == q->n_emitted && st == TL_OK ? why : TL_FINISH_NONE);
    if (why == TL_FINISH_ERROR) push_event(ev, r, -1, why);
    if (why != TL_FINISH_NONE) finish_request(s, r);
    return TL_OK;
}

/* Every speculative decoding request's round, alone, in running order. A round out of memory
 * preempts the newest running request (its memory may be what the round needs; when that is
 * the round's own request, it just waits) and runs once more. */
static tl_status run_rounds(tl_sched* s, step_events* ev) {
    sched_req* next;
    for (sched_req* r = s->running.head; r; r = next) {
        next = r->next;
        if (!r->speculative || !decoding(r)) continue;
        tl_status st = run_round(s, r, ev);
        if (st == TL_ERR_OUT_OF_MEMORY && s->running.n > 1) {
            const bool newest = r == s->running.tail;
            preempt_newest(s);
            if (newest) return TL_OK;
            next = r->next;
            st = run_round(s, r, ev);
        }
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

/* Row j of the step's pass: r's next `count` input tokens, at tokens[*n_tokens ..]. */
static void put_row(tl_sched* s, size_t j, sched_req* r, size_t count, tl_exit exit, float* logits,
                    size_t* n_tokens) {
    const tl_seq* q = r->stream.seq;
    s->rows.seqs[j] = r->stream.seq;
    s->rows.counts[j] = count;
    s->rows.exits[j] = exit;
    s->rows.logits[j] = logits;
    s->row_reqs[j] = r;
    memcpy(s->rows.tokens + *n_tokens, r->input + q->n, count * sizeof *r->input);
    *n_tokens += count;
}

/* The positions of r's prefill chunk of T that run as a prompt chunk (the rest are replays). */
static size_t prompt_part(const sched_req* r, size_t T) {
    const size_t n = r->stream.seq->n, end = min_size(n + T, chunked_end(r));
    return end > n ? end - n : 0;
}

/* The rows of the step's pass: every decoding request but the speculative ones (rows
 * [0, *n_decodes)), then, when `mixed`, each prefill's prompt chunk as a span. Each running
 * request's chunk of the `budget` positions (empty for a decoding one) is recorded in
 * chunk_from, chunk_to either way. Returns the rows. */
static size_t collect_rows(tl_sched* s, size_t budget, bool mixed, size_t* n_decodes) {
    size_t n = 0, n_tokens = 0;
    for (sched_req* r = s->running.head; r; r = r->next)
        if (decoding(r) && !r->speculative) put_row(s, n++, r, 1, tl_gen_exit(&r->p), r->stream.logits, &n_tokens);
    *n_decodes = n;
    for (sched_req* r = s->running.head; r; r = r->next) {
        const size_t T = decoding(r) ? 0 : chunk_of(r, budget);
        r->chunk_from = r->stream.seq->n;
        r->chunk_to = r->chunk_from + T;
        budget = budget_after(budget, T);
        const size_t prompt = prompt_part(r, T);
        /* an instruction block past the step's tokens (chunk_of) runs as its own pass, end_chunk */
        if (mixed && prompt && n_tokens + prompt <= s->params.step_tokens)
            put_row(s, n++, r, prompt, (tl_exit){TL_EXIT_NONE, 0.0f, 0},
                    r->chunk_to == input_length(r) ? r->stream.logits : NULL, &n_tokens);
    }
    return n;
}

/* Collect the step's rows (mixed: with the prompt chunks; *n_rows of them) and run them in one
 * pass. */
static tl_status collect_and_run(tl_sched* s, size_t budget, bool mixed, size_t* n_decodes, size_t* n_rows) {
    *n_rows = collect_rows(s, budget, mixed, n_decodes);
    return *n_rows ? tl_gen_run_rows(s->engine, &s->rows, *n_rows) : TL_OK;
}

/* The step's one pass: the mixed one, or the decodes alone. A mixed pass out of memory (all or
 * nothing) leaves the step to separate passes, as with TINYLOOP_MIXED_PASS=0; a decode pass out
 * of memory preempts the newest request (its memory may be what the others need) and runs once
 * more, so the oldest keeps going. */
static tl_status run_rows(tl_sched* s, size_t budget, size_t* n_decodes) {
    size_t n_rows;
    if (s->mixed) {
        const tl_status st = collect_and_run(s, budget, true, n_decodes, &n_rows);
        if (st == TL_OK && *n_decodes && n_rows > *n_decodes) s->stats.mixed_passes++;
        if (st != TL_ERR_OUT_OF_MEMORY) return st;
    }
    tl_status st = collect_and_run(s, budget, false, n_decodes, &n_rows);
    if (st == TL_ERR_OUT_OF_MEMORY && s->running.n > 1) {
        preempt_newest(s);
        st = collect_and_run(s, budget, false, n_decodes, &n_rows);
    }
    return st;
}

/* The decode rows ran: their depths recorded, their windows released, their requests ready. */
static void end_decodes(tl_sched* s, size_t n, size_t* n_ready) {
    for (size_t j = 0; j < n; j++) {
        sched_req* r = s->row_reqs[j];
        tl_seq* q = r->stream.seq;
        r->pass_depth = s->rows.depths[j];
        if (r->depths) r->depths[q->n - 1 - r->n_prompt] = s->rows.depths[j];
        tl_kv_release_outside(&q->kv, q->n, q->window);
        s->ready[(*n_ready)++] = r;
    }
}

/* Replay r's emitted token at its next position: a decode pass forced to exit at the depth it
 * ran when it was decoded (docs/spec.md §5.7); its logits are not sampled. */
static tl_status replay(tl_sched* s, sched_req* r) {
    tl_seq* q = r->stream.seq;
    size_t n_tokens = 0;
    put_row(s, 0, r, 1, (tl_exit){TL_EXIT_FORCED, 0.0f, r->depths[q->n - r->n_prompt]}, r->stream.logits,
            &n_tokens);
    const tl_status st = tl_gen_run_rows(s->engine, &s->rows, 1);
    if (st == TL_OK) tl_kv_release_outside(&q->kv, q->n, q->window);
    return st;
}

/* The rest of r's prefill chunk, positions [chunk_from, chunk_to): its prompt chunk (run here
 * unless the mixed pass ran it) offers the prefix cache its full blocks (a preempted prefill
 * then resumes from them), then the replays (chunked_end); the chunk that ends the phase on the
 * input's last position leaves the logits to sample. */
static tl_status end_chunk(tl_sched* s, sched_req* r, size_t* n_ready) {
    tl_engine* e = s->engine;
    tl_seq* q = r->stream.seq;
    const size_t chunked = min_size(r->chunk_to, chunked_end(r));
    const bool sample = r->chunk_to == input_length(r);
    tl_status st;
    if (q->n < chunked) {
        const size_t n = chunked - q->n;
        const tl_run_opts opts = {.logits_last = sample ? r->stream.logits : NULL, .keep_window = true};
        if ((st = tl_seq_run(q, r->input + q->n, n, n, &opts)) != TL_OK) return st;
    }
    if (r->chunk_from < chunked) {
        s->stats.prompt_tokens += chunked - r->chunk_from;
        if (e->pcache) {
            const tl_pcache_key key = tl_gen_cache_key(e, q, &r->p);
            tl_pcache_insert(e->pcache, &key, r->input, q->n, &q->kv);
        }
        if (!e->pcache || q->n == chunked_end(r)) tl_kv_release_outside(&q->kv, q->n, q->window);
    }
    for (; q->n < r->chunk_to; s->stats.prompt_tokens++)
        if ((st = replay(s, r)) != TL_OK) return st;
    if (sample) {
        r->pass_depth = r->p.loops;
        s->ready[(*n_ready)++] = r;
    }
    return TL_OK;
}

/* The step's passes: the decode rows (and, mixed, the prompt chunks) in one, then the rest of
 * each prefill's chunk in running order. Without the mixed pass the decodes go first alone,
 * then each prompt chunk. A chunk that fails leaves its request where it got to (the next step
 * goes on from there) and the others go on: a mixed pass has run their prompt chunks already,
 * which must end (offered, released, ready to sample). Returns the first failure. */
static tl_status run_passes(tl_sched* s, size_t budget, size_t* n_ready) {
    size_t n_decodes;
    tl_status st = run_rows(s, budget, &n_decodes);
    if (st != TL_OK) return st;
    end_decodes(s, n_decodes, n_ready);
    for (sched_req* r = s->running.head; r; r = r->next) {
        const tl_status chunk = r->chunk_to > r->chunk_from ? end_chunk(s, r, n_ready) : TL_OK;
        if (st == TL_OK) st = chunk;
    }
    return st;
}

/* Sample each ready request's next token into the events; finished requests leave. */
static void sample_ready(tl_sched* s, size_t n_ready, step_events* ev) {
    for (size_t i = 0; i < n_ready; i++) {
        sched_req* r = s->ready[i];
        int32_t token = -1;
        const tl_finish why = tl_stream_sample(&r->stream, &token) == TL_OK ? r->stream.finish : TL_FINISH_ERROR;
        push_event(ev, r, why == TL_FINISH_ERROR ? -1 : token, why);
        if (why != TL_FINISH_ERROR) s->stats.generated_tokens++;
        if (why != TL_FINISH_ERROR && r->n_out > 1 && !r->speculative) { /* after a pass over an emitted token */
            s->stats.decode_passes++;
            s->stats.decode_loops += r->pass_depth;
            s->depth_counts[r->pass_depth - 1]++;
            if (r->pass_depth > s->n_depths) s->n_depths = r->pass_depth;
        }
        if (why != TL_FINISH_NONE) finish_request(s, r);
    }
}

TL_API tl_status tl_sched_step(tl_sched* s, uint64_t* ids, int32_t* tokens, uint8_t* finish, size_t capacity,
                               size_t* n_events) {
    if (n_events) *n_events = 0;
    if (!s || !ids || !tokens || !finish || !n_events)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "sched, ids, tokens, finish or n_events is NULL");
    if (capacity < s->params.max_batch)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "capacity %zu < max_batch %zu", capacity, s->params.max_batch);
    tl_status st = tl_engine_check_open(s->engine);
    if (st != TL_OK) return st;
    const tl_status admitted = admit(s);  /* a failed admission does not stop the running requests */
    if (s->running.n == 0) return admitted;
    const size_t prefill_positions = fit_budget(s, capacity);
    step_events ev = {ids, tokens, finish, 0};
    size_t n_ready = 0;
    st = run_rounds(s, &ev);
    if (st == TL_OK) st = run_passes(s, prefill_positions, &n_ready);
    sample_ready(s, n_ready, &ev);
    *n_events = ev.n;
    s->stats.steps++;
    return st != TL_OK ? st : admitted;
}

TL_API tl_status tl_sched_stats_get(const tl_sched* s, tl_sched_stats* out) {
    if (!s || !out || out->size < sizeof(size_t))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "sched or out is NULL, or out->size not set");
    tl_sched_stats v = s->stats;
    v.running = s->running.n;
    v.waiting = s->waiting.n;
    v.kv_bytes = kv_alone(s, &v.kv_blocks);
    v.kv_budget_bytes = s->params.kv_budget_bytes;
    tl_copy_versioned(out, &v, sizeof v);
    return TL_OK;
}

TL_API tl_status tl_sched_depth_counts(const tl_sched* s, uint64_t* counts, size_t n, size_t* n_depths) {
    if (!s || !n_depths || (!counts && n > 0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "sched or n_depths is NULL, or counts is NULL with n > 0");
    *n_depths = s->n_depths;
    const size_t copied = n < s->n_depths ? n : s->n_depths;
    if (copied) memcpy(counts, s->depth_counts, copied * sizeof *counts);
    return TL_OK;
}
