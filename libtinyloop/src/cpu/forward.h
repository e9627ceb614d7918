/* forward.h (cpu) — the CPU pass: core/forward.h's three entry points computed on the host
 * with the linears repacked for the engine's kernel path (matmul.h) and the engine's pool.
 * `linears` is indexed like tl_file.linears (tl_block_linear_index, the adapter's two at
 * tl_adapter_linear_index, then the head). The CPU backend (backend_cpu.c) calls these; the
 * CUDA backend borrows tl_cpu_head_logits for the one head it keeps on the host. */
#ifndef TL_CPU_FORWARD_H
#define TL_CPU_FORWARD_H

#include "core/forward.h"
#include "cpu/matmul.h"

/* tl_forward on the CPU: fails only with TL_ERR_OUT_OF_MEMORY, before touching the cache. */
tl_status tl_cpu_forward(const tl_linear* linears, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                         float* logits_last, float* last_hidden, float* loop_states);
/* tl_forward_batch on the CPU. */
tl_status tl_cpu_forward_batch(const tl_linear* linears, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                               float* const* logits);
/* tl_head_logits with the prepared head linear `head`. */
tl_status tl_cpu_head_logits(const tl_linear* head, const tl_engine* e, const float* x, float* logits);

#endif
