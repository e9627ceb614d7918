/* test_loop.c — loop attention (IQuest-Coder Loop, docs/spec.md §1, §4) through the public API,
 * on small random models of one set of weights (tu_spec_loop: a prelude, a core of 2, a coda;
 * the loop window W_l the only difference): the local attention reads its own slot through W_l
 * (W_l = 1 and W_l = 3 differ on a long prompt; a position whose keys all lie within W_l equals
 * the model with loop_window = max_seq_len, whose local attention is plain causal; under a
 * sequence window W, W' = min(W, W_l)), and at L = 1 nothing changes; then every path against
 * the sequence path and tl_generate, bit for bit: every prefill chunk (AMX tiles and per row),
 * every ISA path this CPU runs at 1 and 3 threads, int4 KV, decodes and forks, batches mixing
 * depths, the scheduler, speculative decoding in rounds and in the wave, adaptive depth's exits
 * (their KV copies) against 1 thread and the scalar path, the automatic prefix cache (hit and
 * miss), prefixes (at their depth and a shallower one, with a window, through a blob,
 * hidden-state ones) and warm start extended through nested depths (with a window that released
 * blocks: their iteration-0 KV is gone, so the extension rebuilds). */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N = 20, V = 256, LOOPS = 3, MAX_TOKENS = 6, MAX_SEQ = 96 };

static const int32_t prompt[N] = {5, 17, 99, 3, 200, 41, 7, 77, 150, 12, 8, 64, 33, 250, 9, 1, 180, 66, 23, 140};

/* A loop model of tu_spec_loop's weights with loop window w (written once per w). */
static const char* loop_model(uint32_t w) {
    tu_spec s = tu_spec_loop();
    s.vocab = V, s.max_seq = MAX_SEQ, s.loop_window = w;
    char name[64];
    snprintf(name, sizeof name, "loop-%u.tinyloop", w);
    return tu_write_model(name, &s);
}

/* logits_all [N][V] of the prompt run into a new sequence at depth loops with window W, in chunks. */
static float* prefill_logits(tl_model* m, uint32_t loops, uint32_t window, size_t chunk) {
    float* out = calloc((size_t)N * V, sizeof(float));
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, loops, window, &s));
    CHECK_OK(tl_seq_prefill_all(s, prompt, N, chunk, out));
    tl_seq_free(s);
    return out;
}

/* Whether models a and b give the same logits at rows [lo, hi) of the prompt. */
static int same_rows(tl_model* a, tl_model* b, uint32_t loops, uint32_t window, size_t lo, size_t hi) {
    float* x = prefill_logits(a, loops, window, 0);
    float* y = prefill_logits(b, loops, window, 0);
    const int same = tu_same_bits(x + lo * V, y + lo * V, (hi - lo) * V);
    free(x), free(y);
    return same;
}

static tl_gen_params params(uint32_t loops, uint32_t window) { return tu_gen_params(MAX_TOKENS, loops, window, 1, 7); }

/* ---- the semantics --------------------------------------------------------------------------- */

static void test_windows(void) {
    tl_model* w1 = tu_open_kv(loop_model(1), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    tl_model* w2 = tu_open_kv(loop_model(2), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    tl_model* w3 = tu_open_kv(loop_model(3), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    tl_model* wn = tu_open_kv(loop_model(N), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    tl_model* causal = tu_open_kv(loop_model(MAX_SEQ), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    if (!w1 || !w2 || !w3 || !wn || !causal) goto done;
    CHECK(!same_rows(w1, w3, LOOPS, 0, N - 1, N), "W_l = 1 and W_l = 3 give the same last logits");
    CHECK(!same_rows(w3, causal, LOOPS, 0, 3, N), "W_l = 3 and a causal local attention agree past position 2");
    /* positions t < W_l see every key 0 .. t in the local window: the causal model's logits */
    CHECK(same_rows(w3, causal, LOOPS, 0, 0, 3), "W_l = 3 differs from causal at positions 0 .. 2");
    CHECK(same_rows(w1, causal, LOOPS, 0, 0, 1), "W_l = 1 differs from causal at position 0");
    CHECK(same_rows(wn, causal, LOOPS, 0, 0, N), "W_l = N differs from causal over N positions");
    /* W' = min(W, W_l): under W = 2 the local windows of W_l = 2, 3 and max_seq_len are all 2 */
    CHECK(same_rows(w2, w3, LOOPS, 2, 0, N) && same_rows(w2, causal, LOOPS, 2, 0, N), "W' under W = 2 is not 2");
    CHECK(!same_rows(w3, causal, LOOPS, 5, 0, N), "W' under W = 5 ignores W_l = 3");
    CHECK(same_rows(w3, causal, LOOPS, 3, 0, N), "W' under W = 3 differs between W_l = 3 and max_seq_len");
    /* at L = 1 no layer is a loop layer; at L = 2 the first iteration's are */
    CHECK(same_rows(w1, causal, 1, 0, 0, N), "W_l changes a depth-1 model");
    CHECK(!same_rows(w1, causal, 2, 0, N - 1, N), "W_l changes nothing at depth 2");
done:
    tl_model_free(w1), tl_model_free(w2), tl_model_free(w3), tl_model_free(wn), tl_model_free(causal);
}

/* ---- the paths -------------------------------------------------------------------------------- */

/* Every chunking (tiles from two rows on AMX, per row in chunks of 1) gives one result, with
 * and without a window, and decodes and forks continue it. */
static void test_chunks(tl_model* m, const char* what) {
    for (uint32_t window = 0; window <= 4; window += 4) {
        float* ref = prefill_logits(m, LOOPS, window, 0);
        for (size_t chunk = 1; chunk <= N; chunk += chunk < 5 ? 1 : 5) {
            float* got = prefill_logits(m, LOOPS, window, chunk);
            CHECK(tu_same_bits(ref, got, (size_t)N * V), "%s W=%u: chunks of %zu differ", what, window, chunk);
            free(got);
        }
        tl_seq *s = NULL, *f = NULL;
        float logits[V];
        CHECK_OK(tl_seq_create(m, LOOPS, window, &s));
        CHECK_OK(tl_seq_prefill(s, prompt, 7, 3, logits));
        CHECK(tu_same_bits(logits, ref + 6 * V, V), "%s W=%u: prefill of 7", what, window);
        CHECK_OK(tl_seq_fork(s, &f));
        for (size_t t = 7; f && t < N; t++) {
            CHECK_OK(tl_seq_decode(f, prompt[t], logits));
            CHECK(tu_same_bits(logits, ref + t * V, V), "%s W=%u: decode at %zu", what, window, t);
        }
        tl_seq_free(f), tl_seq_free(s), free(ref);
    }
}

/* Every ISA path this CPU runs, at 1 and 3 threads, and the int4 KV mode (against itself). */
static void test_isas(const char* path, tl_model* m) {
    const tl_isa isas[4] = {TL_ISA_SCALAR, TL_ISA_AVX2, TL_ISA_AVX512_VNNI, TL_ISA_AMX};
    float* ref = prefill_logits(m, LOOPS, 0, 0);
    const tl_gen_params gp = params(LOOPS, 0);
    tu_result want = tu_generate(m, prompt, N, &gp, V);
    for (int i = 0; i < 4; i++)
        for (uint32_t threads = 1; threads <= 3 && tl_cpu_supports(isas[i]); threads += 2) {
            tl_model* x = tu_open_kv(path, threads, isas[i], 4, TL_KV_INT8);
            if (!x) continue;
            for (size_t chunk = 0; chunk <= 1; chunk++) {
                float* got = prefill_logits(x, LOOPS, 0, chunk);
                CHECK(tu_same_bits(ref, got, (size_t)N * V), "isa %d, %u threads, chunk %zu", (int)isas[i], threads,
                      chunk);
                free(got);
            }
            tu_result r = tu_generate(x, prompt, N, &gp, V);
            CHECK(tu_same_result(&want, &r), "isa %d, %u threads: tl_generate", (int)isas[i], threads);
            tu_result_free(&r);
            tl_model_free(x);
        }
    tu_result_free(&want), free(ref);
    tl_model* q = tu_open_kv(path, 2, TL_ISA_AUTO, 4, TL_KV_INT4);
    if (q) test_chunks(q, "int4 KV");
    tl_model_free(q);
}

/* tl_generate for every prefill chunk, speculative decoding (rounds, the wave), a batch mixing
 * depths and the scheduler give its tokens and logits. */
static void test_generate(tl_model* m) {
    const tl_gen_params gp = params(LOOPS, 0);
    float* whole = prefill_logits(m, LOOPS, 0, 0);
    tu_result ref = tu_generate(m, prompt, N, &gp, V);
    CHECK(tu_same_bits(ref.logits, whole + (N - 1) * V, V), "tl_generate's first logits");
    for (size_t chunk = 0; chunk <= 4; chunk++) {
        tl_gen_params g = gp;
        g.prefill_chunk = chunk;
        tu_result r = tu_generate(m, prompt, N, &g, V);
        CHECK(tu_same_result(&ref, &r), "tl_generate with prefill_chunk %zu", chunk);
        tu_result_free(&r);
    }
    for (uint32_t wave = 0; wave <= 1; wave++)
        for (uint32_t draft = 1; draft < LOOPS; draft++) {
            tl_gen_params g = gp;
            g.n_draft = 3, g.draft_loops = draft, g.draft_wave = wave;
            tu_result r = tu_generate(m, prompt, N, &g, V);
            CHECK(tu_same_result(&ref, &r), "speculative decoding at L_d %u (wave %u)", draft, wave);
            tu_result_free(&r);
        }
    const tl_gen_params pb = params(2, 0);
    const tl_gen_params* batch[2] = {&gp, &pb};
    CHECK(tu_batch_agrees(m, prompt, (size_t[]){N, N - 3}, batch, 2, V), "a batch of depths 3 and 2");
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 2, sp.step_tokens = 5;
    const tl_gen_params* three[3] = {&gp, &pb, &gp};
    CHECK(tu_sched_agrees(m, &sp, prompt, (size_t[]){N, N - 1, N - 2}, three, 3, V), "the scheduler");
    tu_result_free(&ref), free(whole);
}

/* Adaptive depth: rows exiting early copy their KV into the deeper core slots, which later
 * loop layers read through their local window; the result does not depend on the thread count
 * or the path, a batch gives each request's own result, and a rule that cannot fire is plain
 * decoding. */
static void test_exits(const char* path, tl_model* m) {
    tl_gen_params gp = tu_gen_params(12, LOOPS, 0, 0, 3);
    gp.exit_rule = TL_EXIT_LATENT, gp.exit_threshold = 0.5f;
    tu_result ref = tu_generate(m, prompt, N, &gp, V);
    tl_model* one = tu_open_kv(path, 1, TL_ISA_SCALAR, 4, TL_KV_INT8);
    tu_result r = tu_generate(one, prompt, N, &gp, V);
    CHECK(tu_same_result(&ref, &r), "exits: scalar path at 1 thread");
    tu_result_free(&r);
    const tl_gen_params plain = tu_gen_params(12, LOOPS, 0, 0, 3);
    const tl_gen_params* batch[2] = {&gp, &plain};
    CHECK(tu_batch_agrees(m, prompt, (size_t[]){N, N - 4}, batch, 2, V), "exits: a batch beside plain decoding");
    gp.min_loops = LOOPS;
    tu_result never = tu_generate(m, prompt, N, &gp, V), want = tu_generate(m, prompt, N, &plain, V);
    CHECK(tu_same_result(&never, &want), "exits: min_loops = loops is plain decoding");
    tu_result_free(&never), tu_result_free(&want), tu_result_free(&ref), tl_model_free(one);
}

/* The automatic prefix cache: a hit gives a miss's tokens and logits. */
static void test_prefix_cache(const char* path, tl_model* m) {
    tl_model* c = tu_open_cached(path, 1 << 22);
    if (!c) return;
    for (uint32_t window = 0; window <= 6; window += 6) {
        const tl_gen_params gp = params(LOOPS, window);
        tu_result want = tu_generate(m, prompt, N, &gp, V);
        for (int k = 0; k < 2; k++) {
            const uint64_t before = tu_cache_stats(c).hit_tokens;
            tu_result got = tu_generate(c, prompt, N, &gp, V);
            CHECK(tu_same_result(&got, &want), "prefix cache W=%u, run %d", window, k);
            CHECK((tu_cache_stats(c).hit_tokens > before) == (k == 1), "prefix cache W=%u, run %d: hits", window, k);
            tu_result_free(&got);
        }
        tu_result_free(&want);
    }
    tl_model_free(c);
}

/* Generations from p (the prompt's first n tokens) at depth `loops` equal tl_generate's. */
static void check_from_prefix(tl_model* m, const tl_prefix* p, size_t n, uint32_t loops, uint32_t window,
                              const char* what) {
    const tl_gen_params gp = params(loops, window);
    tu_result got = tu_from_prefix(p, prompt + n, N - n, &gp, V), want = tu_generate(m, prompt, N, &gp, V);
    CHECK(tu_same_result(&got, &want), "%s: from the prefix at depth %u != tl_generate", what, loops);
    tu_result_free(&got), tu_result_free(&want);
}

static tl_prefix* build(tl_model* m, size_t n, uint32_t loops, uint32_t window, size_t chunk, uint32_t flags) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, n, loops, window, chunk, flags, &p));
    return p;
}

/* Prefixes at their depth and a shallower one, with a window, through a blob, hidden-state
 * ones; warm start built at depth 1 and extended to 2 then 3 is the prefix built at 3. */
static void test_prefixes(tl_model* m) {
    enum { NP = 13 };
    for (uint32_t window = 0; window <= 5; window += 5) {
        tl_prefix* p = build(m, NP, LOOPS, window, 2, 0);
        check_from_prefix(m, p, NP, LOOPS, window, "built");
        check_from_prefix(m, p, NP, 2, window, "built, shallower");
        tu_blob b = tu_save(p);
        tl_prefix* q = tu_load(m, b);
        if (q) check_from_prefix(m, q, NP, LOOPS, window, "loaded");
        tl_prefix_free(q), free(b.bytes), tl_prefix_free(p);
        for (uint32_t h = TL_PREFIX_STORE_H8; h <= TL_PREFIX_STORE_H4; h *= 2) {
            tl_prefix* x = build(m, NP, LOOPS, window, 3, h);
            if (x && h == TL_PREFIX_STORE_H8) check_from_prefix(m, x, NP, LOOPS, window, "h8");
            tl_prefix_free(x);
        }
    }
    for (uint32_t window = 0; window <= 5; window += 5) { /* W = 5 released two blocks of 4 */
        tl_prefix* a = build(m, NP, 1, window, 2, TL_PREFIX_WARM_START);
        tl_prefix* b2 = build(m, NP, 2, window, 0, TL_PREFIX_WARM_START);
        tl_prefix* b3 = build(m, NP, LOOPS, window, 0, TL_PREFIX_WARM_START);
        CHECK_OK(tl_prefix_extend(a, 2, 3));
        tu_blob x = tu_save(a), y = tu_save(b2);
        CHECK(tu_same_blob(x, y), "warm start W=%u: extended to 2 != built at 2", window);
        free(x.bytes), free(y.bytes);
        CHECK_OK(tl_prefix_extend(a, LOOPS, 0));
        x = tu_save(a), y = tu_save(b3);
        CHECK(tu_same_blob(x, y), "warm start W=%u: extended to 3 != built at 3", window);
        free(x.bytes), free(y.bytes);
        check_from_prefix(m, a, NP, LOOPS, window, "warm start extended");
        tl_prefix_free(a), tl_prefix_free(b2), tl_prefix_free(b3);
    }
}

int main(void) {
    test_windows();
    const char* path = loop_model(3);
    tl_model* m = tu_open_kv(path, 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    if (m) {
        test_chunks(m, "int8 KV");
        test_isas(path, m);
        test_generate(m);
        test_exits(path, m);
        test_prefix_cache(path, m);
        test_prefixes(m);
    }
    tl_model_free(m);
    /* a local window past the prompt: both attentions of a tile slice pack their values */
    m = tu_open_kv(loop_model(MAX_SEQ), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    if (m) test_chunks(m, "W_l = max_seq_len");
    tl_model_free(m);
    return tu_finish("test_loop");
}
