/* loader.h — the `.tinyloop` file (docs/spec.md §6): map it read-only, validate every rule,
 * and expose the tensors as borrowed views into the mapping. */
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

typedef struct tl_file {
    const uint8_t* bytes;  /* the read-only mapping                               */
    size_t n_bytes;
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

/* Map and validate; on failure returns TL_ERR_IO / TL_ERR_BAD_FILE / TL_ERR_OUT_OF_MEMORY
 * with the first broken rule in tl_last_error() and leaves *out empty. */
tl_status tl_file_open(const char* path, tl_file* out);
void tl_file_close(tl_file* file);

static inline const tl_linear_src* tl_file_linear(const tl_file* f, uint32_t block, int part) {
    return &f->linears[(size_t)block * TL_PARTS + (size_t)part];
}
static inline const tl_linear_src* tl_file_head(const tl_file* f) {
    return &f->linears[f->n_linears - 1];
}

#endif
