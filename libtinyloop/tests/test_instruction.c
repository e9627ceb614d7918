/* test_instruction.c — the prefix-LM instruction block (docs/spec.md §4.1, §4.2, §4.3, §5.4,
 * §5.5, §7.1, §7.6) through the public API, on small random models (a plain one, an HRM-like
 * two-state one with a coda): the mask (a query inside the block sees a later instruction token,
 * one after it does not see later tokens), every prefill chunking giving identical logits (a
 * chunk smaller than the block grows to it), tl_generate, batches and a scheduler (whose
 * step_tokens the block passes) against the sequence path, the automatic prefix cache (a tree
 * per instruction length; a hit ending inside the block is no hit) and its disk tier, prefixes
 * (build, generation, blob round trip and reader rule, warm-start extension), and the refused
 * arguments. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

enum { N = 14, V = 256, LOOPS = 2, MAX_TOKENS = 6 };

static const int32_t prompt[N] = {5, 17, 99, 3, 200, 41, 7, 77, 150, 12, 8, 64, 33, 250};

/* logits_all [n][V] of tokens run into a new sequence with instruction length P, in chunks. */
static float* prefill_logits(tl_model* m, const int32_t* tokens, size_t n, size_t P, uint32_t window,
                             size_t chunk) {
    float* out = calloc(n * V, sizeof(float));
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, LOOPS, window, &s));
    CHECK_OK(tl_seq_set_instruction(s, P));
    CHECK(tl_seq_instruction(s) == P, "tl_seq_instruction %zu, set %zu", tl_seq_instruction(s), P);
    CHECK_OK(tl_seq_prefill_all(s, tokens, n, chunk, out));
    tl_seq_free(s);
    return out;
}

static tl_gen_params params_with(size_t P, uint32_t window) {
    tl_gen_params gp = tu_gen_params(MAX_TOKENS, LOOPS, window, 1, 7);
    gp.instruction_length = P;
    return gp;
}

static tu_result generate(tl_model* m, const int32_t* tokens, size_t n, size_t P, uint32_t window) {
    const tl_gen_params gp = params_with(P, window);
    return tu_generate(m, tokens, n, &gp, V);
}

/* ---- the mask and chunking ------------------------------------------------------------------- */

static void test_mask(tl_model* m, const char* name) {
    enum { P = 7, CHANGED = 5 };
    int32_t other[N];
    memcpy(other, prompt, sizeof other);
    other[CHANGED] = 123; /* a later instruction token than position 2 */
    for (uint32_t window = 0; window <= 3; window += 3) {
        float* base = prefill_logits(m, prompt, N, P, window, 0);
        float* changed = prefill_logits(m, other, N, P, window, 0);
        float* causal = prefill_logits(m, prompt, N, 0, window, 0);
        float* causal_changed = prefill_logits(m, other, N, 0, window, 0);
        /* bidirectional inside the block: position 2 sees the token at 5 */
        CHECK(!tu_same_bits(base + 2 * V, changed + 2 * V, V), "%s W=%u: position 2 ignores instruction token 5",
              name, window);
        CHECK(tu_same_bits(causal + 2 * V, causal_changed + 2 * V, V), "%s W=%u: causal position 2 sees token 5", name,
              window);
        CHECK(!tu_same_bits(base, causal, V), "%s W=%u: position 0 of the block is causal", name, window);
        /* every chunking, the chunks smaller than the block grown to it */
        for (size_t chunk = 1; chunk <= N; chunk++) {
            float* got = prefill_logits(m, prompt, N, P, window, chunk);
            CHECK(tu_same_bits(base, got, (size_t)N * V), "%s W=%u: chunks of %zu differ", name, window, chunk);
            free(got);
        }
        /* an instruction block of the whole prompt, run in chunks of 1 (one grown chunk) */
        float* all = prefill_logits(m, prompt, N, N, window, 0);
        float* all1 = prefill_logits(m, prompt, N, N, window, 1);
        CHECK(tu_same_bits(all, all1, (size_t)N * V), "%s W=%u: P = n in chunks of 1", name, window);
        free(all), free(all1);
        /* P = 0 is the causal sequence of tl_seq_create */
        tl_seq* s = NULL;
        float* plain = calloc((size_t)N * V, sizeof(float));
        CHECK_OK(tl_seq_create(m, LOOPS, window, &s));
        CHECK_OK(tl_seq_prefill_all(s, prompt, N, 3, plain));
        CHECK(tu_same_bits(plain, causal, (size_t)N * V), "%s W=%u: P = 0 is not causal", name, window);
        tl_seq_free(s);
        free(plain), free(base), free(changed), free(causal), free(causal_changed);
    }
}

/* A sequence continues an instruction block by decodes and forks as one prefilled whole. */
static void test_seq_continue(tl_model* m) {
    enum { P = 9 };
    float* whole = prefill_logits(m, prompt, N, P, 0, 0);
    tl_seq* s = NULL;
    float logits[V];
    CHECK_OK(tl_seq_create(m, LOOPS, 0, &s));
    CHECK_OK(tl_seq_set_instruction(s, P));
    CHECK_OK(tl_seq_prefill(s, prompt, P + 1, 2, logits));
    CHECK(tu_same_bits(logits, whole + P * V, V), "prefill of P + 1 tokens");
    tl_seq* f = NULL;
    CHECK_OK(tl_seq_fork(s, &f));
    CHECK(tl_seq_instruction(f) == P, "a fork's instruction length %zu", tl_seq_instruction(f));
    for (size_t t = P + 1; t < N; t++) {
        CHECK_OK(tl_seq_decode(f, prompt[t], logits));
        CHECK(tu_same_bits(logits, whole + t * V, V), "decode at %zu", t);
    }
    tl_seq_free(f), tl_seq_free(s), free(whole);
}

/* tl_generate's first logits are the sequence path's last ones, for every prefill chunk;
 * speculative decoding and a batch give the same. */
static void test_generate(tl_model* m) {
    enum { P = 9 };
    float* whole = prefill_logits(m, prompt, N, P, 0, 0);
    tu_result ref = generate(m, prompt, N, P, 0);
    CHECK(tu_same_bits(ref.logits, whole + (N - 1) * V, V), "tl_generate's first logits");
    for (size_t chunk = 0; chunk <= 4; chunk++) {
        tl_gen_params gp = params_with(P, 0);
        gp.prefill_chunk = chunk;
        tu_result r = tu_generate(m, prompt, N, &gp, V);
        CHECK(tu_same_result(&ref, &r), "tl_generate with prefill_chunk %zu", chunk);
        tu_result_free(&r);
    }
    tl_gen_params spec = params_with(P, 0);
    spec.n_draft = 3, spec.draft_loops = 1;
    tu_result r = tu_generate(m, prompt, N, &spec, V);
    CHECK(tu_same_result(&ref, &r), "speculative decoding");
    tu_result_free(&r);
    /* a batch: the block's request beside a causal one */
    tu_result a = tu_result_new(MAX_TOKENS, V), b = tu_result_new(MAX_TOKENS, V);
    const tl_gen_params pa = params_with(P, 0), pb = params_with(0, 0);
    tl_request ra = {sizeof ra, NULL, prompt, N, &pa, a.tokens, a.logits, 0};
    tl_request rb = {sizeof rb, NULL, prompt, N - 2, &pb, b.tokens, b.logits, 0};
    tl_request* reqs[2] = {&ra, &rb};
    CHECK_OK(tl_generate_batch(m, reqs, 2));
    a.n = ra.n_out, b.n = rb.n_out;
    tu_result rb_ref = generate(m, prompt, N - 2, 0, 0);
    CHECK(tu_same_result(&ref, &a) && tu_same_result(&rb_ref, &b), "a batch");
    tu_result_free(&a), tu_result_free(&b), tu_result_free(&rb_ref), tu_result_free(&ref), free(whole);
}

/* A scheduler whose step_tokens the instruction block passes: the tokens of tl_generate. */
static void test_sched(tl_model* m) {
    enum { P = 11, REQS = 3 };
    const size_t Ps[REQS] = {P, 0, 5};
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 2, sp.step_tokens = 4;
    tl_gen_params gp[REQS];
    const tl_gen_params* each[REQS];
    size_t n[REQS];
    for (size_t i = 0; i < REQS; i++) {
        gp[i] = params_with(Ps[i], 0);
        gp[i].prefill_chunk = 0;
        each[i] = &gp[i], n[i] = N - i;
    }
    CHECK(tu_sched_agrees(m, &sp, prompt, n, each, REQS, V), "the scheduler with instruction lengths 11, 0, 5");
}

/* ---- the automatic prefix cache -------------------------------------------------------------- */

static uint64_t hits_of(tl_model* m) { return tu_cache_stats(m).hit_tokens; }

/* A generation on the cached model `c`: equal to the cache-less one's on `m`, with `hit` cached
 * positions. */
static void cached_case(tl_model* c, tl_model* m, const int32_t* tokens, size_t P, uint64_t hit, const char* what) {
    const uint64_t before = hits_of(c);
    tu_result got = generate(c, tokens, N, P, 0), want = generate(m, tokens, N, P, 0);
    CHECK(tu_same_result(&got, &want), "%s: tokens or logits differ from a cache-less run", what);
    CHECK(hits_of(c) - before == hit, "%s: %llu positions hit, want %llu", what,
          (unsigned long long)(hits_of(c) - before), (unsigned long long)hit);
    tu_result_free(&got), tu_result_free(&want);
}

static void test_prefix_cache(const char* path, tl_model* m) {
    tl_model* c = tu_open_cached(path, 1 << 22); /* blocks of 4: floor(13 / 4) = 3 cacheable */
    int32_t inside[N], past[N];
    memcpy(inside, prompt, sizeof inside);
    memcpy(past, prompt, sizeof past);
    inside[8] = 111; /* shares blocks 0 and 1 (8 positions), differs in the block of P = 9 */
    past[12] = 111;  /* shares all three blocks */
    cached_case(c, m, prompt, 9, 0, "first, P=9");
    cached_case(c, m, prompt, 9, 12, "again, P=9");
    cached_case(c, m, prompt, 0, 0, "P=0 (another tree)");
    cached_case(c, m, prompt, 6, 0, "P=6 (another tree)");
    cached_case(c, m, inside, 9, 0, "two shared blocks end inside P=9");
    cached_case(c, m, past, 9, 12, "three shared blocks pass P=9");
    cached_case(c, m, prompt, 6, 12, "again, P=6");
    cached_case(c, m, prompt, 0, 12, "again, P=0");
    tl_model_free(c);
}

/* The disk tier: blocks spilled from the P tree at close are read back by P, not by P = 0. */
static void remove_dir(const char* dir) {
    DIR* d = opendir(dir);
    for (struct dirent* e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char file[512];
        snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
        unlink(file);
    }
    if (d) closedir(d);
    rmdir(dir);
}

static tl_model* open_tiered(const char* path, const char* dir) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2, p.kv_block_size = 4, p.prefix_cache_bytes = 1 << 22, p.prefix_cache_dir = dir;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &p, &m));
    return m;
}

static void test_disk_tier(const char* path, tl_model* m) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/tltest-instr-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    tl_model* c = open_tiered(path, dir);
    cached_case(c, m, prompt, 9, 0, "disk: first, P=9");
    tl_model_free(c); /* spills the P=9 tree */
    c = open_tiered(path, dir);
    cached_case(c, m, prompt, 0, 0, "disk: P=0 finds no P=9 file");
    CHECK(tu_cache_stats(c).disk_hit_blocks == 0, "disk: P=0 read %llu blocks",
          (unsigned long long)tu_cache_stats(c).disk_hit_blocks);
    cached_case(c, m, prompt, 9, 12, "disk: P=9 reads its files");
    CHECK(tu_cache_stats(c).disk_hit_blocks == 3, "disk: P=9 read %llu blocks",
          (unsigned long long)tu_cache_stats(c).disk_hit_blocks);
    tl_model_free(c);
    remove_dir(dir);
}

/* ---- prefixes -------------------------------------------------------------------------------- */

static tl_prefix* build(tl_model* m, size_t n, size_t P, uint32_t loops, uint32_t window, size_t chunk,
                        uint32_t flags) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_instruction(m, prompt, n, P, loops, window, chunk, flags, &p));
    return p;
}

/* Generations from p (its n tokens, instruction length P) equal tl_generate of the whole prompt. */
static void check_from_prefix(tl_model* m, const tl_prefix* p, size_t n, size_t P, uint32_t window, const char* what) {
    CHECK(tl_prefix_instruction(p) == P, "%s: tl_prefix_instruction %zu, want %zu", what, tl_prefix_instruction(p), P);
    tl_gen_params gp = params_with(0, window);
    gp.loops = 0;
    tu_result got = tu_from_prefix(p, prompt + n, N - n, &gp, V), want = generate(m, prompt, N, P, window);
    CHECK(tu_same_result(&got, &want), "%s: from the prefix != tl_generate", what);
    tu_result_free(&got), tu_result_free(&want);
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_from_prefix(p, 0, &s));
    CHECK(tl_seq_instruction(s) == P, "%s: a sequence from the prefix has P %zu", what, tl_seq_instruction(s));
    tl_seq_free(s);
}

static void test_prefix(tl_model* m) {
    enum { NP = 10, P = 6 };
    for (uint32_t window = 0; window <= 5; window += 5) {
        tl_prefix* p = build(m, NP, P, LOOPS, window, 1, 0);
        check_from_prefix(m, p, NP, P, window, "built");
        tu_blob b = tu_save(p);
        CHECK(tu_get_u32(b.bytes + 92) == P, "the blob's instruction %u", tu_get_u32(b.bytes + 92));
        tl_prefix* q = tu_load(m, b);
        if (q) check_from_prefix(m, q, NP, P, window, "loaded");
        tl_prefix_free(q);
        /* a blob whose instruction passes its tokens (§7.4 step 4) */
        tu_put_u32(b.bytes + 92, NP + 1);
        tu_fix_checksum(b.bytes, b.n);
        q = (tl_prefix*)&q;
        CHECK_STATUS(tl_prefix_load(m, b.bytes, b.n, &q), TL_ERR_BAD_FILE);
        CHECK(q == NULL && strstr(tl_last_error(), "instruction: 11 exceeds the prefix's 10 tokens"), "message: %s",
              tl_last_error());
        free(b.bytes);
        tl_prefix_free(p);
    }
    /* the whole prefix an instruction block; a prefix past its block; P = 0 is tl_prefix_build */
    tl_prefix* whole = build(m, NP, NP, LOOPS, 0, 3, 0);
    check_from_prefix(m, whole, NP, NP, 0, "P = n");
    tl_prefix* zero = build(m, NP, 0, LOOPS, 0, 3, 0);
    tl_prefix* plain = NULL;
    CHECK_OK(tl_prefix_build(m, prompt, NP, LOOPS, 0, 3, &plain));
    tu_blob bz = tu_save(zero), bp = tu_save(plain);
    CHECK(tu_same_blob(bz, bp), "tl_prefix_build_instruction with P = 0 != tl_prefix_build");
    free(bz.bytes), free(bp.bytes);
    tl_prefix_free(whole), tl_prefix_free(zero), tl_prefix_free(plain);
}

/* Warm start: built at L_b = 1 with the block, extended to 3, it is the prefix built at 3. */
static void test_warm_start(tl_model* m) {
    enum { NP = 10, P = 7 };
    tl_prefix* a = build(m, NP, P, 1, 0, 2, TL_PREFIX_WARM_START);
    tl_prefix* b = build(m, NP, P, 3, 0, 0, TL_PREFIX_WARM_START);
    CHECK_OK(tl_prefix_extend(a, 3, 3));
    tu_blob ba = tu_save(a), bb = tu_save(b);
    CHECK(tu_same_blob(ba, bb), "extended to 3 != built at 3");
    free(ba.bytes), free(bb.bytes);
    tl_gen_params gp = params_with(0, 0);
    gp.loops = 3;
    tu_result ra = tu_from_prefix(a, prompt + NP, N - NP, &gp, V), rb = tu_from_prefix(b, prompt + NP, N - NP, &gp, V);
    CHECK(tu_same_result(&ra, &rb), "generations from the extended prefix");
    tu_result_free(&ra), tu_result_free(&rb);
    tl_prefix_free(a), tl_prefix_free(b);
}

/* ---- refused arguments ------------------------------------------------------------------------ */

static void test_errors(tl_model* m) {
    int32_t out[MAX_TOKENS];
    size_t n_out;
    tl_gen_params gp = params_with(N + 1, 0);
    CHECK_STATUS(tl_generate(m, prompt, N, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "instruction_length 15 exceeds the prompt's 14 tokens"), "message: %s",
          tl_last_error());
    tl_prefix* p = build(m, 8, 3, LOOPS, 0, 0, 0);
    gp = params_with(1, 0);
    CHECK_STATUS(tl_generate_from_prefix(p, prompt + 8, 2, &gp, out, &n_out, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "a generation from a prefix takes the prefix's instruction length"), "message: %s",
          tl_last_error());
    tl_request r = {sizeof r, p, prompt + 8, 2, &gp, out, NULL, 0};
    tl_request* reqs[1] = {&r};
    CHECK_STATUS(tl_generate_batch(m, reqs, 1), TL_ERR_INVALID_ARGUMENT);
    tl_sched* s = NULL;
    uint64_t id;
    CHECK_OK(tl_sched_create(m, NULL, &s));
    gp = params_with(N + 1, 0);
    CHECK_STATUS(tl_sched_add(s, prompt, N, &gp, &id), TL_ERR_INVALID_ARGUMENT);
    tl_sched_free(s);
    tl_prefix* none = NULL;
    CHECK_STATUS(tl_prefix_build_instruction(m, prompt, 4, 5, LOOPS, 0, 0, 0, &none), TL_ERR_INVALID_ARGUMENT);
    CHECK(none == NULL && tl_prefix_instruction(NULL) == 0 && tl_seq_instruction(NULL) == 0, "NULL handles");
    /* a caller built before the field: its size stops short of it, so it reads as 0 */
    gp = params_with(N + 1, 0);
    gp.size = offsetof(tl_gen_params, instruction_length);
    tu_result old = tu_generate(m, prompt, N, &gp, V), causal = generate(m, prompt, N, 0, 0);
    CHECK(tu_same_result(&old, &causal), "a short tl_gen_params is causal");
    tu_result_free(&old), tu_result_free(&causal);
    /* sequences: set on an empty one only; the first prefill holds the block */
    tl_seq* q = NULL;
    CHECK_OK(tl_seq_create(m, LOOPS, 0, &q));
    CHECK_OK(tl_seq_set_instruction(q, 4));
    CHECK_STATUS(tl_seq_prefill(q, prompt, 3, 0, NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(tl_seq_decode(q, prompt[0], NULL), TL_ERR_INVALID_ARGUMENT);
    CHECK(tl_seq_length(q) == 0, "a refused prefill left %zu tokens", tl_seq_length(q));
    CHECK_OK(tl_seq_prefill(q, prompt, 4, 1, NULL));
    CHECK_STATUS(tl_seq_set_instruction(q, 2), TL_ERR_INVALID_ARGUMENT);
    CHECK(tl_seq_instruction(q) == 4, "a refused set changed P to %zu", tl_seq_instruction(q));
    CHECK_OK(tl_seq_decode(q, prompt[4], NULL)); /* later prefills are unconstrained */
    tl_seq_free(q);
    CHECK_OK(tl_seq_create(m, LOOPS, 0, &q));
    CHECK_OK(tl_seq_set_instruction(q, 1));
    CHECK_OK(tl_seq_decode(q, prompt[0], NULL)); /* a block of one position: a decode holds it */
    tl_seq_free(q);
    tl_prefix_free(p);
}

int main(void) {
    tu_spec specs[2] = {tu_spec_default(), tu_spec_hrm()};
    const char* names[2] = {"plain", "hrm"};
    for (int i = 0; i < 2; i++) {
        specs[i].vocab = V;
        const char* path = tu_write_model(i ? "instr-hrm.tinyloop" : "instr.tinyloop", &specs[i]);
        tl_model* m = tu_open(path, 2, TL_ISA_AUTO, 4);
        if (!m) continue;
        test_mask(m, names[i]);
        test_seq_continue(m);
        test_generate(m);
        test_sched(m);
        test_prefix_cache(path, m);
        test_disk_tier(path, m);
        test_prefix(m);
        test_warm_start(m);
        if (i == 0) test_errors(m);
        tl_model_free(m);
    }
    return tu_finish("test_instruction");
}
