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

#include "core/generate.h"

/* One request's speculative scratch, sized for K = p->n_draft at init; reused by every round. */
typedef struct tl_spec {
    uint32_t n_draft;     /* K                                                            */
    uint32_t draft_loops; /* L_d                                                          */
    int32_t* rows;        /* [K] the round's rows r_0 = t, r_i = d_i                        */
    int32_t* drafts;      /* [K] drafts[i] = d_{i+1} (-1: its logits could not be sampled) */
    float* states;        /* [K][d] each row's state after iteration L_d - 1               */
    float* injects;       /* [K][d] each row's injected term (injection only, else NULL)   */
    float* logits;        /* [K][V] row i: its draft logits, then the verifier's z_{i+1}    */
    float* hidden;        /* [K][d] each row's final state at depth L                      */
    uint8_t* seen;        /* [V] the drafts' history: the stream's, then d_1 .. d_i          */
    tl_kv_mark* marks;    /* [K] marks[i]: the table at length p + i, before row i           */
    size_t drafted, accepted;
} tl_spec;

/* Scratch for checked params p (p->n_draft > 0, which tl_gen_check leaves only on a backend
 * with a part pass) on engine e. */
tl_status tl_spec_init(tl_spec* sp, const tl_engine* e, const tl_gen_params* p);
void tl_spec_free(tl_spec* sp);

/* One round (docs/spec.md §5.6) on stream s, whose last emitted token *token sits at position
 * s->seq->n: emits 1 .. K' tokens through tl_stream_sample, leaves in *token the last emitted
 * one (unless s->done), adds to sp->drafted / accepted and to s->p->draft_stats. round_cap
 * bounds K' (0 = none). All-or-nothing on failure before the first emission. */
tl_status tl_spec_round(tl_spec* sp, tl_stream* s, int32_t* token, size_t round_cap);

#endif
