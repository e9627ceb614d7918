/* seq.h — the internals of tl_seq and tl_prefix shared by seq.c, prefix.c, forward.c and
 * generate.c. */
#ifndef TL_SEQ_H
#define TL_SEQ_H

#include "engine.h"
#include "kvcache.h"

struct tl_seq {
    tl_engine* engine;      /* holds a reference                                          */
    uint32_t loops;         /* L                                                          */
    uint32_t n_layers;      /* n_pre_blocks + L                                           */
    uint32_t window;        /* cache_window W, 0 = full                                   */
    size_t n;               /* tokens so far                                              */
    tl_kv_table kv;
    float* last_hidden;     /* [d] final hidden state of token n-1 (valid when n > 0)     */
};

struct tl_prefix {
    tl_engine* engine;      /* holds a reference                                          */
    int32_t* tokens;        /* [n] copy                                                   */
    size_t n;
    uint32_t loops;         /* L_b                                                        */
    uint32_t window;
    tl_kv_table kv;         /* immutable once built                                       */
    float* loop_states;     /* [L_b][d]: last token's hidden state after loop iteration i  */
};

/* A new empty sequence (engine reference taken). */
tl_status tl_seq_new(tl_engine* e, uint32_t loops, uint32_t window, tl_seq** out);
/* Prefill with optional per-position logits ([n][V]) or last logits ([V]) and optional
 * loop states of the last token ([loops][d]). All-or-nothing: on error the sequence is
 * unchanged. release_window: drop the blocks the window no longer sees afterwards (false
 * lets the caller offer them to the prefix cache first, then call tl_kv_release_outside). */
tl_status tl_seq_run(tl_seq* s, const int32_t* tokens, size_t n, size_t chunk, float* logits_all,
                     float* logits_last, float* loop_states, bool release_window);

#endif
