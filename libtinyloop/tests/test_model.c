/* test_model.c — the public API end to end, on models written by test_util (version 1, and
 * version 2 with several core blocks, a coda, each block layout, biases, the injection adapter,
 * the step and coda norms): invariance of logits and tokens under thread count, kernel path,
 * chunking, block size, forking, prefixes, depth nesting and windows; a version-1 file equals
 * the version-2 file of the same weights; block sharing (forks and prefix continuations copy no block);
 * argument validation with its messages; the TINYLOOP_ISA override; closed models; concurrent use of
 * one model. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N_PROMPT = 37 };

enum { N_MODELS = 7 };

static tu_spec specs[N_MODELS];
static const char* paths[N_MODELS];
static int32_t prompt[N_PROMPT];

/* Logits of every position of tokens[0..n), as [n][V] (malloc'd). */
static float* all_logits(tl_model* m, const int32_t* tokens, size_t n, uint32_t loops, uint32_t window,
                         size_t chunk, uint32_t V) {
    float* out = malloc(n * V * sizeof(float));
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, loops, window, &s));
    CHECK_OK(tl_seq_prefill_all(s, tokens, n, chunk, out));
    tl_seq_free(s);
    return out;
}

static size_t bytes_in_use(void) {
    tl_memory_stats st = {.size = sizeof st};
    tl_memory_stats_get(&st);
    return st.bytes_in_use;
}

/* Threads, kernel paths, chunking and block sizes all give the same bits. */
static void test_invariance(int which) {
    const tu_spec* sp = &specs[which];
    const uint32_t V = sp->vocab;
    tl_model* ref_model = tu_open(paths[which], 1, TL_ISA_SCALAR, 16);
    float* ref = all_logits(ref_model, prompt, N_PROMPT, 2, 0, 0, V);
    float* ref_w = all_logits(ref_model, prompt, N_PROMPT, 3, 5, 0, V);
    const uint32_t threads[] = {1, 2, 3, 7};
    const size_t chunks[] = {0, 1, 4, 16};
    const uint32_t blocks[] = {1, 3, 16};
    for (tl_isa isa = TL_ISA_SCALAR; isa <= TL_ISA_AMX; isa++) {
        if (!tl_cpu_supports(isa)) continue;
        for (int i = 0; i < 4; i++) {
            tl_model* m = tu_open(paths[which], threads[i], isa, blocks[i % 3]);
            float* got = all_logits(m, prompt, N_PROMPT, 2, 0, chunks[i], V);
            CHECK(tu_same_bits(got, ref, N_PROMPT * V), "model %d isa %d threads %u chunk %zu block %u", which, isa,
                  threads[i], chunks[i], blocks[i % 3]);
            free(got);
            got = all_logits(m, prompt, N_PROMPT, 3, 5, chunks[3 - i], V);
            CHECK(tu_same_bits(got, ref_w, N_PROMPT * V), "window 5: model %d isa %d threads %u", which, isa, threads[i]);
            free(got);
            tl_model_free(m);
        }
    }
    /* prefill + decode == prefill_all, and last logits agree */
    tl_seq* s = NULL;
    float* last = malloc(V * sizeof(float));
    CHECK_OK(tl_seq_create(ref_model, 2, 0, &s));
    CHECK_OK(tl_seq_prefill(s, prompt, 20, 7, last));
    CHECK(tu_same_bits(last, ref + 19 * V, V), "prefill last logits");
    for (size_t i = 20; i < N_PROMPT; i++) {
        CHECK_OK(tl_seq_decode(s, prompt[i], last));
        CHECK(tu_same_bits(last, ref + i * V, V), "decode at %zu", i);
    }
    float* again = malloc(V * sizeof(float));
    CHECK_OK(tl_seq_last_logits(s, again));
    CHECK(tu_same_bits(again, last, V), "tl_seq_last_logits");
    CHECK(tl_seq_length(s) == N_PROMPT, "length");
    tl_seq_free(s);
    free(again), free(last), free(ref), free(ref_w);
    tl_model_free(ref_model);
}

/* Forks share blocks and evolve independently; prefixes serve every depth <= theirs. */
static void test_fork_prefix(void) {
    const tu_spec* sp = &specs[0];
    const uint32_t V = sp->vocab;
    tl_model* m = tu_open(paths[0], 2, TL_ISA_AUTO, 4);
    float* ref3 = all_logits(m, prompt, N_PROMPT, 3, 0, 0, V);
    float* logits = malloc(V * sizeof(float));

    tl_seq* a = NULL;
    tl_seq* b = NULL;
    CHECK_OK(tl_seq_create(m, 3, 0, &a));
    CHECK_OK(tl_seq_prefill(a, prompt, 22, 0, NULL)); /* 5 full blocks of 4 + a partial one */
    size_t before = bytes_in_use();
    CHECK_OK(tl_seq_fork(a, &b));
    CHECK(bytes_in_use() - before < 4096, "fork copied %zu bytes", bytes_in_use() - before);
    /* a continues with the prompt, b with other tokens; a must match the reference */
    const int32_t other[3] = {7, 8, 9};
    for (int i = 0; i < 3; i++) CHECK_OK(tl_seq_decode(b, other[i], logits));
    for (size_t i = 22; i < N_PROMPT; i++) {
        CHECK_OK(tl_seq_decode(a, prompt[i], logits));
        CHECK(tu_same_bits(logits, ref3 + i * V, V), "forked parent at %zu", i);
    }
    int32_t mixed[25];
    memcpy(mixed, prompt, 22 * sizeof(int32_t));
    memcpy(mixed + 22, other, sizeof other);
    float* ref_b = all_logits(m, mixed, 25, 3, 0, 0, V);
    CHECK_OK(tl_seq_last_logits(b, logits));
    CHECK(tu_same_bits(logits, ref_b + 24 * V, V), "fork child");
    tl_seq_free(a);
    tl_seq_free(b);
    free(ref_b);

    /* prefix at depth 3 serves depths 1, 2, 3 exactly; 4 is refused */
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build(m, prompt, 30, 3, 0, 8, &p));
    size_t n_tokens, nbytes;
    uint32_t loops, window;
    tl_prefix_info(p, &n_tokens, &loops, &window, &nbytes);
    CHECK(n_tokens == 30 && loops == 3 && window == 0 && nbytes > 0, "prefix info");
    size_t nt;
    const int32_t* toks = tl_prefix_tokens(p, &nt);
    CHECK(nt == 30 && memcmp(toks, prompt, 30 * sizeof(int32_t)) == 0, "prefix tokens");
    for (uint32_t L = 1; L <= 3; L++) {
        float* ref = all_logits(m, prompt, N_PROMPT, L, 0, 0, V);
        tl_seq* s = NULL;
        CHECK_OK(tl_seq_from_prefix(p, L, &s));
        CHECK_OK(tl_seq_last_logits(s, logits));
        CHECK(tu_same_bits(logits, ref + 29 * V, V), "prefix at depth %u: first logits", L);
        for (size_t i = 30; i < N_PROMPT; i++) {
            CHECK_OK(tl_seq_decode(s, prompt[i], logits));
            CHECK(tu_same_bits(logits, ref + i * V, V), "prefix at depth %u: position %zu", L, i);
        }
        tl_seq_free(s);
        free(ref);
    }
    tl_seq* s = NULL;
    CHECK_STATUS(tl_seq_from_prefix(p, 4, &s), TL_ERR_LOOPS_MISMATCH);
    CHECK(strstr(tl_last_error(), "loops mismatch") != NULL, "%s", tl_last_error());

    /* N continuations share every prefix block */
    before = bytes_in_use();
    tl_seq* conts[4];
    for (int i = 0; i < 4; i++) CHECK_OK(tl_seq_from_prefix(p, 0, &conts[i]));
    CHECK(bytes_in_use() - before < 4 * 2048, "4 continuations allocated %zu bytes", bytes_in_use() - before);
    for (int i = 0; i < 4; i++) tl_seq_free(conts[i]);

    /* generation from the prefix == generation from the whole prompt */
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 12;
    gp.temperature = 0.9f;
    gp.top_k = 0;
    gp.seed = 1234;
    gp.loops = 2;
    int32_t out_a[12], out_b[12];
    size_t na, nb;
    float* la = malloc(12 * V * sizeof(float));
    float* lb = malloc(12 * V * sizeof(float));
    CHECK_OK(tl_generate(m, prompt, 33, &gp, out_a, &na, la));
    CHECK_OK(tl_generate_from_prefix(p, prompt + 30, 3, &gp, out_b, &nb, lb));
    CHECK(na == nb && memcmp(out_a, out_b, na * sizeof(int32_t)) == 0 && tu_same_bits(la, lb, na * V),
          "generate_from_prefix with a suffix");
    CHECK_OK(tl_generate(m, prompt, 30, &gp, out_a, &na, la));
    CHECK_OK(tl_generate_from_prefix(p, NULL, 0, &gp, out_b, &nb, lb));
    CHECK(na == nb && memcmp(out_a, out_b, na * sizeof(int32_t)) == 0 && tu_same_bits(la, lb, na * V),
          "generate_from_prefix");
    gp.cache_window = 4;
    CHECK_STATUS(tl_generate_from_prefix(p, NULL, 0, &gp, out_b, &nb, NULL), TL_ERR_WINDOW_MISMATCH);
    CHECK(strstr(tl_last_error(), "cache_window mismatch") != NULL, "%s", tl_last_error());
    gp.cache_window = 0;
    gp.loops = 5;
    CHECK_STATUS(tl_generate_from_prefix(p, NULL, 0, &gp, out_b, &nb, NULL), TL_ERR_LOOPS_MISMATCH);
    CHECK(strstr(tl_last_error(), "loops mismatch: prefix built at loops=3, requested 5") != NULL, "%s", tl_last_error());

    /* a windowed prefix */
    tl_prefix* pw = NULL;
    gp.loops = 0;
    gp.cache_window = 6;
    CHECK_OK(tl_prefix_build(m, prompt, 30, 2, 6, 0, &pw));
    CHECK_STATUS(tl_generate(m, prompt, 30, &(tl_gen_params){0}, out_a, &na, NULL), TL_ERR_INVALID_ARGUMENT);
    gp.loops = 2;
    CHECK_OK(tl_generate(m, prompt, 30, &gp, out_a, &na, la));
    CHECK_OK(tl_generate_from_prefix(pw, NULL, 0, &gp, out_b, &nb, lb));
    CHECK(na == nb && memcmp(out_a, out_b, na * sizeof(int32_t)) == 0 && tu_same_bits(la, lb, na * V),
          "windowed prefix");
    tl_prefix_free(pw);

    /* closing the model: the prefix stays valid memory but every use fails cleanly */
    tl_model_close(m);
    CHECK_STATUS(tl_seq_from_prefix(p, 0, &s), TL_ERR_CLOSED);
    CHECK(strcmp(tl_last_error(), "model was closed") == 0, "%s", tl_last_error());
    CHECK_STATUS(tl_generate_from_prefix(p, NULL, 0, &gp, out_b, &nb, NULL), TL_ERR_CLOSED);
    CHECK_STATUS(tl_generate(m, prompt, 3, &gp, out_b, &nb, NULL), TL_ERR_CLOSED);
    CHECK_STATUS(tl_seq_create(m, 0, 0, &s), TL_ERR_CLOSED);
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_STATUS(tl_model_config_get(m, &cfg), TL_ERR_CLOSED);
    tl_model_free(m);
    tl_prefix_free(p); /* releases the weights last */
    free(ref3), free(logits), free(la), free(lb);
}

/* A version-1 file reads as the version-2 model of the same weights (docs/spec.md §6.5): the
 * same logits, bit for bit, at every depth. */
static void test_version1_is_version2(void) {
    tu_spec v1 = specs[0];
    v1.version = 1;
    const char* path = tu_write_model("v1.tinyloop", &v1);
    tl_model* m1 = tu_open(path, 2, TL_ISA_AUTO, 4);
    tl_model* m2 = tu_open(paths[0], 2, TL_ISA_AUTO, 4);
    tl_model_config c1 = {.size = sizeof c1}, c2 = {.size = sizeof c2};
    CHECK_OK(tl_model_config_get(m1, &c1));
    CHECK_OK(tl_model_config_get(m2, &c2));
    CHECK(c1.version == 1 && c2.version == 2 && c1.n_core_blocks == 1 && c1.embed_scale == 1.0f,
          "versions %u, %u", c1.version, c2.version);
    for (uint32_t L = 1; L <= 3; L++) {
        float* a = all_logits(m1, prompt, N_PROMPT, L, 0, 5, v1.vocab);
        float* b = all_logits(m2, prompt, N_PROMPT, L, 0, 0, v1.vocab);
        CHECK(tu_same_bits(a, b, N_PROMPT * v1.vocab), "version 1 differs from version 2 at depth %u", L);
        free(a), free(b);
    }
    tl_model_free(m1);
    tl_model_free(m2);
}

/* A prefix built at depth 3 (in chunks) serves depths 1, 2, 3 exactly as fresh runs of the whole
 * prompt: with a coda it wrote the coda slots of every depth and the final state of each. */
static void test_prefix_depths(int which) {
    const uint32_t V = specs[which].vocab;
    tl_model* m = tu_open(paths[which], 3, TL_ISA_AUTO, 4);
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build(m, prompt, 30, 3, 0, 7, &p));
    float* logits = malloc(V * sizeof(float));
    for (uint32_t L = 1; L <= 3; L++) {
        float* ref = all_logits(m, prompt, N_PROMPT, L, 0, 0, V);
        tl_seq* s = NULL;
        CHECK_OK(tl_seq_from_prefix(p, L, &s));
        CHECK_OK(tl_seq_last_logits(s, logits));
        CHECK(tu_same_bits(logits, ref + 29 * V, V), "model %d: prefix at depth %u: first logits", which, L);
        for (size_t i = 30; i < N_PROMPT; i++) {
            CHECK_OK(tl_seq_decode(s, prompt[i], logits));
            CHECK(tu_same_bits(logits, ref + i * V, V), "model %d: prefix at depth %u: position %zu", which, L, i);
        }
        tl_seq_free(s);
        free(ref);
    }
    tl_prefix_free(p);
    free(logits);
    tl_model_free(m);
}

/* n_layers(L) <= 65536 (docs/spec.md §1): a prelude block and 64 core blocks run at most 1023
 * loops. */
static void test_depth_limit(void) {
    tu_spec sp = tu_spec_default();
    sp.vocab = 16, sp.d = 8, sp.heads = 1, sp.kv_heads = 1, sp.head_dim = 8, sp.ffn = 8, sp.n_pre = 1;
    sp.n_core = 64, sp.loops = 1, sp.max_seq = 8;
    tl_model* m = tu_open(tu_write_model("deep.tinyloop", &sp), 1, TL_ISA_AUTO, 4);
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, 1023, 0, &s));
    const int32_t token = 3;
    CHECK_OK(tl_seq_prefill(s, &token, 1, 0, NULL));
    tl_seq_free(s);
    s = NULL;
    CHECK_STATUS(tl_seq_create(m, 1024, 0, &s), TL_ERR_INVALID_ARGUMENT);
    CHECK(s == NULL && strstr(tl_last_error(), "loops=1024 needs 65537 cache layers, more than 65536") != NULL,
          "%s", tl_last_error());
    tl_prefix* p = NULL;
    CHECK_STATUS(tl_prefix_build(m, &token, 1, 1024, 0, 0, &p), TL_ERR_INVALID_ARGUMENT);
    tl_gen_params gp = tl_gen_params_default();
    gp.loops = 1024;
    gp.max_tokens = 2;
    int32_t out[4];
    size_t n_out;
    CHECK_STATUS(tl_generate(m, &token, 1, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    tl_request r = {.size = sizeof r, .prompt = &token, .n_prompt = 1, .params = &gp, .out_tokens = out};
    tl_request* batch[1] = {&r};
    CHECK_STATUS(tl_generate_batch(m, batch, 1), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "request 0: loops=1024 needs 65537 cache layers") != NULL, "%s", tl_last_error());
    tl_model_free(m);
}

/* on_token sees every emitted token in order; a nonzero return stops generation there. */
typedef struct streamed {
    int32_t tokens[16];
    size_t n, stop_after;
} streamed;

static int collect_token(void* user_data, int32_t token) {
    streamed* st = user_data;
    st->tokens[st->n++] = token;
    return st->n == st->stop_after;
}

static void test_token_callback(void) {
    tl_model* m = tu_open(paths[0], 1, TL_ISA_AUTO, 4);
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 10;
    gp.temperature = 0.8f;
    gp.seed = 7;
    int32_t plain[10], out[10];
    size_t n_plain, n;
    CHECK_OK(tl_generate(m, prompt, 20, &gp, plain, &n_plain, NULL));
    streamed st = {.stop_after = 0};
    gp.on_token = collect_token;
    gp.user_data = &st;
    CHECK_OK(tl_generate(m, prompt, 20, &gp, out, &n, NULL));
    CHECK(n == n_plain && st.n == n && memcmp(st.tokens, plain, n * sizeof(int32_t)) == 0,
          "streamed tokens differ from the returned ones");
    st = (streamed){.stop_after = 3};
    CHECK_OK(tl_generate(m, prompt, 20, &gp, out, &n, NULL));
    CHECK(n == 3 && st.n == 3 && memcmp(out, plain, 3 * sizeof(int32_t)) == 0, "stop after 3: %zu", n);
    tl_model_free(m);
}

typedef struct progress_log {
    size_t done[16], total, n, stop_at;
} progress_log;

static int log_progress(void* user_data, size_t done, size_t total) {
    progress_log* log = user_data;
    log->done[log->n++] = done;
    log->total = total;
    return log->n == log->stop_at;
}

/* on_prefill reports every chunk, counting reused positions, and can stop before any token. */
static void test_prefill_progress(void) {
    tl_model* m = tu_open(paths[0], 1, TL_ISA_AUTO, 4);
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 4;
    gp.prefill_chunk = 8;
    gp.on_prefill = log_progress;
    progress_log log = {.stop_at = 0};
    gp.user_data = &log;
    int32_t plain[4], out[4];
    size_t n_plain, n;
    CHECK_OK(tl_generate(m, prompt, 20, &gp, plain, &n_plain, NULL));
    CHECK(log.n == 3 && log.done[0] == 8 && log.done[1] == 16 && log.done[2] == 20 && log.total == 20,
          "prompt of 20 in chunks of 8: %zu reports", log.n);
    log = (progress_log){.stop_at = 2};
    CHECK_OK(tl_generate(m, prompt, 20, &gp, out, &n, NULL));
    CHECK(n == 0 && log.n == 2, "stopped prefill emitted %zu tokens", n);
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build(m, prompt, 12, 0, 0, 0, &p));
    log = (progress_log){.stop_at = 0};
    CHECK_OK(tl_generate_from_prefix(p, prompt + 12, 8, &gp, out, &n, NULL));
    CHECK(log.n == 1 && log.done[0] == 20 && log.total == 20, "from a prefix: %zu reports", log.n);
    CHECK(n == n_plain && memcmp(out, plain, n * sizeof(int32_t)) == 0, "progress changed the tokens");
    tl_prefix_free(p);
    tl_model_free(m);
}

/* Windowed sequences release blocks: memory stays bounded however long the sequence. */
static void test_window_memory(void) {
    tl_model* m = tu_open(paths[0], 1, TL_ISA_AUTO, 4);
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, 2, 5, &s));
    CHECK_OK(tl_seq_prefill(s, prompt, 8, 0, NULL));
    const size_t early = bytes_in_use();
    for (int i = 0; i < 80; i++) CHECK_OK(tl_seq_decode(s, prompt[i % N_PROMPT], NULL));
    CHECK(bytes_in_use() <= early + 2048 + 2 * 4 * 4 * 1024, "window: %zu -> %zu bytes", early, bytes_in_use());
    tl_seq_free(s);
    tl_model_free(m);
}

/* TL_DEVICE_AUTO and TL_DEVICE_CPU open on the CPU; TL_DEVICE_CUDA opens only where
 * tl_device_check says it can, and otherwise fails with the same reason. */
static void test_device_selection(void) {
    CHECK_OK(tl_device_check(TL_DEVICE_AUTO));
    CHECK_OK(tl_device_check(TL_DEVICE_CPU));
    CHECK_STATUS(tl_device_check((tl_device)7), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "device must be 0 (auto), 1 (cpu) or 2 (cuda), got 7"), "%s", tl_last_error());
    tl_model_params mp = tl_model_params_default();
    CHECK(mp.device == TL_DEVICE_AUTO && mp.device_index == 0, "device defaults");
    tl_model* m = NULL;
    mp.device = TL_DEVICE_CPU;
    CHECK_OK(tl_model_open(paths[0], &mp, &m));
    tl_model_free(m);
    mp.device = TL_DEVICE_CUDA;
    const tl_status cuda = tl_device_check(TL_DEVICE_CUDA);
    if (cuda != TL_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", tl_last_error());
        CHECK(cuda == TL_ERR_UNSUPPORTED && strlen(why) > 0, "tl_device_check(CUDA): %d", (int)cuda);
        CHECK_STATUS(tl_model_open(paths[0], &mp, &m), TL_ERR_UNSUPPORTED);
        CHECK(m == NULL && strcmp(tl_last_error(), why) == 0, "%s", tl_last_error());
    }
    mp.device_index = 1 << 20;
    CHECK_STATUS(tl_model_open(paths[0], &mp, &m), cuda == TL_OK ? TL_ERR_INVALID_ARGUMENT : TL_ERR_UNSUPPORTED);
    CHECK(m == NULL, "output handle set on failure");
}

/* The ISA a model opened with `isa` runs, as tl_model_runtime reports it; TL_ISA_AUTO if the
 * open fails (its status in *status). */
static tl_isa opened_isa(tl_isa isa, tl_status* status) {
    tl_model_params mp = tl_model_params_default();
    mp.n_threads = 1;
    mp.isa = isa;
    tl_model* m = NULL;
    *status = tl_model_open(paths[0], &mp, &m);
    if (*status != TL_OK) return TL_ISA_AUTO;
    tl_model_runtime rt = {.size = sizeof rt};
    CHECK_OK(tl_model_runtime_get(m, &rt));
    tl_model_free(m);
    return rt.isa;
}

/* TINYLOOP_ISA forces the path of a model opened with TL_ISA_AUTO, by name; an explicit isa
 * ignores it. The caller's own TINYLOOP_ISA (a forced ctest run) is restored afterwards. */
static void test_isa_from_environment(void) {
    const char* outer = getenv("TINYLOOP_ISA");
    char* saved = outer ? strdup(outer) : NULL;
    unsetenv("TINYLOOP_ISA");
    tl_status st;
    const tl_isa best = opened_isa(TL_ISA_AUTO, &st);
    CHECK(st == TL_OK && best != TL_ISA_AUTO, "no TINYLOOP_ISA: %s", tl_last_error());
    static const char* const canonical[] = {"auto", "scalar", "avx2", "avx512-vnni", "amx"};
    const struct {
        const char* name;
        tl_isa isa;
    } names[] = {{"", best},
                 {"auto", best},
                 {"scalar", TL_ISA_SCALAR},
                 {"avx2", TL_ISA_AVX2},
                 {"avx512", TL_ISA_AVX512_VNNI},
                 {"avx512-vnni", TL_ISA_AVX512_VNNI},
                 {"amx", TL_ISA_AMX}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        setenv("TINYLOOP_ISA", names[i].name, 1);
        const tl_isa got = opened_isa(TL_ISA_AUTO, &st);
        if (tl_cpu_supports(names[i].isa)) {
            CHECK(st == TL_OK && got == names[i].isa, "TINYLOOP_ISA=%s: isa %d, want %d (%s)", names[i].name,
                  (int)got, (int)names[i].isa, tl_last_error());
            continue;
        }
        char want[128];
        snprintf(want, sizeof want, "isa %s is not supported by this CPU or build (from TINYLOOP_ISA)",
                 canonical[names[i].isa]);
        CHECK(st == TL_ERR_UNSUPPORTED && strcmp(tl_last_error(), want) == 0, "TINYLOOP_ISA=%s: %d %s",
              names[i].name, (int)st, tl_last_error());
    }
    setenv("TINYLOOP_ISA", "bogus", 1);
    opened_isa(TL_ISA_AUTO, &st);
    CHECK(st == TL_ERR_INVALID_ARGUMENT && strcmp(tl_last_error(), "TINYLOOP_ISA must be auto, scalar, avx2, "
                                                                   "avx512, avx512-vnni or amx, got 'bogus'") == 0,
          "TINYLOOP_ISA=bogus: %d %s", (int)st, tl_last_error());
    CHECK(opened_isa(TL_ISA_SCALAR, &st) == TL_ISA_SCALAR && st == TL_OK, "explicit scalar, TINYLOOP_ISA=bogus");
    setenv("TINYLOOP_ISA", "scalar", 1);
    CHECK(opened_isa(best, &st) == best && st == TL_OK, "explicit isa %d, TINYLOOP_ISA=scalar", (int)best);
    if (saved) setenv("TINYLOOP_ISA", saved, 1);
    else unsetenv("TINYLOOP_ISA");
    free(saved);
}

static void test_validation(void) {
    tl_model* m = tu_open(paths[0], 1, TL_ISA_AUTO, 0);
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, 0, 0, &s));
    uint32_t loops, window;
    tl_seq_shape(s, &loops, &window);
    CHECK(loops == specs[0].loops && window == 0, "default loops");
    const int32_t bad[4] = {1, 2, 300, 4};
    CHECK_STATUS(tl_seq_prefill(s, bad, 4, 0, NULL), TL_ERR_OUT_OF_RANGE);
    CHECK(strstr(tl_last_error(), "token id 300 at index 2 is out of range [0, 256)") != NULL, "%s", tl_last_error());
    CHECK(tl_seq_length(s) == 0, "failed prefill changed the sequence");
    int32_t* longp = calloc(specs[0].max_seq + 1, sizeof(int32_t));
    CHECK_STATUS(tl_seq_prefill(s, longp, specs[0].max_seq + 1, 0, NULL), TL_ERR_SEQ_TOO_LONG);
    CHECK(strstr(tl_last_error(), "exceeds max_seq_len") != NULL, "%s", tl_last_error());
    CHECK_STATUS(tl_seq_prefill(s, longp, 0, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_seq_last_logits(s, (float[1]){0}), TL_ERR_INVALID_ARGUMENT);
    tl_seq_free(s);
    CHECK_STATUS(tl_seq_create(m, 1025, 0, &s), TL_ERR_INVALID_ARGUMENT);
    CHECK(s == NULL, "output handle set on failure");

    tl_gen_params gp = tl_gen_params_default();
    int32_t out[64];
    size_t n_out;
    gp.max_tokens = 0;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "max_tokens < 1") == 0, "%s", tl_last_error());
    gp = tl_gen_params_default();
    gp.temperature = -1.0f;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "temperature") != NULL, "%s", tl_last_error());
    gp = tl_gen_params_default();
    gp.temperature = 1.0f / 0.0f;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    gp = tl_gen_params_default();
    gp.top_p = 0.0f;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "top_p") != NULL, "%s", tl_last_error());
    gp.top_p = 1.5f;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    gp = tl_gen_params_default();
    gp.top_k = -1;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    gp = tl_gen_params_default();
    gp.repetition_penalty = 0.0f;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "repetition_penalty") != NULL, "%s", tl_last_error());
    gp = tl_gen_params_default();
    const int32_t stops[3] = {1, 2, 3};
    const size_t lens[2] = {2, 0};
    gp.stop_tokens = stops;
    gp.stop_lengths = lens;
    gp.n_stop = 2;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "stop_sequences[1] is empty") != NULL, "%s", tl_last_error());
    gp = tl_gen_params_default();
    gp.max_tokens = specs[0].max_seq;
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, out, &n_out, NULL), TL_ERR_SEQ_TOO_LONG);
    gp = tl_gen_params_default();
    CHECK_STATUS(tl_generate(m, prompt, 0, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_generate(m, bad, 4, &gp, out, &n_out, NULL), TL_ERR_OUT_OF_RANGE);
    CHECK_STATUS(tl_generate(m, prompt, 4, &gp, NULL, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);

    /* stop rules: a stop sequence equal to the greedy continuation stops right after it */
    gp = tl_gen_params_default();
    gp.max_tokens = 10;
    int32_t greedy[10];
    size_t n_greedy;
    CHECK_OK(tl_generate(m, prompt, 10, &gp, greedy, &n_greedy, NULL));
    CHECK(n_greedy == 10, "max_tokens");
    const size_t stop_len[1] = {2};
    gp.stop_tokens = greedy + 3;
    gp.stop_lengths = stop_len;
    gp.n_stop = 1;
    CHECK_OK(tl_generate(m, prompt, 10, &gp, out, &n_out, NULL));
    CHECK(n_out <= 5 && memcmp(out, greedy, n_out * sizeof(int32_t)) == 0, "stop sequence: %zu tokens", n_out);

    tl_model_params mp = tl_model_params_default();
    mp.isa = (tl_isa)9;
    tl_model* m2 = NULL;
    CHECK_STATUS(tl_model_open(paths[0], &mp, &m2), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "isa must be 0 .. 4, got 9") == 0, "%s", tl_last_error());
    for (tl_isa isa = TL_ISA_AVX2; isa <= TL_ISA_AMX; isa++) {
        if (tl_cpu_supports(isa)) continue;
        mp.isa = isa;
        CHECK_STATUS(tl_model_open(paths[0], &mp, &m2), TL_ERR_UNSUPPORTED);
    }
    tl_model_runtime rt = {.size = sizeof rt};
    CHECK_OK(tl_model_runtime_get(m, &rt));
    CHECK(rt.isa != TL_ISA_AUTO && rt.n_threads == 1 && rt.kv_block_size == 16, "runtime");
    CHECK(rt.device == TL_DEVICE_CPU && strncmp(rt.device_name, "cpu (", 5) == 0 && rt.device_weight_bytes == 0,
          "runtime device: %d %s", (int)rt.device, rt.device_name);
    tl_model_runtime old_rt = {.size = offsetof(tl_model_runtime, device)}; /* an older caller */
    CHECK_OK(tl_model_runtime_get(m, &old_rt));
    CHECK(old_rt.size == offsetof(tl_model_runtime, device) && old_rt.device == 0, "versioned runtime");
    test_device_selection();
    test_isa_from_environment();
    CHECK(tl_abi_version() == TL_ABI_VERSION && strlen(tl_version_string()) > 0, "versions");
    CHECK(strcmp(tl_status_string(TL_ERR_CLOSED), "model was closed") == 0 &&
              strcmp(tl_status_string(TL_ERR_OUT_OF_MEMORY), "out of memory") == 0, "status strings");
    tl_model_free(NULL);
    tl_seq_free(NULL);
    tl_prefix_free(NULL);
    free(longp);
    tl_model_free(m);
}

/* One model, many threads generating at once: same tokens as serially. */
typedef struct gen_job {
    tl_model* model;
    uint64_t seed;
    int32_t out[16];
    size_t n;
    tl_status status;
} gen_job;

static void* gen_thread(void* arg) {
    gen_job* j = arg;
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 16;
    gp.temperature = 1.0f;
    gp.seed = j->seed;
    j->status = tl_generate(j->model, prompt, 9, &gp, j->out, &j->n, NULL);
    return NULL;
}

static void test_concurrency(void) {
    tl_model* m = tu_open(paths[1], 2, TL_ISA_AUTO, 0);
    gen_job serial[4], parallel[4];
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) {
        serial[i] = (gen_job){.model = m, .seed = (uint64_t)i * 77};
        gen_thread(&serial[i]);
        parallel[i] = serial[i];
        memset(parallel[i].out, 0, sizeof parallel[i].out);
        pthread_create(&threads[i], NULL, gen_thread, &parallel[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(threads[i], NULL);
        CHECK(parallel[i].status == TL_OK && serial[i].status == TL_OK && parallel[i].n == serial[i].n &&
                  memcmp(parallel[i].out, serial[i].out, serial[i].n * sizeof(int32_t)) == 0,
              "thread %d", i);
    }
    tl_model_free(m);
}

int main(void) {
    tu_spec base = tu_spec_default();
    specs[0] = base;                                                     /* int8, GQA, n_pre 1 */
    specs[1] = base, specs[1].int4 = 1, specs[1].group_size = 16;        /* int4 */
    specs[2] = base, specs[2].n_pre = 0, specs[2].tied = 1, specs[2].vocab = 263, specs[2].kv_heads = 1;
    specs[3] = base, specs[3].int4 = 1, specs[3].group_size = 6, specs[3].n_pre = 2, specs[3].d = 36,
    specs[3].ffn = 42, specs[3].heads = 3, specs[3].kv_heads = 3; /* group size 6: scalar fallback */
    /* Ouro-like: no prelude, two core blocks, sandwich, step norm */
    specs[4] = base, specs[4].n_pre = 0, specs[4].n_core = 2, specs[4].layout = 1, specs[4].step_norm = 1;
    /* Huginn-like: prelude, core, coda, post, injection, coda norm, q/k/v bias, embedding scale, tied */
    specs[5] = base, specs[5].n_core = 2, specs[5].n_coda = 1, specs[5].layout = 2, specs[5].injection = 1,
    specs[5].coda_norm = 1, specs[5].qkv_bias = 1, specs[5].embed_scale = 2.5f, specs[5].tied = 1;
    /* int4 with a two-block coda, injection and the step norm, pre layout */
    specs[6] = base, specs[6].int4 = 1, specs[6].group_size = 16, specs[6].n_core = 2, specs[6].n_coda = 2,
    specs[6].injection = 1, specs[6].step_norm = 1, specs[6].embed_scale = 0.5f;
    for (int i = 0; i < N_MODELS; i++) {
        char name[32];
        snprintf(name, sizeof name, "m%d.tinyloop", i);
        paths[i] = tu_write_model(name, &specs[i]);
    }
    uint64_t rng = 42;
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = tu_uniform(&rng, 0, 255);
    const size_t baseline = bytes_in_use();
    for (int i = 0; i < N_MODELS; i++) test_invariance(i);
    test_version1_is_version2();
    test_fork_prefix();
    for (int i = 4; i < N_MODELS; i++) test_prefix_depths(i);
    test_depth_limit();
    test_window_memory();
    test_token_callback();
    test_prefill_progress();
    test_validation();
    test_concurrency();
    CHECK(bytes_in_use() == baseline, "leak: %zu bytes still in use", bytes_in_use() - baseline);
    return tu_finish("test_model");
}
