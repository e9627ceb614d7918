/* attn_mask.h — which keys a query sees (docs/spec.md §4.1), for every attention kernel: the CPU
 * driver and its tile path (cpu/attention*.c) and the CUDA kernels (cuda/attention.cu). A query
 * at position t of a sequence with window W (0 = full) and instruction length P (0 = causal)
 * sees the one run of positions tl_attn_first_key(t, W) .. tl_attn_last_key(t, P). */
#ifndef TL_ATTN_MASK_H
#define TL_ATTN_MASK_H

#include <stddef.h>
#include <stdint.h>

#include "core/numerics.h"

/* The first key visible from position t: t + 1 - window with a window, else 0. */
static inline TL_HD size_t tl_attn_first_key(size_t t, uint32_t window) {
    return (window && t + 1 > window) ? t + 1 - window : 0;
}

/* W', the window of loop attention's local attention (docs/spec.md §4): the loop window W_l
 * under the sequence's window W, W_l when W = 0 (full), else min(W, W_l). */
static inline TL_HD uint32_t tl_loop_local_window(uint32_t window, uint32_t loop_window) {
    return window && window < loop_window ? window : loop_window;
}

/* The last key visible from position t, e(t): P - 1 inside the instruction block (t < P, the
 * block's positions see each other), else t itself. */
static inline TL_HD size_t tl_attn_last_key(size_t t, size_t instruction) {
    return t < instruction ? instruction - 1 : t;
}

#endif
