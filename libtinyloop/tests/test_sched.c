/* test_sched.c — the continuous-batching scheduler from a C host. Requests sharing a prefix,
 * with stop sequences, salts, sampling and depths, some decoding speculatively among plain
 * ones, added at different steps to schedulers of several batch sizes, step budgets, event
 * capacities and KV budgets (down to one that forces preemption), each get exactly plain
 * tl_generate's tokens, and their finish codes say why they ended; no step emits more events
 * than its capacity and step budget allow, nor more than one for a plain request; a cancelled
 * request emits nothing more; the counters add up (drafted and accepted tokens too, equal to
 * tl_generate's when no step caps a round); bad arguments, callbacks, a too small event array
 * and a closed model are refused with the right status. Steps run their decodes and prompt
 * chunks as one mixed pass (counted), or with TINYLOOP_MIXED_PASS=0 as separate passes (for some
 * seeds): the tokens are the same. */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N = 6, MAX_NEW = 9, SHARED = 24, PROMPT_MAX = SHARED + 12, CAP = 16, MAX_K = 8, EVENTS = 256 };

static uint32_t V;
static int32_t prompts[N][PROMPT_MAX];
static size_t prompt_lengths[N];
static tl_gen_params params[N];
static const int32_t stop_tokens[] = {3, 5, 7};
static const size_t stop_lengths[] = {1, 2};
static const char* salts[] = {NULL, "tenant-a", "", "tenant-a", "tenant-b", NULL};

typedef struct expected {
    int32_t tokens[N][MAX_NEW];
    size_t n[N];
    size_t drafted, accepted; /* tl_generate's, over the requests */
} expected;

/* Requests of seed; `decode_heavy`: prompts of 2 tokens decoding MAX_NEW tokens each, so the
 * decodes outgrow what admission foresaw and a tight budget must preempt; `speculative`: every
 * request but one in three decodes speculatively (1 <= n_draft <= MAX_K, at depth 2 or 3). */
static void make_requests(uint64_t seed, int decode_heavy, int speculative) {
    uint64_t rng = seed;
    int32_t shared[SHARED];
    for (int j = 0; j < SHARED; j++) shared[j] = tu_uniform(&rng, 0, (int32_t)V - 1);
    for (int i = 0; i < N; i++) {
        const size_t own = (size_t)tu_uniform(&rng, 1, PROMPT_MAX - SHARED);
        memcpy(prompts[i], shared, sizeof shared);
        for (size_t j = 0; j < own; j++) prompts[i][SHARED + j] = tu_uniform(&rng, 0, (int32_t)V - 1);
        prompt_lengths[i] = decode_heavy ? 2 : SHARED + own;
        tl_gen_params* p = &params[i];
        *p = tl_gen_params_default();
        p->max_tokens = decode_heavy ? MAX_NEW : (size_t)tu_uniform(&rng, 1, MAX_NEW);
        p->loops = (uint32_t)tu_uniform(&rng, 1, 3);
        p->temperature = i % 2 ? 0.9f : 0.0f;
        p->seed = tu_next(&rng);
        p->cache_salt = salts[i];
        p->cache_window = i == 4 ? 6 : 0;
        if (i == 1) {
            p->stop_tokens = stop_tokens;
            p->stop_lengths = stop_lengths;
            p->n_stop = 2;
        }
        if (speculative && i % 3 != 2) {
            p->loops = (uint32_t)tu_uniform(&rng, 2, 3);
            p->draft_loops = (uint32_t)tu_uniform(&rng, 1, (int32_t)p->loops - 1);
            p->n_draft = (uint32_t)tu_uniform(&rng, 1, MAX_K);
        }
    }
}

/* Each request alone, decoded plainly (the tokens every schedule must give); a speculative
 * one also as requested, which must give the same tokens, counting its drafts. */
static void generate_alone(tl_model* m, expected* want) {
    want->drafted = want->accepted = 0;
    for (int i = 0; i < N; i++) {
        tl_gen_params plain = params[i];
        plain.n_draft = 0;
        CHECK_OK(tl_generate(m, prompts[i], prompt_lengths[i], &plain, want->tokens[i], &want->n[i], NULL));
        if (!params[i].n_draft) continue;
        tl_gen_params p = params[i];
        tl_draft_stats drafts;
        p.draft_stats = &drafts;
        int32_t tokens[MAX_NEW];
        size_t n = 0;
        CHECK_OK(tl_generate(m, prompts[i], prompt_lengths[i], &p, tokens, &n, NULL));
        CHECK(n == want->n[i] && memcmp(tokens, want->tokens[i], n * sizeof *tokens) == 0,
              "request %d: speculative tl_generate differs from plain", i);
        want->drafted += drafts.drafted;
        want->accepted += drafts.accepted;
    }
}

/* Run every request through a scheduler, request i added at step i % 3, stepping with room for
 * `capacity` events; check its tokens and finish code against `want`, and each step's events
 * against the caps. Returns the scheduler's final counters. */
static tl_sched_stats run_scheduled(tl_model* m, const expected* want, size_t max_batch, size_t step_tokens,
                                    size_t budget, size_t capacity) {
    tl_sched_stats st = {.size = sizeof st};
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = max_batch;
    sp.step_tokens = step_tokens;
    sp.kv_budget_bytes = budget;
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, &sp, &s));
    if (!s) return st;
    uint64_t ids[N] = {0}, ev_ids[EVENTS];
    int32_t got[N][MAX_NEW], ev_tokens[EVENTS];
    uint8_t ev_finish[EVENTS], finish[N] = {0};
    size_t n_got[N] = {0}, n_events = 0, added = 0;
    for (int step = 0; step < 1000; step++) {
        for (int i = 0; i < N; i++)
            if (i % 3 == step) {
                CHECK_OK(tl_sched_add(s, prompts[i], prompt_lengths[i], &params[i], &ids[i]));
                added++;
            }
        CHECK_OK(tl_sched_step(s, ev_ids, ev_tokens, ev_finish, capacity, &n_events));
        CHECK(n_events <= capacity && n_events <= step_tokens, "a step emitted %zu events (capacity %zu, step "
              "tokens %zu)", n_events, capacity, step_tokens);
        size_t step_events[N] = {0};
        for (size_t e = 0; e < n_events; e++) {
            int i = 0;
            while (i < N && ids[i] != ev_ids[e]) i++;
            CHECK(i < N && !finish[i] && n_got[i] < MAX_NEW, "event for unknown or finished request %llu",
                  (unsigned long long)ev_ids[e]);
            if (i == N || finish[i] || n_got[i] == MAX_NEW) continue;
            got[i][n_got[i]++] = ev_tokens[e];
            finish[i] = ev_finish[e];
            step_events[i]++;
        }
        for (int i = 0; i < N; i++)
            CHECK(step_events[i] <= (params[i].n_draft ? params[i].n_draft : 1), "request %d (n_draft %u) got %zu "
                  "events in a step", i, params[i].n_draft, step_events[i]);
        CHECK_OK(tl_sched_stats_get(s, &st));
        if (budget) CHECK(st.kv_bytes <= budget, "kv_bytes %zu > budget %zu", st.kv_bytes, budget);
        if (added == N && st.running == 0 && st.waiting == 0) break;
    }
    for (int i = 0; i < N; i++) {
        CHECK(n_got[i] == want->n[i] && memcmp(got[i], want->tokens[i], want->n[i] * sizeof(int32_t)) == 0,
              "batch %zu, step %zu, budget %zu: request %d got %zu tokens, want %zu", max_batch, step_tokens,
              budget, i, n_got[i], want->n[i]);
        const uint8_t why = want->n[i] == params[i].max_tokens && i != 1 ? TL_FINISH_LENGTH : finish[i];
        CHECK(finish[i] == why && finish[i] != TL_FINISH_NONE && finish[i] != TL_FINISH_ERROR,
              "request %d finish %u", i, finish[i]);
    }
    CHECK_OK(tl_sched_stats_get(s, &st));
    size_t emitted = 0, emitted_speculative = 0;
    for (int i = 0; i < N; i++) {
        emitted += want->n[i];
        if (params[i].n_draft) emitted_speculative += want->n[i];
    }
    CHECK(st.finished == N && st.cancelled == 0 && st.generated_tokens == emitted && st.kv_bytes == 0,
          "stats: finished %llu, generated %llu of %zu, kv %zu", (unsigned long long)st.finished,
          (unsigned long long)st.generated_tokens, emitted, st.kv_bytes);
    /* accepted drafts are emitted tokens of the speculative requests */
    CHECK(st.accepted_tokens <= st.drafted_tokens && st.accepted_tokens <= emitted_speculative,
          "drafted %llu, accepted %llu, speculative tokens %zu",
          (unsigned long long)st.drafted_tokens, (unsigned long long)st.accepted_tokens, emitted_speculative);
    tl_sched_free(s);
    return st;
}

/* The schedules of the requests made last, each checked against `want`; adds up the
 * preemptions and the drafted and accepted tokens. */
static void run_schedules(tl_model* m, const expected* want, size_t fits, tl_sched_stats* total) {
    const tl_sched_stats runs[] = {
        run_scheduled(m, want, 1, 1, 0, 1),            /* every round K' = 1 */
        run_scheduled(m, want, 4, 4, 0, 4),
        run_scheduled(m, want, 3, 9, 0, EVENTS),       /* step_tokens caps the rounds */
        run_scheduled(m, want, CAP, 64, 0, EVENTS),    /* nothing caps a round */
        run_scheduled(m, want, CAP, 16, fits, CAP),
        run_scheduled(m, want, 4, 7, fits + fits / 2, 5),
        run_scheduled(m, want, 4, 64, fits, 4),        /* the events cap the rounds */
    };
    /* with no cap, every round is tl_generate's */
    CHECK(runs[3].drafted_tokens == want->drafted && runs[3].accepted_tokens == want->accepted,
          "uncapped schedule drafted %llu, accepted %llu; tl_generate %zu, %zu",
          (unsigned long long)runs[3].drafted_tokens, (unsigned long long)runs[3].accepted_tokens, want->drafted,
          want->accepted);
    for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
        total->preemptions += runs[i].preemptions;
        total->drafted_tokens += runs[i].drafted_tokens;
        total->accepted_tokens += runs[i].accepted_tokens;
        total->mixed_passes += runs[i].mixed_passes;
    }
}

/* Whether a scheduler with this KV budget accepts every request. */
static int all_fit(tl_model* m, size_t budget) {
    tl_sched_params sp = tl_sched_params_default();
    sp.kv_budget_bytes = budget;
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, &sp, &s));
    int fits = s != NULL;
    for (int i = 0; i < N && fits; i++) {
        uint64_t id;
        fits = tl_sched_add(s, prompts[i], prompt_lengths[i], &params[i], &id) == TL_OK;
    }
    tl_sched_free(s);
    return fits;
}

/* The smallest budget that admits the largest request (what it could need alone). */
static size_t fitting_budget(tl_model* m) {
    size_t lo = 0, hi = 1024;
    while (!all_fit(m, hi)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        if (all_fit(m, mid)) hi = mid;
        else lo = mid;
    }
    return hi;
}

static void test_cancel(tl_model* m) {
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, NULL, &s));
    if (!s) return;
    tl_gen_params p = tl_gen_params_default();
    p.max_tokens = 8;
    uint64_t a, b, ids[32];
    int32_t tokens[32];
    uint8_t finish[32];
    size_t n = 0;
    CHECK_OK(tl_sched_add(s, prompts[0], prompt_lengths[0], &p, &a));
    CHECK_OK(tl_sched_add(s, prompts[2], prompt_lengths[2], &p, &b));
    CHECK(a >= 1 && b != a, "ids %llu, %llu", (unsigned long long)a, (unsigned long long)b);
    CHECK_OK(tl_sched_step(s, ids, tokens, finish, 32, &n));
    CHECK(n == 2, "first step emitted %zu", n);
    CHECK_OK(tl_sched_cancel(s, a));
    CHECK_STATUS(tl_sched_cancel(s, a), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "no request") != NULL, "message: %s", tl_last_error());
    for (int step = 0; step < 20; step++) {
        CHECK_OK(tl_sched_step(s, ids, tokens, finish, 32, &n));
        for (size_t e = 0; e < n; e++) CHECK(ids[e] == b, "cancelled request %llu emitted", (unsigned long long)a);
    }
    tl_sched_stats st = {.size = sizeof st};
    CHECK_OK(tl_sched_stats_get(s, &st));
    CHECK(st.cancelled == 1 && st.finished == 1 && st.running == 0, "cancel stats");
    uint64_t waiting;
    CHECK_OK(tl_sched_add(s, prompts[1], prompt_lengths[1], &p, &waiting));
    CHECK_OK(tl_sched_cancel(s, waiting));      /* never ran */
    tl_sched_free(s);                           /* frees what is left; ASan checks */
}

static int stop_now(void* user_data, int32_t token) {
    (void)user_data;
    (void)token;
    return 1;
}

static void test_bad_arguments(tl_model* m) {
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 8;
    sp.step_tokens = 4;
    tl_sched* s = (tl_sched*)1;
    CHECK_STATUS(tl_sched_create(m, &sp, &s), TL_ERR_INVALID_ARGUMENT);
    CHECK(s == NULL && strstr(tl_last_error(), "step_tokens 4 < max_batch 8"), "%s", tl_last_error());
    sp.size = 0;
    CHECK_STATUS(tl_sched_create(m, &sp, &s), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_sched_create(NULL, NULL, &s), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_sched_create(m, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    tl_sched_free(NULL);

    CHECK_OK(tl_sched_create(m, NULL, &s));
    uint64_t id = 7, ids[32];
    int32_t tokens[32];
    uint8_t finish[32];
    size_t n = 5;
    tl_gen_params p = tl_gen_params_default();
    p.on_token = stop_now;
    CHECK_STATUS(tl_sched_add(s, prompts[0], prompt_lengths[0], &p, &id), TL_ERR_INVALID_ARGUMENT);
    CHECK(id == 0 && strstr(tl_last_error(), "no callbacks"), "%s", tl_last_error());
    p = tl_gen_params_default();
    p.temperature = -1.0f;
    CHECK_STATUS(tl_sched_add(s, prompts[0], prompt_lengths[0], &p, &id), TL_ERR_INVALID_ARGUMENT);
    const int32_t bad[] = {1, (int32_t)V};
    CHECK_STATUS(tl_sched_add(s, bad, 2, NULL, &id), TL_ERR_OUT_OF_RANGE);
    CHECK_STATUS(tl_sched_add(s, bad, 0, NULL, &id), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_sched_add(s, bad, 1, NULL, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_sched_step(s, ids, tokens, finish, 31, &n), TL_ERR_INVALID_ARGUMENT);
    CHECK(n == 0 && strstr(tl_last_error(), "capacity 31 < max_batch 32"), "%s", tl_last_error());
    CHECK_STATUS(tl_sched_step(s, NULL, tokens, finish, 32, &n), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_sched_step(s, ids, tokens, finish, 32, &n));
    CHECK(n == 0, "an empty scheduler emitted %zu", n);
    tl_sched_stats st = {.size = 0};
    CHECK_STATUS(tl_sched_stats_get(s, &st), TL_ERR_INVALID_ARGUMENT);
    st.size = offsetof(tl_sched_stats, steps);  /* an older, shorter struct */
    st.steps = 12345;
    CHECK_OK(tl_sched_stats_get(s, &st));
    CHECK(st.size == offsetof(tl_sched_stats, steps) && st.running == 0 && st.waiting == 0 && st.steps == 12345,
          "a short struct is filled up to its size only");
    size_t n_depths = 99;
    uint64_t counts[2] = {7, 7};
    CHECK_STATUS(tl_sched_depth_counts(s, counts, 2, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_sched_depth_counts(s, NULL, 2, &n_depths), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_sched_depth_counts(s, NULL, 0, &n_depths));
    CHECK_OK(tl_sched_depth_counts(s, counts, 2, &n_depths));
    CHECK(n_depths == 0 && counts[0] == 7 && counts[1] == 7, "no decode pass yet: nothing counted or written");
    CHECK_OK(tl_sched_add(s, prompts[0], prompt_lengths[0], NULL, &id));
    tl_model_close(m);
    CHECK_STATUS(tl_sched_step(s, ids, tokens, finish, 32, &n), TL_ERR_CLOSED);
    CHECK_STATUS(tl_sched_add(s, prompts[0], prompt_lengths[0], NULL, &id), TL_ERR_CLOSED);
    tl_sched_free(s);
}

int main(void) {
    tu_spec spec = tu_spec_rich();
    spec.max_seq = 64;
    spec.eos = 2;
    V = spec.vocab;
    const char* path = tu_write_model("sched", &spec);
    /* with a prefix cache, a prompt's full blocks are shared once offered to it and count
       against its budget: the scheduler's budget preempts only without one */
    tl_sched_stats cached = {0}, uncached = {0}, speculative = {0}, separate = {0};
    for (size_t cache_bytes = 0; cache_bytes <= (1 << 20); cache_bytes += 1 << 20) {
        tl_model* m = tu_open_cached(path, cache_bytes);
        if (!m) return tu_finish("test_sched");
        for (uint64_t seed = 1; seed <= 12; seed++) {
            const int drafting = seed > 8, separate_passes = seed % 4 == 3;
            make_requests(seed, drafting ? seed > 10 : seed > 4, drafting);
            expected want;
            generate_alone(m, &want);
            tl_sched_stats* total = separate_passes ? &separate : drafting ? &speculative : cache_bytes ? &cached
                                                                                                       : &uncached;
            if (separate_passes) setenv("TINYLOOP_MIXED_PASS", "0", 1);
            run_schedules(m, &want, fitting_budget(m), total);
            unsetenv("TINYLOOP_MIXED_PASS");
            tl_model_prefix_cache_clear(m);
        }
        tl_model_free(m);
    }
    CHECK(uncached.preemptions > 0 && speculative.preemptions > 0, "no budget forced a preemption (%llu plain, "
          "%llu with speculative requests)", (unsigned long long)uncached.preemptions,
          (unsigned long long)speculative.preemptions);
    CHECK(cached.drafted_tokens == 0 && uncached.drafted_tokens == 0 && speculative.accepted_tokens > 0,
          "drafted %llu without speculative requests; accepted %llu with them",
          (unsigned long long)(cached.drafted_tokens + uncached.drafted_tokens),
          (unsigned long long)speculative.accepted_tokens);
    CHECK(cached.mixed_passes > 0 && uncached.mixed_passes > 0 && speculative.mixed_passes > 0 &&
          separate.mixed_passes == 0, "mixed passes: %llu, %llu, %llu; %llu with TINYLOOP_MIXED_PASS=0",
          (unsigned long long)cached.mixed_passes, (unsigned long long)uncached.mixed_passes,
          (unsigned long long)speculative.mixed_passes, (unsigned long long)separate.mixed_passes);
    tl_model* m = tu_open_cached(path, 1 << 20);
    if (!m) return tu_finish("test_sched");
    test_cancel(m);
    test_bad_arguments(m);
    tl_model_free(m);
    printf("test_sched: %llu preemptions without a prefix cache, %llu with one, %llu with speculative requests "
           "(%llu of %llu drafted tokens accepted); %llu mixed passes\n", (unsigned long long)uncached.preemptions,
           (unsigned long long)cached.preemptions, (unsigned long long)speculative.preemptions,
           (unsigned long long)speculative.accepted_tokens, (unsigned long long)speculative.drafted_tokens,
           (unsigned long long)(cached.mixed_passes + uncached.mixed_passes + speculative.mixed_passes));
    return tu_finish("test_sched");
}
