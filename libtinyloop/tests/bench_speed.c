/* bench_speed.c — prefill and decode throughput of one model (not a test).
 *
 * usage: bench_speed MODEL [threads=2] [isa=0] [prefill_tokens=512] [decode_tokens=64]
 * Prints tokens/s of a prefill of `prefill_tokens` tokens (one chunk) and of greedy decoding
 * `decode_tokens` tokens after it, best of three runs each. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tinyloop.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void check(tl_status st, const char* what) {
    if (st != TL_OK) {
        fprintf(stderr, "%s: %s\n", what, tl_last_error());
        exit(1);
    }
}

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_speed MODEL [threads] [isa] [prefill_tokens] [decode_tokens]\n");
        return 2;
    }
    tl_model_params mp = tl_model_params_default();
    mp.n_threads = argc > 2 ? (uint32_t)atoi(argv[2]) : 2;
    mp.isa = argc > 3 ? (tl_isa)atoi(argv[3]) : TL_ISA_AUTO;
    const size_t n_prefill = argc > 4 ? (size_t)atol(argv[4]) : 512;
    const size_t n_decode = argc > 5 ? (size_t)atol(argv[5]) : 64;
    tl_model* m;
    check(tl_model_open(argv[1], &mp, &m), "open");
    tl_model_config cfg = {.size = sizeof cfg};
    tl_model_runtime rt = {.size = sizeof rt};
    check(tl_model_config_get(m, &cfg), "config");
    check(tl_model_runtime_get(m, &rt), "runtime");
    int32_t* tokens = malloc(n_prefill * sizeof(int32_t));
    for (size_t i = 0; i < n_prefill; i++) tokens[i] = (int32_t)((i * 7919 + 13) % cfg.vocab_size);
    float* logits = malloc(cfg.vocab_size * sizeof(float));
    double best_prefill = 1e30, best_decode = 1e30;
    for (int run = 0; run < 3; run++) {
        tl_seq* s;
        check(tl_seq_create(m, 0, 0, &s), "seq");
        double t0 = now();
        check(tl_seq_prefill(s, tokens, n_prefill, 0, logits), "prefill");
        double t1 = now();
        for (size_t i = 0; i < n_decode; i++) {
            int32_t next = 0;
            for (uint32_t v = 1; v < cfg.vocab_size; v++)
                if (logits[v] > logits[next]) next = (int32_t)v;
            check(tl_seq_decode(s, next, logits), "decode");
        }
        double t2 = now();
        tl_seq_free(s);
        if (t1 - t0 < best_prefill) best_prefill = t1 - t0;
        if (t2 - t1 < best_decode) best_decode = t2 - t1;
    }
    printf("%s: d=%u H=%u G=%u D=%u F=%u n_pre=%u L=%u V=%u %s%s isa=%d threads=%u\n", argv[1], cfg.d_model,
           cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.n_pre_blocks, cfg.default_loops,
           cfg.vocab_size, cfg.weight_format == 1 ? "int8" : "int4", "", rt.isa,
           rt.n_threads);
    printf("  prefill %zu tokens: %.3f s = %.1f tokens/s\n", n_prefill, best_prefill, (double)n_prefill / best_prefill);
    printf("  decode %zu tokens: %.3f s = %.1f tokens/s\n", n_decode, best_decode, (double)n_decode / best_decode);
    free(tokens);
    free(logits);
    tl_model_free(m);
    return 0;
}
