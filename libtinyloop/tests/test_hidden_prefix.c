/* test_hidden_prefix.c — hidden-state prefixes (TL_PREFIX_STORE_H8 / _H4, docs/spec.md §5.4.1).
 *
 * The rows: tl_hidden_capture against this file's own reading of §2.2 / §2.3 (libm rint, a
 * plain max) on random rows and on zero, tiny, NaN and infinite ones, h8 and h4, bit for bit.
 * On a plain model, a Huginn-like one (prelude, core of 2 with injection, coda with coda_norm)
 * and one with a coda and no prelude, windows 0, 6 and 1, build chunks 0, 4 and 1: an h8 prefix
 * generates (every depth <= L_b, with and without a suffix, greedy and sampled; and
 * tl_seq_from_prefix's first logits and a decode) exactly what the kv prefix and tl_generate
 * do, on a model of 3 threads and blocks of 4 and on a scalar one of 1 thread and blocks of 3.
 * An h4 prefix (int8 and int4 KV) gives the same on both models and every chunking, and not
 * the kv prefix's logits. tl_prefix_info counts the rows (the formula of §5.4.1), the KV of a
 * kv prefix being larger. Refused: both flags, warm start, an unknown flag, rows as large as
 * the KV (GQA with one kv head; h8 over int4 KV), with messages naming that. Many threads
 * generating from one h8 prefix at once get the kv prefix's results. A prefix of 1030 tokens
 * rebuilds in several chunks of rows, also from a window's h_start, as the kv prefix. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/hidden.h"
#include "test_util.h"

enum { N_PROMPT = 23, N_SUFFIX = 3, MAX_NEW = 5, SEED = 7, N_THREADS = 4 };

static int32_t prompt[N_PROMPT + N_SUFFIX]; /* the prefix's tokens, then a suffix */
static const int32_t* const suffix = prompt + N_PROMPT;
static uint32_t V;

static tl_model* open_model(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size, tl_kv_mode mode) {
    tl_model_params mp = tl_model_params_default();
    mp.n_threads = threads;
    mp.isa = isa;
    mp.kv_block_size = block_size;
    mp.kv_mode = mode;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &mp, &m));
    return m;
}

static tl_prefix* build(tl_model* m, uint32_t loops, uint32_t window, size_t chunk, uint32_t flags) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, N_PROMPT, loops, window, chunk, flags, &p));
    return p;
}

/* ---- the rows, against an independent reading of the spec ---------------------------------- */

/* §2.2 Q(x, qmax) as written there, with libm's rint (round half to even). */
static float spec_q(const float* x, size_t n, int qmax, int* q) {
    const float amax = tu_spec_amax(x, n);
    if (amax < 0x1p-64f) {
        for (size_t i = 0; i < n; i++) q[i] = 0;
        return 0.0f;
    }
    const float r = (float)qmax / amax;
    for (size_t i = 0; i < n; i++) {
        float v = x[i] * r;
        v = v >= (float)-qmax ? v : (float)-qmax;
        v = v <= (float)qmax ? v : (float)qmax;
        q[i] = (int)rintf(v);
    }
    return amax / (float)qmax;
}

/* The record of §5.4.1 for row x[d]: q as stored (h4 packed, low nibble first) and a. */
static float spec_record(const float* x, size_t d, int h4, float eps, uint8_t* stored) {
    int q[64];
    const float s = spec_q(x, d, h4 ? 7 : 127, q);
    const float a = tu_spec_nq_scale(q, d, s, eps);
    for (size_t i = 0; i < d; i++) {
        if (!h4) stored[i] = (uint8_t)(int8_t)q[i];
        else if (i % 2 == 0) stored[i / 2] = (uint8_t)(q[i] & 15);
        else stored[i / 2] |= (uint8_t)((q[i] & 15) << 4);
    }
    return a;
}

static void test_rows(void) {
    enum { D = 48, ROWS = 9, LAYERS = 2 };
    const float eps = 1e-5f;
    static float x[ROWS][D];
    uint64_t rng = 3;
    for (size_t t = 0; t < ROWS; t++)
        for (size_t i = 0; i < D; i++) x[t][i] = (float)tu_uniform(&rng, -100000, 100000) * 1e-3f;
    memset(x[1], 0, sizeof x[1]);                                  /* zero: q = 0, a = 0 */
    for (size_t i = 0; i < D; i++) x[2][i] = 1e-21f * (float)i;    /* below 2^-64 */
    x[3][5] = NAN;                                                 /* a NaN among finite values */
    x[4][7] = INFINITY;                                            /* a = NaN */
    for (size_t i = 0; i < D; i++) x[5][i] = NAN;                  /* all NaN: a tiny row */
    for (size_t i = 0; i < D; i++) x[6][i] = (float)(i % 15) - 7.5f; /* halves: ties to even */
    x[7][0] = 3e38f;                                               /* huge */
    for (int h4 = 0; h4 < 2; h4++) {
        for (uint32_t window = 0; window <= 4; window += 4) { /* window 4 of 9: positions 6 .. 8 */
            tl_hidden_rows* h = tl_hidden_new(h4 ? TL_STORE_H4 : TL_STORE_H8, LAYERS, D, ROWS, window, eps);
            CHECK(h != NULL, "tl_hidden_new");
            if (!h) return;
            const size_t start = window ? ROWS - window + 1 : 0, r = h4 ? D / 2 : D;
            CHECK(h->start == start && h->row_bytes == r, "h_start %zu row_bytes %zu", h->start, h->row_bytes);
            CHECK(tl_hidden_bytes(h) == LAYERS * (ROWS - start) * (r + 4), "tl_hidden_bytes %zu", tl_hidden_bytes(h));
            tl_hidden_capture(h, 1, 0, 4, &x[0][0]); /* in two calls, as two chunks */
            tl_hidden_capture(h, 1, 4, ROWS - 4, &x[4][0]);
            for (size_t p = start; p < ROWS; p++) {
                uint8_t want[D];
                const float a = spec_record(x[p], D, h4, eps, want);
                const size_t row = (ROWS - start) + (p - start); /* slot 1 */
                CHECK(memcmp(h->q + row * r, want, r) == 0, "h%d window %u position %zu: q differs", h4 ? 4 : 8,
                      window, p);
                CHECK(memcmp(&h->a[row], &a, sizeof a) == 0 || (isnan(a) && isnan(h->a[row])),
                      "h%d window %u position %zu: a %a, want %a", h4 ? 4 : 8, window, p, h->a[row], a);
                CHECK(h->a[p - start] == 0.0f, "slot 0 was written");
            }
            tl_hidden_free(h);
        }
    }
}

/* ---- generations ---------------------------------------------------------------------------- */

/* Every generation from got equals want's (from another prefix, maybe of another model of the
 * same file) and, with `plain`, tl_generate's on `plain`; or, with same = 0, differs from
 * want's in at least one. */
static void check_generations(const tl_prefix* got, const tl_prefix* want, tl_model* plain, int same,
                              const char* what) {
    uint32_t L, W;
    tl_prefix_info(want, NULL, &L, &W, NULL);
    int differ = 0;
    for (uint32_t depth = 1; depth <= L; depth++)
        for (size_t n_suffix = 0; n_suffix <= N_SUFFIX; n_suffix += N_SUFFIX)
            for (int sampled = 0; sampled < 2; sampled++) {
                const tl_gen_params gp = tu_gen_params(MAX_NEW, depth, W, sampled, SEED);
                tu_result a = tu_from_prefix(got, suffix, n_suffix, &gp, V);
                tu_result b = tu_from_prefix(want, suffix, n_suffix, &gp, V);
                differ += !tu_same_result(&a, &b);
                if (same)
                    CHECK(tu_same_result(&a, &b), "%s: loops=%u suffix %zu sampled %d: differs", what, depth, n_suffix,
                          sampled);
                if (plain) {
                    tu_result c = tu_generate(plain, prompt, N_PROMPT + n_suffix, &gp, V);
                    CHECK(tu_same_result(&a, &c), "%s: loops=%u suffix %zu sampled %d: differs from tl_generate",
                          what, depth, n_suffix, sampled);
                    tu_result_free(&c);
                }
                tu_result_free(&a);
                tu_result_free(&b);
            }
    if (!same) CHECK(differ > 0, "%s: every generation equals the kv prefix's", what);
}

/* tl_seq_from_prefix at every depth: the first logits and a decode's equal want's. */
static void check_seqs(const tl_prefix* got, const tl_prefix* want, const char* what) {
    uint32_t L;
    tl_prefix_info(want, NULL, &L, NULL, NULL);
    float* logits = malloc(4 * (size_t)V * sizeof(float));
    for (uint32_t depth = 1; depth <= L; depth++) {
        tl_seq* s[2] = {NULL, NULL};
        CHECK_OK(tl_seq_from_prefix(got, depth, &s[0]));
        CHECK_OK(tl_seq_from_prefix(want, depth, &s[1]));
        for (int k = 0; k < 2 && s[k]; k++) {
            CHECK_OK(tl_seq_last_logits(s[k], logits + (size_t)k * 2 * V));
            CHECK_OK(tl_seq_decode(s[k], suffix[0], logits + (size_t)(k * 2 + 1) * V));
        }
        CHECK(tu_same_bits(logits, logits + 2 * (size_t)V, 2 * (size_t)V), "%s: loops=%u: a sequence's logits differ",
              what, depth);
        tl_seq_free(s[0]);
        tl_seq_free(s[1]);
    }
    free(logits);
}

/* n_layers(L_b) * (n - h_start) * (r + 4) + 4 L_b d + 4 n (docs/spec.md §5.4.1, tinyloop.h). */
static void check_bytes(const tl_prefix* p, const tu_spec* spec, uint32_t L_b, uint32_t W, size_t r) {
    const size_t n_layers = spec->n_pre + (size_t)L_b * (tu_core_width(spec->n_core, spec->core_cycles) + spec->n_coda);
    const size_t h_start = W == 0 || N_PROMPT < W ? 0 : N_PROMPT - W + 1;
    const size_t want = n_layers * (N_PROMPT - h_start) * (r + 4) + 4 * (size_t)L_b * spec->d + 4 * (size_t)N_PROMPT;
    size_t got = 0;
    tl_prefix_info(p, NULL, NULL, NULL, &got);
    CHECK(got == want, "nbytes %zu, want %zu (r %zu, window %u)", got, want, r, W);
}

typedef struct reader {
    const tl_prefix* got;
    const tl_prefix* want;
    int wrong;
} reader;

static void* read_prefix(void* arg) {
    reader* r = arg;
    for (uint32_t depth = 1; depth <= 2; depth++) {
        const tl_gen_params gp = tu_gen_params(MAX_NEW, depth, 0, 1, SEED + depth);
        tu_result a = tu_from_prefix(r->got, suffix, N_SUFFIX, &gp, V);
        tu_result b = tu_from_prefix(r->want, suffix, N_SUFFIX, &gp, V);
        r->wrong += !tu_same_result(&a, &b);
        tu_result_free(&a);
        tu_result_free(&b);
    }
    return NULL;
}

static void test_concurrent(const tl_prefix* h8, const tl_prefix* kv) {
    pthread_t threads[N_THREADS];
    reader readers[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        readers[i] = (reader){h8, kv, 0};
        CHECK(pthread_create(&threads[i], NULL, read_prefix, &readers[i]) == 0, "pthread_create");
    }
    int wrong = 0;
    for (int i = 0; i < N_THREADS; i++) {
        pthread_join(threads[i], NULL);
        wrong += readers[i].wrong;
    }
    CHECK(wrong == 0, "%d generations from a shared h8 prefix differ from the kv prefix's", wrong);
}

/* ---- the blob (version 2, docs/spec.md §7) ------------------------------------------------ */

enum { HEADER = 96 };

/* Save p (storage 1 h8, 2 h4; window W), check the header and size of §7.1 / §7.2, load it into
 * m and into other (other blocks, another ISA): the same generations, sequences and nbytes,
 * and the same bytes saved again from both. */
static void check_round_trip(tl_model* m, tl_model* other, const tu_spec* spec, const tl_prefix* p, uint32_t storage,
                             uint32_t L_b, uint32_t W, const char* what) {
    tu_blob b = tu_save(p);
    const size_t n_layers = spec->n_pre + (size_t)L_b * (tu_core_width(spec->n_core, spec->core_cycles) + spec->n_coda);
    const size_t h_start = W == 0 || N_PROMPT < W ? 0 : N_PROMPT - W + 1, r = storage == 2 ? spec->d / 2 : spec->d;
    const size_t want = HEADER + 4 * N_PROMPT + 4 * (size_t)L_b * spec->d + n_layers * (N_PROMPT - h_start) * (r + 4);
    CHECK(b.n == want, "%s: blob of %zu bytes, want %zu", what, b.n, want);
    CHECK(tu_get_u32(b.bytes + 8) == 2 && tu_get_u32(b.bytes + 88) == storage && tu_get_u64(b.bytes + 64) == h_start,
          "%s: version %u, storage %u, kv_start %llu", what, tu_get_u32(b.bytes + 8), tu_get_u32(b.bytes + 88),
          (unsigned long long)tu_get_u64(b.bytes + 64));
    tl_model* models[2] = {m, other};
    for (int k = 0; k < 2; k++) {
        tl_prefix* q = tu_load(models[k], b);
        CHECK((uint32_t)tl_prefix_storage_get(q) == storage, "%s: loaded storage %d", what,
              (int)tl_prefix_storage_get(q));
        check_generations(q, p, NULL, 1, what);
        check_seqs(q, p, what);
        size_t nq, np;
        tl_prefix_info(q, NULL, NULL, NULL, &nq);
        tl_prefix_info(p, NULL, NULL, NULL, &np);
        CHECK(nq == np, "%s: loaded nbytes %zu, saved %zu", what, nq, np);
        tu_blob again = tu_save(q);
        CHECK(tu_same_blob(again, b), "%s: saving the loaded prefix (model %d) gives other bytes", what, k);
        free(again.bytes);
        tl_prefix_free(q);
    }
    free(b.bytes);
}

/* The reader under mutation on a v2 blob of 9 tokens, loops 1, window 6 (kv_start 4): every
 * truncation (also made consistent), a flip of every byte (with and without the checksum fixed
 * up), each field set to a bad value, and the rules of the records. */
static void test_mutations(tl_model* m, uint32_t storage, uint32_t d) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, 9, 1, 6, 0, storage == 1 ? TL_PREFIX_STORE_H8 : TL_PREFIX_STORE_H4, &p));
    const tu_blob b = tu_save(p);
    tl_prefix_free(p);
    const int loaded = tu_mutate(tu_try_load, m, b.bytes, b.n, 9, 0);
    printf("h%d blob of %zu bytes: %d checksum-fixed flips still load\n", storage == 1 ? 8 : 4, b.n, loaded);
    const size_t kv_at = HEADER + 4 * 9 + 4 * (size_t)d, r = storage == 1 ? d : d / 2;
    const size_t last = b.n - (r + 4); /* the last record */
    uint8_t* x = malloc(b.n);
    const tu_field cases[] = {
        {8, 4, 3, "version: unsupported 3"},
        {8, 4, 1, "must be 0 (kv) in a version-1 blob"},
        {88, 4, 3, "storage: unknown 3"},
        {88, 4, 0, "storage: unknown 0"},
        {88, 4, 3 - storage, "blob_bytes"},
        {92, 4, 10, "instruction: 10 exceeds the prefix's 9 tokens"},
        {92, 4, 9, NULL}, /* an instruction block of every token */
        {52, 4, 1, "has no warm start"},
        {64, 8, 3, "stores from h_start 4"},
        {64, 8, 5, "kv_start: 5, must be <= 4"},
        {kv_at + 1, 1, 0x80, storage == 1 ? "slot 0, position 4: the row holds -128"
                                          : "slot 0, position 4: the row holds the nibble -8"},
        {last + 2, 1, storage == 1 ? 0x80 : 0x08, storage == 1 ? "slot 1, position 8: the row holds -128"
                                                               : "slot 1, position 8: the row holds the nibble -8"},
        {last + 2, 1, 0x77, NULL},
        {last + r, 4, 0xbf800000u, "slot 1, position 8: the scale is -1"},
        {last + r, 4, 0x80000000u, NULL}, /* -0 is not negative */
        {last + r, 4, 0x7fc00000u, NULL}, /* NaN and +inf: after non-finite activations */
        {last + r, 4, 0x7f800000u, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tu_field* c = &cases[i];
        memcpy(x, b.bytes, b.n);
        tu_set_field(x, c);
        tu_fix_checksum(x, b.n);
        tl_prefix* q = (tl_prefix*)&q;
        const tl_status st = tl_prefix_load(m, x, b.n, &q);
        if (!c->message) {
            CHECK(st == TL_OK, "h%u field at %zu = 0x%llx: refused: %s", storage, c->at, (unsigned long long)c->value,
                  tl_last_error());
        } else {
            CHECK(st == TL_ERR_BAD_FILE && q == NULL, "h%u field at %zu: status %d", storage, c->at, st);
            CHECK(strstr(tl_last_error(), c->message), "h%u field at %zu: message \"%s\" lacks \"%s\"", storage, c->at,
                  tl_last_error(), c->message);
        }
        if (st == TL_OK) tl_prefix_free(q);
    }
    free(x);
    free(b.bytes);
}

/* ---- models --------------------------------------------------------------------------------- */

static void test_model(const char* name, const tu_spec* spec, int full) {
    const char* path = tu_write_model(name, spec);
    tl_model* m = open_model(path, 3, TL_ISA_AUTO, 4, TL_KV_INT8);
    tl_model* scalar = open_model(path, 1, TL_ISA_SCALAR, 3, TL_KV_INT8);
    V = spec->vocab;
    const uint32_t L_b = 3;
    static const uint32_t windows[] = {0, 6, 1};
    static const size_t chunks[] = {0, 4, 1};
    for (size_t w = 0; w < sizeof windows / sizeof windows[0]; w++) {
        const uint32_t W = windows[w];
        char what[96];
        tl_prefix* kv = build(m, L_b, W, 5, 0);
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            tl_prefix* h8 = build(c % 2 ? scalar : m, L_b, W, chunks[c], TL_PREFIX_STORE_H8);
            CHECK(tl_prefix_storage_get(h8) == TL_STORE_H8, "storage %d", (int)tl_prefix_storage_get(h8));
            snprintf(what, sizeof what, "%s h8 window %u chunk %zu", name, W, chunks[c]);
            check_generations(h8, kv, c == 0 ? m : NULL, 1, what);
            check_seqs(h8, kv, what);
            check_bytes(h8, spec, L_b, W, spec->d);
            if (c == 0 && W == 0) test_concurrent(h8, kv);
            tl_prefix_free(h8);
        }
        tl_prefix* h8 = build(m, L_b, W, 0, TL_PREFIX_STORE_H8);
        snprintf(what, sizeof what, "%s h8 blob window %u", name, W);
        check_round_trip(m, scalar, spec, h8, 1, L_b, W, what);
        tl_prefix_free(h8);
        tl_prefix* h4 = build(m, L_b, W, 4, TL_PREFIX_STORE_H4);
        tl_prefix* h4_scalar = build(scalar, L_b, W, 1, TL_PREFIX_STORE_H4);
        snprintf(what, sizeof what, "%s h4 blob window %u", name, W);
        check_round_trip(m, scalar, spec, h4, 2, L_b, W, what);
        snprintf(what, sizeof what, "%s h4 window %u", name, W);
        check_generations(h4_scalar, h4, NULL, 1, what);
        check_seqs(h4_scalar, h4, what);
        check_bytes(h4, spec, L_b, W, spec->d / 2);
        if (W != 1) check_generations(h4, kv, NULL, 0, what); /* window 1: the rows are never read */
        tl_prefix_free(h4_scalar);
        tl_prefix_free(h4);
        tl_prefix_free(kv);
    }
    if (full) { /* int4 KV: h4 only (h8's rows would be larger than the KV) */
        tl_model* m4 = open_model(path, 2, TL_ISA_AUTO, 4, TL_KV_INT4);
        tl_model* scalar4 = open_model(path, 1, TL_ISA_SCALAR, 5, TL_KV_INT4);
        tl_prefix* h4 = build(m4, L_b, 6, 0, TL_PREFIX_STORE_H4);
        tl_prefix* h4_scalar = build(scalar4, L_b, 6, 3, TL_PREFIX_STORE_H4);
        tl_prefix* kv4 = build(m4, L_b, 6, 0, 0);
        check_generations(h4_scalar, h4, NULL, 1, "int4 KV h4");
        check_generations(h4, kv4, NULL, 0, "int4 KV h4");
        check_round_trip(m4, scalar4, spec, h4, 2, L_b, 6, "int4 KV h4 blob");
        size_t kv_bytes = 0, h_bytes = 0;
        tl_prefix_info(kv4, NULL, NULL, NULL, &kv_bytes);
        tl_prefix_info(h4, NULL, NULL, NULL, &h_bytes);
        CHECK(h_bytes < kv_bytes, "int4 KV: h4 prefix of %zu bytes, kv %zu", h_bytes, kv_bytes);
        tl_prefix* p = (tl_prefix*)&p;
        CHECK_STATUS(tl_prefix_build_ex(m4, prompt, N_PROMPT, 1, 0, 0, TL_PREFIX_STORE_H8, &p),
                     TL_ERR_INVALID_ARGUMENT);
        CHECK(p == NULL, "a refused build set *out");
        char want[128];
        snprintf(want, sizeof want, "h8 prefixes take %u bytes per layer and position, the KV %u (%u kv heads of %u)",
                 spec->d + 4, 2 * spec->kv_heads * (spec->head_dim / 2 + 4), spec->kv_heads, spec->head_dim);
        CHECK(strstr(tl_last_error(), want), "message \"%s\" lacks \"%s\"", tl_last_error(), want);
        tl_prefix_free(kv4);
        tl_prefix_free(h4_scalar);
        tl_prefix_free(h4);
        tl_model_free(scalar4);
        tl_model_free(m4);
    }
    tl_model_free(scalar);
    tl_model_free(m);
    printf("%s: done\n", name);
}

/* A prefix longer than tl_hidden_rebuild's chunks of rows (512): windows 0 and 600 (h_start 431),
 * its sequences' first logits and a decode's equal the kv prefix's at every depth. */
static void test_long(void) {
    enum { N = 1030 };
    tu_spec spec = tu_spec_default();
    spec.max_seq = N + 8;
    tl_model* m = open_model(tu_write_model("long.tinyloop", &spec), 2, TL_ISA_AUTO, 16, TL_KV_INT8);
    static int32_t tokens[N];
    for (int i = 0; i < N; i++) tokens[i] = (i * 37 + 11) % (int32_t)spec.vocab;
    float* logits = malloc(4 * (size_t)spec.vocab * sizeof(float));
    static const uint32_t windows[] = {0, 600};
    for (size_t w = 0; w < 2; w++) {
        tl_prefix *kv = NULL, *h8 = NULL;
        CHECK_OK(tl_prefix_build_ex(m, tokens, N, 2, windows[w], 256, 0, &kv));
        CHECK_OK(tl_prefix_build_ex(m, tokens, N, 2, windows[w], 0, TL_PREFIX_STORE_H8, &h8));
        for (uint32_t depth = 1; kv && h8 && depth <= 2; depth++) {
            const tl_prefix* from[2] = {h8, kv};
            for (int k = 0; k < 2; k++) {
                tl_seq* q = NULL;
                CHECK_OK(tl_seq_from_prefix(from[k], depth, &q));
                CHECK_OK(tl_seq_last_logits(q, logits + (size_t)k * 2 * spec.vocab));
                CHECK_OK(tl_seq_decode(q, tokens[0], logits + (size_t)(k * 2 + 1) * spec.vocab));
                tl_seq_free(q);
            }
            CHECK(tu_same_bits(logits, logits + 2 * (size_t)spec.vocab, 2 * (size_t)spec.vocab),
                  "%d tokens, window %u, loops=%u: an h8 sequence's logits differ from the kv prefix's", N, windows[w],
                  depth);
        }
        tl_prefix_free(h8);
        tl_prefix_free(kv);
    }
    free(logits);
    tl_model_free(m);
}

static void check_refused(tl_model* m, uint32_t flags, const char* want) {
    tl_prefix* p = (tl_prefix*)&p;
    CHECK_STATUS(tl_prefix_build_ex(m, prompt, N_PROMPT, 1, 0, 0, flags, &p), TL_ERR_INVALID_ARGUMENT);
    CHECK(p == NULL, "flags 0x%x: a refused build set *out", flags);
    CHECK(strstr(tl_last_error(), want), "flags 0x%x: message \"%s\" lacks \"%s\"", flags, tl_last_error(), want);
}

static void test_refusals(void) {
    tu_spec spec = tu_spec_default();
    tl_model* m = open_model(tu_write_model("default.tinyloop", &spec), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    check_refused(m, TL_PREFIX_STORE_H8 | TL_PREFIX_STORE_H4, "exclude each other");
    check_refused(m, TL_PREFIX_STORE_H8 | TL_PREFIX_WARM_START, "has no warm start");
    check_refused(m, TL_PREFIX_STORE_H4 | TL_PREFIX_WARM_START, "has no warm start");
    check_refused(m, 8, "unknown prefix flags 0x8");
    tl_prefix* kv = build(m, 1, 0, 0, 0);
    CHECK(tl_prefix_storage_get(kv) == TL_STORE_KV && tl_prefix_storage_get(NULL) == TL_STORE_KV, "kv storage");
    tl_prefix_free(kv);
    test_mutations(m, 1, spec.d);
    test_mutations(m, 2, spec.d);
    spec.kv_heads = 1; /* GQA: the KV of one kv head takes 2 (12 + 4) = 32 bytes, an h8 row 52 */
    tl_model* gqa = open_model(tu_write_model("gqa.tinyloop", &spec), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    check_refused(gqa, TL_PREFIX_STORE_H8,
                  "h8 prefixes take 52 bytes per layer and position, the KV 32 (1 kv heads of 12): use the kv storage");
    tl_prefix* h4 = build(gqa, 1, 0, 0, TL_PREFIX_STORE_H4); /* 28 bytes: fine */
    CHECK(tl_prefix_storage_get(h4) == TL_STORE_H4, "h4 storage");
    tl_prefix_free(h4);
    tl_model_free(gqa);
    tl_model_free(m);
}

int main(void) {
    const tu_spec huginn = tu_spec_huginn(), plain_spec = tu_spec_default(), coda = tu_spec_coda();
    for (int i = 0; i < N_PROMPT + N_SUFFIX; i++) prompt[i] = (i * 41 + 5) % 256;
    test_rows();
    test_refusals();
    test_long();
    test_model("huginn.tinyloop", &huginn, 1);
    test_model("default.tinyloop", &plain_spec, 1);
    test_model("coda.tinyloop", &coda, 0);
    const tu_spec hrm = tu_spec_hrm(); /* a two-state core's slots, the attention gate's rows */
    test_model("hrm.tinyloop", &hrm, 0);
    return tu_finish("test_hidden_prefix");
}
