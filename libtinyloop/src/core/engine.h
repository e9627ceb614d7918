/* engine.h — the shared, reference-counted state behind a tl_model handle: the mapped file,
 * the prepared linears, the KV geometry, the thread pool and, on a GPU, the CUDA state. Sequences and prefixes hold a
 * reference, so the weights outlive tl_model_close until the last of them is freed; every
 * public entry point first checks `closed` and fails with "model was closed". */
#ifndef TL_ENGINE_H
#define TL_ENGINE_H

#include <stdatomic.h>
#include <stdbool.h>

#include "cuda/cuda_backend.h"
#include "core/kvcache.h"
#include "core/loader.h"
#include "cpu/matmul.h"
#include "core/prefix_cache.h"
#include "cpu/threadpool.h"

enum { TL_MAX_LOOPS = 1024 }; /* as the Python layer (tinyloop/params.py MAX_LOOPS) */

typedef struct tl_engine {
    atomic_uint refs;
    atomic_bool closed;
    tl_file file;
    tl_isa isa;
    tl_kv_geom kv_geom;
    tl_linear* linears;  /* indexed like file.linears: block * TL_PARTS + part, then head */
    size_t n_linears;
    tl_pool* pool;
    size_t weight_bytes;
    tl_pcache* pcache;   /* the automatic prefix cache; NULL when the model has none */
    tl_cuda* cuda;       /* the device running the forward pass; NULL = the CPU. The CPU
                            linears stay prepared either way (tl_head_logits uses them). */
} tl_engine;

static inline const tl_config* tl_engine_config(const tl_engine* e) { return &e->file.cfg; }
static inline const tl_linear* tl_engine_linear(const tl_engine* e, uint32_t layer, int part) {
    const uint32_t n_pre = e->file.cfg.n_pre_blocks;
    const uint32_t block = layer < n_pre ? layer : n_pre;
    return &e->linears[(size_t)block * TL_PARTS + (size_t)part];
}
static inline const tl_linear* tl_engine_head(const tl_engine* e) { return &e->linears[e->n_linears - 1]; }

void tl_engine_ref(tl_engine* e);
void tl_engine_unref(tl_engine* e);
/* TL_OK, or TL_ERR_CLOSED with "model was closed". */
tl_status tl_engine_check_open(const tl_engine* e);
/* Resolve `loops` (0 = default) and check it: 1 .. TL_MAX_LOOPS. */
tl_status tl_engine_resolve_loops(const tl_engine* e, uint32_t loops, uint32_t* out);
/* Every token id in [0, vocab_size), else TL_ERR_OUT_OF_RANGE naming the first bad one. */
tl_status tl_engine_check_tokens(const tl_engine* e, const int32_t* tokens, size_t n, const char* what);

/* Acquire the engine behind a model handle (a reference the caller must drop), or fail with
 * TL_ERR_CLOSED / TL_ERR_INVALID_ARGUMENT. */
tl_status tl_model_acquire(tl_model* model, tl_engine** out);

#endif
