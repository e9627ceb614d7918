/* forward_exits.c — a CPU batch pass's exit rules (adaptive depth, docs/spec.md §5.7): each
 * row with an active rule is begun on the state entering iteration 0 and judged after every
 * iteration by core/exit_rule.h on the host; a row under kl or argmax is first probed
 * (coda_norm and the coda on a copy of its state in its own depth's coda slots, then the head,
 * every probed row at once). A row that exits copies its KV of that iteration into its deeper
 * core slots ("last available"), ends at U = i + 1 (a probed one keeping its probe's final
 * state and logits: done) and moves behind the rows that go on, so the batch stays deepest
 * first and forward.c's run_layers ends it like any row of that depth. Rows without a rule are
 * never touched here. */
#include <stdint.h>
#include <string.h>

#include "core/exit_rule.h"
#include "core/kvcache.h"
#include "cpu/pass.h"


/* Each row's exit rule begun on x, the state entering iteration 0, with its storage. */
void tl_fwd_begin_exits(fwd* f) {
    const size_t d = f->c->d_model, V = f->c->vocab_size;
    size_t k = 0; /* kl rows so far */
    for (size_t r = 0; r < f->T; r++) {
        const tl_exit* x = &f->rules[f->order[r]];
        bool latent, kl, probes;
        tl_exit_storage(x, f->seqs[r]->loops, &latent, &kl, &probes);
        tl_exit_store store = {f->prev + r * d, NULL, NULL};
        if (kl) {
            store.logits = f->klz + k * V;
            store.w = f->klw + k * V;
            k++;
        }
        tl_exit_begin(&f->exits[r], x, f->seqs[r]->loops, f->x + r * d, store, &f->e->file);
        if (f->done) f->done[r] = 0;
    }
}

/* base[r] = old base[from[r]] for r < n, elements of `elem` bytes, through tmp. */
static void gather(void* base, size_t elem, const size_t* from, size_t n, void* tmp) {
    char* b = base;
    char* t = tmp;
    for (size_t r = 0; r < n; r++) memcpy(t + r * elem, b + from[r] * elem, elem);
    memcpy(b, t, n * elem);
}

/* Rows [0, T) reordered, stably, so that those ending at depth `end` or before come after those
 * going on, and the done ones (probed) last: the order stays deepest first, and rows of one
 * coda depth stay together. */
void tl_fwd_partition_rows(fwd* f, uint32_t end) {
    const size_t T = f->T, state = f->c->d_model * sizeof(float);
    size_t n = 0;
    for (int key = 0; key < 3; key++)
        for (size_t r = 0; r < T; r++)
            if ((f->ends[r] > end ? 0 : tl_fwd_done(f, r) ? 2 : 1) == key) f->from[n++] = r;
    gather(f->x, state, f->from, T, f->moved);
    if (tl_has_inject(f->c)) gather(f->inject, state, f->from, T, f->moved);
    gather(f->seqs, sizeof *f->seqs, f->from, T, f->moved);
    gather(f->pos, sizeof *f->pos, f->from, T, f->moved);
    gather(f->tokens, sizeof *f->tokens, f->from, T, f->moved);
    gather(f->order, sizeof *f->order, f->from, T, f->moved);
    gather(f->ends, sizeof *f->ends, f->from, T, f->moved);
    gather(f->exits, sizeof *f->exits, f->from, T, f->moved);
    if (f->done) gather(f->done, sizeof *f->done, f->from, T, f->moved);
}

/* The probes after iteration i (docs/spec.md §5.7, kl and argmax): each row going deeper whose
 * rule asks for one gets a copy of its state in side (probe row probe_at[r]), which runs
 * coda_norm and the coda in its own depth's coda slots, each run of one depth at once; then
 * the head of every probed row into logits. */
void tl_fwd_probe(fwd* f, uint32_t i) {
    const size_t d = f->c->d_model, T = f->T;
    size_t P = 0;
    for (size_t r = 0; r < T; r++) {
        f->probe_at[r] = SIZE_MAX;
        if (f->ends[r] <= i + 1 || !tl_exit_probes(&f->exits[r], i)) continue;
        f->probe_at[r] = P;
        memcpy(f->side + P * d, f->x + r * d, d * sizeof(float));
        f->pseqs[P] = f->seqs[r];
        f->ppos[P++] = f->pos[r];
    }
    if (P == 0) return;
    tl_seq** const seqs = f->seqs;
    size_t* const pos = f->pos;
    f->seqs = f->pseqs;
    f->pos = f->ppos;
    f->T = P;
    for (size_t p = 0, g; p < P; p = g) { /* the rows stay deepest first: one run per depth */
        const uint32_t depth = f->seqs[p]->loops;
        for (g = p + 1; g < P && f->seqs[g]->loops == depth; g++) continue;
        tl_fwd_end_depth(f, f->side, p, g, depth);
    }
    tl_fwd_head_rows(f, f->side, f->logits);
    f->seqs = seqs;
    f->pos = pos;
    f->T = T;
}

/* After iteration i: every row going deeper whose rule fires exits with U = i + 1. Its KV of
 * iteration i (every one of the core's w applications) is copied into the core slots of
 * iterations i+1 .. L-1 at its position ("last available"), its end becomes i + 1, and it moves
 * behind the rows that go on. */
void tl_fwd_take_exits(fwd* f, uint32_t i) {
    const tl_config* c = f->c;
    const size_t d = c->d_model, V = c->vocab_size;
    bool any = false;
    for (size_t r = 0; r < f->T; r++) {
        if (f->ends[r] <= i + 1) continue;
        const size_t p = f->done ? f->probe_at[r] : SIZE_MAX;
        const float* z = p == SIZE_MAX ? NULL : f->logits + p * V;
        if (!tl_exit_after(&f->exits[r], &f->e->file, i, f->x + r * d, z)) continue;
        const tl_seq* s = f->seqs[r];
        for (uint32_t u = i + 1; u < s->loops; u++)
            for (uint32_t a = 0; a < tl_core_width(c); a++)
                tl_kv_copy_layer(&f->e->kv_geom, &s->kv, f->pos[r], (uint32_t)tl_core_slot(c, i, a),
                                 (uint32_t)tl_core_slot(c, u, a));
        f->ends[r] = i + 1;
        if (z) { /* the probe's final state and logits are the row's: nothing more runs for it */
            memcpy(f->x + r * d, f->side + p * d, d * sizeof(float));
            memcpy(f->out[f->order[r]], z, V * sizeof(float));
            f->done[r] = 1;
        }
        any = true;
    }
    if (any) tl_fwd_partition_rows(f, i + 1);
}

