/* test_cuda_describe.c — the host side of the CUDA forward pass, on the CPU:
 *  - how tl_cuda_describe turns sequences (span tables, windows, reserved positions) into the
 *    rows and KV spans the device reads: two sequences, one windowed, several blocks, some
 *    released;
 *  - how tl_cuda_describe_writes turns positions of a sequence into the rows of a K/V write from
 *    layer inputs (a hidden-state prefix's rebuild), or refuses positions outside its live blocks;
 *  - the pass schedule of cuda/pass.h (which rows run which step, on which state, writing which
 *    cache slot), recorded per row and compared with docs/spec.md §1 / §4 / §5.4 written out
 *    independently: the slot table's formulas, not tl_slot_at, a two-state core's cycles
 *    included; for whole passes (mixed depths,
 *    prefix builds) and for part passes (core/forward.h's tl_part): a draft (its coda in a deeper
 *    depth's slots, its state kept), the verification resumed from it, a warm-start build's
 *    base and its extension. */
#include <stdbool.h>
#include <string.h>

#include "core/engine.h"
#include "core/seq.h"
#include "cuda/backend_cuda.h"
#include "cuda/pass.h"
#include "test_util.h"

enum { BLOCK = 4, N_A = 10, N_B = 13, WINDOW_B = 6 };

/* The span of `s` holding pos, or NULL. */
static const tl_kv_span* span_of(const tl_seq* s, size_t pos) {
    for (size_t i = s->kv.first_live; i < s->kv.n_spans; i++) {
        const tl_kv_span* sp = &s->kv.spans[i];
        if (sp->block && pos >= sp->start && pos < (size_t)sp->start + sp->count) return sp;
    }
    return NULL;
}

static tl_seq* prefilled(tl_engine* e, uint32_t loops, uint32_t window, size_t n, size_t reserve) {
    tl_seq* s = NULL;
    CHECK_OK(tl_seq_new(e, loops, window, &s));
    int32_t tokens[32];
    for (size_t i = 0; i < n; i++) tokens[i] = (int32_t)(i * 7 % 200);
    CHECK_OK(tl_seq_prefill(s, tokens, n, 3, NULL));
    CHECK_OK(tl_kv_reserve(&s->kv, &e->kv_geom, s->n_layers, s->n, reserve));
    return s;
}

/* tl_cuda_describe_writes of every range pos0 .. pos0+T-1 around s's reserved positions: the
 * rows when span_of finds every position, each row where its K/V goes; else false, rows kept. */
static void check_writes(const char* what, const tl_seq* s, size_t reserved) {
    enum { MAX_T = 6 };
    for (size_t pos0 = 0; pos0 < reserved + 2; pos0++)
        for (size_t T = 1; T <= MAX_T; T++) {
            bool live = true;
            for (size_t p = pos0; p < pos0 + T; p++) live = live && span_of(s, p) != NULL;
            tl_cuda_row rows[MAX_T], kept;
            memset(rows, 0xab, sizeof rows);
            memcpy(&kept, &rows[0], sizeof kept);
            const bool got = tl_cuda_describe_writes(s, pos0, T, rows);
            CHECK(got == live, "%s: positions %zu .. %zu described: %d, live: %d", what, pos0, pos0 + T - 1, got, live);
            if (!got) CHECK(memcmp(&rows[0], &kept, sizeof kept) == 0, "%s: a refused range wrote rows", what);
            for (size_t t = 0; got && t < T; t++) {
                const tl_cuda_row* r = &rows[t];
                const tl_kv_span* w = span_of(s, pos0 + t);
                CHECK(r->token == 0 && r->pos == pos0 + t && r->loops == s->loops && r->window == s->window &&
                          r->n_spans == 0 && r->write_data == w->block->data && r->write_slot == pos0 + t - w->start,
                      "%s: position %zu's row", what, pos0 + t);
            }
        }
}

static void test_describe(void) {
    tu_spec spec = tu_spec_default();
    spec.n_core = 2; /* two core blocks and a coda: a row's depth is not its slot count */
    spec.n_coda = 1;
    tl_model* m = tu_open(tu_write_model("describe.tinyloop", &spec), 1, TL_ISA_AUTO, BLOCK);
    tl_engine* e = NULL;
    CHECK_OK(tl_model_acquire(m, &e));
    tl_seq* a = prefilled(e, 3, 0, N_A, 3);        /* deeper: rows 0..2 */
    tl_seq* b = prefilled(e, 1, WINDOW_B, N_B, 1); /* windowed: row 3, front blocks released */
    CHECK(b->kv.first_live > 0 || b->kv.spans[0].block == NULL, "the window released no block");

    tl_seq* seqs[4] = {a, a, a, b};
    const size_t pos[4] = {N_A, N_A + 1, N_A + 2, N_B};
    const int32_t tokens[4] = {5, 6, 7, 8};
    tl_cuda_row rows[4];
    tl_cuda_span spans[64];
    const size_t expect = tl_cuda_count_spans(seqs, 4);
    CHECK(expect <= 64, "%zu spans", expect);
    uint32_t max_keys = 0;
    const size_t n_spans = tl_cuda_describe(seqs, pos, tokens, 4, rows, spans, &max_keys);
    CHECK(max_keys == N_B + 1, "max_keys %u", max_keys);

    size_t live_a = 0;
    for (size_t i = a->kv.first_live; i < a->kv.n_spans; i++) live_a += a->kv.spans[i].block != NULL;
    CHECK(n_spans <= expect && rows[3].first_span == live_a && n_spans == live_a + rows[3].n_spans,
          "span ranges: %zu spans, a has %zu, b starts at %u", n_spans, live_a, rows[3].first_span);
    for (int t = 0; t < 4; t++) {
        const tl_cuda_row* r = &rows[t];
        const tl_seq* s = seqs[t];
        const tl_kv_span* w = span_of(s, pos[t]);
        CHECK(r->token == tokens[t] && r->pos == pos[t] && r->loops == s->loops && r->window == s->window,
              "row %d fields", t);
        CHECK(w && r->write_data == w->block->data && r->write_slot == pos[t] - w->start && r->write_slot < BLOCK,
              "row %d: K/V goes to slot %u", t, r->write_slot);
        CHECK(t == 3 || (r->first_span == 0 && r->n_spans == live_a), "row %d shares a's spans", t);
        /* every key the row may see is in exactly one of its spans, at the block's own slot */
        const size_t lo = s->window && pos[t] + 1 > s->window ? pos[t] + 1 - s->window : 0;
        for (size_t j = lo; j <= pos[t]; j++) {
            int found = 0;
            for (uint32_t i = r->first_span; i < r->first_span + r->n_spans; i++) {
                const tl_cuda_span* sp = &spans[i];
                if (j >= sp->start && j < (size_t)sp->start + sp->count) {
                    found++;
                    CHECK(sp->data == span_of(s, j)->block->data, "row %d key %zu: wrong block", t, j);
                }
            }
            CHECK(found == 1, "row %d: key %zu is in %d spans", t, j, found);
        }
    }
    for (size_t i = 1; i < live_a; i++)
        CHECK(spans[i].start == spans[i - 1].start + spans[i - 1].count, "a's spans are not in order");
    CHECK(spans[rows[3].first_span].start > 0, "b's released blocks were described");
    check_writes("a", a, N_A + 3);
    check_writes("b, windowed", b, N_B + 1);

    tl_seq_free(a);
    tl_seq_free(b);
    tl_engine_unref(e);
    tl_model_free(m);
}

/* ---- the pass schedule ------------------------------------------------------------------------ */

enum { MAX_ROWS = 8, MAX_EVENTS = 256 };
enum { EV_BLOCK, EV_NORM, EV_INJECT, EV_ADAPTER, EV_COPY, EV_STATE, EV_KEEP, EV_MIX };

/* One step as one row saw it: BLOCK (a = slot, b = block), NORM (a = tl_cu_norm), STATE
 * (a = depth), MIX (a = tl_cu_mix), on state `on`. */
typedef struct event {
    int kind;
    uint32_t a, b;
    tl_cu_state on;
} event;

typedef struct trace {
    size_t T;
    bool one_sequence;          /* every block step must cover all rows (they attend together) */
    event ev[MAX_ROWS][MAX_EVENTS];
    size_t n[MAX_ROWS];
    size_t state_row;           /* the row every STATE step named                              */
} trace;

static void record(trace* tr, size_t lo, size_t hi, event e) {
    CHECK(lo < hi && hi <= tr->T, "step kind %d on rows [%zu, %zu) of %zu", e.kind, lo, hi, tr->T);
    CHECK(!tr->one_sequence || e.kind != EV_BLOCK || (lo == 0 && hi == tr->T),
          "block %u (slot %u) of one sequence on rows [%zu, %zu) only", e.b, e.a, lo, hi);
    for (size_t r = lo; r < hi && r < tr->T; r++)
        if (tr->n[r] < MAX_EVENTS) tr->ev[r][tr->n[r]++] = e;
}

static tl_status rec_block(void* ctx, uint32_t slot, uint32_t block, size_t lo, size_t hi, tl_cu_state on) {
    record(ctx, lo, hi, (event){EV_BLOCK, slot, block, on});
    return TL_OK;
}
static tl_status rec_norm(void* ctx, tl_cu_norm which, size_t lo, size_t hi, tl_cu_state on) {
    record(ctx, lo, hi, (event){EV_NORM, (uint32_t)which, 0, on});
    return TL_OK;
}
static tl_status rec_inject(void* ctx, size_t hi) {
    record(ctx, 0, hi, (event){EV_INJECT, 0, 0, TL_CU_ON_X});
    return TL_OK;
}
static tl_status rec_adapter(void* ctx, size_t hi) {
    record(ctx, 0, hi, (event){EV_ADAPTER, 0, 0, TL_CU_ON_X});
    return TL_OK;
}
static tl_status rec_copy(void* ctx, size_t hi) {
    record(ctx, 0, hi, (event){EV_COPY, 0, 0, TL_CU_ON_COPY});
    return TL_OK;
}
static tl_status rec_state(void* ctx, uint32_t depth, size_t row, tl_cu_state on) {
    trace* tr = ctx;
    tr->state_row = row;
    record(tr, row, row + 1, (event){EV_STATE, depth, 0, on});
    return TL_OK;
}
static tl_status rec_keep(void* ctx, size_t hi) {
    record(ctx, 0, hi, (event){EV_KEEP, 0, 0, TL_CU_ON_X});
    return TL_OK;
}
static tl_status rec_mix(void* ctx, tl_cu_mix what, size_t hi) {
    record(ctx, 0, hi, (event){EV_MIX, (uint32_t)what, 0, TL_CU_ON_X});
    return TL_OK;
}

/* A two-state core's iteration i (docs/spec.md §1) as its row sees it: h held aside and l taken
 * up, then each cycle c = 0 .. C (C low ones, the high one) adds h, runs its stack in slots
 * n_pre + i * (w + n_coda) + c * n + j and closes with the weightless norm; after the last low
 * cycle l is kept. */
static size_t expected_two_state(const tl_config* c, uint32_t i, event* out) {
    const uint32_t n = c->n_core_blocks / 2, C = c->core_cycles, w = (C + 1) * n;
    size_t k = 0;
    out[k++] = (event){EV_MIX, TL_CU_HOLD, 0, TL_CU_ON_X};
    for (uint32_t cycle = 0; cycle <= C; cycle++) {
        out[k++] = (event){EV_MIX, TL_CU_ADD_HIGH, 0, TL_CU_ON_X};
        for (uint32_t j = 0; j < n; j++)
            out[k++] = (event){EV_BLOCK, c->n_pre_blocks + i * (w + c->n_coda_blocks) + cycle * n + j,
                               c->n_pre_blocks + (cycle < C ? j : n + j), TL_CU_ON_X};
        out[k++] = (event){EV_NORM, TL_CU_PLAIN_NORM, 0, TL_CU_ON_X};
        if (cycle + 1 == C) out[k++] = (event){EV_MIX, TL_CU_KEEP_LOW, 0, TL_CU_ON_X};
    }
    return k;
}

/* What docs/spec.md says one row of depth L goes through in part `part` of a pass (§5.6: from
 * iteration first_iter, its coda in depth coda_depth's slots); `build`: a prefix build's last
 * row. */
static size_t expected(const tl_config* c, uint32_t L, const tl_cu_part* part, bool build, event* out) {
    const uint32_t n_pre = c->n_pre_blocks, k = c->n_core_blocks, n_coda = c->n_coda_blocks;
    const uint32_t w = c->core_cycles ? (c->core_cycles + 1) * (k / 2) : k; /* the core's width */
    const bool coda = c->coda_norm || n_coda;
    size_t n = 0;
    if (part->first_iter == 0) {
        for (uint32_t b = 0; b < n_pre; b++) out[n++] = (event){EV_BLOCK, b, b, TL_CU_ON_X};
        if (c->injection) out[n++] = (event){EV_INJECT, 0, 0, TL_CU_ON_X};
        if (c->core_cycles) out[n++] = (event){EV_MIX, TL_CU_LOW_ZERO, 0, TL_CU_ON_X};
    }
    for (uint32_t i = part->first_iter; i < L; i++) {
        if (c->step_norm && i >= 1) out[n++] = (event){EV_NORM, TL_CU_STEP_NORM, 0, TL_CU_ON_X};
        if (c->injection) out[n++] = (event){EV_ADAPTER, 0, 0, TL_CU_ON_X};
        if (c->core_cycles) n += expected_two_state(c, i, out + n);
        for (uint32_t j = 0; j < k && !c->core_cycles; j++)
            out[n++] = (event){EV_BLOCK, n_pre + i * (k + n_coda) + j, n_pre + j, TL_CU_ON_X};
        /* the depth i + 1 ends: on x at the row's own depth, on a copy before it (a build) */
        const bool last = i + 1 == L;
        if (!last && !build) continue;
        if (last && part->keep) out[n++] = (event){EV_KEEP, 0, 0, TL_CU_ON_X};
        const tl_cu_state on = last || !coda ? TL_CU_ON_X : TL_CU_ON_COPY;
        const uint32_t depth = last && part->coda_depth ? part->coda_depth : i + 1; /* whose coda slots */
        if (on == TL_CU_ON_COPY) out[n++] = (event){EV_COPY, 0, 0, TL_CU_ON_COPY};
        if (c->coda_norm) out[n++] = (event){EV_NORM, TL_CU_CODA_NORM, 0, on};
        for (uint32_t j = 0; j < n_coda; j++)
            out[n++] = (event){EV_BLOCK, n_pre + (depth - 1) * (w + n_coda) + w + j, n_pre + k + j, on};
        if (build) out[n++] = (event){EV_STATE, i + 1, 0, on};
    }
    return n;
}

static bool same_event(event a, event b) { return a.kind == b.kind && a.a == b.a && a.b == b.b && a.on == b.on; }

/* Walk part `part` of a pass of rows of the given depths (deepest first) and compare each row's
 * trace. */
static void check_part(const char* what, const tl_config* c, const uint32_t* loops, size_t T, const tl_cu_part* part) {
    static trace tr;
    memset(&tr, 0, sizeof tr);
    tr.T = T;
    const bool build = part->build;
    tr.one_sequence = build || part->first_iter || part->coda_depth || part->keep;
    tr.state_row = T;
    tl_cuda_row rows[MAX_ROWS];
    memset(rows, 0, sizeof rows);
    for (size_t t = 0; t < T; t++) rows[t].loops = loops[t];
    const tl_cu_pass_steps steps = {&tr,      rec_block, rec_norm, rec_inject, rec_adapter,
                                    rec_copy, rec_state, rec_keep, rec_mix};
    CHECK_OK(tl_cu_pass_walk(c, rows, T, part, &steps));
    CHECK(!build || tr.state_row == T - 1, "%s: states of row %zu", what, tr.state_row);
    event want[MAX_EVENTS];
    for (size_t t = 0; t < T; t++) {
        /* only the last row of a build keeps states; every row of a build runs every depth */
        size_t n = expected(c, loops[t], part, build, want);
        if (build && t + 1 < T) { /* drop the STATE events: the other rows record none */
            size_t kept = 0;
            for (size_t i = 0; i < n; i++)
                if (want[i].kind != EV_STATE) want[kept++] = want[i];
            n = kept;
        }
        CHECK(tr.n[t] == n, "%s: row %zu (loops %u) ran %zu steps, want %zu", what, t, loops[t], tr.n[t], n);
        for (size_t i = 0; i < n && i < tr.n[t]; i++) {
            const event g = tr.ev[t][i], w = want[i];
            CHECK(same_event(g, w), "%s: row %zu step %zu is (%d, %u, %u, on %d), want (%d, %u, %u, on %d)", what, t,
                  i, g.kind, g.a, g.b, (int)g.on, w.kind, w.a, w.b, (int)w.on);
            if (!same_event(g, w)) break;
        }
        /* a draft's coda writes the deeper depth's slots; every other slot is the row's own */
        const uint32_t deepest = part->coda_depth > loops[t] ? part->coda_depth : loops[t];
        for (size_t i = 0; i < tr.n[t]; i++)
            if (tr.ev[t][i].kind == EV_BLOCK)
                CHECK(tr.ev[t][i].a < tl_n_layers(c, deepest), "%s: row %zu writes slot %u of %zu", what, t,
                      tr.ev[t][i].a, tl_n_layers(c, deepest));
    }
}

/* check_part of the whole pass (or a whole prefix build). */
static void check_schedule(const char* what, const tl_config* c, const uint32_t* loops, size_t T, bool build) {
    const tl_cu_part whole = {.build = build};
    check_part(what, c, loops, T, &whole);
}

/* The parts of self-speculative decoding and warm start (docs/spec.md §5.6, §5.4) on T rows of
 * one sequence at depth L, split at L_d: a draft to L_d (its coda in depth L's slots, its state
 * kept) and its verification from L_d; a warm-start build's base at L_d (states kept) and its
 * extension to L. */
static void check_parts(const char* name, const tl_config* c, size_t T, uint32_t L, uint32_t Ld) {
    uint32_t draft[MAX_ROWS], verify[MAX_ROWS];
    for (size_t t = 0; t < T; t++) {
        draft[t] = Ld;
        verify[t] = L;
    }
    const tl_cu_part parts[4] = {{.coda_depth = L, .keep = true},
                                 {.first_iter = Ld},
                                 {.build = true, .keep = true},
                                 {.first_iter = Ld, .build = true, .keep = true}};
    const char* kinds[4] = {"draft", "verification", "warm build", "extension"};
    for (int i = 0; i < 4; i++) {
        char what[128];
        snprintf(what, sizeof what, "%s, %zu rows, L=%u, L_d=%u: %s", name, T, L, Ld, kinds[i]);
        check_part(what, c, i % 2 ? verify : draft, T, &parts[i]);
    }
}

/* flags: 1 injection, 2 step norm, 4 coda norm; cycles: a two-state core's C (docs/spec.md §1). */
static tl_config config(uint32_t n_pre, uint32_t k, uint32_t n_coda, uint32_t flags, uint32_t cycles) {
    tl_config c;
    memset(&c, 0, sizeof c);
    c.n_pre_blocks = n_pre;
    c.n_core_blocks = k;
    c.n_coda_blocks = n_coda;
    c.injection = flags & 1;
    c.step_norm = (flags >> 1) & 1;
    c.coda_norm = (flags >> 2) & 1;
    c.core_cycles = cycles;
    return c;
}

static void test_schedule(void) {
    enum { INJ = 1, STEP = 2, CODA_NORM = 4 };
    const uint32_t mixed[5] = {4, 4, 3, 1, 1}, one[3] = {3, 3, 3}, single[1] = {1};
    const tl_config huginn = config(2, 3, 2, INJ | CODA_NORM, 0), ouro = config(0, 4, 0, STEP, 0);
    const tl_config v1 = config(1, 1, 0, 0, 0), norm_only = config(1, 2, 0, STEP | CODA_NORM | INJ, 0);
    const tl_config hrm = config(0, 4, 0, 0, 2), hrm_coda = config(1, 2, 2, CODA_NORM, 1);
    const tl_config* configs[6] = {&huginn, &ouro, &v1, &norm_only, &hrm, &hrm_coda};
    const char* names[6] = {"huginn-like", "ouro-like", "version 1", "coda norm without coda blocks", "hrm-like",
                            "two-state core with a prelude and a coda"};
    for (int i = 0; i < 6; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s, mixed batch", names[i]);
        check_schedule(what, configs[i], mixed, 5, false);
        snprintf(what, sizeof what, "%s, prefix build", names[i]);
        check_schedule(what, configs[i], one, 3, true);
        snprintf(what, sizeof what, "%s, one row at depth 1, build", names[i]);
        check_schedule(what, configs[i], single, 1, true);
        for (uint32_t L = 2; L <= 4; L++)
            for (uint32_t Ld = 1; Ld < L; Ld++) {
                check_parts(names[i], configs[i], 1, L, Ld);
                check_parts(names[i], configs[i], 3, L, Ld);
            }
    }
}

int main(void) {
    test_describe();
    test_schedule();
    return tu_finish("test_cuda_describe");
}
