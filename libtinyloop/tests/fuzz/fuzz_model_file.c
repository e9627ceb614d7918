/* fuzz_model_file.c — libFuzzer target: tl_model_open on a `.tinyloop` file of the fuzzer's
 * bytes (docs/spec.md §6), with its file_bytes and checksum made consistent (fuzz_util.h).
 *
 * Invariants: the open succeeds, or fails as TL_ERR_BAD_FILE with a "bad model file: " message
 * (or TL_ERR_OUT_OF_MEMORY); never a crash, a leak or a read outside what was read. A model it
 * accepts must also run: a short greedy generation either works with finite logits or stops
 * with TL_ERR_NUMERIC (finite weights can still overflow a float), and a prefix built from the
 * same prompt continues it with the same tokens and bit-identical logits (docs/spec.md §5.4). */
#include <string.h>

#include "fuzz_util.h"

enum { MAX_NEW = 2, MAX_PROMPT = 3, MAX_LOOPS = 4 };

/* A greedy generation of MAX_NEW tokens from prompt[0 .. n) at depth `loops`, directly or
 * (from_prefix) continuing a prefix built from the whole prompt. */
typedef struct run {
    int32_t tokens[MAX_NEW];
    float* logits; /* [MAX_NEW][vocab] */
    size_t n;
    tl_status status;
} run;

static run generate(tl_model* m, uint32_t vocab, const int32_t* prompt, size_t n, uint32_t loops, int from_prefix) {
    tl_gen_params g = tl_gen_params_default();
    g.max_tokens = MAX_NEW, g.loops = loops;
    run r = {{0}, calloc((size_t)MAX_NEW * vocab, sizeof(float)), 0, TL_OK};
    FUZZ_REQUIRE(r.logits != NULL, "vocab %u", vocab);
    if (!from_prefix) {
        r.status = tl_generate(m, prompt, n, &g, r.tokens, &r.n, r.logits);
        return r;
    }
    tl_prefix* p = NULL;
    r.status = tl_prefix_build(m, prompt, n, loops, 0, 0, &p);
    if (r.status == TL_OK) r.status = tl_generate_from_prefix(p, NULL, 0, &g, r.tokens, &r.n, r.logits);
    tl_prefix_free(p);
    return r;
}

static void check_runs(tl_model* m) {
    tl_model_config c;
    c.size = sizeof c;
    FUZZ_REQUIRE(tl_model_config_get(m, &c) == TL_OK, "%s", tl_last_error());
    const size_t n = c.max_seq_len < MAX_PROMPT ? c.max_seq_len : MAX_PROMPT;
    int32_t prompt[MAX_PROMPT];
    for (size_t i = 0; i < n; i++) prompt[i] = (int32_t)(i % c.vocab_size);
    const uint32_t loops = c.default_loops < MAX_LOOPS ? c.default_loops : MAX_LOOPS;

    run plain = generate(m, c.vocab_size, prompt, n, loops, 0);
    FUZZ_REQUIRE(plain.status == TL_OK || plain.status == TL_ERR_NUMERIC || plain.status == TL_ERR_SEQ_TOO_LONG,
                 "generation: status %d (%s)", plain.status, tl_last_error());
    if (plain.status == TL_OK) {
        FUZZ_REQUIRE(fuzz_all_finite(plain.logits, plain.n * c.vocab_size), "non-finite logits returned as OK");
        run cont = generate(m, c.vocab_size, prompt, n, loops, 1);
        FUZZ_REQUIRE(cont.status == TL_OK, "the prefix path: status %d (%s)", cont.status, tl_last_error());
        FUZZ_REQUIRE(cont.n == plain.n && memcmp(cont.tokens, plain.tokens, plain.n * sizeof(int32_t)) == 0,
                     "the prefix path emitted other tokens");
        FUZZ_REQUIRE(tu_same_bits(cont.logits, plain.logits, plain.n * c.vocab_size), "the prefix path's logits differ");
        free(cont.logits);
    }
    free(plain.logits);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    uint8_t* bytes = fuzz_sealed_copy(data, size);
    const char* path = fuzz_memory_file(bytes, size);
    free(bytes);
    tl_model_params p = tl_model_params_default();
    p.n_threads = 1, p.kv_block_size = 4;
    tl_model* m = NULL;
    const tl_status st = tl_model_open(path, &p, &m);
    FUZZ_REQUIRE(st == TL_OK || st == TL_ERR_OUT_OF_MEMORY ||
                 (st == TL_ERR_BAD_FILE && strncmp(tl_last_error(), "bad model file: ", 16) == 0),
                 "status %d (%s)", st, tl_last_error());
    fuzz_verdict(st);
    FUZZ_REQUIRE((st == TL_OK) == (m != NULL), "status %d with model %p", st, (void*)m);
    if (m) check_runs(m);
    tl_model_free(m);
    return 0;
}
