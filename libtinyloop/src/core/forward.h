/* forward.h — the forward pass of docs/spec.md §4, as the core calls it: each entry point goes
 * through the engine's backend (backend.h), so callers never know which device runs it. */
#ifndef TL_FORWARD_H
#define TL_FORWARD_H

#include "core/backend.h"
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

/* One new token for each of B sequences of one engine (each with KV reserved for position
 * seqs[b]->n), run together: every linear is one GEMM over the B rows, attention reads each
 * row's own cache. Rows may differ in depth and window; a row runs coda_norm and the coda (in
 * its own depth's slots) after its last iteration, while deeper rows go on. Writes logits[b] ([V] each, the
 * callers' buffers) and each sequence's last_hidden; the caller advances seqs[b]->n. Each
 * row's result is bit-identical to running its token alone. Fails like tl_forward, before
 * touching any cache on the CPU. */
static inline tl_status tl_forward_batch(tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                         float* const* logits) {
    tl_backend* b = seqs[0]->engine->backend;
    return b->iface->forward_batch(b, seqs, tokens, B, logits);
}

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
