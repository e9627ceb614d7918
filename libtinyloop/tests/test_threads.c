/* test_threads.c — threads and scratch through the public API: two models (different files and
 * thread counts) sharing the process's worker threads, decoding from two threads at once, give
 * logits bit-identical to running them one after the other; tl_model_runtime reports each
 * model's own thread count, also above the number of cores; a child of fork() computes the same
 * logits with threads of its own; a decode step that needs no new KV block allocates nothing:
 * the forward pass reuses its sequence's scratch. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

enum { N_PROMPT = 13, N_DECODE = 12, ROUNDS = 3 };

typedef struct run {
    tl_model* model;
    uint32_t vocab;
    float* logits; /* [N_DECODE + 1][V]: after the prompt, then after each decoded token */
    tl_status status;
} run;

/* Prefill, then greedy decoding; every step's logits kept. */
static void* decode(void* arg) {
    run* r = arg;
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)((i * 29 + 5) % r->vocab);
    tl_seq* s = NULL;
    r->status = tl_seq_create(r->model, 0, 0, &s);
    if (r->status == TL_OK) r->status = tl_seq_prefill(s, prompt, N_PROMPT, 5, r->logits);
    for (size_t t = 0; t < N_DECODE && r->status == TL_OK; t++) {
        const float* last = r->logits + t * r->vocab;
        int32_t next = 0;
        for (uint32_t v = 1; v < r->vocab; v++)
            if (last[v] > last[next]) next = (int32_t)v;
        r->status = tl_seq_decode(s, next, r->logits + (t + 1) * r->vocab);
    }
    tl_seq_free(s);
    return NULL;
}

static run make_run(tl_model* m) {
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_OK(tl_model_config_get(m, &cfg));
    return (run){m, cfg.vocab_size, calloc((size_t)(N_DECODE + 1) * cfg.vocab_size, sizeof(float)), TL_OK};
}

static size_t n_logits(const run* r) { return (size_t)(N_DECODE + 1) * r->vocab; }

static void test_two_models_at_once(tl_model* a, tl_model* b) {
    run ref_a = make_run(a), ref_b = make_run(b);
    decode(&ref_a);
    decode(&ref_b);
    CHECK(ref_a.status == TL_OK && ref_b.status == TL_OK, "sequential runs: %s", tl_last_error());
    for (int round = 0; round < ROUNDS; round++) {
        run got_a = make_run(a), got_b = make_run(b);
        pthread_t ta, tb;
        pthread_create(&ta, NULL, decode, &got_a);
        pthread_create(&tb, NULL, decode, &got_b);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        CHECK(got_a.status == TL_OK && got_b.status == TL_OK, "round %d: status %d, %d", round, got_a.status,
              got_b.status);
        CHECK(tu_same_bits(got_a.logits, ref_a.logits, n_logits(&ref_a)), "round %d: model a's logits differ", round);
        CHECK(tu_same_bits(got_b.logits, ref_b.logits, n_logits(&ref_b)), "round %d: model b's logits differ", round);
        free(got_a.logits);
        free(got_b.logits);
    }
    free(ref_a.logits);
    free(ref_b.logits);
}

static void test_runtime_threads(tl_model* m, uint32_t want) {
    tl_model_runtime rt = {.size = sizeof rt};
    CHECK_OK(tl_model_runtime_get(m, &rt));
    CHECK(rt.n_threads == want, "runtime n_threads %u, want %u", rt.n_threads, want);
}

#if !defined(__SANITIZE_THREAD__) /* ThreadSanitizer does not follow a multi-threaded fork */
/* The child recomputes the logits (restarting the crew's threads) and exits 0 iff they match. */
static void test_fork(tl_model* m) {
    run ref = make_run(m);
    decode(&ref);
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        run got = make_run(m);
        decode(&got);
        _exit(got.status == TL_OK && tu_same_bits(got.logits, ref.logits, n_logits(&ref)) ? 0 : 1);
    }
    int wstatus = 0;
    CHECK(pid > 0 && waitpid(pid, &wstatus, 0) == pid, "fork/waitpid failed");
    CHECK(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0, "forked child: logits differ or it failed (status %d)",
          wstatus);
    run again = make_run(m); /* and the parent's crew still works */
    decode(&again);
    CHECK(again.status == TL_OK && tu_same_bits(again.logits, ref.logits, n_logits(&ref)), "parent after fork");
    free(again.logits);
    free(ref.logits);
}
#endif

static size_t allocs_so_far(void) {
    tl_memory_stats st = {.size = sizeof st};
    CHECK_OK(tl_memory_stats_get(&st));
    return st.total_allocs;
}

/* Block size 64: the steps below stay inside the sequence's first KV block. */
static void test_decode_allocates_nothing(const char* path) {
    tl_model* m = tu_open(path, 3, TL_ISA_AUTO, 64);
    run r = make_run(m);
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)(i * 3 + 1);
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, 0, 0, &s));
    CHECK_OK(tl_seq_prefill(s, prompt, N_PROMPT, 0, r.logits));
    CHECK_OK(tl_seq_decode(s, 1, r.logits)); /* the first step may grow the scratch */
    const size_t before = allocs_so_far();
    for (int32_t t = 0; t < 20; t++) CHECK_OK(tl_seq_decode(s, t, r.logits));
    CHECK(allocs_so_far() == before, "20 decode steps made %zu allocations", allocs_so_far() - before);
    tl_seq_free(s);
    free(r.logits);
    tl_model_free(m);
}

int main(void) {
    tu_spec sa = tu_spec_default();
    tu_spec sb = tu_spec_default();
    sb.int4 = 1, sb.group_size = 16, sb.vocab = 263, sb.seed = 7;
    tl_model* a = tu_open(tu_write_model("threads_a.tinyloop", &sa), 3, TL_ISA_AUTO, 4);
    tl_model* b = tu_open(tu_write_model("threads_b.tinyloop", &sb), 7, TL_ISA_AUTO, 0);
    test_runtime_threads(a, 3);
    test_runtime_threads(b, 7);
    test_two_models_at_once(a, b);
    test_decode_allocates_nothing(tu_write_model("threads_c.tinyloop", &sa));
#if !defined(__SANITIZE_THREAD__)
    test_fork(b);
#endif
    tl_model_free(a);
    tl_model_free(b);
    return tu_finish("test_threads");
}
