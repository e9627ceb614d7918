/* hidden.h — the layer input rows of a hidden-state prefix (docs/spec.md §5.4.1).
 *
 * A build with storage h8 or h4 hands every chunk's layer inputs to tl_hidden_capture (the
 * sequence's `capture`, core/seq.h), which keeps, per cache slot and stored position, the row
 * (q, a) a sequence later rebuilds that slot's KV from (tl_hidden_rebuild, through the
 * backend's kv_from_rows). Rows are host memory on every backend.
 *
 * Shapes: q [n_layers][n - start][row_bytes] (h8: d i8; h4: d / 2 bytes of packed Q4, as an
 * int4 cache row), a [n_layers][n - start] f32. */
#ifndef TL_HIDDEN_H
#define TL_HIDDEN_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

typedef struct tl_seq tl_seq;

typedef struct tl_hidden_rows {
    tl_prefix_storage storage; /* TL_STORE_H8 or TL_STORE_H4                                */
    uint32_t n_layers;         /* cache slots stored: n_layers(L_b)                         */
    size_t d;                  /* d_model                                                   */
    size_t start, n;           /* positions start .. n-1 are stored (start = h_start)        */
    size_t row_bytes;          /* d (h8) or d / 2 (h4)                                       */
    float eps;                 /* the model's rms_eps (NQ, and h4's scale)                   */
    int8_t* q;
    float* a;
} tl_hidden_rows;

/* Empty rows (zeroed) for a prefix of n tokens, window W, n_layers slots; NULL when out of memory. */
tl_hidden_rows* tl_hidden_new(tl_prefix_storage storage, uint32_t n_layers, size_t d, size_t n, uint32_t window,
                              float eps);
void tl_hidden_free(tl_hidden_rows* h);
/* Bytes of the rows and scales (what tl_prefix_info counts). */
size_t tl_hidden_bytes(const tl_hidden_rows* h);
/* Record the input rows x[T][d] (host memory, before NQ) of the layer at cache slot `slot`, at
 * positions pos0 .. pos0+T-1; positions before h->start are skipped. Exact: the portable §2
 * primitives, bit-identical to every backend's NQ. */
void tl_hidden_capture(tl_hidden_rows* h, uint32_t slot, size_t pos0, size_t T, const float* x);
/* The KV of every slot depth s->loops reads, at positions start .. n-1, into s (empty, positions
 * 0 .. n-1 reserved here at s->n_layers slots), through the backend's kv_from_rows in chunks of
 * positions, releasing the blocks outside the window as it goes (as a prefill does). Fails like
 * tl_forward, s then empty again. */
tl_status tl_hidden_rebuild(const tl_hidden_rows* h, tl_seq* s);

#endif
