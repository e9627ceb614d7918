/* backend_cuda.h — the CUDA backend (core/backend.h) of engines opened with TL_DEVICE_CUDA:
 * the forward pass described as rows and KV spans for tl_cuda_forward (device.h), KV block data
 * in device memory. In a build without CUDA, tl_backend_cuda_new fails as tl_cuda_probe does. */
#ifndef TL_BACKEND_CUDA_H
#define TL_BACKEND_CUDA_H

#include "core/backend.h"
#include "core/seq.h"
#include "cuda/device.h"

/* The CUDA backend of engine e (its file open, e->isa and e->pool set) on CUDA device `device`:
 * uploads every weight, and repacks only the head for the host (tl_head_logits of a saved hidden
 * state, as tl_seq_last_logits asks, runs there); then releases the file's copies of the
 * linears (the head's stays if its host kernel reads it). On failure nothing stays allocated. */
tl_status tl_backend_cuda_new(tl_engine* e, int device, tl_backend** out);

/* The live KV spans of the distinct sequences among seqs[0 .. T) (consecutive rows of one
 * sequence count once): the size tl_cuda_describe needs for `spans`. */
size_t tl_cuda_count_spans(tl_seq* const* seqs, size_t T);
/* Describe rows t < T (token tokens[t] of seqs[t] at position pos[t], KV reserved) for
 * tl_cuda_forward: rows[T], and each distinct sequence's live spans (released ones left out)
 * in spans[], shared by its consecutive rows; *max_keys = 1 + the largest position. Returns
 * the number of spans written. Pure host bookkeeping (tested on the CPU). */
size_t tl_cuda_describe(tl_seq* const* seqs, const size_t* pos, const int32_t* tokens, size_t T,
                        tl_cuda_row* rows, tl_cuda_span* spans, uint32_t* max_keys);
/* Describe positions pos0 .. pos0+T-1 of s (T >= 1) as the rows of tl_cuda_kv_from_rows: each
 * row's position, depth, window and where its K/V goes (token 0, no spans). False, with
 * nothing written, unless every one of those positions is in a live block of s. Pure host
 * bookkeeping (tested on the CPU). */
bool tl_cuda_describe_writes(const tl_seq* s, size_t pos0, size_t T, tl_cuda_row* rows);

#endif
