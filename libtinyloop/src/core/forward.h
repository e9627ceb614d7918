/* forward.h — the forward pass of docs/spec.md §4, as the core calls it: each entry point goes
 * through the engine's backend (backend.h), so callers never know which device runs it. */
#ifndef TL_FORWARD_H
#define TL_FORWARD_H

#include "core/backend.h"
#include "core/exit_rule.h"
#include "core/seq.h"

/* Run tokens[0..T) at positions s->n .. s->n+T-1 through the model at depth s->loops
 * (docs/spec.md §1), writing their KV into s->kv (already reserved for those positions, all
 * s->n_layers slots). Outputs (each may be NULL except last_hidden): logits_all [T][V];
 * logits_last [V] = the last token's logits; last_hidden [d] = final hidden state of the last
 * token (the head's input). loop_states [loops][d] makes the pass a prefix build's (§5.4): every
 * depth 1 .. loops ends (coda_norm, coda) on a copy of the state after its iteration, writing
 * that depth's coda slots too, and loop_states[i] = the last token's final state at depth i+1
 * (so loop_states[loops-1] = last_hidden). On the CPU it fails only with TL_ERR_OUT_OF_MEMORY,
 * before touching the cache; on a device also with TL_ERR_INTERNAL, possibly after writing
 * the reserved positions' KV (callers roll the reservation back either way). */
static inline tl_status tl_forward(tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                                   float* logits_last, float* last_hidden, float* loop_states) {
    tl_backend* b = s->engine->backend;
    return b->iface->forward(b, s, tokens, T, logits_all, logits_last, last_hidden, loop_states);
}

/* What a part pass runs and produces (docs/spec.md §5.6, §5.4 warm start). Iteration i of a
 * row depends only on the row's state after iteration i-1, its second state (tl_has_inject:
 * Huginn's injected term, the same at every iteration, or a two-state core's low state l, x
 * being h) and the KV of earlier layers, so a pass split at any iteration is the whole pass, bit
 * for bit: a draft at depth L_d keeps its states and a verifier resumes from them at L_d; a
 * warm-start prefix resumes every token at its old depth. */
typedef struct tl_part {
    uint32_t first_iter;     /* 0: from the embedding (prelude included); else resume before core
                                iteration first_iter from state_in                              */
    uint32_t depth;          /* iterations first_iter .. depth-1 run; first_iter < depth <= s->loops */
    uint32_t coda_depth;     /* whose coda slots the coda uses; 0 = depth's own (a draft: s->loops) */
    const float* state_in;   /* [T][d] with first_iter > 0: each row's state after iteration first_iter-1 */
    const float* inject_in;  /* [T][d] with first_iter > 0 and tl_has_inject: each row's injected
                                term or low state after iteration first_iter-1                  */
    float* state_out;        /* NULL or [T][d]: each row's state after iteration depth-1 (before coda) */
    float* inject_out;       /* NULL or [T][d] (tl_has_inject only; else untouched): and its
                                injected term or low state then                                 */
    float* hidden_all;       /* NULL or [T][d]: each row's final state (the head's input)          */
    float* logits_all;       /* NULL or [T][V]                                                    */
    float* logits_last;      /* NULL or [V]                                                       */
    float* loop_states;      /* NULL or [depth][d]: prefix build/extension: every depth
                                first_iter+1 .. depth ends on a copy (its coda slots), and
                                loop_states[i] = last row's final state at depth i+1 (i >= first_iter) */
} tl_part;

/* Rows tokens[0..T) (ignored when first_iter > 0) at positions pos0 .. pos0+T-1 of s, whose KV
 * is reserved for those positions; fails like tl_forward. It writes the KV of the layers it
 * runs only (the prelude's with first_iter 0, iterations first_iter .. depth-1, the coda's in
 * coda_depth's slots); s->n and s->last_hidden are the caller's. Only on a backend with a part
 * pass (tl_has_part_pass). */
static inline tl_status tl_forward_part(tl_seq* s, const int32_t* tokens, size_t T, size_t pos0, const tl_part* part) {
    tl_backend* b = s->engine->backend;
    return b->iface->forward_part(b, s, tokens, T, pos0, part);
}

/* One row of a wave pass (docs/spec.md §5.6.1): position pos of the sequence runs ONE core
 * iteration, `iter`, beside rows of other positions at other iterations; every row reads the
 * same core weights, so the pass reads them once for all. A row at iteration 0 runs from its
 * token (embedding, prelude, the injection's start); a deeper one resumes from state (and
 * inject). With logits, the row then also ends at depth s->loops on a copy of its state
 * (coda_norm, the coda in depth s->loops's slots, the head): its final logits when iter + 1 ==
 * s->loops (hidden, if not NULL, receives its final state), else a draft's. */
typedef struct tl_wave_row {
    int32_t token;  /* iter 0: the row's token                                            */
    uint32_t iter;  /* the core iteration this pass runs, 0 .. s->loops - 1                */
    size_t pos;     /* its position; its KV is reserved                                    */
    float* state;   /* [d] in (iter > 0): the state after iteration iter - 1; out: after iter */
    float* inject;  /* [d] tl_has_inject only: the injected term, in (iter > 0), out (iter 0);
                       a two-state core's low state, in (iter > 0), out (always)            */
    float* logits;  /* NULL or [V]: the row's logits at depth s->loops after this iteration  */
    float* hidden;  /* NULL or [d] (final rows): the final state the head read              */
} tl_wave_row;

/* Rows[0..R) of sequence s, ordered by iteration, deepest first, no two at one (position,
 * iteration), each row's earlier positions done with its iteration (so a row is computed as
 * it would be alone, bit for bit). Writes the KV of the slots its rows run. Only on a backend
 * with a wave pass (tl_has_wave_pass); fails like tl_forward. */
static inline tl_status tl_forward_wave(tl_seq* s, const tl_wave_row* rows, size_t R) {
    tl_backend* b = s->engine->backend;
    return b->iface->forward_wave(b, s, rows, R);
}

/* Whether the engine's backend has a wave pass. */
static inline bool tl_has_wave_pass(const tl_engine* e) { return e->backend->iface->forward_wave != NULL; }

/* Whether the engine's backend has a part pass. */
static inline bool tl_has_part_pass(const tl_engine* e) { return e->backend->iface->forward_part != NULL; }

/* One new token for each of B sequences of one engine (each with KV reserved for position
 * seqs[b]->n), run together: every linear is one GEMM over the B rows, attention reads each
 * row's own cache. Rows may differ in depth and window; a row runs coda_norm and the coda (in
 * its own depth's slots) after its last iteration, while deeper rows go on. exits: NULL, or
 * [B] each row's exit rule (docs/spec.md §5.7; only on a backend with tl_has_adaptive_pass,
 * else every rule must be inactive): a row whose rule fires after iteration U - 1 < L - 1
 * copies that iteration's KV into the core slots of iterations U .. L-1 at its position, then
 * runs coda_norm and the coda in depth L's slots and leaves (under kl and argmax the probe
 * after iteration U - 1 ran them, and its logits are the row's). Writes logits[b] ([V] each, the
 * callers' buffers), each sequence's last_hidden and, when depths is not NULL, depths[b] = the
 * core iterations row b ran (U, or its depth); the caller advances seqs[b]->n. Each row's result
 * is bit-identical to running its token alone. Fails like tl_forward, before touching any cache
 * on the CPU. */
static inline tl_status tl_forward_batch(tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                         float* const* logits, const tl_exit* exits, uint32_t* depths) {
    tl_backend* b = seqs[0]->engine->backend;
    return b->iface->forward_batch(b, seqs, tokens, B, logits, exits, depths);
}

/* The next counts[b] tokens of each of S sequences of one engine in one pass (a scheduler step's
 * decode rows and prefill chunks together, so the step reads each weight once): sequence
 * seqs[b] (KV reserved for positions n .. n + counts[b] - 1) runs its tokens, which follow
 * the spans before it in `tokens`. As tl_forward_batch, which is the case of every count 1,
 * but: logits[b] may be NULL (no head), else it receives the logits of the span's last row;
 * last_hidden and depths[b] are the last row's; a span of more than one row must have an
 * inactive exit rule (it runs to its sequence's depth, as tl_forward does). Each span's
 * result is bit-identical to running it alone. Only on a backend with tl_has_mixed_pass. */
static inline tl_status tl_forward_spans(tl_seq* const* seqs, const int32_t* tokens, const size_t* counts, size_t S,
                                         float* const* logits, const tl_exit* exits, uint32_t* depths) {
    tl_backend* b = seqs[0]->engine->backend;
    return b->iface->forward_spans(b, seqs, tokens, counts, S, logits, exits, depths);
}

/* Whether the engine's backend runs spans of several tokens in its batch pass. */
static inline bool tl_has_mixed_pass(const tl_engine* e) { return e->backend->iface->forward_spans != NULL; }

/* Whether the engine's backend runs exit rules in its batch pass. */
static inline bool tl_has_adaptive_pass(const tl_engine* e) { return e->backend->iface->adaptive; }

/* logits[V] = head(NQ(x)) for one hidden state x[d] (docs/spec.md §4, "Head"). */
static inline tl_status tl_head_logits(const tl_engine* e, const float* x, float* logits) {
    return e->backend->iface->head_logits(e->backend, e, x, logits);
}

/* order[0 .. B) = the rows deepest first, the order every backend runs a batch in (iteration i
 * then runs on a prefix of the rows, and the rows of depth i + 1 are the last of those); a
 * stable insertion sort keeps the callers' order among equals. */
static inline void tl_sort_deepest_first(tl_seq* const* seqs, size_t B, size_t* order) {
    for (size_t b = 0; b < B; b++) {
        size_t r = b;
        for (; r > 0 && seqs[order[r - 1]]->n_layers < seqs[b]->n_layers; r--) order[r] = order[r - 1];
        order[r] = b;
    }
}

#endif
