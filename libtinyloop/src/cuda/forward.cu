/* forward.cu — tl_cuda_forward: one forward pass (docs/spec.md §4) of a batch of rows on the
 * device, in forward.c's order. One copy of rows + spans to the device, then only launches on
 * c->stream (no host round trip per layer), then the outputs back and one synchronization.
 *
 * Per layer l (pre block l, or the loop block), on the active rows (n_layers > l: a prefix,
 * rows being ordered deepest first):
 *   NQ(x) -> qkv linear -> RoPE + K/V write (every active row, before any attention reads)
 *   -> attention -> Q8(o) -> out linear (x +=) -> NQ(x) -> gate_up linear -> SwiGLU + Q8
 *   -> down linear (x +=); after a loop layer, the last active row's x -> loop_states.
 * Then hidden = x, and logits = head(NQ(x)) of every row when asked for.
 *
 * Scratch (grow-on-demand, owned by tl_cuda, guarded by its lock): x [T][d],
 * qkv [T][(H + 2G) * D], o [T][H * D], gu [T][2F], acts [T_pad][max cols_pad] i8, ascale [T],
 * raw [T_pad][max int4 rows_pad] i32, scores [rows per launch][H][max_keys], io (rows + spans),
 * logits [T][V], states [loops][d]; host_io (pinned) stages rows + spans. */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

/* Make b hold at least `bytes` (contents not kept). The stream is idle when this runs. */
static tl_status reserve(tl_cu_buf* b, size_t bytes, bool pinned_host, const char* what) {
    if (bytes <= b->cap) return TL_OK;
    size_t cap = b->cap + b->cap / 2;
    if (cap < bytes) cap = bytes;
    cap = tl_cu_round_up(cap, 4096);
    if (pinned_host) cudaFreeHost(b->p);
    else cudaFree(b->p);
    b->p = NULL;
    b->cap = 0;
    const cudaError_t err = pinned_host ? cudaMallocHost(&b->p, cap) : cudaMalloc(&b->p, cap);
    if (err != cudaSuccess) {
        b->p = NULL;
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "out of memory (CUDA scratch: %s, %zu bytes)", what, cap);
    }
    b->cap = cap;
    return TL_OK;
}

static const tl_cu_linear* layer_linear(const tl_cuda* c, uint32_t layer, int part) {
    const uint32_t n_pre = c->cfg.n_pre_blocks;
    const uint32_t block = layer < n_pre ? layer : n_pre;
    return &c->lin[(size_t)block * TL_PARTS + (size_t)part];
}

static tl_status check_batch(const tl_cuda* c, const tl_cuda_batch* b, uint32_t* max_keys) {
    const tl_config* cfg = &c->cfg;
    uint32_t keys = b->max_keys;
    for (size_t t = 0; t < b->T; t++) {
        const tl_cuda_row* r = &b->rows[t];
        if (r->token < 0 || (uint32_t)r->token >= cfg->vocab_size || r->pos >= cfg->max_seq_len || !r->write_data ||
            r->write_slot >= b->block_size || (size_t)r->first_span + r->n_spans > b->n_spans ||
            (t > 0 && r->n_layers > b->rows[t - 1].n_layers))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: bad row %zu (token %d, position %u)", t,
                           (int)r->token, r->pos);
        if (r->pos + 1 > keys) keys = r->pos + 1;
    }
    if (b->block_size == 0 || (b->n_spans && !b->spans))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: bad span table");
    *max_keys = keys;
    return TL_OK;
}

static tl_status forward_locked(tl_cuda* c, const tl_cuda_batch* b) {
    const tl_config* cfg = &c->cfg;
    const size_t T = b->T, d = cfg->d_model, H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    const size_t F = cfg->ffn_dim, V = cfg->vocab_size, n_pre = cfg->n_pre_blocks;
    const size_t qkv_dim = (H + 2 * G) * D, hd = H * D;
    uint32_t max_keys = 0;
    TL_CU_TRY(check_batch(c, b, &max_keys));
    TL_CU_TRY(tl_cu_check(cudaSetDevice(c->device), "cudaSetDevice"));

    const size_t n_layers = b->rows[0].n_layers;
    const size_t loops = n_layers > n_pre ? n_layers - n_pre : 0;
    const size_t T_pad = tl_cu_round_up(T, TL_CU_TILE_M);
    const size_t score_rows = tl_cu_attention_rows(c, T, max_keys);
    const size_t rows_bytes = tl_cu_round_up(T * sizeof(tl_cuda_row), 64);
    const size_t io_bytes = rows_bytes + b->n_spans * sizeof(tl_cuda_span);
    TL_CU_TRY(reserve(&c->x, T * d * sizeof(float), false, "x"));
    TL_CU_TRY(reserve(&c->qkv, T * qkv_dim * sizeof(float), false, "qkv"));
    TL_CU_TRY(reserve(&c->o, T * hd * sizeof(float), false, "attention output"));
    TL_CU_TRY(reserve(&c->gu, T * 2 * F * sizeof(float), false, "gate/up"));
    TL_CU_TRY(reserve(&c->acts, T_pad * c->max_cols_pad, false, "activations"));
    TL_CU_TRY(reserve(&c->ascale, T * sizeof(float), false, "activation scales"));
    if (c->max_rows_pad_int4)
        TL_CU_TRY(reserve(&c->raw, T_pad * c->max_rows_pad_int4 * sizeof(int32_t), false, "int4 partial sums"));
    TL_CU_TRY(reserve(&c->scores, score_rows * H * max_keys * sizeof(float), false, "attention scores"));
    TL_CU_TRY(reserve(&c->io, io_bytes, false, "rows and spans"));
    TL_CU_TRY(reserve(&c->host_io, io_bytes, true, "rows and spans (host)"));
    if (b->logits || b->logits_last)
        TL_CU_TRY(reserve(&c->logits, (b->logits ? T : 1) * V * sizeof(float), false, "logits"));
    if (b->loop_states && loops) TL_CU_TRY(reserve(&c->states, loops * d * sizeof(float), false, "loop states"));

    float* x = (float*)c->x.p;
    float* qkv = (float*)c->qkv.p;
    float* o = (float*)c->o.p;
    float* gu = (float*)c->gu.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    int32_t* raw = (int32_t*)c->raw.p;
    float* scores = (float*)c->scores.p;
    cudaStream_t s = c->stream;

    /* rows and spans: one copy */
    char* host_io = (char*)c->host_io.p;
    memcpy(host_io, b->rows, T * sizeof(tl_cuda_row));
    if (b->n_spans) memcpy(host_io + rows_bytes, b->spans, b->n_spans * sizeof(tl_cuda_span));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->io.p, host_io, io_bytes, cudaMemcpyHostToDevice, s),
                          "cudaMemcpyAsync (rows and spans)"));
    const tl_cuda_row* rows = (const tl_cuda_row*)c->io.p;
    const tl_cuda_span* spans = (const tl_cuda_span*)((char*)c->io.p + rows_bytes);

    TL_CU_TRY(tl_cu_embed(c, rows, T, x));
    size_t active = T;
    for (uint32_t l = 0; l < n_layers; l++) {
        while (active > 0 && b->rows[active - 1].n_layers <= l) active--;
        const tl_cu_linear* lq = layer_linear(c, l, TL_PART_QKV);
        const tl_cu_linear* lo = layer_linear(c, l, TL_PART_OUT);
        const tl_cu_linear* lg = layer_linear(c, l, TL_PART_GATE_UP);
        const tl_cu_linear* ld = layer_linear(c, l, TL_PART_DOWN);

        TL_CU_TRY(tl_cu_quantize(c, x, d, d, active, true, acts, lq->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lq, acts, ascale, active, qkv, qkv_dim, false, raw));
        TL_CU_TRY(tl_cu_rope_kv(c, rows, active, qkv, l, b->block_size, b->head_bytes));
        TL_CU_TRY(tl_cu_attention(c, rows, spans, active, qkv, o, l, b->block_size, b->head_bytes, max_keys, scores,
                                  score_rows));
        TL_CU_TRY(tl_cu_quantize(c, o, hd, hd, active, false, acts, lo->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lo, acts, ascale, active, x, d, true, raw));

        TL_CU_TRY(tl_cu_quantize(c, x, d, d, active, true, acts, lg->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lg, acts, ascale, active, gu, 2 * F, false, raw));
        TL_CU_TRY(tl_cu_swiglu_q8(c, gu, active, acts, ld->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, ld, acts, ascale, active, x, d, true, raw));

        if (b->loop_states && l >= n_pre)
            TL_CU_TRY(tl_cu_check(cudaMemcpyAsync((float*)c->states.p + (l - n_pre) * d, x + (active - 1) * d,
                                                  d * sizeof(float), cudaMemcpyDeviceToDevice, s),
                                  "cudaMemcpyAsync (loop state)"));
    }
    if (b->logits || b->logits_last) { /* launched before the copies: a copy to pageable memory blocks the host */
        const tl_cu_linear* head = &c->lin[c->n_lin - 1];
        const size_t first = b->logits ? 0 : T - 1, n = T - first; /* every row, or the last one */
        TL_CU_TRY(tl_cu_quantize(c, x + first * d, d, d, n, true, acts, head->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, head, acts, ascale, n, (float*)c->logits.p, V, false, raw));
    }
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(b->hidden, x, T * d * sizeof(float), cudaMemcpyDeviceToHost, s),
                          "cudaMemcpyAsync (hidden)"));
    if (b->logits)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(b->logits, c->logits.p, T * V * sizeof(float), cudaMemcpyDeviceToHost,
                                              s),
                              "cudaMemcpyAsync (logits)"));
    if (b->logits_last)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(b->logits_last, (float*)c->logits.p + (b->logits ? (T - 1) * V : 0),
                                              V * sizeof(float), cudaMemcpyDeviceToHost, s),
                              "cudaMemcpyAsync (last logits)"));
    if (b->loop_states && loops)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(b->loop_states, c->states.p, loops * d * sizeof(float),
                                              cudaMemcpyDeviceToHost, s),
                              "cudaMemcpyAsync (loop states)"));
    return tl_cu_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (forward)");
}

extern "C" tl_status tl_cuda_forward(tl_cuda* c, const tl_cuda_batch* batch) {
    if (!c || !batch || (batch->T && (!batch->rows || !batch->hidden)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: missing batch, rows or hidden");
    if (batch->T == 0) return TL_OK;
    pthread_mutex_lock(&c->lock);
    tl_status st = forward_locked(c, batch);
    if (st != TL_OK) {
        /* leave nothing in flight that still reads the caller's buffers or the scratch */
        cudaStreamSynchronize(c->stream);
        (void)cudaGetLastError();
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}
