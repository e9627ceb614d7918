/* prefix_threads.c — libtinyloop host example: open a model, build a prefix once, and run
 * four continuations of it on four threads at once (each sampled with its own seed). The
 * prefix's KV blocks are shared by all four; none is copied.
 *
 * usage: prefix_threads MODEL [max_tokens]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include <tinyloop.h>

enum { N_THREADS = 4, PROMPT_LEN = 24 };

typedef struct job {
    const tl_prefix* prefix;
    uint64_t seed;
    size_t max_tokens;
    int32_t* tokens;
    size_t n_tokens;
    tl_status status;
    char error[256];
} job;

static void* continue_prefix(void* arg) {
    job* j = arg;
    tl_gen_params params = tl_gen_params_default();
    params.max_tokens = j->max_tokens;
    params.temperature = 0.8f;
    params.top_k = 40;
    params.seed = j->seed;
    j->status = tl_generate_from_prefix(j->prefix, NULL, 0, &params, j->tokens, &j->n_tokens, NULL);
    if (j->status != TL_OK) snprintf(j->error, sizeof j->error, "%s", tl_last_error());
    return NULL;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL [max_tokens]\n", argv[0]);
        return 2;
    }
    const size_t max_tokens = argc > 2 ? (size_t)strtoul(argv[2], NULL, 10) : 16;
    if (tl_abi_version() != TL_ABI_VERSION) {
        fprintf(stderr, "libtinyloop has ABI %d, this program was built for %d\n", tl_abi_version(), TL_ABI_VERSION);
        return 1;
    }
    printf("libtinyloop %s (ABI %d)\n", tl_version_string(), tl_abi_version());

    tl_model* model = NULL;
    if (tl_model_open(argv[1], NULL, &model) != TL_OK) {
        fprintf(stderr, "cannot open %s: %s\n", argv[1], tl_last_error());
        return 1;
    }
    tl_model_config cfg = {.size = sizeof cfg};
    tl_model_config_get(model, &cfg);
    printf("model '%s': vocab %u, d_model %u, %u pre blocks + loop block x %u\n", cfg.name, cfg.vocab_size,
           cfg.d_model, cfg.n_pre_blocks, cfg.default_loops);

    int32_t prompt[PROMPT_LEN];
    for (int i = 0; i < PROMPT_LEN; i++) prompt[i] = (int32_t)((i * 31 + 7) % cfg.vocab_size);
    tl_prefix* prefix = NULL;
    if (tl_prefix_build(model, prompt, PROMPT_LEN, 0, 0, 0, &prefix) != TL_OK) {
        fprintf(stderr, "prefix: %s\n", tl_last_error());
        tl_model_free(model);
        return 1;
    }
    size_t nbytes;
    tl_prefix_info(prefix, NULL, NULL, NULL, &nbytes);
    printf("prefix of %d tokens: %zu bytes\n", PROMPT_LEN, nbytes);

    job jobs[N_THREADS];
    pthread_t threads[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        jobs[i] = (job){.prefix = prefix, .seed = 1000 + (uint64_t)i, .max_tokens = max_tokens,
                        .tokens = calloc(max_tokens, sizeof(int32_t))};
        pthread_create(&threads[i], NULL, continue_prefix, &jobs[i]);
    }
    int failed = 0;
    for (int i = 0; i < N_THREADS; i++) {
        pthread_join(threads[i], NULL);
        if (jobs[i].status != TL_OK) {
            fprintf(stderr, "continuation %d: %s\n", i, jobs[i].error);
            failed = 1;
        } else {
            printf("continuation %d (seed %llu):", i, (unsigned long long)jobs[i].seed);
            for (size_t k = 0; k < jobs[i].n_tokens; k++) printf(" %d", jobs[i].tokens[k]);
            printf("\n");
        }
        free(jobs[i].tokens);
    }
    tl_prefix_free(prefix);
    tl_model_free(model);
    return failed;
}
