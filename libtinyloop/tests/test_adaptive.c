/* test_adaptive.c — adaptive depth (docs/spec.md §5.7) on the CPU. This test links the
 * library's objects: it gives models an exit gate by hand (weights it chooses, in a file
 * written without one) and drives decode passes of one row.
 *
 * Checked:
 *  - validation: an unknown rule, the gate on a model without one, thresholds out of range,
 *    min_loops > loops, an exit rule with n_draft > 0, depth_stats in a scheduled request, each
 *    with its message (a batch names the request); a valid request zeroes depth_stats;
 *  - the gate where its arithmetic is exact: zero weights give λ = 1/2 after every iteration, so
 *    c = 1 - 2^-(i+1) and U follows from q and min_loops (the CDF accumulates before min_loops
 *    allows an exit); a large bias exits at min_loops;
 *  - a reference: greedy decode passes of one row under a rule (the gate with random weights,
 *    latent at several thresholds, forced) against an independent composition of part passes:
 *    the state after each iteration (state_out), the exit decided by this test's own reading of
 *    §5.7, the pass at that depth with the coda in depth L's slots, the "last available" KV
 *    copied by this test. Same U, bit-identical logits, every KV slot equal; models with pre,
 *    sandwich and post blocks, injection, step and coda norms, no prelude, int8 and int4 caches;
 *  - the public paths agree bit for bit on mixed requests (gate, latent, plain, speculative):
 *    tl_generate at 2 threads and at 1 on the scalar path, from a prefix, tl_generate_batch, a
 *    scheduler without and with a KV budget that forces preemption (replays); the depth counters
 *    add up; settings that cannot exit give plain decoding's tokens and logits, and a plain
 *    tl_generate equals prefill plus tl_seq_decode. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "core/forward.h"
#include "core/generate.h"
#include "test_kv.h"
#include "test_util.h"

enum { MAX_D = 64, MAX_L = 6, PROMPT = 7, DECODES = 10, NREQ = 10, MAX_NEW = 12, EVENTS = 64 };

static int32_t prompt[PROMPT];

/* ---- this test's reading of §2 and §5.7 --------------------------------------------------- */

static float f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float t_exp2s(float x) {
    x = x >= -126.0f ? x : -126.0f;
    x = x <= 126.0f ? x : 126.0f;
    const float n = floorf(x), f = x - n;
    float p = f32(0x39648c8e);
    p = p * f + f32(0x3aa2b764);
    p = p * f + f32(0x3c1e9e34);
    p = p * f + f32(0x3d634186);
    p = p * f + f32(0x3e75fed5);
    p = p * f + f32(0x3f317215);
    p = p * f + 1.0f;
    return ldexpf(p, (int)n);
}

static float t_exps(float v) { return t_exp2s(v * f32(0x3fb8aa3b)); }

/* §2.8 log2s(N), 1 <= N < 2^63. */
static float t_log2s(uint64_t N) {
    int e = 0;
    while (N >> (e + 1)) e++;
    const float f = ldexpf((float)N, -e), s = (f - 1.0f) / (f + 1.0f), w = s * s;
    static const uint32_t k[7] = {0x4038aa3b, 0x3f76384f, 0x3f13bb63, 0x3ed30bb1, 0x3ea4258a, 0x3e864d42, 0x3e6347ab};
    float p = f32(k[6]);
    for (int j = 5; j >= 0; j--) p = p * w + f32(k[j]);
    p = p * s;
    return (float)e + p;
}

/* (q, s) = Q(x[n], qmax) (§2.2); returns s. */
static float t_quantize(const float* x, size_t n, float qmax, int64_t* q) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (amax < f32(0x1f800000)) {
        memset(q, 0, n * sizeof *q);
        return 0.0f;
    }
    const float r = qmax / amax;
    for (size_t i = 0; i < n; i++) {
        float v = x[i] * r;
        v = v >= -qmax ? v : -qmax;
        v = v <= qmax ? v : qmax;
        q[i] = (int64_t)rintf(v);
    }
    return amax / qmax;
}

static int64_t t_squares(const int64_t* q, size_t n) {
    int64_t ss = 0;
    for (size_t i = 0; i < n; i++) ss += q[i] * q[i];
    return ss;
}

/* The kl rule's M = max z (NaN-ignoring, from -inf), W_j = rint(exp2s((z_j - M) LOG2E) 2^24)
 * and S = Σ W_j of logits z[V]; returns S. */
static int64_t t_weights(const float* z, size_t V, float* M, int64_t* W) {
    *M = -INFINITY;
    for (size_t j = 0; j < V; j++) *M = fmaxf(*M, z[j]);
    int64_t S = 0;
    for (size_t j = 0; j < V; j++) S += W[j] = (int64_t)rintf(t_exp2s((z[j] - *M) * f32(0x3fb8aa3b)) * 16777216.0f);
    return S;
}

static int t_finite(const float* z, size_t V) {
    for (size_t j = 0; j < V; j++)
        if (!isfinite(z[j])) return 0;
    return 1;
}

/* KL(P' || P) of §5.7 for finite logits zp (the previous iteration's) and z. */
static float t_kl(const float* zp, const float* z, size_t V) {
    int64_t* Wp = malloc(V * sizeof *Wp);
    int64_t* W = malloc(V * sizeof *W);
    int64_t* qd = malloc(V * sizeof *qd);
    float* delta = malloc(V * sizeof *delta);
    float Mp, M;
    const int64_t Sp = t_weights(zp, V, &Mp, Wp), S = t_weights(z, V, &M, W);
    for (size_t j = 0; j < V; j++) delta[j] = zp[j] - z[j];
    const float sd = t_quantize(delta, V, 524287.0f, qd);
    int64_t dot = 0;
    for (size_t j = 0; j < V; j++) dot += Wp[j] * qd[j];
    const float A = (((float)dot) / (float)Sp) * sd;
    const float k = A - (Mp - M);
    float l = t_log2s((uint64_t)S) - t_log2s((uint64_t)Sp);
    l = l * f32(0x3f317218);
    free(Wp), free(W), free(qd), free(delta);
    /* the formula against KL(P' || P) in double: it approximates the divergence closely */
    double mp = -INFINITY, mm = -INFINITY, sp = 0, sm = 0, exact = 0;
    for (size_t j = 0; j < V; j++) mp = fmax(mp, zp[j]), mm = fmax(mm, z[j]);
    for (size_t j = 0; j < V; j++) sp += exp(zp[j] - mp), sm += exp(z[j] - mm);
    for (size_t j = 0; j < V; j++) {
        const double lp = zp[j] - mp - log(sp), lq = z[j] - mm - log(sm);
        exact += exp(lp) * (lp - lq);
    }
    CHECK(fabs((double)(k + l) - exact) < 1e-4 + 1e-5 * exact, "kl %.9g, in double %.9g", (double)(k + l), exact);
    return k + l;
}

/* The smallest index of the largest logit (NaN never the largest; all NaN: -1). */
static int32_t t_argmax(const float* z, size_t V) {
    int32_t a = -1;
    for (size_t j = 0; j < V; j++)
        if (!isnan(z[j]) && (a < 0 || z[j] > z[a])) a = (int32_t)j;
    return a;
}

/* The exit iteration count U of a token at depth L whose state entering iteration 0 is xm1 and
 * after iteration i is xs[i], with the logits of exiting there zs[i] (i <= L-2). */
static uint32_t t_exit_depth(const tl_file* f, const tl_exit* x, uint32_t L, const float* xm1, const float* xs,
                             const float* zs) {
    const size_t d = f->cfg.d_model, V = f->cfg.vocab_size;
    int64_t q[MAX_D];
    float c = 0.0f, r = 1.0f, prev[MAX_D], delta[MAX_D];
    int32_t arg = -1;
    uint32_t count = 0;
    if (x->rule == TL_EXIT_NONE || (x->rule == TL_EXIT_GATE && x->q == 1.0f)) return L;
    memcpy(prev, xm1, d * sizeof(float));
    for (uint32_t i = 0; i + 1 < L; i++) {
        const float* xi = xs + i * d;
        int hit = x->rule == TL_EXIT_FORCED;
        if (x->rule == TL_EXIT_GATE) {
            const float s = t_quantize(xi, d, 127.0f, q);
            int64_t dot = 0;
            for (size_t k = 0; k < d; k++) dot += q[k] * f->exit_gate_w[k];
            float t = (float)t_squares(q, d);
            t = t * s;
            t = t * s;
            t = t / (float)d;
            t = t + f->cfg.rms_eps;
            t = sqrtf(t);
            const float a = s / t, v = (((float)dot * a) * f->exit_gate_s) + f->exit_gate_b;
            const float lambda = 1.0f / (1.0f + t_exps(-v));
            c = c + lambda * r;
            r = r * (1.0f - lambda);
            hit = c >= x->q;
        } else if (x->rule == TL_EXIT_LATENT) {
            for (size_t k = 0; k < d; k++) delta[k] = xi[k] - prev[k];
            const float sd = t_quantize(delta, d, 32767.0f, q);
            const int64_t nd = t_squares(q, d);
            const float sx = t_quantize(xi, d, 32767.0f, q);
            const int64_t nx = t_squares(q, d);
            const float rho = (sqrtf((float)nd) * sd) / (sqrtf((float)nx) * sx);
            hit = nx > 0 && rho < x->q;
            memcpy(prev, xi, d * sizeof(float));
        } else if (x->rule == TL_EXIT_KL) {
            const float* z = zs + i * V;
            hit = i >= 1 && t_finite(z - V, V) && t_finite(z, V) && t_kl(z - V, z, V) < x->q;
        } else if (x->rule == TL_EXIT_ARGMAX) {
            const int32_t ai = t_argmax(zs + i * V, V);
            count = i > 0 && ai == arg ? count + 1 : 0;
            arg = ai;
            hit = (float)count >= x->q;
        }
        if (i + 1 >= x->min_loops && hit) return i + 1;
    }
    return L;
}

/* ---- models --------------------------------------------------------------------------------- */

static int8_t gate_w[MAX_D];

/* Give m's file the exit gate (w, s, b) and default threshold q: a copy of w in the library's
 * allocator, which the file frees when it closes (as the gate the loader reads). */
static void set_gate(tl_model* m, const int8_t* w, float s, float b, float q) {
    tl_engine* e = NULL;
    CHECK_OK(tl_model_acquire(m, &e));
    if (!e) return;
    const size_t d = e->file.cfg.d_model;
    int8_t* copy = tl_alloc(d);
    CHECK(copy != NULL, "no memory for the exit gate");
    if (!copy) return;
    memcpy(copy, w, d);
    tl_free((void*)e->file.exit_gate_w);
    e->file.cfg.exit_gate = 1;
    e->file.cfg.exit_threshold = q;
    e->file.exit_gate_w = copy;
    e->file.exit_gate_s = s;
    e->file.exit_gate_b = b;
    tl_engine_unref(e);
}

/* A model with the exit gate (gate_w), blocks of 4 and an automatic prefix cache of cache_bytes. */
static tl_model* open_model(const char* path, uint32_t threads, tl_isa isa, tl_kv_mode mode, size_t cache_bytes) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = threads;
    p.isa = isa;
    p.kv_block_size = 4;
    p.kv_mode = mode;
    p.prefix_cache_bytes = cache_bytes;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &p, &m));
    set_gate(m, gate_w, 0.01f, 0.25f, 0.9f);
    return m;
}

/* ---- validation ----------------------------------------------------------------------------- */

static void check_refused(tl_model* m, const tl_gen_params* gp, tl_status want, const char* message) {
    int32_t out[4];
    size_t n_out = 9;
    CHECK_STATUS(tl_generate(m, prompt, PROMPT, gp, out, &n_out, NULL), want);
    CHECK(n_out == 0 && strcmp(tl_last_error(), message) == 0, "message \"%s\", want \"%s\"", tl_last_error(),
          message);
}

static void check_validation(tl_model* plain, tl_model* gated) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = 3, gp.loops = 3;
#define UNKNOWN_RULE "unknown exit_rule 5 (0 none, 1 gate, 2 latent, 3 kl, 4 argmax)"
    gp.exit_rule = 5;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, UNKNOWN_RULE);
    gp.exit_rule = TL_EXIT_FORCED; /* internal only */
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT,
                  "unknown exit_rule 255 (0 none, 1 gate, 2 latent, 3 kl, 4 argmax)");
    gp.exit_rule = TL_EXIT_GATE;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, "exit_rule gate: the model has no exit gate");
#define GATE_Q "exit_threshold must be in (0, 1] for exit_rule gate, got "
#define LATENT_Q "exit_threshold must be finite and > 0 for exit_rule latent, got "
    gp.exit_threshold = 1.5f;
    check_refused(gated, &gp, TL_ERR_INVALID_ARGUMENT, GATE_Q "1.5");
    gp.exit_threshold = -0.25f;
    check_refused(gated, &gp, TL_ERR_INVALID_ARGUMENT, GATE_Q "-0.25");
    gp.exit_threshold = NAN;
    check_refused(gated, &gp, TL_ERR_INVALID_ARGUMENT, GATE_Q "nan");
    gp.exit_rule = TL_EXIT_LATENT;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, LATENT_Q "nan");
    gp.exit_threshold = INFINITY;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, LATENT_Q "inf");
    gp.exit_threshold = -1.0f;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, LATENT_Q "-1");
#define KL_Q "exit_threshold must be finite and > 0 for exit_rule kl, got "
#define ARGMAX_Q "exit_threshold must be an integer in 1 .. 1024 for exit_rule argmax, got "
    gp.exit_rule = TL_EXIT_KL;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, KL_Q "-1");
    gp.exit_threshold = NAN;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, KL_Q "nan");
    gp.exit_threshold = -INFINITY;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, KL_Q "-inf");
    gp.exit_rule = TL_EXIT_ARGMAX;
    static const struct {
        float q;
        const char* got;
    } bad_steps[] = {{2.5f, "2.5"}, {0.5f, "0.5"}, {1025.0f, "1025"}, {-3.0f, "-3"}, {1e30f, "1.00000002e+30"},
                     {INFINITY, "inf"}, {NAN, "nan"}, {1.0f + 0x1p-23f, "1.00000012"}, {0x1p-149f, "1.40129846e-45"}};
    char want[160];
    for (size_t i = 0; i < sizeof bad_steps / sizeof *bad_steps; i++) {
        gp.exit_threshold = bad_steps[i].q;
        snprintf(want, sizeof want, ARGMAX_Q "%s", bad_steps[i].got);
        check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, want);
    }
    gp.exit_threshold = 0.0f;
    gp.min_loops = 4;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, "min_loops must be in 1 .. loops (loops=3), got 4");
    gp.exit_rule = TL_EXIT_NONE; /* min_loops is checked with any rule */
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, "min_loops must be in 1 .. loops (loops=3), got 4");
    gp.min_loops = 3, gp.n_draft = 2, gp.draft_loops = 1;
    for (uint32_t rule = TL_EXIT_GATE; rule <= TL_EXIT_ARGMAX; rule++) {
        gp.exit_rule = rule;
        check_refused(gated, &gp, TL_ERR_INVALID_ARGUMENT,
                      "an exit_rule (adaptive depth) cannot be combined with self-speculative decoding (n_draft > 0)");
    }
    /* the thresholds' edges and defaults are accepted */
    static const struct {
        uint32_t rule;
        float q;
    } good[] = {{TL_EXIT_ARGMAX, 1.0f}, {TL_EXIT_ARGMAX, 1024.0f}, {TL_EXIT_ARGMAX, 0.0f}, {TL_EXIT_KL, 0.0f},
                {TL_EXIT_KL, 0x1p-149f}, {TL_EXIT_KL, 3e38f}};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        tl_gen_params g = tu_gen_params(2, 3, 0, 0, 1);
        g.exit_rule = good[i].rule, g.exit_threshold = good[i].q;
        int32_t toks[2];
        size_t n = 0;
        CHECK_OK(tl_generate(plain, prompt, PROMPT, &g, toks, &n, NULL));
    }

    /* a valid request zeroes depth_stats; a refused one leaves it */
    tl_depth_stats stats = {7, 7};
    gp.n_draft = 0, gp.min_loops = 0, gp.exit_rule = 5, gp.depth_stats = &stats;
    check_refused(plain, &gp, TL_ERR_INVALID_ARGUMENT, UNKNOWN_RULE);
    CHECK(stats.tokens == 7 && stats.loops == 7, "a refused request touched depth_stats");
    gp.exit_rule = TL_EXIT_LATENT, gp.max_tokens = 1;
    int32_t out[4];
    size_t n_out = 0;
    CHECK_OK(tl_generate(plain, prompt, PROMPT, &gp, out, &n_out, NULL));
    CHECK(n_out == 1 && stats.tokens == 0 && stats.loops == 0, "depth_stats %llu %llu after one token",
          (unsigned long long)stats.tokens, (unsigned long long)stats.loops);

    /* a batch names the request; a scheduled request takes no depth_stats */
    tl_gen_params ok = tl_gen_params_default(), bad = ok;
    bad.exit_rule = TL_EXIT_GATE;
    tl_request r[2];
    for (int i = 0; i < 2; i++)
        r[i] = (tl_request){.size = sizeof(tl_request), .prompt = prompt, .n_prompt = PROMPT,
                            .params = i ? &bad : &ok, .out_tokens = out + 2 * i};
    tl_request* rs[2] = {&r[0], &r[1]};
    ok.max_tokens = bad.max_tokens = 2;
    CHECK_STATUS(tl_generate_batch(plain, rs, 2), TL_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(tl_last_error(), "request 1: exit_rule gate: the model has no exit gate") == 0, "message: %s",
          tl_last_error());
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(gated, NULL, &s));
    uint64_t id = 0;
    gp.max_tokens = 2;
    CHECK_STATUS(tl_sched_add(s, prompt, PROMPT, &gp, &id), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "a scheduled request takes no depth_stats"), "message: %s", tl_last_error());
    gp.depth_stats = NULL;
    CHECK_OK(tl_sched_add(s, prompt, PROMPT, &gp, &id));
    tl_sched_free(s);
}

/* ---- the gate where it is exact ------------------------------------------------------------ */

/* Greedy tl_generate of `max` tokens under rule/q/m at depth L: its depth_stats. */
static tl_depth_stats depth_of(tl_model* m, uint32_t L, uint32_t rule, float q, uint32_t min_loops, size_t max) {
    tl_gen_params gp = tu_gen_params(max, L, 0, 0, 1);
    tl_depth_stats stats = {0, 0};
    gp.exit_rule = rule, gp.exit_threshold = q, gp.min_loops = min_loops, gp.depth_stats = &stats;
    int32_t out[MAX_NEW];
    size_t n = 0;
    CHECK_OK(tl_generate(m, prompt, PROMPT, &gp, out, &n, NULL));
    CHECK(stats.tokens + 1 == n, "%llu decode passes for %zu tokens", (unsigned long long)stats.tokens, n);
    return stats;
}

static void check_gate_exact(const char* path) {
    static const int8_t zeros[MAX_D];
    tl_model* m = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 0);
    set_gate(m, zeros, 1.0f, 0.0f, 0.75f); /* v = 0: λ = 1/2, c = 0.5, 0.75, 0.875, 0.9375, ... */
    static const struct {
        float q;
        uint32_t m, U;
    } cases[] = {{0.5f, 1, 1}, {0.75f, 1, 2}, {0.0f, 1, 2}, {0.75f, 3, 3}, {0.875f, 1, 3}, {0.9f, 1, 4},
                 {0.96f, 1, 5}, {0.97f, 1, 5}, {1.0f, 1, 5}, {0.5f, 4, 4}, {0.5f, 5, 5}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const tl_depth_stats st = depth_of(m, 5, TL_EXIT_GATE, cases[i].q, cases[i].m, 6);
        CHECK(st.loops == st.tokens * cases[i].U && st.tokens == 5, "λ = 1/2, q %g, min_loops %u: %llu loops in %llu "
              "passes, want U = %u", (double)cases[i].q, cases[i].m, (unsigned long long)st.loops,
              (unsigned long long)st.tokens, cases[i].U);
    }
    set_gate(m, zeros, 1.0f, 100.0f, 0.75f); /* λ = 1 at once: every token exits at min_loops */
    for (uint32_t mm = 1; mm <= 4; mm++) {
        const tl_depth_stats st = depth_of(m, 4, TL_EXIT_GATE, 0.999f, mm, 5);
        CHECK(st.loops == st.tokens * mm, "λ = 1, min_loops %u: %llu loops", mm, (unsigned long long)st.loops);
    }
    tl_model_free(m);
}

/* ---- kl and argmax where the exit is known ------------------------------------------------- */

/* A model of spec whose head's row scales are all zero: every probe's logits are zeros, so the
 * argmax is 0 after every iteration (c_i = i) and KL = 0 exactly, whatever the state. */
static tl_model* open_zero_head(const char* name, tu_spec spec) {
    size_t n = 0;
    uint8_t* bytes = tu_model_bytes(&spec, &n);
    const uint32_t count = tu_get_u32(bytes + 28);
    const uint64_t table = tu_get_u64(bytes + 32);
    int found = 0;
    for (uint32_t t = 0; t < count; t++) {
        const uint8_t* entry = bytes + table + 96 * (uint64_t)t;
        if (strcmp((const char*)entry, "head.s") != 0) continue;
        CHECK(tu_get_u32(entry + 48) == 1 && tu_get_u32(entry + 52) == 1, "head.s is not f32 [V]");
        memset(bytes + tu_get_u64(entry + 88), 0, tu_get_u64(entry + 56) * sizeof(float));
        found = 1;
    }
    CHECK(found, "%s has no head.s", name);
    tu_fix_checksum(bytes, n);
    const char* path = tu_write_file(name, bytes, n);
    free(bytes);
    return open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 0);
}

/* Whether a greedy tl_generate of 5 tokens under rule/q/m at depth L runs U iterations per
 * decoded token. */
static void check_depth(tl_model* m, const char* what, uint32_t L, uint32_t rule, float q, uint32_t mm, uint32_t U) {
    const tl_depth_stats st = depth_of(m, L, rule, q, mm, 5);
    CHECK(st.loops == st.tokens * U && st.tokens == 4, "%s, rule %u q %g, L %u, m %u: %llu loops in %llu passes, "
          "want U = %u", what, rule, (double)q, L, mm, (unsigned long long)st.loops, (unsigned long long)st.tokens, U);
}

/* argmax exits after iteration max(q, m - 1) and kl after max(1, m - 1) where that is <= L - 2,
 * on a head of zeros; kl at q = 1e30 does on any model (KL is finite there). */
static void check_known_exits(const char* path, tu_spec spec) {
    tl_model* zero = open_zero_head("adaptive-zero-head.tinyloop", spec);
    tl_model* m = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 0);
    for (uint32_t L = 1; L <= MAX_L; L++)
        for (uint32_t mm = 1; mm <= L; mm++) {
            const uint32_t kl_at = mm - 1 > 1 ? mm - 1 : 1, kl_U = kl_at + 2 <= L ? kl_at + 1 : L;
            check_depth(zero, "zero head", L, TL_EXIT_KL, 0x1p-149f, mm, kl_U);
            check_depth(zero, "zero head", L, TL_EXIT_KL, 1e-3f, mm, kl_U);
            check_depth(m, "random head", L, TL_EXIT_KL, 1e30f, mm, kl_U);
            for (uint32_t q = 1; q <= 4; q++) {
                const uint32_t at = q > mm - 1 ? q : mm - 1;
                check_depth(zero, "zero head", L, TL_EXIT_ARGMAX, (float)q, mm, at + 2 <= L ? at + 1 : L);
            }
        }
    tl_model_free(zero);
    tl_model_free(m);
}

/* ---- the reference composition --------------------------------------------------------------- */

/* This test's copy of position pos's rows of slot `from` into slot `to`. */
static void copy_slot(tl_seq* s, size_t pos, uint32_t from, uint32_t to) {
    const tl_kv_geom* g = &s->engine->kv_geom;
    const tl_kv_span* sp = &s->kv.spans[tl_kv_find(&s->kv, pos)];
    const size_t slot = pos - sp->start, R = tl_kv_row_bytes(g);
    for (uint32_t h = 0; h < g->n_kv_heads; h++) {
        memmove(tl_kv_keys(g, sp->block, to, h) + slot * R, tl_kv_keys(g, sp->block, from, h) + slot * R, R);
        memmove(tl_kv_values(g, sp->block, to, h) + slot * R, tl_kv_values(g, sp->block, from, h) + slot * R, R);
        memmove(&tl_kv_key_scales(g, sp->block, to, h)[slot], &tl_kv_key_scales(g, sp->block, from, h)[slot], 4);
        memmove(&tl_kv_value_scales(g, sp->block, to, h)[slot], &tl_kv_value_scales(g, sp->block, from, h)[slot], 4);
    }
}

/* The state entering iteration 0 of token t, where this test knows it: zero with injection,
 * the embedding without a prelude. Returns 0 elsewhere (the prelude's output). */
static int state_before(const tl_file* f, int32_t t, float* x) {
    const size_t d = f->cfg.d_model;
    if (f->cfg.injection) {
        memset(x, 0, d * sizeof(float));
        return 1;
    }
    if (f->cfg.n_pre_blocks) return 0;
    for (size_t i = 0; i < d; i++) x[i] = ((float)f->emb_w[(size_t)t * d + i] * f->emb_s[t]) * f->cfg.embed_scale;
    return 1;
}

static int32_t argmax(const float* z, size_t V) {
    size_t best = 0;
    for (size_t i = 1; i < V; i++)
        if (z[i] > z[best]) best = i;
    return (int32_t)best;
}

/* DECODES greedy decode passes of one row under x at depth L on sequence a, against sequence b
 * run by part passes at the U this test decides (where it knows x_{-1}; else at a's U) with its
 * own KV copies. early[rule][U] counts the exits before the last iteration. */
static void check_reference(tl_model* m, uint32_t L, tl_exit x, const char* what, uint32_t early[][MAX_L]) {
    tl_engine* e = NULL;
    CHECK_OK(tl_model_acquire(m, &e));
    const tl_file* f = &e->file;
    const tl_config* c = &f->cfg;
    const uint32_t w = tu_core_width(c->n_core_blocks, c->core_cycles); /* the core's applications */
    const size_t d = c->d_model, V = c->vocab_size, per = (size_t)w + c->n_coda_blocks;
    tl_seq *a = NULL, *b = NULL;
    CHECK_OK(tl_seq_create(m, L, 0, &a));
    CHECK_OK(tl_seq_create(m, L, 0, &b));
    float* la = malloc(V * sizeof(float));
    float* lb = malloc(V * sizeof(float));
    float xs[MAX_L * MAX_D], xm1[MAX_D] = {0};
    float* zs = malloc(MAX_L * V * sizeof(float));
    CHECK_OK(tl_seq_prefill(a, prompt, PROMPT, 3, la));
    CHECK_OK(tl_seq_prefill(b, prompt, PROMPT, 0, lb));
    for (int k = 0; k < DECODES; k++) {
        int32_t token = argmax(la, V);
        uint32_t U = 0;
        tl_kv_mark mark;
        tl_decode_rows row = {.seqs = &a, .tokens = &token, .logits = &la, .exits = &x, .depths = &U, .marks = &mark};
        CHECK_OK(tl_gen_run_rows(e, &row, 1));
        const size_t pos = b->n;
        CHECK_OK(tl_kv_reserve(&b->kv, &e->kv_geom, b->n_layers, pos, 1));
        for (uint32_t i = 0; i + 1 < L; i++) {
            const tl_part part = {.depth = i + 1, .coda_depth = L, .state_out = xs + i * d, .logits_last = zs + i * V};
            CHECK_OK(tl_forward_part(b, &token, 1, pos, &part));
        }
        const int known = state_before(f, token, xm1) || x.rule != TL_EXIT_LATENT;
        const uint32_t want = known ? t_exit_depth(f, &x, L, xm1, xs, zs) : U;
        const tl_part part = {.depth = want, .coda_depth = L, .logits_last = lb};
        CHECK_OK(tl_forward_part(b, &token, 1, pos, &part));
        for (uint32_t u = want; u < L; u++)
            for (uint32_t j = 0; j < w; j++)
                copy_slot(b, pos, (uint32_t)(c->n_pre_blocks + (want - 1) * per + j),
                          (uint32_t)(c->n_pre_blocks + u * per + j));
        b->n++;
        CHECK(U == want, "%s: L %u rule %u q %g m %u, token %d: exit at %u, want %u", what, L, x.rule, (double)x.q,
              x.min_loops, k, U, want);
        CHECK(tu_same_bits(la, lb, V), "%s: L %u rule %u q %g m %u, token %d (U %u): logits differ", what, L, x.rule,
              (double)x.q, x.min_loops, k, U);
        CHECK_OK(tl_seq_last_logits(a, lb)); /* the final state kept is the one the logits came from */
        CHECK(tu_same_bits(la, lb, V), "%s: L %u rule %u q %g m %u, token %d (U %u): last logits differ", what, L,
              x.rule, (double)x.q, x.min_loops, k, U);
        if (U < L && x.rule <= TL_EXIT_ARGMAX) early[x.rule][U]++;
    }
    CHECK(tu_same_seq_kv(a, b, 0, a->n, 0), "%s: L %u rule %u q %g m %u: KV differs", what, L, x.rule, (double)x.q,
          x.min_loops);
    free(la);
    free(lb);
    free(zs);
    tl_seq_free(a);
    tl_seq_free(b);
    tl_engine_unref(e);
}

/* References over depths, min_loops, rules and thresholds; every rule must exit early at two
 * depths or more. */
static void check_references(tl_model* m, const char* what) {
    uint32_t early[TL_EXIT_ARGMAX + 1][MAX_L] = {{0}};
    static const float latent_q[] = {0.25f, 0.5f, 0.75f, 1.0f, 1.5f, 1e30f};
    static const float gate_q[] = {0.3f, 0.6f, 0.9f, 0.99f, 1.0f};
    static const float kl_q[] = {1e-4f, 1e-2f, 0.1f, 1.0f, 1e30f};
    static const float argmax_q[] = {1.0f, 2.0f, 3.0f, 1024.0f};
    for (uint32_t L = 1; L <= MAX_L; L += 1 + (L > 2)) {
        for (uint32_t mm = 1; mm <= L; mm += 1 + (mm > 1)) {
            for (size_t i = 0; i < sizeof latent_q / sizeof *latent_q; i++)
                check_reference(m, L, (tl_exit){TL_EXIT_LATENT, latent_q[i], mm}, what, early);
            for (size_t i = 0; i < sizeof gate_q / sizeof *gate_q; i++)
                check_reference(m, L, (tl_exit){TL_EXIT_GATE, gate_q[i], mm}, what, early);
            for (size_t i = 0; i < sizeof kl_q / sizeof *kl_q; i++)
                check_reference(m, L, (tl_exit){TL_EXIT_KL, kl_q[i], mm}, what, early);
            for (size_t i = 0; i < sizeof argmax_q / sizeof *argmax_q; i++)
                check_reference(m, L, (tl_exit){TL_EXIT_ARGMAX, argmax_q[i], mm}, what, early);
            check_reference(m, L, (tl_exit){TL_EXIT_FORCED, 0.0f, mm}, what, early);
        }
        check_reference(m, L, (tl_exit){TL_EXIT_NONE, 0.0f, 1}, what, early);
    }
    for (uint32_t rule = TL_EXIT_GATE; rule <= TL_EXIT_ARGMAX; rule++) {
        int depths = 0;
        for (uint32_t U = 1; U < MAX_L; U++) depths += early[rule][U] > 0;
        CHECK(depths >= 2, "%s: rule %u exits early at %d depths (1 .. 4: %u %u %u %u)", what, rule, depths,
              early[rule][1], early[rule][2], early[rule][3], early[rule][4]);
    }
}

/* ---- the public paths ----------------------------------------------------------------------- */

typedef struct request {
    int32_t prompt[PROMPT + 4];
    size_t n;
    tl_gen_params p;
    tu_result want;
    tl_depth_stats depth;
} request;

static request reqs[NREQ];

/* Requests of seed: a mix of every rule and plain decoding at depths 1 .. 5 with min_loops,
 * windows, sampling and one speculative request (5); `short_prompts` makes them decode-heavy. */
static void make_requests(uint64_t seed, uint32_t V, int short_prompts) {
    static const uint32_t rules[NREQ] = {TL_EXIT_GATE, TL_EXIT_LATENT, TL_EXIT_NONE, TL_EXIT_KL, TL_EXIT_ARGMAX,
                                         TL_EXIT_NONE, TL_EXIT_KL, TL_EXIT_ARGMAX, TL_EXIT_GATE, TL_EXIT_LATENT};
    static const float kl_q[] = {1e-3f, 1e-2f, 0.1f, 1.0f, 1e30f};
    uint64_t rng = seed;
    for (int i = 0; i < NREQ; i++) {
        request* r = &reqs[i];
        r->n = short_prompts ? 2 : (size_t)tu_uniform(&rng, 3, PROMPT + 4);
        for (size_t j = 0; j < r->n; j++) r->prompt[j] = tu_uniform(&rng, 0, (int32_t)V - 1);
        tl_gen_params* p = &r->p;
        *p = tu_gen_params((size_t)tu_uniform(&rng, short_prompts ? MAX_NEW - 2 : 2, MAX_NEW),
                           (uint32_t)tu_uniform(&rng, 1, 5), i == 3 ? 5 : 0, i % 2, tu_next(&rng));
        p->exit_rule = rules[i];
        if (p->exit_rule == TL_EXIT_GATE) p->exit_threshold = (float)tu_uniform(&rng, 0, 9) / 10.0f;
        if (p->exit_rule == TL_EXIT_LATENT) p->exit_threshold = (float)tu_uniform(&rng, 0, 6) / 4.0f;
        if (p->exit_rule == TL_EXIT_KL) p->exit_threshold = kl_q[tu_uniform(&rng, 0, 4)];
        if (p->exit_rule == TL_EXIT_ARGMAX) p->exit_threshold = (float)tu_uniform(&rng, 1, 3);
        if (p->exit_rule != TL_EXIT_NONE) p->min_loops = (uint32_t)tu_uniform(&rng, 0, (int32_t)p->loops);
        if (short_prompts && p->exit_rule != TL_EXIT_NONE) { /* most decoded tokens exit early */
            p->loops = (uint32_t)tu_uniform(&rng, p->exit_rule == TL_EXIT_KL ? 3 : 2, 5);
            p->min_loops = (uint32_t)tu_uniform(&rng, 1, (int32_t)p->loops - 1);
            p->exit_threshold = p->exit_rule == TL_EXIT_GATE ? 0.01f : p->exit_rule == TL_EXIT_ARGMAX ? 1.0f : 1e30f;
        }
        if (i == 5) {
            p->loops = 3, p->n_draft = 2, p->draft_loops = 1;
        }
    }
}

/* Each request alone: its result and depth counters. */
static void generate_alone(tl_model* m, uint32_t V) {
    for (int i = 0; i < NREQ; i++) {
        request* r = &reqs[i];
        tu_result_free(&r->want);
        tl_gen_params p = r->p;
        p.depth_stats = &r->depth;
        r->want = tu_generate(m, r->prompt, r->n, &p, V);
        CHECK(r->depth.tokens + 1 == r->want.n || p.n_draft || r->want.n == 0, "request %d: %llu decode passes for %zu "
              "tokens", i, (unsigned long long)r->depth.tokens, r->want.n);
        const uint32_t least = !p.exit_rule ? p.loops : p.min_loops ? p.min_loops : 1;
        CHECK(r->depth.loops <= r->depth.tokens * p.loops && r->depth.loops >= r->depth.tokens * least,
              "request %d: %llu loops in %llu passes", i, (unsigned long long)r->depth.loops,
              (unsigned long long)r->depth.tokens);
    }
}

/* Whether a request under each rule ran a decoded token short of its depth (the decode-heavy
 * requests must, so that the paths below see exits of every rule). */
static void check_exits_seen(const char* what) {
    for (uint32_t rule = TL_EXIT_GATE; rule <= TL_EXIT_ARGMAX; rule++) {
        int seen = 0;
        for (int i = 0; i < NREQ; i++)
            seen = seen || (reqs[i].p.exit_rule == rule &&
                            reqs[i].depth.loops < reqs[i].depth.tokens * reqs[i].p.loops);
        CHECK(seen, "%s: no request under rule %u exits early", what, rule);
    }
}

static void check_alone(tl_model* m, uint32_t V, const char* what) {
    for (int i = 0; i < NREQ; i++) {
        tu_result got = tu_generate(m, reqs[i].prompt, reqs[i].n, &reqs[i].p, V);
        CHECK(tu_same_result(&reqs[i].want, &got), "%s: request %d differs", what, i);
        tu_result_free(&got);
    }
}

static void check_from_prefix(tl_model* m, uint32_t V) {
    for (int i = 0; i < NREQ; i++) {
        const request* r = &reqs[i];
        tl_prefix* prefix = NULL;
        CHECK_OK(tl_prefix_build(m, r->prompt, 2, r->p.loops + (i % 2), r->p.cache_window, 0, &prefix));
        tu_result got = tu_from_prefix(prefix, r->prompt + 2, r->n - 2, &r->p, V);
        CHECK(tu_same_result(&r->want, &got), "from a prefix: request %d differs", i);
        tu_result_free(&got);
        tl_prefix_free(prefix);
    }
}

static void check_batch(tl_model* m, uint32_t V) {
    tl_request rs[NREQ];
    tl_request* ptrs[NREQ];
    tu_result got[NREQ];
    tl_gen_params params[NREQ];
    tl_depth_stats depth[NREQ];
    for (int i = 0; i < NREQ; i++) {
        got[i] = tu_result_new(reqs[i].p.max_tokens, V);
        params[i] = reqs[i].p;
        params[i].depth_stats = &depth[i];
        rs[i] = (tl_request){.size = sizeof(tl_request), .prompt = reqs[i].prompt, .n_prompt = reqs[i].n,
                             .params = &params[i], .out_tokens = got[i].tokens, .out_logits = got[i].logits};
        ptrs[i] = &rs[i];
    }
    CHECK_OK(tl_generate_batch(m, ptrs, NREQ));
    for (int i = 0; i < NREQ; i++) {
        got[i].n = rs[i].n_out;
        CHECK(tu_same_result(&reqs[i].want, &got[i]), "batch: request %d differs", i);
        CHECK(depth[i].tokens == reqs[i].depth.tokens && depth[i].loops == reqs[i].depth.loops,
              "batch: request %d depth counters differ", i);
        tu_result_free(&got[i]);
    }
}

/* Every request through a scheduler (request i added at step i % 3); their tokens must be the
 * ones they get alone. Returns the final counters. */
enum { TU_MAX_DEPTH = 64 }; /* deeper than any request here */

static tl_sched_stats run_scheduled(tl_model* m, size_t max_batch, size_t step_tokens, size_t budget) {
    tl_sched_stats st = {.size = sizeof st};
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = max_batch, sp.step_tokens = step_tokens, sp.kv_budget_bytes = budget;
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, &sp, &s));
    if (!s) return st;
    uint64_t ids[NREQ] = {0}, ev_ids[EVENTS];
    int32_t got[NREQ][MAX_NEW], ev_tokens[EVENTS];
    uint8_t ev_finish[EVENTS];
    size_t n_got[NREQ] = {0}, n_events = 0;
    for (int step = 0; step < 2000; step++) {
        for (int i = 0; i < NREQ; i++)
            if (i % 3 == step) CHECK_OK(tl_sched_add(s, reqs[i].prompt, reqs[i].n, &reqs[i].p, &ids[i]));
        CHECK_OK(tl_sched_step(s, ev_ids, ev_tokens, ev_finish, EVENTS, &n_events));
        for (size_t ev = 0; ev < n_events; ev++)
            for (int i = 0; i < NREQ; i++)
                if (ids[i] == ev_ids[ev] && n_got[i] < MAX_NEW) got[i][n_got[i]++] = ev_tokens[ev];
        CHECK_OK(tl_sched_stats_get(s, &st));
        if (budget) CHECK(st.kv_bytes <= budget, "kv_bytes %zu > budget %zu", st.kv_bytes, budget);
        if (step >= 3 && st.running == 0 && st.waiting == 0) break;
    }
    for (int i = 0; i < NREQ; i++)
        CHECK(n_got[i] == reqs[i].want.n && memcmp(got[i], reqs[i].want.tokens, n_got[i] * sizeof(int32_t)) == 0,
              "scheduler (batch %zu, step %zu, budget %zu): request %d got %zu tokens, want %zu", max_batch,
              step_tokens, budget, i, n_got[i], reqs[i].want.n);
    uint64_t counts[TU_MAX_DEPTH], passes = 0, loops = 0;
    size_t n_depths = 0;
    CHECK_OK(tl_sched_depth_counts(s, counts, TU_MAX_DEPTH, &n_depths));
    CHECK(n_depths <= TU_MAX_DEPTH && (n_depths == 0 || counts[n_depths - 1] > 0), "deepest count %zu", n_depths);
    for (size_t u = 1; u <= n_depths && u <= TU_MAX_DEPTH; u++) passes += counts[u - 1], loops += u * counts[u - 1];
    CHECK(passes == st.decode_passes && loops == st.decode_loops, "depth counts: %llu passes of %llu loops",
          (unsigned long long)passes, (unsigned long long)loops);
    tl_sched_free(s);
    return st;
}

static void check_scheduled(tl_model* m) {
    uint64_t passes = 0, loops = 0;
    for (int i = 0; i < NREQ; i++) passes += reqs[i].depth.tokens, loops += reqs[i].depth.loops;
    const tl_sched_stats st = run_scheduled(m, 4, 8, 0);
    CHECK(st.preemptions == 0 && st.decode_passes == passes && st.decode_loops == loops, "scheduler: %llu decode "
          "passes of %llu loops, want %llu of %llu", (unsigned long long)st.decode_passes,
          (unsigned long long)st.decode_loops, (unsigned long long)passes, (unsigned long long)loops);
    run_scheduled(m, 1, 1, 0);
}

/* A budget that holds the largest request alone, so that decode-heavy requests preempt. */
static void check_preempted(tl_model* m) {
    tl_engine* e = NULL;
    CHECK_OK(tl_model_acquire(m, &e));
    size_t budget = 0;
    for (int i = 0; i < NREQ; i++) {
        const tl_kv_geom* g = &e->kv_geom;
        const size_t blocks = (reqs[i].n + reqs[i].p.max_tokens + g->block_size - 1) / g->block_size;
        const size_t need = blocks * tl_kv_block_bytes(g, (uint32_t)tl_n_layers(&e->file.cfg, reqs[i].p.loops));
        if (need > budget) budget = need;
    }
    tl_engine_unref(e);
    uint64_t preemptions = 0;
    for (size_t step_tokens = 4; step_tokens <= 16; step_tokens *= 2)
        preemptions += run_scheduled(m, 4, step_tokens, budget).preemptions;
    CHECK(preemptions > 0, "no preemption under a budget of %zu bytes", budget);
}

/* Settings that cannot exit decode as plain decoding does, bit for bit. */
static void check_cannot_exit(tl_model* m, uint32_t V) {
    for (uint32_t L = 1; L <= 4; L++) {
        tl_gen_params plain = tu_gen_params(8, L, 0, (int)L % 2, L);
        tu_result want = tu_generate(m, prompt, PROMPT, &plain, V);
        tl_gen_params cases[8] = {plain, plain, plain, plain, plain, plain, plain, plain};
        cases[0].exit_rule = TL_EXIT_LATENT, cases[0].exit_threshold = 1e30f, cases[0].min_loops = L;
        cases[1].exit_rule = TL_EXIT_GATE, cases[1].exit_threshold = 1.0f;
        cases[2].exit_rule = TL_EXIT_GATE, cases[2].exit_threshold = 1e-6f, cases[2].min_loops = L;
        cases[3].exit_threshold = 1e-6f, cases[3].min_loops = 1; /* no rule: the threshold is ignored */
        cases[4].exit_rule = TL_EXIT_KL, cases[4].exit_threshold = 1e30f, cases[4].min_loops = L;
        cases[5].exit_rule = TL_EXIT_ARGMAX, cases[5].exit_threshold = 1.0f, cases[5].min_loops = L;
        cases[6].exit_rule = TL_EXIT_ARGMAX, cases[6].exit_threshold = 1024.0f; /* c_i <= i < 1024 */
        if (L <= 2) /* kl first decides after iteration 1, which needs L >= 3 */
            cases[7].exit_rule = TL_EXIT_KL, cases[7].exit_threshold = 1e30f;
        else
            cases[7].exit_rule = TL_EXIT_ARGMAX, cases[7].exit_threshold = (float)(L - 1);
        for (int i = 0; i < 8; i++) {
            tl_depth_stats st;
            cases[i].depth_stats = &st;
            tu_result got = tu_generate(m, prompt, PROMPT, &cases[i], V);
            CHECK(tu_same_result(&want, &got), "L %u case %d: differs from plain decoding", L, i);
            CHECK(st.loops == st.tokens * L && st.tokens + 1 == got.n, "L %u case %d: %llu loops in %llu passes", L, i,
                  (unsigned long long)st.loops, (unsigned long long)st.tokens);
            tu_result_free(&got);
        }
        /* tl_generate decodes as prefill + tl_seq_decode do */
        tl_seq* s = NULL;
        CHECK_OK(tl_seq_create(m, L, 0, &s));
        float* z = malloc(V * sizeof(float));
        CHECK_OK(tl_seq_prefill(s, prompt, PROMPT, 0, z));
        plain.temperature = 0.0f;
        tu_result greedy = tu_generate(m, prompt, PROMPT, &plain, V);
        for (size_t k = 0; k < greedy.n; k++) {
            CHECK(tu_same_bits(z, greedy.logits + k * V, V) && argmax(z, V) == greedy.tokens[k],
                  "L %u: token %zu differs from tl_seq_decode", L, k);
            CHECK_OK(tl_seq_decode(s, greedy.tokens[k], z));
        }
        free(z);
        tl_seq_free(s);
        tu_result_free(&greedy);
        tu_result_free(&want);
    }
}

/* ---- main ------------------------------------------------------------------------------------ */

static void check_model(const char* name, tu_spec spec, int paths) {
    const char* path = tu_write_model(name, &spec);
    tl_model* m = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 0);
    const uint32_t V = spec.vocab;
    check_references(m, name);
    tl_model* m4 = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT4, 0);
    check_references(m4, name);
    tl_model_free(m4);
    if (paths) {
        tl_model* scalar = open_model(path, 1, TL_ISA_SCALAR, TL_KV_INT8, 0);
        tl_model* cached = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 1 << 20);
        check_cannot_exit(m, V);
        for (int heavy = 0; heavy < 2; heavy++) {
            make_requests(spec.seed * 7 + (uint64_t)heavy, V, heavy);
            generate_alone(m, V);
            if (heavy) check_exits_seen(name);
            check_alone(scalar, V, "1 thread, scalar");
            check_alone(cached, V, "prefix cache");
            if (!heavy) check_from_prefix(m, V);
            check_batch(m, V);
            for (int i = 0; i < 2; i++) {
                tl_model* sm = i ? cached : m;
                if (!heavy) check_scheduled(sm);
                else check_preempted(sm);
            }
        }
        tl_model_free(scalar);
        tl_model_free(cached);
    }
    tl_model_free(m);
}

int main(void) {
    uint64_t rng = 99;
    for (int i = 0; i < PROMPT; i++) prompt[i] = tu_uniform(&rng, 0, 255);
    for (int i = 0; i < MAX_D; i++) gate_w[i] = (int8_t)tu_uniform(&rng, -127, 127);

    tu_spec plain = tu_spec_default();
    plain.loops = 3;
    const char* path = tu_write_model("adaptive-plain.tinyloop", &plain);
    tl_model* m = tu_open(path, 2, TL_ISA_AUTO, 4);
    tl_model* gated = open_model(path, 2, TL_ISA_AUTO, TL_KV_INT8, 0);
    check_validation(m, gated);
    tl_model_free(m);
    tl_model_free(gated);
    check_gate_exact(path);
    check_known_exits(path, plain);

    tu_spec huginn = tu_spec_huginn();
    tu_spec post = tu_spec_huginn();
    post.layout = 2, post.n_coda = 2, post.seed = 5;
    tu_spec coda = tu_spec_coda();
    coda.seed = 3;
    check_model("adaptive-default.tinyloop", plain, 1);
    check_model("adaptive-huginn.tinyloop", huginn, 1);
    check_model("adaptive-post.tinyloop", post, 0);
    check_model("adaptive-coda.tinyloop", coda, 0);
    tu_spec hrm = tu_spec_hrm(); /* an exit copies all w = (C + 1) * n applications' KV */
    hrm.seed = 9;
    check_model("adaptive-hrm.tinyloop", hrm, 0);
    for (int i = 0; i < NREQ; i++) tu_result_free(&reqs[i].want);
    return tu_finish("test_adaptive");
}
