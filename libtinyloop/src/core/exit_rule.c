/* exit_rule.c — the exit decision of docs/spec.md §5.7 (exit_rule.h), in scalar C on the host. */
#include "core/exit_rule.h"

#include <string.h>

#include "core/numerics.h"

bool tl_exit_active(const tl_exit* x, uint32_t loops) {
    return x->rule != TL_EXIT_NONE && x->min_loops < loops && !(x->rule == TL_EXIT_GATE && x->q == 1.0f);
}

void tl_exit_begin(tl_exit_state* s, const tl_exit* x, uint32_t loops, const float* x0, float* prev,
                   const tl_file* f) {
    s->exit = *x;
    if (!tl_exit_active(x, loops)) s->exit.rule = TL_EXIT_NONE;
    s->c = 0.0f;
    s->r = 1.0f;
    s->prev = prev;
    if (s->exit.rule == TL_EXIT_LATENT) memcpy(prev, x0, f->cfg.d_model * sizeof(float));
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
    float t = -v;
    const float e = tl_exps(t);
    t = 1.0f + e;
    const float lambda = 1.0f / t;
    const float p = lambda * st->r;
    st->c = st->c + p;
    st->r = st->r * (1.0f - lambda);
}

/* The latent rule's ratio ρ = (sqrt((f32) nd) * sd) / (sqrt((f32) nx) * sx) of δ = x - prev and
 * x, through Q16; then prev = x. Returns whether nx > 0 and ρ < q. */
static bool latent_step(tl_exit_state* st, const tl_file* f, const float* x, bool decide) {
    const size_t d = f->cfg.d_model;
    float* delta = st->prev;
    bool hit = false;
    if (decide) {
        for (size_t k = 0; k < d; k++) delta[k] = x[k] - delta[k];
        float sd, sx;
        const int64_t nd = quantized_squares(delta, d, 32767.0f, &sd);
        const int64_t nx = quantized_squares(x, d, 32767.0f, &sx);
        const float rho = (sqrtf((float)nd) * sd) / (sqrtf((float)nx) * sx);
        hit = nx > 0 && rho < st->exit.q;
    }
    memcpy(st->prev, x, d * sizeof(float));
    return hit;
}

bool tl_exit_after(tl_exit_state* s, const tl_file* f, uint32_t i, const float* xi) {
    const bool allowed = i + 1 >= s->exit.min_loops;
    switch (s->exit.rule) {
    case TL_EXIT_GATE:
        gate_step(s, f, xi); /* after every iteration, whether or not m allows an exit yet */
        return allowed && s->c >= s->exit.q;
    case TL_EXIT_LATENT:
        return latent_step(s, f, xi, allowed);
    case TL_EXIT_FORCED:
        return allowed;
    default:
        return false;
    }
}
