/* test_prefix_blob.c — prefixes as bytes: tl_prefix_save / tl_prefix_load (docs/spec.md §7).
 *
 * On a plain model, a Huginn-like one (prelude, core of 2 with injection and step norm, coda
 * with coda_norm) and one with a coda and no prelude, windows 0 and 6, plain and warm-start:
 * a loaded prefix generates (every depth <= L_b, with and without a suffix, greedy and
 * sampled) the tokens and bit-identical logits of the saved one and of plain tl_generate, and
 * saves back to the same bytes; loaded into a model with another kv_block_size it generates
 * the same; a loaded warm-start prefix extends to the extension of the saved one (same blob
 * afterwards), with its kept states or, from a blob without them, by rebuilding. Int4 KV mode
 * round-trips too. Refused: a blob of another model (other weights) or of the other KV mode,
 * with messages naming that; bad arguments; a closed model. The size query (buf NULL, cap too
 * small). The loader under mutation: every truncation (with blob_bytes and the checksum also
 * fixed up, to reach the deeper rules), a flip of every byte (with and without the checksum
 * fixed up), each header field set to a bad value, and random multi-byte damage: never a
 * crash or an out-of-bounds read (run under ASan), every failure TL_ERR_BAD_FILE naming the
 * rule. A save while another thread extends the prefix gets the blob of the prefix before or
 * after the extension, never a mixture (run under TSan). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N_PROMPT = 29, N_SUFFIX = 3, MAX_NEW = 5, SEED = 11, HEADER = 96 };

static int32_t prompt[N_PROMPT + N_SUFFIX]; /* the prefix's tokens, then a suffix */
static const int32_t* const suffix = prompt + N_PROMPT;
static uint32_t V;

static tl_prefix* build(tl_model* m, uint32_t loops, uint32_t window, uint32_t flags) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, N_PROMPT, loops, window, 4, flags, &p));
    return p;
}

/* ---- generations ---------------------------------------------------------------------------- */

/* Every generation from got equals want's and plain tl_generate's of the same tokens on m. */
static void check_generations(tl_model* m, const tl_prefix* got, const tl_prefix* want, const char* what) {
    uint32_t L, W;
    tl_prefix_info(want, NULL, &L, &W, NULL);
    for (uint32_t depth = 1; depth <= L; depth++)
        for (size_t n_suffix = 0; n_suffix <= N_SUFFIX; n_suffix += N_SUFFIX)
            for (int sampled = 0; sampled < 2; sampled++) {
                const tl_gen_params gp = tu_gen_params(MAX_NEW, depth, W, sampled, SEED);
                tu_result a = tu_from_prefix(got, suffix, n_suffix, &gp, V);
                tu_result b = tu_from_prefix(want, suffix, n_suffix, &gp, V);
                tu_result c = tu_generate(m, prompt, N_PROMPT + n_suffix, &gp, V);
                CHECK(tu_same_result(&a, &b), "%s: loops=%u suffix %zu sampled %d: differs from the saved prefix", what,
                      depth, n_suffix, sampled);
                CHECK(tu_same_result(&a, &c), "%s: loops=%u suffix %zu sampled %d: differs from tl_generate", what,
                      depth, n_suffix, sampled);
                tu_result_free(&a);
                tu_result_free(&b);
                tu_result_free(&c);
            }
}

/* ---- round trips ---------------------------------------------------------------------------- */

/* A blob without the kept states (as a backend without a part pass saves a warm-start prefix):
 * flags bit 1 cleared, the states and injected terms cut off. */
static tu_blob without_states(tu_blob b, uint32_t d, int injection) {
    CHECK(tu_get_u32(b.bytes + 52) == 3, "a warm-start blob from the CPU has states (flags %u)",
          tu_get_u32(b.bytes + 52));
    tu_blob out = {malloc(b.n), b.n - (size_t)N_PROMPT * d * 4 * (injection ? 2 : 1)};
    memcpy(out.bytes, b.bytes, out.n);
    tu_put_u32(out.bytes + 52, 1);
    tu_put_u64(out.bytes + 16, out.n);
    tu_fix_checksum(out.bytes, out.n);
    return out;
}

/* Save, load, compare; into `other` (another kv_block_size) too; a warm-start prefix extends
 * as the saved one does, from its states and from a blob without them. */
static void check_round_trip(tl_model* m, tl_model* other, const tu_spec* spec, uint32_t L_b, uint32_t W,
                             uint32_t flags) {
    char what[96];
    snprintf(what, sizeof what, "loops %u window %u%s", L_b, W, flags ? " warm" : "");
    tl_prefix* p = build(m, L_b, W, flags);
    tu_blob b = tu_save(p);
    tl_prefix* q = tu_load(m, b);
    check_generations(m, q, p, what);
    CHECK(tl_prefix_warm_start(q) == tl_prefix_warm_start(p), "%s: warm start lost", what);
    size_t nq, np;
    tl_prefix_info(q, NULL, NULL, NULL, &nq);
    tl_prefix_info(p, NULL, NULL, NULL, &np);
    CHECK(nq == np, "%s: loaded nbytes %zu, saved %zu", what, nq, np);
    tu_blob again = tu_save(q);
    CHECK(tu_same_blob(again, b), "%s: saving the loaded prefix gives other bytes", what);

    tl_prefix* r = tu_load(other, b); /* paged into other blocks: the same generations */
    char other_what[128];
    snprintf(other_what, sizeof other_what, "%s, other block size", what);
    check_generations(other, r, p, other_what);
    tu_blob from_other = tu_save(r);
    tl_prefix* back = tu_load(m, from_other);
    check_generations(m, back, p, other_what);
    tl_prefix_free(back);
    free(from_other.bytes);

    if (flags & TL_PREFIX_WARM_START) {
        const uint32_t L = L_b + 2;
        tu_blob bare = without_states(b, spec->d, spec->injection || spec->core_cycles);
        tl_prefix* rebuilt = tu_load(m, bare);
        CHECK(tl_prefix_warm_start(rebuilt), "%s: a blob without states loads as warm start", what);
        tu_blob bare_again = tu_save(rebuilt);
        CHECK(tu_same_blob(bare_again, bare), "%s: a blob without states saves back differently", what);
        CHECK_OK(tl_prefix_extend(p, L, 3));
        CHECK_OK(tl_prefix_extend(q, L, 5));
        CHECK_OK(tl_prefix_extend(r, L, 0));
        CHECK_OK(tl_prefix_extend(rebuilt, L, 0));
        tu_blob want = tu_save(p), got = tu_save(q);
        CHECK(tu_same_blob(got, want), "%s: the loaded prefix extended differs from the saved one extended", what);
        snprintf(other_what, sizeof other_what, "%s, extended", what);
        check_generations(m, q, p, other_what);
        check_generations(other, r, p, other_what);
        check_generations(m, rebuilt, p, other_what);
        free(want.bytes);
        free(got.bytes);
        free(bare.bytes);
        free(bare_again.bytes);
        tl_prefix_free(rebuilt);
    }
    free(again.bytes);
    free(b.bytes);
    tl_prefix_free(r);
    tl_prefix_free(q);
    tl_prefix_free(p);
}

/* ---- refusals ------------------------------------------------------------------------------- */

static void check_bad(tl_model* m, const uint8_t* bytes, size_t n, const char* want, const char* what) {
    tl_prefix* p = (tl_prefix*)&p; /* not NULL: the failed load must clear it */
    const tl_status st = tl_prefix_load(m, bytes, n, &p);
    CHECK(st == TL_ERR_BAD_FILE && p == NULL, "%s: status %d (%s)", what, st, tl_last_error());
    CHECK(strstr(tl_last_error(), want) != NULL, "%s: message \"%s\" lacks \"%s\"", what, tl_last_error(), want);
}

static void test_arguments(tl_model* m, const char* path) {
    tl_prefix* p = build(m, 2, 0, 0);
    tu_blob b = tu_save(p);
    size_t size = 0;
    CHECK_STATUS(tl_prefix_save(NULL, NULL, 0, &size), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_save(p, NULL, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    uint8_t* small = malloc(b.n);
    memset(small, 0xab, b.n);
    CHECK_STATUS(tl_prefix_save(p, small, b.n - 1, &size), TL_ERR_INVALID_ARGUMENT);
    CHECK(size == b.n, "cap too small: *size %zu, want %zu", size, b.n);
    CHECK(small[0] == 0xab, "cap too small: the buffer was written");
    CHECK(strstr(tl_last_error(), "cap") != NULL, "cap too small: message %s", tl_last_error());
    free(small);
    tl_prefix* q = NULL;
    CHECK_STATUS(tl_prefix_load(m, b.bytes, b.n, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_load(m, NULL, b.n, &q), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_load(NULL, b.bytes, b.n, &q), TL_ERR_INVALID_ARGUMENT);
    CHECK(q == NULL, "a refused load set *out");

    tl_model* closing = tu_open(path, 1, TL_ISA_AUTO, 4);
    tl_prefix* orphan = build(closing, 1, 0, 0);
    tl_model_close(closing);
    CHECK_STATUS(tl_prefix_save(orphan, NULL, 0, &size), TL_ERR_CLOSED);
    CHECK_STATUS(tl_prefix_load(closing, b.bytes, b.n, &q), TL_ERR_CLOSED);
    tl_prefix_free(orphan);
    tl_model_free(closing);
    tl_prefix_free(p);
    free(b.bytes);
}

/* A blob of another model (other weights: another checksum), of the other KV mode. */
static void test_identity(tl_model* m8, tl_model* m4, tl_model* other_weights) {
    tl_prefix* p = build(m8, 2, 6, TL_PREFIX_WARM_START);
    tu_blob b = tu_save(p);
    check_bad(other_weights, b.bytes, b.n, "this prefix was saved from another model (checksum 0x", "other weights");
    check_bad(m4, b.bytes, b.n, "saved with kv_mode int8; this model runs int4", "int8 blob, int4 model");
    tl_prefix* p4 = build(m4, 2, 6, TL_PREFIX_WARM_START);
    tu_blob b4 = tu_save(p4);
    CHECK(tu_get_u32(b4.bytes + 40) == 1 && b4.n < b.n, "an int4 blob: kv_mode %u, %zu bytes (int8: %zu)",
          tu_get_u32(b4.bytes + 40), b4.n, b.n);
    check_bad(m8, b4.bytes, b4.n, "saved with kv_mode int4; this model runs int8", "int4 blob, int8 model");
    free(b4.bytes);
    free(b.bytes);
    tl_prefix_free(p4);
    tl_prefix_free(p);
}

/* ---- the loader under mutation -------------------------------------------------------------- */

/* b: a warm-start blob with states of the injection model: 9 tokens, window 6, loops 1, so
 * kv_start > 0. */
static void test_mutations(tl_model* m, tu_blob b, uint32_t d) {
    const int loaded = tu_mutate(tu_try_load, m, b.bytes, b.n, 5, 2000);
    printf("mutations of a %zu-byte blob: %d of the checksum-fixed ones still load\n", b.n, loaded);

    const uint32_t n = tu_get_u32(b.bytes + 56), n_layers = tu_get_u32(b.bytes + 72), G = tu_get_u32(b.bytes + 76);
    const uint32_t kv_start = tu_get_u32(b.bytes + 64), R = tu_get_u32(b.bytes + 80); /* int8: R = D */
    const size_t kv_at = HEADER + 4 * (size_t)n + 4 * (size_t)tu_get_u32(b.bytes + 44) * d;
    const size_t last_record = kv_at + ((size_t)n_layers * (n - kv_start) * G - 1) * (2 * R + 8);
    CHECK(kv_start > 0, "the mutation blob has kv_start %u", kv_start);
    uint8_t* x = malloc(b.n);
    const tu_field cases[] = {
        {0, 1, (uint8_t)~"TLPREFIX"[0], "bad magic"},
        {8, 4, 3, "version: unsupported 3"},
        {8, 4, 2, "has no warm start"}, /* version 2 is a hidden-state prefix */
        {12, 4, 95, "header_bytes"},
        {16, 8, b.n + 1, "blob_bytes: header says"},
        {28, 4, tu_get_u32(b.bytes + 28) ^ 1, "saved from another model (checksum"},
        {32, 8, tu_get_u64(b.bytes + 32) + 64, "saved from another model (file_bytes"},
        {40, 4, 7, "kv_mode: unknown 7"},
        {76, 4, G + 1, "n_kv_heads"},
        {80, 4, R + 2, "head_dim"},
        {84, 4, d + 1, "d_model"},
        {44, 4, 0, "loops: 0"},
        {44, 4, 1025, "loops: 1025"},
        {44, 4, 2, "n_layers"},
        {72, 4, n_layers + 1, "n_layers"},
        {52, 4, 5, "flags: unknown bits 0x4"},
        {52, 4, 2, "flags: states (bit 1) without warm start"},
        {52, 4, 1, "blob_bytes"},
        {56, 8, 0, "n_tokens: 0"},
        {56, 8, 97, "n_tokens: 97"},
        {56, 8, (uint64_t)1 << 62, "n_tokens"},
        {64, 8, kv_start + 1, "kv_start"},
        {64, 8, kv_start - 1, "blob_bytes"},
        {88, 4, 1, "storage: 1, must be 0 (kv) in a version-1 blob"},
        {92, 4, 1u << 24, "instruction: 16777216 exceeds the prefix's 9 tokens"},
        {92, 4, 10, "instruction: 10 exceeds the prefix's 9 tokens"},
        {HEADER + 4 * 3, 4, V, "tokens[3]"},
        {HEADER + 4 * 5, 4, 0xffffffffu, "tokens[5]: -1"},
        {kv_at + 1, 1, 0x80, "the key row holds -128"},
        {last_record + R + R - 1, 1, 0x80, "the value row holds -128"},
        {last_record + 2 * R, 4, 0xbf800000u, "the key scale is -1"},
        {last_record + 2 * R + 4, 4, 0x7fc00000u, "the value scale is nan"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tu_field* c = &cases[i];
        memcpy(x, b.bytes, b.n);
        tu_set_field(x, c);
        if (c->at != 16) tu_fix_checksum(x, b.n);
        char what[48];
        snprintf(what, sizeof what, "field at %zu", c->at);
        check_bad(m, x, b.n, c->message, what);
    }
    memcpy(x, b.bytes, b.n); /* a record's rows are checked before its scales (§7.4) */
    tu_put_u32(x + last_record + 2 * R, 0xbf800000u);
    x[last_record + R] = 0x80;
    tu_fix_checksum(x, b.n);
    check_bad(m, x, b.n, "the value row holds -128", "a bad key scale and a bad value row");
    memcpy(x, b.bytes, b.n); /* +inf scales are allowed (a row of infinities) */
    tu_put_u32(x + last_record + 2 * R, 0x7f800000u);
    tu_fix_checksum(x, b.n);
    CHECK(tu_try_load(m, x, b.n, "+inf scale", 0), "a +inf scale was refused: %s", tl_last_error());
    free(x);
}

/* The same rules on int4 rows: the nibble -8 in either half of a byte is refused. */
static void test_int4_nibbles(tl_model* m4) {
    tl_prefix* p = build(m4, 1, 0, 0);
    tu_blob b = tu_save(p);
    const size_t kv_at = HEADER + 4 * (size_t)N_PROMPT + 4 * (size_t)tu_get_u32(b.bytes + 84); /* loops 1 */
    const uint8_t bad_bytes[2] = {0x08, 0x80};
    for (int k = 0; k < 2; k++) {
        uint8_t* x = malloc(b.n);
        memcpy(x, b.bytes, b.n);
        x[kv_at + 2] = bad_bytes[k];
        tu_fix_checksum(x, b.n);
        check_bad(m4, x, b.n, "the key row holds the nibble -8", "int4 nibble");
        x[kv_at + 2] = 0x77; /* 7, 7: fine */
        tu_fix_checksum(x, b.n);
        CHECK(tu_try_load(m4, x, b.n, "int4 nibbles 7", 0), "int4 nibbles 7 refused: %s", tl_last_error());
        free(x);
    }
    free(b.bytes);
    tl_prefix_free(p);
}

/* ---- a save while the prefix is extended ---------------------------------------------------- */

typedef struct saver {
    tl_prefix* prefix;
    tu_blob before, after; /* the blobs of the prefix at L_b and at L */
    atomic_int started, done;
    int runs, wrong, retries;
} saver;

/* Save until the extension is done, then once more; every blob is `before` or `after`. */
static void* save_while_extending(void* arg) {
    saver* s = arg;
    atomic_store(&s->started, 1);
    for (int after = 0; after < 2; s->runs++) {
        after += atomic_load(&s->done) != 0;
        size_t n = 0, got = 0;
        CHECK_OK(tl_prefix_save(s->prefix, NULL, 0, &n));
        uint8_t* bytes = malloc(n);
        tl_status st;
        while ((st = tl_prefix_save(s->prefix, bytes, n, &got)) == TL_ERR_INVALID_ARGUMENT) { /* it grew */
            s->retries++;
            bytes = realloc(bytes, got);
            n = got;
        }
        CHECK_OK(st);
        const tu_blob b = {bytes, got};
        s->wrong += !tu_same_blob(b, s->before) && !tu_same_blob(b, s->after);
        free(bytes);
    }
    return NULL;
}

static void test_concurrent(tl_model* m) {
    enum { L_B = 2, L = 40 };
    tl_prefix* want = build(m, L, 0, TL_PREFIX_WARM_START);
    tl_prefix* p = build(m, L_B, 0, TL_PREFIX_WARM_START);
    saver s = {.prefix = p, .before = tu_save(p), .after = tu_save(want)};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, save_while_extending, &s) == 0, "pthread_create");
    while (!atomic_load(&s.started)) sched_yield();
    CHECK_OK(tl_prefix_extend(p, L, 1));
    atomic_store(&s.done, 1);
    pthread_join(thread, NULL);
    CHECK(s.wrong == 0, "%d of %d saves during an extension are neither the old nor the new prefix", s.wrong, s.runs);
    printf("concurrent: %d saves around the extension, %d retried after it grew\n", s.runs, s.retries);
    free(s.before.bytes);
    free(s.after.bytes);
    tl_prefix_free(p);
    tl_prefix_free(want);
}

/* ---- models --------------------------------------------------------------------------------- */

static tl_model* open_mode(const char* path, uint32_t block_size, tl_kv_mode mode) {
    tl_model_params mp = tl_model_params_default();
    mp.n_threads = 2;
    mp.kv_block_size = block_size;
    mp.kv_mode = mode;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &mp, &m));
    return m;
}

static void test_model(const char* name, const tu_spec* spec, int full) {
    const char* path = tu_write_model(name, spec);
    tl_model* m = open_mode(path, 4, TL_KV_INT8);
    tl_model* other = open_mode(path, 3, TL_KV_INT8); /* other blocks */
    V = spec->vocab;
    static const uint32_t windows[] = {0, 6, 1}; /* window 1 keeps no block of the prefix */
    for (size_t i = 0; i < sizeof windows / sizeof windows[0]; i++)
        for (uint32_t flags = 0; flags <= TL_PREFIX_WARM_START; flags++)
            check_round_trip(m, other, spec, 2, windows[i], flags);
    if (full) {
        tl_model* m4 = open_mode(path, 4, TL_KV_INT4);
        tl_model* other4 = open_mode(path, 16, TL_KV_INT4);
        check_round_trip(m4, other4, spec, 2, 6, TL_PREFIX_WARM_START);
        check_round_trip(m4, other4, spec, 3, 0, 0);
        tu_spec reseeded = *spec;
        reseeded.seed++;
        tl_model* other_weights = open_mode(tu_write_model("reseeded.tinyloop", &reseeded), 4, TL_KV_INT8);
        test_identity(m, m4, other_weights);
        test_int4_nibbles(m4);
        test_arguments(m, path);
        tl_prefix* p = NULL; /* of 9 tokens: the sweep is quadratic in the blob's size */
        CHECK_OK(tl_prefix_build_ex(m, prompt, 9, 1, 6, 0, TL_PREFIX_WARM_START, &p));
        tu_blob b = tu_save(p);
        test_mutations(m, b, spec->d);
        free(b.bytes);
        tl_prefix_free(p);
        test_concurrent(m);
        tl_model_free(other_weights);
        tl_model_free(other4);
        tl_model_free(m4);
    }
    tl_model_free(other);
    tl_model_free(m);
    printf("%s: done\n", name);
}

int main(void) {
    const tu_spec huginn = tu_spec_huginn(), plain_spec = tu_spec_default(), coda = tu_spec_coda();
    for (int i = 0; i < N_PROMPT + N_SUFFIX; i++) prompt[i] = (i * 37 + 11) % 256;
    test_model("huginn.tinyloop", &huginn, 1); /* prelude, core of 2 with injection and step norm, coda */
    test_model("default.tinyloop", &plain_spec, 0);
    test_model("coda.tinyloop", &coda, 0);
    const tu_spec hrm = tu_spec_hrm(); /* warm start keeps the low states as injects (§7.2) */
    test_model("hrm.tinyloop", &hrm, 0);
    return tu_finish("test_prefix_blob");
}
