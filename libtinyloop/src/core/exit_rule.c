/* exit_rule.c — the exit decision of docs/spec.md §5.7 (exit_rule.h), in scalar C on the host. */
#include "core/exit_rule.h"

#include <math.h>
#include <string.h>

#include "core/numerics.h"

bool tl_exit_active(const tl_exit* x, uint32_t loops) {
    return x->rule != TL_EXIT_NONE && x->min_loops < loops && !(x->rule == TL_EXIT_GATE && x->q == 1.0f);
}

/* The rule a row of depth `loops` runs: x's, or TL_EXIT_NONE when it cannot fire there. kl
 * first decides at iteration max(1, m - 1), argmax at max(q, m - 1) (c_i <= i), and the last
 * iteration that decides is L - 2. */
static uint32_t row_rule(const tl_exit* x, uint32_t loops) {
    if (!tl_exit_active(x, loops)) return TL_EXIT_NONE;
    if (x->rule == TL_EXIT_KL && loops < 3) return TL_EXIT_NONE;
    if (x->rule == TL_EXIT_ARGMAX && !(x->q <= (float)loops - 2.0f)) return TL_EXIT_NONE;
    return x->rule;
}

void tl_exit_storage(const tl_exit* x, uint32_t loops, bool* latent, bool* kl, bool* probes) {
    const uint32_t rule = row_rule(x, loops);
    *latent = rule == TL_EXIT_LATENT;
    *kl = rule == TL_EXIT_KL;
    *probes = rule == TL_EXIT_KL || rule == TL_EXIT_ARGMAX;
}

void tl_exit_begin(tl_exit_state* s, const tl_exit* x, uint32_t loops, const float* x0, tl_exit_store store,
                   const tl_file* f) {
    memset(s, 0, sizeof *s);
    s->exit = *x;
    s->exit.rule = row_rule(x, loops);
    s->c = 0.0f;
    s->r = 1.0f;
    s->at = store;
    if (s->exit.rule == TL_EXIT_LATENT) memcpy(store.prev, x0, f->cfg.d_model * sizeof(float));
}

bool tl_exit_probes(const tl_exit_state* s, uint32_t i) {
    return s->exit.rule == TL_EXIT_ARGMAX || (s->exit.rule == TL_EXIT_KL && i + 2 >= s->exit.min_loops);
}

/* Σ q_k² of (q, s) = Q(x[n], qmax) (§2.2; exact), and *s. */
static int64_t quantized_squares(const float* x, size_t n, float fq, float* s) {
    float r;
    *s = tl_quantize_begin(x, n, fq, &r);
    int64_t ss = 0;
    for (size_t k = 0; *s != 0.0f && k < n; k++) {
        const int64_t q = tl_quantize_one(x[k], r, fq);
        ss += q * q;
    }
    return ss;
}

/* The gate's step after an iteration: (qg, a) = NQ(x), v = (((f32) Σ qg_k w_k) * a) * s + b,
 * λ = 1 / (1 + exps(-v)), then p = λ r, c = c + p, r = r (1 - λ). */
static void gate_step(tl_exit_state* st, const tl_file* f, const float* x) {
    const size_t d = f->cfg.d_model;
    float r;
    const float s = tl_quantize_begin(x, d, 127.0f, &r);
    int64_t ss = 0, dot = 0;
    for (size_t k = 0; s != 0.0f && k < d; k++) {
        const int64_t q = tl_quantize_one(x[k], r, 127.0f);
        ss += q * q;
        dot += q * f->exit_gate_w[k];
    }
    const float a = tl_nq_scale(ss, s, d, f->cfg.rms_eps);
    const float v = (((float)dot * a) * f->exit_gate_s) + f->exit_gate_b;
    const float lambda = tl_sigmoid(v);
    const float p = lambda * st->r;
    st->c = st->c + p;
    st->r = st->r * (1.0f - lambda);
}

/* The latent rule's ratio ρ = (sqrt((f32) nd) * sd) / (sqrt((f32) nx) * sx) of δ = x - prev and
 * x, through Q16; then prev = x. Returns whether nx > 0 and ρ < q. */
static bool latent_step(tl_exit_state* st, const tl_file* f, const float* x, bool decide) {
    const size_t d = f->cfg.d_model;
    float* delta = st->at.prev;
    bool hit = false;
    if (decide) {
        for (size_t k = 0; k < d; k++) delta[k] = x[k] - delta[k];
        float sd, sx;
        const int64_t nd = quantized_squares(delta, d, 32767.0f, &sd);
        const int64_t nx = quantized_squares(x, d, 32767.0f, &sx);
        const float rho = (sqrtf((float)nd) * sd) / (sqrtf((float)nx) * sx);
        hit = nx > 0 && rho < st->exit.q;
    }
    memcpy(st->at.prev, x, d * sizeof(float));
    return hit;
}

/* The kl rule's step on the probe logits z[V]: with the previous probe's (z', M', W', S'),
 *   δ = z' - z, (qd, sd) = Q(δ, 2^19 - 1), A = (((f32) Σ W'_j qd_j) / (f32) S') * sd,
 *   k = A - (M' - M), l = (log2s(S) - log2s(S')) * LN2, KL = k + l
 * (§5.7); then (z, M, W, S) become the previous probe's. Returns whether `decide`, a previous
 * probe, every logit of both finite, and KL < q. */
static bool kl_step(tl_exit_state* st, const tl_file* f, const float* z, bool decide) {
    const size_t V = f->cfg.vocab_size;
    float* zp = st->at.logits;
    int32_t* wp = st->at.w;
    const float fq = 524287.0f; /* 2^19 - 1 */
    float M = -INFINITY, amax = 0.0f;
    bool finite = true;
    for (size_t j = 0; j < V; j++) {
        M = tl_fmax(M, z[j]);
        finite = finite && isfinite(z[j]);
    }
    decide = decide && st->have_prev && st->prev_finite && finite;
    if (decide)
        for (size_t j = 0; j < V; j++) {
            const float delta = zp[j] - z[j];
            amax = fabsf(delta) > amax ? fabsf(delta) : amax;
        }
    /* §2.2 with qmax 2^19 - 1: sd = 0 and every qd = 0 for a row below 2^-64 */
    const bool tiny = amax < TL_TINY_ROW;
    const float r = tiny ? 0.0f : fq / amax, sd = tiny ? 0.0f : amax / fq;
    int64_t dot = 0, S = 0;
    for (size_t j = 0; j < V; j++) {
        if (decide && !tiny) {
            const float delta = zp[j] - z[j];
            dot += (int64_t)wp[j] * (int64_t)tl_quantize_one(delta, r, fq);
        }
        const int32_t w = (int32_t)tl_rint(tl_exp2s((z[j] - M) * TL_LOG2E) * 16777216.0f); /* <= 2^24 */
        S += w;
        wp[j] = w;
        zp[j] = z[j];
    }
    bool hit = false;
    if (decide) {
        const float A = (((float)dot) / (float)st->prev_sum) * sd;
        const float t = st->prev_max - M;
        const float k = A - t;
        float l = tl_log2s((uint64_t)S) - tl_log2s((uint64_t)st->prev_sum);
        l = l * TL_LN2;
        const float kl = k + l;
        hit = kl < st->exit.q;
    }
    st->have_prev = true;
    st->prev_finite = finite;
    st->prev_max = M;
    st->prev_sum = S;
    return hit;
}

/* The argmax rule's step on the probe logits z[V]: a_i the smallest index of the largest logit
 * (a NaN never the largest; all NaN: -1), c_i = a_i == a_{i-1} ? c_{i-1} + 1 : 0 (c_0 = 0).
 * Returns whether c_i >= q. */
static bool argmax_step(tl_exit_state* st, const tl_file* f, const float* z) {
    const size_t V = f->cfg.vocab_size;
    int32_t a = -1;
    for (size_t j = 0; j < V; j++)
        if (z[j] == z[j] && (a < 0 || z[j] > z[a])) a = (int32_t)j;
    st->count = st->have_prev && a == st->arg ? st->count + 1 : 0;
    st->arg = a;
    st->have_prev = true;
    return (float)st->count >= st->exit.q;
}

bool tl_exit_after(tl_exit_state* s, const tl_file* f, uint32_t i, const float* xi, const float* zi) {
    const bool allowed = i + 1 >= s->exit.min_loops;
    switch (s->exit.rule) {
    case TL_EXIT_GATE:
        gate_step(s, f, xi); /* after every iteration, whether or not m allows an exit yet */
        return allowed && s->c >= s->exit.q;
    case TL_EXIT_LATENT:
        return latent_step(s, f, xi, allowed);
    case TL_EXIT_KL:
        return zi && kl_step(s, f, zi, allowed);
    case TL_EXIT_ARGMAX:
        return zi && argmax_step(s, f, zi) && allowed; /* the count runs from iteration 0 */
    case TL_EXIT_FORCED:
        return allowed;
    default:
        return false;
    }
}
