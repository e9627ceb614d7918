/* sampling.c — docs/spec.md §5.1-5.2: repetition penalty, argmax, candidate order (logit
 * descending, id ascending), top-k, fixed-point softmax weights, integer top-p and the draw.
 *
 * Speed without changing a result: a candidate whose exponent (y_i - m) * LOG2E is <= -22
 * gets weight rint(exp2s(x) * 2^20) = 0 (exp2s(x) < 2^-21), and such candidates form a suffix
 * of the order, so they can never be drawn nor move the top-p cut. Only the others are sorted;
 * with top_k, only the best k of them are kept (a bounded heap). Greedy decoding without a
 * penalty takes one vectorised sweep (argmax_finite) instead. */
#include "core/sampling.h"

#include <math.h>
#include <stdbool.h>

#include "base/errors.h"
#include "core/numerics.h"

uint64_t tl_rng(uint64_t seed, uint64_t pos) {
    uint64_t z = seed + (pos + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Candidate order: z descending, then id ascending. */
static int before(const float* z, int32_t a, int32_t b) {
    return z[a] > z[b] || (z[a] == z[b] && a < b);
}

/* Heap whose root is the last candidate in order (the first to drop). */
static void sift_down(const float* z, int32_t* h, size_t n, size_t i) {
    for (;;) {
        size_t worst = i, l = 2 * i + 1, r = l + 1;
        if (l < n && before(z, h[worst], h[l])) worst = l;
        if (r < n && before(z, h[worst], h[r])) worst = r;
        if (worst == i) return;
        int32_t tmp = h[i];
        h[i] = h[worst];
        h[worst] = tmp;
        i = worst;
    }
}

/* Keep the best `k` of ids[0..n) and return them sorted in candidate order (k <= n). */
static void select_sorted(const float* z, int32_t* ids, size_t n, size_t k) {
    for (size_t i = k / 2; i-- > 0;) sift_down(z, ids, k, i);
    for (size_t i = k; i < n; i++)
        if (before(z, ids[i], ids[0])) {
            ids[0] = ids[i];
            sift_down(z, ids, k, 0);
        }
    for (size_t end = k; end > 1; end--) { /* heapsort: worst to the back */
        int32_t tmp = ids[0];
        ids[0] = ids[end - 1];
        ids[end - 1] = tmp;
        sift_down(z, ids, end - 1, 0);
    }
}

enum { LANES = 16 }; /* independent maxima: the compiler makes them one vector register */

/* The lowest id of the greatest of x[0..V) (V >= 1), as the argmax below finds it; false when
 * some x[i] is NaN or infinite (then x * 0 is NaN, and so is every sum holding it). Each lane
 * keeps `v > m ? v : m` (a vector max) and a sum of v * 0: the sweep has no branch, and the
 * id is found after it. */
static bool argmax_finite(const float* x, uint32_t V, int32_t* best) {
    float m[LANES], nan[LANES];
    for (int l = 0; l < LANES; l++) {
        m[l] = x[0];
        nan[l] = 0.0f;
    }
    uint32_t i = 0;
    for (; i + LANES <= V; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = x[i + l];
            nan[l] += v * 0.0f;
            m[l] = v > m[l] ? v : m[l];
        }
    float top = x[0], check = 0.0f;
    for (; i < V; i++) {
        check += x[i] * 0.0f;
        top = x[i] > top ? x[i] : top;
    }
    for (int l = 0; l < LANES; l++) {
        check += nan[l];
        top = m[l] > top ? m[l] : top;
    }
    if (check != 0.0f) return false;
    uint32_t j = 0;
    while (x[j] != top) j++;
    *best = (int32_t)j;
    return true;
}

tl_status tl_sample(const tl_sampler* s, const float* logits, uint32_t V, const uint8_t* seen,
                    uint64_t pos, tl_sample_scratch* w, int32_t* token) {
    if (s->temperature == 0.0f && s->penalty == 1.0f && argmax_finite(logits, V, token)) return TL_OK;
    float* z = w->z;
    for (uint32_t i = 0; i < V; i++) {
        if (!isfinite(logits[i]))
            return tl_fail(TL_ERR_NUMERIC, "non-finite logits: logit %u is %g at position %llu", i,
                           (double)logits[i], (unsigned long long)pos);
        z[i] = logits[i];
        if (s->penalty != 1.0f && seen[i]) z[i] = z[i] > 0 ? z[i] / s->penalty : z[i] * s->penalty;
    }
    int32_t best = 0;
    for (uint32_t i = 1; i < V; i++)
        if (z[i] > z[best]) best = (int32_t)i;
    if (s->temperature == 0.0f) {
        *token = best;
        return TL_OK;
    }
    const float T = s->temperature;
    const float m = z[best] / T;
    if (isinf(m)) { /* z / T overflowed: the top candidate wins (as the reference does) */
        *token = best;
        return TL_OK;
    }
    size_t n = 0;
    for (uint32_t i = 0; i < V; i++)
        if ((int32_t)i == best || (z[i] / T - m) * TL_LOG2E > -22.0f) w->order[n++] = (int32_t)i;
    size_t kept = n;
    if (s->top_k > 0 && (uint32_t)s->top_k < V && (size_t)s->top_k < n) kept = (size_t)s->top_k;
    select_sorted(z, w->order, n, kept);

    /* the first candidate has weight exp2s(0) * 2^20 = 2^20, so every sum below is > 0 */
    int64_t total = 0;
    for (size_t i = 0; i < kept; i++) {
        const float e = tl_exp2s((z[w->order[i]] / T - m) * TL_LOG2E);
        w->weights[i] = tl_to_i64(tl_rint(e * 1048576.0f)); /* 2^20 */
        total += w->weights[i];
    }
    const int64_t P = tl_to_i64(tl_rint(s->top_p * 1048576.0f));
    size_t cut = 0;
    int64_t mass = 0;
    while (cut < kept) {
        mass += w->weights[cut++];
        if (mass * 1048576 >= P * total) break;
    }
    const uint64_t r = tl_rng(s->seed, pos) % (uint64_t)mass;
    size_t i = 0;
    for (int64_t run = w->weights[0]; (uint64_t)run <= r; run += w->weights[++i]) {
    }
    *token = w->order[i];
    return TL_OK;
}
