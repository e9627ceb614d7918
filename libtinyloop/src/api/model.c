/* model.c — tl_model handles and their engines: open (read, validate, take a share of the
 * process's worker threads, pick the backend: the CPU's or, for TL_DEVICE_CUDA, the device's),
 * configuration queries, close/free, and the reference counting that keeps the weights alive
 * while sequences and prefixes use them. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "base/versioned.h"
#include "core/backend.h"
#include "core/engine.h"
#include "core/prefix_cache.h"
#include "cpu/backend_cpu.h"
#include "cpu/isa.h"
#include "cpu/row_kernels.h"
#include "cpu/threadpool.h"
#include "cuda/backend_cuda.h"

enum { TL_MAX_KV_BLOCK_SIZE = 65536 }; /* as the Python layer (tinyloop/params.py MAX_BLOCK_SIZE) */

struct tl_model {
    pthread_mutex_t lock; /* guards engine against a concurrent close */
    tl_engine* engine;    /* NULL once closed */
};

void tl_engine_ref(tl_engine* e) { atomic_fetch_add(&e->refs, 1); }

/* tl_device_check, and *n_devices = the CUDA devices its probe found (0 unless `device` is
 * TL_DEVICE_CUDA): one probe serves both. */
static tl_status device_check(tl_device device, int* n_devices) {
    *n_devices = 0;
    switch (device) {
    case TL_DEVICE_AUTO:
    case TL_DEVICE_CPU: return TL_OK;
    case TL_DEVICE_CUDA: return tl_cuda_probe(n_devices);
    }
    return tl_fail(TL_ERR_INVALID_ARGUMENT, "device must be 0 (auto), 1 (cpu) or 2 (cuda), got %d", (int)device);
}

TL_API tl_status tl_device_check(tl_device device) {
    int n_devices;
    return device_check(device, &n_devices);
}

static void engine_destroy(tl_engine* e) {
    tl_pcache_free(e->pcache); /* its device blocks go back before the backend does */
    tl_backend_free(e->backend);
    tl_pool_destroy(e->pool);
    tl_file_close(&e->file);
    tl_free(e);
}

void tl_engine_unref(tl_engine* e) {
    if (e && atomic_fetch_sub(&e->refs, 1) == 1) engine_destroy(e);
}

tl_status tl_engine_check_open(const tl_engine* e) {
    return atomic_load(&e->closed) ? tl_fail(TL_ERR_CLOSED, "model was closed") : TL_OK;
}

tl_status tl_engine_resolve_loops(const tl_engine* e, uint32_t loops, uint32_t* out) {
    if (loops == 0) loops = e->file.cfg.default_loops;
    if (loops > TL_MAX_LOOPS) return tl_fail(TL_ERR_INVALID_ARGUMENT, "loops > %d", TL_MAX_LOOPS);
    *out = loops;
    return TL_OK;
}

tl_status tl_engine_check_tokens(const tl_engine* e, const int32_t* tokens, size_t n, const char* what) {
    const uint32_t V = e->file.cfg.vocab_size;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= V)
            return tl_fail(TL_ERR_OUT_OF_RANGE, "%s: token id %d at index %zu is out of range [0, %u)",
                           what, tokens[i], i, V);
    return TL_OK;
}

tl_status tl_model_acquire(tl_model* model, tl_engine** out) {
    *out = NULL;
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model is NULL");
    pthread_mutex_lock(&model->lock);
    tl_engine* e = model->engine;
    if (e) tl_engine_ref(e);
    pthread_mutex_unlock(&model->lock);
    if (!e) return tl_fail(TL_ERR_CLOSED, "model was closed");
    *out = e;
    return TL_OK;
}

TL_API tl_model_params tl_model_params_default(void) {
    tl_model_params p;
    memset(&p, 0, sizeof p);
    p.size = sizeof p;
    p.n_threads = 0;
    p.kv_block_size = 0;
    p.isa = TL_ISA_AUTO;
    p.device = TL_DEVICE_AUTO;
    p.device_index = 0;
    p.kv_mode = TL_KV_INT8;
    return p;
}

/* The kernel path for the params' `isa`: an explicit one as given; for TL_ISA_AUTO the one the
 * environment variable TINYLOOP_ISA names when it is set and not empty (tests and benches force
 * a path with it), else the best this CPU runs. A path the CPU or build lacks is
 * TL_ERR_UNSUPPORTED. */
static tl_status resolve_isa(tl_isa* isa) {
    if ((int)*isa < TL_ISA_AUTO || (int)*isa > TL_ISA_AMX)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "isa must be 0 .. %d, got %d", (int)TL_ISA_AMX, (int)*isa);
    const char* from = "";
    const char* forced = *isa == TL_ISA_AUTO ? getenv("TINYLOOP_ISA") : NULL;
    if (forced && *forced) {
        if (!tl_isa_from_name(forced, isa))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "TINYLOOP_ISA must be auto, scalar, avx2, avx512, "
                           "avx512-vnni or amx, got '%s'", forced);
        from = " (from TINYLOOP_ISA)";
    }
    if (!tl_isa_available(*isa))
        return tl_fail(TL_ERR_UNSUPPORTED, "isa %s is not supported by this CPU or build%s", tl_isa_name(*isa), from);
    if (*isa == TL_ISA_AUTO) *isa = tl_isa_best();
    return TL_OK;
}

/* The form of the CPU row and attention kernels for kernel path `path`: the widest it allows,
 * or AVX2 where the environment variable TINYLOOP_ROW_KERNELS is "avx2" and the path is a SIMD
 * one (benches compare the two forms with it; both give the same bits). */
static tl_status resolve_row_isa(tl_isa path, tl_isa* out) {
    *out = tl_widest_row_isa(path);
    const char* forced = getenv("TINYLOOP_ROW_KERNELS");
    if (!forced || !*forced || strcmp(forced, "auto") == 0) return TL_OK;
    if (strcmp(forced, "avx2") != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "TINYLOOP_ROW_KERNELS must be auto or avx2, got '%s'", forced);
    if (*out != TL_ISA_SCALAR) *out = TL_ISA_AVX2;
    return TL_OK;
}

static tl_status resolve_params(const tl_model_params* given, tl_model_params* p) {
    *p = tl_model_params_default();
    if (given) {
        if (given->size < sizeof(size_t))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_model_params.size must be set (sizeof(tl_model_params))");
        memcpy(p, given, given->size < sizeof *p ? given->size : sizeof *p);
    }
    if (p->n_threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        p->n_threads = cores > 0 ? (uint32_t)(cores < TL_POOL_MAX_THREADS ? cores : TL_POOL_MAX_THREADS) : 1;
    }
    if (p->n_threads > TL_POOL_MAX_THREADS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_threads must be <= %d, got %u", TL_POOL_MAX_THREADS,
                       p->n_threads);
    if (p->kv_block_size == 0) p->kv_block_size = 16;
    if (p->kv_block_size > TL_MAX_KV_BLOCK_SIZE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_block_size must be <= %d, got %u", TL_MAX_KV_BLOCK_SIZE,
                       p->kv_block_size);
    if (p->kv_mode != TL_KV_INT8 && p->kv_mode != TL_KV_INT4)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_mode must be 0 (int8) or 1 (int4), got %d", (int)p->kv_mode);
    if (p->prefix_cache_dir && p->prefix_cache_bytes == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix_cache_dir needs prefix_cache_bytes > 0");
    tl_status st = resolve_isa(&p->isa);
    if (st != TL_OK) return st;
    int n_devices;
    st = device_check(p->device, &n_devices);
    if (st != TL_OK) return st;
    if (p->device == TL_DEVICE_AUTO) p->device = TL_DEVICE_CPU; /* CUDA joins auto once verified */
    if (p->device == TL_DEVICE_CUDA && (p->device_index < 0 || p->device_index >= n_devices))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "device_index %d: this machine has %d CUDA device(s)",
                       (int)p->device_index, n_devices);
    return TL_OK;
}

/* The automatic prefix cache and, with a prefix_cache_dir, its disk tier. */
static tl_status prefix_cache_create(tl_engine* e, const tl_model_params* p) {
    const tl_config* c = &e->file.cfg;
    tl_pdisk* disk = NULL;
    if (p->prefix_cache_dir) {
        const tl_block_model m = {e->file.checksum, e->file.file_bytes, c->max_seq_len, c->vocab_size, e->kv_geom};
        const tl_status st = tl_pdisk_open(p->prefix_cache_dir, p->prefix_cache_disk_bytes, &m, &disk);
        if (st != TL_OK) return st;
    }
    e->pcache = tl_pcache_new(&e->kv_geom, p->prefix_cache_bytes, disk);
    return e->pcache ? TL_OK : tl_fail_oom("prefix cache");
}

static tl_status engine_create(const char* path, const tl_model_params* p, tl_engine** out) {
    *out = NULL;
    tl_engine* e = tl_alloc_zeroed(1, sizeof *e);
    if (!e) return tl_fail_oom("model");
    atomic_init(&e->refs, 1);
    atomic_init(&e->closed, false);
    e->isa = p->isa;
    tl_status st = resolve_row_isa(e->isa, &e->row_isa);
    if (st != TL_OK) {
        tl_free(e);
        return st;
    }
    st = tl_file_open(path, &e->file);
    if (st != TL_OK) {
        tl_free(e);
        return st;
    }
    const tl_config* c = &e->file.cfg;
    e->kv_geom = tl_kv_geom_make(p->kv_block_size, c->n_kv_heads, c->head_dim,
                                 p->kv_mode == TL_KV_INT4 ? 4 : 8);
    st = tl_pool_create(p->n_threads, &e->pool);
    if (st == TL_OK)
        st = p->device == TL_DEVICE_CUDA ? tl_backend_cuda_new(e, p->device_index, &e->backend)
                                         : tl_backend_cpu_new(e, &e->backend);
    if (st == TL_OK) e->kv_geom.device = e->backend->kv;
    if (st == TL_OK && p->prefix_cache_bytes) st = prefix_cache_create(e, p);
    if (st != TL_OK) {
        engine_destroy(e);
        return st;
    }
    *out = e;
    return TL_OK;
}

TL_API tl_status tl_model_open(const char* path, const tl_model_params* params, tl_model** out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    tl_model_params p;
    tl_status st = resolve_params(params, &p);
    if (st != TL_OK) return st;
    tl_model* m = tl_alloc_zeroed(1, sizeof *m);
    if (!m) return tl_fail_oom("model handle");
    st = engine_create(path, &p, &m->engine);
    if (st != TL_OK) {
        tl_free(m);
        return st;
    }
    pthread_mutex_init(&m->lock, NULL);
    *out = m;
    return TL_OK;
}

/* Shared start of the versioned getters: `out` must carry its size; the model must be open. */
static tl_status begin_get(const tl_model* model, const void* out, tl_engine** e) {
    if (!out || *(const size_t*)out < sizeof(size_t))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "out is NULL or out->size not set");
    return tl_model_acquire((tl_model*)model, e);
}

/* Copy `full` (whose first field is its size) into the caller's struct, up to the caller's
 * size, so an older caller with a shorter struct gets the fields it knows. */

TL_API tl_status tl_model_config_get(const tl_model* model, tl_model_config* out) {
    tl_engine* e;
    tl_status st = begin_get(model, out, &e);
    if (st != TL_OK) return st;
    const tl_config* c = tl_engine_config(e);
    tl_model_config full = {
        sizeof full, c->vocab_size, c->d_model, c->n_heads, c->n_kv_heads, c->head_dim, c->ffn_dim,
        c->n_pre_blocks, c->default_loops, c->max_seq_len, c->weight_format, c->group_size,
        c->tied_head, c->bos_id, c->eos_id, c->tokenizer, c->rope_theta, c->rms_eps, {0},
        c->version, c->n_core_blocks, c->n_coda_blocks, c->block_layout, c->qkv_bias, c->injection,
        c->step_norm, c->embed_scale, c->coda_norm, c->n_stop_ids, {0}, c->exit_gate, c->exit_threshold,
        c->core_cycles, c->attn_gate, c->loop_window, c->act_block};
    memcpy(full.name, c->name, sizeof full.name);
    memcpy(full.stop_ids, c->stop_ids, sizeof full.stop_ids);
    tl_copy_versioned(out, &full, sizeof full);
    tl_engine_unref(e);
    return TL_OK;
}

TL_API tl_status tl_model_runtime_get(const tl_model* model, tl_model_runtime* out) {
    tl_engine* e;
    tl_status st = begin_get(model, out, &e);
    if (st != TL_OK) return st;
    tl_backend_info info;
    e->backend->iface->info(e->backend, &info);
    /* the backend's own weights, and the file's tensors that are still held (embedding, rope, ...) */
    const size_t host_weight_bytes = info.host_weight_bytes + tl_file_held_bytes(&e->file);
    tl_model_runtime full = {sizeof full, e->isa, tl_pool_threads(e->pool), e->kv_geom.block_size,
                             host_weight_bytes, info.device, info.device_weight_bytes, {0},
                             tl_kv_geom_mode(&e->kv_geom)};
    snprintf(full.device_name, sizeof full.device_name, "%s", info.name);
    tl_copy_versioned(out, &full, sizeof full);
    tl_engine_unref(e);
    return TL_OK;
}

TL_API tl_status tl_model_prefix_cache_stats(tl_model* model, tl_prefix_cache_stats* out) {
    tl_engine* e;
    tl_status st = begin_get(model, out, &e);
    if (st != TL_OK) return st;
    tl_prefix_cache_stats full;
    memset(&full, 0, sizeof full);
    full.size = sizeof full;
    if (e->pcache) full = tl_pcache_stats(e->pcache);
    tl_copy_versioned(out, &full, sizeof full);
    tl_engine_unref(e);
    return TL_OK;
}

TL_API tl_status tl_model_prefix_cache_clear(tl_model* model) {
    tl_engine* e;
    tl_status st = tl_model_acquire(model, &e);
    if (st != TL_OK) return st;
    if (e->pcache) tl_pcache_clear(e->pcache);
    tl_engine_unref(e);
    return TL_OK;
}

TL_API void tl_model_close(tl_model* model) {
    if (!model) return;
    pthread_mutex_lock(&model->lock);
    tl_engine* e = model->engine;
    model->engine = NULL;
    if (e) atomic_store(&e->closed, true);
    pthread_mutex_unlock(&model->lock);
    if (e && e->pcache) tl_pcache_close(e->pcache); /* cached blocks are spilled and go now; none comes back */
    tl_engine_unref(e);
}

TL_API void tl_model_free(tl_model* model) {
    if (!model) return;
    tl_model_close(model);
    pthread_mutex_destroy(&model->lock);
    tl_free(model);
}
