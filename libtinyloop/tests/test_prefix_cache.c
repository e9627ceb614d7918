/* test_prefix_cache.c — the automatic prefix cache and batched generation.
 *
 * Through the public API, on a model without a coda and one with (whose tree is per depth):
 * tokens and logits equal those of a model without a cache (hits, misses, evictions under a
 * tiny budget, salts, depths, windows); which depths a cached block serves; the counters; clear and
 * close, and a request still running at close adds nothing afterwards; tl_generate_batch
 * against tl_generate / tl_generate_from_prefix request by request, and its validation;
 * tl_prefix_build's length check. Directly on the cache (this test links the library's
 * objects): the eviction order after every operation equals a plain reference model's, and
 * an eviction visits O(1) nodes, not the whole cache. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/prefix_cache.h"
#include "test_util.h"

enum { N_SYSTEM = 23, MAX_NEW = 6 };

static int32_t system_prompt[N_SYSTEM];
static uint32_t V;

/* A workload of prompts sharing the system prompt, varied depth, window, salt and sampling:
 * every result equals the cache-less model's, at a large and at a tiny budget. */
static void test_results_unchanged(const char* path, size_t budget) {
    tl_model* plain = tu_open_cached(path, 0);
    tl_model* cached = tu_open_cached(path, budget);
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
        tu_result got = tu_generate(cached, prompt, keep + extra, &gp, V);
        tu_result want = tu_generate(plain, prompt, keep + extra, &gp, V);
        CHECK(tu_same_result(&got, &want), "cached: tokens or logits differ");
        tu_result_free(&got);
        tu_result_free(&want);
        const tl_prefix_cache_stats s = tu_cache_stats(cached);
        CHECK(s.bytes_in_use <= budget, "%zu bytes cached over a budget of %zu", s.bytes_in_use, budget);
    }
    const tl_prefix_cache_stats s = tu_cache_stats(cached);
    CHECK(s.lookups == 40 && s.hit_tokens > 0, "lookups %llu, hits %llu", (unsigned long long)s.lookups,
          (unsigned long long)s.hit_tokens);
    if (budget < 20000) CHECK(s.evicted_blocks > 0, "a tiny budget evicted nothing");
    tl_model_free(cached);
    tl_model_free(plain);
}

static void test_counters_salts_clear(const char* path) {
    tl_model* m = tu_open_cached(path, 1 << 30);
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 1;
    int32_t out[1];
    size_t n;
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    tl_prefix_cache_stats s = tu_cache_stats(m);
    CHECK(s.blocks == 5 && s.inserted_blocks == 5 && s.hit_tokens == 0 && s.prefilled_tokens == N_SYSTEM,
          "first request: %zu blocks", s.blocks);
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    CHECK(tu_cache_stats(m).hit_tokens == 20, "repeat: %llu hit tokens",
          (unsigned long long)tu_cache_stats(m).hit_tokens);
    gp.cache_salt = "tenant";
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL));
    CHECK(tu_cache_stats(m).hit_tokens == 20, "another salt shared blocks");
    CHECK_OK(tl_model_prefix_cache_clear(m));
    s = tu_cache_stats(m);
    CHECK(s.blocks == 0 && s.bytes_in_use == 0 && s.lookups == 3, "clear: %zu blocks", s.blocks);
    tl_model_close(m);
    CHECK_STATUS(tl_model_prefix_cache_stats(m, &s), TL_ERR_CLOSED);
    CHECK_STATUS(tl_model_prefix_cache_clear(m), TL_ERR_CLOSED);
    tl_model_free(m);
}

/* Mixed requests in one batch each equal their own tl_generate / tl_generate_from_prefix. */
static void test_batch(const char* path) {
    tl_model* m = tu_open_cached(path, 1 << 20);
    tl_prefix* prefix = NULL;
    CHECK_OK(tl_prefix_build(m, system_prompt, 11, 4, 0, 3, &prefix));
    enum { N = 7 };
    tl_request req[N];
    tl_request* batch[N];
    tl_gen_params gp[N];
    tu_result got[N];
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
        got[i] = tu_result_new(MAX_NEW, V);
        req[i].out_tokens = got[i].tokens;
        req[i].out_logits = got[i].logits;
        batch[i] = &req[i];
    }
    CHECK_OK(tl_generate_batch(m, batch, N));
    for (int i = 0; i < N; i++) {
        got[i].n = req[i].n_out;
        tu_result want = req[i].prefix ? tu_from_prefix(prefix, req[i].prompt, req[i].n_prompt, &gp[i], V)
                                       : tu_generate(m, req[i].prompt, req[i].n_prompt, &gp[i], V);
        CHECK(tu_same_result(&got[i], &want), "batch, request %d: tokens or logits differ", i);
        tu_result_free(&want);
    }

    /* validation: the first bad request is named, nothing runs */
    gp[2].top_p = 2.0f;
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "request 2: top_p") != NULL, "message: %s", tl_last_error());
    CHECK(req[5].n_out == 0, "a request ran although the batch was refused");
    gp[2].top_p = 1.0f;
    gp[5].loops = 5;
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_LOOPS_MISMATCH);
    gp[5].loops = 1;
    req[1].size = 0;
    req[0].n_out = 99;
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "request 1: size 0 is less than sizeof(tl_request)") != NULL, "message: %s",
          tl_last_error());
    CHECK(req[0].n_out == 99, "a refused layout still wrote n_out");
    req[1].size = sizeof req[1];
    batch[3] = NULL;
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "request 3 is NULL") != NULL, "message: %s", tl_last_error());
    batch[3] = &req[3];
    CHECK_STATUS(tl_generate_batch(m, NULL, 1), TL_ERR_INVALID_ARGUMENT);
    CHECK_OK(tl_generate_batch(m, NULL, 0));
    tl_model* other = tu_open_cached(path, 0);
    CHECK_STATUS(tl_generate_batch(other, batch, N), TL_ERR_WRONG_MODEL);
    tl_model_free(other);
    tl_model_close(m);
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_CLOSED);
    for (int i = 0; i < N; i++) tu_result_free(&got[i]);
    tl_prefix_free(prefix);
    tl_model_free(m);
}

/* A block cached at depth 3 serves a request at depth 2 when the model has no coda (depth
 * nesting); with a coda it serves depth 3 alone (its coda slots hold depth 3's KV). */
static void test_depth_trees(const char* path, int coda) {
    tl_model* m = tu_open_cached(path, 1 << 30);
    tl_model* plain = tu_open_cached(path, 0);
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 3;
    gp.loops = 3;
    tu_result deep = tu_generate(m, system_prompt, N_SYSTEM, &gp, V);
    tu_result want_deep = tu_generate(plain, system_prompt, N_SYSTEM, &gp, V);
    CHECK(tu_same_result(&deep, &want_deep), "depth 3: tokens or logits differ");
    gp.loops = 2;
    const tl_prefix_cache_stats before = tu_cache_stats(m);
    tu_result shallow = tu_generate(m, system_prompt, N_SYSTEM, &gp, V);
    tu_result want = tu_generate(plain, system_prompt, N_SYSTEM, &gp, V);
    CHECK(tu_same_result(&shallow, &want), "depth 2 after depth 3: tokens or logits differ");
    const tl_prefix_cache_stats after = tu_cache_stats(m);
    CHECK(after.hit_tokens - before.hit_tokens == (coda ? 0u : 20u),
          "coda %d: depth 2 reused %llu tokens of depth 3", coda,
          (unsigned long long)(after.hit_tokens - before.hit_tokens));
    CHECK(after.blocks == (coda ? 10u : 5u), "coda %d: %zu blocks cached", coda, after.blocks);
    tu_result_free(&deep);
    tu_result_free(&want_deep);
    tu_result_free(&shallow);
    tu_result_free(&want);
    tl_model_free(m);
    tl_model_free(plain);
}

/* ---- a request running while its model is closed ---------------------------------------- */

typedef struct rendezvous {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int phase; /* 1: the prompt has run; 2: the model is closed */
    tl_model* model;
    tl_status status;
} rendezvous;

static void advance(rendezvous* r, int phase) {
    pthread_mutex_lock(&r->lock);
    r->phase = phase;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
}

static void wait_for(rendezvous* r, int phase) {
    pthread_mutex_lock(&r->lock);
    while (r->phase < phase) pthread_cond_wait(&r->cond, &r->lock);
    pthread_mutex_unlock(&r->lock);
}

/* After the last prompt chunk, just before the prompt's blocks are offered to the cache. */
static int hold_until_closed(void* user, size_t done, size_t total) {
    if (done == total) {
        advance(user, 1);
        wait_for(user, 2);
    }
    return 0;
}

static void* generate_through_close(void* arg) {
    rendezvous* r = arg;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 3;
    gp.on_prefill = hold_until_closed;
    gp.user_data = r;
    int32_t out[3];
    size_t n;
    r->status = tl_generate(r->model, system_prompt, N_SYSTEM, &gp, out, &n, NULL);
    return NULL;
}

/* A sequence keeps the closed model's engine (and its cache) alive; the request that ran
 * through the close must not have put its blocks back into the cache: every byte it took is
 * returned when it ends. */
static void test_no_insert_after_close(const char* path) {
    tl_model* m = tu_open_cached(path, 1 << 20);
    tl_seq* keeper = NULL;
    CHECK_OK(tl_seq_create(m, 1, 0, &keeper));
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 3;
    int32_t out[3];
    size_t n;
    CHECK_OK(tl_generate(m, system_prompt, N_SYSTEM, &gp, out, &n, NULL)); /* warm, then empty */
    CHECK_OK(tl_model_prefix_cache_clear(m));
    const size_t baseline = tu_memory().bytes_in_use;
    rendezvous r = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, m, TL_OK};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, generate_through_close, &r) == 0, "pthread_create");
    wait_for(&r, 1);
    tl_model_close(m);
    advance(&r, 2);
    pthread_join(thread, NULL);
    CHECK(r.status == TL_OK || r.status == TL_ERR_CLOSED, "the request ended with status %d", r.status);
    const size_t after = tu_memory().bytes_in_use;
    CHECK(after == baseline, "%zu bytes still held after the request ended (blocks cached after close)",
          after - baseline);
    tl_seq_free(keeper);
    tl_model_free(m);
}

/* One token too many says so; a huge n says so too (it is refused before anything is
 * allocated or read, where it used to fail as "out of memory"). */
static void test_prefix_build_checks_length_first(const char* path) {
    tl_model* m = tu_open_cached(path, 0);
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_OK(tl_model_config_get(m, &cfg));
    const size_t too_long = (size_t)cfg.max_seq_len + 1;
    int32_t* tokens = calloc(too_long, sizeof(int32_t));
    const size_t lengths[] = {too_long, (size_t)1 << 40, SIZE_MAX};
    for (int i = 0; i < 3; i++) {
        tl_prefix* p = NULL;
        CHECK_STATUS(tl_prefix_build(m, tokens, lengths[i], 0, 0, 0, &p), TL_ERR_SEQ_TOO_LONG);
        char want[96];
        snprintf(want, sizeof want, "sequence length %zu exceeds max_seq_len %u", lengths[i], cfg.max_seq_len);
        CHECK(strstr(tl_last_error(), want) != NULL, "n = %zu: %s", lengths[i], tl_last_error());
        CHECK(p == NULL, "a prefix came back");
    }
    free(tokens);
    tl_model_free(m);
}

/* ---- the cache itself against a reference model ------------------------------------------- */

enum { BS = 2, MAX_REF = 64, MAX_PROMPT = 11, N_SLOTS = 6, N_KEYS = 6 };

/* The policy, written plainly: nodes in an array, found by scanning; a call's tick marks what
 * it touched; the victim is the leaf with the smallest tick whose block only the cache holds. */
typedef struct ref_node {
    int live, parent, key; /* parent -1: a child of the key's root */
    int32_t tokens[BS];
    const tl_kv_block* block;
    size_t bytes;
    uint32_t n_layers;
    uint64_t last_used;
    int n_children;
} ref_node;

typedef struct ref_cache {
    ref_node nodes[MAX_REF];
    size_t budget, bytes;
    uint64_t tick, evicted;
} ref_cache;

static int ref_find(const ref_cache* r, int key, int parent, const int32_t* tokens) {
    for (int i = 0; i < MAX_REF; i++) {
        const ref_node* x = &r->nodes[i];
        if (x->live && x->key == key && x->parent == parent && memcmp(x->tokens, tokens, sizeof x->tokens) == 0)
            return i;
    }
    return -1;
}

static int ref_depth(const ref_cache* r, int i) {
    int d = 0;
    for (; i >= 0; i = r->nodes[i].parent) d++;
    return d;
}

static void ref_remove(ref_cache* r, int i) {
    ref_node* x = &r->nodes[i];
    if (x->parent >= 0) r->nodes[x->parent].n_children--;
    r->bytes -= x->bytes;
    x->live = 0;
}

static bool ref_make_room(ref_cache* r, size_t extra) {
    if (extra > r->budget) return false;
    while (r->bytes > r->budget - extra) {
        int victim = -1, ties = 0;
        for (int i = 0; i < MAX_REF; i++) {
            const ref_node* x = &r->nodes[i];
            if (!x->live || x->n_children || x->last_used == r->tick || tl_kv_block_refs(x->block) != 1) continue;
            if (victim < 0 || x->last_used < r->nodes[victim].last_used) {
                victim = i;
                ties = 0;
            } else if (x->last_used == r->nodes[victim].last_used) {
                ties++;
            }
        }
        CHECK(ties == 0, "two evictable leaves share a tick");
        if (victim < 0) return false;
        ref_remove(r, victim);
        r->evicted++;
    }
    return true;
}

/* Blocks a lookup shares, into want[]; returns their count. */
static size_t ref_lookup(ref_cache* r, int key, uint32_t n_layers, const int32_t* tokens, size_t n,
                         const tl_kv_block** want) {
    r->tick++;
    size_t k = 0;
    for (int parent = -1; k < (n - 1) / BS; k++) {
        const int x = ref_find(r, key, parent, tokens + k * BS);
        if (x < 0 || r->nodes[x].n_layers < n_layers) break;
        r->nodes[x].last_used = r->tick;
        want[k] = r->nodes[x].block;
        parent = x;
    }
    return k;
}

static void ref_insert(ref_cache* r, int key, const int32_t* tokens, size_t n, const tl_kv_table* t) {
    r->tick++;
    int parent = -1;
    for (size_t i = 0; i < n / BS; i++) {
        const tl_kv_block* mine = t->spans[i].block;
        int x = ref_find(r, key, parent, tokens + i * BS);
        if (x >= 0) {
            ref_node* y = &r->nodes[x];
            y->last_used = r->tick;
            if (y->n_layers < mine->n_layers && ref_make_room(r, mine->bytes - y->bytes)) {
                r->bytes += mine->bytes - y->bytes;
                y->block = mine;
                y->bytes = mine->bytes;
                y->n_layers = mine->n_layers;
            }
        } else if (ref_make_room(r, mine->bytes)) {
            for (x = 0; x < MAX_REF && r->nodes[x].live; x++) {
            }
            if (x == MAX_REF) {
                CHECK(false, "the reference is full");
                return;
            }
            r->nodes[x] = (ref_node){1, parent, key, {0}, mine, mine->bytes, mine->n_layers, r->tick, 0};
            memcpy(r->nodes[x].tokens, tokens + i * BS, sizeof r->nodes[x].tokens);
            if (parent >= 0) r->nodes[parent].n_children++;
            r->bytes += mine->bytes;
        } else {
            return;
        }
        parent = x;
    }
}

/* The reference's eviction order: by tick, a call's chain deepest first. */
static size_t ref_order(const ref_cache* r, const tl_kv_block** out) {
    int idx[MAX_REF];
    size_t n = 0;
    for (int i = 0; i < MAX_REF; i++)
        if (r->nodes[i].live) idx[n++] = i;
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0; j--) {
            const ref_node *a = &r->nodes[idx[j - 1]], *b = &r->nodes[idx[j]];
            if (a->last_used < b->last_used || (a->last_used == b->last_used && ref_depth(r, idx[j - 1]) > ref_depth(r, idx[j])))
                break;
            const int tmp = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = tmp;
        }
    for (size_t i = 0; i < n; i++) out[i] = r->nodes[idx[i]].block;
    return n;
}

/* Nodes on the path to a node whose block a table holds: what an eviction walk may skip. */
static size_t ref_held_paths(const ref_cache* r) {
    bool on_path[MAX_REF] = {false};
    for (int i = 0; i < MAX_REF; i++)
        if (r->nodes[i].live && tl_kv_block_refs(r->nodes[i].block) > 1)
            for (int j = i; j >= 0 && !on_path[j]; j = r->nodes[j].parent) on_path[j] = true;
    size_t h = 0;
    for (int i = 0; i < MAX_REF; i++) h += on_path[i];
    return h;
}

static bool same_state(tl_pcache* c, const ref_cache* r, int step) {
    const tl_kv_block *got[MAX_REF], *want[MAX_REF];
    const size_t n_got = tl_pcache_use_order(c, got, MAX_REF), n_want = ref_order(r, want);
    const tl_prefix_cache_stats s = tl_pcache_stats(c);
    bool same = n_got == n_want && memcmp(got, want, n_want * sizeof *got) == 0;
    CHECK(same, "step %d: eviction order differs (%zu vs %zu blocks)", step, n_got, n_want);
    CHECK(s.blocks == n_want && s.bytes_in_use == r->bytes && s.evicted_blocks == r->evicted,
          "step %d: %zu blocks / %zu bytes / %llu evicted, reference %zu / %zu / %llu", step, s.blocks,
          s.bytes_in_use, (unsigned long long)s.evicted_blocks, n_want, r->bytes, (unsigned long long)r->evicted);
    return same && s.bytes_in_use == r->bytes;
}

/* Random requests (lookup, run the rest, insert; tables kept alive for a while, windows
 * releasing early blocks), probes, releases and clears over two salts and two windows, with
 * tokens from {0, 1} so that chains share and branch. */
static void test_lru_matches_reference(uint64_t seed) {
    const tl_kv_geom g = tl_kv_geom_make(BS, 1, 4, 8);
    ref_cache* r = calloc(1, sizeof *r);
    r->budget = 1500; /* 5 .. 11 blocks of 1 .. 3 layers */
    tl_pcache* c = tl_pcache_new(&g, r->budget, NULL);
    /* the last two are per-depth trees (a model with a coda): blocks of one layer count each,
     * apart from the depth-nested trees of the same salt and window */
    const char* salts[N_KEYS] = {NULL, NULL, "t", "t", NULL, "t"};
    const uint32_t windows[N_KEYS] = {0, 3, 0, 3, 0, 3};
    const uint32_t tree_depths[N_KEYS] = {0, 0, 0, 0, 2, 3};
    tl_kv_table slots[N_SLOTS];
    memset(slots, 0, sizeof slots);
    uint64_t rng = seed;
    int32_t tokens[MAX_PROMPT];
    for (int step = 0; step < 3000; step++) {
        const int op = tu_uniform(&rng, 0, 99), key = tu_uniform(&rng, 0, N_KEYS - 1);
        const uint32_t layers = tree_depths[key] ? tree_depths[key] : (uint32_t)tu_uniform(&rng, 1, 3);
        const tl_pcache_key k = {salts[key], windows[key], layers, tree_depths[key], 0};
        const size_t n = (size_t)tu_uniform(&rng, 1, MAX_PROMPT);
        for (size_t i = 0; i < n; i++) tokens[i] = tu_uniform(&rng, 0, 1);
        tl_kv_table* t = &slots[tu_uniform(&rng, 0, N_SLOTS - 1)];
        if (op < 80) { /* a request (op < 60) or a probe */
            tl_kv_clear(t);
            const tl_kv_block* want[MAX_PROMPT];
            const size_t want_hit = ref_lookup(r, key, k.n_layers, tokens, n, want) * BS;
            size_t hit;
            tl_pcache_lookup(c, &k, tokens, n, t, &hit);
            CHECK(hit == want_hit, "step %d: hit %zu, reference %zu", step, hit, want_hit);
            for (size_t i = 0; i < hit / BS && i < t->n_spans; i++)
                CHECK(t->spans[i].block == want[i], "step %d: block %zu is not the reference's", step, i);
            if (op < 60) {
                CHECK_OK(tl_kv_reserve(t, &g, k.n_layers, hit, n - hit));
                const size_t h = ref_held_paths(r);
                const uint64_t visits = tl_pcache_eviction_visits(c), evicted = r->evicted;
                ref_insert(r, key, tokens, n, t);
                tl_pcache_insert(c, &k, tokens, n, t);
                const uint64_t walked = tl_pcache_eviction_visits(c) - visits;
                CHECK(walked <= (r->evicted - evicted) + h, "step %d: %llu nodes visited for %llu evictions",
                      step, (unsigned long long)walked, (unsigned long long)(r->evicted - evicted));
                if (k.window) tl_kv_release_outside(t, n, k.window);
            }
        } else if (op < 98) {
            tl_kv_clear(t);
        } else {
            tl_pcache_clear(c);
            for (int i = 0; i < MAX_REF; i++) r->nodes[i].live = 0;
            r->bytes = 0;
        }
        if (!same_state(c, r, step)) break; /* the reference would now read freed blocks */
    }
    for (int i = 0; i < N_SLOTS; i++) tl_kv_clear(&slots[i]);
    tl_pcache_free(c);
    free(r);
}

enum { MAX_CHAIN = 8 };

/* Insert the prompt of blocks {id, 0}, {id, 1}, ... (`blocks` of them: a new chain for a new
 * id) from table u (emptied first); returns the nodes the eviction walk visited for it. */
static uint64_t insert_chain(tl_pcache* c, const tl_kv_geom* g, int32_t id, size_t blocks, tl_kv_table* u) {
    const tl_pcache_key key = {NULL, 0, 1, 0, 0};
    int32_t tokens[MAX_CHAIN * BS];
    for (size_t i = 0; i < blocks; i++) {
        tokens[i * BS] = id;
        tokens[i * BS + 1] = (int32_t)i;
    }
    tl_kv_clear(u);
    CHECK_OK(tl_kv_reserve(u, g, 1, 0, blocks * BS));
    const uint64_t before = tl_pcache_eviction_visits(c);
    tl_pcache_insert(c, &key, tokens, blocks * BS, u);
    return tl_pcache_eviction_visits(c) - before;
}

static uint64_t insert_one(tl_pcache* c, const tl_kv_geom* g, int32_t id, tl_kv_table* u) {
    return insert_chain(c, g, id, 1, u);
}

/* A cache of exactly n one-block entries (ids 0 .. n-1), the h oldest held by held[0 .. h),
 * the rest by t (one reserved block, the shared source of every entry). */
static tl_pcache* filled_cache(const tl_kv_geom* g, int n, int h, tl_kv_table* held, tl_kv_table* t) {
    memset(held, 0, (size_t)h * sizeof *held);
    memset(t, 0, sizeof *t);
    CHECK_OK(tl_kv_reserve(t, g, 1, 0, BS));
    tl_pcache* c = tl_pcache_new(g, (size_t)n * t->spans[0].block->bytes, NULL);
    for (int32_t id = 0; id < n; id++) insert_one(c, g, id, id < h ? &held[id] : t);
    return c;
}

/* N one-block entries fill the cache, the H oldest held by tables; each further insert evicts
 * exactly one entry and visits the H held ones and its victim, never the N cached nodes; once
 * they are released, it visits its victim only. */
static void test_eviction_cost(void) {
    enum { N = 2000, M = 300, H = 3 };
    const tl_kv_geom g = tl_kv_geom_make(BS, 1, 4, 8);
    tl_kv_table held[H], t;
    tl_pcache* c = filled_cache(&g, N, H, held, &t);
    uint64_t walked = tl_pcache_eviction_visits(c);
    CHECK(walked == 0 && tl_pcache_stats(c).blocks == N, "filling: %llu visits, %zu blocks",
          (unsigned long long)walked, tl_pcache_stats(c).blocks);
    int32_t id = N;
    for (int i = 0; i < M; i++, id++) {
        walked = insert_one(c, &g, id, &t);
        CHECK(walked == H + 1, "insert %d with %d held: %llu nodes visited", id, H, (unsigned long long)walked);
    }
    for (int i = 0; i < H; i++) tl_kv_clear(&held[i]);
    for (int i = 0; i < M; i++, id++) {
        walked = insert_one(c, &g, id, &t);
        CHECK(walked == 1, "insert %d: %llu nodes visited", id, (unsigned long long)walked);
    }
    const tl_prefix_cache_stats s = tl_pcache_stats(c);
    CHECK(s.evicted_blocks == 2 * M && s.blocks == N, "%llu evictions, %zu blocks", (unsigned long long)s.evicted_blocks,
          s.blocks);
    tl_kv_clear(&t);
    tl_pcache_free(c);
}

/* One insert's evictions are one walk: with H held entries at the old end, an insert of B new
 * blocks evicts B entries and visits the H held ones once, not once per block (B * (H + 1)). */
static void test_eviction_cost_per_insert(void) {
    enum { N = 1000, M = 100, H = 50, B = MAX_CHAIN };
    const tl_kv_geom g = tl_kv_geom_make(BS, 1, 4, 8);
    tl_kv_table held[H], t;
    tl_pcache* c = filled_cache(&g, N, H, held, &t);
    int32_t id = N;
    for (int i = 0; i < M; i++, id++) {
        const uint64_t evicted = tl_pcache_stats(c).evicted_blocks, walked = insert_chain(c, &g, id, B, &t);
        const uint64_t k = tl_pcache_stats(c).evicted_blocks - evicted;
        CHECK(k == B && walked == H + B, "insert %d of %d blocks with %d held: %llu evictions, %llu nodes visited", id,
              B, H, (unsigned long long)k, (unsigned long long)walked);
    }
    for (int i = 0; i < H; i++) tl_kv_clear(&held[i]);
    tl_kv_clear(&t);
    tl_pcache_free(c);
}

int main(void) {
    tu_spec spec = tu_spec_default();
    V = spec.vocab;
    const char* path = tu_write_model("pcache.tinyloop", &spec);
    tu_spec coda_spec = spec; /* Huginn's shape: prelude, two core blocks, a coda, post layout */
    coda_spec.n_core = 2, coda_spec.n_coda = 1, coda_spec.layout = 2, coda_spec.injection = 1;
    coda_spec.coda_norm = 1, coda_spec.qkv_bias = 1;
    const char* coda = tu_write_model("pcache-coda.tinyloop", &coda_spec);
    uint64_t rng = 3;
    for (int i = 0; i < N_SYSTEM; i++) system_prompt[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    test_results_unchanged(path, (size_t)1 << 30);
    test_results_unchanged(path, 9000);
    test_results_unchanged(coda, (size_t)1 << 30);
    test_results_unchanged(coda, 19000);
    test_depth_trees(path, 0);
    test_depth_trees(coda, 1);
    test_counters_salts_clear(path);
    test_batch(path);
    test_batch(coda);
    test_no_insert_after_close(path);
    test_prefix_build_checks_length_first(path);
    for (uint64_t seed = 1; seed <= 4; seed++) test_lru_matches_reference(seed);
    test_eviction_cost();
    test_eviction_cost_per_insert();
    return tu_finish("test_prefix_cache");
}
