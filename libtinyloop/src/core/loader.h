/* loader.h — the `.tinyloop` file, versions 1, 2 and 3 (docs/spec.md §6): read it once into
 * private memory, validate every rule on that copy, and own the tensors. Once tl_file_open has
 * returned, the file on disk is never read again: a host may delete, truncate or rewrite it. */
#ifndef TL_LOADER_H
#define TL_LOADER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

enum { TL_FORMAT_INT8 = 1, TL_FORMAT_INT4 = 2 };
enum { TL_PART_QKV = 0, TL_PART_OUT = 1, TL_PART_GATE_UP = 2, TL_PART_DOWN = 3, TL_PARTS = 4 };
enum { TL_LAYOUT_PRE = 0, TL_LAYOUT_SANDWICH = 1, TL_LAYOUT_POST = 2 }; /* docs/spec.md §4 */
enum { TL_TOKENIZER_NONE = 0, TL_TOKENIZER_BYTES = 1, TL_TOKENIZER_HF = 2 };
enum { TL_MAX_CACHE_LAYERS = 65536 }; /* n_layers(L) bound, docs/spec.md §1 */

typedef struct tl_config {
    uint32_t vocab_size, d_model, n_heads, n_kv_heads, head_dim, ffn_dim;
    uint32_t n_pre_blocks, default_loops, max_seq_len, weight_format, group_size, tied_head;
    int32_t bos_id, eos_id;
    uint32_t tokenizer;
    float rope_theta, rms_eps;
    char name[64];
    /* version 2 (a version-1 file reads as 1, 0, PRE, 0, 0, 0, 1.0f, 0: docs/spec.md §6.5) */
    uint32_t version;                     /* the file's, 1, 2 or 3                      */
    uint32_t n_core_blocks, n_coda_blocks; /* k >= 1, n_coda                            */
    uint32_t block_layout;                /* TL_LAYOUT_*                                */
    uint32_t qkv_bias, injection, step_norm, coda_norm; /* 0 or 1                       */
    float embed_scale;
    /* version 3: the ids besides eos_id that end generation (the stop_ids tensor, §6.3) */
    uint32_t n_stop_ids;
    int32_t stop_ids[TL_MAX_STOP_IDS];
    /* version 3: adaptive depth's exit gate (the exit_gate.* tensors, §5.7, §6.3) */
    uint32_t exit_gate;     /* 1: the file has it (tl_file.exit_gate_w and the rest)      */
    float exit_threshold;   /* the gate rule's default q, in (0, 1]; 0 without the gate   */
    /* version 3 (§1, §4, §6.1 offsets 220, 224; 0 before) */
    uint32_t core_cycles;   /* 0: one state; C >= 1: a two-state core, its low stack C times */
    uint32_t attn_gate;     /* 1: attn_qkv ends with H * D gate rows, o *= sig(gate)       */
    /* version 3 (§1, §4, §6.1 offset 228; 0 before) */
    uint32_t loop_window;   /* 0: none; W_l >= 1: loop attention (the loop_gate.* tensors) */
    /* version 3 (§2.2.1, §3, §4, §6.1 offset 232; 0 before) */
    uint32_t act_block;     /* 0: one activation scale per row; B >= 1: block activations, every
                               linear's input quantized by QB / NQB in blocks of B */
} tl_config;

/* Whether emitting `token` ends generation by the model's own rule (docs/spec.md §5.3): it
 * is eos_id or one of stop_ids. */
static inline bool tl_is_stop_id(const tl_config* c, int32_t token) {
    if (c->eos_id >= 0 && token == c->eos_id) return true;
    for (uint32_t i = 0; i < c->n_stop_ids; i++)
        if (token == c->stop_ids[i]) return true;
    return false;
}

/* One linear as stored: y[R] from x[K] (docs/spec.md §3). */
typedef struct tl_linear_src {
    uint32_t rows, cols;   /* R, K                                                */
    uint32_t group_size;   /* int4 group size; 0 = int8                          */
    const int8_t* w8;      /* int8 weights [R][K]                                 */
    const uint8_t* w4;     /* int4 weights [R][K/2], element 2i in the low nibble */
    const uint8_t* mult;   /* int4 group multipliers [R][K/group_size]            */
    const float* scale;    /* row scales [R]                                      */
} tl_linear_src;

/* The f32 vectors of one block (NULL where the config has none). */
typedef struct tl_block_vectors {
    const float* qkv_bias;       /* [tl_qkv_rows] when qkv_bias                         */
    const float* attn_post_norm; /* [d] gain, sandwich and post layouts                  */
    const float* ffn_post_norm;  /* [d] gain, sandwich and post layouts                  */
    const int8_t* loop_gate_w;   /* [H][D] a core block's loop gate (loop_window >= 1)   */
    const float* loop_gate_s;    /* [H] its row scales                                   */
    const float* loop_gate_b;    /* [H] its biases                                       */
} tl_block_vectors;

/* Every tensor below is its own 64-byte-aligned allocation, owned by the tl_file. The blocks
 * are numbered in file order: prelude 0 .. n_pre-1, core n_pre .. n_pre+k-1, then the coda. */
typedef struct tl_file {
    tl_config cfg;
    uint32_t checksum;     /* the header's (§6.1 offset 24): a prefix blob names its model by */
    uint64_t file_bytes;   /* it and by this (docs/spec.md §7)                               */
    const int8_t* emb_w;   /* [V][d]                                              */
    const float* emb_s;    /* [V]                                                 */
    const float* rope_cos; /* [max_seq_len][D/2]                                  */
    const float* rope_sin; /* [max_seq_len][D/2]                                  */
    /* Part p of block b at linears[tl_block_linear_index(b, p)]; then the adapter's two
     * linears (state, inject) when injection; then the head (the embedding when tied). */
    tl_linear_src* linears;
    size_t n_linears;
    tl_block_vectors* blocks; /* [tl_n_blocks(cfg)]                                  */
    const float* step_norm;  /* [d] gain of core.step_norm, or NULL                 */
    const float* coda_norm;  /* [d] gain of coda.input_norm, or NULL                */
    const int8_t* exit_gate_w; /* [d] int8 weights of the exit gate (§5.7), NULL without the gate */
    float exit_gate_s, exit_gate_b; /* its row scale and bias (0 without the gate)  */
} tl_file;

static inline uint32_t tl_n_blocks(const tl_config* c) {
    return c->n_pre_blocks + c->n_core_blocks + c->n_coda_blocks;
}

/* R of attn_qkv (docs/spec.md §4, §6.3): the Q, K and V heads, (H + 2G) * D, then with the
 * attention gate H * D gate rows. */
static inline size_t tl_qkv_rows(const tl_config* c) {
    return ((size_t)c->n_heads * (c->attn_gate ? 2 : 1) + 2 * (size_t)c->n_kv_heads) * c->head_dim;
}

/* w, the core's layers per iteration (docs/spec.md §1): k, or (C + 1) * k/2 for a two-state core. */
static inline uint32_t tl_core_width(const tl_config* c) {
    return c->core_cycles ? (c->core_cycles + 1) * (c->n_core_blocks / 2) : c->n_core_blocks;
}

/* The core block (0 .. k-1) that application a (0 .. w-1) of an iteration runs: block a, or in a
 * two-state core the low stack's block a mod n in the low cycles (a < C*n), then the high
 * stack's n + (a - C*n). */
static inline uint32_t tl_core_block_of(const tl_config* c, uint32_t a) {
    const uint32_t n = c->n_core_blocks / 2, low = c->core_cycles * n;
    return !c->core_cycles ? a : a < low ? a % n : a - low + n;
}

/* Whether a row carries a second state between core iterations, beside x (core/forward.h's
 * "inject"): Huginn's injected term (constant), or a two-state core's low state l (x is h). */
static inline bool tl_has_inject(const tl_config* c) { return c->injection || c->core_cycles; }

/* Cache slots of a sequence at depth `loops` (docs/spec.md §1): n_pre + L * (w + n_coda). */
static inline size_t tl_n_layers(const tl_config* c, uint32_t loops) {
    return (size_t)c->n_pre_blocks + (size_t)loops * (tl_core_width(c) + c->n_coda_blocks);
}

/* The cache slot of core application a in iteration i (docs/spec.md §1); with a = w + c, that of
 * coda block c at depth i + 1. */
static inline size_t tl_core_slot(const tl_config* c, uint32_t i, uint32_t a) {
    return (size_t)c->n_pre_blocks + (size_t)i * (tl_core_width(c) + c->n_coda_blocks) + a;
}

/* Loop attention (docs/spec.md §1, §4): whether the layer of cache slot `slot` is a core
 * application j of an iteration i >= 1 of a loop model, and then *global = n_pre + j, the slot
 * of application j in iteration 0, whose KV its global attention reads. */
static inline bool tl_loop_slot(const tl_config* c, size_t slot, uint32_t* global) {
    if (!c->loop_window || slot < c->n_pre_blocks) return false;
    const size_t per = (size_t)c->n_core_blocks + c->n_coda_blocks, r = slot - c->n_pre_blocks;
    if (r < per || r % per >= c->n_core_blocks) return false;
    *global = c->n_pre_blocks + (uint32_t)(r % per);
    return true;
}

/* Whether a pass has work after the last iteration (coda_norm or coda blocks): what a prefix
 * build repeats on a copy of the state at every shallower depth (docs/spec.md §5.4). */
static inline bool tl_has_coda(const tl_config* c) { return c->coda_norm || c->n_coda_blocks > 0; }

/* What runs cache slot `slot` (docs/spec.md §1): the block number (file order) and, for a coda
 * slot, the depth whose coda writes it (0 for prelude and core slots, which every depth whose
 * slot range covers them runs). */
typedef struct tl_slot {
    uint32_t block;
    uint32_t coda_depth;
} tl_slot;

static inline tl_slot tl_slot_at(const tl_config* c, size_t slot) {
    tl_slot s = {(uint32_t)slot, 0};
    if (slot < c->n_pre_blocks) return s;
    const uint32_t w = tl_core_width(c);
    const size_t per = (size_t)w + c->n_coda_blocks;
    const size_t r = slot - c->n_pre_blocks, i = r / per;
    const uint32_t j = (uint32_t)(r % per);
    s.block = c->n_pre_blocks + (j < w ? tl_core_block_of(c, j) : c->n_core_blocks + j - w);
    s.coda_depth = j < w ? 0 : (uint32_t)i + 1;
    return s;
}

/* The index in tl_file.linears (and every backend's array laid out like it) of part `part`
 * of block `block` (file order). */
static inline size_t tl_block_linear_index(uint32_t block, int part) {
    return (size_t)block * TL_PARTS + (size_t)part;
}
/* The adapter's linears (injection only): 0 = state, 1 = inject. */
static inline size_t tl_adapter_linear_index(const tl_config* c, int which) {
    return (size_t)tl_n_blocks(c) * TL_PARTS + (size_t)which;
}

/* Read and validate; on failure returns TL_ERR_IO / TL_ERR_BAD_FILE / TL_ERR_OUT_OF_MEMORY
 * with the first broken rule in tl_last_error() and leaves *out empty. */
tl_status tl_file_open(const char* path, tl_file* out);
/* Free the weights of linear i once a backend holds them in its own form (repacked, uploaded);
 * its shape stays and its weight pointers become NULL. The tied head is the embedding, which
 * stays. */
void tl_file_release_linear(tl_file* file, size_t i);
/* Bytes of tensors the file still holds. */
size_t tl_file_held_bytes(const tl_file* file);
void tl_file_close(tl_file* file);

#endif
