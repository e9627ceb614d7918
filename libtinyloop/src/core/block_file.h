/* block_file.h — the spilled block file of the prefix cache's disk tier (docs/spec.md §7.6):
 * one full, block-aligned KV block as bytes, with the key of its place in the cache (model,
 * KV mode, window, tree depth, block size, instruction length, salt and every token up to the
 * block's end), and
 * its name (§4.3.1: the FNV-1a hash of those key fields, the salt and the tokens).
 *
 * The writer fills a buffer of tl_block_file_size bytes; the reader checks every rule of §7.6
 * on bytes it does not trust, in the spec's order, without reading outside them, before
 * tl_block_file_decode copies the records into a block. Device blocks are staged through
 * kv_records.h. */
#ifndef TL_BLOCK_FILE_H
#define TL_BLOCK_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/kvcache.h"

enum { TL_BLOCK_HEADER_BYTES = 96, TL_BLOCK_MAX_SALT = 65536, TL_BLOCK_MAX_LAYERS = 65536 };

/* What every file of a tier shares: the model it belongs to and its KV geometry. */
typedef struct tl_block_model {
    uint32_t checksum;      /* the model file's header checksum (§6.1 offset 24) */
    uint64_t file_bytes;    /* the model file's file_bytes                        */
    uint32_t max_seq_len, vocab_size;
    tl_kv_geom geom;        /* block size, G, D, KV mode (and the device's hooks) */
} tl_block_model;

/* A block's place in the cache: block `index` (positions index*bs .. (index+1)*bs - 1) of the
 * tree (salt, window, tree_depth, instruction), reached by tokens[0 .. (index+1)*bs). */
typedef struct tl_block_place {
    const char* salt;       /* NUL-terminated, not NULL                 */
    uint32_t window, tree_depth, index;
    const int32_t* tokens;  /* [(index + 1) * bs]                       */
    uint32_t instruction;   /* the tree's instruction length P          */
} tl_block_place;

/* The name hash, incrementally: tl_block_name_start over the key fields of `at` (the
 * instruction only when it is > 0: a causal tree's names are those of TinyLoop 0.7) and its
 * salt (of salt_bytes bytes), then tl_block_name_more over the tokens in order. */
uint64_t tl_block_name_start(const tl_block_model* m, const tl_block_place* at, size_t salt_bytes);
uint64_t tl_block_name_more(uint64_t h, const int32_t* tokens, size_t n);
/* "<16 lower-case hex digits>.tlblock" into out[32]. */
void tl_block_name_format(uint64_t h, char out[32]);

/* Bytes of the file of a block of n_layers layers at block index `index` with a salt of
 * salt_bytes bytes (no overflow for any block the model can hold). */
size_t tl_block_file_size(const tl_block_model* m, size_t salt_bytes, uint32_t index, uint32_t n_layers);

/* Block b (full, block-aligned, at `at`; salt of at most TL_BLOCK_MAX_SALT bytes) as a file into
 * out[tl_block_file_size]; `stage`: tl_kv_stage_new's for the geometry. */
tl_status tl_block_file_encode(const tl_block_model* m, const tl_block_place* at, tl_kv_block* b, void* stage,
                               uint8_t* out);

/* Whether which layer counts a block of a tree serves a request needing n_layers: the same
 * count with a coda (tree_depth > 0), that many or more without. */
static inline bool tl_block_serves(uint32_t block_layers, uint32_t tree_depth, uint32_t n_layers) {
    return tree_depth ? block_layers == n_layers : block_layers >= n_layers;
}

/* Every rule of §7.6 on buf[0 .. n), in order, then that the file holds the block at `at` and
 * serves n_layers (tl_block_serves); TL_ERR_BAD_FILE naming the first rule broken. */
tl_status tl_block_file_check(const tl_block_model* m, const uint8_t* buf, size_t n, const tl_block_place* at,
                              uint32_t n_layers);
/* The layer count of a checked file. */
uint32_t tl_block_file_layers(const uint8_t* buf);
/* The records of a checked file into b (its layer count and start the file's). */
tl_status tl_block_file_decode(const tl_block_model* m, const uint8_t* buf, tl_kv_block* b, void* stage);

#endif
