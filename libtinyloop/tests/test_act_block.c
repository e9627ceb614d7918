/* test_act_block.c — block activations (act_block, docs/spec.md §2.2.1, §3, §4, §6.1 offset 232):
 * QB and NQB against the spec's steps written here with libm, on crafted rows (an outlier block,
 * a tiny row, NaN and infinite elements, whose clamp makes them -127 and the multiplier 1) with
 * their values worked out by hand, and on random rows; the digit split of every block input; the
 * loader's act_block rules, each with its message, and tl_model_config_get; then small random
 * models (int8 and int4 weights; B = 1, 4, 16 and d_model; a prelude and a coda, the injection
 * adapter with sandwich blocks and biases, loop attention, a two-state core with the attention
 * gate, an exit gate) through the public API: block activations change the logits, and every
 * ISA path this CPU runs (the AMX one emulated in that build) at 1 and 3 threads, every prefill
 * chunk, the int4 KV mode, batches, the scheduler, speculative decoding and the gate exits give
 * one result bit for bit; h8 prefixes are refused with their message, h4 and kv ones run. The
 * numbers themselves are checked against the numpy reference by the golden vectors. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "test_util.h"

enum { N = 20, MAX_TOKENS = 6, MAX_SEQ = 96 };

static const int32_t prompt[N] = {5, 17, 99, 3, 200, 41, 7, 77, 150, 12, 8, 64, 33, 250, 9, 1, 180, 66, 23, 140};

/* ---- QB and NQB ------------------------------------------------------------------------------ */

static float ref_clamp(float x, float lo, float hi) {
    x = x >= lo ? x : lo;
    return x <= hi ? x : hi;
}

/* §2.2.1 QB(x, B), step by step with libm (fmaxf ignores a NaN): p[n]; returns s. */
static float ref_qb(const float* x, size_t n, size_t B, int32_t* p) {
    const float amax = tu_spec_amax(x, n);
    if (amax < 0x1p-64f) {
        for (size_t i = 0; i < n; i++) p[i] = 0;
        return 0.0f;
    }
    const float u = 255.0f / amax, v = 32385.0f / amax;
    for (size_t b0 = 0; b0 < n; b0 += B) {
        const float amax_b = tu_spec_amax(x + b0, B);
        const int m = (int)ceilf(ref_clamp(amax_b * u, 1.0f, 255.0f));
        const float r = v / (float)m;
        for (size_t i = b0; i < b0 + B; i++) p[i] = m * (int)rintf(ref_clamp(x[i] * r, -127.0f, 127.0f));
    }
    return amax / 32385.0f;
}


static int same_float(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

/* The library's QB and NQB of x[n] against ref_qb (and want[n], want_s when given). */
static void check_row(const float* x, size_t n, size_t B, const int32_t* want, float want_s, const char* what) {
    enum { MAX_N = 512 };
    int32_t ref[MAX_N];
    int16_t p[MAX_N], p2[MAX_N];
    const float eps = 1e-5f;
    const float s_ref = ref_qb(x, n, B, ref);
    const float s = tl_block_quantize_row(x, n, B, p);
    const float a = tl_block_rms_quantize_row(x, n, B, eps, p2);
    CHECK(same_float(s, s_ref), "%s: s %g, reference %g", what, (double)s, (double)s_ref);
    CHECK(same_float(a, tu_spec_nq_scale(ref, n, s_ref, eps)), "%s: NQB's a %g", what, (double)a);
    for (size_t i = 0; i < n; i++) {
        CHECK(p[i] == ref[i] && p2[i] == ref[i], "%s: p[%zu] = %d / %d, reference %d", what, i, p[i], p2[i], ref[i]);
        CHECK(!want || want[i] == ref[i], "%s: reference p[%zu] = %d, by hand %d", what, i, ref[i], want[i]);
    }
    CHECK(!want || same_float(want_s, s_ref), "%s: reference s %g, by hand %g", what, (double)s_ref, (double)want_s);
}

static void test_quantize(void) {
    const float nan = NAN, inf = INFINITY;
    /* block 0 holds the row's max: m = 255, q = rint(x * 323.85 / 255); block 1's max 0.5 gives
     * m = ceil(1.275) = 2, 81 times the resolution a row scale leaves it */
    const float outlier[8] = {100, -50, 25, 1, 0.5f, -0.25f, 0.125f, 0.0625f};
    const int32_t outlier_p[8] = {32385, -16320, 8160, 255, 162, -80, 40, 20};
    check_row(outlier, 8, 4, outlier_p, 100.0f / 32385.0f, "outlier block");
    /* below 2^-64: zeros, s = 0, a = 0 */
    const float tiny[4] = {1e-20f, -3e-20f, 0, 5e-21f};
    const int32_t zeros[4] = {0};
    check_row(tiny, 4, 2, zeros, 0.0f, "tiny row");
    /* NaN: ignored by the maxima (an all-NaN block has amax_b = 0, m = 1), clamped to -127 */
    const float nans[8] = {nan, 2, 0.5f, nan, nan, nan, 1, -1};
    const int32_t nans_p[8] = {-32385, 32385, 8128, -8128, -127, -127, 16256, -16256};
    check_row(nans, 8, 2, nans_p, 2.0f / 32385.0f, "NaN elements");
    /* inf: u = v = 0, so every product is 0 (m = 1) or NaN (-127); s = inf, a NaN */
    const float infs[4] = {inf, 1, -2, 3};
    const int32_t infs_p[4] = {-127, 0, 0, 0};
    check_row(infs, 4, 2, infs_p, inf, "infinite element");
    /* random rows of a wide dynamic range, every block size dividing n */
    uint64_t rng = 11;
    float x[480];
    const size_t ns[] = {1, 6, 48, 480};
    for (size_t k = 0; k < sizeof ns / sizeof *ns; k++)
        for (size_t B = 1; B <= ns[k]; B++) {
            if (ns[k] % B) continue;
            for (size_t i = 0; i < ns[k]; i++)
                x[i] = ldexpf((float)tu_uniform(&rng, -1000, 1000) / 1000.0f, tu_uniform(&rng, -30, 10));
            if (ns[k] > 6 && B % 5 == 1) x[tu_uniform(&rng, 0, (int32_t)ns[k] - 1)] = nan;
            char what[64];
            snprintf(what, sizeof what, "random row n=%zu B=%zu", ns[k], B);
            check_row(x, ns[k], B, NULL, 0.0f, what);
        }
    /* the digits of every block input */
    int bad = 0;
    for (int32_t v = -32385; v <= 32385; v++) {
        const int16_t p = (int16_t)v;
        int8_t h, l;
        tl_split_digits(&p, 1, &h, &l);
        bad += 255 * h + l != v || h != (int32_t)floor((v + 127) / 255.0) || h == -128 || l == -128;
    }
    CHECK(bad == 0, "%d block inputs split into wrong digits", bad);
}

/* ---- the loader ------------------------------------------------------------------------------ */

/* spec's file with act_block `block` (and version `version`) must be refused with `needle`. */
static void expect_refused(tu_spec spec, uint32_t version, uint32_t block, const char* needle) {
    size_t n;
    uint8_t* f = tu_model_bytes(&spec, &n);
    tu_put_u32(f + 8, version);
    tu_put_u32(f + 232, block);
    tu_fix_checksum(f, n);
    tl_model* m = NULL;
    const tl_status st = tl_model_open(tu_write_file("act-block-rule.tinyloop", f, n), NULL, &m);
    CHECK(st == TL_ERR_BAD_FILE && !m, "act_block %u: status %d", block, st);
    CHECK(strstr(tl_last_error(), needle) != NULL, "act_block %u: '%s' lacks '%s'", block, tl_last_error(), needle);
    tl_model_free(m);
    free(f);
}

static void test_loader(void) {
    tu_spec s = tu_spec_default(); /* d 48, n_heads * head_dim 32, ffn_dim 72 */
    s.version = 3, s.head_dim = 8, s.ffn = 72;
    expect_refused(s, 3, 65537, "act_block: must be an int in 0 .. 65536, got 65537");
    expect_refused(s, 3, 5, "act_block: must divide d_model (48), got 5");
    expect_refused(s, 3, 24, "act_block: must divide n_heads * head_dim (32), got 24");
    expect_refused(s, 3, 16, "act_block: must divide ffn_dim (72), got 16");
    expect_refused(s, 2, 8, "reserved: header bytes 216 .. 255 must be zero");
    tu_spec loop = tu_spec_loop();
    loop.loop_window = (1u << 20) + 1;
    expect_refused(loop, 3, 65537, "loop_window: must be an int"); /* header order */
    s.act_block = 8;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(tu_write_model("act-block-8.tinyloop", &s), NULL, &m));
    tl_model_config full = {.size = sizeof full}, old;
    memset(&old, 0xab, sizeof old);
    old.size = offsetof(tl_model_config, act_block);
    CHECK_OK(tl_model_config_get(m, &full));
    CHECK_OK(tl_model_config_get(m, &old));
    CHECK(full.act_block == 8 && full.version == 3, "config act_block %u", full.act_block);
    CHECK(old.loop_window == 0 && old.act_block == 0xababababu, "a tl_model_config without act_block");
    tl_model_free(m);
}

/* ---- the paths ------------------------------------------------------------------------------- */

/* logits_all [N][V] of the prompt run into a new sequence at the model's depth, in chunks; the
 * head of the kept last state (tl_seq_last_logits) gives the last row again. */
static float* prefill_logits(tl_model* m, uint32_t V, size_t chunk) {
    float* out = calloc((size_t)N * V, sizeof(float));
    float* last = calloc(V, sizeof(float));
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_create(m, 0, 0, &s));
    CHECK_OK(tl_seq_prefill_all(s, prompt, N, chunk, out));
    CHECK_OK(tl_seq_last_logits(s, last));
    CHECK(tu_same_bits(last, out + (size_t)(N - 1) * V, V), "tl_seq_last_logits differs from the pass's logits");
    tl_seq_free(s), free(last);
    return out;
}

/* A model's result on every ISA path at 1 and 3 threads, prefilled whole and in chunks of 1 and
 * 7, equals the reference `ref` (logits_all) and `want` (tl_generate); and the int4 KV mode's
 * chunks agree with each other. */
static void check_paths(const char* path, uint32_t V, const float* ref, const tu_result* want, const tl_gen_params* gp,
                        const char* what) {
    const tl_isa isas[4] = {TL_ISA_SCALAR, TL_ISA_AVX2, TL_ISA_AVX512_VNNI, TL_ISA_AMX};
    for (int i = 0; i < 4; i++)
        for (uint32_t threads = 1; threads <= 3 && tl_cpu_supports(isas[i]); threads += 2) {
            tl_model* m = tu_open_kv(path, threads, isas[i], 4, TL_KV_INT8);
            if (!m) continue;
            for (size_t chunk = 0; chunk <= 7; chunk += chunk ? 6 : 1) {
                float* got = prefill_logits(m, V, chunk);
                CHECK(tu_same_bits(ref, got, (size_t)N * V), "%s: isa %d, %u threads, chunk %zu", what, (int)isas[i],
                      threads, chunk);
                free(got);
            }
            tu_result r = tu_generate(m, prompt, N, gp, V);
            CHECK(tu_same_result(want, &r), "%s: isa %d, %u threads: tl_generate", what, (int)isas[i], threads);
            tu_result_free(&r);
            tl_model_free(m);
        }
    tl_model* q = tu_open_kv(path, 2, TL_ISA_AUTO, 4, TL_KV_INT4);
    float* whole = q ? prefill_logits(q, V, 0) : NULL;
    float* ones = q ? prefill_logits(q, V, 1) : NULL;
    CHECK(!q || tu_same_bits(whole, ones, (size_t)N * V), "%s: int4 KV, chunks of 1", what);
    free(whole), free(ones), tl_model_free(q);
}

/* Batches, the scheduler, speculative decoding (rounds and the wave) and tl_generate's prefill
 * chunks give tl_generate's result. */
static void check_requests(tl_model* m, uint32_t V, uint32_t loops, const tu_result* want, const tl_gen_params* gp,
                           const char* what) {
    for (uint32_t wave = 0; wave <= 1; wave++) {
        tl_gen_params g = *gp;
        g.n_draft = 3, g.draft_loops = 1, g.draft_wave = wave, g.prefill_chunk = 3 + wave;
        tu_result r = tu_generate(m, prompt, N, &g, V);
        CHECK(tu_same_result(want, &r), "%s: speculative decoding (wave %u)", what, wave);
        tu_result_free(&r);
    }
    const tl_gen_params shallow = tu_gen_params(MAX_TOKENS, loops - 1, 0, 1, 7);
    const tl_gen_params* batch[2] = {gp, &shallow};
    CHECK(tu_batch_agrees(m, prompt, (size_t[]){N, N - 3}, batch, 2, V), "%s: a batch of two depths", what);
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 2, sp.step_tokens = 5;
    CHECK(tu_sched_agrees(m, &sp, prompt, (size_t[]){N, N - 1}, batch, 2, V), "%s: the scheduler", what);
}

/* Prefixes: h8 is refused with its message; a kv prefix continues as tl_generate does; an h4
 * one gives one result on the scalar path and the widest. */
static void check_prefixes(const char* path, tl_model* m, uint32_t V, uint32_t block, const tu_result* want,
                           const tl_gen_params* gp) {
    enum { NP = 13 };
    tl_prefix* p = NULL;
    CHECK_STATUS(tl_prefix_build_ex(m, prompt, NP, gp->loops, 0, 2, TL_PREFIX_STORE_H8, &p),
                 TL_ERR_INVALID_ARGUMENT);
    char msg[160];
    snprintf(msg, sizeof msg, "h8 prefixes need one activation scale per row (act_block 0), this model's act_block "
             "is %u: use h4 or kv", block);
    CHECK(strcmp(tl_last_error(), msg) == 0, "h8 refusal: '%s'", tl_last_error());
    CHECK_OK(tl_prefix_build_ex(m, prompt, NP, gp->loops, 0, 2, 0, &p));
    tu_result got = tu_from_prefix(p, prompt + NP, N - NP, gp, V);
    CHECK(tu_same_result(want, &got), "block %u: from a kv prefix", block);
    tu_result_free(&got), tl_prefix_free(p);
    tl_model* scalar = tu_open_kv(path, 1, TL_ISA_SCALAR, 4, TL_KV_INT8);
    tl_prefix *h4 = NULL, *h4_scalar = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, NP, gp->loops, 0, 3, TL_PREFIX_STORE_H4, &h4));
    CHECK_OK(tl_prefix_build_ex(scalar, prompt, NP, gp->loops, 0, 0, TL_PREFIX_STORE_H4, &h4_scalar));
    if (h4 && h4_scalar) {
        tu_result a = tu_from_prefix(h4, prompt + NP, N - NP, gp, V);
        tu_result b = tu_from_prefix(h4_scalar, prompt + NP, N - NP, gp, V);
        CHECK(tu_same_result(&a, &b), "block %u: h4 prefix, scalar path", block);
        tu_result_free(&a), tu_result_free(&b);
    }
    tl_prefix_free(h4), tl_prefix_free(h4_scalar), tl_model_free(scalar);
}

/* spec with act_block `block` against every path; with `requests`, also batches, the scheduler,
 * speculative decoding and prefixes; and its logits differ from spec's without block activations. */
static void test_model(tu_spec spec, uint32_t block, int requests, const char* what) {
    const uint32_t V = spec.vocab;
    spec.version = 3, spec.max_seq = MAX_SEQ;
    tl_model* plain = tu_open_kv(tu_write_model("act-block-0.tinyloop", &spec), 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    spec.act_block = block;
    const char* path = tu_write_model("act-block.tinyloop", &spec);
    tl_model* m = tu_open_kv(path, 2, TL_ISA_AUTO, 4, TL_KV_INT8);
    if (!plain || !m) goto done;
    float* ref = prefill_logits(m, V, 0);
    float* row_scaled = prefill_logits(plain, V, 0);
    CHECK(!tu_same_bits(ref, row_scaled, V), "%s: block activations change no logit of the first position", what);
    free(row_scaled);
    tl_gen_params gp = tu_gen_params(MAX_TOKENS, spec.loops, 0, 1, 7);
    if (spec.exit_gate) gp.exit_rule = TL_EXIT_GATE, gp.exit_threshold = 0.5f;
    tu_result want = tu_generate(m, prompt, N, &gp, V);
    check_paths(path, V, ref, &want, &gp, what);
    if (requests) {
        check_requests(m, V, spec.loops, &want, &gp, what);
        check_prefixes(path, m, V, block, &want, &gp);
    }
    tu_result_free(&want), free(ref);
done:
    tl_model_free(plain), tl_model_free(m);
}

int main(void) {
    test_quantize();
    test_loader();
    tu_spec huginn = tu_spec_huginn(); /* prelude, injection, sandwich blocks, biases, norms, coda */
    test_model(huginn, 4, 1, "int8 Huginn-like, B = 4");
    tu_spec loop = tu_spec_loop(); /* loop attention, prelude, coda; int4 */
    loop.int4 = 1, loop.group_size = 16, loop.ffn = 96;
    test_model(loop, 48, 1, "int4 loop attention, B = d_model");
    tu_spec plain = tu_spec_default(); /* a prelude, post blocks, an exit gate */
    plain.layout = 2, plain.exit_gate = 1, plain.exit_threshold = 0.75f;
    test_model(plain, 1, 0, "int8 post blocks with an exit gate, B = 1");
    tu_spec hrm = tu_spec_hrm(); /* a two-state core, the attention gate; int4 */
    hrm.int4 = 1, hrm.group_size = 16;
    test_model(hrm, 16, 0, "int4 two-state core, B = 16");
    return tu_finish("test_act_block");
}
