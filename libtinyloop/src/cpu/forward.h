/* forward.h (cpu) — the CPU pass: core/forward.h's entry points computed on the host
 * with the linears repacked for the engine's kernel path (matmul.h) and the engine's pool.
 * `linears` is indexed like tl_file.linears (tl_block_linear_index, the adapter's two at
 * tl_adapter_linear_index, then the head). The CPU backend (backend_cpu.c) calls these; the
 * CUDA backend borrows tl_cpu_head_logits for the one head it keeps on the host. */
#ifndef TL_CPU_FORWARD_H
#define TL_CPU_FORWARD_H

#include "core/forward.h"
#include "cpu/matmul.h"

/* tl_forward_part on the CPU, and with last_hidden (NULL or [d]) the last row's final state
 * too: tl_forward is the whole part (first_iter 0, depth s->loops) at pos0 = s->n. Fails only
 * with TL_ERR_OUT_OF_MEMORY, before touching the cache. */
tl_status tl_cpu_forward(const tl_linear* linears, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0,
                         const tl_part* part, float* last_hidden);
/* The backend's kv_from_rows (core/backend.h) on the CPU: the KV of cache slot `slot` at
 * positions pos0 .. pos0+T-1 of s from the rows (q [T][d], a [T]) its attn_qkv reads. Fails
 * only with TL_ERR_OUT_OF_MEMORY, before touching the cache. */
tl_status tl_cpu_kv_from_rows(const tl_linear* linears, tl_seq* s, uint32_t slot, size_t pos0, size_t T,
                              const int8_t* q, const float* a);
/* tl_forward_spans on the CPU; with counts NULL (one token per sequence), tl_forward_batch. */
tl_status tl_cpu_forward_spans(const tl_linear* linears, tl_seq* const* seqs, const int32_t* tokens,
                               const size_t* counts, size_t S, float* const* logits, const tl_exit* exits,
                               uint32_t* depths);
/* tl_forward_wave on the CPU. Fails only with TL_ERR_OUT_OF_MEMORY, before touching the cache. */
tl_status tl_cpu_forward_wave(const tl_linear* linears, tl_seq* s, const tl_wave_row* rows, size_t R);
/* tl_head_logits with the prepared head linear `head`. */
tl_status tl_cpu_head_logits(const tl_linear* head, const tl_engine* e, const float* x, float* logits);

#endif
