/* test_backend.c — the backend seam (core/backend.h), on the CPU. One model runs behind a
 * recording backend that delegates the pass to the CPU backend and places every KV block's data
 * in a "device" allocator of its own (host memory, so the CPU pass can still read it). Checked:
 * the core reaches the pass only through the seam (every entry point is counted), block data
 * comes from the backend's allocator and all of it goes back, an allocator failure leaves the
 * sequence unchanged, a prefix build hands every chunk's pass its loop_states (so each chunk
 * writes every depth's coda slots), a hidden-state prefix is refused on a backend without
 * kv_from_rows and an exit rule on one without an adaptive pass (as on CUDA), and the logits are
 * bit-identical to the same model run plainly. */
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/engine.h"
#include "core/forward.h"
#include "core/seq.h"
#include "test_util.h"

enum { BLOCK = 4, PROMPT = 11, CHUNK = 3, DECODES = 5, MAX_V = 512 };

typedef struct recorder {
    tl_backend base;
    tl_backend* inner;  /* the CPU backend the model opened with */
    tl_kv_allocator kv; /* ctx = this recorder                   */
    int forwards, batches, heads;
    int builds; /* forward calls with loop_states (a prefix build's chunks) */
    int allocs, frees, fail_next_alloc;
} recorder;

static tl_status rec_forward(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                             float* logits_last, float* last_hidden, float* loop_states) {
    recorder* r = (recorder*)b;
    r->forwards++;
    r->builds += loop_states != NULL;
    return r->inner->iface->forward(r->inner, s, tokens, T, logits_all, logits_last, last_hidden, loop_states);
}

static tl_status rec_forward_batch(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                   float* const* logits, const tl_exit* exits, uint32_t* depths) {
    recorder* r = (recorder*)b;
    r->batches++;
    return r->inner->iface->forward_batch(r->inner, seqs, tokens, B, logits, exits, depths);
}

static tl_status rec_head_logits(tl_backend* b, const tl_engine* e, const float* x, float* logits) {
    recorder* r = (recorder*)b;
    r->heads++;
    return r->inner->iface->head_logits(r->inner, e, x, logits);
}

static void rec_info(const tl_backend* b, tl_backend_info* out) {
    const recorder* r = (const recorder*)b;
    r->inner->iface->info(r->inner, out);
}

static void rec_free(tl_backend* b) { tl_backend_free(((recorder*)b)->inner); }

static void* rec_alloc(void* ctx, size_t bytes) {
    recorder* r = ctx;
    if (r->fail_next_alloc) {
        r->fail_next_alloc = 0;
        return NULL;
    }
    r->allocs++;
    return calloc(1, bytes);
}

static void rec_release(void* ctx, void* data) {
    recorder* r = ctx;
    r->frees++;
    free(data);
}

static const tl_backend_iface rec_iface = {.forward = rec_forward, .forward_batch = rec_forward_batch,
                                           .head_logits = rec_head_logits, .info = rec_info, .free = rec_free};

/* Every live block of s has its data outside its header: it came from the allocator. */
static int blocks_on_device(const tl_seq* s, const recorder* r) {
    for (size_t i = s->kv.first_live; i < s->kv.n_spans; i++) {
        const tl_kv_block* b = s->kv.spans[i].block;
        if (b && (b->device != &r->kv || b->data == (const char*)b + 64)) return 0;
    }
    return 1;
}

/* One token of each of `n` sequences through tl_forward_batch, as tl_generate_batch runs it. */
static tl_status batch_step(tl_seq** seqs, const int32_t* tokens, size_t n, float* const* logits) {
    const tl_engine* e = seqs[0]->engine;
    for (size_t i = 0; i < n; i++) {
        const tl_status st = tl_kv_reserve(&seqs[i]->kv, &e->kv_geom, seqs[i]->n_layers, seqs[i]->n, 1);
        if (st != TL_OK) return st;
    }
    const tl_status st = tl_forward_batch(seqs, tokens, n, logits, NULL, NULL);
    for (size_t i = 0; st == TL_OK && i < n; i++) seqs[i]->n++;
    return st;
}

int main(void) {
    tu_spec spec = tu_spec_default(); /* with a coda: its slots depend on the depth */
    spec.n_core = 2, spec.n_coda = 1;
    const char* path = tu_write_model("backend.tinyloop", &spec);
    tl_model* plain = tu_open(path, 2, TL_ISA_AUTO, BLOCK);
    tl_model* seam = tu_open(path, 2, TL_ISA_AUTO, BLOCK);
    tl_engine* e = NULL;
    CHECK_OK(tl_model_acquire(seam, &e));
    const size_t V = tl_engine_config(e)->vocab_size;
    CHECK(V <= MAX_V, "vocab %zu", V);

    static recorder rec;
    rec.base = (tl_backend){&rec_iface, &rec.kv};
    rec.inner = e->backend;
    rec.kv = (tl_kv_allocator){.alloc = rec_alloc, .free = rec_release, .ctx = &rec};
    e->backend = &rec.base; /* before any block exists */
    e->kv_geom.device = rec.base.kv;

    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (int32_t)((i * 37 + 5) % (int)V);
    static float want[PROMPT * MAX_V], got[PROMPT * MAX_V];
    tl_seq *p = NULL, *s = NULL;
    CHECK_OK(tl_seq_create(plain, 2, 0, &p));
    CHECK_OK(tl_seq_create(seam, 2, 0, &s));
    CHECK_OK(tl_seq_prefill_all(p, prompt, PROMPT, CHUNK, want));
    CHECK_OK(tl_seq_prefill_all(s, prompt, PROMPT, CHUNK, got));
    CHECK(tu_same_bits(want, got, PROMPT * V), "prefill logits differ behind the seam");
    CHECK(rec.forwards == (PROMPT + CHUNK - 1) / CHUNK, "%d forward calls for %d chunks", rec.forwards,
          (PROMPT + CHUNK - 1) / CHUNK);
    CHECK(rec.allocs > 0 && blocks_on_device(s, &rec), "KV block data did not come from the allocator");

    for (int k = 0; k < DECODES; k++) {
        const int32_t token = (int32_t)((k * 11 + 3) % (int)V);
        CHECK_OK(tl_seq_decode(p, token, want));
        CHECK_OK(tl_seq_decode(s, token, got));
        CHECK(tu_same_bits(want, got, V), "decode %d logits differ", k);
    }
    CHECK_OK(tl_seq_last_logits(p, want));
    const int heads = rec.heads;
    CHECK_OK(tl_seq_last_logits(s, got));
    CHECK(rec.heads == heads + 1 && tu_same_bits(want, got, V), "last logits: %d head calls", rec.heads - heads);

    /* an allocation failure of the device leaves the sequence as it was */
    const size_t n_before = tl_seq_length(s);
    while (tl_seq_length(s) % BLOCK) { /* the next position opens a block */
        CHECK_OK(tl_seq_decode(s, 1, got));
        CHECK_OK(tl_seq_decode(p, 1, want));
    }
    rec.fail_next_alloc = 1;
    const int frees = rec.frees;
    CHECK_STATUS(tl_seq_decode(s, 2, got), TL_ERR_OUT_OF_MEMORY);
    CHECK(rec.fail_next_alloc == 0 && rec.frees == frees, "the failed block was not the allocator's");
    CHECK(tl_seq_length(s) == tl_seq_length(p) && tl_seq_length(s) >= n_before, "failed decode moved the sequence");
    CHECK_OK(tl_seq_decode(p, 2, want));
    CHECK_OK(tl_seq_decode(s, 2, got));
    CHECK(tu_same_bits(want, got, V), "decode after the failure differs");

    /* a batched step of two sequences (one forked) goes through forward_batch */
    tl_seq *pf = NULL, *sf = NULL;
    CHECK_OK(tl_seq_fork(p, &pf));
    CHECK_OK(tl_seq_fork(s, &sf));
    tl_seq* pair[2] = {s, sf};
    const int32_t tokens[2] = {7, 9};
    float* outs[2] = {got, got + V};
    CHECK_OK(batch_step(pair, tokens, 2, outs));
    CHECK(rec.batches == 1, "%d forward_batch calls", rec.batches);
    CHECK_OK(tl_seq_decode(p, tokens[0], want));
    CHECK_OK(tl_seq_decode(pf, tokens[1], want + V));
    CHECK(tu_same_bits(want, got, 2 * V), "batched logits differ");
    CHECK(blocks_on_device(s, &rec) && blocks_on_device(sf, &rec), "batch blocks not from the allocator");

    /* a prefix build: every chunk's pass carries loop_states; the prefix serves depth 1 exactly */
    const int forwards = rec.forwards;
    tl_prefix* prefix = NULL;
    CHECK_OK(tl_prefix_build(seam, prompt, PROMPT, 2, 0, CHUNK, &prefix));
    CHECK(rec.forwards - forwards == (PROMPT + CHUNK - 1) / CHUNK && rec.builds == rec.forwards - forwards,
          "prefix build: %d forward calls, %d with loop_states", rec.forwards - forwards, rec.builds);
    tl_seq* from = NULL;
    CHECK_OK(tl_seq_from_prefix(prefix, 1, &from));
    CHECK_OK(tl_seq_last_logits(from, got));
    tl_seq* fresh = NULL;
    CHECK_OK(tl_seq_create(plain, 1, 0, &fresh));
    CHECK_OK(tl_seq_prefill(fresh, prompt, PROMPT, 0, want));
    CHECK(tu_same_bits(want, got, V), "prefix at depth 1 differs from a fresh run");
    tl_seq_free(from);
    tl_seq_free(fresh);
    tl_prefix_free(prefix);

    /* this backend has no kv_from_rows: a hidden-state prefix is refused, naming why */
    prefix = (tl_prefix*)&prefix;
    CHECK_STATUS(tl_prefix_build_ex(seam, prompt, PROMPT, 2, 0, CHUNK, TL_PREFIX_STORE_H4, &prefix),
                 TL_ERR_INVALID_ARGUMENT);
    CHECK(prefix == NULL && strstr(tl_last_error(), "h4 prefixes need a backend that rebuilds the KV from rows"),
          "message: %s", tl_last_error());

    /* nor runs exit rules: a request with one is refused as on CUDA, plain decoding still runs */
    tl_gen_params gp = tl_gen_params_default();
    int32_t out[4];
    size_t n_out = 7;
    gp.max_tokens = 4, gp.loops = 2;
    static const uint32_t rules[] = {TL_EXIT_LATENT, TL_EXIT_KL, TL_EXIT_ARGMAX};
    for (size_t i = 0; i < sizeof rules / sizeof *rules; i++) {
        gp.exit_rule = rules[i];
        CHECK_STATUS(tl_generate(seam, prompt, PROMPT, &gp, out, &n_out, NULL), TL_ERR_UNSUPPORTED);
        CHECK(n_out == 0 && strcmp(tl_last_error(), "adaptive depth (exit_rule) is not on the CUDA backend yet") == 0,
              "rule %u, message: %s", rules[i], tl_last_error());
    }
    gp.exit_rule = TL_EXIT_NONE;
    CHECK_OK(tl_generate(seam, prompt, PROMPT, &gp, out, &n_out, NULL));

    tl_seq_free(s);
    tl_seq_free(sf);
    CHECK(rec.allocs > 0 && rec.frees == rec.allocs, "%d block allocations, %d frees", rec.allocs, rec.frees);
    tl_seq_free(p);
    tl_seq_free(pf);
    tl_engine_unref(e);
    tl_model_free(plain);
    tl_model_free(seam); /* frees the recorder's inner backend */
    return tu_finish("test_backend");
}
