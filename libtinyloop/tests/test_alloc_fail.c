/* test_alloc_fail.c — allocation-failure injection sweep. For each operation and each k below
 * the number of allocations a clean run makes, the k-th allocation fails. Every failure must
 * give TL_ERR_OUT_OF_MEMORY with "out of memory" in the message; failed or not (a best-effort
 * step such as filling the prefix cache may absorb one), the operation must free everything it
 * allocated (bytes_in_use back to the baseline; ASan checks the rest), leave a sequence
 * unchanged, and leave the model usable with unchanged results. Adaptive depth's requests (an
 * exit rule, alone, batched and scheduled) are swept too. An argument names the kernel path the
 * models open on ("avx2": each path repacks weights its own way at open; the test is skipped,
 * exit 77, on a CPU without it); none, the default path. */
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h" /* tl_alloc_fail_after: this test links the library's objects */
#include "test_util.h"

static const char* path;
static tl_isa isa = TL_ISA_AUTO;
static int32_t prompt[21];
static int32_t reference[8];

static tl_memory_stats memory(void) {
    tl_memory_stats st = {.size = sizeof st};
    tl_memory_stats_get(&st);
    return st;
}

static size_t in_use(void) { return memory().bytes_in_use; }

static tl_status greedy(tl_model* m, int32_t* out) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 8;
    gp.prefill_chunk = 5;
    size_t n;
    return tl_generate(m, prompt, 21, &gp, out, &n, NULL);
}

typedef tl_status (*op_fn)(tl_model* m);

static tl_status op_open(tl_model* unused) {
    (void)unused;
    tl_model_params p = tl_model_params_default();
    p.isa = isa;
    p.n_threads = 3;
    tl_model* m = NULL;
    tl_status st = tl_model_open(path, &p, &m);
    tl_model_free(m);
    return st;
}

static tl_status op_prefill_decode(tl_model* m) {
    tl_seq* s = NULL;
    float logits[256];
    tl_status st = tl_seq_create(m, 2, 7, &s);
    if (st == TL_OK) st = tl_seq_prefill(s, prompt, 21, 4, logits);
    if (st == TL_OK) st = tl_seq_decode(s, 3, logits);
    if (st != TL_OK && s) CHECK(tl_seq_length(s) == 0 || tl_seq_length(s) == 21, "partial prefill left behind");
    tl_seq_free(s);
    return st;
}

static tl_status op_fork(tl_model* m) {
    tl_seq* s = NULL;
    tl_seq* f = NULL;
    tl_status st = tl_seq_create(m, 0, 0, &s);
    if (st == TL_OK) st = tl_seq_prefill(s, prompt, 10, 0, NULL);
    if (st == TL_OK) st = tl_seq_fork(s, &f);
    if (st == TL_OK) st = tl_seq_decode(f, 1, NULL);
    tl_seq_free(f);
    tl_seq_free(s);
    return st;
}

static tl_status op_prefix(tl_model* m) {
    tl_prefix* p = NULL;
    tl_seq* s = NULL;
    int32_t out[8];
    size_t n;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    gp.temperature = 0.7f;
    tl_status st = tl_prefix_build(m, prompt, 15, 3, 0, 6, &p);
    if (st == TL_OK) st = tl_seq_from_prefix(p, 2, &s);
    if (st == TL_OK) st = tl_generate_from_prefix(p, prompt + 15, 3, &gp, out, &n, NULL);
    tl_seq_free(s);
    tl_prefix_free(p);
    return st;
}

/* A hidden-state prefix (h4, windowed): built, a sequence and a generation from it (each
 * rebuilding its KV from the rows), saved and loaded back (a version-2 blob). */
static tl_status op_hidden_prefix(tl_model* m) {
    tl_prefix* p = NULL;
    tl_prefix* q = NULL;
    tl_seq* s = NULL;
    int32_t out[8];
    size_t n = 0;
    uint8_t* bytes = NULL;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    gp.cache_window = 6;
    tl_status st = tl_prefix_build_ex(m, prompt, 15, 2, 6, 4, TL_PREFIX_STORE_H4, &p);
    if (st == TL_OK) st = tl_seq_from_prefix(p, 1, &s);
    if (st == TL_OK) st = tl_generate_from_prefix(p, prompt + 15, 3, &gp, out, &n, NULL);
    if (st == TL_OK) st = tl_prefix_save(p, NULL, 0, &n);
    if (st == TL_OK && !(bytes = malloc(n))) st = TL_ERR_OUT_OF_MEMORY;
    if (st == TL_OK) st = tl_prefix_save(p, bytes, n, &n);
    if (st == TL_OK) st = tl_prefix_load(m, bytes, n, &q);
    free(bytes);
    tl_prefix_free(q);
    tl_seq_free(s);
    tl_prefix_free(p);
    return st;
}

static uint8_t* blob; /* of a warm-start prefix with a window, saved in main */
static size_t blob_bytes;

/* The blob loaded, generated from and saved again (to the same bytes). */
static tl_status op_prefix_blob(tl_model* m) {
    tl_prefix* p = NULL;
    uint8_t* again = malloc(blob_bytes);
    int32_t out[8];
    size_t n;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    gp.cache_window = 6;
    tl_status st = tl_prefix_load(m, blob, blob_bytes, &p);
    if (st == TL_OK) st = tl_generate_from_prefix(p, prompt + 15, 3, &gp, out, &n, NULL);
    if (st == TL_OK) st = tl_prefix_save(p, again, blob_bytes, &n);
    if (st == TL_OK) CHECK(n == blob_bytes && memcmp(again, blob, n) == 0, "the loaded prefix saves other bytes");
    free(again);
    tl_prefix_free(p);
    return st;
}

static tl_status op_generate(tl_model* m) {
    int32_t out[8];
    return greedy(m, out);
}

/* Request 0 alone, then requests 0 .. n-1 in one batch (request i: params[i] on the first
 * lengths[i] tokens of the prompt, 8 tokens each); whenever a call succeeds, request i's tokens
 * are want[i]. */
static tl_status alone_then_batched(tl_model* m, const tl_gen_params* params, const size_t* lengths,
                                    const int32_t* const* want, size_t n_requests, const char* what) {
    int32_t out[3][8];
    tl_request req[3];
    tl_request* batch[3];
    size_t n;
    tl_status st = tl_generate(m, prompt, lengths[0], &params[0], out[0], &n, NULL);
    if (st == TL_OK) CHECK(n == 8 && memcmp(out[0], want[0], sizeof out[0]) == 0, "%s tokens differ", what);
    if (st != TL_OK) return st;
    for (size_t i = 0; i < n_requests; i++) {
        req[i] = (tl_request){sizeof req[i], NULL, prompt, lengths[i], &params[i], out[i], NULL, 0};
        batch[i] = &req[i];
    }
    st = tl_generate_batch(m, batch, n_requests);
    for (size_t i = 0; st == TL_OK && i < n_requests; i++)
        CHECK(memcmp(out[i], want[i], sizeof out[i]) == 0, "%s batch request %zu's tokens differ", what, i);
    return st;
}

/* greedy's 8 tokens with prefill chunks of 5 under `rule` at threshold q. */
static tl_gen_params eight_tokens(uint32_t rule, float q) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 8;
    gp.prefill_chunk = 5;
    gp.exit_rule = rule;
    gp.exit_threshold = q;
    return gp;
}

/* greedy's request decoded speculatively (drafts at depth 1, rounds of 4 rows over blocks of
 * 4), alone and in a batch beside a plain request; whenever it succeeds, the tokens are
 * greedy's. */
static tl_status op_speculative(tl_model* m) {
    tl_gen_params params[2] = {eight_tokens(TL_EXIT_NONE, 0.0f), eight_tokens(TL_EXIT_NONE, 0.0f)};
    params[0].draft_loops = 1;
    params[0].n_draft = 4;
    const size_t lengths[2] = {21, 21};
    const int32_t* want[2] = {reference, reference};
    return alone_then_batched(m, params, lengths, want, 2, "speculative");
}

/* greedy's request under the latent rule with a threshold no state change stays under (every
 * decoded token exits after iteration 0, its KV copied into the deeper slots), alone and in a
 * batch beside greedy's plain request and one under the kl rule at q = 1e30 (every decoded
 * token probed after iterations 0 and 1, and exiting with the second probe); whenever it
 * succeeds, the tokens are their own. */
static int32_t adaptive_reference[8], kl_reference[8];

static tl_status op_adaptive(tl_model* m) {
    const tl_gen_params params[3] = {eight_tokens(TL_EXIT_LATENT, 1e30f), eight_tokens(TL_EXIT_NONE, 0.0f),
                                     eight_tokens(TL_EXIT_KL, 1e30f)};
    const size_t lengths[3] = {21, 21, 17};
    const int32_t* want[3] = {adaptive_reference, reference, kl_reference};
    return alone_then_batched(m, params, lengths, want, 3, "adaptive");
}

/* Three requests in one batch: two prompts and a prefix continuation. */
static tl_status batch_of_three(tl_model* m, const tl_prefix* p) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    int32_t out[3][4];
    tl_request req[3];
    tl_request* batch[3] = {&req[0], &req[1], &req[2]};
    memset(req, 0, sizeof req);
    for (int i = 0; i < 3; i++) {
        req[i].size = sizeof req[i];
        req[i].params = &gp;
        req[i].out_tokens = out[i];
        req[i].prompt = prompt;
        req[i].n_prompt = (size_t)(9 + 5 * i);
    }
    req[2].prefix = p;
    req[2].n_prompt = p ? 2 : req[2].n_prompt;
    return tl_generate_batch(m, batch, 3);
}

static tl_status op_batch(tl_model* m) {
    tl_prefix* p = NULL;
    tl_status st = tl_prefix_build(m, prompt, 12, 0, 0, 0, &p);
    if (st == TL_OK) st = batch_of_three(m, p);
    tl_prefix_free(p);
    return st;
}

/* A model with an automatic prefix cache: a miss that fills it, a hit, a batch through it;
 * the model (and its cache) is freed at the end. */
static tl_status op_cached(tl_model* unused) {
    (void)unused;
    tl_model_params p = tl_model_params_default();
    p.isa = isa;
    p.n_threads = 2;
    p.kv_block_size = 4;
    p.prefix_cache_bytes = 1 << 20;
    tl_model* m = NULL;
    int32_t out[8];
    tl_status st = tl_model_open(path, &p, &m);
    if (st == TL_OK) st = greedy(m, out);
    if (st == TL_OK) st = greedy(m, out);
    if (st == TL_OK) CHECK(memcmp(out, reference, sizeof out) == 0, "cached results differ");
    if (st == TL_OK) st = batch_of_three(m, NULL);
    tl_model_free(m);
    return st;
}

/* The three requests op_sched runs: prompt[0 .. 21 - 4i), 8 greedy tokens, the second one
 * decoding speculatively (rounds of 3 drafted at depth 1), the third under op_adaptive's exit
 * rule; their tokens alone, decoded plainly (the third under its rule). */
static int32_t sched_reference[3][8];

static tl_gen_params sched_params(size_t i) {
    tl_gen_params gp = i == 2 ? eight_tokens(TL_EXIT_LATENT, 1e30f) : tl_gen_params_default();
    gp.max_tokens = 8;
    if (i == 1) gp.draft_loops = 1, gp.n_draft = 3;
    return gp;
}

static void sched_references(tl_model* m) {
    for (size_t i = 0; i < 3; i++) {
        tl_gen_params gp = sched_params(i);
        gp.n_draft = 0;
        size_t n;
        CHECK_OK(tl_generate(m, prompt, 21 - 4 * i, &gp, sched_reference[i], &n, NULL));
    }
}

/* A scheduler running three requests; a step that fails is retried, as tl_sched_step allows,
 * and every request must still get its tokens alone. */
static tl_status op_sched(tl_model* m) {
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 4;
    sp.step_tokens = 8;
    tl_sched* s = NULL;
    tl_status first = tl_sched_create(m, &sp, &s);
    uint64_t ids_added[3] = {0};
    for (size_t i = 0; i < 3 && first == TL_OK; i++) {
        const tl_gen_params gp = sched_params(i);
        first = tl_sched_add(s, prompt, 21 - 4 * i, &gp, &ids_added[i]);
    }
    int32_t got[3][8];
    size_t n_got[3] = {0};
    for (int step = 0; first == TL_OK && step < 100; step++) {
        uint64_t ids[8];
        int32_t tokens[8];
        uint8_t finish[8];
        size_t n = 0;
        const tl_status st = tl_sched_step(s, ids, tokens, finish, 8, &n);  /* a failure: retried */
        CHECK(st == TL_OK || st == TL_ERR_OUT_OF_MEMORY, "scheduler step: status %d: %s", st, tl_last_error());
        for (size_t e = 0; e < n; e++)
            for (size_t i = 0; i < 3; i++)
                if (ids[e] == ids_added[i] && n_got[i] < 8) got[i][n_got[i]++] = tokens[e];
        tl_sched_stats stats = {.size = sizeof stats};
        CHECK_OK(tl_sched_stats_get(s, &stats));
        if (stats.running + stats.waiting == 0) break;
    }
    for (size_t i = 0; i < 3 && first == TL_OK; i++)
        CHECK(n_got[i] == 8 && memcmp(got[i], sched_reference[i], sizeof got[i]) == 0,
              "scheduled request %zu: tokens differ", i);
    tl_sched_free(s);
    return first;
}

static void sweep(const char* name, op_fn op, tl_model* m) {
    const size_t baseline = in_use(), before = memory().total_allocs;
    CHECK_OK(op(m));
    const size_t n_allocs = memory().total_allocs - before;
    int failures = 0;
    for (size_t k = 0; k < n_allocs && tu_failures <= 10; k++) {
        tl_alloc_fail_after((int64_t)k);
        const tl_status st = op(m);
        tl_alloc_fail_after(-1);
        if (st != TL_OK) {
            failures++;
            CHECK(st == TL_ERR_OUT_OF_MEMORY, "%s, k=%zu: status %d: %s", name, k, st, tl_last_error());
            CHECK(strstr(tl_last_error(), "out of memory") != NULL, "%s, k=%zu: message %s", name, k, tl_last_error());
        }
        CHECK(in_use() == baseline, "%s, k=%zu: %zu bytes leaked", name, k, in_use() - baseline);
        if (m) {
            int32_t out[8];
            CHECK_OK(greedy(m, out));
            CHECK(memcmp(out, reference, sizeof out) == 0, "%s, k=%zu: model results changed", name, k);
        }
    }
    printf("%s: %zu allocations, %d injected failures reported\n", name, n_allocs, failures);
}

int main(int argc, char** argv) {
    if (argc > 1) {
        CHECK(strcmp(argv[1], "avx2") == 0, "unknown kernel path argument");
        isa = TL_ISA_AVX2;
        if (!tl_cpu_supports(isa)) return 77;
    }
    tu_spec spec = tu_spec_default();
    spec.int4 = 1;
    spec.group_size = 8;
    path = tu_write_model("alloc.tinyloop", &spec);
    for (int i = 0; i < 21; i++) prompt[i] = (i * 37 + 11) % 256;
    tl_model* m = tu_open(path, 2, isa, 4);
    CHECK_OK(greedy(m, reference));
    const tl_gen_params adaptive = eight_tokens(TL_EXIT_LATENT, 1e30f);
    size_t n_adaptive;
    CHECK_OK(tl_generate(m, prompt, 21, &adaptive, adaptive_reference, &n_adaptive, NULL));
    const tl_gen_params kl = eight_tokens(TL_EXIT_KL, 1e30f);
    CHECK_OK(tl_generate(m, prompt, 17, &kl, kl_reference, &n_adaptive, NULL));
    sched_references(m);
    sweep("open", op_open, NULL);
    sweep("prefill+decode", op_prefill_decode, m);
    sweep("fork", op_fork, m);
    sweep("prefix", op_prefix, m);
    sweep("hidden-state prefix", op_hidden_prefix, m);
    tl_prefix* saved = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, 15, 2, 6, 0, TL_PREFIX_WARM_START, &saved));
    CHECK_OK(tl_prefix_save(saved, NULL, 0, &blob_bytes));
    blob = malloc(blob_bytes);
    CHECK_OK(tl_prefix_save(saved, blob, blob_bytes, &blob_bytes));
    tl_prefix_free(saved);
    sweep("prefix blob", op_prefix_blob, m);
    free(blob);
    sweep("generate", op_generate, m);
    sweep("batch", op_batch, m);
    sweep("speculative", op_speculative, m);
    sweep("adaptive", op_adaptive, m);
    sweep("prefix cache", op_cached, NULL);
    sweep("scheduler", op_sched, m);
    tl_model_free(m);
    return tu_finish("test_alloc_fail");
}
