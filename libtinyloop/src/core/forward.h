/* forward.h — the forward pass of docs/spec.md §4 over a chunk of tokens. */
#ifndef TL_FORWARD_H
#define TL_FORWARD_H

#include "core/seq.h"

/* Run tokens[0..T) at positions s->n .. s->n+T-1 through all s->n_layers layers, writing
 * their KV into s->kv (already reserved for those positions). Outputs (each may be NULL
 * except last_hidden): logits_all [T][V]; logits_last [V] = the last token's logits;
 * last_hidden [d] = final hidden state of the last token; loop_states [loops][d] = the last
 * token's state after each loop iteration. On the CPU it fails only with TL_ERR_OUT_OF_MEMORY,
 * before touching the cache; on a CUDA engine also with TL_ERR_INTERNAL, possibly after
 * writing the reserved positions' KV (callers roll the reservation back either way). */
tl_status tl_forward(tl_seq* s, const int32_t* tokens, size_t T, float* logits_all, float* logits_last,
                     float* last_hidden, float* loop_states);

/* One new token for each of B sequences (each with KV reserved for position seqs[b]->n),
 * run together: every linear is one GEMM over the B rows, attention reads each row's own
 * cache. Rows may differ in depth and window. Writes logits[b] ([V] each, the callers'
 * buffers) and each sequence's last_hidden; the caller advances seqs[b]->n. Each row's result is
 * bit-identical to running its token alone. Fails only with TL_ERR_OUT_OF_MEMORY, before
 * touching any cache. */
tl_status tl_forward_batch(tl_seq* const* seqs, const int32_t* tokens, size_t B, float* const* logits);

/* logits[V] = head(NQ(x)) for one hidden state x[d] (docs/spec.md §4, "Head"). */
tl_status tl_head_logits(tl_engine* e, const float* x, float* logits);

#endif
