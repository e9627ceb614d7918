/* speculate.c — one round of self-speculative decoding (core/speculate.h, docs/spec.md §5.6).
 *
 * A round on a stream whose last emitted token t sits at position p (not yet run): K' rows
 * r_0 = t, r_1 = d_1, .. at positions p .. p+K'-1, each reserved and drafted alone at depth L_d
 * (its coda in depth L's slots, which the verifier then overwrites), its state after iteration
 * L_d - 1 kept and its draft d_{i+1} sampled with the request's sampler at position p+i+1 over
 * the real history plus d_1 .. d_i. One verify pass resumes the K' rows at iteration L_d and
 * yields every row's logits at depth L; the stream samples v_1, v_2, .. from them exactly as
 * plain decoding would, stopping after a stop rule or the first v_i != d_i. The sequence keeps
 * the m emitted rows: the rest of the round's KV is rolled back to the mark taken before row m
 * was reserved, and only then is the window applied, at the committed length.
 *
 * Why it is exact: row i of the verify pass sees rows r_0 .. r_i, which equal plain decoding's
 * tokens while every earlier v_j == d_j; its KV below iteration L_d is the draft's, which by
 * depth nesting is depth L's; and every row of a pass is computed as it would be alone. */
#include "core/speculate.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/forward.h"

static tl_status bad_predictions(uint32_t L) {
    return tl_fail(TL_ERR_INVALID_ARGUMENT, "TINYLOOP_BENCH_PREDICTIONS must be groups of %u ids (the request's "
                   "depth), each id >= 0, the ids comma-separated and the groups separated by ';'", L);
}

/* TINYLOOP_BENCH_PREDICTIONS into sp->predicted: groups separated by ';', each the L
 * comma-separated ids a recorded model predicted at depths 1 .. L for one emitted token. */
static tl_status read_predictions(tl_spec* sp, uint32_t L) {
    const char* text = getenv("TINYLOOP_BENCH_PREDICTIONS");
    if (!text || !*text) return TL_OK;
    size_t ids = 1;
    for (const char* c = text; *c; c++) ids += *c == ',' || *c == ';';
    if (!(sp->predicted = tl_alloc(ids * sizeof *sp->predicted))) return tl_fail_oom("TINYLOOP_BENCH_PREDICTIONS");
    size_t n = 0;
    for (const char* c = text;; c++) {
        char* end;
        errno = 0;
        const long id = strtol(c, &end, 10);
        if (end == c || errno || id < 0 || id > INT32_MAX) return bad_predictions(L);
        sp->predicted[n++] = (int32_t)id;
        c = end;
        if (*c == ',') continue;
        if (n % L) return bad_predictions(L); /* a group ends: it has L ids */
        if (*c == '\0') break;
        if (*c != ';') return bad_predictions(L);
    }
    sp->n_predicted = n / L;
    sp->predicted_loops = L;
    return TL_OK;
}

static tl_status spec_oom(tl_spec* sp) {
    tl_spec_free(sp);
    return tl_fail_oom("speculative decoding scratch");
}

tl_status tl_spec_init(tl_spec* sp, const tl_engine* e, const tl_gen_params* p, bool wave) {
    memset(sp, 0, sizeof *sp);
    sp->n_draft = p->n_draft;
    sp->draft_loops = p->draft_loops;
    const tl_config* c = tl_engine_config(e);
    const size_t K = p->n_draft, d = c->d_model, V = c->vocab_size;
    sp->rows = tl_alloc(K * sizeof *sp->rows);
    sp->drafts = tl_alloc(K * sizeof *sp->drafts);
    sp->states = tl_alloc(K * d * sizeof(float));
    sp->injects = tl_has_inject(c) ? tl_alloc(K * d * sizeof(float)) : NULL;
    sp->logits = tl_alloc(K * V * sizeof(float));
    sp->hidden = tl_alloc(K * d * sizeof(float));
    sp->seen = tl_alloc(V);
    sp->marks = tl_alloc(K * sizeof *sp->marks);
    if (!sp->rows || !sp->drafts || !sp->states || (tl_has_inject(c) && !sp->injects) || !sp->logits || !sp->hidden ||
        !sp->seen || !sp->marks)
        return spec_oom(sp);
    tl_status st = read_predictions(sp, p->loops);
    if (st != TL_OK) {
        tl_spec_free(sp);
        return st;
    }
    sp->wave = wave && tl_has_wave_pass(e);
    sp->auto_depth = sp->wave && p->draft_loops == 0;
    if (p->draft_loops == 0 && !sp->wave) sp->draft_loops = tl_spec_rounds_depth(p->loops);
    if (!sp->wave) return TL_OK;
    if (sp->auto_depth) {
        sp->verified = tl_alloc_zeroed(p->loops, sizeof *sp->verified);
        sp->agreed = tl_alloc_zeroed(p->loops, sizeof *sp->agreed);
        if (!sp->verified || !sp->agreed) return spec_oom(sp);
        /* a block's linears: qkv (with the attention gate's rows), out, gate and up, down */
        const double heads = (double)c->n_heads * (c->attn_gate ? 2.0 : 1.0) + 2.0 * c->n_kv_heads;
        const double dd = d, block = dd * heads * c->head_dim + (double)c->n_heads * c->head_dim * dd +
                                     3.0 * c->ffn_dim * dd;
        const double adapter = c->injection ? dd * dd : 0.0; /* adapter_state a step, adapter_inject once */
        sp->reads_core = tl_core_width(c) * block + adapter;
        sp->reads_entry = c->n_pre_blocks * block + adapter;
        sp->reads_end = c->n_coda_blocks * block + (double)V * dd;
    }
    sp->flight = tl_alloc((K + 1) * sizeof *sp->flight);
    sp->slots = tl_alloc((K + 1) * sizeof *sp->slots);
    sp->wave_bufs = tl_alloc((K + 1) * (2 * d + V) * sizeof(float));
    if (!sp->flight || !sp->slots || !sp->wave_bufs) return spec_oom(sp);
    for (size_t i = 0; i <= K; i++) {
        float* buf = sp->wave_bufs + i * (2 * d + V);
        sp->flight[i] = (tl_wave_row){.state = buf, .inject = buf + d};
        sp->slots[i] = (tl_wave_slot){.logits = buf + 2 * d};
    }
    return TL_OK;
}

int32_t tl_spec_seen_as(const tl_spec* sp, size_t index, uint32_t depth, int32_t token) {
    if (!sp->predicted || token < 0) return token;
    return sp->predicted[(index % sp->n_predicted) * sp->predicted_loops + depth - 1];
}

void tl_spec_free(tl_spec* sp) {
    tl_free(sp->rows);
    tl_free(sp->drafts);
    tl_free(sp->states);
    tl_free(sp->injects);
    tl_free(sp->logits);
    tl_free(sp->hidden);
    tl_free(sp->seen);
    tl_free(sp->marks);
    tl_free(sp->predicted);
    tl_free(sp->flight);
    tl_free(sp->slots);
    tl_free(sp->wave_bufs);
    tl_free(sp->verified);
    tl_free(sp->agreed);
    memset(sp, 0, sizeof *sp);
}

/* Reserve and draft rows r_0 .. r_{K-1} at positions p .. p+K-1 (A.2). Shallow logits that
 * cannot be sampled (not finite) end the drafting there, with a draft no token equals: plain
 * decoding never sees them, so they must not fail the round. *K becomes the rows drafted. On
 * failure the table is back at marks[0]. */
static tl_status draft(tl_spec* sp, tl_stream* s, size_t p, size_t* K) {
    tl_seq* q = s->seq;
    const tl_engine* e = q->engine;
    const tl_config* c = tl_engine_config(e);
    const size_t d = c->d_model, V = c->vocab_size;
    memcpy(sp->seen, s->seen, V);
    for (size_t i = 0; i < *K; i++) {
        sp->marks[i] = tl_kv_mark_now(&q->kv);
        tl_status st = tl_kv_reserve(&q->kv, &e->kv_geom, q->n_layers, p + i, 1);
        const tl_part part = {.depth = sp->draft_loops, .coda_depth = q->loops, .state_out = sp->states + i * d,
                              .inject_out = sp->injects ? sp->injects + i * d : NULL,
                              .logits_last = sp->logits + i * V};
        if (st == TL_OK) st = tl_forward_part(q, &sp->rows[i], 1, p + i, &part);
        if (st == TL_OK)
            st = tl_sample(&s->sampler, sp->logits + i * V, (uint32_t)V, sp->seen, p + i + 1, &s->scratch,
                           &sp->drafts[i]);
        if (st == TL_ERR_NUMERIC) {
            sp->drafts[i] = -1;
            *K = i + 1;
            return TL_OK;
        }
        if (st != TL_OK) {
            tl_kv_rollback(&q->kv, sp->marks[0]);
            return st;
        }
        sp->seen[sp->drafts[i]] = 1;
        if (i + 1 < *K) sp->rows[i + 1] = sp->drafts[i];
    }
    return TL_OK;
}

/* Emit v_1 .. v_m from the verifier's logits (A.4), each sampled by the stream at its position
 * p + i; returns the status of the last sample and sets *m and *accepted. */
static tl_status emit(tl_spec* sp, tl_stream* s, int32_t* token, size_t p, size_t K, size_t* m, size_t* accepted) {
    const size_t V = tl_engine_config(s->seq->engine)->vocab_size;
    float* const own = s->logits;
    tl_status st = TL_OK;
    *m = *accepted = 0;
    while (*m < K) {
        s->logits = sp->logits + *m * V;
        s->seq->n = p + *m + 1; /* v_{m+1} will occupy position p + m + 1 */
        const size_t index = s->n_emitted;
        st = tl_stream_sample(s, token);
        if (st != TL_OK) break;
        const int32_t draft = sp->drafts[(*m)++];
        const bool agree = tl_spec_seen_as(sp, index, sp->draft_loops, draft) ==
                           tl_spec_seen_as(sp, index, s->seq->loops, *token);
        *accepted += agree;
        if (s->done || !agree) break;
    }
    s->logits = own;
    return st;
}

tl_status tl_spec_round(tl_spec* sp, tl_stream* s, int32_t* token, size_t round_cap) {
    tl_seq* q = s->seq;
    tl_engine* e = q->engine;
    tl_status st = tl_engine_check_open(e);
    if (st != TL_OK) return st;
    const tl_config* c = tl_engine_config(e);
    const size_t p = q->n, left = s->p->max_tokens - s->n_emitted;
    size_t K = sp->n_draft < left ? sp->n_draft : left;
    if (round_cap && K > round_cap) K = round_cap;
    if (K > c->max_seq_len || p > c->max_seq_len - K) /* tl_gen_check bounds it; this guards RoPE and KV */
        return tl_fail(TL_ERR_SEQ_TOO_LONG, "sequence length %zu exceeds max_seq_len %u", p + K, c->max_seq_len);

    sp->rows[0] = *token;
    if ((st = draft(sp, s, p, &K)) != TL_OK) return st;
    const tl_part verify = {.first_iter = sp->draft_loops, .depth = q->loops, .state_in = sp->states,
                            .inject_in = sp->injects, .hidden_all = sp->hidden, .logits_all = sp->logits};
    if ((st = tl_forward_part(q, NULL, K, p, &verify)) != TL_OK) {
        tl_kv_rollback(&q->kv, sp->marks[0]);
        return st;
    }
    size_t m, accepted;
    st = emit(sp, s, token, p, K, &m, &accepted);
    if (m < K) tl_kv_rollback(&q->kv, sp->marks[m]);
    q->n = p + m;
    if (m) memcpy(q->last_hidden, sp->hidden + (m - 1) * c->d_model, c->d_model * sizeof(float));
    tl_kv_release_outside(&q->kv, q->n, q->window);
    sp->drafted += K;
    sp->accepted += accepted;
    if (s->p->draft_stats) {
        s->p->draft_stats->drafted += K;
        s->p->draft_stats->accepted += accepted;
    }
    return st;
}
