/* test_sched.c — the continuous-batching scheduler from a C host. Requests sharing a prefix,
 * with stop sequences, salts, sampling and depths, added at different steps to schedulers of
 * several batch sizes, step budgets and KV budgets (down to one that forces preemption), each
 * get exactly tl_generate's tokens, and their finish codes say why they ended; a cancelled
 * request emits nothing more; the counters add up; bad arguments, callbacks, a too small
 * event array and a closed model are refused with the right status. */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N = 6, MAX_NEW = 9, SHARED = 24, PROMPT_MAX = SHARED + 12, CAP = 16 };

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
} expected;

/* Requests of seed; `decode_heavy`: prompts of 2 tokens decoding MAX_NEW tokens each, so the
 * decodes outgrow what admission foresaw and a tight budget must preempt. */
static void make_requests(uint64_t seed, int decode_heavy) {
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
    }
}

static void generate_alone(tl_model* m, expected* want) {
    for (int i = 0; i < N; i++)
        CHECK_OK(tl_generate(m, prompts[i], prompt_lengths[i], &params[i], want->tokens[i], &want->n[i], NULL));
}

/* Run every request through a scheduler, request i added at step i % 3; check its tokens and
 * finish code against `want`. Returns the scheduler's preemptions. */
static uint64_t run_scheduled(tl_model* m, const expected* want, size_t max_batch, size_t step_tokens, size_t budget) {
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = max_batch;
    sp.step_tokens = step_tokens;
    sp.kv_budget_bytes = budget;
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, &sp, &s));
    if (!s) return 0;
    uint64_t ids[N] = {0}, ev_ids[CAP];
    int32_t got[N][MAX_NEW], ev_tokens[CAP];
    uint8_t ev_finish[CAP], finish[N] = {0};
    size_t n_got[N] = {0}, n_events = 0, added = 0;
    for (int step = 0; step < 1000; step++) {
        for (int i = 0; i < N; i++)
            if (i % 3 == step) {
                CHECK_OK(tl_sched_add(s, prompts[i], prompt_lengths[i], &params[i], &ids[i]));
                added++;
            }
        CHECK_OK(tl_sched_step(s, ev_ids, ev_tokens, ev_finish, CAP, &n_events));
        for (size_t e = 0; e < n_events; e++) {
            int i = 0;
            while (i < N && ids[i] != ev_ids[e]) i++;
            CHECK(i < N && !finish[i] && n_got[i] < MAX_NEW, "event for unknown or finished request %llu",
                  (unsigned long long)ev_ids[e]);
            if (i == N || finish[i] || n_got[i] == MAX_NEW) continue;
            got[i][n_got[i]++] = ev_tokens[e];
            finish[i] = ev_finish[e];
        }
        tl_sched_stats st = {.size = sizeof st};
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
    tl_sched_stats st = {.size = sizeof st};
    CHECK_OK(tl_sched_stats_get(s, &st));
    size_t emitted = 0;
    for (int i = 0; i < N; i++) emitted += want->n[i];
    CHECK(st.finished == N && st.cancelled == 0 && st.generated_tokens == emitted && st.kv_bytes == 0,
          "stats: finished %llu, generated %llu of %zu, kv %zu", (unsigned long long)st.finished,
          (unsigned long long)st.generated_tokens, emitted, st.kv_bytes);
    tl_sched_free(s);
    return st.preemptions;
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
    uint64_t preemptions_cached = 0, preemptions = 0;
    for (size_t cache_bytes = 0; cache_bytes <= (1 << 20); cache_bytes += 1 << 20) {
        tl_model* m = tu_open_cached(path, cache_bytes);
        if (!m) return tu_finish("test_sched");
        uint64_t* preempted = cache_bytes ? &preemptions_cached : &preemptions;
        for (uint64_t seed = 1; seed <= 8; seed++) {
            make_requests(seed, seed > 4);
            expected want;
            generate_alone(m, &want);
            const size_t fits = fitting_budget(m);
            run_scheduled(m, &want, 1, 1, 0);
            run_scheduled(m, &want, 4, 4, 0);
            run_scheduled(m, &want, 3, 9, 0);
            run_scheduled(m, &want, CAP, 64, 0);
            *preempted += run_scheduled(m, &want, CAP, 16, fits);
            *preempted += run_scheduled(m, &want, 4, 7, fits + fits / 2);
            tl_model_prefix_cache_clear(m);
        }
        tl_model_free(m);
    }
    CHECK(preemptions > 0, "no budget forced a preemption");
    tl_model* m = tu_open_cached(path, 1 << 20);
    if (!m) return tu_finish("test_sched");
    test_cancel(m);
    test_bad_arguments(m);
    tl_model_free(m);
    printf("test_sched: %llu preemptions without a prefix cache, %llu with one\n",
           (unsigned long long)preemptions, (unsigned long long)preemptions_cached);
    return tu_finish("test_sched");
}
