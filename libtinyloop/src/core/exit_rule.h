/* exit_rule.h — adaptive depth's exit decision (docs/spec.md §5.7), on the host, for any backend.
 *
 * Contract: a row of a decode pass whose rule is active is begun (tl_exit_begin) on the state
 * entering core iteration 0, then asked after each iteration i <= L - 2, in order, with its
 * state x_i after that iteration (before any step norm of the next; tl_exit_after), until it
 * answers true: the row exits with U = i + 1 iterations. Each answer is §5.7's decision computed
 * literally (scalar f32 operations in the spec's order, exact integer sums), so every backend
 * that hands over the same states gets the same exits. The caller owns the rows and the copies
 * of the KV an exit writes; this file reads a row x[d] in host memory and nothing else. */
#ifndef TL_EXIT_RULE_H
#define TL_EXIT_RULE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/loader.h"

/* The latent rule's default threshold (Huginn's `latent-diff` default; tinyloop/engine.py's
 * LATENT_DEFAULT_THRESHOLD). */
#define TL_EXIT_LATENT_DEFAULT 0.03f

/* Internal rule kind, past tl_exit_rule's values (never accepted from a caller): a scheduled
 * request's replay, which exits at min_loops = its recorded U, whatever its state. */
enum { TL_EXIT_FORCED = 3 };

/* One request's rule, checked and resolved (q never 0; min_loops >= 1). */
typedef struct tl_exit {
    uint32_t rule;      /* tl_exit_rule, or TL_EXIT_FORCED */
    float q;            /* the threshold                  */
    uint32_t min_loops; /* m                              */
} tl_exit;

/* A row's progress under its rule through one pass. */
typedef struct tl_exit_state {
    tl_exit exit; /* rule TL_EXIT_NONE when it cannot fire at this depth (never evaluated) */
    float c, r;   /* gate: the exit distribution's CDF, and the probability left          */
    float* prev;  /* latent: [d] the state after the previous iteration (caller's storage) */
} tl_exit_state;

/* Whether the rule can make a row of depth `loops` exit before its last iteration: a rule,
 * min_loops < loops, and not the gate with q = 1 (which §5.7 never evaluates). */
bool tl_exit_active(const tl_exit* x, uint32_t loops);

/* Start a row of depth `loops` under *x with x0[d], its state entering iteration 0 (zero with
 * injection, else the prelude's output); `prev` ([d], the latent rule's storage) is kept. */
void tl_exit_begin(tl_exit_state* s, const tl_exit* x, uint32_t loops, const float* x0, float* prev,
                   const tl_file* f);

/* After iteration i (i <= L - 2) with the row's state xi[d]: whether it exits now (U = i + 1).
 * Always false for a row begun inactive. */
bool tl_exit_after(tl_exit_state* s, const tl_file* f, uint32_t i, const float* xi);

#endif
