/* pass.h (cpu) — the state of one CPU pass, shared by the files that run it: forward.c (the
 * layers, the pass's entry points) and forward_exits.c (a batch's exit rules, docs/spec.md
 * §5.7). Private to the CPU backend; see forward.c for what a pass computes. */
#ifndef TL_CPU_PASS_H
#define TL_CPU_PASS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/forward.h"
#include "cpu/attention.h"
#include "cpu/matmul.h"
#include "cpu/row_kernels.h"

/* A tile unit of a layer's attention: the rows t0 .. t0+m-1 (consecutive positions of one
 * sequence) by tiles of TL_ATTN_TILE rows (tl_attend_tile), for every query head of kv head
 * kv_head, its values packed once where no window cuts the keys (tl_attn_pack_slice). */
typedef struct attn_slice {
    size_t t0, m;
    uint32_t kv_head;
} attn_slice;

/* One pass over T rows: its inputs, the arena's buffers (forward.c's layout) and the
 * inputs of the tasks it hands the pool. */
typedef struct fwd {
    const tl_engine* e;
    const tl_config* c;
    const tl_linear* linears; /* [n_linears] indexed like tl_file.linears              */
    size_t T;                /* rows of the current step: the active ones, or a range  */
    tl_seq** seqs;           /* [T] the sequence of each row                           */
    size_t* pos;             /* [T] the position of each row                           */
    int32_t* tokens;         /* [T]                                                    */
    size_t qkv_dim, hd;      /* tl_qkv_rows ((H + 2G) * D, + H * D gate rows), H * D   */
    uint32_t layer;          /* cache slot of the current layer (row t's: tl_fwd_row_slot) */
    uint32_t block;          /* the current layer's block (file order)                   */
    uint32_t* iters;         /* [T] wave pass: each row's core iteration; else NULL     */
    bool per_row_slots;      /* a wave pass's core blocks: row t runs in iters[t]'s slots */
    bool simd;               /* SIMD kernels: acts need qx                              */
    const tl_row_kernels* rows;          /* the row operations' form (tl_row_kernels_for)  */
    const tl_attn_kernels* attn_kernels; /* the attention kernels (tl_attn_kernels_for)    */
    bool chunk;              /* the rows are positions pos[0] .. pos[0]+T-1 of one sequence;
                                else a batch: the spans of S sequences (tl_cpu_forward_spans) */
    uint32_t first_iter;     /* chunk: the first core iteration it runs (0 for a batch)  */
    uint32_t depth;          /* chunk: the depth it runs to (a batch: unused)       */
    uint32_t coda_depth;     /* chunk: whose coda slots its coda writes                */
    float* x;                /* [T][d] the state the blocks run on                     */
    float* inject;           /* [T][d] injection: linear(adapter_inject; Q8(e)); a
                                two-state core: the low state l (x is h)              */
    float* high;             /* [T][d] a two-state core: h while the stacks run on x   */
    float* side;             /* [T][d] a prefix build: the state a shallower depth ends on;
                                a batch with probes: the probed rows' copies           */
    float* y;                /* [T][d] sandwich: a sublayer's output before its norm    */
    float* qkv;              /* [T][qkv_dim]                                           */
    float* o;                /* [T][hd]; a loop layer's rows: the global attention's    */
    float* o_local;          /* [T][hd] loop attention (loop_window): the local one's    */
    float* gu;               /* [T][2F]                                                */
    tl_acts acts;            /* [T][stride] for the next linear (with act_block [2T]: digit rows) */
    size_t kmax;             /* the widest acts row, bytes (tl_acts_stride)             */
    int16_t* block_p;        /* [workers][kmax] act_block: a row's QB / NQB integers; else NULL */
    tl_attn_scratch* attn;   /* [pool threads]                                         */
    size_t* alone;           /* [T] the current layer's rows attending one by one (plan_attention) */
    attn_slice* slices;      /* [T * G] the current layer's tile units (plan_attention)            */
    size_t n_alone, n_slices;
    size_t* order;           /* [T] batch: row r belongs to the caller's span order[r]  */
    size_t* first;           /* [S] batch: span b's first token in the caller's tokens   */
    float* heads;            /* [S][d] batch: the final states the head runs on         */
    size_t* head_span;       /* [S] batch: heads row h is span head_span[h]'s last row  */
    float* logits;           /* [S][V] batch: the head's (or the probes') logits, in row order */
    uint32_t* ends;          /* [T] batch: the depth each row ends at (its own, or its exit's) */
    const tl_exit* rules;    /* batch: the caller's exit rules (caller's order), or NULL */
    tl_exit_state* exits;    /* [T] batch with an active exit rule: each row's; else NULL */
    float* prev;             /* [T][d] with exits: the latent rule's storage            */
    size_t* from;            /* [T] with exits: a reordering, new row r = old row from[r] */
    void* moved;             /* [T][moved_row] with exits: a reordering's scratch       */
    float* const* out;       /* batch: the caller's logits buffers (caller's order)     */
    uint8_t* done;           /* [T] with probes: 1 for a row that exited with its probe's
                                final state and logits (already in out); else NULL      */
    size_t* probe_at;        /* [T] with probes: row r's probe row after this iteration,
                                or SIZE_MAX                                             */
    tl_seq** pseqs;          /* [T] with probes: the probed rows' sequences             */
    size_t* ppos;            /* [T] with probes: their positions                        */
    float* klz;              /* [kl rows][V] the kl rule's previous logits              */
    int32_t* klw;            /* [kl rows][V] and its previous weights                   */
    /* input of the quantize task */
    const float* q_src;
    size_t q_src_stride, q_cols;
    bool q_rms;
    /* input of the norm task */
    float* rn_rows;
    const float* rn_gain;
    bool rn_add;
} fwd;

/* What a batch's exit rules need besides the state of each row's rule: whether any row
 * probes, and how many rows keep the kl rule's previous logits. */
typedef struct exit_needs {
    bool adaptive;  /* some row's rule is active */
    bool probes;    /* some row is kl or argmax  */
    size_t kl_rows;
} exit_needs;


/* The bytes of one row of the arrays a batch with exits reorders (tl_fwd_partition_rows). */
static inline size_t tl_fwd_moved_row(const tl_config* cfg) {
    const size_t state = cfg->d_model * sizeof(float);
    return state > sizeof(tl_exit_state) ? state : sizeof(tl_exit_state);
}

/* The cache slot row t runs the current layer in: a wave pass's core block runs each row in
 * its own iteration's slot of that block; any other layer runs every row in f->layer. */
static inline uint32_t tl_fwd_row_slot(const fwd* f, size_t t) {
    if (!f->per_row_slots) return f->layer;
    return f->layer + f->iters[t] * (tl_core_width(f->c) + f->c->n_coda_blocks);
}

/* Whether batch row r exited with its probe's final state and logits. */
static inline bool tl_fwd_done(const fwd* f, size_t r) { return f->done && f->done[r]; }

/* forward.c: the end of depth `depth` for rows [lo, hi) of `state` (f->x or f->side):
 * coda_norm, then the coda blocks in that depth's slots; and logits[T][V] of the final states
 * x[T][d]. */
void tl_fwd_end_depth(fwd* f, float* state, size_t lo, size_t hi, uint32_t depth);
void tl_fwd_head_rows(fwd* f, const float* x, float* logits);

/* forward_exits.c: a batch's exit rules (docs/spec.md §5.7), in the order run_layers calls
 * them: begun on the state entering iteration 0; after each iteration i the probes (kl,
 * argmax), then the exits taken; partition_rows puts the rows ending at depth `end` or before
 * behind the others (the done ones last). */
void tl_fwd_begin_exits(fwd* f);
void tl_fwd_probe(fwd* f, uint32_t i);
void tl_fwd_take_exits(fwd* f, uint32_t i);
void tl_fwd_partition_rows(fwd* f, uint32_t end);

#endif
