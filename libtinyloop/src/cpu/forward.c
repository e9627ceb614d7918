/* forward.c — the CPU pass (docs/spec.md §1, §4) of T rows: the embedding, the prelude, L
 * iterations of the core (step norm, injection adapter, k blocks; or a two-state core's C low
 * cycles and its high stack on the states h in x and l in inject), then coda_norm and the coda
 * in the depth's own slots, each block application a layer with its own KV cache slot. The rows
 * are either a chunk of one sequence (positions n .. n+T-1) or one new token of each of T
 * sequences (batched decode); either way row t knows its sequence and position, and nothing
 * else differs.
 *
 * A batch may mix depths: its rows are ordered by depth, deepest first, so iteration i runs on
 * the first `active` rows (those deeper than i), and the rows whose depth is exactly i + 1 (the
 * last of those) then run coda_norm and the coda at that depth and leave with their final state.
 * A batch row may carry an exit rule (adaptive depth, docs/spec.md §5.7; forward_exits.c):
 * after iteration i a row whose rule fires copies its KV of iteration i into its deeper core
 * slots, moves behind the rows that go on and leaves too, running the coda in its own depth's
 * slots (unless a kl or argmax probe has run it already: done); rows without a rule run
 * exactly as before. The pass's state (struct fwd) is in cpu/pass.h.
 * A prefix build (loop_states) also finishes every shallower depth on a copy of the state after
 * each iteration, writing that depth's coda slots and keeping the last row's final state.
 * A chunk runs as a part pass (core/forward.h's tl_part): it may stop at a depth below the
 * sequence's (ending in another depth's coda slots) and resume from kept states, skipping the
 * embedding, the prelude and the iterations before first_iter; tl_forward is the whole part.
 * A wave pass (tl_cpu_forward_wave, docs/spec.md §5.6.1) runs rows of one sequence at several
 * core iterations at once: each core block runs every row in its own iteration's slot
 * (tl_fwd_row_slot), so the block's weights are read once for all of them; its rows at
 * iteration 0 first run the embedding and prelude, and the rows that end then run the coda
 * and the head together, gathered.
 * A chunk of a hidden-state prefix build hands every layer's input rows to its sequence's
 * capture (core/hidden.h); tl_cpu_kv_from_rows runs only a layer's attn_qkv and KV write, on
 * the stored rows of such a prefix.
 *
 * With block activations (act_block, docs/spec.md §2.2.1, §4) every linear's input is NQB or QB
 * instead of NQ or Q8, each token's integers split into two digit rows of acts (matmul.h); the
 * KV rebuilt from a hidden-state prefix's h4 rows reads them as plain rows (§5.4.1).
 * Per layer, every step is either a linear over all T tokens (tl_linear_run: a GEMM split
 * over the pool by rows) or a per-token / per-(token, head) task split over the pool (on AMX,
 * the attention of a chunk of two rows or more per (slice of 16-row tiles, kv head):
 * tl_attend_tile, the slice's values packed once by tl_attn_pack_slice). Each
 * output element is computed by exactly one task from inputs that no concurrent task writes,
 * so the thread count never changes a bit. In a loop layer (loop attention, docs/spec.md §4: a
 * core application of an iteration i >= 1 of a loop model) a row's query heads attend twice,
 * globally over iteration 0's slot into o and locally over their own slot through W' into
 * o_local (both on tiles or alone, as any layer's), then one row task mixes the two per head
 * and quantizes the result (task_loop_attention). All scratch lives in one arena owned by the
 * sequence (a batch borrows its first sequence's), grown only when a bigger chunk, or a history
 * longer by KEYS_STEP keys, arrives: a decode step allocates nothing.
 * Not here: choosing the device (core/backend.h; this pass is the CPU backend's, backend_cpu.c).
 *
 * Shapes (per token): x [d], qkv [(H + 2G) * D] (Q heads, K heads, V heads; with the attention
 * gate H * D gate rows after them), o [H * D], gu [2F] (gate, then up; the gate half is
 * overwritten by silu(gate) * up).
 */
#include "cpu/forward.h"

#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "cpu/pass.h"
#include "cpu/quant.h"
#include "cpu/threadpool.h"



/* ---- scratch ------------------------------------------------------------------------------ */

enum { KEYS_STEP = 256 }; /* attention scratch grows by this many keys at a time */

/* Runs of this many rows or more at consecutive positions of one sequence (a chunk, a prefill
 * span of a batch) run attention on AMX tiles (tl_attend_tile), which read each key block once
 * for all the rows of a tile: from two rows on that beats per-row attention (a verify pass of
 * 4 / 8 rows, 15% / 27% faster on the demo model); the emulated build, whose linears take tiles
 * from one row on, runs every row's attention on them too. */
enum { ATTN_TILE_MIN_ROWS = TL_AMX_MIN_TOKENS < 2 ? TL_AMX_MIN_TOKENS : 2 };

static bool attends_on_tiles(const tl_engine* e, size_t run) {
    return e->isa == TL_ISA_AMX && run >= ATTN_TILE_MIN_ROWS;
}

/* Lays out every buffer of f in the arena at c (measure first with c->base == NULL): S > 0 for
 * a batch of S spans, whose longest is max_run rows (a chunk: S = 0, max_run = T). The batch
 * buffers only for a batch, the exit rules' only for a batch with one (adaptive), the side
 * state only for a prefix build, a batch with probes or a wave pass (its ending rows). */
static void layout(fwd* f, tl_carve* c, unsigned workers, size_t max_keys, size_t S, size_t max_run, bool build,
                   exit_needs x, bool wave) {
    const tl_config* cfg = f->c;
    const size_t T = f->T, D = cfg->head_dim, state = T * cfg->d_model * sizeof(float);
    size_t kmax = cfg->d_model > f->hd ? cfg->d_model : f->hd;
    if (cfg->ffn_dim > kmax) kmax = cfg->ffn_dim;
    kmax = f->kmax = tl_acts_stride(kmax);
    const bool digits = cfg->act_block != 0;
    const size_t q_rows = digits ? 2 * T : T; /* a token's two digit rows with act_block */
    f->seqs = tl_take(c, T * sizeof(tl_seq*));
    f->pos = tl_take(c, T * sizeof(size_t));
    f->tokens = tl_take(c, T * sizeof(int32_t));
    f->x = tl_take(c, state);
    f->inject = tl_take(c, tl_has_inject(cfg) ? state : 0);
    f->high = tl_take(c, cfg->core_cycles ? state : 0);
    f->side = tl_take(c, (build && tl_has_coda(cfg)) || x.probes || wave ? state : 0);
    f->iters = wave ? tl_take(c, T * sizeof(uint32_t)) : NULL;
    f->y = tl_take(c, cfg->block_layout == TL_LAYOUT_SANDWICH ? state : 0);
    f->qkv = tl_take(c, T * f->qkv_dim * sizeof(float));
    f->o = tl_take(c, T * f->hd * sizeof(float));
    f->o_local = tl_take(c, cfg->loop_window ? T * f->hd * sizeof(float) : 0);
    f->gu = tl_take(c, T * 2 * (size_t)cfg->ffn_dim * sizeof(float));
    f->acts.digits = digits;
    f->acts.q = tl_take(c, q_rows * kmax);
    f->acts.tiled = tl_take(c, tl_acts_tiled_bytes(f->e->isa, q_rows, kmax));
    f->acts.qx = tl_take(c, q_rows * kmax);
    f->acts.scale = tl_take(c, T * sizeof(float));
    f->acts.scratch_bytes = tl_linear_scratch_bytes(f->e->isa, q_rows, kmax);
    f->acts.scratch = tl_take(c, workers * f->acts.scratch_bytes);
    f->acts.raw = tl_take(c, digits ? workers * tl_acts_raw_bytes(T) : 0);
    f->block_p = digits ? tl_take(c, workers * kmax * sizeof(int16_t)) : NULL;
    f->attn = tl_take(c, workers * sizeof(tl_attn_scratch));
    /* only where run_block runs attention on tiles: the tile scratch grows with the whole history */
    const bool tiles = attends_on_tiles(f->e, max_run);
    const size_t tile_bytes = tiles ? tl_attn_tile_bytes(max_keys, &f->e->kv_geom) : 0;
    f->alone = tl_take(c, T * sizeof(size_t));
    f->slices = tl_take(c, tiles ? T * cfg->n_kv_heads * sizeof(attn_slice) : 0);
    for (unsigned w = 0; w < workers; w++) {
        tl_attn_scratch s = {tl_take(c, max_keys * sizeof(float)), tl_take(c, max_keys * sizeof(int32_t)),
                             tl_take(c, D * sizeof(int64_t)), tl_take(c, D), tl_take(c, D * sizeof(int16_t)),
                             tl_take(c, tile_bytes), tl_take(c, tl_attn_rows_bytes(&f->e->kv_geom)),
                             tiles ? max_keys : 0};
        if (f->attn) f->attn[w] = s;
    }
    f->order = tl_take(c, S ? T * sizeof(size_t) : 0);
    f->first = tl_take(c, S * sizeof(size_t));
    f->heads = tl_take(c, S * cfg->d_model * sizeof(float));
    f->head_span = tl_take(c, S * sizeof(size_t));
    f->logits = tl_take(c, (wave ? T : S) * cfg->vocab_size * sizeof(float));
    f->ends = tl_take(c, S ? T * sizeof(uint32_t) : 0);
    f->exits = x.adaptive ? tl_take(c, T * sizeof(tl_exit_state)) : NULL;
    f->prev = tl_take(c, x.adaptive ? state : 0);
    f->from = tl_take(c, x.adaptive ? T * sizeof(size_t) : 0);
    f->moved = tl_take(c, x.adaptive ? T * tl_fwd_moved_row(cfg) : 0);
    f->done = x.probes ? tl_take(c, T) : NULL;
    f->probe_at = tl_take(c, x.probes ? T * sizeof(size_t) : 0);
    f->pseqs = tl_take(c, x.probes || wave ? T * sizeof(tl_seq*) : 0);
    f->ppos = tl_take(c, x.probes || wave ? T * sizeof(size_t) : 0);
    f->klz = tl_take(c, x.kl_rows * cfg->vocab_size * sizeof(float));
    f->klw = tl_take(c, x.kl_rows * cfg->vocab_size * sizeof(int32_t));
}

/* ---- per-token tasks ------------------------------------------------------------------------ */

/* acts q row r holds its `cols` values: zero the rest of the row, then (SIMD kernels) fill its qx. */
static void finish_q_row(tl_acts* acts, size_t r, size_t cols, bool simd) {
    memset(acts->q + r * acts->stride + cols, 0, acts->stride - cols);
    if (simd) tl_acts_finish_row(acts, r);
}

/* Token t of acts from x[n], a linear's input (docs/spec.md §4): NQ (rms) or Q8 through the row
 * form `rows` (every form gives the same bits); with digit rows (act_block) their block forms NQB
 * or QB (§2.2.1) through p[n], split into the digit rows 2t and 2t + 1 (§3). Then the token's
 * scale, and its rows finished. */
static void quantize_into(tl_acts* acts, size_t t, const float* x, size_t n, bool rms, const tl_config* c,
                          const tl_row_kernels* rows, int16_t* p, bool simd) {
    if (!acts->digits) {
        int8_t* q = acts->q + t * acts->stride;
        acts->scale[t] = rms ? rows->rms_quantize(x, n, c->rms_eps, q) : rows->quantize(x, n, 127, q);
        finish_q_row(acts, t, n, simd);
        return;
    }
    acts->scale[t] = rms ? tl_block_rms_quantize_row(x, n, c->act_block, c->rms_eps, p)
                         : tl_block_quantize_row(x, n, c->act_block, p);
    int8_t* high = acts->q + 2 * t * acts->stride;
    tl_split_digits(p, n, high, high + acts->stride);
    finish_q_row(acts, 2 * t, n, simd);
    finish_q_row(acts, 2 * t + 1, n, simd);
}

/* quantize_into the pass's acts, through the worker's block scratch. */
static void quantize_token(fwd* f, size_t t, const float* x, size_t n, bool rms, unsigned worker) {
    int16_t* p = f->block_p ? f->block_p + worker * f->kmax : NULL;
    quantize_into(&f->acts, t, x, n, rms, f->c, f->rows, p, f->simd);
}

/* (q, s) = Q8(x[n]) in the pass's row form (every form gives the same bits). */
static float q8_row(const fwd* f, const float* x, size_t n, int8_t* q) { return f->rows->quantize(x, n, 127, q); }

/* acts token t = NQ or Q8 (with act_block NQB or QB) of q_src row t. */
static void task_quantize(void* ctx, size_t t, unsigned worker) {
    fwd* f = ctx;
    quantize_token(f, t, f->q_src + t * f->q_src_stride, f->q_cols, f->q_rms, worker);
}

static void quantize_rows(fwd* f, const float* src, size_t src_stride, size_t cols, bool rms) {
    f->q_src = src;
    f->q_src_stride = src_stride;
    f->q_cols = cols;
    f->q_rms = rms;
    f->acts.n = f->T;
    f->acts.stride = tl_acts_stride(cols);
    tl_pool_run(f->e->pool, f->T, task_quantize, f);
}

/* rn_rows row t := RN(it, rn_gain) (rn_gain NULL: the weightless RN); with rn_add, x row t +=
 * that too (the sandwich residual). */
static void task_norm(void* ctx, size_t t, unsigned worker) {
    (void)worker;
    fwd* f = ctx;
    const size_t d = f->c->d_model;
    float* row = f->rn_rows + t * d;
    tl_rms_norm_row(row, f->rn_gain, d, f->c->rms_eps, row);
    if (!f->rn_add) return;
    float* x = f->x + t * d;
    for (size_t i = 0; i < d; i++) x[i] = x[i] + row[i];
}

static void norm_rows(fwd* f, float* rows, const float* gain, bool add_to_x) {
    f->rn_rows = rows;
    f->rn_gain = gain;
    f->rn_add = add_to_x;
    tl_pool_run(f->e->pool, f->T, task_norm, f);
}

/* Row x[D] of one K or V head into its cache row (docs/spec.md §4): Q8 in an int8 cache; Q4,
 * through the worker's free query row qq, packed two per byte in an int4 one. Returns the scale. */
static float kv_row(const fwd* f, const float* x, size_t D, int8_t* row, unsigned worker) {
    if (f->e->kv_geom.kv_bits == 8) return q8_row(f, x, D, row);
    int8_t* q = f->attn[worker].qq;
    const float s = f->rows->quantize(x, D, 7, q);
    tl_kv_pack4(q, D, row);
    return s;
}

/* RoPE on token t's Q and K heads, then Q8 (Q4 in an int4 cache) of each K and V head into the
 * cache. */
static void task_kv_write(void* ctx, size_t t, unsigned worker) {
    fwd* f = ctx;
    const tl_config* c = f->c;
    const size_t D = c->head_dim, pos = f->pos[t];
    const float* cos = f->e->file.rope_cos + pos * (D / 2);
    const float* sin = f->e->file.rope_sin + pos * (D / 2);
    float* z = f->qkv + t * f->qkv_dim;
    for (uint32_t h = 0; h < c->n_heads + c->n_kv_heads; h++) tl_rope_head(z + h * D, D, cos, sin);
    const tl_kv_geom* g = &f->e->kv_geom;
    const tl_kv_table* kv = &f->seqs[t]->kv;
    const tl_kv_span* span = &kv->spans[tl_kv_find(kv, pos)];
    const size_t slot = pos - span->start, R = tl_kv_row_bytes(g);
    const uint32_t layer = tl_fwd_row_slot(f, t);
    for (uint32_t h = 0; h < c->n_kv_heads; h++) {
        const float* k = z + ((size_t)c->n_heads + h) * D;
        const float* v = z + ((size_t)c->n_heads + c->n_kv_heads + h) * D;
        tl_kv_key_scales(g, span->block, layer, h)[slot] =
            kv_row(f, k, D, tl_kv_keys(g, span->block, layer, h) + slot * R, worker);
        tl_kv_value_scales(g, span->block, layer, h)[slot] =
            kv_row(f, v, D, tl_kv_values(g, span->block, layer, h) + slot * R, worker);
    }
}

/* The layer's attention work: each run of rows at consecutive positions of one sequence long
 * enough for tiles (attends_on_tiles) as slices (f->slices): per kv head, the run's tiles of
 * TL_ATTN_TILE rows cut into as few slices as give the pool about two tasks per worker, since
 * each slice packs its values once; every other row alone (f->alone). Returns the tasks' count:
 * the slices, then each lone row's query heads. */
static size_t plan_attention(fwd* f) {
    const size_t G = f->c->n_kv_heads, per_head = (2 * (size_t)tl_pool_threads(f->e->pool) + G - 1) / G;
    f->n_alone = f->n_slices = 0;
    for (size_t r = 0, g; r < f->T; r = g) {
        for (g = r + 1; g < f->T && f->seqs[g] == f->seqs[r] && f->pos[g] == f->pos[g - 1] + 1 &&
                        tl_fwd_row_slot(f, g) == tl_fwd_row_slot(f, r);
             g++)
            continue;
        if (!attends_on_tiles(f->e, g - r)) {
            for (size_t t = r; t < g; t++) f->alone[f->n_alone++] = t;
            continue;
        }
        const size_t tiles = (g - r + TL_ATTN_TILE - 1) / TL_ATTN_TILE, cuts = per_head < tiles ? per_head : tiles;
        for (size_t k = 0; k < cuts; k++) {
            const size_t t0 = r + k * tiles / cuts * TL_ATTN_TILE;
            const size_t t1 = k + 1 == cuts ? g : r + (k + 1) * tiles / cuts * TL_ATTN_TILE;
            for (uint32_t h = 0; h < G; h++) f->slices[f->n_slices++] = (attn_slice){t0, t1 - t0, h};
        }
    }
    return f->n_slices + f->n_alone * f->c->n_heads;
}

/* One attention of a row's query heads (docs/spec.md §4.1): over cache slot `layer`, its keys
 * seen through `window`, into o ([T][hd]). */
typedef struct attn_read {
    uint32_t layer, window;
    float* o;
} attn_read;

/* The attentions row t runs in the current layer, into reads; returns their count: one over its
 * slot with its sequence's window into o, or in a loop layer (docs/spec.md §4, tl_loop_slot) the
 * global one over iteration 0's slot with that window into o and the local one over its own slot
 * through W' into o_local. */
static size_t attn_reads(const fwd* f, size_t t, attn_read reads[2]) {
    const tl_seq* s = f->seqs[t];
    const uint32_t slot = tl_fwd_row_slot(f, t);
    uint32_t global;
    if (!tl_loop_slot(f->c, slot, &global)) {
        reads[0] = (attn_read){slot, s->window, f->o};
        return 1;
    }
    reads[0] = (attn_read){global, s->window, f->o};
    reads[1] = (attn_read){slot, tl_loop_local_window(s->window, f->c->loop_window), f->o_local};
    return 2;
}

/* r->o[t][h] = attention r of query head h of row t for the slice's rows and its kv head's query
 * heads, tile by tile, the values of r's layer packed once when every tile's queries see keys
 * from 0 through r's window. */
static void attend_slice_read(fwd* f, const attn_slice* a, const attn_read* r, tl_attn_scratch* scratch) {
    const tl_config* c = f->c;
    const tl_seq* s = f->seqs[a->t0];
    const size_t D = c->head_dim, group = c->n_heads / c->n_kv_heads,
                 keys = tl_attn_last_key(f->pos[a->t0 + a->m - 1], s->instruction) + 1;
    size_t packed = 0;
    if (r->window == 0 || keys <= r->window) {
        tl_attn_pack_slice(&f->e->kv_geom, &s->kv, r->layer, a->kv_head, keys, scratch);
        packed = keys;
    }
    for (size_t t = a->t0; t < a->t0 + a->m; t += TL_ATTN_TILE) {
        const size_t m = a->t0 + a->m - t < TL_ATTN_TILE ? a->t0 + a->m - t : TL_ATTN_TILE;
        for (size_t h = a->kv_head * group; h < (a->kv_head + 1) * group; h++)
            tl_attend_tile(f->attn_kernels, &f->e->kv_geom, &s->kv, r->layer, a->kv_head, f->pos[t], m, r->window,
                           s->instruction, f->qkv + t * f->qkv_dim + h * D, f->qkv_dim, r->o + t * f->hd + h * D,
                           f->hd, packed, scratch);
    }
}

/* The slice's attentions (attn_reads of its rows, which share their slot), one after the other:
 * each packs its own layer's values. */
static void attend_slice(fwd* f, const attn_slice* a, tl_attn_scratch* scratch) {
    attn_read reads[2];
    const size_t n = attn_reads(f, a->t0, reads);
    for (size_t k = 0; k < n; k++) attend_slice_read(f, a, &reads[k], scratch);
}

/* task < n_slices: slice `task`; after them, (i * H + h): query head h of lone row alone[i]. */
static void task_attention(void* ctx, size_t task, unsigned worker) {
    fwd* f = ctx;
    if (task < f->n_slices) {
        attend_slice(f, &f->slices[task], &f->attn[worker]);
        return;
    }
    task -= f->n_slices;
    const tl_config* c = f->c;
    const size_t H = c->n_heads, D = c->head_dim, h = task % H, t = f->alone[task / H];
    const uint32_t kv_head = (uint32_t)(h / (H / c->n_kv_heads));
    const tl_seq* s = f->seqs[t];
    attn_read reads[2];
    const size_t n = attn_reads(f, t, reads);
    for (size_t k = 0; k < n; k++)
        tl_attend(f->attn_kernels, &f->e->kv_geom, &s->kv, reads[k].layer, kv_head, f->pos[t], reads[k].window,
                  s->instruction, f->qkv + t * f->qkv_dim + h * D, reads[k].o + t * f->hd + h * D, &f->attn[worker]);
}

/* gate := silu(gate) * up, then acts token t = Q8 (QB) of it. */
static void task_swiglu(void* ctx, size_t t, unsigned worker) {
    fwd* f = ctx;
    const size_t F = f->c->ffn_dim;
    float* gate = f->gu + t * 2 * F;
    const float* up = gate + F;
    f->rows->swiglu(gate, up, F);
    quantize_token(f, t, gate, F, false, worker);
}

/* o row t *= sig(its gate rows of qkv), then acts token t = Q8 (QB) of it (docs/spec.md §4). */
static void task_attn_gate(void* ctx, size_t t, unsigned worker) {
    fwd* f = ctx;
    float* o = f->o + t * f->hd;
    f->rows->gate(o, f->qkv + t * f->qkv_dim + f->qkv_dim - f->hd, f->hd);
    quantize_token(f, t, o, f->hd, false, worker);
}

/* In a loop layer (docs/spec.md §4), o row t := the per-head gated mix of its global attention
 * (o) and its local one (o_local), the gates from its query heads; then acts token t = Q8 (QB)
 * of o. */
static void task_loop_attention(void* ctx, size_t t, unsigned worker) {
    fwd* f = ctx;
    const tl_config* c = f->c;
    const tl_block_vectors* vec = &f->e->file.blocks[f->block];
    float* o = f->o + t * f->hd;
    uint32_t global;
    if (tl_loop_slot(c, tl_fwd_row_slot(f, t), &global))
        tl_loop_mix_row(f->qkv + t * f->qkv_dim, vec->loop_gate_w, vec->loop_gate_s, vec->loop_gate_b, c->n_heads,
                        c->head_dim, o, f->o_local + t * f->hd, f->attn[worker].qq);
    quantize_token(f, t, o, f->hd, false, worker);
}

/* acts = Q8(o) (QB), after the attention gate or loop attention's mix when the model has one. */
static void quantize_attention(fwd* f) {
    if (!f->c->attn_gate && !f->c->loop_window) {
        quantize_rows(f, f->o, f->hd, f->hd, false);
        return;
    }
    f->acts.n = f->T;
    f->acts.stride = tl_acts_stride(f->hd);
    tl_pool_run(f->e->pool, f->T, f->c->attn_gate ? task_attn_gate : task_loop_attention, f);
}

/* ---- the pass ------------------------------------------------------------------------------ */

/* x = residual(x, linear(lin; acts), gain) for the model's block_layout (docs/spec.md §4):
 * pre x + y, sandwich x + RN(y, gain), post RN(x + y, gain). */
static void residual(fwd* f, const tl_linear* lin, const float* gain) {
    const size_t d = f->c->d_model;
    const bool sandwich = f->c->block_layout == TL_LAYOUT_SANDWICH;
    tl_linear_run(lin, &f->acts, sandwich ? f->y : f->x, d, !sandwich, f->e->pool);
    if (f->c->block_layout != TL_LAYOUT_PRE) norm_rows(f, sandwich ? f->y : f->x, gain, sandwich);
}

/* The KV of the rows at cache slot f->layer from acts (each row's attention input, NQ of the
 * layer's input): qkv = linear(attn_qkv of block `block`; acts) (+ bias), then RoPE and the K
 * and V heads into the cache. */
static void write_kv(fwd* f, uint32_t block) {
    const tl_block_vectors* vec = &f->e->file.blocks[block];
    if (vec->qkv_bias) /* y + b, as b + y: one f32 addition either way */
        for (size_t t = 0; t < f->T; t++) memcpy(f->qkv + t * f->qkv_dim, vec->qkv_bias, f->qkv_dim * sizeof(float));
    tl_linear_run(&f->linears[tl_block_linear_index(block, TL_PART_QKV)], &f->acts, f->qkv, f->qkv_dim,
                  vec->qkv_bias != NULL, f->e->pool);
    tl_pool_run(f->e->pool, f->T, task_kv_write, f);
}

/* Block `block` (file order) on the rows, as the layer of cache slot `slot`. A chunk of a
 * hidden-state prefix build first hands the layer's input rows to its capture. */
static void run_block(fwd* f, uint32_t block, size_t slot) {
    const tl_config* c = f->c;
    const size_t d = c->d_model, F = c->ffn_dim;
    tl_pool* pool = f->e->pool;
    const tl_linear* part = &f->linears[tl_block_linear_index(block, 0)]; /* part p at part[p] */
    const tl_block_vectors* vec = &f->e->file.blocks[block];
    f->layer = (uint32_t)slot;
    f->block = block;

    if (f->chunk && f->seqs[0]->capture) tl_hidden_capture(f->seqs[0]->capture, f->layer, f->pos[0], f->T, f->x);
    quantize_rows(f, f->x, d, d, true);
    write_kv(f, block);
    tl_pool_run(pool, plan_attention(f), task_attention, f);
    quantize_attention(f);
    residual(f, &part[TL_PART_OUT], vec->attn_post_norm);

    quantize_rows(f, f->x, d, d, true);
    tl_linear_run(&part[TL_PART_GATE_UP], &f->acts, f->gu, 2 * F, false, pool);
    f->acts.stride = tl_acts_stride(F);
    tl_pool_run(pool, f->T, task_swiglu, f);
    residual(f, &part[TL_PART_DOWN], vec->ffn_post_norm);
}

/* The start of injection (docs/spec.md §4.4), on the prelude's output e in x: inject =
 * linear(adapter_inject; Q8(e)), the same term at every iteration; then the state is zero. */
static void begin_injection(fwd* f) {
    const size_t d = f->c->d_model;
    quantize_rows(f, f->x, d, d, false);
    tl_linear_run(&f->linears[tl_adapter_linear_index(f->c, 1)], &f->acts, f->inject, d, false, f->e->pool);
    memset(f->x, 0, f->T * d * sizeof(float));
}

/* The adapter: x = linear(adapter_state; Q8(x)) + inject, added as inject + linear (one f32
 * addition either way). */
static void adapter(fwd* f) {
    const size_t d = f->c->d_model;
    quantize_rows(f, f->x, d, d, false);
    memcpy(f->x, f->inject, f->T * d * sizeof(float));
    tl_linear_run(&f->linears[tl_adapter_linear_index(f->c, 0)], &f->acts, f->x, d, true, f->e->pool);
}

/* The states entering iteration 0, on the prelude's output in x: with injection the injected
 * term and a zero state (begin_injection); a two-state core's l = 0 beside h = x (docs/spec.md
 * §1). */
static void begin_core(fwd* f) {
    if (f->c->injection) begin_injection(f);
    if (f->c->core_cycles) memset(f->inject, 0, f->T * f->c->d_model * sizeof(float));
}

/* x += high, one f32 addition per element: y = l + h (or h + l, the same bits). */
static void add_high(fwd* f) {
    const size_t n = f->T * f->c->d_model;
    for (size_t i = 0; i < n; i++) f->x[i] = f->x[i] + f->high[i];
}

/* A two-state core's applications of iteration i (docs/spec.md §1) on h in x and l in inject: h
 * held aside, then C low cycles (y = l + h, the low stack, l = RN(y)) and the high one (y = h +
 * l, the high stack, h = RN(y)). x ends as h, inject as l. */
static void two_state(fwd* f, uint32_t i) {
    const tl_config* c = f->c;
    const uint32_t n = c->n_core_blocks / 2, C = c->core_cycles;
    const size_t state = f->T * c->d_model * sizeof(float);
    memcpy(f->high, f->x, state);
    memcpy(f->x, f->inject, state);
    for (uint32_t cycle = 0; cycle <= C; cycle++) { /* the low cycles, then the high one */
        add_high(f);
        for (uint32_t a = cycle * n; a < (cycle + 1) * n; a++)
            run_block(f, c->n_pre_blocks + tl_core_block_of(c, a), tl_core_slot(c, i, a));
        norm_rows(f, f->x, NULL, false);
        if (cycle + 1 == C) memcpy(f->inject, f->x, state);
    }
}

/* The core applications of iteration i on the rows: the k blocks, or a two-state core's. */
static void run_core(fwd* f, uint32_t i) {
    const tl_config* c = f->c;
    if (c->core_cycles) {
        two_state(f, i);
        return;
    }
    for (uint32_t j = 0; j < c->n_core_blocks; j++) run_block(f, c->n_pre_blocks + j, tl_core_slot(c, i, j));
}

/* Core iteration i on the rows: the step norm (i >= 1), the adapter, the core's applications. */
static void iteration(fwd* f, uint32_t i) {
    const tl_config* c = f->c;
    if (c->step_norm && i > 0) norm_rows(f, f->x, f->e->file.step_norm, false);
    if (c->injection) adapter(f);
    run_core(f, i);
}

/* What narrow() changes: the pass's rows, put back by widen(). */
typedef struct rows_view {
    float* x;
    float* inject;
    tl_seq** seqs;
    size_t* pos;
    int32_t* tokens;
    size_t T;
} rows_view;

/* The pass narrowed to rows [lo, hi), their states in `state` (laid out as f->x), as a pass of
 * their own; returns the whole, for widen(). */
static rows_view narrow(fwd* f, float* state, size_t lo, size_t hi) {
    const size_t d = f->c->d_model;
    const rows_view whole = {f->x, f->inject, f->seqs, f->pos, f->tokens, f->T};
    f->x = state + lo * d;
    if (tl_has_inject(f->c)) f->inject += lo * d;
    f->seqs += lo;
    f->pos += lo;
    f->tokens += lo;
    f->T = hi - lo;
    return whole;
}

static void widen(fwd* f, const rows_view* whole) {
    f->x = whole->x;
    f->inject = whole->inject;
    f->seqs = whole->seqs;
    f->pos = whole->pos;
    f->tokens = whole->tokens;
    f->T = whole->T;
}

/* The end of depth `depth` for rows [lo, hi) of `state` (f->x or f->side): coda_norm, then the
 * coda blocks in depth `depth`'s slots. The rows' state becomes their final state. */
void tl_fwd_end_depth(fwd* f, float* state, size_t lo, size_t hi, uint32_t depth) {
    const tl_config* c = f->c;
    if (lo == hi || !tl_has_coda(c)) return;
    const rows_view whole = narrow(f, state, lo, hi);
    if (c->coda_norm) norm_rows(f, f->x, f->e->file.coda_norm, false);
    for (uint32_t j = 0; j < c->n_coda_blocks; j++)
        run_block(f, c->n_pre_blocks + c->n_core_blocks + j, tl_core_slot(c, depth - 1, tl_core_width(c) + j));
    widen(f, &whole);
}

static void embed(fwd* f) {
    const size_t d = f->c->d_model;
    const float embed_scale = f->c->embed_scale;
    for (size_t t = 0; t < f->T; t++) {
        const int8_t* row = f->e->file.emb_w + (size_t)f->tokens[t] * d;
        const float scale = f->e->file.emb_s[f->tokens[t]];
        for (size_t i = 0; i < d; i++) f->x[t * d + i] = ((float)row[i] * scale) * embed_scale;
    }
}

/* Lay out the scratch of T rows whose positions are all below max_keys in `scratch`, growing it
 * first if they do not fit: the pass's only allocation, and on failure nothing has changed. */
static tl_status begin(fwd* f, const tl_engine* e, const tl_linear* linears, size_t T, size_t max_keys, size_t S,
                       size_t max_run, bool build, exit_needs x, bool wave, tl_scratch* scratch) {
    memset(f, 0, sizeof *f);
    f->e = e;
    f->c = tl_engine_config(e);
    f->linears = linears;
    f->T = T;
    f->qkv_dim = tl_qkv_rows(f->c);
    f->hd = (size_t)f->c->n_heads * f->c->head_dim;
    f->simd = e->isa != TL_ISA_SCALAR;
    f->rows = tl_row_kernels_for(e->row_isa);
    f->attn_kernels = tl_attn_kernels_for(e->row_isa);
    f->chunk = S == 0;
    const unsigned workers = tl_pool_threads(e->pool);
    max_keys = (max_keys + KEYS_STEP - 1) / KEYS_STEP * KEYS_STEP;
    tl_carve arena = {0, NULL};
    layout(f, &arena, workers, max_keys, S, max_run, build, x, wave);
    const tl_status st = tl_scratch_fit(scratch, arena.used, "forward scratch");
    if (st != TL_OK) return st;
    arena = (tl_carve){0, scratch->base};
    layout(f, &arena, workers, max_keys, S, max_run, build, x, wave);
    return TL_OK;
}

/* The depth row r runs to: a chunk's part depth, a batch row's sequence depth or exit. */
static uint32_t row_depth(const fwd* f, size_t r) { return f->chunk ? f->depth : f->ends[r]; }

/* Whose coda slots row r's coda writes: a chunk's coda_depth, a batch row's sequence depth. */
static uint32_t coda_of(const fwd* f, size_t r) { return f->chunk ? f->coda_depth : f->seqs[r]->loops; }


/* Rows [lo, T) end now: coda_norm and the coda, each run of rows of one coda depth at once;
 * a row done with its probe already has its final state. */
static void end_rows(fwd* f, size_t lo) {
    for (size_t r = lo, g; r < f->T; r = g) {
        const uint32_t depth = coda_of(f, r);
        for (g = r + 1; g < f->T && coda_of(f, g) == depth && tl_fwd_done(f, g) == tl_fwd_done(f, r); g++) continue;
        if (!tl_fwd_done(f, r)) tl_fwd_end_depth(f, f->x, r, g, depth);
    }
}

/* logits[T][V] of the final states x[T][d]. */
void tl_fwd_head_rows(fwd* f, const float* x, float* logits) {
    const size_t d = f->c->d_model;
    quantize_rows(f, x, d, d, true);
    tl_linear_run(&f->linears[f->e->file.n_linears - 1], &f->acts, logits, f->c->vocab_size, false, f->e->pool);
}

/* The layers of the rows (ordered deepest first) from the embedding in x, or from iteration
 * first_iter's input state in x (and the injected terms or low states in inject); x ends as
 * each row's final state. A batch's rows with exit rules may end early (take_exits), still
 * deepest first. A
 * chunk's `part` (NULL for a batch) may ask for the state after the last iteration
 * (state_out), and a prefix build's (loop_states) ends every depth first_iter+1 .. depth-1 on a
 * copy of the state too, writing its coda slots, with loop_states[i] the last row's final state
 * at depth i + 1. */
static void run_layers(fwd* f, const tl_part* part) {
    const tl_config* c = f->c;
    const size_t d = c->d_model, rows = f->T;
    float* const states = part ? part->loop_states : NULL;
    if (f->first_iter == 0) {
        for (uint32_t b = 0; b < c->n_pre_blocks; b++) run_block(f, b, b);
        begin_core(f);
    }
    if (f->exits) tl_fwd_begin_exits(f);
    const uint32_t depth = row_depth(f, 0);
    for (uint32_t i = f->first_iter; i < row_depth(f, 0); i++) { /* row 0: the deepest going on */
        while (row_depth(f, f->T - 1) <= i) f->T--;
        iteration(f, i);
        if (f->done) tl_fwd_probe(f, i);
        if (f->exits) tl_fwd_take_exits(f, i);
        size_t lo = f->T; /* rows [lo, T) end at depth i + 1 */
        while (lo > 0 && row_depth(f, lo - 1) == i + 1) lo--;
        if (states && lo == f->T) { /* a shallower depth of a prefix build */
            const float* final = f->x;
            if (tl_has_coda(c)) {
                memcpy(f->side, f->x, f->T * d * sizeof(float));
                tl_fwd_end_depth(f, f->side, 0, f->T, i + 1);
                final = f->side;
            }
            memcpy(states + (size_t)i * d, final + (f->T - 1) * d, d * sizeof(float));
        }
        if (part && part->state_out && lo == 0) memcpy(part->state_out, f->x, rows * d * sizeof(float));
        end_rows(f, lo);
    }
    f->T = rows;
    if (states) memcpy(states + (size_t)(depth - 1) * d, f->x + (rows - 1) * d, d * sizeof(float));
}

/* logits[V] of the last row's final state (what tl_cpu_head_logits computes, in this scratch). */
static void head_last(fwd* f, float* logits) {
    const size_t rows = f->T;
    f->T = 1;
    tl_fwd_head_rows(f, f->x + (rows - 1) * f->c->d_model, logits);
    f->T = rows;
}

tl_status tl_cpu_forward(const tl_linear* linears, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0,
                         const tl_part* part, float* last_hidden) {
    fwd f;
    const exit_needs none = {false, false, 0};
    tl_status st = begin(&f, s->engine, linears, T, pos0 + T, 0, T, part->loop_states != NULL, none, false, &s->scratch);
    if (st != TL_OK) return st;
    f.first_iter = part->first_iter;
    f.depth = part->depth;
    f.coda_depth = part->coda_depth ? part->coda_depth : part->depth;
    for (size_t t = 0; t < T; t++) {
        f.seqs[t] = s;
        f.pos[t] = pos0 + t;
    }
    const size_t d = f.c->d_model, state = T * d * sizeof(float);
    if (part->first_iter == 0) {
        memcpy(f.tokens, tokens, T * sizeof *tokens);
        embed(&f);
    } else {
        memcpy(f.x, part->state_in, state);
        if (tl_has_inject(f.c)) memcpy(f.inject, part->inject_in, state);
    }
    run_layers(&f, part);
    if (part->inject_out && tl_has_inject(f.c)) memcpy(part->inject_out, f.inject, state);
    if (part->hidden_all) memcpy(part->hidden_all, f.x, state);
    if (last_hidden) memcpy(last_hidden, f.x + (T - 1) * d, d * sizeof(float));
    if (part->logits_all) tl_fwd_head_rows(&f, f.x, part->logits_all);
    if (part->logits_last) head_last(&f, part->logits_last);
    return TL_OK;
}

tl_status tl_cpu_kv_from_rows(const tl_linear* linears, tl_seq* s, uint32_t slot, size_t pos0, size_t T,
                              const int8_t* q, const float* a) {
    fwd f;
    const exit_needs none = {false, false, 0};
    tl_status st = begin(&f, s->engine, linears, T, 1, 0, 0, false, none, false, &s->scratch); /* no attention */
    if (st != TL_OK) return st;
    const size_t d = f.c->d_model;
    f.layer = slot;
    f.acts.n = T;
    f.acts.stride = tl_acts_stride(d);
    f.acts.digits = false; /* integer rows of i8 (an h4 row, with act_block too: docs/spec.md §5.4.1) */
    for (size_t t = 0; t < T; t++) {
        f.seqs[t] = s;
        f.pos[t] = pos0 + t;
        memcpy(f.acts.q + t * f.acts.stride, q + t * d, d);
        f.acts.scale[t] = a[t];
        finish_q_row(&f.acts, t, d, f.simd);
    }
    write_kv(&f, tl_slot_at(f.c, slot).block);
    return TL_OK;
}

tl_status tl_cpu_forward_spans(const tl_linear* linears, tl_seq* const* seqs, const int32_t* tokens,
                               const size_t* counts, size_t S, float* const* logits, const tl_exit* exits,
                               uint32_t* depths) {
    const tl_engine* e = seqs[0]->engine;
    size_t rows = 0, max_keys = 0, max_run = 0, widest = 0;
    exit_needs needs = {false, false, 0};
    for (size_t b = 0; b < S; b++) {
        const size_t n = counts ? counts[b] : 1;
        rows += n;
        if (seqs[b]->n + n > max_keys) max_keys = seqs[b]->n + n;
        if (n > max_run) {
            max_run = n;
            widest = b;
        }
        if (!exits || !tl_exit_active(&exits[b], seqs[b]->loops)) continue;
        bool latent, kl, probes;
        tl_exit_storage(&exits[b], seqs[b]->loops, &latent, &kl, &probes);
        needs.adaptive = true;
        needs.probes = needs.probes || probes;
        needs.kl_rows += kl;
    }
    fwd f;
    const size_t V = tl_engine_config(e)->vocab_size, d = tl_engine_config(e)->d_model;
    /* the widest span's arena: the one a prefill's own chunks grow anyway */
    tl_status st = begin(&f, e, linears, rows, max_keys, S, max_run, false, needs, false, &seqs[widest]->scratch);
    if (st != TL_OK) return st;
    f.rules = exits;
    f.out = logits;
    for (size_t b = 0, t = 0; b < S; t += counts ? counts[b] : 1, b++) f.first[b] = t;
    size_t* spans = f.head_span; /* the spans deepest first, until the head needs head_span */
    tl_sort_deepest_first(seqs, S, spans);
    for (size_t k = 0, r = 0; k < S; k++) {
        const size_t b = spans[k], n = counts ? counts[b] : 1;
        for (size_t i = 0; i < n; i++, r++) {
            f.seqs[r] = seqs[b];
            f.pos[r] = seqs[b]->n + i;
            f.tokens[r] = tokens[f.first[b] + i];
            f.ends[r] = seqs[b]->loops;
            f.order[r] = b;
        }
    }
    embed(&f);
    run_layers(&f, NULL);
    size_t heads = 0; /* the last rows of the spans that want logits, but the done ones (probed) */
    for (size_t r = 0; r < rows; r++) {
        const size_t b = f.order[r];
        if (f.pos[r] + 1 != f.seqs[r]->n + (counts ? counts[b] : 1)) continue;
        memcpy(f.seqs[r]->last_hidden, f.x + r * d, d * sizeof(float));
        if (depths) depths[b] = f.ends[r];
        if (logits[b] && !tl_fwd_done(&f, r)) {
            memcpy(f.heads + heads * d, f.x + r * d, d * sizeof(float));
            f.head_span[heads++] = b;
        }
    }
    f.T = heads;
    if (heads) tl_fwd_head_rows(&f, f.heads, f.logits);
    for (size_t h = 0; h < heads; h++) memcpy(logits[f.head_span[h]], f.logits + h * V, V * sizeof(float));
    return TL_OK;
}

/* A wave pass's core iteration: each row runs its own iteration, iters[t], of the core blocks
 * in that iteration's slots (the blocks' weights read once for all); the step norm on the rows
 * past iteration 0 only: [0, fresh), the fresh rows being last. */
static void wave_iteration(fwd* f, size_t fresh) {
    const tl_config* c = f->c;
    if (c->step_norm && fresh > 0) {
        const rows_view whole = narrow(f, f->x, 0, fresh);
        norm_rows(f, f->x, f->e->file.step_norm, false);
        widen(f, &whole);
    }
    if (c->injection) adapter(f);
    f->per_row_slots = true;
    run_core(f, 0);
    f->per_row_slots = false;
}

tl_status tl_cpu_forward_wave(const tl_linear* linears, tl_seq* s, const tl_wave_row* rows, size_t R) {
    size_t max_keys = 0;
    for (size_t r = 0; r < R; r++)
        if (rows[r].pos + 1 > max_keys) max_keys = rows[r].pos + 1;
    fwd f;
    const exit_needs none = {false, false, 0};
    /* max_run R: runs of consecutive positions in one slot (the ending rows' coda) may use tiles */
    tl_status st = begin(&f, s->engine, linears, R, max_keys, 0, R, false, none, true, &s->scratch);
    if (st != TL_OK) return st;
    f.chunk = false; /* rows at several iterations: no hidden-state capture */
    const tl_config* c = f.c;
    const size_t d = c->d_model, V = c->vocab_size, state = d * sizeof(float);
    size_t fresh = R; /* rows [fresh, R) start at iteration 0 */
    while (fresh > 0 && rows[fresh - 1].iter == 0) fresh--;
    for (size_t r = 0; r < R; r++) {
        f.seqs[r] = s;
        f.pos[r] = rows[r].pos;
        f.iters[r] = rows[r].iter;
        f.tokens[r] = rows[r].token;
        if (r >= fresh) continue;
        memcpy(f.x + r * d, rows[r].state, state);
        if (tl_has_inject(c)) memcpy(f.inject + r * d, rows[r].inject, state);
    }
    if (fresh < R) {
        const rows_view whole = narrow(&f, f.x, fresh, R);
        embed(&f);
        for (uint32_t b = 0; b < c->n_pre_blocks; b++) run_block(&f, b, b);
        begin_core(&f);
        widen(&f, &whole);
    }
    wave_iteration(&f, fresh);
    size_t m = 0; /* the rows that end at depth s->loops now, gathered in side */
    for (size_t r = 0; r < R; r++) {
        memcpy(rows[r].state, f.x + r * d, state);
        if ((r >= fresh && c->injection) || c->core_cycles) /* a low state changes every iteration */
            memcpy(rows[r].inject, f.inject + r * d, state);
        if (!rows[r].logits) continue;
        memcpy(f.side + m * d, f.x + r * d, state);
        f.pseqs[m] = s;
        f.ppos[m++] = rows[r].pos;
    }
    if (m == 0) return TL_OK;
    f.seqs = f.pseqs;
    f.pos = f.ppos;
    f.T = m;
    tl_fwd_end_depth(&f, f.side, 0, m, s->loops);
    tl_fwd_head_rows(&f, f.side, f.logits);
    for (size_t r = 0, h = 0; r < R; r++) {
        if (!rows[r].logits) continue;
        memcpy(rows[r].logits, f.logits + h * V, V * sizeof(float));
        if (rows[r].hidden) memcpy(rows[r].hidden, f.side + h * d, state);
        h++;
    }
    return TL_OK;
}

/* The buffers of one token's head input (tl_cpu_head_logits) in the arena at c (measure first
 * with c->base == NULL): acts for the linear, p for NQB's integers. */
static void head_layout(tl_carve* c, const tl_engine* e, tl_acts* acts, int16_t** p) {
    const tl_config* cfg = tl_engine_config(e);
    const size_t d = cfg->d_model, rows = tl_acts_rows(acts), workers = tl_pool_threads(e->pool);
    acts->q = tl_take(c, rows * acts->stride);
    acts->qx = tl_take(c, rows * acts->stride);
    acts->scale = tl_take(c, sizeof(float));
    acts->scratch_bytes = tl_linear_scratch_bytes(e->isa, rows, d);
    acts->scratch = tl_take(c, workers * acts->scratch_bytes);
    acts->tiled = tl_take(c, tl_acts_tiled_bytes(e->isa, rows, d));
    acts->raw = tl_take(c, acts->digits ? workers * tl_acts_raw_bytes(1) : 0);
    *p = tl_take(c, acts->digits ? d * sizeof(int16_t) : 0);
}

tl_status tl_cpu_head_logits(const tl_linear* head, const tl_engine* e, const float* x, float* logits) {
    const tl_config* c = tl_engine_config(e);
    const size_t d = c->d_model;
    tl_acts acts = {.n = 1, .stride = tl_acts_stride(d), .digits = c->act_block != 0};
    int16_t* p;
    tl_carve arena = {0, NULL};
    head_layout(&arena, e, &acts, &p);
    arena.base = tl_alloc(arena.used);
    if (!arena.base) return tl_fail_oom("head scratch");
    arena.used = 0;
    head_layout(&arena, e, &acts, &p);
    quantize_into(&acts, 0, x, d, true, c, tl_row_kernels_for(e->row_isa), p, e->isa != TL_ISA_SCALAR);
    tl_linear_run(head, &acts, logits, 0, false, e->pool);
    tl_free(arena.base);
    return TL_OK;
}
