/* loader.h — the `.tinyloop` file (docs/spec.md §6): read it once into private memory,
 * validate every rule on that copy, and own the tensors. Once tl_file_open has returned, the
 * file on disk is never read again: a host may delete, truncate or rewrite it. */
#ifndef TL_LOADER_H
#define TL_LOADER_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

enum { TL_FORMAT_INT8 = 1, TL_FORMAT_INT4 = 2 };
enum { TL_PART_QKV = 0, TL_PART_OUT = 1, TL_PART_GATE_UP = 2, TL_PART_DOWN = 3, TL_PARTS = 4 };

typedef struct tl_config {
    uint32_t vocab_size, d_model, n_heads, n_kv_heads, head_dim, ffn_dim;
    uint32_t n_pre_blocks, default_loops, max_seq_len, weight_format, group_size, tied_head;
    int32_t bos_id, eos_id;
    uint32_t tokenizer;
    float rope_theta, rms_eps;
    char name[64];
} tl_config;

/* One linear as stored: y[R] from x[K] (docs/spec.md §3). */
typedef struct tl_linear_src {
    uint32_t rows, cols;   /* R, K                                                */
    uint32_t group_size;   /* int4 group size; 0 = int8                          */
    const int8_t* w8;      /* int8 weights [R][K]                                 */
    const uint8_t* w4;     /* int4 weights [R][K/2], element 2i in the low nibble */
    const uint8_t* mult;   /* int4 group multipliers [R][K/group_size]            */
    const float* scale;    /* row scales [R]                                      */
} tl_linear_src;

/* Every tensor below is its own 64-byte-aligned allocation, owned by the tl_file. */
typedef struct tl_file {
    tl_config cfg;
    const int8_t* emb_w;   /* [V][d]                                              */
    const float* emb_s;    /* [V]                                                 */
    const float* rope_cos; /* [max_seq_len][D/2]                                  */
    const float* rope_sin; /* [max_seq_len][D/2]                                  */
    /* Linears of block b (0 .. n_pre_blocks; the last is the loop block), part p:
     * linears[b * TL_PARTS + p]; then the head (the embedding when tied). */
    tl_linear_src* linears;
    size_t n_linears;
} tl_file;

/* The index in tl_file.linears (and every backend's array laid out like it) of part `part` of
 * the block that runs cache layer `layer`: pre block `layer`, or the loop block for every
 * later layer. The head is the last entry. */
static inline size_t tl_layer_linear_index(const tl_config* c, uint32_t layer, int part) {
    const uint32_t block = layer < c->n_pre_blocks ? layer : c->n_pre_blocks;
    return (size_t)block * TL_PARTS + (size_t)part;
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
