/* exit_rule.h — adaptive depth's exit decision (docs/spec.md §5.7), on the host, for any backend.
 *
 * Contract: a row of a decode pass whose rule is active is begun (tl_exit_begin) on the state
 * entering core iteration 0, then asked after each iteration i <= L - 2, in order, with its
 * state x_i after that iteration (before any step norm of the next; tl_exit_after), until it
 * answers true: the row exits with U = i + 1 iterations. The kl and argmax rules read the
 * row's probe logits z_i too (coda_norm, the coda in depth L's slots and the head on a copy of
 * x_i): the caller probes the row after iteration i when tl_exit_probes says so, and hands the
 * logits over (else NULL: a row it did not probe at i is never asked to exit there). Each
 * answer is §5.7's decision computed literally (scalar f32 operations in the spec's order,
 * exact integer sums), so every backend that hands over the same states and logits gets the
 * same exits. The caller owns the rows, the probes and the copies of the KV an exit writes;
 * this file reads rows x[d] and z[V] in host memory and nothing else. */
#ifndef TL_EXIT_RULE_H
#define TL_EXIT_RULE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/loader.h"

/* The default thresholds of the rules that work on any model (Huginn's; tinyloop/engine.py's
 * EXIT_DEFAULT_THRESHOLDS): latent, kl, and argmax's count of steps. */
#define TL_EXIT_LATENT_DEFAULT 0.03f
#define TL_EXIT_KL_DEFAULT 0.001f
#define TL_EXIT_ARGMAX_DEFAULT 5.0f
/* The argmax rule's largest threshold (tinyloop/engine.py's MAX_ARGMAX_STEPS). */
enum { TL_EXIT_ARGMAX_MAX = 1024 };

/* Internal rule kind, past tl_exit_rule's values (never accepted from a caller): a scheduled
 * request's replay, which exits at min_loops = its recorded U, whatever its state. */
enum { TL_EXIT_FORCED = 255 };

/* One request's rule, checked and resolved (q never 0; min_loops >= 1). */
typedef struct tl_exit {
    uint32_t rule;      /* tl_exit_rule, or TL_EXIT_FORCED */
    float q;            /* the threshold                  */
    uint32_t min_loops; /* m                              */
} tl_exit;

/* The caller's storage for one row's rule (what tl_exit_storage asks for; NULL where not). */
typedef struct tl_exit_store {
    float* prev;    /* latent: [d] the state after the previous iteration      */
    float* logits;  /* kl: [V] the previous probe's logits z'                   */
    int32_t* w;     /* kl: [V] the previous probe's weights W' (each <= 2^24)   */
} tl_exit_store;

/* A row's progress under its rule through one pass. */
typedef struct tl_exit_state {
    tl_exit exit;      /* rule TL_EXIT_NONE when it cannot fire at this depth (never evaluated) */
    float c, r;        /* gate: the exit distribution's CDF, and the probability left          */
    tl_exit_store at;  /* the caller's storage                                                  */
    bool have_prev;    /* kl: a previous probe is stored; argmax: a_{i-1} is set                */
    bool prev_finite;  /* kl: every logit of the previous probe is finite                       */
    float prev_max;    /* kl: M' of the previous probe                                          */
    int64_t prev_sum;  /* kl: S' = Σ W'_j                                                       */
    int32_t arg;       /* argmax: a_{i-1}                                                       */
    uint32_t count;    /* argmax: c_{i-1}                                                       */
} tl_exit_state;

/* Whether the rule can make a row of depth `loops` exit before its last iteration: a rule,
 * min_loops < loops, and not the gate with q = 1 (which §5.7 never evaluates). */
bool tl_exit_active(const tl_exit* x, uint32_t loops);

/* What a row of depth `loops` under *x needs from its caller: *latent the prev row ([d]
 * floats), *kl the logits and weights ([V] floats and [V] i32), *probes probes (kl, argmax). */
void tl_exit_storage(const tl_exit* x, uint32_t loops, bool* latent, bool* kl, bool* probes);

/* Start a row of depth `loops` under *x with x0[d], its state entering iteration 0 (zero with
 * injection, else the prelude's output); `store` (what tl_exit_storage asked for) is kept. A
 * kl or argmax row that cannot fire at this depth (kl below depth 3, argmax with
 * max(q, min_loops - 1) > loops - 2) is begun inactive: it probes nothing. */
void tl_exit_begin(tl_exit_state* s, const tl_exit* x, uint32_t loops, const float* x0, tl_exit_store store,
                   const tl_file* f);

/* Whether the row (begun) needs its probe logits after iteration i: kl from iteration
 * min_loops - 2 on (its first decision compares min_loops - 1 with the iteration before),
 * argmax after every iteration (its count starts at iteration 0). Callers probe only rows
 * that will be asked after i (i <= L - 2). */
bool tl_exit_probes(const tl_exit_state* s, uint32_t i);

/* After iteration i (i <= L - 2) with the row's state xi[d] and, when tl_exit_probes(s, i),
 * its probe logits zi[V] (else NULL): whether it exits now (U = i + 1). Always false for a
 * row begun inactive. */
bool tl_exit_after(tl_exit_state* s, const tl_file* f, uint32_t i, const float* xi, const float* zi);

#endif
