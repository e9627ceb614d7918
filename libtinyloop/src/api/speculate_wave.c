/* speculate_wave.c — self-speculative decoding in the wave schedule (core/speculate.h,
 * docs/spec.md §5.6.1).
 *
 * The positions in flight are c, c+1, .., c+k-1, where c is the committed length: position c
 * holds the last emitted token, each later one the draft its predecessor sampled. Each step
 * is ONE wave pass (tl_forward_wave) in which every position in flight runs its next core
 * iteration, all on the same core weights, so a step reads them once. The oldest position,
 * after iteration L - 1, ends at depth L: the stream samples the next token from those logits
 * exactly as plain decoding would, and the position is committed. When that token is the one
 * the next position was run with, the positions behind go on; otherwise they are all dropped
 * (their KV rolled back) and the token enters alone. Every L_d iterations a position also ends
 * on a copy of its state (its coda in depth L's slots) and samples what follows it: the newest
 * position drafts the next one, which enters the next step at iteration 0; an older one
 * checks the draft behind it against this deeper sample and, where they differ, drops the
 * positions behind it and lets the deeper sample enter instead (a redraft).
 *
 * With draft_loops 0 the draft depth is chosen whenever the wave starts again (first, and after
 * every drop by the verifier, when nothing is in flight): the L_d with the fewest expected
 * weight reads a token (docs/spec.md §5.6.1), from s = L - (L - L_d) a(L_d) expected steps a
 * token, a(L_d) the share of the drafts verified at that L_d that the verifier agreed with,
 * counted as if one more had agreed (so an untried depth looks perfect once: each is tried
 * while it could beat the best measured). The choice depends on the tokens only (f64
 * operations in a fixed order), and so do the drafts.
 *
 * Why it is exact: the oldest position's every iteration ran on its own token (an emitted one)
 * with the KV of the committed positions, each of which ran every iteration on plain
 * decoding's tokens, and every row of a pass is computed as it would be alone. */
#include <string.h>

#include "base/errors.h"
#include "core/forward.h"
#include "core/speculate.h"

/* The draft depth for a wave starting again: the L_d in 1 .. L-1 with the fewest expected
 * weight reads a token, s C + P + s X / L_d (C, P, X: sp->reads_core, _entry, _end), the first
 * on a tie. */
static uint32_t choose_depth(const tl_spec* sp, uint32_t L) {
    uint32_t best = 0;
    double least = 0.0;
    for (uint32_t d = 1; d < L; d++) {
        const double agree = (double)(sp->agreed[d] + 1) / (double)(sp->verified[d] + 1);
        const double steps = (double)L - (double)(L - d) * agree;
        const double reads = steps * sp->reads_core + sp->reads_entry + steps * sp->reads_end / (double)d;
        if (best == 0 || reads < least) {
            best = d;
            least = reads;
        }
    }
    return best;
}

/* Reserve position pos and put it in flight at slot j, at iteration 0, with `token` (seen by
 * the decisions as `seen_as`). */
static tl_status enter(tl_spec* sp, tl_seq* q, size_t j, int32_t token, int32_t seen_as, size_t pos) {
    sp->slots[j].mark = tl_kv_mark_now(&q->kv);
    tl_status st = tl_kv_reserve(&q->kv, &q->engine->kv_geom, q->n_layers, pos, 1);
    if (st != TL_OK) return st;
    sp->flight[j] = (tl_wave_row){.token = token, .pos = pos, .state = sp->flight[j].state,
                                  .inject = sp->flight[j].inject};
    sp->slots[j].seen_as = seen_as;
    return TL_OK;
}

/* Drop the positions in flight from slot j on (their KV rolled back): *k becomes j. */
static void drop_from(tl_spec* sp, tl_seq* q, size_t j, size_t* k) {
    if (j < *k) tl_kv_rollback(&q->kv, sp->slots[j].mark);
    *k = j;
}

/* Whether the newest of k positions in flight, at pos, may draft one more: K drafts in flight
 * at most, no position whose token max_tokens would not emit, none past max_seq_len. */
static bool may_draft(const tl_spec* sp, const tl_stream* s, size_t k, size_t pos) {
    const size_t max_len = tl_engine_config(s->seq->engine)->max_seq_len;
    return k <= sp->n_draft && s->n_emitted + k < s->p->max_tokens && pos + 1 < max_len;
}

/* Slot j ended at its depth it_j (a multiple of L_d) on a copy: sample what follows it (§5.1,
 * position pos + 1, the history being the real one then the drafts in flight up to slot j),
 * and put it in flight at slot j + 1 (*entered), dropping what was there, unless that was seen
 * as the sample already. Logits that cannot be sampled change nothing. */
static tl_status draft_after(tl_spec* sp, tl_stream* s, size_t j, size_t* k, bool* entered) {
    tl_seq* q = s->seq;
    const size_t V = tl_engine_config(q->engine)->vocab_size, pos = sp->flight[j].pos;
    memcpy(sp->seen, s->seen, V);
    for (size_t i = 1; i <= j; i++) sp->seen[sp->flight[i].token] = 1;
    int32_t d;
    tl_status st = tl_sample(&s->sampler, sp->slots[j].logits, (uint32_t)V, sp->seen, pos + 1, &s->scratch, &d);
    if (st == TL_ERR_NUMERIC) return TL_OK;
    if (st != TL_OK) return st;
    const int32_t seen_as = tl_spec_seen_as(sp, s->n_emitted + j, sp->flight[j].iter, d);
    if (j + 1 < *k && sp->slots[j + 1].seen_as == seen_as) return TL_OK; /* the deeper sample agrees */
    drop_from(sp, q, j + 1, k);
    if ((st = enter(sp, q, j + 1, d, seen_as, pos + 1)) != TL_OK) return st;
    *k = j + 2;
    *entered = true;
    sp->drafted++;
    if (s->p->draft_stats) s->p->draft_stats->drafted++;
    return TL_OK;
}

/* The oldest position ended at depth L: emit the stream's next token from its logits and
 * commit the position; then keep the positions behind it if the token is the one they ran
 * with, else drop them (*dropped) and put the token in flight alone (unless a stop rule
 * fired). A failed sample commits nothing and drops every position. */
static tl_status emit_oldest(tl_spec* sp, tl_stream* s, int32_t* token, size_t* k, bool* dropped) {
    tl_seq* q = s->seq;
    float* const own = s->logits;
    const size_t index = s->n_emitted, pos = sp->flight[0].pos;
    q->n = pos + 1; /* the token will occupy position pos + 1 */
    s->logits = sp->slots[0].logits;
    tl_status st = tl_stream_sample(s, token);
    s->logits = own;
    if (st != TL_OK) {
        drop_from(sp, q, 0, k);
        q->n = pos;
        return st;
    }
    const int32_t seen_as = tl_spec_seen_as(sp, index, q->loops, *token);
    const bool verified = !s->done && *k > 1;
    *dropped = !(verified && sp->slots[1].seen_as == seen_as);
    if (verified && sp->auto_depth) {
        sp->verified[sp->draft_loops]++;
        sp->agreed[sp->draft_loops] += !*dropped;
    }
    if (!*dropped) { /* the oldest leaves; its buffers go last, for the next position to enter */
        const tl_wave_row row = sp->flight[0];
        const tl_wave_slot slot = sp->slots[0];
        memmove(sp->flight, sp->flight + 1, (*k - 1) * sizeof *sp->flight);
        memmove(sp->slots, sp->slots + 1, (*k - 1) * sizeof *sp->slots);
        sp->flight[--*k] = row;
        sp->slots[*k] = slot;
        sp->accepted++;
        if (s->p->draft_stats) s->p->draft_stats->accepted++;
    } else {
        drop_from(sp, q, 1, k);
        *k = 0;
        if (sp->auto_depth) sp->draft_loops = choose_depth(sp, q->loops);
        if (!s->done && (st = enter(sp, q, 0, *token, seen_as, q->n)) == TL_OK) *k = 1;
    }
    tl_kv_release_outside(&q->kv, q->n, q->window);
    return st;
}

/* Which positions end this step, and why: the oldest after its last iteration (it_0 + 1 = L);
 * any other after every L_d-th iteration, the newest only when it may draft. Sets each row's
 * logits (and the oldest's hidden) for the pass; returns whether the oldest ends. */
static bool plan_step(tl_spec* sp, const tl_stream* s, size_t k) {
    const uint32_t L = s->seq->loops;
    for (size_t j = 0; j < k; j++) {
        tl_wave_row* row = &sp->flight[j];
        const uint32_t depth = row->iter + 1;
        const bool ends = j == 0 && depth == L;
        const bool samples = depth < L && depth % sp->draft_loops == 0 &&
                             (j + 1 < k || may_draft(sp, s, k, row->pos));
        row->logits = ends || samples ? sp->slots[j].logits : NULL;
        row->hidden = ends ? s->seq->last_hidden : NULL;
    }
    return sp->flight[0].iter + 1 == L;
}

tl_status tl_spec_wave(tl_spec* sp, tl_stream* s, int32_t* token) {
    tl_seq* q = s->seq;
    size_t k = 0;
    if (sp->auto_depth) sp->draft_loops = choose_depth(sp, q->loops);
    tl_status st = enter(sp, q, 0, *token, tl_spec_seen_as(sp, s->n_emitted - 1, q->loops, *token), q->n);
    if (st == TL_OK) k = 1;
    while (st == TL_OK && k > 0) {
        if ((st = tl_engine_check_open(q->engine)) != TL_OK) break;
        const bool ends = plan_step(sp, s, k);
        if ((st = tl_forward_wave(q, sp->flight, k)) != TL_OK) break;
        for (size_t j = 0; j < k; j++) sp->flight[j].iter++;
        bool dropped = false;
        size_t shift = 0; /* slot j before the oldest left is slot j - shift after */
        if (ends) {
            if ((st = emit_oldest(sp, s, token, &k, &dropped)) != TL_OK) break;
            shift = 1;
        }
        bool entered = false; /* behind a position that entered, nothing ran this step */
        for (size_t j = shift; !dropped && !entered && st == TL_OK && j - shift < k; j++)
            if (sp->flight[j - shift].logits) st = draft_after(sp, s, j - shift, &k, &entered);
    }
    if (st != TL_OK) drop_from(sp, q, 0, &k); /* q->n: the committed length */
    return st;
}
