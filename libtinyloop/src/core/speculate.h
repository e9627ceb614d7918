/* speculate.h — self-speculative decoding (docs/spec.md §5.6): a request at depth L drafts K
 * tokens with its own weights at depth L_d < L, one row at a time, then verifies them in ONE
 * pass that resumes every drafted row at iteration L_d from its kept state, and emits the
 * verifier's tokens, sampled as plain decoding samples them, while they agree with the drafts.
 * By depth nesting the draft's prelude and core KV is the verifier's, and every row of the
 * verify pass is computed as it would be alone, so the emitted tokens and their logits are
 * exactly plain decoding's. Rejected rows' KV is rolled back (paged: spans dropped, no copy).
 *
 * Used by tl_generate (api/generate.c), tl_generate_batch (api/batch.c) and the scheduler
 * (api/sched.c), each running one round per step of a speculative request. */
#ifndef TL_SPECULATE_H
#define TL_SPECULATE_H

#include "core/forward.h"
#include "core/generate.h"

/* One request's speculative scratch, sized for K = p->n_draft at init; reused by every round. */
/* One position in flight of the wave (speculate_wave.c), beside its tl_wave_row. */
typedef struct tl_wave_slot {
    tl_kv_mark mark; /* the table before the position was reserved                        */
    int32_t seen_as; /* its token as the schedule's decisions see it (tl_spec_seen_as)    */
    float* logits;   /* [V] its logits whenever a pass ends it at depth L                 */
} tl_wave_slot;

/* One request's speculative scratch, sized for K = p->n_draft at init; reused by every round. */
typedef struct tl_spec {
    uint32_t n_draft;     /* K                                                            */
    uint32_t draft_loops; /* L_d                                                          */
    int32_t* rows;        /* [K] the round's rows r_0 = t, r_i = d_i                        */
    int32_t* drafts;      /* [K] drafts[i] = d_{i+1} (-1: its logits could not be sampled) */
    float* states;        /* [K][d] each row's state after iteration L_d - 1               */
    float* injects;       /* [K][d] each row's injected term or low state (tl_has_inject, else NULL) */
    float* logits;        /* [K][V] row i: its draft logits, then the verifier's z_{i+1}    */
    float* hidden;        /* [K][d] each row's final state at depth L                      */
    uint8_t* seen;        /* [V] the drafts' history: the stream's, then d_1 .. d_i          */
    tl_kv_mark* marks;    /* [K] marks[i]: the table at length p + i, before row i           */
    size_t drafted, accepted;
    /* the wave schedule (docs/spec.md §5.6.1), with p->draft_wave on a backend with a wave pass */
    bool wave;
    tl_wave_row* flight;  /* [K + 1] the positions in flight, oldest (deepest) first        */
    tl_wave_slot* slots;  /* [K + 1] beside them; a slot's buffers (its row's state and
                             inject, its logits) travel with it                           */
    float* wave_bufs;     /* [K + 1][2d + V] those buffers                                */
    bool auto_depth;      /* draft_loops 0: L_d chosen from the measured acceptance        */
    size_t* verified;     /* [L] auto_depth: drafts at depth L_d verified so far, by L_d   */
    size_t* agreed;       /* [L] and of those, the ones the verifier agreed with           */
    double reads_core;    /* auto_depth: the weights a core iteration reads (parameters)    */
    double reads_entry;   /* those a position reads once, entering (prelude, injection)     */
    double reads_end;     /* those an ending reads (coda, head)                             */
    /* TINYLOOP_BENCH_PREDICTIONS (benchmarks only): [n_predicted][L] the ids a recorded
       model predicted for each emitted token at each depth, cycled; NULL = none         */
    int32_t* predicted;
    size_t n_predicted;
    uint32_t predicted_loops; /* L */
} tl_spec;

/* Scratch for checked params p (p->n_draft > 0, which tl_gen_check leaves only on a backend
 * with a part pass) on engine e; with `wave` (a caller that decodes in the wave schedule) and
 * a backend with a wave pass, the wave's too, and sp->wave set. draft_loops 0 (the wave's
 * automatic draft depth) becomes tl_spec_rounds_depth(L) where rounds run instead. Reads
 * TINYLOOP_BENCH_PREDICTIONS (TL_ERR_INVALID_ARGUMENT unless it is empty or groups of L ids). */
tl_status tl_spec_init(tl_spec* sp, const tl_engine* e, const tl_gen_params* p, bool wave);
void tl_spec_free(tl_spec* sp);

/* The draft depth rounds take for a request that asked the wave to choose one (draft_loops 0)
 * but runs rounds: a quarter of its depth L, at least 1. */
static inline uint32_t tl_spec_rounds_depth(uint32_t L) { return L / 4 ? L / 4 : 1; }

/* The id the schedule's decisions (a draft agreeing with the verifier, a deeper draft with an
 * earlier one) see for `token`, sampled from depth `depth`'s logits as emitted token `index`:
 * the token itself, or under TINYLOOP_BENCH_PREDICTIONS the recorded model's id for that
 * token and depth (then the timings are those of the recorded acceptance on any weights, and
 * the output is not plain decoding's). */
int32_t tl_spec_seen_as(const tl_spec* sp, size_t index, uint32_t depth, int32_t token);

/* Decode stream s in the wave schedule (docs/spec.md §5.6.1) from its last emitted token *token
 * at position s->seq->n until a stop rule fires: one wave pass per step, each emitting 0 or 1
 * token through tl_stream_sample, the tokens and logits exactly plain decoding's, drafts
 * redrafted from deeper loops where those disagree. On failure
 * the positions not yet emitted are rolled back; the emitted ones stay. */
tl_status tl_spec_wave(tl_spec* sp, tl_stream* s, int32_t* token);

/* One round (docs/spec.md §5.6) on stream s, whose last emitted token *token sits at position
 * s->seq->n: emits 1 .. K' tokens through tl_stream_sample, leaves in *token the last emitted
 * one (unless s->done), adds to sp->drafted / accepted and to s->p->draft_stats. round_cap
 * bounds K' (0 = none). All-or-nothing on failure before the first emission. */
tl_status tl_spec_round(tl_spec* sp, tl_stream* s, int32_t* token, size_t round_cap);

#endif
