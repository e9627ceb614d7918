/* device.cu — the CUDA backend's lifecycle (device.h): probing, tl_cuda_create (device,
 * stream, every weight uploaded in the layouts of common.cuh), tl_cuda_free, KV block memory,
 * the release of pass scratch and cached graphs, and the CUDA error -> tl_status helpers. Every
 * entry point that selects the model's device does so through tl_cu_device_guard, which gives
 * the caller back its own current device.
 *
 * Weights are uploaded once, padded with zeros (rows to TL_CU_TILE_N, columns to TL_CU_TILE_K)
 * so the kernels never test bounds inside their loops; so are the f32 vectors of version 2
 * (docs/spec.md §6.3): the qkv biases beside their linears, each block's post-norm gains, the
 * step norm's and the coda norm's gains. An int4 linear is stored twice: the
 * exact int8 split m*w = 128*hi + lo (|hi| <= 16, -64 <= lo < 64) that the tensor-core GEMM
 * runs, and, when the group size is a multiple of 8, the packed nibbles + per-word multipliers
 * of the dp4a GEMV. Both compute the same exact integer acc of docs/spec.md §3. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

extern "C" {
#include "base/alloc.h"
}

/* ---- errors ------------------------------------------------------------------------------- */

tl_status tl_cu_check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return TL_OK;
    (void)cudaGetLastError(); /* clear it, so that a later launch check does not report it again */
    if (err == cudaErrorMemoryAllocation)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "out of memory (CUDA %s: %s)", what, cudaGetErrorString(err));
    return tl_fail(TL_ERR_INTERNAL, "CUDA %s failed: %s", what, cudaGetErrorString(err));
}

tl_status tl_cu_launched(const char* what) { return tl_cu_check(cudaGetLastError(), what); }

/* ---- probing -------------------------------------------------------------------------------- */

/* A kernel whose attributes tell whether this build has code for the current device. */
static __global__ void probe_kernel(int* p) {
    if (p) *p = 0;
}

extern "C" tl_status tl_cuda_probe(int* n_devices) {
    int n = 0;
    if (n_devices) *n_devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_UNSUPPORTED, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (n < 1) return tl_fail(TL_ERR_UNSUPPORTED, "no CUDA device: none found");
    if (n_devices) *n_devices = n;
    return TL_OK;
}

/* ---- upload --------------------------------------------------------------------------------- */

/* cudaMalloc + copy of `bytes` host bytes; counts them in weight_bytes. */
static tl_status upload(tl_cuda* c, void** dst, const void* src, size_t bytes, const char* what) {
    *dst = NULL;
    if (bytes == 0) return TL_OK;
    cudaError_t err = cudaMalloc(dst, bytes);
    if (err != cudaSuccess) {
        *dst = NULL;
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "out of memory (CUDA weights: %s, %zu bytes)", what, bytes);
    }
    c->weight_bytes += bytes;
    return tl_cu_check(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (weights)");
}

static int int4_at(const uint8_t* w4_row, size_t k) {
    const uint8_t byte = w4_row[k / 2];
    const int nib = (k & 1) ? byte >> 4 : byte & 15;
    return (nib ^ 8) - 8;
}

/* Device copy of one linear (see common.cuh for the layouts). */
static tl_status upload_linear(tl_cuda* c, const tl_linear_src* s, tl_cu_linear* L) {
    memset(L, 0, sizeof *L);
    L->rows = s->rows;
    L->cols = s->cols;
    L->rows_pad = (uint32_t)tl_cu_round_up(s->rows, TL_CU_TILE_N);
    L->cols_pad = (uint32_t)tl_cu_round_up(s->cols, TL_CU_TILE_K);
    L->group_size = s->group_size;
    const size_t R = s->rows, K = s->cols, Rp = L->rows_pad, Kp = L->cols_pad;
    tl_status st = TL_OK;

    float* scale = (float*)tl_alloc_zeroed(Rp, sizeof(float));
    if (!scale) return tl_fail_oom("CUDA weight staging");
    memcpy(scale, s->scale, R * sizeof(float));
    st = upload(c, (void**)&L->scale, scale, Rp * sizeof(float), "row scales");
    tl_free(scale);
    if (st != TL_OK) return st;

    if (s->group_size == 0) {
        int8_t* w = (int8_t*)tl_alloc_zeroed(Rp * Kp, 1);
        if (!w) return tl_fail_oom("CUDA weight staging");
        for (size_t j = 0; j < R; j++) memcpy(w + j * Kp, s->w8 + j * K, K);
        st = upload(c, (void**)&L->w8, w, Rp * Kp, "int8 weights");
        tl_free(w);
        return st;
    }

    /* int4: the exact split m*w = 128*hi + lo for the tensor cores */
    const size_t gs = s->group_size, ng = K / gs;
    int8_t* hi = (int8_t*)tl_alloc_zeroed(Rp * Kp, 1);
    int8_t* lo = (int8_t*)tl_alloc_zeroed(Rp * Kp, 1);
    if (!hi || !lo) {
        tl_free(hi);
        tl_free(lo);
        return tl_fail_oom("CUDA weight staging");
    }
    for (size_t j = 0; j < R; j++) {
        const uint8_t* w4 = s->w4 + j * (K / 2);
        for (size_t g = 0; g < ng; g++) {
            const int m = s->mult[j * ng + g];
            for (size_t k = g * gs; k < (g + 1) * gs; k++) {
                const int v = m * int4_at(w4, k);                /* in [-2040, 2040] */
                const int l = ((v % 128) + 128 + 64) % 128 - 64; /* v mod 128 in [-64, 64) */
                hi[j * Kp + k] = (int8_t)((v - l) / 128);        /* exact, in [-16, 16] */
                lo[j * Kp + k] = (int8_t)l;
            }
        }
    }
    st = upload(c, (void**)&L->w_hi, hi, Rp * Kp, "int4 weights (high part)");
    if (st == TL_OK) st = upload(c, (void**)&L->w_lo, lo, Rp * Kp, "int4 weights (low part)");
    tl_free(hi);
    tl_free(lo);
    if (st != TL_OK || gs % 8 != 0) return st;

    /* int4, group size a multiple of 8: packed words and their multipliers for the GEMV */
    const size_t nw = K / 8;
    uint32_t* w4 = (uint32_t*)tl_alloc_zeroed(Rp * nw, sizeof(uint32_t));
    uint8_t* m8 = (uint8_t*)tl_alloc_zeroed(Rp * nw, 1);
    if (!w4 || !m8) {
        tl_free(w4);
        tl_free(m8);
        return tl_fail_oom("CUDA weight staging");
    }
    for (size_t j = 0; j < R; j++) {
        const uint8_t* src = s->w4 + j * (K / 2);
        for (size_t wi = 0; wi < nw; wi++) {
            uint32_t word = 0;
            for (uint32_t b = 0; b < 4; b++) {
                const uint32_t e0 = (uint32_t)int4_at(src, wi * 8 + b) & 15u;
                const uint32_t e1 = (uint32_t)int4_at(src, wi * 8 + b + 4) & 15u;
                word |= (e0 | (e1 << 4)) << (8 * b);
            }
            w4[j * nw + wi] = word;
            m8[j * nw + wi] = s->mult[j * ng + wi * 8 / gs];
        }
    }
    st = upload(c, (void**)&L->w4, w4, Rp * nw * sizeof(uint32_t), "int4 weights (packed)");
    if (st == TL_OK) st = upload(c, (void**)&L->m8, m8, Rp * nw, "int4 multipliers");
    tl_free(w4);
    tl_free(m8);
    return st;
}

/* Device copy of the f32 vector src[n] zero-padded to `padded` elements; NULL stays NULL. */
static tl_status upload_vector(tl_cuda* c, float** dst, const float* src, size_t n, size_t padded,
                               const char* what) {
    *dst = NULL;
    if (!src) return TL_OK;
    float* v = (float*)tl_alloc_zeroed(padded, sizeof(float));
    if (!v) return tl_fail_oom("CUDA weight staging");
    memcpy(v, src, n * sizeof(float));
    const tl_status st = upload(c, (void**)dst, v, padded * sizeof(float), what);
    tl_free(v);
    return st;
}

/* Block v's loop gate (loop attention, docs/spec.md §4): w [H][D] i8, s and b [H]; none stays NULL. */
static tl_status upload_loop_gate(tl_cuda* c, tl_cu_block* dst, const tl_block_vectors* v) {
    const size_t H = c->cfg.n_heads;
    if (v->loop_gate_w)
        TL_CU_TRY(upload(c, (void**)&dst->loop_gate_w, v->loop_gate_w, H * c->cfg.head_dim, "loop_gate.w"));
    TL_CU_TRY(upload_vector(c, &dst->loop_gate_s, v->loop_gate_s, H, H, "loop_gate.s"));
    return upload_vector(c, &dst->loop_gate_b, v->loop_gate_b, H, H, "loop_gate.b");
}

static void free_linear(tl_cu_linear* L) {
    cudaFree(L->w8);
    cudaFree(L->w_hi);
    cudaFree(L->w_lo);
    cudaFree(L->w4);
    cudaFree(L->m8);
    cudaFree(L->scale);
    cudaFree(L->bias);
    memset(L, 0, sizeof *L);
}

/* Every block's qkv bias (onto its attn_qkv linear), post-norm gains and loop gate, and the step
 * and coda norm gains. */
static tl_status upload_vectors(tl_cuda* c, const tl_file* f) {
    const tl_config* cfg = &f->cfg;
    const uint32_t n_blocks = tl_n_blocks(cfg);
    const size_t d = cfg->d_model;
    c->blocks = (tl_cu_block*)tl_alloc_zeroed(n_blocks, sizeof *c->blocks);
    if (!c->blocks) return tl_fail_oom("CUDA block vectors");
    for (uint32_t b = 0; b < n_blocks; b++) {
        const tl_block_vectors* v = &f->blocks[b];
        tl_cu_linear* qkv = &c->lin[tl_block_linear_index(b, TL_PART_QKV)];
        TL_CU_TRY(upload_vector(c, &qkv->bias, v->qkv_bias, qkv->rows, qkv->rows_pad, "qkv bias"));
        TL_CU_TRY(upload_vector(c, &c->blocks[b].attn_post_norm, v->attn_post_norm, d, d, "attn_post_norm"));
        TL_CU_TRY(upload_vector(c, &c->blocks[b].ffn_post_norm, v->ffn_post_norm, d, d, "ffn_post_norm"));
        TL_CU_TRY(upload_loop_gate(c, &c->blocks[b], v));
    }
    TL_CU_TRY(upload_vector(c, &c->step_norm, f->step_norm, d, d, "core.step_norm"));
    return upload_vector(c, &c->coda_norm, f->coda_norm, d, d, "coda.input_norm");
}

/* A memory pool for KV blocks that keeps up to POOL_KEEP_BYTES of released memory cached, or
 * NULL (then blocks use cudaMalloc / cudaFree) where the device has no memory pools. */
enum { POOL_KEEP_BYTES = 1 << 30 };

static cudaMemPool_t make_pool(int device) {
    int supported = 0;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess || !supported) {
        (void)cudaGetLastError();
        return NULL;
    }
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = NULL;
    if (cudaMemPoolCreate(&pool, &props) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    uint64_t keep = POOL_KEEP_BYTES;
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
        (void)cudaGetLastError(); /* only a cache size: the pool works without it */
    return pool;
}

static tl_status create(tl_cuda* c, const tl_file* f, int device) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_UNSUPPORTED, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (device < 0 || device >= n)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist (%d found)", device, n);
    const tl_cu_device_guard guard(device);
    TL_CU_TRY(tl_cu_check(guard.error(), "cudaSetDevice"));
    c->device = device;
    cudaDeviceProp prop;
    TL_CU_TRY(tl_cu_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
    snprintf(c->name, sizeof c->name, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
    c->sm_count = prop.multiProcessorCount;
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_UNSUPPORTED, "libtinyloop's CUDA kernels do not run on %s: %s", c->name,
                       cudaGetErrorString(err));
    }
    /* non-blocking: the legacy stream (another model's weight upload) never waits on it, which
     * would fail while it captures a graph */
    TL_CU_TRY(tl_cu_check(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    c->stream_made = true;
    TL_CU_TRY(tl_cu_check(cudaEventCreateWithFlags(&c->captured, cudaEventDisableTiming), "cudaEventCreate"));
    c->event_made = true;
    const char* graphs = getenv("TINYLOOP_CUDA_GRAPHS");
    c->graphs_off = graphs && strcmp(graphs, "0") == 0;
    c->pool = make_pool(device);

    c->cfg = f->cfg;
    const tl_config* cfg = &f->cfg;
    c->n_lin = f->n_linears;
    c->lin = (tl_cu_linear*)tl_alloc_zeroed(c->n_lin, sizeof *c->lin);
    if (!c->lin) return tl_fail_oom("CUDA linears");
    for (size_t i = 0; i < c->n_lin; i++) {
        TL_CU_TRY(upload_linear(c, &f->linears[i], &c->lin[i]));
        const tl_cu_linear* L = &c->lin[i];
        if (L->cols_pad > c->max_cols_pad) c->max_cols_pad = L->cols_pad;
        if (L->group_size && L->rows_pad > c->max_rows_pad_int4) c->max_rows_pad_int4 = L->rows_pad;
        if (i + 1 < c->n_lin && L->rows_pad > c->max_rows_pad_layer) c->max_rows_pad_layer = L->rows_pad;
    }
    TL_CU_TRY(upload_vectors(c, f));
    const tl_cu_linear* head = &c->lin[c->n_lin - 1];
    const size_t V = cfg->vocab_size, d = cfg->d_model;
    if (cfg->tied_head && head->w8) { /* the head is the embedding: look tokens up in it */
        c->emb_w = head->w8;
        c->emb_ld = head->cols_pad;
        c->emb_s = head->scale;
    } else {
        TL_CU_TRY(upload(c, (void**)&c->emb_w_own, f->emb_w, V * d, "embedding"));
        TL_CU_TRY(upload(c, (void**)&c->emb_s_own, f->emb_s, V * sizeof(float), "embedding scales"));
        c->emb_w = c->emb_w_own;
        c->emb_ld = d;
        c->emb_s = c->emb_s_own;
    }
    const size_t rope = (size_t)cfg->max_seq_len * (cfg->head_dim / 2) * sizeof(float);
    TL_CU_TRY(upload(c, (void**)&c->rope_cos, f->rope_cos, rope, "rope.cos"));
    TL_CU_TRY(upload(c, (void**)&c->rope_sin, f->rope_sin, rope, "rope.sin"));
    /* plain cudaMemcpy from pageable memory may return before its DMA lands */
    TL_CU_TRY(tl_cu_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (weights)"));
    if (pthread_mutex_init(&c->lock, NULL) != 0) return tl_fail(TL_ERR_INTERNAL, "CUDA backend: mutex init failed");
    c->lock_made = true;
    if (pthread_mutex_init(&c->capture_lock, NULL) != 0)
        return tl_fail(TL_ERR_INTERNAL, "CUDA backend: mutex init failed");
    c->capture_lock_made = true;
    return TL_OK;
}

extern "C" tl_status tl_cuda_create(const tl_file* file, int device, tl_cuda** out) {
    *out = NULL;
    tl_cuda* c = (tl_cuda*)tl_alloc_zeroed(1, sizeof *c);
    if (!c) return tl_fail_oom("CUDA backend");
    c->device = device;
    const tl_status st = create(c, file, device);
    if (st != TL_OK) {
        tl_cuda_free(c);
        return st;
    }
    *out = c;
    return TL_OK;
}

void tl_cu_scratch_release(tl_cuda* c, tl_cu_buf* b) {
    if (b->p && c->pool) cudaFreeAsync(b->p, c->stream);
    else cudaFree(b->p);
    b->p = NULL;
    b->cap = 0;
}

void tl_cu_graphs_drop(tl_cuda* c) {
    for (size_t i = 0; i < TL_CU_GRAPHS; i++) {
        if (c->graphs[i].exec) cudaGraphExecDestroy(c->graphs[i].exec);
        c->graphs[i].exec = NULL;
    }
}

extern "C" void tl_cuda_free(tl_cuda* c) {
    if (!c) return;
    const tl_cu_device_guard guard(c->device);
    if (c->stream_made) cudaStreamSynchronize(c->stream);
    tl_cu_graphs_drop(c);
    for (size_t i = 0; c->lin && i < c->n_lin; i++) free_linear(&c->lin[i]);
    tl_free(c->lin);
    for (uint32_t b = 0; c->blocks && b < tl_n_blocks(&c->cfg); b++) {
        cudaFree(c->blocks[b].attn_post_norm);
        cudaFree(c->blocks[b].ffn_post_norm);
        cudaFree(c->blocks[b].loop_gate_w);
        cudaFree(c->blocks[b].loop_gate_s);
        cudaFree(c->blocks[b].loop_gate_b);
    }
    tl_free(c->blocks);
    cudaFree(c->step_norm);
    cudaFree(c->coda_norm);
    cudaFree(c->emb_w_own);
    cudaFree(c->emb_s_own);
    cudaFree(c->rope_cos);
    cudaFree(c->rope_sin);
    tl_cu_buf* bufs[] = {&c->x,      &c->qkv,       &c->o,  &c->gu,     &c->acts,   &c->ascale, &c->raw,
                         &c->scores, &c->att_split, &c->io, &c->logits, &c->states, &c->inject, &c->high, &c->sub,
                         &c->xcopy,  &c->o_local};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tl_cu_scratch_release(c, bufs[i]);
    if (c->stream_made) cudaStreamSynchronize(c->stream); /* the pool's frees are done */
    cudaFreeHost(c->host_io.p);
    cudaFreeHost(c->host_out.p);
    cudaFreeHost(c->host_capture.p);
    if (c->event_made) cudaEventDestroy(c->captured);
    if (c->pool) cudaMemPoolDestroy(c->pool);
    if (c->stream_made) cudaStreamDestroy(c->stream);
    if (c->lock_made) pthread_mutex_destroy(&c->lock);
    if (c->capture_lock_made) pthread_mutex_destroy(&c->capture_lock);
    (void)cudaGetLastError(); /* errors while tearing down are not reported */
    tl_free(c);
}

extern "C" size_t tl_cuda_weight_bytes(const tl_cuda* c) { return c ? c->weight_bytes : 0; }

extern "C" const char* tl_cuda_device_name(const tl_cuda* c) { return c ? c->name : ""; }

/* ---- KV block memory -------------------------------------------------------------------------- */

/* Blocks come from c->pool in stream order on c->stream: allocation is cheap (a sequence takes a
 * block every block_size tokens), the zero fill and every later forward run after it on the same
 * stream, and a release takes effect only after the work already queued there (which may still
 * read the block) is done, without synchronizing the device as cudaFree does. Stream-ordered
 * calls from several threads are safe; each sets the device for its own duration. They hold
 * capture_lock so that they never enqueue into a graph capture of tl_cuda_forward (forward.cu). */
static void block_free_locked(tl_cuda* c, void* data) {
    if (c->pool) {
        cudaFreeAsync(data, c->stream);
    } else { /* the stream does not synchronize with the legacy stream: wait for it first */
        cudaStreamSynchronize(c->stream);
        cudaFree(data);
    }
    (void)cudaGetLastError();
}

extern "C" void* tl_cuda_block_alloc(tl_cuda* c, size_t bytes) {
    if (!c || bytes == 0) return NULL;
    const tl_cu_device_guard guard(c->device);
    if (guard.error() != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    void* p = NULL;
    pthread_mutex_lock(&c->capture_lock);
    const cudaError_t err = c->pool ? cudaMallocFromPoolAsync(&p, bytes, c->pool, c->stream) : cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        p = NULL;
    } else if (cudaMemsetAsync(p, 0, bytes, c->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        block_free_locked(c, p);
        p = NULL;
    }
    pthread_mutex_unlock(&c->capture_lock);
    return p;
}

/* One copy between host memory and block data, or between two blocks' data, on the model's
 * stream, waited for. */
static int block_copy(tl_cuda* c, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return 0;
    if (!c) return -1;
    const tl_cu_device_guard guard(c->device);
    if (guard.error() != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    pthread_mutex_lock(&c->capture_lock);
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, c->stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(c->stream);
    pthread_mutex_unlock(&c->capture_lock);
    if (err != cudaSuccess) (void)cudaGetLastError();
    return err == cudaSuccess ? 0 : -1;
}

extern "C" int tl_cuda_block_download(tl_cuda* c, void* host, const void* data, size_t bytes) {
    return block_copy(c, host, data, bytes, cudaMemcpyDeviceToHost);
}

extern "C" int tl_cuda_block_upload(tl_cuda* c, void* data, const void* host, size_t bytes) {
    return block_copy(c, data, host, bytes, cudaMemcpyHostToDevice);
}

extern "C" int tl_cuda_block_copy(tl_cuda* c, void* dst, const void* src, size_t bytes) {
    return block_copy(c, dst, src, bytes, cudaMemcpyDeviceToDevice);
}

extern "C" void tl_cuda_block_free(tl_cuda* c, void* data) {
    if (!c || !data) return;
    const tl_cu_device_guard guard(c->device);
    pthread_mutex_lock(&c->capture_lock);
    block_free_locked(c, data);
    pthread_mutex_unlock(&c->capture_lock);
}
