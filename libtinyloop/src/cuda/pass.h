/* pass.h — the schedule of one CUDA forward pass (docs/spec.md §1, §4, §5.4, §5.6): which rows run
 * which step, on which state, in which order, and which cache slot each block writes. Pure host
 * logic, shared by forward.cu (whose steps launch kernels) and tests/test_cuda_describe.c (whose
 * steps record what ran), so the schedule is checked on the CPU. It is the order of
 * cpu/forward.c's pass, written over ranges of rows.
 *
 * The rows are ordered deepest first (loops non-increasing), so the rows still iterating in
 * iteration i are a prefix [0, active) and those whose depth is exactly i + 1 the range
 * [ended, active) at its end. Each step names its rows [lo, hi) and the state it works on: x, the
 * residual stream, or the copy, on which a prefix build runs the coda of the depths a row goes
 * beyond:
 *
 *   prelude block b          slot b, every row, on x                       (first_iter 0)
 *   injection                inj = linear(adapter_inject; Q8(x)), x = 0, every row (first_iter 0)
 *   two-state start          inj = 0 (l; x is h), every row                  (first_iter 0)
 *   iteration i >= first_iter  rows [0, active), those with loops > i:
 *     step norm (i >= 1)       x = RN(x, g_step)
 *     adapter (injection)      x = linear(adapter_state; Q8(x)) + inj
 *     core block j             slot n_layers(i) + j
 *     or, a two-state core:    hold (high = x, x = inj); then for each cycle c = 0 .. C (the
 *                              low ones, then the high one): x = x + high, its stack's blocks
 *                              (application a at slot n_layers(i) + a), x = RN(x), and after
 *                              the last low one inj = x
 *     keep, the last one       kept = x, every row (its state after its last iteration)
 *     rows [ended, active)     on x: the coda of depth coda_depth (0: i + 1); their state is final
 *     build: rows [0, ended)   copy = x, then on the copy the coda of depth i + 1
 *     build                    loop_states[i] = row T-1's state at depth i + 1 (x or the copy)
 *   the coda of depth D      the coda norm, then coda block c at slot n_layers(D) - n_coda + c
 *
 * A part pass (core/forward.h's tl_part) is this walk with first_iter > 0 (the rows enter that
 * iteration with their kept state and injected term or low state, already in x and inj), a
 * coda_depth (a draft's coda in the sequence's own depth's slots) or keep; the whole pass is
 * first_iter 0, coda_depth 0. A model without coda blocks or coda norm has an empty coda:
 * nothing is copied, and the state at depth i + 1 is x after iteration i. */
#ifndef TL_CUDA_PASS_H
#define TL_CUDA_PASS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"
#include "cuda/device.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tl_cu_state { TL_CU_ON_X = 0, TL_CU_ON_COPY = 1 } tl_cu_state;
typedef enum tl_cu_norm { TL_CU_STEP_NORM = 0, TL_CU_CODA_NORM = 1, TL_CU_PLAIN_NORM = 2 } tl_cu_norm;
/* A two-state core's moves of its states h (in x while it is the row's state) and l (in inj)
 * (docs/spec.md §1). */
typedef enum tl_cu_mix {
    TL_CU_LOW_ZERO = 0, /* inj = 0: l entering iteration 0            */
    TL_CU_HOLD = 1,     /* high = x, then x = inj: h aside, l to run on */
    TL_CU_ADD_HIGH = 2, /* x = x + high: y = l + h (or h + l)         */
    TL_CU_KEEP_LOW = 3  /* inj = x: the new l                          */
} tl_cu_mix;

/* Which part of the pass a walk runs (core/forward.h's tl_part). With build or keep, every row
 * has one depth (one sequence). */
typedef struct tl_cu_part {
    uint32_t first_iter; /* 0: the prelude and the injection first; else the walk starts at
                            core iteration first_iter (< every row's loops)                   */
    uint32_t coda_depth; /* whose coda slots the rows' own coda writes; 0 = each row's loops  */
    bool build;          /* a prefix build's: every depth first_iter+1 .. loops ends (its coda
                            on a copy), and row T-1's state at each                          */
    bool keep;           /* the state after the rows' last iteration, before their coda, kept */
} tl_cu_part;

/* The steps of a pass; each returns TL_OK or the failure that ends the pass. */
typedef struct tl_cu_pass_steps {
    void* ctx;
    /* Block `block` (file order) on rows [lo, hi) of state `on`, its K/V into cache slot `slot`. */
    tl_status (*block)(void* ctx, uint32_t slot, uint32_t block, size_t lo, size_t hi, tl_cu_state on);
    /* state = RN(state, gain of `which`; TL_CU_PLAIN_NORM: no gain), rows [lo, hi). */
    tl_status (*norm)(void* ctx, tl_cu_norm which, size_t lo, size_t hi, tl_cu_state on);
    /* inj = linear(adapter_inject; Q8(x)) (the injected term, docs/spec.md §4.4), then x = 0,
     * rows [0, hi). */
    tl_status (*inject)(void* ctx, size_t hi);
    /* x = linear(adapter_state; Q8(x)) + inj, rows [0, hi). */
    tl_status (*adapter)(void* ctx, size_t hi);
    /* copy = x, rows [0, hi). */
    tl_status (*copy)(void* ctx, size_t hi);
    /* loop_states[depth - 1] = state `on` of row `row`. */
    tl_status (*state)(void* ctx, uint32_t depth, size_t row, tl_cu_state on);
    /* kept = x, rows [0, hi): their state after their last iteration. */
    tl_status (*keep)(void* ctx, size_t hi);
    /* A two-state core's move `what` (tl_cu_mix), rows [0, hi). */
    tl_status (*mix)(void* ctx, tl_cu_mix what, size_t hi);
} tl_cu_pass_steps;

/* The coda of depth `depth` on rows [lo, hi) of state `on`. */
static inline tl_status tl_cu_pass_coda(const tl_config* c, const tl_cu_pass_steps* s, uint32_t depth, size_t lo,
                                        size_t hi, tl_cu_state on) {
    tl_status st = c->coda_norm ? s->norm(s->ctx, TL_CU_CODA_NORM, lo, hi, on) : TL_OK;
    const size_t end = tl_n_layers(c, depth);
    for (size_t slot = end - c->n_coda_blocks; st == TL_OK && slot < end; slot++)
        st = s->block(s->ctx, (uint32_t)slot, tl_slot_at(c, slot).block, lo, hi, on);
    return st;
}

/* A two-state core's iteration i on rows [0, active) (docs/spec.md §1). */
static inline tl_status tl_cu_pass_two_state(const tl_config* c, const tl_cu_pass_steps* s, uint32_t i,
                                             size_t active) {
    const uint32_t n = c->n_core_blocks / 2;
    tl_status st = s->mix(s->ctx, TL_CU_HOLD, active);
    for (uint32_t cycle = 0; st == TL_OK && cycle <= c->core_cycles; cycle++) {
        st = s->mix(s->ctx, TL_CU_ADD_HIGH, active);
        for (uint32_t a = cycle * n; st == TL_OK && a < (cycle + 1) * n; a++) {
            const size_t slot = tl_core_slot(c, i, a);
            st = s->block(s->ctx, (uint32_t)slot, tl_slot_at(c, slot).block, 0, active, TL_CU_ON_X);
        }
        if (st == TL_OK) st = s->norm(s->ctx, TL_CU_PLAIN_NORM, 0, active, TL_CU_ON_X);
        if (st == TL_OK && cycle + 1 == c->core_cycles) st = s->mix(s->ctx, TL_CU_KEEP_LOW, active);
    }
    return st;
}

/* The core's applications of iteration i on rows [0, active): the k blocks, or a two-state
 * core's. */
static inline tl_status tl_cu_pass_core(const tl_config* c, const tl_cu_pass_steps* s, uint32_t i, size_t active) {
    if (c->core_cycles) return tl_cu_pass_two_state(c, s, i, active);
    tl_status st = TL_OK;
    for (uint32_t j = 0; st == TL_OK && j < c->n_core_blocks; j++) {
        const size_t slot = tl_core_slot(c, i, j);
        st = s->block(s->ctx, (uint32_t)slot, tl_slot_at(c, slot).block, 0, active, TL_CU_ON_X);
    }
    return st;
}

/* Run the steps of part `part` of a pass of rows[0 .. T) (T >= 1, deepest first, each loops >= 1,
 * and > part->first_iter). */
static inline tl_status tl_cu_pass_walk(const tl_config* c, const tl_cuda_row* rows, size_t T, const tl_cu_part* part,
                                        const tl_cu_pass_steps* s) {
    tl_status st = TL_OK;
    if (part->first_iter == 0) {
        for (uint32_t b = 0; st == TL_OK && b < c->n_pre_blocks; b++) st = s->block(s->ctx, b, b, 0, T, TL_CU_ON_X);
        if (st == TL_OK && c->injection) st = s->inject(s->ctx, T);
        if (st == TL_OK && c->core_cycles) st = s->mix(s->ctx, TL_CU_LOW_ZERO, T);
    }
    const bool coda = tl_has_coda(c);
    size_t active = T;
    for (uint32_t i = part->first_iter; st == TL_OK && i < rows[0].loops; i++) {
        while (active > 0 && rows[active - 1].loops <= i) active--;
        if (c->step_norm && i >= 1) st = s->norm(s->ctx, TL_CU_STEP_NORM, 0, active, TL_CU_ON_X);
        if (st == TL_OK && c->injection) st = s->adapter(s->ctx, active);
        if (st == TL_OK) st = tl_cu_pass_core(c, s, i, active);
        size_t ended = active;
        while (ended > 0 && rows[ended - 1].loops == i + 1) ended--;
        if (st == TL_OK && part->keep && ended == 0) st = s->keep(s->ctx, active);
        const uint32_t own = part->coda_depth ? part->coda_depth : i + 1;
        if (st == TL_OK && coda && ended < active) st = tl_cu_pass_coda(c, s, own, ended, active, TL_CU_ON_X);
        const bool copied = coda && part->build && ended > 0;
        if (st == TL_OK && copied) st = s->copy(s->ctx, ended);
        if (st == TL_OK && copied) st = tl_cu_pass_coda(c, s, i + 1, 0, ended, TL_CU_ON_COPY);
        if (st == TL_OK && part->build && i < rows[T - 1].loops)
            st = s->state(s->ctx, i + 1, T - 1, copied && T - 1 < ended ? TL_CU_ON_COPY : TL_CU_ON_X);
    }
    return st;
}

#ifdef __cplusplus
}
#endif

#endif
