/* forward_cuda.h — forward.c's entry into the CUDA backend (engines opened with
 * TL_DEVICE_CUDA): the same two forms as forward.h, with the same outputs and bits. */
#ifndef TL_FORWARD_CUDA_H
#define TL_FORWARD_CUDA_H

#include "cuda/cuda_backend.h"
#include "core/seq.h"

/* The live KV spans of the distinct sequences among seqs[0 .. T) (consecutive rows of one
 * sequence count once): the size tl_cuda_describe needs for `spans`. */
size_t tl_cuda_count_spans(tl_seq* const* seqs, size_t T);
/* Describe rows t < T (token tokens[t] of seqs[t] at position pos[t], KV reserved) for
 * tl_cuda_forward: rows[T], and each distinct sequence's live spans (released ones left out)
 * in spans[], shared by its consecutive rows; *max_keys = 1 + the largest position. Returns
 * the number of spans written. Pure host bookkeeping (tested on the CPU). */
size_t tl_cuda_describe(tl_seq* const* seqs, const size_t* pos, const int32_t* tokens, size_t T,
                        tl_cuda_row* rows, tl_cuda_span* spans, uint32_t* max_keys);

/* tl_forward on the device: a chunk of T tokens of one sequence. */
tl_status tl_forward_cuda_chunk(tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                                float* logits_last, float* last_hidden, float* loop_states);

/* tl_forward_batch on the device; order[0 .. B) lists the rows deepest first. */
tl_status tl_forward_batch_cuda(tl_seq* const* seqs, const int32_t* tokens, const size_t* order, size_t B,
                                float* const* logits);

#endif
