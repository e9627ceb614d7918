/* test_prefix_cache.c — the automatic prefix cache and batched generation through the public
 * API: tokens and logits equal those of a model without a cache (hits, misses, evictions under
 * a tiny budget, salts, depths, windows); the counters; clear and close; tl_generate_batch
 * against tl_generate / tl_generate_from_prefix request by request, and its validation. */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N_SYSTEM = 23, MAX_NEW = 6 };

static int32_t system_prompt[N_SYSTEM];
static uint32_t V;

static tl_model* open_with_cache(const char* path, size_t budget) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2;
    p.kv_block_size = 4;
    p.prefix_cache_bytes = budget;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &p, &m));
    return m;
}

static tl_prefix_cache_stats stats_of(tl_model* m) {
    tl_prefix_cache_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    CHECK_OK(tl_model_prefix_cache_stats(m, &s));
    return s;
}

typedef struct result {
    int32_t tokens[MAX_NEW];
    float* logits; /* [MAX_NEW][V] */
    size_t n;
} result;

static result run(tl_model* m, const int32_t* prompt, size_t n, const tl_gen_params* gp) {
    result r = {{0}, calloc((size_t)MAX_NEW * V, sizeof(float)), 0};
    CHECK_OK(tl_generate(m, prompt, n, gp, r.tokens, &r.n, r.logits));
    return r;
}

static void check_same(result a, result b, const char* what) {
    CHECK(a.n == b.n && memcmp(a.tokens, b.tokens, a.n * sizeof(int32_t)) == 0, "%s: tokens differ", what);
    CHECK(tu_same_bits(a.logits, b.logits, a.n * V), "%s: logits differ", what);
}

/* A workload of prompts sharing the system prompt, varied depth, window, salt and sampling:
 * every result equals the cache-less model's, at a large and at a tiny budget. */
static void test_results_unchanged(const char* path, size_t budget) {
    tl_model* plain = open_with_cache(path, 0);
    tl_model* cached = open_with_cache(path, budget);
    const char* salts[3] = {NULL, "alice", "bob"};
    uint64_t rng = 42;
    int32_t prompt[N_SYSTEM + 9];
    for (int i = 0; i < 40; i++) {
        const size_t keep = (size_t)tu_uniform(&rng, 1, N_SYSTEM), extra = (size_t)tu_uniform(&rng, 0, 9);
        memcpy(prompt, system_prompt, keep * sizeof(int32_t));
        for (size_t j = 0; j < extra; j++) prompt[keep + j] = tu_uniform(&rng, 0, (int32_t)V - 1);
        tl_gen_params gp = tl_gen_params_default();
        gp.max_tokens = (size_t)tu_uniform(&rng, 1, MAX_NEW);
        gp.loops = (uint32_t)tu_uniform(&rng, 1, 4);
        gp.cache_window = tu_uniform(&rng, 0, 2) == 2 ? 6 : 0;
        gp.prefill_chunk = (size_t)tu_uniform(&rng, 0, 7);
        gp.temperature = tu_uniform(&rng, 0, 1) ? 0.8f : 0.0f;
        gp.seed = tu_next(&rng);
        gp.cache_salt = salts[tu_uniform(&rng, 0, 2)];
        result got = run(cached, prompt, keep + extra, &gp), want = run(plain, prompt, keep + extra, &gp);
        check_same(got, want, "cached");
        free(got.logits);
        free(want.logits);
        const tl_prefix_cache_stats s = stats_of(cached);
        CHECK(s.bytes_in_use <= budget, "%zu bytes cached over a budget of %zu", s.bytes_in_use, budget);
    }
    const tl_prefix_cache_stats s = stats_of(cached);
    CHECK(s.lookups == 40 && s.hit_tokens > 0, "lookups %llu, hits %llu", (unsigned long long)s.lookups,
          (unsigned long long)s.hit_tokens);
    if (budget < 20000) CHECK(s.evicted_blocks > 0, "a tiny budget evicted nothing");
    tl_model_free(cached);
    tl_model_free(plain);
}

static void test_counters_salts_clear(const char* path) {
    tl_model* m = open_with_cache(path, 1 << 30);
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 1;
    int32_t out[1];
    size_t n;
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    tl_prefix_cache_stats s = stats_of(m);
    CHECK(s.blocks == 5 && s.inserted_blocks == 5 && s.hit_tokens == 0 && s.prefilled_tokens == N_SYSTEM,
          "first request: %zu blocks", s.blocks);
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    CHECK(stats_of(m).hit_tokens == 20, "repeat: %llu hit tokens", (unsigned long long)stats_of(m).hit_tokens);
    gp.cache_salt = "tenant";
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    CHECK(stats_of(m).hit_tokens == 20, "another salt shared blocks");
    CHECK_OK(tl_model_prefix_cache_clear(m));
    s = stats_of(m);
    CHECK(s.blocks == 0 && s.bytes_in_use == 0 && s.lookups == 3, "clear: %zu blocks", s.blocks);
    tl_model_close(m);
    CHECK_STATUS(tl_model_prefix_cache_stats(m, &s), TL_ERR_CLOSED);
    CHECK_STATUS(tl_model_prefix_cache_clear(m), TL_ERR_CLOSED);
    tl_model_free(m);
}

/* Mixed requests in one batch each equal their own tl_generate / tl_generate_from_prefix. */
static void test_batch(const char* path) {
    tl_model* m = open_with_cache(path, 1 << 20);
    tl_prefix* prefix = NULL;
    CHECK_OK(tl_prefix_build(m, system_prompt, 11, 4, 0, 3, &prefix));
    enum { N = 7 };
    tl_request req[N];
    tl_gen_params gp[N];
    result got[N];
    uint64_t rng = 7;
    for (int i = 0; i < N; i++) {
        gp[i] = tl_gen_params_default();
        gp[i].max_tokens = (size_t)tu_uniform(&rng, 1, MAX_NEW);
        gp[i].loops = (uint32_t)tu_uniform(&rng, 1, 4);
        gp[i].temperature = i % 2 ? 0.9f : 0.0f;
        gp[i].seed = (uint64_t)i;
        memset(&req[i], 0, sizeof req[i]);
        req[i].size = sizeof req[i];
        req[i].params = &gp[i];
        if (i >= 4) {
            req[i].prefix = prefix;  /* continuations: suffix of 0 .. 2 tokens */
            req[i].prompt = system_prompt + 11;
            req[i].n_prompt = (size_t)(i - 4);
        } else {
            gp[i].cache_window = i == 3 ? 5 : 0;
            req[i].prompt = system_prompt;
            req[i].n_prompt = (size_t)tu_uniform(&rng, 1, N_SYSTEM);
        }
        got[i] = (result){{0}, calloc((size_t)MAX_NEW * V, sizeof(float)), 0};
        req[i].out_tokens = got[i].tokens;
        req[i].out_logits = got[i].logits;
    }
    CHECK_OK(tl_generate_batch(m, req, N));
    for (int i = 0; i < N; i++) {
        got[i].n = req[i].n_out;
        result want = {{0}, calloc((size_t)MAX_NEW * V, sizeof(float)), 0};
        if (req[i].prefix)
            CHECK_OK(tl_generate_from_prefix(prefix, req[i].prompt, req[i].n_prompt, &gp[i], want.tokens,
                                             &want.n, want.logits));
        else
            CHECK_OK(tl_generate(m, req[i].prompt, req[i].n_prompt, &gp[i], want.tokens, &want.n, want.logits));
        check_same(got[i], want, "batch");
        free(want.logits);
    }

    /* validation: the first bad request is named, nothing runs */
    gp[2].top_p = 2.0f;
    CHECK_STATUS(tl_generate_batch(m, req, N), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "request 2: top_p") != NULL, "message: %s", tl_last_error());
    CHECK(req[5].n_out == 0, "a request ran although the batch was refused");
    gp[2].top_p = 1.0f;
    gp[5].loops = 5;
    CHECK_STATUS(tl_generate_batch(m, req, N), TL_ERR_LOOPS_MISMATCH);
    gp[5].loops = 1;
    req[1].size = 0;
    CHECK_STATUS(tl_generate_batch(m, req, N), TL_ERR_INVALID_ARGUMENT);
    req[1].size = sizeof req[1];
    CHECK_STATUS(tl_generate_batch(m, NULL, 1), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_generate_batch(m, NULL, 0));
    tl_model* other = open_with_cache(path, 0);
    CHECK_STATUS(tl_generate_batch(other, req, N), TL_ERR_WRONG_MODEL);
    tl_model_free(other);
    tl_model_close(m);
    CHECK_STATUS(tl_generate_batch(m, req, N), TL_ERR_CLOSED);
    for (int i = 0; i < N; i++) free(got[i].logits);
    tl_prefix_free(prefix);
    tl_model_free(m);
}

int main(void) {
    tu_spec spec = tu_spec_default();
    V = spec.vocab;
    const char* path = tu_write_model("pcache.tinyloop", &spec);
    uint64_t rng = 3;
    for (int i = 0; i < N_SYSTEM; i++) system_prompt[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    test_results_unchanged(path, (size_t)1 << 30);
    test_results_unchanged(path, 9000);
    test_counters_salts_clear(path);
    test_batch(path);
    return tu_finish("test_prefix_cache");
}
