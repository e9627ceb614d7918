/* test_prefix_warm.c — warm start: tl_prefix_build_ex(TL_PREFIX_WARM_START) and
 * tl_prefix_extend (docs/spec.md §5.4).
 *
 * On a Huginn-like model (prelude, core of 2 with injection and step norm, coda with coda_norm,
 * sandwich blocks), one with a step norm and no coda (post-norm blocks), one with a coda and no
 * prelude, and an HRM-like one (a two-state core, whose kept low states change with the depth;
 * the attention gate), all GQA, windows 0 and 6, and chunkings that differ between build and
 * extension: a prefix built at L_b and extended to L equals one built at L bit for bit — its KV
 * (every written slot of every live block), its last token's states, its tokens' kept states
 * and injected terms or low states —
 * and every generation from it at every depth L' <= L (with and without a suffix, greedy and
 * sampled) equals the built one's, tokens and logits; extending twice equals one build;
 * extending to <= its depth changes nothing; a prefix built without the flag is refused with
 * the message naming the flag; bad arguments are refused; a warm-start prefix without kept
 * states (a backend without a part pass) extends by rebuilding, to the same prefix; a
 * generation running from the prefix while another thread extends it gets its tokens, and a
 * sequence taken before keeps its blocks; an allocation failure anywhere in a warm build or an
 * extension leaks nothing and leaves the prefix as it was. This test links the library's
 * objects (tl_alloc_fail_after, the prefix's internals). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "core/seq.h"
#include "test_util.h"

enum { N_PROMPT = 29, N_SUFFIX = 3, MAX_NEW = 5, SEED = 7 };

static int32_t prompt[N_PROMPT + N_SUFFIX]; /* the prefix's tokens, then a suffix */
static const int32_t* const suffix = prompt + N_PROMPT;
static uint32_t V, D;

static tl_prefix* build(tl_model* m, uint32_t loops, uint32_t window, size_t chunk, uint32_t flags) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, N_PROMPT, loops, window, chunk, flags, &p));
    return p;
}

static size_t nbytes_of(const tl_prefix* p) {
    size_t nbytes;
    tl_prefix_info(p, NULL, NULL, NULL, &nbytes);
    return nbytes;
}

/* Whether two prefixes hold the same KV: the same spans, and in every live block the same
 * bytes in every slot a position was written to, in every layer (a block's unused slots are
 * never written, nor read). */
static int same_kv(const tl_prefix* a, const tl_prefix* b) {
    const tl_kv_geom* g = &a->engine->kv_geom;
    if (a->kv.n_spans != b->kv.n_spans || a->kv.first_live != b->kv.first_live) return 0;
    for (size_t i = a->kv.first_live; i < a->kv.n_spans; i++) {
        const tl_kv_span* x = &a->kv.spans[i];
        const tl_kv_span* y = &b->kv.spans[i];
        if (x->start != y->start || x->count != y->count || x->block->n_layers != y->block->n_layers) return 0;
        for (uint32_t l = 0; l < x->block->n_layers; l++)
            for (uint32_t h = 0; h < g->n_kv_heads; h++) {
                const size_t kv = (size_t)x->count * g->head_dim, scales = x->count * sizeof(float);
                if (memcmp(tl_kv_keys(g, x->block, l, h), tl_kv_keys(g, y->block, l, h), kv) ||
                    memcmp(tl_kv_values(g, x->block, l, h), tl_kv_values(g, y->block, l, h), kv) ||
                    memcmp(tl_kv_key_scales(g, x->block, l, h), tl_kv_key_scales(g, y->block, l, h), scales) ||
                    memcmp(tl_kv_value_scales(g, x->block, l, h), tl_kv_value_scales(g, y->block, l, h), scales))
                    return 0;
            }
    }
    return 1;
}

/* Whether two [n][d] arrays that may be NULL are both NULL or hold the same bits. */
static int same_rows(const float* a, const float* b, size_t n) {
    return a && b ? tu_same_bits(a, b, n * D) : a == b;
}

/* got (extended) equals want (built at its depth), inside and in everything generated from
 * it at every depth; both of the same depth, tokens and window, and built the same way (with
 * kept states or without). */
static void check_equal(const tl_prefix* got, const tl_prefix* want, const char* what) {
    const uint32_t L = want->loops, W = want->window;
    CHECK(got->loops == L && got->window == W && got->n == want->n, "%s: shape", what);
    CHECK(same_kv(got, want), "%s: KV differs", what);
    CHECK(tu_same_bits(got->loop_states, want->loop_states, (size_t)L * D), "%s: loop states differ", what);
    CHECK(same_rows(got->states, want->states, want->n), "%s: kept states differ", what);
    CHECK(same_rows(got->injects, want->injects, want->n), "%s: injected terms differ", what);
    CHECK(nbytes_of(got) == nbytes_of(want), "%s: nbytes %zu, want %zu", what, nbytes_of(got), nbytes_of(want));
    for (uint32_t depth = 1; depth <= L; depth++)
        for (size_t n_suffix = 0; n_suffix <= N_SUFFIX; n_suffix += N_SUFFIX) {
            const tl_gen_params gp = tu_gen_params(MAX_NEW, depth, W, depth % 2, SEED);
            tu_result a = tu_from_prefix(got, suffix, n_suffix, &gp, V);
            tu_result b = tu_from_prefix(want, suffix, n_suffix, &gp, V);
            CHECK(tu_same_result(&a, &b), "%s: generation at loops=%u, suffix %zu differs", what, depth, n_suffix);
            tu_result_free(&a);
            tu_result_free(&b);
        }
}

/* L_b -> L by tl_prefix_extend equals a build at L, warm-start or not; and so does
 * L_b -> L1 -> L in two steps. */
static void check_extension(tl_model* m, uint32_t L_b, uint32_t L1, uint32_t L, uint32_t W) {
    char what[96];
    snprintf(what, sizeof what, "loops %u -> %u, window %u", L_b, L, W);
    tl_prefix* want = build(m, L, W, 6, TL_PREFIX_WARM_START);
    tl_prefix* plain = build(m, L, W, 0, 0);
    tl_prefix* got = build(m, L_b, W, 5, TL_PREFIX_WARM_START);
    CHECK_OK(tl_prefix_extend(got, L, 4));
    check_equal(got, want, what);
    const size_t kept = (want->injects ? 2 : 1) * sizeof(float) * N_PROMPT * D;
    CHECK(nbytes_of(want) == nbytes_of(plain) + kept, "%s: warm start keeps %zu bytes, want %zu", what,
          nbytes_of(want) - nbytes_of(plain), kept);
    CHECK(same_kv(got, plain), "%s: KV differs from a build without warm start", what);
    const tl_gen_params gp = tu_gen_params(MAX_NEW, L, W, 1, SEED);
    tu_result a = tu_from_prefix(got, suffix, N_SUFFIX, &gp, V), b = tu_from_prefix(plain, suffix, N_SUFFIX, &gp, V);
    CHECK(tu_same_result(&a, &b), "%s: generation differs from a build without warm start", what);
    tu_result_free(&a);
    tu_result_free(&b);
    tl_prefix_free(got);

    snprintf(what, sizeof what, "loops %u -> %u -> %u, window %u", L_b, L1, L, W);
    got = build(m, L_b, W, 0, TL_PREFIX_WARM_START);
    CHECK_OK(tl_prefix_extend(got, L1, 0));
    CHECK_OK(tl_prefix_extend(got, L, 3));
    check_equal(got, want, what);
    tl_prefix_free(got);
    tl_prefix_free(plain);
    tl_prefix_free(want);
}

/* Extending to a depth <= the prefix's changes nothing; a prefix without warm start is refused
 * (and so is a deeper sequence from it); bad arguments. */
static void test_refusals(tl_model* m) {
    tl_prefix* warm = build(m, 3, 0, 0, TL_PREFIX_WARM_START);
    const tl_kv_span* spans = warm->kv.spans;
    const size_t nbytes = nbytes_of(warm);
    for (uint32_t loops = 0; loops <= 3; loops++) {
        CHECK_OK(tl_prefix_extend(warm, loops, 0));
        CHECK(warm->loops == 3 && warm->kv.spans == spans && nbytes_of(warm) == nbytes, "extend to %u changed it",
              loops);
    }
    CHECK(tl_prefix_warm_start(warm) == 1, "warm start not reported");
    tl_seq* s = NULL;
    CHECK_STATUS(tl_seq_from_prefix(warm, 4, &s), TL_ERR_LOOPS_MISMATCH);
    CHECK(s == NULL, "a refused sequence was returned");
    CHECK(strcmp(tl_last_error(), "loops mismatch: prefix built at loops=3, requested 4 (a prefix serves loops <= "
                                  "its own; tl_prefix_extend deepens it)") == 0,
          "message: %s", tl_last_error());
    CHECK_STATUS(tl_prefix_extend(NULL, 4, 0), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_prefix_extend(warm, 1025, 0), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "loops > 1024") != NULL, "message: %s", tl_last_error());
    CHECK(warm->loops == 3 && warm->kv.spans == spans, "a refused extension changed the prefix");
    tl_prefix_free(warm);

    tl_prefix* cold = build(m, 2, 0, 0, 0);
    CHECK(tl_prefix_warm_start(cold) == 0 && tl_prefix_warm_start(NULL) == 0, "warm start reported");
    CHECK_OK(tl_prefix_extend(cold, 2, 0));
    CHECK_STATUS(tl_prefix_extend(cold, 4, 0), TL_ERR_LOOPS_MISMATCH);
    CHECK(strcmp(tl_last_error(), "loops mismatch: prefix built at loops=2, requested 4 (a prefix serves loops <= "
                                  "its own; build it with TL_PREFIX_WARM_START to extend it)") == 0,
          "message: %s", tl_last_error());
    CHECK(cold->loops == 2, "a refused extension changed the prefix");
    tl_prefix_free(cold);

    tl_prefix* p = (tl_prefix*)1;
    CHECK_STATUS(tl_prefix_build_ex(m, prompt, N_PROMPT, 2, 0, 0, 8, &p), TL_ERR_INVALID_ARGUMENT);
    CHECK(p == NULL && strstr(tl_last_error(), "unknown prefix flags 0x8") != NULL, "message: %s", tl_last_error());
    CHECK_STATUS(tl_prefix_build_ex(m, prompt, N_PROMPT, 2, 0, 0, TL_PREFIX_WARM_START, NULL), TL_ERR_INVALID_ARGUMENT);
}

/* A warm-start prefix that keeps no states, as a backend without a part pass builds it,
 * extends by rebuilding itself: the prefix a build makes. */
static void test_rebuild(tl_model* m) {
    tl_prefix* got = build(m, 2, 6, 0, TL_PREFIX_WARM_START);
    tl_free(got->states);
    tl_free(got->injects);
    got->states = got->injects = NULL;
    CHECK_OK(tl_prefix_extend(got, 5, 3));
    tl_prefix* want = build(m, 5, 6, 0, 0);
    check_equal(got, want, "rebuilt");
    tl_prefix_free(want);
    tl_prefix_free(got);
}

/* tl_prefix_extend after tl_model_close: "model was closed". */
static void test_closed(const char* path) {
    tl_model* m = tu_open(path, 1, TL_ISA_AUTO, 4);
    tl_prefix* p = build(m, 1, 0, 0, TL_PREFIX_WARM_START);
    tl_model_close(m);
    CHECK_STATUS(tl_prefix_extend(p, 2, 0), TL_ERR_CLOSED);
    CHECK(p->loops == 1, "a refused extension changed the prefix");
    tl_prefix_free(p);
    tl_model_free(m);
}

/* ---- an extension while generations run from the prefix ------------------------------------ */

typedef struct reader {
    tl_prefix* prefix;
    uint32_t loops;
    tu_result want;      /* of a generation at `loops` from the prefix as built        */
    atomic_int started;  /* set by the reader before its first generation               */
    atomic_int done;     /* set once the extension returned                             */
    int during, runs, wrong; /* generations wholly inside the extension; all; wrong ones */
} reader;

/* Generate at r->loops from the prefix until the extension is done, then twice more. */
static void* read_while_extending(void* arg) {
    reader* r = arg;
    const tl_gen_params gp = tu_gen_params(MAX_NEW, r->loops, 0, 1, SEED);
    atomic_store(&r->started, 1);
    for (int after = 0; after < 2; r->runs++) {
        const int inside = !atomic_load(&r->done);
        after += !inside;
        tu_result got = tu_from_prefix(r->prefix, suffix, N_SUFFIX, &gp, V);
        r->during += inside && !atomic_load(&r->done);
        r->wrong += !tu_same_result(&got, &r->want);
        tu_result_free(&got);
    }
    return NULL;
}

static void test_concurrent(tl_model* m) {
    enum { L_B = 2, L = 48 };
    tl_prefix* want = build(m, L, 0, 0, 0);
    tl_prefix* p = build(m, L_B, 0, 0, TL_PREFIX_WARM_START);
    const tl_gen_params shallow = tu_gen_params(MAX_NEW, L_B, 0, 1, SEED);
    tl_seq* before = NULL; /* taken before the extension: keeps its blocks */
    CHECK_OK(tl_seq_from_prefix(p, L_B, &before));
    reader r = {.prefix = p, .loops = L_B, .want = tu_from_prefix(p, suffix, N_SUFFIX, &shallow, V)};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, read_while_extending, &r) == 0, "pthread_create");
    while (!atomic_load(&r.started)) sched_yield();
    CHECK_OK(tl_prefix_extend(p, L, 1)); /* chunks of one token: a long extension */
    atomic_store(&r.done, 1);
    pthread_join(thread, NULL);
    CHECK(r.wrong == 0, "%d of %d generations around the extension differ", r.wrong, r.runs);
    printf("concurrent: %d of %d generations ran wholly during the extension\n", r.during, r.runs);
    tu_result_free(&r.want);

    /* the sequence taken before decodes exactly as one taken from a prefix built at L_b */
    tl_prefix* shallow_prefix = build(m, L_B, 0, 0, 0);
    tl_seq* fresh = NULL;
    CHECK_OK(tl_seq_from_prefix(shallow_prefix, L_B, &fresh));
    float* a = calloc(V, sizeof(float));
    float* b = calloc(V, sizeof(float));
    CHECK_OK(tl_seq_decode(before, prompt[N_PROMPT], a));
    CHECK_OK(tl_seq_decode(fresh, prompt[N_PROMPT], b));
    CHECK(tu_same_bits(a, b, V), "a sequence taken before the extension decodes differently");
    CHECK(before->kv.spans[0].block != p->kv.spans[0].block &&
              before->kv.spans[0].block->n_layers == fresh->kv.spans[0].block->n_layers,
          "a sequence taken before the extension lost its blocks");
    free(a);
    free(b);
    tl_seq_free(fresh);
    tl_seq_free(before);
    tl_prefix_free(shallow_prefix);

    const tl_gen_params deep = tu_gen_params(MAX_NEW, L, 0, 1, SEED);
    tu_result got = tu_from_prefix(p, suffix, N_SUFFIX, &deep, V);
    tu_result exp = tu_from_prefix(want, suffix, N_SUFFIX, &deep, V);
    CHECK(tu_same_result(&got, &exp), "after a concurrent extension: generation at loops=%d differs", L);
    tu_result_free(&got);
    tu_result_free(&exp);
    tl_prefix_free(p);
    tl_prefix_free(want);
}

/* ---- allocation failures ------------------------------------------------------------------ */

static void check_oom(tl_status st, const char* what, size_t k) {
    CHECK(st == TL_ERR_OUT_OF_MEMORY, "%s, k=%zu: status %d: %s", what, k, st, tl_last_error());
    CHECK(strstr(tl_last_error(), "out of memory") != NULL, "%s, k=%zu: message %s", what, k, tl_last_error());
}

/* Every allocation of a warm build, then of an extension, failing in turn: the call fails with
 * "out of memory", frees what it allocated, and the prefix stays as built (its bytes, and what
 * is generated from it); then the extension succeeds and equals a build. */
static void test_alloc_failures(tl_model* m, uint32_t W) {
    enum { L_B = 2, L = 4 };
    size_t baseline = tu_memory().bytes_in_use, before = tu_memory().total_allocs;
    tl_prefix_free(build(m, L_B, W, 5, TL_PREFIX_WARM_START));
    size_t n_allocs = tu_memory().total_allocs - before;
    for (size_t k = 0; k < n_allocs; k++) {
        tl_prefix* p = NULL;
        tl_alloc_fail_after((int64_t)k);
        const tl_status st = tl_prefix_build_ex(m, prompt, N_PROMPT, L_B, W, 5, TL_PREFIX_WARM_START, &p);
        tl_alloc_fail_after(-1);
        check_oom(st, "warm build", k);
        CHECK(p == NULL && tu_memory().bytes_in_use == baseline, "warm build, k=%zu: %zu bytes leaked", k,
              tu_memory().bytes_in_use - baseline);
    }
    printf("warm build (window %u): %zu allocations, each failed in turn\n", W, n_allocs);

    tl_prefix* p = build(m, L_B, W, 5, TL_PREFIX_WARM_START);
    tl_prefix* probe = build(m, L_B, W, 5, TL_PREFIX_WARM_START);
    before = tu_memory().total_allocs;
    CHECK_OK(tl_prefix_extend(probe, L, 3));
    n_allocs = tu_memory().total_allocs - before;
    tl_prefix_free(probe);
    const tl_gen_params gp = tu_gen_params(MAX_NEW, L_B, W, 1, SEED);
    tu_result want = tu_from_prefix(p, suffix, N_SUFFIX, &gp, V);
    const size_t nbytes = nbytes_of(p);
    baseline = tu_memory().bytes_in_use;
    for (size_t k = 0; k < n_allocs; k++) {
        tl_alloc_fail_after((int64_t)k);
        const tl_status st = tl_prefix_extend(p, L, 3);
        tl_alloc_fail_after(-1);
        check_oom(st, "extension", k);
        CHECK(tu_memory().bytes_in_use == baseline, "extension, k=%zu: %zu bytes leaked", k,
              tu_memory().bytes_in_use - baseline);
        CHECK(p->loops == L_B && nbytes_of(p) == nbytes, "extension, k=%zu: the prefix changed", k);
        tu_result got = tu_from_prefix(p, suffix, N_SUFFIX, &gp, V);
        CHECK(tu_same_result(&got, &want), "extension, k=%zu: generation from the prefix changed", k);
        tu_result_free(&got);
    }
    printf("extension (window %u): %zu allocations, each failed in turn\n", W, n_allocs);
    tu_result_free(&want);
    CHECK_OK(tl_prefix_extend(p, L, 3));
    tl_prefix* built = build(m, L, W, 0, TL_PREFIX_WARM_START);
    check_equal(p, built, "extension after failures");
    tl_prefix_free(built);
    tl_prefix_free(p);
}

/* ---- models ------------------------------------------------------------------------------- */

static void test_model(const char* name, const tu_spec* spec, int full) {
    const char* path = tu_write_model(name, spec);
    tl_model* m = tu_open(path, 2, TL_ISA_AUTO, 4);
    V = spec->vocab;
    D = spec->d;
    for (uint32_t W = 0; W <= 6; W += 6) {
        check_extension(m, 1, 2, 3, W);
        check_extension(m, 2, 4, 6, W);
    }
    if (full) {
        test_refusals(m);
        test_rebuild(m);
        test_concurrent(m);
        test_alloc_failures(m, 0);
        test_alloc_failures(m, 6);
        test_closed(path);
    }
    tl_model_free(m);
    printf("%s: done\n", name);
}

int main(void) {
    for (int i = 0; i < N_PROMPT + N_SUFFIX; i++) prompt[i] = (i * 37 + 11) % 256;
    const tu_spec huginn = tu_spec_huginn(); /* prelude, core of 2 with injection and step norm, coda */
    test_model("huginn.tinyloop", &huginn, 1);
    tu_spec step_norm = tu_spec_default();
    step_norm.step_norm = 1;
    step_norm.layout = 2;
    test_model("step_norm.tinyloop", &step_norm, 0);
    const tu_spec coda = tu_spec_coda();
    test_model("coda.tinyloop", &coda, 0);
    const tu_spec hrm = tu_spec_hrm(); /* a two-state core: the kept low states change with the depth */
    test_model("hrm.tinyloop", &hrm, 1);
    return tu_finish("test_prefix_warm");
}
