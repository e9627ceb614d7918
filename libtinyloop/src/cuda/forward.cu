/* forward.cu — tl_cuda_forward: one forward pass (docs/spec.md §1, §4) of a batch of rows on
 * the device, in the CPU pass's order (cpu/forward.c). One copy of rows + spans to the device,
 * then only launches on c->stream (no host round trip per layer, but a capture's), the outputs
 * into pinned host memory, one synchronization, and a memcpy of the outputs to the caller's
 * buffers. And tl_cuda_kv_from_rows: a block's K/V write alone, from given layer input rows.
 *
 * The embedding (times embed_scale), then the steps of cuda/pass.h (the prelude, the injection,
 * the iterations with their step norm, adapter and core blocks, or a two-state core's cycles on
 * h in x and l in inject, each depth's coda_norm and coda), each on a range of rows. A part
 * pass (core/forward.h's tl_part) resumed at first_iter > 0 starts instead from the states and
 * injected terms (or low states) it is given, copied into x and inject with the rows; a part may
 * also keep the state after its last iteration (state_out, copied out before the coda runs) and
 * its injected terms (or low states). The injected term linear(adapter_inject; Q8(e))
 * is computed once, at the injection, and added into every iteration's adapter output: the one
 * f32 addition x + v the epilogue of an accumulating linear would make.
 * A block on rows [lo, hi) of a state (x, or a prefix build's copy):
 *   NQ(x) -> qkv linear (+ bias) -> RoPE + K/V write into its slot (every row of the range,
 *   before any attention reads) -> attention -> (the attention gate) Q8(o) -> out linear ->
 *   residual -> NQ(x)
 *   -> gate_up linear -> SwiGLU + Q8 -> down linear -> residual,
 * the residual per block_layout: pre x += y; sandwich x += RN(y, g); post x = RN(x + y, g). A
 * loop layer (loop attention, docs/spec.md §4: a core block of an iteration i >= 1) attends
 * twice, globally over iteration 0's slot into o and locally over its own slot through W' into
 * o_local, and its gated mix replaces o before the Q8 (one kernel for both).
 * With act_block (block activations, docs/spec.md §2.2.1, §4) every NQ and Q8 above is its block
 * form, NQB or QB, into each row's two digit rows of acts, which every linear reads as block
 * inputs (gemm.cu); a K/V write from a hidden-state prefix's rows reads them as plain rows.
 * Then hidden = x, and logits = head(NQ(x)) of every row, of the rows asked for (logit_rows: the
 * last rows of a mixed pass's spans; their indices ride in io after the spans, so a graph
 * replays them), or of the last one, when asked for.
 * A hidden-state prefix build's pass (a batch with a capture, docs/spec.md §5.4.1) also copies
 * each block's input rows into pinned host_capture and hands them to the capture once copied,
 * while the block's kernels run: one wait per block, and never a graph.
 *
 * Scratch (grow-on-demand, owned by tl_cuda, guarded by its lock): x [T][d],
 * qkv [T][tl_qkv_rows], o [T][H * D], gu [T][2F], acts [T_pad][max cols_pad] i8 (act_block:
 * 2T rows padded), ascale [T], raw [T_pad][max int4 rows_pad] i32 (act_block: also [2T][max
 * rows_pad], the head's on its rows), scores [rows per launch][H][key_stride], att_split (split
 * attention's partial maxima and sums), io (rows + spans), logits [T or 1][V], states [loops][d],
 * and as the model needs them inject [T][d] (injection, a two-state core's l), high [T][d] (a
 * two-state core's h aside), sub [T][d] (sandwich), xcopy [T][d] (a prefix build with a coda),
 * o_local [T][H * D] (loop attention);
 * pinned host: host_io stages rows + spans (a resumed part's states and injected terms too;
 * kv_from_rows: rows, q, a), host_out the outputs, host_capture [T][d] a capture's rows.
 * Device scratch comes from the model's stream-ordered pool (c->pool): a buffer grows (old one
 * freed, new one allocated, both queued on c->stream) only in reserve_pass or reserve_kv_write,
 * before the first launch, and that never synchronizes the device; nothing allocates or frees
 * between launches.
 *
 * CUDA graphs (decode, T <= TL_CU_GRAPH_MAX_T): each pass shape (tl_cu_pass_shape: row count,
 * each row's depth, the part (first iteration, coda depth), the scores' key stride, which outputs
 * and so whether it is a prefix build's: all that cuda/pass.h's schedule reads) is captured once
 * into an executable graph, kept in a small cache (least recently used out), and replayed with
 * cudaGraphLaunch on every later pass of that shape. Why a replay gives the plain path's bits,
 * by construction: launch_pass takes its kernel arguments only from the shape and from the
 * scratch addresses, and every value that changes per step (tokens, positions, windows, instruction lengths, K/V
 * write slots, the span tables and so the keys each row sees, a resumed part's states) lives in
 * device memory (io, x, inject), rewritten by the copies before each launch and read there by
 * the kernels. A moved scratch buffer drops every graph.
 * So a replay is exactly the launches the plain path would make for this batch (same kernels,
 * same arguments, same order, same stream), and graphs on or off cannot change a bit. The key
 * stride is max_keys rounded up to a power of two (attention reads only keys up to each row's
 * own last visible key e(pos), whatever the stride), so a decode shape changes only when the context doubles.
 * Any failure of a graph call falls back to plain launches of the same pass and turns graphs off
 * for the model (c->graphs_off, also set by TINYLOOP_CUDA_GRAPHS=0). */
#include <string.h>

#include "common.cuh"
#include "core/attn_mask.h"
#include "cuda/pass.h"

enum {
    OUT_LOGITS = 1,      /* logits of every row                                               */
    OUT_LOGITS_LAST = 2, /* logits of the last row                                            */
    OUT_STATES = 4,      /* a prefix build: every depth's coda, the last row's state at each  */
    OUT_CAPTURE = 8,     /* a hidden-state prefix build: each block's input rows (never a graph) */
    OUT_KEPT = 16,       /* a part's state_out: the state after the last iteration           */
    OUT_INJECT = 32,     /* a part's inject_out: the injected terms                          */
    OUT_LOGIT_ROWS = 64, /* with OUT_LOGITS: the logits of the rows logit_rows names only      */
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

/* Whether row r's K/V write is one the kernels can make: a position of the model, a block and a
 * slot in it, a depth with cache slots. */
static bool writes_ok(const tl_config* cfg, const tl_cuda_row* r, uint32_t block_size) {
    return r->pos < cfg->max_seq_len && r->write_data && r->write_slot < block_size && r->loops >= 1 &&
           tl_n_layers(cfg, r->loops) <= TL_MAX_CACHE_LAYERS;
}

/* Whether b is a part or a prefix build: a pass of one sequence, every row at one depth. */
static bool one_depth(const tl_cuda_batch* b) {
    return b->loop_states || b->first_iter || b->coda_depth || b->state_out || b->inject_out;
}

static tl_status check_batch(const tl_cuda* c, const tl_cuda_batch* b, uint32_t* max_keys) {
    const tl_config* cfg = &c->cfg;
    uint32_t keys = b->max_keys;
    for (size_t t = 0; t < b->T; t++) {
        const tl_cuda_row* r = &b->rows[t];
        if (r->token < 0 || (uint32_t)r->token >= cfg->vocab_size || !writes_ok(cfg, r, b->block_size) ||
            (size_t)r->first_span + r->n_spans > b->n_spans || (t > 0 && r->loops > b->rows[t - 1].loops) ||
            (one_depth(b) && r->loops != b->rows[0].loops))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: bad row %zu (token %d, position %u, loops %u)", t,
                           (int)r->token, r->pos, r->loops);
        const size_t last = tl_attn_last_key(r->pos, r->instruction);
        if (last + 1 > keys) keys = (uint32_t)(last + 1);
    }
    if (b->block_size == 0 || (b->n_spans && !b->spans))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: bad span table");
    for (size_t i = 0; b->logit_rows && i < b->n_logit_rows; i++)
        if (!b->logits || b->logit_rows[i] >= b->T || (i > 0 && b->logit_rows[i] <= b->logit_rows[i - 1]))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: bad logit row %zu (%u of %zu rows)", i,
                           b->logit_rows[i], b->T);
    if (b->logit_rows && (b->n_logit_rows == 0 || b->logits_last))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: logit_rows with n_logit_rows 0 or logits_last");
    const uint32_t loops = b->rows[0].loops;
    if (b->first_iter >= loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: first_iter %u, rows of loops %u", b->first_iter, loops);
    if (b->first_iter && (!b->state_in || (tl_has_inject(cfg) && !b->inject_in)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: first_iter %u without state_in%s", b->first_iter,
                       tl_has_inject(cfg) ? " and inject_in" : "");
    if (b->coda_depth && tl_n_layers(cfg, b->coda_depth) > TL_MAX_CACHE_LAYERS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: coda_depth %u", b->coda_depth);
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
    s.kv_bits = b->kv_bits;
    s.loops = b->rows[0].loops;
    s.first_iter = b->first_iter;
    s.coda_depth = b->coda_depth;
    s.outputs = (b->logits ? OUT_LOGITS : 0) | (b->logits_last ? OUT_LOGITS_LAST : 0) |
                (b->loop_states ? OUT_STATES : 0) | (b->capture ? OUT_CAPTURE : 0) | (b->state_out ? OUT_KEPT : 0) |
                (b->inject_out && tl_has_inject(&c->cfg) ? OUT_INJECT : 0) |
                (b->logits && b->logit_rows ? OUT_LOGIT_ROWS : 0);
    s.n_logit_rows = (s.outputs & OUT_LOGIT_ROWS) ? (uint32_t)b->n_logit_rows : 0;
    for (size_t t = 0; b->T <= TL_CU_GRAPH_MAX_T && t < b->T; t++) s.depth[t] = b->rows[t].loops;
    return s;
}

static bool same_shape(const tl_cu_pass_shape* a, const tl_cu_pass_shape* b) {
    return a->T == b->T && a->key_stride == b->key_stride && a->block_size == b->block_size &&
           a->head_bytes == b->head_bytes && a->kv_bits == b->kv_bits && a->loops == b->loops &&
           a->first_iter == b->first_iter && a->coda_depth == b->coda_depth && a->outputs == b->outputs &&
           a->n_logit_rows == b->n_logit_rows &&
           memcmp(a->depth, b->depth, sizeof a->depth) == 0;
}

/* Where a pass's outputs sit in host_out (in floats): hidden [T][d], logits [n_logits][V]
 * (every row, the logit rows, or the last one), states [loops][d] (a prefix build: its rows' common depth; rows
 * first_iter .. loops-1 written), kept [T][d] (state_out), inject [T][d] (inject_out). */
typedef struct out_layout {
    size_t logits, n_logits, states, loops, kept, inject, floats;
} out_layout;

static out_layout out_layout_of(const tl_cuda* c, const tl_cu_pass_shape* s) {
    const size_t d = c->cfg.d_model;
    out_layout L;
    L.logits = (size_t)s->T * d;
    L.n_logits = (s->outputs & OUT_LOGIT_ROWS) ? s->n_logit_rows
                 : (s->outputs & OUT_LOGITS)   ? s->T
                 : (s->outputs & OUT_LOGITS_LAST) ? 1 : 0;
    L.states = L.logits + L.n_logits * c->cfg.vocab_size;
    L.loops = (s->outputs & OUT_STATES) ? s->loops : 0;
    L.kept = L.states + L.loops * d;
    L.inject = L.kept + ((s->outputs & OUT_KEPT) ? (size_t)s->T * d : 0);
    L.floats = L.inject + ((s->outputs & OUT_INJECT) ? (size_t)s->T * d : 0);
    return L;
}

/* Bytes of the rows part of io (the logit rows follow it, then the spans): the logit rows at
 * rows_bytes(T), the spans at spans_at(s), both fixed by the shape, so a graph's kernels find
 * them. */
static size_t rows_bytes(size_t T) { return tl_cu_round_up(T * sizeof(tl_cuda_row), 64); }

static size_t spans_at(const tl_cu_pass_shape* s) {
    return rows_bytes(s->T) + tl_cu_round_up(s->n_logit_rows * sizeof(uint32_t), 64);
}

/* Bytes of io: rows, logit rows and n_spans spans of a pass of shape s. */
static size_t io_bytes_of(const tl_cu_pass_shape* s, size_t n_spans) {
    return spans_at(s) + n_spans * sizeof(tl_cuda_span);
}

/* Where host_io stages a resumed part's states (its injected terms follow them, [T][d] each):
 * after io's bytes. */
static size_t states_in_at(const tl_cu_pass_shape* s, size_t n_spans) {
    return tl_cu_round_up(io_bytes_of(s, n_spans), 64);
}

/* Whether the activations are digit rows of block inputs (act_block, docs/spec.md §3). */
static bool digits(const tl_cuda* c) { return c->cfg.act_block != 0; }

/* Bytes of raw for the linears of a pass of T rows whose head runs on head_rows of them: the
 * int4 two-pass GEMM's first pass (T rows of the widest int4 output), and with block inputs
 * every linear's accumulators of its 2T digit rows (gemm.cu). */
static size_t raw_bytes(const tl_cuda* c, size_t T, size_t head_rows) {
    size_t ints = tl_cu_round_up(T, TL_CU_TILE_M) * c->max_rows_pad_int4;
    if (digits(c)) {
        const size_t layers = 2 * T * c->max_rows_pad_layer, head = 2 * head_rows * c->lin[c->n_lin - 1].rows_pad;
        if (layers > ints) ints = layers;
        if (head > ints) ints = head;
    }
    return ints * sizeof(int32_t);
}

/* The buffers of a K/V write of T rows (write_kv): activations (two digit rows a row with
 * act_block), their scales, qkv, int4 sums. */
static tl_status reserve_kv_write(tl_cuda* c, size_t T) {
    const tl_config* cfg = &c->cfg;
    const size_t acts_pad = tl_cu_round_up(digits(c) ? 2 * T : T, TL_CU_TILE_M);
    TL_CU_TRY(reserve(c, &c->qkv, T * tl_qkv_rows(cfg) * sizeof(float), false, "qkv"));
    TL_CU_TRY(reserve(c, &c->acts, acts_pad * c->max_cols_pad, false, "activations"));
    TL_CU_TRY(reserve(c, &c->ascale, T * sizeof(float), false, "activation scales"));
    return reserve(c, &c->raw, raw_bytes(c, T, 0), false, "linear partial sums");
}

/* Every buffer a pass of shape s with n_spans spans uses, grown before its first launch. */
static tl_status reserve_pass(tl_cuda* c, const tl_cu_pass_shape* s, size_t n_spans) {
    const tl_config* cfg = &c->cfg;
    const size_t T = s->T, d = cfg->d_model, H = cfg->n_heads, D = cfg->head_dim;
    const size_t F = cfg->ffn_dim, V = cfg->vocab_size;
    const size_t score_rows = tl_cu_attention_rows(c, T, s->key_stride);
    const size_t io_bytes = io_bytes_of(s, n_spans);
    const size_t states_in = s->first_iter ? (tl_has_inject(cfg) ? 2 : 1) * T * d * sizeof(float) : 0;
    const out_layout L = out_layout_of(c, s);
    TL_CU_TRY(reserve(c, &c->x, T * d * sizeof(float), false, "x"));
    TL_CU_TRY(reserve_kv_write(c, T));
    TL_CU_TRY(reserve(c, &c->raw, raw_bytes(c, T, L.n_logits), false, "linear partial sums"));
    TL_CU_TRY(reserve(c, &c->o, T * H * D * sizeof(float), false, "attention output"));
    TL_CU_TRY(reserve(c, &c->o_local, cfg->loop_window ? T * H * D * sizeof(float) : 0, false,
                      "local attention output"));
    TL_CU_TRY(reserve(c, &c->gu, T * 2 * F * sizeof(float), false, "gate/up"));
    TL_CU_TRY(reserve(c, &c->scores, score_rows * H * s->key_stride * sizeof(float), false, "attention scores"));
    TL_CU_TRY(reserve(c, &c->att_split, tl_cu_attention_split_bytes(c, T, score_rows), false,
                      "attention partial sums"));
    TL_CU_TRY(reserve(c, &c->io, io_bytes, false, "rows and spans"));
    TL_CU_TRY(reserve(c, &c->logits, L.n_logits * V * sizeof(float), false, "logits"));
    TL_CU_TRY(reserve(c, &c->states, L.loops * d * sizeof(float), false, "loop states"));
    TL_CU_TRY(reserve(c, &c->inject, tl_has_inject(cfg) ? T * d * sizeof(float) : 0, false, "injected terms"));
    TL_CU_TRY(reserve(c, &c->high, cfg->core_cycles ? T * d * sizeof(float) : 0, false, "high states"));
    TL_CU_TRY(reserve(c, &c->sub, cfg->block_layout == TL_LAYOUT_SANDWICH ? T * d * sizeof(float) : 0, false,
                      "sublayer output"));
    TL_CU_TRY(reserve(c, &c->xcopy, L.loops && tl_has_coda(cfg) ? T * d * sizeof(float) : 0, false,
                      "prefix build state"));
    TL_CU_TRY(reserve(c, &c->host_io, states_in_at(s, n_spans) + states_in, true, "rows and spans (host)"));
    TL_CU_TRY(reserve(c, &c->host_capture, (s->outputs & OUT_CAPTURE) ? T * d * sizeof(float) : 0, true,
                      "layer inputs (host)"));
    return reserve(c, &c->host_out, L.floats * sizeof(float), true, "outputs (host)");
}

/* What the steps of one pass (cuda/pass.h) launch with: the shape, the device rows and spans, and
 * the scratch. */
typedef struct pass {
    tl_cuda* c;
    const tl_cu_pass_shape* s;
    const tl_cuda_row* rows;   /* [T] device */
    const tl_cuda_span* spans; /* device     */
    size_t score_rows;
    float* x;                  /* [T][d] the residual stream          */
    float* xcopy;              /* [T][d] a prefix build's coda state  */
    float* states;             /* [loops][d]                          */
    float* inject;             /* [T][d] the injected terms, or l     */
    float* high;               /* [T][d] a two-state core's h aside   */
    float* kept;               /* [T][d] pinned host: state_out       */
    const tl_cuda_batch* b;    /* the batch: its capture, if any      */
} pass;

static float* state_of(const pass* p, tl_cu_state on) { return on == TL_CU_ON_COPY ? p->xcopy : p->x; }

/* x[0 .. n) = residual(x, linear(L; acts), g) for the model's block_layout (docs/spec.md §4):
 * pre x + y, sandwich x + RN(y, g), post RN(x + y, g). */
static tl_status residual(tl_cuda* c, const tl_cu_linear* L, size_t n, float* x, const float* g) {
    const size_t d = c->cfg.d_model;
    const int8_t* acts = (const int8_t*)c->acts.p;
    const float* ascale = (const float*)c->ascale.p;
    int32_t* raw = (int32_t*)c->raw.p;
    switch (c->cfg.block_layout) {
    case TL_LAYOUT_SANDWICH: {
        float* y = (float*)c->sub.p;
        TL_CU_TRY(tl_cu_linear_run(c, L, acts, ascale, n, y, d, false, raw, digits(c)));
        return tl_cu_rms_norm(c, y, g, n, x, true);
    }
    case TL_LAYOUT_POST:
        TL_CU_TRY(tl_cu_linear_run(c, L, acts, ascale, n, x, d, true, raw, digits(c)));
        return tl_cu_rms_norm(c, x, g, n, x, false);
    default:
        return tl_cu_linear_run(c, L, acts, ascale, n, x, d, true, raw, digits(c));
    }
}

/* The K/V of rows[0 .. n) into cache slot `slot` from their activation rows in acts / ascale
 * (NQ of the layer input, or with block_inputs NQB's digit rows): z = linear(attn_qkv; acts)
 * (+ bias) into qkv, RoPE of the Q and K heads in place, the K/V write into each row's cache slot. */
static tl_status write_kv(tl_cuda* c, const tl_cu_linear* attn_qkv, const tl_cuda_row* rows, size_t n, uint32_t slot,
                          uint32_t block_size, size_t head_bytes, uint32_t kv_bits, bool block_inputs) {
    const size_t qkv_dim = tl_qkv_rows(&c->cfg);
    float* qkv = (float*)c->qkv.p;
    TL_CU_TRY(tl_cu_linear_run(c, attn_qkv, (const int8_t*)c->acts.p, (const float*)c->ascale.p, n, qkv, qkv_dim,
                               false, (int32_t*)c->raw.p, block_inputs));
    return tl_cu_rope_kv(c, rows, n, qkv, slot, block_size, head_bytes, kv_bits);
}

/* o = the attention of rows[0 .. n)'s query heads in qkv over cache slot `layer`, through each
 * row's window, or with loop_window through loop attention's local window W'. */
static tl_status attend(const pass* p, const tl_cuda_row* rows, size_t n, uint32_t layer, uint32_t loop_window,
                        float* o) {
    tl_cuda* c = p->c;
    return tl_cu_attention(c, rows, p->spans, n, (const float*)c->qkv.p, o, layer, loop_window, p->s->block_size,
                           p->s->head_bytes, p->s->kv_bits, p->s->key_stride, (float*)c->scores.p, p->score_rows,
                           c->att_split.p);
}

/* acts = Q8 of the attention output of rows[0 .. n) in the layer of cache slot `slot` (docs/spec.md
 * §4): o over the slot, gated by the attention gate; or in a loop layer the mix of the global
 * attention over iteration 0's slot (in o) and the local one over this slot (in o_local). */
static tl_status attention(const pass* p, const tl_cuda_row* rows, size_t n, uint32_t slot, const tl_cu_block* b,
                           size_t lda) {
    tl_cuda* c = p->c;
    const tl_config* cfg = &c->cfg;
    const size_t hd = (size_t)cfg->n_heads * cfg->head_dim;
    float* o = (float*)c->o.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    uint32_t global;
    const bool loop = tl_loop_slot(cfg, slot, &global);
    TL_CU_TRY(attend(p, rows, n, loop ? global : slot, 0, o));
    if (loop) {
        TL_CU_TRY(attend(p, rows, n, slot, cfg->loop_window, (float*)c->o_local.p));
        return tl_cu_loop_mix_q8(c, o, (const float*)c->o_local.p, (const float*)c->qkv.p, b, n, acts, lda, ascale);
    }
    if (cfg->attn_gate) return tl_cu_attn_gate_q8(c, o, (const float*)c->qkv.p, n, acts, lda, ascale);
    return tl_cu_quantize(c, o, hd, hd, n, false, acts, lda, ascale);
}

/* Block `block` on rows [lo, hi) of state `on`, its K/V into cache slot `slot`. */
static tl_status run_block(const pass* p, uint32_t slot, uint32_t block, size_t lo, size_t hi, tl_cu_state on) {
    tl_cuda* c = p->c;
    const tl_config* cfg = &c->cfg;
    const size_t n = hi - lo, d = cfg->d_model, F = cfg->ffn_dim;
    const tl_cu_linear* part = &c->lin[tl_block_linear_index(block, 0)]; /* part q at part[q] */
    const tl_cu_block* gains = &c->blocks[block];
    const tl_cuda_row* rows = p->rows + lo;
    float* x = state_of(p, on) + lo * d;
    float* gu = (float*)c->gu.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    int32_t* raw = (int32_t*)c->raw.p;
    if (n == 0) return TL_OK;

    TL_CU_TRY(tl_cu_quantize(c, x, d, d, n, true, acts, part[TL_PART_QKV].cols_pad, ascale));
    TL_CU_TRY(write_kv(c, &part[TL_PART_QKV], rows, n, slot, p->s->block_size, p->s->head_bytes, p->s->kv_bits,
                       digits(c)));
    TL_CU_TRY(attention(p, rows, n, slot, gains, part[TL_PART_OUT].cols_pad));
    TL_CU_TRY(residual(c, &part[TL_PART_OUT], n, x, gains->attn_post_norm));

    TL_CU_TRY(tl_cu_quantize(c, x, d, d, n, true, acts, part[TL_PART_GATE_UP].cols_pad, ascale));
    TL_CU_TRY(tl_cu_linear_run(c, &part[TL_PART_GATE_UP], acts, ascale, n, gu, 2 * F, false, raw, digits(c)));
    TL_CU_TRY(tl_cu_swiglu_q8(c, gu, n, acts, part[TL_PART_DOWN].cols_pad, ascale));
    return residual(c, &part[TL_PART_DOWN], n, x, gains->ffn_post_norm);
}

/* run_block; in a pass with a capture, the block's input rows first go to host_capture (queued
 * before the block, so the block's own kernels run while the host hands them to the capture). */
static tl_status step_block(void* ctx, uint32_t slot, uint32_t block, size_t lo, size_t hi, tl_cu_state on) {
    const pass* p = (const pass*)ctx;
    tl_cuda* c = p->c;
    const tl_cuda_batch* b = p->b;
    if (!b->capture || hi == lo) return run_block(p, slot, block, lo, hi, on);
    const size_t d = c->cfg.d_model;
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->host_capture.p, state_of(p, on) + lo * d, (hi - lo) * d * sizeof(float),
                                          cudaMemcpyDeviceToHost, c->stream),
                          "cudaMemcpyAsync (layer inputs)"));
    TL_CU_TRY(tl_cu_check(cudaEventRecord(c->captured, c->stream), "cudaEventRecord (layer inputs)"));
    TL_CU_TRY(run_block(p, slot, block, lo, hi, on));
    TL_CU_TRY(tl_cu_check(cudaEventSynchronize(c->captured), "cudaEventSynchronize (layer inputs)"));
    b->capture(b->capture_ctx, slot, lo, hi - lo, (const float*)c->host_capture.p);
    return TL_OK;
}

/* state = RN(state, g_step or g_coda, or no gain), rows [lo, hi). */
static tl_status step_norm(void* ctx, tl_cu_norm which, size_t lo, size_t hi, tl_cu_state on) {
    const pass* p = (const pass*)ctx;
    float* x = state_of(p, on) + lo * p->c->cfg.d_model;
    const float* gain = which == TL_CU_STEP_NORM ? p->c->step_norm : which == TL_CU_CODA_NORM ? p->c->coda_norm : NULL;
    return tl_cu_rms_norm(p->c, x, gain, hi - lo, x, false);
}

/* dst = src, rows [0, hi) of the states. */
static tl_status copy_rows(const pass* p, float* dst, const float* src, size_t hi, const char* what) {
    return tl_cu_check(cudaMemcpyAsync(dst, src, hi * p->c->cfg.d_model * sizeof(float), cudaMemcpyDeviceToDevice,
                                       p->c->stream),
                       what);
}

/* A two-state core's move (cuda/pass.h's tl_cu_mix) on rows [0, hi). */
static tl_status step_mix(void* ctx, tl_cu_mix what, size_t hi) {
    const pass* p = (const pass*)ctx;
    switch (what) {
    case TL_CU_LOW_ZERO:
        return tl_cu_check(cudaMemsetAsync(p->inject, 0, hi * p->c->cfg.d_model * sizeof(float), p->c->stream),
                           "cudaMemsetAsync (low state)");
    case TL_CU_HOLD:
        TL_CU_TRY(copy_rows(p, p->high, p->x, hi, "cudaMemcpyAsync (high state)"));
        return copy_rows(p, p->x, p->inject, hi, "cudaMemcpyAsync (low state in)");
    case TL_CU_ADD_HIGH: return tl_cu_add_rows(p->c, p->x, p->high, hi);
    default: return copy_rows(p, p->inject, p->x, hi, "cudaMemcpyAsync (low state out)");
    }
}

/* linear(L; Q8(x)) of rows [0, hi) into y (the adapter's two linears, docs/spec.md §4.4). */
static tl_status adapter_linear(const pass* p, uint32_t which, size_t hi, float* y) {
    tl_cuda* c = p->c;
    const size_t d = c->cfg.d_model;
    const tl_cu_linear* L = &c->lin[tl_adapter_linear_index(&c->cfg, which)];
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    TL_CU_TRY(tl_cu_quantize(c, p->x, d, d, hi, false, acts, L->cols_pad, ascale));
    return tl_cu_linear_run(c, L, acts, ascale, hi, y, d, false, (int32_t*)c->raw.p, digits(c));
}

/* inject = linear(adapter_inject; Q8(e)) on the prelude's output e in x, the same term at every
 * iteration; then x = 0 (docs/spec.md §4.4: the state entering iteration 0), rows [0, hi). */
static tl_status step_inject(void* ctx, size_t hi) {
    const pass* p = (const pass*)ctx;
    TL_CU_TRY(adapter_linear(p, 1, hi, p->inject));
    return tl_cu_check(cudaMemsetAsync(p->x, 0, hi * p->c->cfg.d_model * sizeof(float), p->c->stream),
                       "cudaMemsetAsync (initial state)");
}

/* x = linear(adapter_state; Q8(x)) + inject (docs/spec.md §4.4), rows [0, hi): the linear's
 * output, then the injected term added to it. */
static tl_status step_adapter(void* ctx, size_t hi) {
    const pass* p = (const pass*)ctx;
    TL_CU_TRY(adapter_linear(p, 0, hi, p->x));
    return tl_cu_add_rows(p->c, p->x, p->inject, hi);
}

/* xcopy = x, rows [0, hi). */
static tl_status step_copy(void* ctx, size_t hi) {
    const pass* p = (const pass*)ctx;
    return copy_rows(p, p->xcopy, p->x, hi, "cudaMemcpyAsync (prefix build state)");
}

/* kept = x, rows [0, hi): the part's state_out, straight into host_out. */
static tl_status step_keep(void* ctx, size_t hi) {
    const pass* p = (const pass*)ctx;
    return tl_cu_check(cudaMemcpyAsync(p->kept, p->x, hi * p->c->cfg.d_model * sizeof(float), cudaMemcpyDeviceToHost,
                                       p->c->stream),
                       "cudaMemcpyAsync (state out)");
}

/* states[depth - 1] = row `row` of state `on`. */
static tl_status step_state(void* ctx, uint32_t depth, size_t row, tl_cu_state on) {
    const pass* p = (const pass*)ctx;
    const size_t d = p->c->cfg.d_model;
    return tl_cu_check(cudaMemcpyAsync(p->states + (size_t)(depth - 1) * d, state_of(p, on) + row * d,
                                       d * sizeof(float), cudaMemcpyDeviceToDevice, p->c->stream),
                       "cudaMemcpyAsync (loop state)");
}

/* Every launch and copy of a pass of shape s on c->stream, in order: embedding (a resumed part:
 * none, its states are in x), the steps of cuda/pass.h, the head, the outputs into host_out. Its
 * arguments come from s and c's scratch only; of the batch b it reads each row's loops, which a
 * graph shape records, and its capture (OUT_CAPTURE in the shape). Nothing here allocates, and
 * only a pass with a capture (never a graph's) synchronizes, so any other may run inside a
 * stream capture. */
static tl_status launch_pass(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_batch* b) {
    const tl_config* cfg = &c->cfg;
    const size_t T = s->T, d = cfg->d_model, V = cfg->vocab_size;
    const out_layout L = out_layout_of(c, s);
    float* x = (float*)c->x.p;
    int8_t* acts = (int8_t*)c->acts.p;
    float* ascale = (float*)c->ascale.p;
    float* logits = (float*)c->logits.p;
    float* out = (float*)c->host_out.p;
    const tl_cuda_row* rows = (const tl_cuda_row*)c->io.p;
    cudaStream_t st = c->stream;

    if (s->first_iter == 0) TL_CU_TRY(tl_cu_embed(c, rows, T, x));
    pass p = {c, s, rows, (const tl_cuda_span*)((char*)c->io.p + spans_at(s)),
              tl_cu_attention_rows(c, T, s->key_stride), x, (float*)c->xcopy.p, (float*)c->states.p,
              (float*)c->inject.p, (float*)c->high.p, out + L.kept, b};
    const tl_cu_pass_steps steps = {&p, step_block, step_norm, step_inject, step_adapter, step_copy, step_state,
                                    step_keep, step_mix};
    const tl_cu_part part = {s->first_iter, s->coda_depth, (s->outputs & OUT_STATES) != 0,
                             (s->outputs & OUT_KEPT) != 0};
    TL_CU_TRY(tl_cu_pass_walk(cfg, b->rows, T, &part, &steps));
    if (L.n_logits) {
        const tl_cu_linear* head = &c->lin[c->n_lin - 1];
        const size_t first = T - L.n_logits; /* every row, or the last one */
        const uint32_t* picked = (s->outputs & OUT_LOGIT_ROWS) ? (const uint32_t*)((char*)c->io.p + rows_bytes(T))
                                                               : NULL;
        TL_CU_TRY(tl_cu_quantize_picked(c, picked ? x : x + first * d, d, picked, d, L.n_logits, true, acts,
                                        head->cols_pad, ascale));
        TL_CU_TRY(tl_cu_linear_run(c, head, acts, ascale, L.n_logits, logits, V, false, (int32_t*)c->raw.p,
                                   digits(c)));
    }
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out, x, T * d * sizeof(float), cudaMemcpyDeviceToHost, st),
                          "cudaMemcpyAsync (hidden)"));
    if (L.n_logits)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out + L.logits, logits, L.n_logits * V * sizeof(float),
                                              cudaMemcpyDeviceToHost, st),
                              "cudaMemcpyAsync (logits)"));
    const size_t skipped = (size_t)s->first_iter * d; /* the states a resumed part leaves alone */
    if (L.loops)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out + L.states + skipped, p.states + skipped,
                                              L.loops * d * sizeof(float) - skipped * sizeof(float),
                                              cudaMemcpyDeviceToHost, st),
                              "cudaMemcpyAsync (loop states)"));
    if (s->outputs & OUT_INJECT)
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(out + L.inject, p.inject, T * d * sizeof(float), cudaMemcpyDeviceToHost,
                                              st),
                              "cudaMemcpyAsync (injected terms)"));
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
static tl_cu_graph* capture_graph(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_batch* b) {
    tl_cu_graph* slot = &c->graphs[0];
    for (size_t i = 1; i < TL_CU_GRAPHS && slot->exec; i++)
        if (!c->graphs[i].exec || c->graphs[i].used < slot->used) slot = &c->graphs[i];
    cudaStream_t st = c->stream;
    cudaGraph_t graph = NULL;
    pthread_mutex_lock(&c->capture_lock); /* KV block calls of other threads must not land in the capture */
    bool ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
        const bool launched = launch_pass(c, s, b) == TL_OK;
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
static bool launch_graph(tl_cuda* c, const tl_cu_pass_shape* s, const tl_cuda_batch* b) {
    tl_cu_graph* g = find_graph(c, s);
    if (!g) g = capture_graph(c, s, b);
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

    /* rows and spans: one copy; a resumed part's states into x, its injected terms (or low states)
     * into inject */
    char* host_io = (char*)c->host_io.p;
    const size_t io_bytes = io_bytes_of(&shape, b->n_spans), state = T * d * sizeof(float);
    memcpy(host_io, b->rows, T * sizeof(tl_cuda_row));
    if (shape.n_logit_rows) memcpy(host_io + rows_bytes(T), b->logit_rows, shape.n_logit_rows * sizeof(uint32_t));
    if (b->n_spans) memcpy(host_io + spans_at(&shape), b->spans, b->n_spans * sizeof(tl_cuda_span));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->io.p, host_io, io_bytes, cudaMemcpyHostToDevice, st),
                          "cudaMemcpyAsync (rows and spans)"));
    char* states_in = host_io + states_in_at(&shape, b->n_spans);
    if (b->first_iter) {
        memcpy(states_in, b->state_in, state);
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->x.p, states_in, state, cudaMemcpyHostToDevice, st),
                              "cudaMemcpyAsync (states in)"));
    }
    if (b->first_iter && tl_has_inject(cfg)) {
        memcpy(states_in + state, b->inject_in, state);
        TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->inject.p, states_in + state, state, cudaMemcpyHostToDevice, st),
                              "cudaMemcpyAsync (injected terms in)"));
    }

    bool launched = false;
    if (T <= TL_CU_GRAPH_MAX_T && !c->graphs_off && !b->capture) {
        launched = launch_graph(c, &shape, b);
        if (!launched) c->graphs_off = true; /* plain launches from now on for this model */
    }
    if (!launched) TL_CU_TRY(launch_pass(c, &shape, b));
    TL_CU_TRY(tl_cu_check(cudaStreamSynchronize(st), "cudaStreamSynchronize (forward)"));

    const out_layout L = out_layout_of(c, &shape);
    const float* out = (const float*)c->host_out.p;
    memcpy(b->hidden, out, T * d * sizeof(float));
    if (b->logits) memcpy(b->logits, out + L.logits, L.n_logits * V * sizeof(float));
    if (b->logits_last) memcpy(b->logits_last, out + L.logits + (L.n_logits - 1) * V, V * sizeof(float));
    const size_t skipped = (size_t)b->first_iter * d;
    if (L.loops) memcpy(b->loop_states + skipped, out + L.states + skipped, (L.loops * d - skipped) * sizeof(float));
    if (b->state_out) memcpy(b->state_out, out + L.kept, T * d * sizeof(float));
    if (shape.outputs & OUT_INJECT) memcpy(b->inject_out, out + L.inject, T * d * sizeof(float));
    return TL_OK;
}

/* work(c, args) on c's device under c->lock; on failure, nothing left in flight that still
 * reads the caller's buffers or the scratch. */
template <typename Args>
static tl_status run_locked(tl_cuda* c, tl_status (*work)(tl_cuda*, const Args*), const Args* args) {
    const tl_cu_device_guard guard(c->device);
    if (guard.error() != cudaSuccess) return tl_cu_check(guard.error(), "cudaSetDevice");
    pthread_mutex_lock(&c->lock);
    tl_status st = work(c, args);
    if (st != TL_OK) {
        cudaStreamSynchronize(c->stream);
        (void)cudaGetLastError();
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

extern "C" tl_status tl_cuda_forward(tl_cuda* c, const tl_cuda_batch* batch) {
    if (!c || !batch || (batch->T && (!batch->rows || !batch->hidden)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA forward: missing batch, rows or hidden");
    return batch->T == 0 ? TL_OK : run_locked(c, forward_locked, batch);
}

/* tl_cuda_kv_from_rows under c->lock: the rows, (q, a) as the activations NQ would leave (q rows
 * zero-padded to the linear's cols_pad) staged in host_io and copied up, then write_kv on them as
 * plain rows (with act_block too: an h4 row is an integer input like any other, docs/spec.md
 * §5.4.1). */
static tl_status kv_from_rows_locked(tl_cuda* c, const tl_cuda_kv_rows* kv) {
    const tl_config* cfg = &c->cfg;
    const size_t T = kv->T, d = cfg->d_model;
    for (size_t t = 0; t < T; t++)
        if (!writes_ok(cfg, &kv->rows[t], kv->block_size) || kv->slot >= tl_n_layers(cfg, kv->rows[t].loops))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: bad row %zu (position %u, slot %u)", t,
                           kv->rows[t].pos, kv->slot);
    const tl_cu_linear* attn_qkv = &c->lin[tl_block_linear_index(tl_slot_at(cfg, kv->slot).block, TL_PART_QKV)];
    const size_t lda = attn_qkv->cols_pad, rb = rows_bytes(T), qb = tl_cu_round_up(T * lda, 64);
    TL_CU_TRY(reserve_kv_write(c, T));
    TL_CU_TRY(reserve(c, &c->io, rb, false, "rows and spans"));
    TL_CU_TRY(reserve(c, &c->host_io, rb + qb + T * sizeof(float), true, "rows and layer inputs (host)"));
    cudaStream_t st = c->stream;

    char* host = (char*)c->host_io.p; /* rows [T] | q [T][lda] | a [T] */
    int8_t* q = (int8_t*)(host + rb);
    memcpy(host, kv->rows, T * sizeof(tl_cuda_row));
    for (size_t t = 0; t < T; t++) {
        memcpy(q + t * lda, kv->q + t * d, d);
        memset(q + t * lda + d, 0, lda - d);
    }
    memcpy(host + rb + qb, kv->a, T * sizeof(float));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->io.p, host, rb, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync (rows)"));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->acts.p, q, T * lda, cudaMemcpyHostToDevice, st),
                          "cudaMemcpyAsync (layer inputs)"));
    TL_CU_TRY(tl_cu_check(cudaMemcpyAsync(c->ascale.p, host + rb + qb, T * sizeof(float), cudaMemcpyHostToDevice, st),
                          "cudaMemcpyAsync (layer input scales)"));
    TL_CU_TRY(write_kv(c, attn_qkv, (const tl_cuda_row*)c->io.p, T, kv->slot, kv->block_size, kv->head_bytes,
                       kv->kv_bits, false));
    return tl_cu_check(cudaStreamSynchronize(st), "cudaStreamSynchronize (KV from rows)");
}

extern "C" tl_status tl_cuda_kv_from_rows(tl_cuda* c, const tl_cuda_kv_rows* kv) {
    if (!c || !kv || (kv->T && (!kv->rows || !kv->q || !kv->a)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "CUDA KV from rows: missing rows or layer inputs");
    return kv->T == 0 ? TL_OK : run_locked(c, kv_from_rows_locked, kv);
}
