/* backend.h — the seam between the core and the device that runs the forward pass (the shape of
 * ggml's backend interface, cut down to what TinyLoop needs).
 *
 * A backend is a table of a few functions plus the allocator of its KV block data. The core
 * (sequences, prefixes, the prefix cache, generation) calls only through them and never names a
 * device; each backend lives in its own folder (cpu/backend_cpu.c, cuda/backend_cuda.c) and is
 * chosen once, when api/model.c opens the model. Every backend computes docs/spec.md §4 exactly,
 * so the choice never changes a bit of the logits.
 *
 * Spec v2 (docs/spec.md §1, §5.4): the signatures are version 1's; what changed is what a pass
 * computes. A sequence at depth L has s->n_layers = tl_n_layers(cfg, L) cache slots (see
 * tl_slot_at) and runs prelude, L core iterations, then coda_norm and the coda in depth L's
 * slots. A non-NULL loop_states marks a prefix build: the core passes it on EVERY chunk (not
 * only the last), and each chunk's pass ends every depth 1 .. L on a copy of the state (writing
 * that depth's coda slots) and stores the last row's final state at depth i+1 (the head's input)
 * in loop_states[i]. A batch's rows are ordered deepest first (tl_sort_deepest_first); the rows
 * whose depth is i+1 run coda_norm and the coda right after iteration i.
 *
 * Not here: sampling, KV bookkeeping (span tables, reference counts), anything per request. */
#ifndef TL_BACKEND_H
#define TL_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/kvcache.h"
#include "tinyloop.h"

typedef struct tl_backend tl_backend;
typedef struct tl_engine tl_engine;
typedef struct tl_seq tl_seq;
typedef struct tl_wave_row tl_wave_row; /* core/forward.h */
typedef struct tl_part tl_part; /* core/forward.h */
typedef struct tl_exit tl_exit; /* core/exit_rule.h */

/* What tl_model_runtime reports about a backend. */
typedef struct tl_backend_info {
    tl_device device;           /* TL_DEVICE_CPU or TL_DEVICE_CUDA                        */
    size_t host_weight_bytes;   /* repacked weights it holds in host memory              */
    size_t device_weight_bytes; /* weights in device memory (0 on the CPU)               */
    char name[64];              /* "cpu (avx2)", "NVIDIA H200 (sm_90)"                    */
} tl_backend_info;

typedef struct tl_backend_iface {
    /* The forward pass of T tokens of one sequence: core/forward.h's tl_forward (loop_states: a
     * prefix build's chunk, see above). */
    tl_status (*forward)(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                         float* logits_last, float* last_hidden, float* loop_states);
    /* One new token for each of B sequences: core/forward.h's tl_forward_batch. */
    tl_status (*forward_batch)(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                               float* const* logits, const tl_exit* exits, uint32_t* depths);
    /* logits[V] of one final hidden state x[d]: core/forward.h's tl_head_logits. */
    tl_status (*head_logits)(tl_backend* b, const tl_engine* e, const float* x, float* logits);
    void (*info)(const tl_backend* b, tl_backend_info* out);
    /* Frees the backend; every KV block it allocated is gone by then. */
    void (*free)(tl_backend* b);
    /* A part of the pass of T tokens of one sequence (core/forward.h's tl_forward_part): some
     * core iterations, resumable from kept states. Optional: NULL when the backend has none
     * (then speculative requests decode plainly and tl_prefix_extend rebuilds the prefix). */
    tl_status (*forward_part)(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0,
                              const tl_part* part);
    /* The KV of cache slot `slot` at positions pos0 .. pos0+T-1 of s (reserved) from those
     * positions' layer input rows (q [T][d] i8, a [T] f32: NQ's output, or h4's, docs/spec.md
     * §5.4.1): linear(attn_qkv of the slot's block; q, a), RoPE, QK, written as the pass writes
     * them. Fails like tl_forward. */
    tl_status (*kv_from_rows)(tl_backend* b, tl_seq* s, uint32_t slot, size_t pos0, size_t T, const int8_t* q,
                              const float* a);
    /* Spans of S sequences in one pass, each counts[b] tokens: core/forward.h's tl_forward_spans.
     * Optional: NULL when the backend has none (then a scheduler step runs its decodes and its
     * prefill chunks as separate passes). */
    tl_status (*forward_spans)(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, const size_t* counts,
                               size_t S, float* const* logits, const tl_exit* exits, uint32_t* depths);
    /* Rows of one sequence at different core iterations in one pass: core/forward.h's
     * tl_forward_wave. Optional: NULL when the backend has none (then a wave request decodes in
     * rounds, docs/spec.md §5.6). */
    tl_status (*forward_wave)(tl_backend* b, tl_seq* s, const tl_wave_row* rows, size_t R);
    /* Whether forward_batch runs exit rules (adaptive depth, docs/spec.md §5.7); without it, a
     * request with an exit rule is refused and every row the core hands it runs to its depth. */
    bool adaptive;
} tl_backend_iface;

/* Embedded as the first member of each backend's own state. */
struct tl_backend {
    const tl_backend_iface* iface;
    const tl_kv_allocator* kv; /* allocator of KV block data; NULL = host memory */
};

static inline void tl_backend_free(tl_backend* b) {
    if (b) b->iface->free(b);
}

#endif
