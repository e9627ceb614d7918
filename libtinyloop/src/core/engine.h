/* engine.h — the shared, reference-counted state behind a tl_model handle: the file's tensors,
 * the KV geometry, the thread pool, the prefix cache and the backend that runs the forward pass
 * (backend.h). Sequences and prefixes hold a reference, so the weights outlive tl_model_close
 * until the last of them is freed; every public entry point first checks `closed` and fails
 * with "model was closed". */
#ifndef TL_ENGINE_H
#define TL_ENGINE_H

#include <stdatomic.h>
#include <stdbool.h>

#include "core/kvcache.h"
#include "core/loader.h"

typedef struct tl_backend tl_backend; /* core/backend.h       */
typedef struct tl_pcache tl_pcache;   /* core/prefix_cache.h  */
typedef struct tl_pool tl_pool;       /* cpu/threadpool.h     */

enum { TL_MAX_LOOPS = 1024 }; /* as the Python layer (tinyloop/params.py MAX_LOOPS) */

typedef struct tl_engine {
    atomic_uint refs;
    atomic_bool closed;
    tl_file file;
    tl_isa isa;          /* the CPU kernel path (never TL_ISA_AUTO)                        */
    tl_isa row_isa;      /* the form of its row and attention kernels (cpu/row_kernels.h)   */
    tl_kv_geom kv_geom;  /* its .device is the backend's KV allocator                     */
    tl_pool* pool;       /* the model's share of the process's worker threads (n_threads) */
    tl_pcache* pcache;   /* the automatic prefix cache; NULL when the model has none      */
    tl_backend* backend; /* runs the forward pass: the CPU's or a device's                */
} tl_engine;

static inline const tl_config* tl_engine_config(const tl_engine* e) { return &e->file.cfg; }

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
