/* common.cuh — internals shared by the CUDA backend's files (src/cuda/): the device state
 * behind tl_cuda, the device layout of each linear, CUDA error -> tl_status, the guard that
 * restores the caller's current device, block-wide reductions and the Q8 row quantizer as
 * device functions, and the launch wrappers.
 *
 * Exactness: device code is compiled with -fmad=false -prec-div=true -prec-sqrt=true
 * -ftz=false and no fast math, and calls the host's own primitives (numerics.h, TL_HD), so each
 * f32 operation is the spec's single correctly rounded op. Reductions here are either exact
 * integer sums or maxima of non-NaN values, whose result does not depend on the order.
 *
 * Device layouts (all zero-padded; padding never reaches an output):
 *   activations  q [T_pad][cols_pad] i8, T_pad = T rounded up to TL_CU_TILE_M, with a scale [T];
 *                with act_block (block activations, docs/spec.md §2.2.1, §3) each token's two
 *                digit rows, p = 255 * h + l: h in row 2t, l in row 2t + 1 (T_pad from 2T)
 *   int8 linear  w8 [rows_pad][cols_pad] i8, scale [rows_pad] f32
 *   int4 linear  w_hi, w_lo [rows_pad][cols_pad] i8 with m*w = 128*hi + lo (tensor-core GEMM),
 *                and, when group_size % 8 == 0, w4 [rows_pad][cols/8] u32 (8 elements a word:
 *                byte b holds element b in its low nibble and element b+4 in its high nibble)
 *                with m8 [rows_pad][cols/8] u8 (the group multiplier of each word) for GEMV
 *   bias         [rows_pad] f32 (attn_qkv with qkv_bias), added after the row scale
 *   gains        [d] f32 per vector (tl_cu_block's, step_norm, coda_norm)
 *   loop gate    w [H][D] i8, s [H] f32, b [H] f32 per core block (loop attention) */
#ifndef TL_CUDA_COMMON_CUH
#define TL_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda/device.h"
#include "core/numerics.h"

extern "C" {
#include "base/errors.h"
}

/* A kernel launch kernel<<<grid, block, shmem, stream>>>(args...), written
 * TL_CU_LAUNCH(kernel, grid, block, shmem, stream)(args...): the one form that both nvcc and the
 * tests' CPU emulation of the device (tests/cuda_emu/, whose cuda_runtime.h defines it first)
 * compile. */
#ifndef TL_CU_LAUNCH
#define TL_CU_LAUNCH(kernel, grid, block, shmem, stream) kernel<<<grid, block, shmem, stream>>>
#endif

enum {
    TL_CU_TILE_M = 128,    /* tokens per tensor-core tile: activation rows are padded to it   */
    TL_CU_TILE_N = 128,    /* output rows per tile: weight rows are padded to it               */
    TL_CU_TILE_K = 64,     /* k per step: weight and activation columns are padded to it       */
    TL_CU_GEMV_MAX_T = 16, /* fewer tokens than this run the dp4a GEMV kernels (decode)        */
    TL_CU_GRAPH_MAX_T = 16, /* passes of at most this many rows replay a CUDA graph (forward.cu) */
    TL_CU_GRAPHS = 8       /* executable graphs kept per model, one per pass shape             */
};

/* 2^-64 (0x1f800000), the "tiny row" threshold of every Q(x, qmax) (Q8, Q16), written as
 * quant.c writes it. */
#define TL_CU_TINY_ROW 5.421010862427522e-20f

/* One linear in device memory (see the layouts above). */
typedef struct tl_cu_linear {
    uint32_t rows, cols;          /* R, K                                     */
    uint32_t rows_pad, cols_pad;  /* R up to TL_CU_TILE_N, K up to TL_CU_TILE_K */
    uint32_t group_size;          /* 0 = int8                                 */
    int8_t* w8;                   /* int8 only                                */
    int8_t* w_hi;                 /* int4 only                                */
    int8_t* w_lo;                 /* int4 only                                */
    uint32_t* w4;                 /* int4 with group_size % 8 == 0, else NULL */
    uint8_t* m8;                  /* with w4                                  */
    float* scale;                 /* [rows_pad]                               */
    float* bias;                  /* [rows_pad], or NULL                      */
} tl_cu_linear;

/* The gains of one block's sandwich / post placement in device memory (NULL for pre). */
typedef struct tl_cu_block {
    float* attn_post_norm;        /* [d]                                      */
    float* ffn_post_norm;         /* [d]                                      */
    int8_t* loop_gate_w;          /* [H][D] a core block's loop gate (loop_window >= 1) */
    float* loop_gate_s;           /* [H]                                      */
    float* loop_gate_b;           /* [H]                                      */
} tl_cu_block;

/* A grow-on-demand device (or pinned host) buffer. */
typedef struct tl_cu_buf {
    void* p;
    size_t cap;
} tl_cu_buf;

/* Everything of a pass that its launches take as arguments (forward.cu): two passes of one shape
 * make the same launches with the same arguments, given the same scratch. */
typedef struct tl_cu_pass_shape {
    uint32_t T;
    uint32_t key_stride;                /* row stride of the scores scratch (> every row's pos) */
    uint32_t block_size;
    size_t head_bytes;
    uint32_t kv_bits;                   /* 8, or 4: packed Q4 KV rows                           */
    uint32_t loops;                     /* of the deepest row (row 0)                           */
    uint32_t first_iter, coda_depth;    /* the part of the pass it runs (tl_cuda_batch's)       */
    uint32_t outputs;                   /* which outputs the pass copies back (forward.cu)      */
    uint32_t n_logit_rows;              /* rows whose logits it computes, with logit_rows       */
    uint32_t depth[TL_CU_GRAPH_MAX_T];  /* each row's loops (graph passes; 0 beyond T)          */
} tl_cu_pass_shape;

/* One cached executable graph and the shape it was captured for. */
typedef struct tl_cu_graph {
    tl_cu_pass_shape shape;
    cudaGraphExec_t exec;               /* NULL = free slot                                     */
    uint64_t used;                      /* c->graph_clock at its last launch                    */
} tl_cu_graph;

/* Makes `device` the calling thread's current device for the guard's lifetime, then restores the
 * one that was current before: no library call changes the caller's current device. */
class tl_cu_device_guard {
  public:
    explicit tl_cu_device_guard(int device) {
        if (cudaGetDevice(&prev_) != cudaSuccess) {
            (void)cudaGetLastError();
            prev_ = -1;
        }
        err_ = prev_ == device ? cudaSuccess : cudaSetDevice(device);
        restore_ = err_ == cudaSuccess && prev_ >= 0 && prev_ != device;
    }
    ~tl_cu_device_guard() {
        if (restore_ && cudaSetDevice(prev_) != cudaSuccess) (void)cudaGetLastError();
    }
    tl_cu_device_guard(const tl_cu_device_guard&) = delete;
    tl_cu_device_guard& operator=(const tl_cu_device_guard&) = delete;
    cudaError_t error() const { return err_; }

  private:
    int prev_;
    cudaError_t err_;
    bool restore_;
};

struct tl_cuda {
    int device;
    cudaStream_t stream;
    pthread_mutex_t lock;         /* serializes tl_cuda_forward and guards the scratch below */
    bool lock_made, stream_made;
    cudaMemPool_t pool;           /* KV blocks and scratch (stream-ordered on `stream`); NULL = cudaMalloc */
    tl_config cfg;
    tl_cu_linear* lin;            /* like tl_file.linears: tl_block_linear_index, the adapter, the head */
    size_t n_lin;
    tl_cu_block* blocks;          /* [tl_n_blocks(cfg)]                                     */
    float* step_norm;             /* [d] gain of core.step_norm, or NULL                    */
    float* coda_norm;             /* [d] gain of coda.input_norm, or NULL                   */
    const int8_t* emb_w;          /* [V][emb_ld]: own upload, or the tied head's w8        */
    size_t emb_ld;
    const float* emb_s;           /* [V]                                                    */
    int8_t* emb_w_own;
    float* emb_s_own;
    float* rope_cos;              /* [max_seq_len][D/2]                                     */
    float* rope_sin;
    size_t weight_bytes;
    uint32_t max_cols_pad;        /* widest activation row of any linear                    */
    uint32_t max_rows_pad_int4;   /* widest int4 output (raw scratch of the two-pass GEMM)   */
    uint32_t max_rows_pad_layer;  /* widest output of a block's or the adapter's linear (raw
                                     scratch of the digit rows, act_block)                    */
    char name[320];
    int sm_count;                 /* multiprocessors: how far decode attention splits       */
    /* scratch of tl_cuda_forward (device, from `pool` when there is one, unless noted) */
    tl_cu_buf x, qkv, o, gu, acts, ascale, raw, scores, att_split, io, logits, states;
    tl_cu_buf o_local;            /* [T][H * D] loop attention: the local attention's output */
    tl_cu_buf inject;             /* [T][d] the injected term linear(adapter_inject; Q8(e)),
                                     or a two-state core's low state l                      */
    tl_cu_buf high;               /* [T][d] a two-state core: h while the stacks run on x   */
    tl_cu_buf sub;                /* [T][d] a sublayer's output before its norm (sandwich)  */
    tl_cu_buf xcopy;              /* [T][d] the state a prefix build's coda runs on         */
    tl_cu_buf host_io;            /* pinned host staging of rows + spans (and a resumed
                                     part's states and injected terms)                      */
    tl_cu_buf host_out;           /* pinned host staging of the outputs                     */
    tl_cu_buf host_capture;       /* pinned host [T][d]: a block's input rows (a prefix build
                                     capturing them, docs/spec.md §5.4.1)                   */
    cudaEvent_t captured;         /* recorded after the copy into host_capture              */
    bool event_made;
    /* CUDA graphs of decode passes (forward.cu), guarded by `lock` */
    tl_cu_graph graphs[TL_CU_GRAPHS];
    uint64_t graph_clock;
    bool graphs_off;              /* TINYLOOP_CUDA_GRAPHS=0, or a graph call failed once    */
    pthread_mutex_t capture_lock; /* held while `stream` captures and by the KV block calls */
    bool capture_lock_made;
};

/* ---- errors ------------------------------------------------------------------------------- */

/* TL_OK, or the failure of CUDA call `what`: TL_ERR_OUT_OF_MEMORY for an allocation failure,
 * else TL_ERR_INTERNAL naming `what` and cudaGetErrorString. Clears the runtime's last error. */
tl_status tl_cu_check(cudaError_t err, const char* what);
/* tl_cu_check of cudaGetLastError() after launching kernel `what`. */
tl_status tl_cu_launched(const char* what);

/* ---- scratch (device.cu) ------------------------------------------------------------------ */

/* Release device scratch b (stream-ordered on c->stream when it came from c->pool); b empty. */
void tl_cu_scratch_release(tl_cuda* c, tl_cu_buf* b);
/* Destroy every cached graph of c (the stream is idle). */
void tl_cu_graphs_drop(tl_cuda* c);

#define TL_CU_TRY(expr)                 \
    do {                                \
        const tl_status st_ = (expr);   \
        if (st_ != TL_OK) return st_;   \
    } while (0)

/* ---- block-wide helpers (every thread of the block calls them; blockDim.x % 32 == 0) -------- */

/* Maximum of the threads' v, none NaN, combined as (x > m) ? x : m. `sh` is __shared__ [32].
 * (For NaN-free inputs this is tl_fmax's result up to the sign of a zero, which no caller's
 * output depends on: see cpu/attention_kernels.h.) */
static __device__ __forceinline__ float tl_cu_block_max(float v, float* sh) {
    for (int off = 16; off > 0; off >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, off);
        v = other > v ? other : v;
    }
    __syncthreads(); /* a previous call may still be reading sh */
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = sh[0];
    for (unsigned w = 1; w < blockDim.x / 32; w++) m = sh[w] > m ? sh[w] : m;
    return m;
}

/* Exact sum of the threads' v. `sh` is __shared__ [32]. */
static __device__ __forceinline__ long long tl_cu_block_sum(long long v, long long* sh) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    long long s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; w++) s += sh[w];
    return s;
}

/* docs/spec.md §2.2 step 1 by the whole block: max |x_i| of x[0 .. n) from 0, ignoring NaN, to
 * every thread. `sh` is __shared__ [32]. */
static __device__ __forceinline__ float tl_cu_block_amax(const float* x, int n, float* sh) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = fabsf(x[i]);
        m = v > m ? v : m; /* a NaN never compares greater */
    }
    return tl_cu_block_max(m, sh);
}

/* docs/spec.md §2.2 step 4 of one element: rint(clamp(x * r, -qmax, qmax)). */
static __device__ __forceinline__ int tl_cu_quantize_one(float x, float r, float qmax) {
    return (int)tl_rint_small(tl_clamp(x * r, -qmax, qmax));
}

/* docs/spec.md §2.2 with qmax (127: Q8, 7: Q4) of x[0 .. n) (global or shared) into q[0 .. n),
 * by the whole block, as tl_quantize_row: amax, the tiny-row rule, r = qmax / amax,
 * q = rint(clamp(x * r)). Returns the scale s to every thread; *sumsq is this thread's share of
 * Σ q² (exact; the caller sums it over the block for NQ). `sh` is __shared__ [32]. */
static __device__ __forceinline__ float tl_cu_block_q(const float* x, int n, float qmax, int8_t* q, int* sumsq,
                                                      float* sh) {
    const float amax = tl_cu_block_amax(x, n, sh);
    int ss = 0;
    if (amax < TL_CU_TINY_ROW) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) q[i] = 0;
        *sumsq = 0;
        return 0.0f;
    }
    const float r = qmax / amax;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int v = tl_cu_quantize_one(x[i], r, qmax);
        q[i] = (int8_t)v;
        ss += v * v;
    }
    *sumsq = ss;
    return amax / qmax;
}

/* Q8: tl_cu_block_q with qmax 127. */
static __device__ __forceinline__ float tl_cu_block_q8(const float* x, int n, int8_t* q, int* sumsq, float* sh) {
    return tl_cu_block_q(x, n, 127.0f, q, sumsq, sh);
}

/* docs/spec.md §2.2.1 QB(x, B) of x[0 .. n) (B divides n) by the whole block, as quant.c's
 * tl_block_quantize_row, its p split into the digit rows hi, lo (tl_split_digits, §3): amax, the
 * tiny-row rule, u and v; then warp w takes blocks w, w + warps, ...: amax_b over the warp, m_b,
 * r_b = v / m_b, p = m_b * rint(clamp(x * r_b)). Returns s to every thread; *sumsq is this
 * thread's share of Σ p² (exact). `sh` is __shared__ [32]. */
static __device__ __forceinline__ float tl_cu_block_qb(const float* x, int n, int B, int8_t* hi, int8_t* lo,
                                                       long long* sumsq, float* sh) {
    const float amax = tl_cu_block_amax(x, n, sh);
    if (amax < TL_CU_TINY_ROW) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) hi[i] = lo[i] = 0;
        *sumsq = 0;
        return 0.0f;
    }
    const float u = 255.0f / amax, v = TL_BLOCK_QMAX / amax;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    long long ss = 0;
    for (int b0 = (threadIdx.x >> 5) * B; b0 < n; b0 += warps * B) { /* warp-uniform */
        float m = 0.0f;
        for (int i = b0 + lane; i < b0 + B; i += 32) {
            const float a = fabsf(x[i]);
            m = a > m ? a : m; /* a NaN never compares greater */
        }
        for (int off = 16; off > 0; off >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, m, off);
            m = other > m ? other : m;
        }
        const int mult = tl_block_multiplier(m, u);
        const float r = v / (float)mult;
        for (int i = b0 + lane; i < b0 + B; i += 32) {
            const int p = mult * tl_cu_quantize_one(x[i], r, 127.0f), h = tl_digit_high(p);
            hi[i] = (int8_t)h;
            lo[i] = (int8_t)(p - 255 * h);
            ss += (long long)p * p;
        }
    }
    *sumsq = ss;
    return amax / TL_BLOCK_QMAX;
}

/* Token t's activation rows from x[0 .. n) (docs/spec.md §4) by the whole block: Q8 (rms: NQ)
 * into row t of q, or with act_block `block` >= 1 QB (NQB) into its digit rows 2t and 2t + 1
 * (tl_cu_block_qb); zero from n to lda. Returns the scale (s, or NQ's a with rms) to every
 * thread. `sh` and `sh64` are __shared__ [32]. */
static __device__ __forceinline__ float tl_cu_act_rows(const float* x, int n, int block, int rms, float eps,
                                                       int8_t* q, size_t lda, size_t t, float* sh, long long* sh64) {
    const size_t rows = block ? 2 : 1;
    int8_t* qt = q + t * rows * lda;
    for (size_t r = 0; r < rows; r++)
        for (size_t i = (size_t)n + threadIdx.x; i < lda; i += blockDim.x) qt[r * lda + i] = 0;
    long long ss_part;
    float s;
    if (block) {
        s = tl_cu_block_qb(x, n, block, qt, qt + lda, &ss_part, sh);
    } else {
        int part;
        s = tl_cu_block_q8(x, n, qt, &part, sh);
        ss_part = part;
    }
    if (!rms) return s;
    return tl_nq_scale(tl_cu_block_sum(ss_part, sh64), s, (size_t)n, eps);
}

/* The signed nibble of packed Q4 byte b (kvcache.h): the low one for hi == 0, else the high one. */
static __device__ __forceinline__ int tl_cu_nibble(unsigned b, int hi) {
    return (int)(b << (28 - 4 * hi)) >> 28;
}

static inline size_t tl_cu_round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* ---- launch wrappers (all on c->stream; they check the launch) ----------------------------- */

/* rows.cu */
/* x[t][0 .. d) = embedding of rows[t].token times embed_scale, t < T. */
tl_status tl_cu_embed(tl_cuda* c, const tl_cuda_row* rows, size_t T, float* x);
/* q[t][0 .. lda) = Q8 (rms: NQ) of x[t * xs .. + n), zero beyond n; scale[t] = s (rms: a); with
 * act_block their block forms QB (NQB) into the digit rows 2t and 2t + 1 (tl_cu_act_rows). The
 * row kernels below quantize their outputs the same way. */
tl_status tl_cu_quantize(tl_cuda* c, const float* x, size_t xs, size_t n, size_t T, bool rms, int8_t* q,
                         size_t lda, float* scale);
/* The same of rows picked[t] of x (device memory [T]) into q[t], scale[t]. */
tl_status tl_cu_quantize_picked(tl_cuda* c, const float* x, size_t xs, const uint32_t* picked, size_t n, size_t T,
                                bool rms, int8_t* q, size_t lda, float* scale);
/* RoPE of every Q head in place in qkv [T][(H + 2G) * D], RoPE of each K head, then Q8 (kv_bits
 * 4: Q4, packed) of the K and V heads into each row's cache slot of `layer`. */
tl_status tl_cu_rope_kv(tl_cuda* c, const tl_cuda_row* rows, size_t T, float* qkv, uint32_t layer,
                        uint32_t block_size, size_t head_bytes, uint32_t kv_bits);
/* gu [T][2F]: gate := silu(gate) * up (in place), then q[t] = Q8(gate), scale[t] = s. */
tl_status tl_cu_swiglu_q8(tl_cuda* c, float* gu, size_t T, int8_t* q, size_t lda, float* scale);
/* o [T][H * D]: o := o * sig(gate) (in place; the gate rows end each row of qkv [T][qkv_dim],
 * docs/spec.md §4), then q[t] = Q8(o), scale[t] = s. */
tl_status tl_cu_attn_gate_q8(tl_cuda* c, float* o, const float* qkv, size_t T, int8_t* q, size_t lda, float* scale);
/* Loop attention's mix (docs/spec.md §4): og [T][H * D] := per head h the gate g of the row's
 * quantized query head h in qkv and block b's loop gate, g * og + (1 - g) * ol (ol [T][H * D]),
 * then q[t] = Q8(og), scale[t] = s. */
tl_status tl_cu_loop_mix_q8(tl_cuda* c, float* og, const float* ol, const float* qkv, const tl_cu_block* b, size_t T,
                            int8_t* q, size_t lda, float* scale);
/* dst[t] = RN(src[t], gain) (docs/spec.md §2.7; gain NULL: the weightless RN(x)), or dst[t] +
 * RN(src[t], gain) when add, rows t < T of d floats; dst may be src. */
tl_status tl_cu_rms_norm(tl_cuda* c, const float* src, const float* gain, size_t T, float* dst, bool add);
/* x[t][i] = x[t][i] + v[t][i], rows t < T of d floats (one f32 addition each). */
tl_status tl_cu_add_rows(tl_cuda* c, float* x, const float* v, size_t T);

/* gemm.cu */
/* y[t][j] (stride ys) = or += ((f32)acc * scale[t]) * L->scale[j] (+ L->bias[j]), t < T, j < R, from the
 * activations q [T_pad][L->cols_pad], or with digits (block inputs) from each token's two digit
 * rows of q [2T_pad][L->cols_pad]. int4 linears of T >= TL_CU_GEMV_MAX_T (or without w4) use
 * `raw` ([T_pad][L->rows_pad] i32) as scratch, and digits ([2T][L->rows_pad]) always. */
tl_status tl_cu_linear_run(tl_cuda* c, const tl_cu_linear* L, const int8_t* q, const float* scale, size_t T,
                           float* y, size_t ys, bool accumulate, int32_t* raw, bool digits);

/* attention.cu */
/* o [T][H * D] = attention (docs/spec.md §4.1) of each row's rotated query heads in qkv over
 * cache layer `layer`, each row's keys seen through its window or, with loop_window (loop
 * attention's local one, §4), through tl_loop_local_window(its window, loop_window); `scores`
 * holds score_rows * H * key_stride floats (rows go in chunks; key_stride > every row's pos),
 * `split_scratch` tl_cu_attention_split_bytes (NULL when 0). */
tl_status tl_cu_attention(tl_cuda* c, const tl_cuda_row* rows, const tl_cuda_span* spans, size_t T,
                          const float* qkv, float* o, uint32_t layer, uint32_t loop_window, uint32_t block_size,
                          size_t head_bytes, uint32_t kv_bits, uint32_t key_stride, float* scores, size_t score_rows,
                          void* split_scratch);
/* Rows per attention launch (at most T) whose scores fit the scratch cap: the `score_rows` to
 * size `scores` with. */
size_t tl_cu_attention_rows(const tl_cuda* c, size_t T, uint32_t key_stride);
/* Key ranges each (row, head) of a T-row pass is split into (1: one block per (row, head)). */
uint32_t tl_cu_attention_splits(const tl_cuda* c, size_t T);
/* Bytes of tl_cu_attention's split scratch for a T-row pass in launches of score_rows rows. */
size_t tl_cu_attention_split_bytes(const tl_cuda* c, size_t T, size_t score_rows);

#endif
