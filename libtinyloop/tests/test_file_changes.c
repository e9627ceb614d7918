/* test_file_changes.c — a model never reads its file after tl_model_open (docs/c-api.md):
 * rewriting the file in place, truncating it or deleting it under an open model changes no
 * token and no logit bit, on every kernel path this CPU runs (the scalar path computes on the
 * weights in the file's own layout; the SIMD paths on repacked copies, beside the embedding
 * and rope tables, which every path reads as stored). Through a mapping of the file, the
 * rewrite would change the logits and the truncation would SIGBUS. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

enum { N_PROMPT = 9, MAX_TOKENS = 12 };

typedef struct run {
    int32_t tokens[MAX_TOKENS];
    size_t n;
    float* logits; /* [MAX_TOKENS][vocab] */
} run;

/* Greedy generation from a fixed prompt. */
static run generate(tl_model* m, uint32_t vocab) {
    static const int32_t prompt[N_PROMPT] = {1, 7, 3, 200, 5, 42, 9, 0, 77};
    run r = {.n = 0, .logits = calloc((size_t)MAX_TOKENS * vocab, sizeof(float))};
    tl_gen_params g = tl_gen_params_default();
    g.max_tokens = MAX_TOKENS;
    g.temperature = 0;
    CHECK_OK(tl_generate(m, prompt, N_PROMPT, &g, r.tokens, &r.n, r.logits));
    CHECK(r.n == MAX_TOKENS, "generated %zu tokens, want %d", r.n, MAX_TOKENS);
    return r;
}

static int same_run(const run* a, const run* b, uint32_t vocab) {
    return a->n == b->n && memcmp(a->tokens, b->tokens, a->n * sizeof *a->tokens) == 0 &&
           tu_same_bits(a->logits, b->logits, a->n * vocab);
}

/* Overwrite the file from byte 0 (same inode, same size: what a mapping would see). */
static void overwrite(const char* path, const uint8_t* bytes, size_t n) {
    FILE* f = fopen(path, "r+b");
    CHECK(f != NULL, "cannot reopen %s", path);
    if (!f) return;
    CHECK(fwrite(bytes, 1, n, f) == n, "short write to %s", path);
    CHECK(fclose(f) == 0, "close %s", path);
}

static void check_detached(const char* what, tu_spec spec, tl_isa isa) {
    const uint32_t vocab = spec.vocab;
    const char* path = tu_write_model("detached.tinyloop", &spec);
    tl_model* m = tu_open(path, 2, isa, 0);
    if (!m) return;
    run ref = generate(m, vocab);

    /* a different model of the same shape and size, written over the open one */
    spec.seed += 1000;
    size_t n;
    uint8_t* other = tu_model_bytes(&spec, &n);
    overwrite(path, other, n);
    free(other);
    tl_model* m_other = tu_open(path, 2, isa, 0);
    if (m_other) {
        run changed = generate(m_other, vocab);
        CHECK(!same_run(&ref, &changed, vocab), "%s: the rewritten file gives the same logits (test is void)", what);
        free(changed.logits);
        tl_model_free(m_other);
    }
    run after = generate(m, vocab);
    CHECK(same_run(&ref, &after, vocab), "%s: logits changed after the file was rewritten", what);
    free(after.logits);

    /* cut inside the data, then to nothing, then gone */
    const off_t cuts[2] = {(off_t)n / 2, 0};
    for (int k = 0; k < 2; k++) {
        CHECK(truncate(path, cuts[k]) == 0, "truncate %s", path);
        after = generate(m, vocab);
        CHECK(same_run(&ref, &after, vocab), "%s: logits changed after truncating the file to %lld bytes", what,
              (long long)cuts[k]);
        free(after.logits);
    }
    CHECK(unlink(path) == 0, "unlink %s", path);
    after = generate(m, vocab);
    CHECK(same_run(&ref, &after, vocab), "%s: logits changed after deleting the file", what);
    free(after.logits);
    free(ref.logits);
    tl_model_free(m);
}

/* A file that reads shorter than the size it had when opened — what a truncation during
 * tl_model_open looks like — is TL_ERR_IO. A sysfs file stands in for one (it reports 4096
 * bytes and reads a few dozen); skipped where there is none. */
static void check_shrinking_file(void) {
    const char* path = "/sys/kernel/mm/transparent_hugepage/enabled";
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 256) {
        printf("test_file_changes: no sysfs file reading shorter than its size, short read not tested\n");
        return;
    }
    tl_model* m = NULL;
    CHECK_STATUS(tl_model_open(path, NULL, &m), TL_ERR_IO);
    CHECK(m == NULL && strstr(tl_last_error(), "changed while being read"), "%s", tl_last_error());
}

int main(void) {
    check_shrinking_file();
    const tl_isa isas[] = {TL_ISA_SCALAR, TL_ISA_AVX2, TL_ISA_AVX512_VNNI, TL_ISA_AMX};
    for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
        if (!tl_cpu_supports(isas[i])) {
            printf("test_file_changes: isa %d not supported here, skipped\n", (int)isas[i]);
            continue;
        }
        tu_spec int8 = tu_spec_default();
        check_detached("int8", int8, isas[i]);
        tu_spec tied = int8;
        tied.tied = 1;
        check_detached("int8, tied head", tied, isas[i]);
        tu_spec int4 = int8;
        int4.int4 = 1;
        int4.group_size = 8;
        check_detached("int4, groups of 8", int4, isas[i]);
        int4.group_size = 4; /* not a multiple of 8: the scalar path on every ISA */
        check_detached("int4, groups of 4", int4, isas[i]);
        check_detached("version 2, every option", tu_spec_rich(), isas[i]);
        tu_spec v1 = int8;
        v1.version = 1;
        check_detached("version 1", v1, isas[i]);
    }
    return tu_finish("test_file_changes");
}
