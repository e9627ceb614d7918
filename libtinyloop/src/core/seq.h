/* seq.h — the internals of tl_seq and tl_prefix shared by the entry points (api/) and the
 * backends' forward passes. */
#ifndef TL_SEQ_H
#define TL_SEQ_H

#include <pthread.h>
#include <stdbool.h>

#include "core/engine.h"
#include "core/hidden.h"
#include "core/kvcache.h"

/* Working memory of the forward pass, reused from call to call and grown (never shrunk) to the
 * largest pass so far; its layout is the backend's (cpu/forward.c). */
typedef struct tl_scratch {
    void* base;
    size_t bytes;
} tl_scratch;

/* Make s hold at least `bytes` (contents not kept); when that fails, TL_ERR_OUT_OF_MEMORY
 * naming `what`, and s unchanged. */
tl_status tl_scratch_fit(tl_scratch* s, size_t bytes, const char* what);

struct tl_seq {
    tl_engine* engine;      /* holds a reference                                          */
    uint32_t loops;         /* L                                                          */
    uint32_t n_layers;      /* cache slots: tl_n_layers(cfg, L) <= TL_MAX_CACHE_LAYERS     */
    uint32_t window;        /* cache_window W, 0 = full                                   */
    size_t instruction;     /* instruction length P (docs/spec.md §4.1), 0 = causal; fixed
                               before the first position runs, whose prefill holds >= P    */
    size_t n;               /* tokens so far                                              */
    tl_kv_table kv;
    float* last_hidden;     /* [d] final hidden state of token n-1 (valid when n > 0)     */
    float* next_hidden;     /* [d] where a run puts the new one; swapped in on success    */
    tl_scratch scratch;     /* the forward pass's working memory; one user at a time, like
                               the sequence (a batched pass uses its first sequence's)     */
    tl_hidden_rows* capture; /* a hidden-state prefix build (docs/spec.md §5.4.1): a chunk pass
                               hands each layer's input rows to tl_hidden_capture; else NULL */
};

/* A prefix is read by many threads at once (tl_seq_from_prefix, tl_prefix_info, under `lock`
 * for reading) while tl_prefix_extend may deepen it: the extension computes outside `lock`,
 * holding `extending` (one extension at a time; nothing else writes loops, kv, loop_states or
 * states), then swaps kv, loop_states and states in and raises loops under `lock` for
 * writing. A swapped-out block lives on in the sequences that share it. tl_gen_check reads
 * loops without the lock (an atomic: it only ever rises, and a prefix serves every depth up to
 * it). */
struct tl_prefix {
    tl_engine* engine;      /* holds a reference                                          */
    int32_t* tokens;        /* [n] copy                                                   */
    size_t n;
    _Atomic uint32_t loops; /* L_b, raised by tl_prefix_extend                            */
    uint32_t window;
    size_t instruction;     /* instruction length P, 0 .. n (docs/spec.md §5.4)           */
    bool warm_start;        /* built with TL_PREFIX_WARM_START                            */
    tl_kv_table kv;         /* blocks immutable once written; every depth's coda slots    */
    float* loop_states;     /* [L_b][d]: last token's final state at depth i + 1           */
    float* states;          /* warm start: [n][d] each token's state after iteration L_b-1
                               (before the coda); NULL without warm start or where
                               tl_prefix_can_resume is false (extended by rebuilding)      */
    float* injects;         /* with states and tl_has_inject: [n][d] each token's injected
                               term (a two-state core: its low state l)                    */
    tl_hidden_rows* hidden; /* a hidden-state prefix (docs/spec.md §5.4.1): its layer input
                               rows, kv then empty; NULL for a kv prefix                   */
    pthread_rwlock_t lock;
    pthread_mutex_t extending;
};

/* Whether a warm-start prefix can keep what an extension resumes from (states, injects): the
 * backend has a part pass, and its KV blocks are in host memory or its device copies block data
 * (the extension copies their old layers). */
bool tl_prefix_can_resume(const tl_engine* e);
/* An empty prefix of n tokens at depth `loops` (a reference to e taken), with its locks and
 * buffers: tokens, loop_states (zeroed) and, when `states`, states and (tl_has_inject)
 * injects; its kv table empty. NULL when out of memory. */
tl_prefix* tl_prefix_new(tl_engine* e, size_t n, uint32_t loops, uint32_t window, bool warm_start, bool states);

/* TL_OK when the engine can keep and use prefixes of that storage (kv always), else
 * TL_ERR_INVALID_ARGUMENT naming the reason: the backend has no kv_from_rows, h4 with an odd
 * d_model, or rows that would take as many bytes as the KV or more (docs/spec.md §5.4.1). */
tl_status tl_prefix_check_storage(const tl_engine* e, tl_prefix_storage storage);

/* TL_OK when the prefix serves depth `loops` (<= its own), else TL_ERR_LOOPS_MISMATCH with a
 * message saying how to get a deeper one (tl_prefix_extend, or a warm-start build). */
tl_status tl_prefix_check_loops(const tl_prefix* p, uint32_t loops);

/* TL_OK, or TL_ERR_INVALID_ARGUMENT when depth `loops` needs more than TL_MAX_CACHE_LAYERS
 * cache slots (docs/spec.md §1). */
tl_status tl_seq_check_depth(const tl_engine* e, uint32_t loops);
/* A new empty sequence at depth `loops` (engine reference taken); refuses a depth
 * tl_seq_check_depth refuses. */
tl_status tl_seq_new(tl_engine* e, uint32_t loops, uint32_t window, tl_seq** out);
/* The positions of the prefill chunk starting at position pos of a sequence with instruction
 * length P, asked for `chunk` (>= 1) of the `left` (>= 1) positions still to run: the chunk
 * holding position 0 holds the instruction block 0 .. P-1 whole, growing past `chunk` when it
 * must (docs/spec.md §4.2: every key an instruction query sees is written in its own chunk);
 * never more than `left`. */
static inline size_t tl_chunk_rows(size_t P, size_t pos, size_t chunk, size_t left) {
    const size_t want = pos == 0 && chunk < P ? P : chunk;
    return want < left ? want : left;
}

/* TL_OK, or TL_ERR_INVALID_ARGUMENT when the first prefill of the sequence (s->n == 0) appends
 * fewer than its instruction length: n tokens. */
tl_status tl_seq_check_instruction(const tl_seq* s, size_t n);

/* A prefill's progress report: fn(user_data, done, total) after each chunk, `done` counting
 * from its value at the start; a nonzero return sets `stopped`. */
typedef struct tl_progress {
    tl_progress_fn fn;
    void* user_data;
    size_t done, total;
    bool stopped;
} tl_progress;

/* What a prefill produces besides the KV; every field may be NULL / false. */
typedef struct tl_run_opts {
    float* logits_all;     /* [n][V]: logits of every position                              */
    float* logits_last;    /* [V]: logits of the last token                                 */
    float* loop_states;    /* [loops][d]: a prefix build (tl_forward): every depth's coda slots
                              written, and the last token's final state at each depth       */
    bool keep_window;      /* keep the blocks the window no longer sees (the caller offers
                              them to the prefix cache, then calls tl_kv_release_outside)    */
    tl_progress* progress; /* reported after each chunk; may stop the prefill               */
} tl_run_opts;

/* Prefill tokens[0..n) in chunks of `chunk` (0 = all at once; the first chunk of an empty
 * sequence grows to its instruction length, tl_chunk_rows). All-or-nothing: on error, or
 * when progress stops it (then TL_OK with progress->stopped), the sequence is unchanged. */
tl_status tl_seq_run(tl_seq* s, const int32_t* tokens, size_t n, size_t chunk, const tl_run_opts* opts);

#endif
