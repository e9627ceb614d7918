/* device.h — the C side's view of the CUDA device code: device probing, weights uploaded
 * once per model, device memory for KV block data, and one forward pass over a batch of rows.
 * backend_cuda.c turns it into a backend (core/backend.h).
 *
 * Implemented by the .cu files beside it when the library is built with TINYLOOP_CUDA; otherwise
 * by cuda_stub.c, whose calls fail with TL_ERR_UNSUPPORTED ("libtinyloop was built without
 * CUDA"). Everything the host owns (sequences, span tables, the prefix cache, sampling) stays
 * on the host; only the KV block *data* (kvcache.h layout) lives in device memory.
 *
 * The device computes exactly docs/spec.md §2–§4 (compiled with -fmad=false, IEEE division and
 * square root, no fast math), so its logits are bit-identical to the CPU paths. */
#ifndef TL_CUDA_DEVICE_H
#define TL_CUDA_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/loader.h"
#include "tinyloop.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tl_cuda tl_cuda; /* per-model device state: weights, stream, scratch, a lock */

/* TL_OK and *n_devices >= 1 when a CUDA device can run the backend; otherwise
 * TL_ERR_UNSUPPORTED with a message saying why ("libtinyloop was built without CUDA",
 * "no CUDA device: <driver's reason>"). Never aborts; safe on machines without a driver. */
tl_status tl_cuda_probe(int* n_devices);

/* Select `device`, create a stream and upload every weight of `file` (embedding, rope tables,
 * each linear with its bias, the adapter, the head, every gain vector). On failure nothing stays
 * allocated. */
tl_status tl_cuda_create(const tl_file* file, int device, tl_cuda** out);
void tl_cuda_free(tl_cuda* c);
/* Device bytes of the uploaded weights. */
size_t tl_cuda_weight_bytes(const tl_cuda* c);
/* "NVIDIA H200 (sm_90)"-style name of the device; a static string owned by c. */
const char* tl_cuda_device_name(const tl_cuda* c);

/* Device memory for one KV block's data, zero-filled (NULL when out of device memory), and its
 * release. Thread-safe. */
void* tl_cuda_block_alloc(tl_cuda* c, size_t bytes);
void tl_cuda_block_free(tl_cuda* c, void* data);
/* Copy `bytes` of block data to or from host memory, in order after the work queued before on
 * the model's stream; 0 on success, -1 on a CUDA error. Thread-safe. */
int tl_cuda_block_download(tl_cuda* c, void* host, const void* data, size_t bytes);
int tl_cuda_block_upload(tl_cuda* c, void* data, const void* host, size_t bytes);
/* Copy `bytes` of block data to other block data (both device addresses), likewise. */
int tl_cuda_block_copy(tl_cuda* c, void* dst, const void* src, size_t bytes);

/* A run of `count` consecutive positions from `start` whose (kq, vq, sk, sv) live in the block
 * data at device address `data` (kvcache.h layout: per (layer, kv head) head_bytes from
 * data + (layer * n_kv_heads + h) * head_bytes: kq[bs][R], vq[bs][R], sk[bs] f32, sv[bs] f32
 * (4-byte aligned, tl_kv_scales_offset), rows of R = D int8 values, or with kv_bits 4 of
 * R = D / 2 bytes of packed Q4 values). */
typedef struct tl_cuda_span {
    const void* data;
    uint32_t start, count;
} tl_cuda_span;

/* One row of a batch: one token of one sequence. */
typedef struct tl_cuda_row {
    int32_t token;
    uint32_t pos;          /* absolute position                                               */
    uint32_t loops;        /* depth L of its sequence (cache slots tl_n_layers(cfg, L))       */
    uint32_t window;       /* cache_window, 0 = full                                          */
    void* write_data;      /* block data that receives this row's K and V (device address)   */
    uint32_t write_slot;   /* slot of pos in that block                                       */
    uint32_t first_span;   /* the row's sequence: spans[first_span .. first_span + n_spans)   */
    uint32_t n_spans;      /*   cover every key visible to the row (released ones omitted)   */
    uint32_t instruction;  /* its sequence's instruction length P (docs/spec.md §4.1), 0 = causal */
} tl_cuda_row;

/* A forward pass of T rows (docs/spec.md §4), or a part of one (core/forward.h's tl_part). Rows
 * are ordered by loops, deepest first; the order of the steps and the rows each runs on is
 * cuda/pass.h's. Rows of one sequence sit at consecutive positions and share a span range; a row
 * attends to keys j <= e(pos) (core/attn_mask.h: pos, or instruction - 1 inside the instruction
 * block) and j > pos - window, including the keys other rows of this batch
 * write in the same slot, so every KV write of a block precedes that block's attention. A part
 * (first_iter, coda_depth, state_out, inject_out) and a prefix build (loop_states) are passes of
 * one sequence: every row has the same loops, the depth the part runs to. */
typedef struct tl_cuda_batch {
    size_t T;
    const tl_cuda_row* rows;    /* [T] host memory                                          */
    const tl_cuda_span* spans;  /* [n_spans] host memory                                    */
    size_t n_spans;
    uint32_t max_keys;          /* > every row's last visible key e(pos)                     */
    uint32_t block_size;        /* kvcache geometry                                         */
    size_t head_bytes;
    uint32_t kv_bits;           /* 8 or 4 (int4 KV mode: packed Q4 rows)                     */
    /* outputs, host memory */
    float* hidden;              /* [T][d] each row's final state; required                  */
    float* logits;              /* [T][V] head of each final state; NULL = not wanted       */
    float* logits_last;         /* [V] head of row T-1's final state only; NULL = not wanted */
    const uint32_t* logit_rows; /* with logits: the rows (ascending) whose heads it receives, as
                                   [n_logit_rows][V] in this order; NULL = every row           */
    size_t n_logit_rows;        /* >= 1 with logit_rows                                         */
    float* loop_states;         /* [loops][d] makes the pass a prefix build's (docs/spec.md §5.4):
                                   every depth first_iter+1 .. loops runs its coda, writing its
                                   coda slots, and loop_states[i] = row T-1's final state (the
                                   head's input) at depth i + 1 (i >= first_iter; the rows before
                                   are left as they were); NULL = a plain pass                  */
    /* a part pass (core/forward.h's tl_part); all zero = the whole pass */
    uint32_t first_iter;        /* 0: from the embedding; else the rows enter core iteration
                                   first_iter (< loops) with state_in and inject_in            */
    uint32_t coda_depth;        /* whose coda slots the coda writes; 0 = the rows' loops       */
    const float* state_in;      /* [T][d] host, with first_iter > 0: each row's state after
                                   iteration first_iter - 1                                     */
    const float* inject_in;     /* [T][d] host, with first_iter > 0 and injection: each row's
                                   injected term linear(adapter_inject; Q8(e))                 */
    float* state_out;           /* [T][d] each row's state after iteration loops - 1 (before
                                   the coda); NULL = not wanted                                */
    float* inject_out;          /* [T][d] each row's injected term (injection only); NULL = not
                                   wanted                                                      */
    /* a hidden-state prefix build's (docs/spec.md §5.4.1): called once for every block the pass
     * runs, with its cache slot and the rows [row0, row0 + n) of the state it runs on, x [n][d]
     * (host memory, valid during the call): the layer input its attention's NQ reads. NULL =
     * none (such a pass never replays a graph). */
    void (*capture)(void* ctx, uint32_t slot, size_t row0, size_t n, const float* x);
    void* capture_ctx;
} tl_cuda_batch;

/* Run the batch; returns once the outputs are in host memory. Calls on one tl_cuda are
 * serialized (a lock), so a model may be used from many threads. Fails with
 * TL_ERR_OUT_OF_MEMORY (device scratch) or TL_ERR_INTERNAL (a CUDA error, named in the
 * message) before or after writing the KV of this batch's positions; the caller then rolls
 * those positions back, as on the CPU path. */
tl_status tl_cuda_forward(tl_cuda* c, const tl_cuda_batch* batch);

/* The KV of T positions in one cache slot from their layer input rows (docs/spec.md §5.4.1: a
 * sequence from a hidden-state prefix): the part of a block that writes K and V, on rows (q, a)
 * given instead of NQ(x). */
typedef struct tl_cuda_kv_rows {
    size_t T;
    const tl_cuda_row* rows;    /* [T] host: pos, loops, write_data, write_slot (token, window
                                   and spans unused)                                          */
    uint32_t slot;              /* the cache slot; its block runs (tl_slot_at)                */
    uint32_t block_size;        /* kvcache geometry, as tl_cuda_batch's                       */
    size_t head_bytes;
    uint32_t kv_bits;
    const int8_t* q;            /* [T][d] host: each row's NQ values                          */
    const float* a;             /* [T] host: each row's NQ scale                              */
} tl_cuda_kv_rows;

/* z = linear(attn_qkv; q, a) (+ bias), RoPE of the K heads at each row's position, and the
 * K/V write into each row's cache slot, exactly as tl_cuda_forward's blocks write them;
 * returns once written. Serialized with tl_cuda_forward; fails like it. */
tl_status tl_cuda_kv_from_rows(tl_cuda* c, const tl_cuda_kv_rows* kv);

#ifdef __cplusplus
}
#endif

#endif
