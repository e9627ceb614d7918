/* test_speculate.c — self-speculative decoding (docs/spec.md §5.6) and the part pass under it.
 *
 * The part pass (this test links the library's objects): a pass split at any iteration, a
 * draft at depth L_d (one row at a time or a chunk) resumed to depth L, equals the whole pass
 * bit for bit, logits, final states and every layer's KV; a prefix build split the same way
 * gives the same loop states and coda slots.
 *
 * Speculative decoding through the public API: on models without a coda, with a coda and
 * injection (also on the scalar path and with an automatic prefix cache), with two post-norm
 * codas and with a tiny vocabulary (where drafts often agree),
 * random requests (depths, L_d, K in 1 .. 64, sampling parameters, seeds, windows, prompt
 * chunks, stop sequences and eos that fire inside a drafted run, on_token stops, max_tokens
 * cuts) emit exactly plain decoding's tokens, logits (by bit pattern) and callbacks, alone,
 * from a prefix and in batches mixed with plain requests; the draft counters are sane; a
 * round that runs out of memory changes nothing and its retry is exact; draft logits that
 * cannot be sampled only end a round's drafting; a backend without a part pass decodes
 * plainly; bad parameters are refused with their messages. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "core/forward.h"
#include "core/speculate.h"
#include "test_kv.h"
#include "test_util.h"

enum { PROMPT = 11, ROWS = 9, MAX_NEW = 24 };

static int32_t prompt[PROMPT + ROWS];

/* Two sequences at depth L holding the prompt (run as a prefix build's, every depth's coda
 * slots written, with `build`), with KV reserved for the ROWS rows after it. */
static void two_seqs(tl_model* m, uint32_t L, int build, tl_seq** a, tl_seq** b) {
    CHECK_OK(tl_seq_create(m, L, 0, a));
    CHECK_OK(tl_seq_create(m, L, 0, b));
    float* states = malloc(L * tl_engine_config((*a)->engine)->d_model * sizeof(float));
    const tl_run_opts opts = {.loop_states = build ? states : NULL};
    for (int i = 0; i < 2; i++) {
        tl_seq* s = i ? *b : *a;
        CHECK_OK(tl_seq_run(s, prompt, PROMPT, 4, &opts));
        CHECK_OK(tl_kv_reserve(&s->kv, &s->engine->kv_geom, s->n_layers, s->n, ROWS));
    }
    free(states);
}

/* The whole pass over the ROWS rows vs a draft to L_d (row by row, or as one chunk) resumed
 * to L from its states. */
static void check_split(tl_model* m, uint32_t L, uint32_t Ld, int row_by_row) {
    tl_seq *a, *b;
    two_seqs(m, L, 0, &a, &b);
    const tl_config* c = tl_engine_config(a->engine);
    const size_t d = c->d_model, V = c->vocab_size;
    float* want = malloc(ROWS * V * sizeof(float));
    float* got = malloc(ROWS * V * sizeof(float));
    float* draft = malloc(V * sizeof(float));
    float* states = malloc(ROWS * d * sizeof(float));
    float* injects = malloc(ROWS * d * sizeof(float));
    float* hidden = malloc(ROWS * d * sizeof(float));
    float* last = malloc(d * sizeof(float));
    const int32_t* rows = prompt + PROMPT;
    CHECK_OK(tl_forward(a, rows, ROWS, want, NULL, last, NULL));
    for (size_t i = 0; i < (row_by_row ? ROWS : 1); i++) {
        const size_t T = row_by_row ? 1 : ROWS;
        const tl_part part = {.depth = Ld, .coda_depth = L, .state_out = states + i * d,
                              .inject_out = injects + i * d, .logits_last = draft};
        CHECK_OK(tl_forward_part(b, rows + i, T, PROMPT + i, &part));
    }
    const tl_part verify = {.first_iter = Ld, .depth = L, .state_in = states, .inject_in = injects,
                            .hidden_all = hidden, .logits_all = got};
    CHECK_OK(tl_forward_part(b, NULL, ROWS, PROMPT, &verify));
    CHECK(tu_same_bits(want, got, ROWS * V), "L=%u L_d=%u %s: verifier logits differ from the whole pass", L, Ld,
          row_by_row ? "rows" : "chunk");
    CHECK(tu_same_bits(last, hidden + (ROWS - 1) * d, d), "L=%u L_d=%u: final state differs", L, Ld);
    CHECK(tu_same_seq_kv(a, b, 0, PROMPT + ROWS, 0), "L=%u L_d=%u %s: KV differs", L, Ld, row_by_row ? "rows" : "chunk");
    free(want), free(got), free(draft), free(states), free(injects), free(hidden), free(last);
    tl_seq_free(a);
    tl_seq_free(b);
}

/* A prefix build's pass (loop_states) split at L_b: the same loop states and coda slots. */
static void check_split_build(tl_model* m, uint32_t L, uint32_t Lb) {
    tl_seq *a, *b;
    two_seqs(m, L, 1, &a, &b);
    const size_t d = tl_engine_config(a->engine)->d_model;
    float* want = malloc(L * d * sizeof(float));
    float* got = malloc(L * d * sizeof(float));
    float* states = malloc(ROWS * d * sizeof(float));
    float* injects = malloc(ROWS * d * sizeof(float));
    float* last = malloc(d * sizeof(float));
    CHECK_OK(tl_forward(a, prompt + PROMPT, ROWS, NULL, NULL, last, want));
    const tl_part base = {.depth = Lb, .state_out = states, .inject_out = injects, .loop_states = got};
    CHECK_OK(tl_forward_part(b, prompt + PROMPT, ROWS, PROMPT, &base));
    const tl_part extend = {.first_iter = Lb, .depth = L, .state_in = states, .inject_in = injects, .loop_states = got};
    CHECK_OK(tl_forward_part(b, NULL, ROWS, PROMPT, &extend));
    for (uint32_t i = 0; i < L; i++)
        CHECK(tu_same_bits(want + i * d, got + i * d, d), "build L=%u split at %u: loop state %u differs", L, Lb, i);
    CHECK(tu_same_seq_kv(a, b, 0, PROMPT + ROWS, 1), "build L=%u split at %u: KV differs", L, Lb);
    free(want), free(got), free(states), free(injects), free(last);
    tl_seq_free(a);
    tl_seq_free(b);
}

static void part_pass(const char* name, const tu_spec* spec) {
    const char* path = tu_write_model(name, spec);
    for (tl_isa isa = TL_ISA_SCALAR; isa <= TL_ISA_AMX; isa++) {
        if (!tl_cpu_supports(isa)) continue;
        tl_model* m = tu_open(path, 2, isa, 4);
        if (!m) continue;
        for (uint32_t L = 2; L <= 4; L++)
            for (uint32_t Ld = 1; Ld < L; Ld++) {
                check_split(m, L, Ld, 1);
                check_split(m, L, Ld, 0);
                check_split_build(m, L, Ld);
            }
        tl_model_free(m);
    }
}

/* ---- speculative == plain, through the public API ------------------------------------------- */

/* What one generation produced, on_token's calls included. */
typedef struct outcome {
    tl_status st;
    int32_t tokens[MAX_NEW];
    float* logits;   /* [MAX_NEW][V] */
    size_t n;
    int32_t heard[MAX_NEW];
    size_t n_heard;
    size_t stop_after; /* on_token asks to stop after this many calls (0: never) */
    tl_draft_stats stats;
} outcome;

static int on_token(void* user_data, int32_t token) {
    outcome* o = user_data;
    if (o->n_heard < MAX_NEW) o->heard[o->n_heard] = token;
    o->n_heard++;
    return o->stop_after && o->n_heard >= o->stop_after;
}

static uint32_t V_of(tl_model* m) {
    tl_model_config c = {.size = sizeof c};
    CHECK_OK(tl_model_config_get(m, &c));
    return c.vocab_size;
}

static void outcome_init(outcome* o, uint32_t V, size_t stop_after) {
    memset(o, 0, sizeof *o);
    o->logits = calloc((size_t)MAX_NEW * V, sizeof(float));
    o->stop_after = stop_after;
    o->stats = (tl_draft_stats){777, 777}; /* zeroed by a valid request */
}

/* gp with on_token and draft_stats pointing into o. */
static tl_gen_params wired(const tl_gen_params* gp, outcome* o) {
    tl_gen_params w = *gp;
    w.on_token = on_token;
    w.user_data = o;
    w.draft_stats = &o->stats;
    return w;
}

static void generate(tl_model* m, const tl_prefix* prefix, const int32_t* toks, size_t n, const tl_gen_params* gp,
                     outcome* o) {
    const tl_gen_params w = wired(gp, o);
    o->st = prefix ? tl_generate_from_prefix(prefix, toks, n, &w, o->tokens, &o->n, o->logits)
                   : tl_generate(m, toks, n, &w, o->tokens, &o->n, o->logits);
}

static size_t total_drafted, total_accepted, full_rounds, wave_accepted;

/* spec (speculative) against plain: same status, tokens, logits bits and callbacks; sane counters. */
static void check_same(const outcome* plain, const outcome* spec, const tl_gen_params* gp, uint32_t V,
                       const char* what) {
    CHECK(plain->st == TL_OK && spec->st == TL_OK, "%s: status %d / %d: %s", what, plain->st, spec->st, tl_last_error());
    CHECK(spec->n == plain->n && memcmp(spec->tokens, plain->tokens, plain->n * sizeof(int32_t)) == 0,
          "%s (L=%u L_d=%u K=%u T=%g): tokens differ (%zu vs %zu emitted)", what, gp->loops, gp->draft_loops,
          gp->n_draft, (double)gp->temperature, spec->n, plain->n);
    CHECK(tu_same_bits(spec->logits, plain->logits, (size_t)MAX_NEW * V), "%s (L=%u L_d=%u K=%u): logits differ", what,
          gp->loops, gp->draft_loops, gp->n_draft);
    CHECK(spec->n_heard == plain->n_heard && memcmp(spec->heard, plain->heard, plain->n * sizeof(int32_t)) == 0,
          "%s: on_token calls differ", what);
    CHECK(plain->stats.drafted == 0 && plain->stats.accepted == 0, "%s: plain decoding drafted", what);
    const tl_draft_stats* s = &spec->stats;
    CHECK(s->accepted <= s->drafted, "%s: accepted %zu > drafted %zu", what, s->accepted, s->drafted);
    CHECK(s->accepted + 1 <= spec->n || spec->n == 0, "%s: accepted %zu of %zu emitted", what, s->accepted, spec->n);
    if (gp->draft_wave) /* a wave enters at most one draft a step, and emits a token every L steps or sooner */
        CHECK(s->drafted <= spec->n * (size_t)gp->loops, "%s: wave drafted %zu for %zu emitted", what, s->drafted,
              spec->n);
    else /* every round drafts */
        CHECK((s->drafted > 0) == (gp->n_draft && spec->n > 1), "%s: drafted %zu with %zu emitted, K=%u", what,
              s->drafted, spec->n, gp->n_draft);
    total_drafted += s->drafted;
    total_accepted += s->accepted;
    if (gp->draft_wave) wave_accepted += s->accepted;
    full_rounds += s->drafted > 0 && s->accepted == s->drafted;
}

/* A random request: depth 2 .. 4, L_d, K, max_tokens, every sampling parameter, window,
 * prompt chunk, and maybe an on_token stop after *stop_after tokens. */
static tl_gen_params random_params(uint64_t* rng, size_t* stop_after) {
    static const uint32_t ks[] = {1, 2, 4, 8, 64};
    tl_gen_params gp = tl_gen_params_default();
    gp.loops = (uint32_t)tu_uniform(rng, 2, 4);
    gp.draft_loops = (uint32_t)tu_uniform(rng, 1, (int32_t)gp.loops - 1);
    gp.n_draft = ks[tu_uniform(rng, 0, 4)];
    gp.max_tokens = (size_t)tu_uniform(rng, 1, MAX_NEW);
    const int temp = tu_uniform(rng, 0, 3);
    gp.temperature = temp == 0 ? 0.0f : temp == 1 ? 0.7f : temp == 2 ? 1.0f : 1.6f;
    gp.top_k = tu_uniform(rng, 0, 2) == 0 ? 0 : tu_uniform(rng, 1, 60);
    gp.top_p = tu_uniform(rng, 0, 1) ? 1.0f : 0.85f;
    gp.repetition_penalty = tu_uniform(rng, 0, 2) ? 1.0f : 1.35f;
    gp.seed = tu_next(rng);
    gp.cache_window = tu_uniform(rng, 0, 2) ? 0 : (uint32_t)tu_uniform(rng, 2, 9);
    gp.prefill_chunk = (size_t)tu_uniform(rng, 0, 5);
    *stop_after = tu_uniform(rng, 0, 5) ? 0 : (size_t)tu_uniform(rng, 1, 8);
    gp.draft_wave = (uint32_t)tu_uniform(rng, 0, 1);
    if (gp.draft_wave && tu_uniform(rng, 0, 2) == 0) gp.draft_loops = 0; /* the wave chooses */
    return gp;
}

/* Maybe (one time in three) stop rules made of what gp emits without them (seq[0 .. n_seq)), so
 * they fire inside a drafted run: a sequence of 2 and a single token. */
static void maybe_stops(uint64_t* rng, tl_gen_params* gp, const int32_t* seq, size_t n_seq, int32_t* stops,
                        size_t* lengths) {
    if (n_seq < 6 || tu_uniform(rng, 0, 2) != 0) return;
    const size_t at = (size_t)tu_uniform(rng, 2, (int32_t)n_seq - 2);
    stops[0] = seq[at], stops[1] = seq[at + 1], stops[2] = seq[tu_uniform(rng, 3, (int32_t)n_seq - 1)];
    lengths[0] = 2, lengths[1] = 1;
    gp->stop_tokens = stops;
    gp->stop_lengths = lengths;
    gp->n_stop = 2;
}

/* `cases` random requests on m: speculative == plain, each from the prompt or from a prefix. */
static void random_requests(tl_model* m, const char* name, uint64_t seed, int cases) {
    const uint32_t V = V_of(m);
    uint64_t rng = seed;
    for (int c = 0; c < cases; c++) {
        int32_t toks[PROMPT];
        const size_t n = (size_t)tu_uniform(&rng, 1, PROMPT);
        for (size_t i = 0; i < n; i++) toks[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
        size_t stop_after;
        tl_gen_params gp = random_params(&rng, &stop_after);
        tl_gen_params base = gp; /* plain, without stops: the tokens the stop rules are made of */
        base.n_draft = 0;
        int32_t seq[MAX_NEW], stops[3];
        size_t n_seq = 0, lengths[2];
        CHECK_OK(tl_generate(m, toks, n, &base, seq, &n_seq, NULL));
        maybe_stops(&rng, &gp, seq, n_seq, stops, lengths);
        const int from_prefix = tu_uniform(&rng, 0, 3) == 0 && n >= 2;
        tl_prefix* prefix = NULL;
        size_t skip = 0;
        if (from_prefix) {
            skip = (size_t)tu_uniform(&rng, 1, (int32_t)n - 1);
            const uint32_t Lb = gp.loops + (uint32_t)tu_uniform(&rng, 0, 1); /* a deeper prefix serves L too */
            CHECK_OK(tl_prefix_build(m, toks, skip, Lb, gp.cache_window, 2, &prefix));
        }
        outcome plain, spec;
        outcome_init(&plain, V, stop_after);
        outcome_init(&spec, V, stop_after);
        tl_gen_params off = gp;
        off.n_draft = 0;
        generate(m, prefix, toks + skip, n - skip, &off, &plain);
        generate(m, prefix, toks + skip, n - skip, &gp, &spec);
        char what[96];
        snprintf(what, sizeof what, "%s case %d%s%s", name, c, gp.draft_wave ? " (wave)" : "",
                 prefix ? " (from a prefix)" : "");
        check_same(&plain, &spec, &gp, V, what);
        free(plain.logits);
        free(spec.logits);
        tl_prefix_free(prefix);
    }
}

/* The prompt's ids folded into [0, V). */
static void ids_for(uint32_t V, int32_t* ids) {
    for (size_t i = 0; i < PROMPT; i++) ids[i] = prompt[i] % (int32_t)V;
}

/* eos inside a drafted run: the model's eos is a token plain decoding emits mid-run. */
static void eos_in_run(const char* name, tu_spec spec) {
    tl_model* m = tu_open(tu_write_model(name, &spec), 2, TL_ISA_AUTO, 4);
    const uint32_t V = V_of(m);
    int32_t ids[PROMPT];
    ids_for(V, ids);
    tl_gen_params gp = tl_gen_params_default();
    gp.loops = 4;
    gp.max_tokens = MAX_NEW;
    int32_t seq[MAX_NEW];
    size_t n_seq;
    CHECK_OK(tl_generate(m, ids, PROMPT, &gp, seq, &n_seq, NULL));
    tl_model_free(m);
    spec.eos = seq[n_seq / 2];
    m = tu_open(tu_write_model(name, &spec), 2, TL_ISA_AUTO, 4);
    for (uint32_t Ld = 1; Ld < gp.loops; Ld++)
        for (uint32_t K = 1; K <= 8; K *= 2) {
            outcome plain, sp;
            outcome_init(&plain, V, 0);
            outcome_init(&sp, V, 0);
            generate(m, NULL, ids, PROMPT, &gp, &plain);
            tl_gen_params s = gp;
            s.draft_loops = Ld;
            s.n_draft = K;
            generate(m, NULL, ids, PROMPT, &s, &sp);
            check_same(&plain, &sp, &s, V, "eos");
            CHECK(plain.n <= n_seq / 2 + 1 && plain.tokens[plain.n - 1] == spec.eos, "eos did not stop plain decoding");
            free(plain.logits);
            free(sp.logits);
        }
    tl_model_free(m);
}

/* tl_generate_batch: plain and speculative requests (some from a prefix) mixed in one batch,
 * each equal to tl_generate of it alone without drafting. */
static void batch_mixed(tl_model* m, uint64_t seed) {
    enum { B = 6 };
    const uint32_t V = V_of(m);
    uint64_t rng = seed;
    int32_t ids[PROMPT];
    ids_for(V, ids);
    tl_prefix* prefix = NULL;
    CHECK_OK(tl_prefix_build(m, ids, 5, 4, 0, 0, &prefix));
    tl_gen_params gp[B];
    tl_request req[B];
    tl_request* ptrs[B];
    outcome want[B], got[B];
    for (int i = 0; i < B; i++) {
        size_t stop_after;
        gp[i] = random_params(&rng, &stop_after);
        gp[i].cache_window = 0;
        if (i % 3 == 2) gp[i].n_draft = 0; /* plain, in the batched pass */
        outcome_init(&want[i], V, 0);
        outcome_init(&got[i], V, 0);
        tl_gen_params off = gp[i];
        off.n_draft = 0;
        const int from_prefix = i == 1 || i == 2;
        const int32_t* toks = from_prefix ? ids + 5 : ids;
        const size_t n = from_prefix ? PROMPT - 5 : (size_t)(PROMPT - i);
        generate(m, from_prefix ? prefix : NULL, toks, n, &off, &want[i]);
        gp[i] = wired(&gp[i], &got[i]);
        req[i] = (tl_request){sizeof req[i], from_prefix ? prefix : NULL, toks, n, &gp[i], got[i].tokens, got[i].logits, 0};
        ptrs[i] = &req[i];
    }
    CHECK_OK(tl_generate_batch(m, ptrs, B));
    for (int i = 0; i < B; i++) {
        got[i].n = req[i].n_out;
        got[i].st = TL_OK;
        char what[48];
        snprintf(what, sizeof what, "batch request %d", i);
        tl_gen_params rounds = gp[i]; /* a batch runs rounds whatever draft_wave says */
        rounds.draft_wave = 0;
        check_same(&want[i], &got[i], &rounds, V, what);
        free(want[i].logits);
        free(got[i].logits);
    }
    tl_prefix_free(prefix);
}

/* The prompt decoded plainly by the engine's own backend (*plain), then, with gp's drafts set
 * to draft_loops loops and n_draft a round, through the backend interface `swapped` (*spec). */
static void plain_then_drafted(tl_model* m, tl_engine* e, const tl_backend_iface* swapped, tl_gen_params* gp,
                               uint32_t draft_loops, uint32_t n_draft, outcome* plain, outcome* spec) {
    const uint32_t V = V_of(m);
    outcome_init(plain, V, 0);
    outcome_init(spec, V, 0);
    generate(m, NULL, prompt, PROMPT, gp, plain);
    gp->draft_loops = draft_loops;
    gp->n_draft = n_draft;
    const tl_backend_iface* own = e->backend->iface;
    e->backend->iface = swapped;
    generate(m, NULL, prompt, PROMPT, gp, spec);
    e->backend->iface = own;
}

/* A backend without a part pass decodes plainly: identical tokens, nothing drafted. */
static void no_part_pass(tl_model* m) {
    tl_engine* e;
    CHECK_OK(tl_model_acquire(m, &e));
    tl_backend_iface without = *e->backend->iface;
    without.forward_part = NULL;
    const uint32_t V = V_of(m);
    tl_gen_params gp = tl_gen_params_default();
    gp.loops = 3;
    gp.max_tokens = 10;
    gp.temperature = 0.8f;
    gp.seed = 5;
    outcome plain, spec;
    plain_then_drafted(m, e, &without, &gp, 1, 4, &plain, &spec);
    CHECK(spec.st == TL_OK && spec.n == plain.n && memcmp(spec.tokens, plain.tokens, plain.n * sizeof(int32_t)) == 0 &&
              tu_same_bits(spec.logits, plain.logits, (size_t)MAX_NEW * V),
          "without a part pass: output differs from plain decoding");
    CHECK(spec.stats.drafted == 0 && spec.stats.accepted == 0, "without a part pass: drafted %zu", spec.stats.drafted);
    free(plain.logits);
    free(spec.logits);
    tl_engine_unref(e);
}

/* The real part pass, and a wrapper whose every third draft has a NaN logit. */
static tl_status (*real_part)(tl_backend*, tl_seq*, const int32_t*, size_t, size_t, const tl_part*);
static int drafts_run;

static tl_status nan_drafts(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0, const tl_part* part) {
    const tl_status st = real_part(b, s, tokens, T, pos0, part);
    if (st == TL_OK && part->first_iter == 0 && part->depth < s->loops && ++drafts_run % 3 == 0)
        part->logits_last[7] = NAN;
    return st;
}

/* Draft logits that cannot be sampled end the drafting there (plain decoding never sees them):
 * the output is still plain decoding's. */
static void unsampleable_drafts(tl_model* m) {
    tl_engine* e;
    CHECK_OK(tl_model_acquire(m, &e));
    const tl_backend_iface* own = e->backend->iface;
    tl_backend_iface poisoned = *own;
    real_part = own->forward_part;
    poisoned.forward_part = nan_drafts;
    const uint32_t V = V_of(m);
    for (int greedy = 0; greedy < 2; greedy++) {
        tl_gen_params gp = tl_gen_params_default();
        gp.loops = 4;
        gp.max_tokens = MAX_NEW;
        gp.temperature = greedy ? 0.0f : 1.0f;
        outcome plain, spec;
        drafts_run = 0;
        plain_then_drafted(m, e, &poisoned, &gp, 2, 8, &plain, &spec);
        check_same(&plain, &spec, &gp, V, "NaN drafts");
        CHECK(drafts_run >= 3, "no draft was poisoned");
        free(plain.logits);
        free(spec.logits);
    }
    tl_engine_unref(e);
}

/* The requests the allocation-failure sweeps run: depth 4, a window of 6, MAX_NEW tokens. */
static tl_gen_params sweep_params(uint32_t draft_loops, uint32_t n_draft) {
    tl_gen_params gp = tl_gen_params_default();
    gp.loops = 4;
    gp.draft_loops = draft_loops;
    gp.n_draft = n_draft;
    gp.max_tokens = MAX_NEW;
    gp.cache_window = 6;
    return gp;
}

/* Rounds driven by hand, each first tried with the k-th allocation failing for every k until
 * one succeeds: a failed round leaves the stream and its table exactly as they were, and the
 * tokens at the end are plain decoding's. */
static void failing_rounds(tl_model* m) {
    tl_engine* e;
    CHECK_OK(tl_model_acquire(m, &e));
    tl_gen_params gp = sweep_params(2, 8), p;
    gp.temperature = 0.9f;
    int32_t want[MAX_NEW], got[MAX_NEW];
    size_t n_want, n_got;
    tl_gen_params off = gp;
    off.n_draft = 0;
    CHECK_OK(tl_generate(m, prompt, PROMPT, &off, want, &n_want, NULL));
    CHECK_OK(tl_gen_check(e, NULL, prompt, PROMPT, &gp, &p));
    tl_stream s;
    tl_spec sp;
    CHECK_OK(tl_stream_init(&s, e, &p, got, NULL, &n_got));
    CHECK_OK(tl_spec_init(&sp, e, &p, false));
    CHECK_OK(tl_gen_start(e, NULL, prompt, PROMPT, &s));
    tl_stream_see(&s, prompt, PROMPT);
    int32_t token;
    CHECK_OK(tl_stream_sample(&s, &token));
    size_t failures = 0;
    for (int round = 0; !s.done && round < MAX_NEW; round++) {
        for (int64_t k = 0; k < 1000; k++) {
            const size_t n = s.seq->n, emitted = s.n_emitted, spans = s.seq->kv.n_spans, live = s.seq->kv.first_live;
            const uint32_t last = spans ? s.seq->kv.spans[spans - 1].count : 0;
            const int32_t before = token;
            tl_alloc_fail_after(k);
            const tl_status st = tl_spec_round(&sp, &s, &token, 0);
            tl_alloc_fail_after(-1);
            if (st == TL_OK) break;
            failures++;
            CHECK(st == TL_ERR_OUT_OF_MEMORY, "round: status %d: %s", st, tl_last_error());
            CHECK(s.seq->n == n && s.n_emitted == emitted && token == before && s.seq->kv.n_spans == spans &&
                      s.seq->kv.first_live == live && (!spans || s.seq->kv.spans[spans - 1].count == last),
                  "a failed round changed the stream");
        }
    }
    CHECK(failures > 0, "no round allocated anything");
    CHECK(n_got == n_want && memcmp(got, want, n_want * sizeof(int32_t)) == 0, "retried rounds differ from plain");
    tl_spec_free(&sp);
    tl_stream_free(&s);
    tl_engine_unref(e);
}

/* A wave request failing at each of its allocations in turn fails cleanly (out of memory) or,
 * once none fails, emits plain decoding's tokens. */
static void failing_waves(tl_model* m) {
    tl_gen_params gp = sweep_params(1, 4);
    gp.draft_wave = 1;
    tl_gen_params off = gp;
    off.n_draft = 0;
    int32_t want[MAX_NEW], got[MAX_NEW];
    size_t n_want, n_got, failures = 0;
    CHECK_OK(tl_generate(m, prompt, PROMPT, &off, want, &n_want, NULL));
    for (int64_t k = 0; k < 100000; k++) {
        tl_alloc_fail_after(k);
        const tl_status st = tl_generate(m, prompt, PROMPT, &gp, got, &n_got, NULL);
        tl_alloc_fail_after(-1);
        if (st == TL_OK) {
            CHECK(n_got == n_want && memcmp(got, want, n_want * sizeof(int32_t)) == 0, "wave: tokens differ");
            break;
        }
        failures++;
        CHECK(st == TL_ERR_OUT_OF_MEMORY, "wave: status %d: %s", st, tl_last_error());
    }
    CHECK(failures > 0, "a wave request allocated nothing");
}

/* Bad parameters are refused before any work, with their messages. */
static void bad_arguments(tl_model* m) {
    int32_t out[4];
    size_t n;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    gp.loops = 3;
    tl_draft_stats stats = {5, 5};
    gp.draft_stats = &stats;
    gp.n_draft = TL_MAX_DRAFT + 1;
    gp.draft_loops = 1;
    CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "n_draft > 64") == 0, "message: %s", tl_last_error());
    CHECK(stats.drafted == 5, "an invalid request touched draft_stats");
    gp.n_draft = 4;
    gp.draft_wave = 2;
    CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "draft_wave must be 0 or 1, got 2") == 0, "message: %s", tl_last_error());
    gp.draft_wave = 1;
    static const char* const bad_predictions[] = {"1,2", "1,2,3;4,5", "1,2,3;", "1,-2,3", "1,2,x", "1,,2,3",
                                                  "1,2,3,4", "1,2,99999999999"};
    for (size_t i = 0; i < sizeof bad_predictions / sizeof *bad_predictions; i++) { /* loops 3: groups of 3 */
        setenv("TINYLOOP_BENCH_PREDICTIONS", bad_predictions[i], 1);
        CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
        CHECK(strstr(tl_last_error(), "TINYLOOP_BENCH_PREDICTIONS must be groups of 3 ids") != NULL,
              "'%s': message: %s", bad_predictions[i], tl_last_error());
    }
    setenv("TINYLOOP_BENCH_PREDICTIONS", "1,2,3;4,5,6", 1);
    CHECK_OK(tl_generate(m, prompt, 3, &gp, out, &n, NULL));
    unsetenv("TINYLOOP_BENCH_PREDICTIONS");
    gp.draft_wave = 0;
    const uint32_t bad[] = {0, 3, 9};
    for (size_t i = 0; i < 3; i++) {
        gp.n_draft = 4;
        gp.draft_loops = bad[i];
        CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
        char want[96];
        snprintf(want, sizeof want, "draft_loops must be in 1 .. loops-1 (loops=3) when n_draft > 0, got %u", bad[i]);
        CHECK(strcmp(tl_last_error(), want) == 0, "message: %s", tl_last_error());
    }
    gp.loops = 0; /* the default depth, 3, is what draft_loops is checked against */
    CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "(loops=3)") != NULL, "message: %s", tl_last_error());
    tl_prefix* prefix = NULL;
    CHECK_OK(tl_prefix_build(m, prompt, 4, 2, 0, 0, &prefix));
    gp.draft_loops = 2; /* loops 0 from a prefix: the prefix's depth, 2 */
    CHECK_STATUS(tl_generate_from_prefix(prefix, prompt, 2, &gp, out, &n, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "(loops=2) when n_draft > 0, got 2") != NULL, "message: %s", tl_last_error());
    tl_prefix_free(prefix);
    tl_request r = {sizeof r, NULL, prompt, 3, &gp, out, NULL, 0};
    tl_request* rs[2] = {&r, &r};
    tl_request r0 = {sizeof r0, NULL, prompt, 3, NULL, out, NULL, 0};
    rs[0] = &r0;
    gp.n_draft = 65;
    CHECK_STATUS(tl_generate_batch(m, rs, 2), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "request 1: n_draft > 64") == 0, "message: %s", tl_last_error());
    /* n_draft 0 ignores draft_loops; a valid request zeroes the counters; max_tokens 1 drafts nothing */
    gp.n_draft = 0;
    gp.draft_loops = 99;
    CHECK_OK(tl_generate(m, prompt, 3, &gp, out, &n, NULL));
    CHECK(stats.drafted == 0 && stats.accepted == 0, "draft_stats not zeroed");
    gp.n_draft = 4;
    gp.draft_loops = 1;
    gp.loops = 3;
    gp.max_tokens = 1;
    stats = (tl_draft_stats){5, 5};
    CHECK_OK(tl_generate(m, prompt, 3, &gp, out, &n, NULL));
    CHECK(n == 1 && stats.drafted == 0 && stats.accepted == 0, "max_tokens 1: drafted %zu", stats.drafted);
    /* the defaults decode plainly */
    const tl_gen_params d = tl_gen_params_default();
    CHECK(d.n_draft == 0 && d.draft_loops == 0 && d.draft_stats == NULL, "tl_gen_params_default drafts");
}

int main(void) {
    uint64_t rng = 7;
    for (size_t i = 0; i < PROMPT + ROWS; i++) prompt[i] = tu_uniform(&rng, 0, 255);
    tu_spec plain = tu_spec_default();
    tu_spec rich = tu_spec_rich();
    tu_spec post = tu_spec_rich();
    post.layout = 2, post.n_coda = 2, post.injection = 0;
    tu_spec tiny = tu_spec_default(); /* 5 ids: drafts often agree, rounds run to K */
    tiny.vocab = 5;
    tu_spec hrm = tu_spec_hrm(); /* a two-state core: the low states resume with the states */
    part_pass("part-plain.tinyloop", &plain);
    part_pass("part-rich.tinyloop", &rich);
    part_pass("part-post.tinyloop", &post);
    part_pass("part-hrm.tinyloop", &hrm);

    const tu_spec* specs[] = {&plain, &rich, &post, &tiny, &hrm};
    const char* names[] = {"plain", "rich", "post", "tiny", "hrm"};
    for (int i = 0; i < 5; i++) {
        tl_model* m = tu_open(tu_write_model(names[i], specs[i]), 2, TL_ISA_AUTO, 4);
        random_requests(m, names[i], 100 + (uint64_t)i, 40);
        batch_mixed(m, 200 + (uint64_t)i);
        tl_model_free(m);
    }
    tl_model* scalar = tu_open(tu_write_model("rich-scalar", &rich), 1, TL_ISA_SCALAR, 4);
    random_requests(scalar, "rich scalar", 300, 15);
    tl_model_free(scalar);
    tl_model* cached = tu_open_cached(tu_write_model("rich-cached", &rich), 1 << 20);
    random_requests(cached, "rich cached", 400, 15);
    batch_mixed(cached, 401);
    tl_model_free(cached);
    eos_in_run("eos-rich", rich);
    eos_in_run("eos-tiny", tiny);
    CHECK(total_accepted > 0 && full_rounds > 0, "drafts never agreed (accepted %zu of %zu): the test proves little",
          total_accepted, total_drafted);
    CHECK(wave_accepted > 0, "no wave request kept a draft: the wave schedule went untested");
    printf("drafted %zu, accepted %zu (in waves %zu), requests with every draft accepted %zu\n", total_drafted,
           total_accepted, wave_accepted, full_rounds);

    tl_model* m = tu_open(tu_write_model("rich-misc", &rich), 2, TL_ISA_AUTO, 4);
    no_part_pass(m);
    unsampleable_drafts(m);
    failing_rounds(m);
    failing_waves(m);
    bad_arguments(m);
    tl_model_free(m);
    return tu_finish("test_speculate");
}
