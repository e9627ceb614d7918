/* rows.cu — the per-token row operations of docs/spec.md §2 and §4 on the device: embedding,
 * Q8 / NQ of activation rows (with act_block their block forms QB / NQB into each token's two
 * digit rows, tl_cu_act_rows), RoPE + the Q8 (int4 KV mode: packed Q4) K/V write into the paged
 * cache, SwiGLU + Q8, the attention gate + Q8, loop attention's gated mix + Q8, the RMSNorm
 * with a gain RN (step norm, coda norm, sandwich and post residuals) or without (a two-state
 * core's closing norms), and the row addition (the injected term into the adapter's output, a
 * two-state core's l + h).
 * One thread block per row (per (row, head) for RoPE/KV); every element-wise f32 step is the
 * host's own numerics.h function, so each value is bit-identical to cpu/quant.c / cpu/forward.c.
 *
 * Shapes: x [T][d], qkv [T][(H + 2G) * D] (Q heads, K heads, V heads; with the attention gate
 * its H * D rows after them), gu [T][2F] (gate, up),
 * activations q [T_pad][lda] i8 (with act_block [2T_pad][lda]; zero from n to lda) with scale [T]. */
#include "common.cuh"

enum { ROW_THREADS = 256, HEAD_THREADS = 128, MAX_HEAD_DIM = 1024 };

/* x[t][i] = ((f32) E[token][i] * es[token]) * embed_scale. grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
embed_kernel(const tl_cuda_row* rows, const int8_t* emb_w, size_t emb_ld, const float* emb_s, float embed_scale,
             int d, float* x) {
    const size_t t = blockIdx.x;
    const size_t tok = (size_t)rows[t].token;
    const int8_t* w = emb_w + tok * emb_ld;
    const float s = emb_s[tok];
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[t * d + i] = ((float)w[i] * s) * embed_scale;
}

/* q[t] = Q8 or NQ of x[t] (QB or NQB with act_block `block`), or with picked of x[picked[t]]
 * (quant.c tl_quantize_row / tl_rms_quantize_row / their block forms). grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
quantize_kernel(const float* x, size_t xs, const uint32_t* picked, int n, int block, int rms, float eps, int8_t* q,
                size_t lda, float* scale) {
    __shared__ float sh[32];
    __shared__ long long sh64[32];
    const size_t t = blockIdx.x;
    const float s = tl_cu_act_rows(x + (picked ? picked[t] : t) * xs, n, block, rms, eps, q, lda, t, sh, sh64);
    if (threadIdx.x == 0) scale[t] = s;
}

/* grid T * (H + 2G): block t * (H + 2G) + hh rotates Q head hh in place (hh < H), or rotates K head
 * hh - H and writes its Q8 (kq, sk) into the row's slot, or writes the Q8 (vq, sv) of V head
 * hh - H - G; with kv_bits 4 the Q4 values instead, packed two per byte (kvcache.h) as
 * cpu/forward.c kv_row does. RoPE as tl_rope_head: two products, then the subtraction / addition. */
static __global__ void __launch_bounds__(HEAD_THREADS)
rope_kv_kernel(const tl_cuda_row* rows, float* qkv, size_t qkv_dim, const float* rope_cos, const float* rope_sin,
               int H, int G, int D, uint32_t layer, uint32_t block_size, size_t head_bytes, uint32_t kv_bits) {
    __shared__ float buf[MAX_HEAD_DIM];
    __shared__ int8_t q4[MAX_HEAD_DIM];
    __shared__ float sh[32];
    const size_t t = blockIdx.x / (unsigned)(H + 2 * G);
    const int hh = (int)(blockIdx.x % (unsigned)(H + 2 * G)), half = D / 2;
    const tl_cuda_row row = rows[t];
    float* z = qkv + t * qkv_dim;
    const float* cs = rope_cos + (size_t)row.pos * half;
    const float* sn = rope_sin + (size_t)row.pos * half;
    if (hh < H + G) {
        float* x = z + (size_t)hh * D;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const float a = x[i], b = x[i + half];
            const float ac = a * cs[i], bs = b * sn[i];
            const float bc = b * cs[i], as = a * sn[i];
            const float y0 = ac - bs, y1 = bc + as;
            if (hh < H) {
                x[i] = y0;
                x[i + half] = y1;
            } else {
                buf[i] = y0;
                buf[i + half] = y1;
            }
        }
        if (hh < H) return; /* the whole block: a query head only rotates */
    } else {
        const float* v = z + (size_t)hh * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) buf[i] = v[i];
    }
    __syncthreads();
    const bool is_key = hh < H + G;
    const int g = is_key ? hh - H : hh - H - G;
    int8_t* base = (int8_t*)row.write_data + ((size_t)layer * G + g) * head_bytes;
    const size_t R = (size_t)D * kv_bits / 8, bsR = (size_t)block_size * R; /* bytes of a row, of a block's rows */
    float* scales = (float*)(base + (2 * bsR + 3) / 4 * 4); /* sk [bs], then sv [bs] (kvcache.h) */
    int8_t* dst = base + (is_key ? 0 : bsR) + (size_t)row.write_slot * R;
    int unused;
    float s;
    if (kv_bits == 8) {
        s = tl_cu_block_q8(buf, D, dst, &unused, sh);
    } else {
        s = tl_cu_block_q(buf, D, 7.0f, q4, &unused, sh);
        __syncthreads(); /* q4 complete */
        for (int i = threadIdx.x; i < D / 2; i += blockDim.x)
            dst[i] = (int8_t)(((unsigned)q4[2 * i] & 15u) | ((unsigned)q4[2 * i + 1] & 15u) << 4);
    }
    if (threadIdx.x == 0) scales[(is_key ? 0 : block_size) + row.write_slot] = s;
}

/* gate := silu(gate) * up, then Q8 (QB) of the gate row (cpu/forward.c task_swiglu). grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
swiglu_kernel(float* gu, int F, int block, int8_t* q, size_t lda, float* scale) {
    __shared__ float sh[32];
    __shared__ long long sh64[32];
    const size_t t = blockIdx.x;
    float* gate = gu + t * 2 * (size_t)F;
    const float* up = gate + F;
    for (int i = threadIdx.x; i < F; i += blockDim.x) gate[i] = tl_silu(gate[i]) * up[i];
    /* its amax's first barrier publishes gate */
    const float s = tl_cu_act_rows(gate, F, block, 0, 0.0f, q, lda, t, sh, sh64);
    if (threadIdx.x == 0) scale[t] = s;
}

/* o[t] := o[t] * sig(gate of row t), the gate rows the last hd of qkv's row (docs/spec.md §4,
 * cpu/forward.c task_attn_gate), then Q8 (QB) of it. grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
attn_gate_kernel(float* o, const float* qkv, size_t qkv_dim, int hd, int block, int8_t* q, size_t lda, float* scale) {
    __shared__ float sh[32];
    __shared__ long long sh64[32];
    const size_t t = blockIdx.x;
    float* ot = o + t * hd;
    const float* z = qkv + t * qkv_dim + qkv_dim - hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ot[i] = ot[i] * tl_sigmoid(z[i]);
    /* its amax's first barrier publishes o */
    const float s = tl_cu_act_rows(ot, hd, block, 0, 0.0f, q, lda, t, sh, sh64);
    if (threadIdx.x == 0) scale[t] = s;
}

/* og[t] := per head h, (g * og) + ((1 - g) * ol) with g = sig(gz), gz = (((f32)(qq . gw[h]) * sq) *
 * gs[h]) + gb[h] over (qq, sq) = Q8 of the row's query head h (docs/spec.md §4, cpu/quant.c
 * tl_loop_mix_row), then Q8 (QB) of it. grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
loop_mix_kernel(float* og, const float* ol, const float* qkv, size_t qkv_dim, const int8_t* gw, const float* gs,
                const float* gb, int H, int D, int block, int8_t* q, size_t lda, float* scale) {
    __shared__ int8_t qq[MAX_HEAD_DIM];
    __shared__ float sh[32];
    __shared__ long long sh64[32];
    const size_t t = blockIdx.x;
    const size_t hd = (size_t)H * D;
    float* ot = og + t * hd;
    const float* lt = ol + t * hd;
    for (int h = 0; h < H; h++) {
        int unused;
        const float sq = tl_cu_block_q8(qkv + t * qkv_dim + (size_t)h * D, D, qq, &unused, sh);
        long long part = 0;
        for (int d = threadIdx.x; d < D; d += blockDim.x) part += (long long)qq[d] * gw[(size_t)h * D + d];
        const float g = tl_loop_gate(tl_cu_block_sum(part, sh64), sq, gs[h], gb[h]), rest = 1.0f - g;
        for (int d = threadIdx.x; d < D; d += blockDim.x)
            ot[(size_t)h * D + d] = tl_loop_mix(g, rest, ot[(size_t)h * D + d], lt[(size_t)h * D + d]);
    }
    __syncthreads(); /* og complete: the Q8 reads its elements in another order than the heads wrote them */
    const float s = tl_cu_act_rows(ot, (int)hd, block, 0, 0.0f, q, lda, t, sh, sh64);
    if (threadIdx.x == 0) scale[t] = s;
}

/* dst[t] = RN(src[t], g), or dst[t] + RN(src[t], g) with add (quant.c tl_rms_norm_row): Q16 of
 * the row (amax from 0 ignoring NaN, the tiny-row rule, r = 32767 / amax), the exact i64 Σ q²,
 * t = tl_rms_of, then (x_i / t) * g_i (g NULL: x_i / t). dst may be src: every thread reads and writes only its own
 * elements (i = threadIdx.x mod blockDim.x), and the reductions share nothing else. grid T. */
static __global__ void __launch_bounds__(ROW_THREADS)
rms_norm_kernel(const float* src, const float* g, int n, float eps, int add, float* dst) {
    __shared__ float sh[32];
    __shared__ long long sh64[32];
    const float* x = src + (size_t)blockIdx.x * n;
    float* y = dst + (size_t)blockIdx.x * n;
    const float amax = tl_cu_block_amax(x, n, sh); /* the same for every thread */
    long long ss = 0;
    float s = 0.0f;                                /* a tiny row: q = 0, s = 0 */
    if (!(amax < TL_CU_TINY_ROW)) {
        const float qmax = 32767.0f, r = qmax / amax;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const long long q = tl_cu_quantize_one(x[i], r, qmax);
            ss += q * q;
        }
        s = amax / qmax;
    }
    ss = tl_cu_block_sum(ss, sh64);
    const float t = tl_rms_of(ss, s, (size_t)n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = g ? (x[i] / t) * g[i] : x[i] / t;
        y[i] = add ? y[i] + v : v;
    }
}

/* x[t][i] = x[t][i] + v[t][i]. grid T. */
static __global__ void __launch_bounds__(ROW_THREADS) add_rows_kernel(float* x, const float* v, int d) {
    const size_t row = (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[row + i] = x[row + i] + v[row + i];
}

/* ---- launch wrappers ------------------------------------------------------------------------- */

tl_status tl_cu_embed(tl_cuda* c, const tl_cuda_row* rows, size_t T, float* x) {
    TL_CU_LAUNCH(embed_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (rows, c->emb_w, c->emb_ld, c->emb_s, c->cfg.embed_scale, (int)c->cfg.d_model, x);
    return tl_cu_launched("embedding kernel");
}

tl_status tl_cu_quantize(tl_cuda* c, const float* x, size_t xs, size_t n, size_t T, bool rms, int8_t* q,
                         size_t lda, float* scale) {
    return tl_cu_quantize_picked(c, x, xs, NULL, n, T, rms, q, lda, scale);
}

tl_status tl_cu_quantize_picked(tl_cuda* c, const float* x, size_t xs, const uint32_t* picked, size_t n, size_t T,
                                bool rms, int8_t* q, size_t lda, float* scale) {
    TL_CU_LAUNCH(quantize_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (x, xs, picked, (int)n, (int)c->cfg.act_block, rms ? 1 : 0, c->cfg.rms_eps, q, lda, scale);
    return tl_cu_launched(rms ? "NQ kernel" : "Q8 kernel");
}

tl_status tl_cu_rope_kv(tl_cuda* c, const tl_cuda_row* rows, size_t T, float* qkv, uint32_t layer,
                        uint32_t block_size, size_t head_bytes, uint32_t kv_bits) {
    const tl_config* cfg = &c->cfg;
    if (cfg->head_dim > MAX_HEAD_DIM)
        return tl_fail(TL_ERR_INTERNAL, "CUDA backend: head_dim %u > %d", cfg->head_dim, (int)MAX_HEAD_DIM);
    const size_t qkv_dim = tl_qkv_rows(cfg);
    const size_t blocks = T * (cfg->n_heads + 2 * (size_t)cfg->n_kv_heads);
    if (blocks > 0x7fffffffu) return tl_fail(TL_ERR_INTERNAL, "CUDA backend: %zu rows is too many", T);
    const unsigned grid = (unsigned)blocks;
    TL_CU_LAUNCH(rope_kv_kernel, grid, HEAD_THREADS, 0, c->stream)
    (rows, qkv, qkv_dim, c->rope_cos, c->rope_sin, (int)cfg->n_heads, (int)cfg->n_kv_heads, (int)cfg->head_dim, layer,
     block_size, head_bytes, kv_bits);
    return tl_cu_launched("RoPE / KV write kernel");
}

tl_status tl_cu_swiglu_q8(tl_cuda* c, float* gu, size_t T, int8_t* q, size_t lda, float* scale) {
    TL_CU_LAUNCH(swiglu_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (gu, (int)c->cfg.ffn_dim, (int)c->cfg.act_block, q, lda, scale);
    return tl_cu_launched("SwiGLU kernel");
}

tl_status tl_cu_attn_gate_q8(tl_cuda* c, float* o, const float* qkv, size_t T, int8_t* q, size_t lda, float* scale) {
    const tl_config* cfg = &c->cfg;
    TL_CU_LAUNCH(attn_gate_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (o, qkv, tl_qkv_rows(cfg), (int)(cfg->n_heads * cfg->head_dim), (int)cfg->act_block, q, lda, scale);
    return tl_cu_launched("attention gate kernel");
}

tl_status tl_cu_loop_mix_q8(tl_cuda* c, float* og, const float* ol, const float* qkv, const tl_cu_block* b, size_t T,
                            int8_t* q, size_t lda, float* scale) {
    const tl_config* cfg = &c->cfg;
    if (cfg->head_dim > MAX_HEAD_DIM)
        return tl_fail(TL_ERR_INTERNAL, "CUDA backend: head_dim %u > %d", cfg->head_dim, (int)MAX_HEAD_DIM);
    TL_CU_LAUNCH(loop_mix_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (og, ol, qkv, tl_qkv_rows(cfg), b->loop_gate_w, b->loop_gate_s, b->loop_gate_b, (int)cfg->n_heads,
     (int)cfg->head_dim, (int)cfg->act_block, q, lda, scale);
    return tl_cu_launched("loop attention kernel");
}

tl_status tl_cu_rms_norm(tl_cuda* c, const float* src, const float* gain, size_t T, float* dst, bool add) {
    if (T == 0) return TL_OK;
    TL_CU_LAUNCH(rms_norm_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)
    (src, gain, (int)c->cfg.d_model, c->cfg.rms_eps, add ? 1 : 0, dst);
    return tl_cu_launched("RN kernel");
}

tl_status tl_cu_add_rows(tl_cuda* c, float* x, const float* v, size_t T) {
    if (T == 0) return TL_OK;
    TL_CU_LAUNCH(add_rows_kernel, (unsigned)T, ROW_THREADS, 0, c->stream)(x, v, (int)c->cfg.d_model);
    return tl_cu_launched("row addition kernel");
}
