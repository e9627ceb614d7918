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
 * logits [T][V], states [loops][d]; host_io (pinned) stages rows + spans.
 *
 * CUDA graphs (decode, T <= GRAPH_MAX_T): the launches between the rows/spans copy and the output
 * copies (launch_layers) are captured from c->stream into a graph on every call, and the cached
 * executable graph is updated from it (or instantiated anew when the topology changed) and launched
 * on c->stream. Every kernel argument that changes per step (positions, max_keys, row counts,
 * scratch pointers) is taken by value at capture time, and the capture is redone each call, so the
 * graph always holds this call's values. The graph runs the same kernels with the same arguments in
 * the same order on the same stream as the plain path, so results are identical with and without
 * graphs. Any failure of a graph call falls back to plain launches of the same pass and turns graphs
 * off for the model (c->graphs_off, also set by TINYLOOP_CUDA_GRAPHS=0). The launch wrappers only
 * launch and check cudaGetLastError(), which is legal while capturing; every reserve() happens
 * before the capture, and the output copies (to pageable memory, not capturable) after it. */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

enum { GRAPH_MAX_T = 16 }; /* batches of at most this many rows run as a CUDA graph */

static void drop_graph(tl_cuda* c) {
    if (c->graph_exec) cudaGraphExecDestroy(c->graph_exec);
    c->graph_exec = NULL;
}

/* Make b hold at least `bytes` (contents not kept). The stream is idle when this runs. A moved
 * device buffer drops the cached graph, whose kernels hold the old address. */
static tl_status reserve(tl_cuda* c, tl_cu_buf* b, size_t bytes, bool pinned_host, const char* what) {
    if (bytes <= b->cap) return TL_OK;
    if (!pinned_host) drop_graph(c);
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

/* One pass's device copies of rows + spans and the values its launches need beyond c and b. */
typedef struct pass {
    const tl_cuda_batch* b;
    const tl_cuda_row* rows;   /* device */
    const tl_cuda_span* spans; /* device */
    uint32_t max_keys;
    size_t score_rows;
} pass;

/* Every launch and device-to-device copy of the pass on c->stream, in order: embedding, the
 * layers (with the loop-state copies), the head. Nothing here allocates or synchronizes, so it may
 * run inside a stream capture. */
static tl_status launch_layers(tl_cuda* c, const pass* p) {
    const tl_config* cfg = &c->cfg;
    const tl_cuda_batch* b = p->b;
    const size_t T = b->T, d = cfg->d_model, H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    const size_t F = cfg->ffn_dim, V = cfg->vocab_size, n_pre = cfg->n_pre_blocks;
    const size_t qkv_dim = (H + 2 * G) * D, hd = H * D;
    const size_t n_layers = b->rows[0].n_layers;
    float* x = (float*)c->x.p;
    float* qkv = (float*)c->qkv.p;
    float* o = (float*)c->o.p;
    float* gu = (float*)c->gu.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    int32_t* raw = (int32_t*)c->raw.p;
    float* scores = (float*)c->scores.p;
    const tl_cuda_row* rows = p->rows;

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
        TL_CU_TRY(tl_cu_attention(c, rows, p->spans, active, qkv, o, l, b->block_size, b->head_bytes, p->max_keys,
                                  scores, p->score_rows));
        TL_CU_TRY(tl_cu_quantize(c, o, hd, hd, active, false, acts, lo->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lo, acts, ascale, active, x, d, true, raw));

        TL_CU_TRY(tl_cu_quantize(c, x, d, d, active, true, acts, lg->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lg, acts, ascale, active, gu, 2 * F, false, raw));
        TL_CU_TRY(tl_cu_swiglu_q8(c, gu, active, acts, ld->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, ld, acts, ascale, active, x, d, true, raw));

        if (b->loop_states && l >= n_pre)
            TL_CU_TRY(tl_cu_check(cudaMemcpyAsync((float*)c->states.p + (l - n_pre) * d, x + (active - 1) * d,
                                                  d * sizeof(float), cudaMemcpyDeviceToDevice, c->stream),
                                  "cudaMemcpyAsync (loop state)"));
    }
    if (b->logits || b->logits_last) { /* launched before the copies: a copy to pageable memory blocks the host */
        const tl_cu_linear* head = &c->lin[c->n_lin - 1];
        const size_t first = b->logits ? 0 : T - 1, n = T - first; /* every row, or the last one */
        TL_CU_TRY(tl_cu_quantize(c, x + first * d, d, d, n, true, acts, head->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, head, acts, ascale, n, (float*)c->logits.p, V, false, raw));
    }
    return TL_OK;
}

/* launch_layers as a CUDA graph: capture it from c->stream, update c->graph_exec from the capture
 * (or instantiate it anew when the update is refused: a different topology) and launch it on
 * c->stream. False on any failure, with nothing launched, the stream no longer capturing and no
 * cached graph; the caller then runs launch_layers itself. */
static bool launch_graph(tl_cuda* c, const pass* p) {
    cudaStream_t s = c->stream;
    cudaGraph_t graph = NULL;
    pthread_mutex_lock(&c->capture_lock); /* KV block calls of other threads must not land in the capture */
    bool ok = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
        const bool launched = launch_layers(c, p) == TL_OK;
        ok = cudaStreamEndCapture(s, &graph) == cudaSuccess && launched && graph;
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(s, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) {
            cudaGraph_t rest = NULL; /* not expected: end the capture whatever it holds */
            cudaStreamEndCapture(s, &rest);
            if (rest) cudaGraphDestroy(rest);
            ok = false;
        }
    }
    pthread_mutex_unlock(&c->capture_lock);
    if (ok && c->graph_exec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(c->graph_exec, graph, &info) != cudaSuccess) {
            (void)cudaGetLastError(); /* refused (topology changed): instantiate below */
            drop_graph(c);
        }
    }
    if (ok && !c->graph_exec && cudaGraphInstantiate(&c->graph_exec, graph, 0) != cudaSuccess) {
        c->graph_exec = NULL;
        ok = false;
    }
    if (ok) ok = cudaGraphLaunch(c->graph_exec, s) == cudaSuccess;
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
        drop_graph(c);
        (void)cudaGetLastError(); /* clears a non-sticky error; a sticky one fails the plain path too */
    }
    return ok;
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
    TL_CU_TRY(reserve(c, &c->x, T * d * sizeof(float), false, "x"));
    TL_CU_TRY(reserve(c, &c->qkv, T * qkv_dim * sizeof(float), false, "qkv"));
    TL_CU_TRY(reserve(c, &c->o, T * hd * sizeof(float), false, "attention output"));
    TL_CU_TRY(reserve(c, &c->gu, T * 2 * F * sizeof(float), false, "gate/up"));
    TL_CU_TRY(reserve(c, &c->acts, T_pad * c->max_cols_pad, false, "activations"));
    TL_CU_TRY(reserve(c, &c->ascale, T * sizeof(float), false, "activation scales"));
    if (c->max_rows_pad_int4)
        TL_CU_TRY(reserve(c, &c->raw, T_pad * c->max_rows_pad_int4 * sizeof(int32_t), false, "int4 partial sums"));
    TL_CU_TRY(reserve(c, &c->scores, score_rows * H * max_keys * sizeof(float), false, "attention scores"));
    TL_CU_TRY(reserve(c, &c->io, io_bytes, false, "rows and spans"));
    TL_CU_TRY(reserve(c, &c->host_io, io_bytes, true, "rows and spans (host)"));
    if (b->logits || b->logits_last)
        TL_CU_TRY(reserve(c, &c->logits, (b->logits ? T : 1) * V * sizeof(float), false, "logits"));
    if (b->loop_states && loops) TL_CU_TRY(reserve(c, &c->states, loops * d * sizeof(float), false, "loop states"));

    cudaStream_t s = c->stream;
    float* x = (float*)c->x.p;

    /* rows and spans: one copy */
    char* host_io = (char*)c->host_io.p;
    memcpy(host_io, b->rows, T * sizeof(tl_cuda_row));
    if (b->n_spans) memcpy(host_io + rows_bytes, b->spans, b->n_spans * sizeof(tl_cuda_span));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->io.p, host_io, io_bytes, cudaMemcpyHostToDevice, s),
                          "cudaMemcpyAsync (rows and spans)"));
    pass p;
    p.b = b;
    p.rows = (const tl_cuda_row*)c->io.p;
    p.spans = (const tl_cuda_span*)((char*)c->io.p + rows_bytes);
    p.max_keys = max_keys;
    p.score_rows = score_rows;

    bool launched = false;
    if (T <= GRAPH_MAX_T && !c->graphs_off) {
        launched = launch_graph(c, &p);
        if (!launched) c->graphs_off = true; /* plain launches from now on for this model */
    }
    if (!launched) TL_CU_TRY(launch_layers(c, &p));

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
