/* forward.cu — tl_cuda_forward: one forward pass (docs/spec.md §4) of a batch of rows on the
 * device, in the CPU pass's order (cpu/forward.c). One copy of rows + spans to the device, then
 * only launches on c->stream (no host round trip per layer), the outputs into pinned host memory,
 * one synchronization, and a memcpy of the outputs to the caller's buffers.
 *
 * Per layer l (pre block l, or the loop block), on the active rows (n_layers > l: a prefix,
 * rows being ordered deepest first):
 *   NQ(x) -> qkv linear -> RoPE + K/V write (every active row, before any attention reads)
 *   -> attention -> Q8(o) -> out linear (x +=) -> NQ(x) -> gate_up linear -> SwiGLU + Q8
 *   -> down linear (x +=); after a loop layer, the last active row's x -> loop_states.
 * Then hidden = x, and logits = head(NQ(x)) of every row (or of the last one) when asked for.
 *
 * Scratch (grow-on-demand, owned by tl_cuda, guarded by its lock): x [T][d],
 * qkv [T][(H + 2G) * D], o [T][H * D], gu [T][2F], acts [T_pad][max cols_pad] i8, ascale [T],
 * raw [T_pad][max int4 rows_pad] i32, scores [rows per launch][H][key_stride], att_split (split
 * attention's partial maxima and sums), io (rows + spans), logits [T or 1][V], states [loops][d];
 * pinned host: host_io stages rows + spans, host_out the outputs. Device scratch comes from the
 * model's stream-ordered pool (c->pool): a buffer grows (old one freed, new one allocated, both
 * queued on c->stream) only in reserve_pass, before the pass's first launch, and that never
 * synchronizes the device; nothing allocates or frees between launches.
 *
 * CUDA graphs (decode, T <= TL_CU_GRAPH_MAX_T): each pass shape (tl_cu_pass_shape: row count,
 * each row's depth, the scores' key stride, which outputs) is captured once into an executable
 * graph, kept in a small cache (least recently used out), and replayed with cudaGraphLaunch on
 * every later pass of that shape. Why a replay gives the plain path's bits, by construction:
 * launch_pass takes its kernel arguments only from the shape and from the scratch addresses, and
 * every value that changes per step (tokens, positions, windows, K/V write slots, the span tables
 * and so the keys each row sees) lives in device memory (io), rewritten by the rows/spans copy
 * before each launch and read there by the kernels. A moved scratch buffer drops every graph.
 * So a replay is exactly the launches the plain path would make for this batch (same kernels,
 * same arguments, same order, same stream), and graphs on or off cannot change a bit. The key
 * stride is max_keys rounded up to a power of two (attention reads only keys below each row's
 * own pos + 1, whatever the stride), so a decode shape changes only when the context doubles.
 * Any failure of a graph call falls back to plain launches of the same pass and turns graphs off
 * for the model (c->graphs_off, also set by TINYLOOP_CUDA_GRAPHS=0). */
#include <string.h>

#include "common.cuh"

enum {
    OUT_LOGITS = 1,      /* logits of every row                     */
    OUT_LOGITS_LAST = 2, /* logits of the last row                  */
    OUT_STATES = 4,      /* loop states of the last row (loops > 0) */
    MIN_KEY_STRIDE = 64
};

/* Make b hold at least `bytes` (contents not kept), before any launch of the pass. Device
 * buffers come from c->pool (stream-ordered on c->stream: the old memory goes back to the pool
 * once the work queued before is done; no device synchronization), or cudaMalloc where the device
 * has no pools; pinned host ones from cudaMallocHost. A moved buffer drops the cached graphs,
 * whose nodes hold the old address. */
static tl_status reserve(tl_cuda* c, tl_cu_buf* b, size_t bytes, bool pinned_host, const char* what) {
    if (bytes <= b->cap) return TL_OK;
    tl_cu_graphs_drop(c);
    size_t cap = b->cap + b->cap / 2;
    if (cap < bytes) cap = bytes;
    cap = tl_cu_round_up(cap, 4096);
    cudaError_t err;
    if (pinned_host) {
        cudaFreeHost(b->p);
        b->p = NULL;
        b->cap = 0;
        err = cudaMallocHost(&b->p, cap);
    } else {
        tl_cu_scratch_release(c, b);
        err = c->pool ? cudaMallocFromPoolAsync(&b->p, cap, c->pool, c->stream) : cudaMalloc(&b->p, cap);
    }
    if (err != cudaSuccess) {
        b->p = NULL;
        (void)cudaGetLastError();
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "out of memory (CUDA scratch: %s, %zu bytes)", what, cap);
    }
    b->cap = cap;
    return TL_OK;
}

static const tl_cu_linear* layer_linear(const tl_cuda* c, uint32_t layer, int part) {
    return &c->lin[tl_layer_linear_index(&c->cfg, layer, part)];
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

/* The scores' row stride for max_keys: the next power of two from MIN_KEY_STRIDE, at most
 * max_seq_len (rows' positions are below it), never below max_keys. */
static uint32_t key_stride(const tl_cuda* c, uint32_t max_keys) {
    const uint32_t cap = c->cfg.max_seq_len;
    uint32_t s = MIN_KEY_STRIDE;
    while (s < max_keys && s < cap) s *= 2;
    if (s > cap) s = cap;
    return s < max_keys ? max_keys : s;
}

static tl_cu_pass_shape shape_of(const tl_cuda* c, const tl_cuda_batch* b, uint32_t max_keys) {
    tl_cu_pass_shape s;
    memset(&s, 0, sizeof s);
    s.T = (uint32_t)b->T;
    s.key_stride = key_stride(c, max_keys);
    s.block_size = b->block_size;
    s.head_bytes = b->head_bytes;
    s.n_layers = b->rows[0].n_layers;
    const bool loops = s.n_layers > c->cfg.n_pre_blocks;
    s.outputs = (b->logits ? OUT_LOGITS : 0) | (b->logits_last ? OUT_LOGITS_LAST : 0) |
                (b->loop_states && loops ? OUT_STATES : 0);
    for (size_t t = 0; b->T <= TL_CU_GRAPH_MAX_T && t < b->T; t++) s.depth[t] = b->rows[t].n_layers;
    return s;
}

static bool same_shape(const tl_cu_pass_shape* a, const tl_cu_pass_shape* b) {
    return a->T == b->T && a->key_stride == b->key_stride && a->block_size == b->block_size &&
           a->head_bytes == b->head_bytes && a->n_layers == b->n_layers && a->outputs == b->outputs &&
           memcmp(a->depth, b->depth, sizeof a->depth) == 0;
}

/* Where a pass's outputs sit in host_out (in floats): hidden [T][d], logits [n_logits][V]
 * (every row, or the last one), states [loops][d]. */
typedef struct out_layout {
    size_t logits, n_logits, states, loops, floats;
} out_layout;

static out_layout out_layout_of(const tl_cuda* c, const tl_cu_pass_shape* s) {
    const size_t d = c->cfg.d_model, n_pre = c->cfg.n_pre_blocks;
    out_layout L;
    L.logits = (size_t)s->T * d;
    L.n_logits = (s->outputs & OUT_LOGITS) ? s->T : (s->outputs & OUT_LOGITS_LAST) ? 1 : 0;
    L.states = L.logits + L.n_logits * c->cfg.vocab_size;
    L.loops = (s->outputs & OUT_STATES) ? s->n_layers - n_pre : 0;
    L.floats = L.states + L.loops * d;
    return L;
}

/* Bytes of the rows part of io (the spans follow it). */
static size_t rows_bytes(size_t T) { return tl_cu_round_up(T * sizeof(tl_cuda_row), 64); }

/* Every buffer a pass of shape s with n_spans spans uses, grown before its first launch. */
static tl_status reserve_pass(tl_cuda* c, const tl_cu_pass_shape* s, size_t n_spans) {
    const tl_config* cfg = &c->cfg;
    const size_t T = s->T, d = cfg->d_model, H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    const size_t F = cfg->ffn_dim, V = cfg->vocab_size;
    const size_t T_pad = tl_cu_round_up(T, TL_CU_TILE_M);
    const size_t score_rows = tl_cu_attention_rows(c, T, s->key_stride);
    const size_t io_bytes = rows_bytes(T) + n_spans * sizeof(tl_cuda_span);
    const out_layout L = out_layout_of(c, s);
    TL_CU_TRY(reserve(c, &c->x, T * d * sizeof(float), false, "x"));
    TL_CU_TRY(reserve(c, &c->qkv, T * (H + 2 * G) * D * sizeof(float), false, "qkv"));
    TL_CU_TRY(reserve(c, &c->o, T * H * D * sizeof(float), false, "attention output"));
    TL_CU_TRY(reserve(c, &c->gu, T * 2 * F * sizeof(float), false, "gate/up"));
    TL_CU_TRY(reserve(c, &c->acts, T_pad * c->max_cols_pad, false, "activations"));
    TL_CU_TRY(reserve(c, &c->ascale, T * sizeof(float), false, "activation scales"));
    TL_CU_TRY(reserve(c, &c->raw, T_pad * c->max_rows_pad_int4 * sizeof(int32_t), false, "int4 partial sums"));
    TL_CU_TRY(reserve(c, &c->scores, score_rows * H * s->key_stride * sizeof(float), false, "attention scores"));
    TL_CU_TRY(reserve(c, &c->att_split, tl_cu_attention_split_bytes(c, T, score_rows), false,
                      "attention partial sums"));
    TL_CU_TRY(reserve(c, &c->io, io_bytes, false, "rows and spans"));
    TL_CU_TRY(reserve(c, &c->logits, L.n_logits * V * sizeof(float), false, "logits"));
    TL_CU_TRY(reserve(c, &c->states, L.loops * d * sizeof(float), false, "loop states"));
    TL_CU_TRY(reserve(c, &c->host_io, io_bytes, true, "rows and spans (host)"));
    return reserve(c, &c->host_out, L.floats * sizeof(float), true, "outputs (host)");
}

/* Every launch and copy of a pass of shape s on c->stream, in order: embedding, the layers (with
 * the loop-state copies), the head, the outputs into host_out. Its arguments come from s and c's
 * scratch only; of the host rows it reads each row's n_layers, which a graph shape records.
 * Nothing here allocates or synchronizes, so it may run inside a stream capture. */
static tl_status launch_pass(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_row* host_rows) {
    const tl_config* cfg = &c->cfg;
    const size_t T = s->T, d = cfg->d_model, H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    const size_t F = cfg->ffn_dim, V = cfg->vocab_size, n_pre = cfg->n_pre_blocks;
    const size_t qkv_dim = (H + 2 * G) * D, hd = H * D;
    const size_t score_rows = tl_cu_attention_rows(c, T, s->key_stride);
    const out_layout L = out_layout_of(c, s);
    float* x = (float*)c->x.p;
    float* qkv = (float*)c->qkv.p;
    float* o = (float*)c->o.p;
    float* gu = (float*)c->gu.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    int32_t* raw = (int32_t*)c->raw.p;
    float* scores = (float*)c->scores.p;
    float* logits = (float*)c->logits.p;
    float* states = (float*)c->states.p;
    float* out = (float*)c->host_out.p;
    const tl_cuda_row* rows = (const tl_cuda_row*)c->io.p;
    const tl_cuda_span* spans = (const tl_cuda_span*)((char*)c->io.p + rows_bytes(T));
    cudaStream_t st = c->stream;

    TL_CU_TRY(tl_cu_embed(c, rows, T, x));
    size_t active = T;
    for (uint32_t l = 0; l < s->n_layers; l++) {
        while (active > 0 && host_rows[active - 1].n_layers <= l) active--;
        const tl_cu_linear* lq = layer_linear(c, l, TL_PART_QKV);
        const tl_cu_linear* lo = layer_linear(c, l, TL_PART_OUT);
        const tl_cu_linear* lg = layer_linear(c, l, TL_PART_GATE_UP);
        const tl_cu_linear* ld = layer_linear(c, l, TL_PART_DOWN);

        TL_CU_TRY(tl_cu_quantize(c, x, d, d, active, true, acts, lq->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lq, acts, ascale, active, qkv, qkv_dim, false, raw));
        TL_CU_TRY(tl_cu_rope_kv(c, rows, active, qkv, l, s->block_size, s->head_bytes));
        TL_CU_TRY(tl_cu_attention(c, rows, spans, active, qkv, o, l, s->block_size, s->head_bytes, s->key_stride,
                                  scores, score_rows, c->att_split.p));
        TL_CU_TRY(tl_cu_quantize(c, o, hd, hd, active, false, acts, lo->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lo, acts, ascale, active, x, d, true, raw));

        TL_CU_TRY(tl_cu_quantize(c, x, d, d, active, true, acts, lg->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, lg, acts, ascale, active, gu, 2 * F, false, raw));
        TL_CU_TRY(tl_cu_swiglu_q8(c, gu, active, acts, ld->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, ld, acts, ascale, active, x, d, true, raw));

        if (L.loops && l >= n_pre)
            TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(states + (l - n_pre) * d, x + (active - 1) * d, d * sizeof(float),
                                                  cudaMemcpyDeviceToDevice, st),
                                  "cudaMemcpyAsync (loop state)"));
    }
    if (L.n_logits) {
        const tl_cu_linear* head = &c->lin[c->n_lin - 1];
        const size_t first = T - L.n_logits; /* every row, or the last one */
        TL_CU_TRY(tl_cu_quantize(c, x + first * d, d, d, L.n_logits, true, acts, head->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, head, acts, ascale, L.n_logits, logits, V, false, raw));
    }
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out, x, T * d * sizeof(float), cudaMemcpyDeviceToHost, st),
                          "cudaMemcpyAsync (hidden)"));
    if (L.n_logits)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out + L.logits, logits, L.n_logits * V * sizeof(float),
                                              cudaMemcpyDeviceToHost, st),
                              "cudaMemcpyAsync (logits)"));
    if (L.loops)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out + L.states, states, L.loops * d * sizeof(float),
                                              cudaMemcpyDeviceToHost, st),
                              "cudaMemcpyAsync (loop states)"));
    return TL_OK;
}

/* The cached graph of shape s, or NULL. */
static tl_cu_graph* find_graph(tl_cuda* c, const tl_cu_pass_shape* s) {
    for (size_t i = 0; i < TL_CU_GRAPHS; i++)
        if (c->graphs[i].exec && same_shape(&c->graphs[i].shape, s)) return &c->graphs[i];
    return NULL;
}

/* launch_pass of shape s captured from c->stream into the least recently used cache slot: its
 * executable graph updated from the capture when the topology allows, else instantiated anew.
 * NULL on any failure, with nothing launched, the stream no longer capturing and the slot free. */
static tl_cu_graph* capture_graph(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_row* host_rows) {
    tl_cu_graph* slot = &c->graphs[0];
    for (size_t i = 1; i < TL_CU_GRAPHS && slot->exec; i++)
        if (!c->graphs[i].exec || c->graphs[i].used < slot->used) slot = &c->graphs[i];
    cudaStream_t st = c->stream;
    cudaGraph_t graph = NULL;
    pthread_mutex_lock(&c->capture_lock); /* KV block calls of other threads must not land in the capture */
    bool ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
        const bool launched = launch_pass(c, s, host_rows) == TL_OK;
        ok = cudaStreamEndCapture(st, &graph) == cudaSuccess && launched && graph;
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(st, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) {
            cudaGraph_t rest = NULL; /* not expected: end the capture whatever it holds */
            cudaStreamEndCapture(st, &rest);
            if (rest) cudaGraphDestroy(rest);
            ok = false;
        }
    }
    pthread_mutex_unlock(&c->capture_lock);
    if (ok && slot->exec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(slot->exec, graph, &info) != cudaSuccess) {
            (void)cudaGetLastError(); /* refused (another topology): instantiate below */
            cudaGraphExecDestroy(slot->exec);
            slot->exec = NULL;
        }
    }
    if (ok && !slot->exec && cudaGraphInstantiate(&slot->exec, graph, 0) != cudaSuccess) {
        slot->exec = NULL;
        ok = false;
    }
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
        if (slot->exec) cudaGraphExecDestroy(slot->exec);
        slot->exec = NULL;
        (void)cudaGetLastError(); /* clears a non-sticky error; a sticky one fails the plain path too */
        return NULL;
    }
    slot->shape = *s;
    return slot;
}

/* launch_pass of shape s as its cached graph (captured first if it is not cached). False on any
 * failure, with nothing launched; the caller then runs launch_pass itself. */
static bool launch_graph(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_row* host_rows) {
    tl_cu_graph* g = find_graph(c, s);
    if (!g) g = capture_graph(c, s, host_rows);
    if (!g) return false;
    g->used = ++c->graph_clock;
    if (cudaGraphLaunch(g->exec, c->stream) == cudaSuccess) return true;
    (void)cudaGetLastError();
    tl_cu_graphs_drop(c);
    return false;
}

static tl_status forward_locked(tl_cuda* c, const tl_cuda_batch* b) {
    const tl_config* cfg = &c->cfg;
    const size_t T = b->T, d = cfg->d_model, V = cfg->vocab_size;
    uint32_t max_keys = 0;
    TL_CU_TRY(check_batch(c, b, &max_keys));
    const tl_cu_pass_shape shape = shape_of(c, b, max_keys);
    TL_CU_TRY(reserve_pass(c, &shape, b->n_spans));
    cudaStream_t st = c->stream;

    /* rows and spans: one copy */
    char* host_io = (char*)c->host_io.p;
    const size_t rb = rows_bytes(T), io_bytes = rb + b->n_spans * sizeof(tl_cuda_span);
    memcpy(host_io, b->rows, T * sizeof(tl_cuda_row));
    if (b->n_spans) memcpy(host_io + rb, b->spans, b->n_spans * sizeof(tl_cuda_span));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->io.p, host_io, io_bytes, cudaMemcpyHostToDevice, st),
                          "cudaMemcpyAsync (rows and spans)"));

    bool launched = false;
    if (T <= TL_CU_GRAPH_MAX_T && !c->graphs_off) {
        launched = launch_graph(c, &shape, b->rows);
        if (!launched) c->graphs_off = true; /* plain launches from now on for this model */
    }
    if (!launched) TL_CU_TRY(launch_pass(c, &shape, b->rows));
    TL_CU_TRY(tl_cu_check(cudaStreamSynchronize(st), "cudaStreamSynchronize (forward)"));

    const out_layout L = out_layout_of(c, &shape);
    const float* out = (const float*)c->host_out.p;
    memcpy(b->hidden, out, T * d * sizeof(float));
    if (b->logits) memcpy(b->logits, out + L.logits, T * V * sizeof(float));
    if (b->logits_last) memcpy(b->logits_last, out + L.logits + (L.n_logits - 1) * V, V * sizeof(float));
    if (L.loops) memcpy(b->loop_states, out + L.states, L.loops * d * sizeof(float));
    return TL_OK;
}

extern "C" tl_status tl_cuda_forward(tl_cuda* c, const tl_cuda_batch* batch) {
    if (!c || !batch || (batch->T && (!batch->rows || !batch->hidden)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: missing batch, rows or hidden");
    if (batch->T == 0) return TL_OK;
    const tl_cu_device_guard guard(c->device);
    if (guard.error() != cudaSuccess) return tl_cu_check(guard.error(), "cudaSetDevice");
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
