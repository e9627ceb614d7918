/* test_cuda_describe.c — the host side of the CUDA forward pass, on the CPU: how
 * tl_cuda_describe turns sequences (span tables, windows, reserved positions) into the rows and
 * KV spans the device reads. Two sequences, one windowed, several blocks, some released. */
#include <string.h>

#include "core/engine.h"
#include "core/seq.h"
#include "cuda/backend_cuda.h"
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

int main(void) {
    const tu_spec spec = tu_spec_default();
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
        CHECK(r->token == tokens[t] && r->pos == pos[t] && r->n_layers == s->n_layers && r->window == s->window,
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

    tl_seq_free(a);
    tl_seq_free(b);
    tl_engine_unref(e);
    tl_model_free(m);
    return tu_finish("test_cuda_describe");
}
