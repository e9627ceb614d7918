/* fuzz_prefix_blob.c — libFuzzer target: tl_prefix_load of the fuzzer's bytes as a prefix blob
 * (docs/spec.md §7), blob_bytes and checksum made consistent (fuzz_util.h), into the model of
 * fuzz_blob_model_spec with the KV mode the blob's kv_mode field names (so both record forms
 * get past that rule).
 *
 * Invariants: the load succeeds, or fails as TL_ERR_BAD_FILE with a "bad prefix blob: " message
 * (or TL_ERR_OUT_OF_MEMORY), and returns a prefix exactly when it succeeds. A blob it accepts
 * saves back to the same bytes when its kv_start is the one this model's writer picks (§7.3,
 * blocks of 4); one written with other blocks (kv_start earlier, §7.4) saves in this writer's
 * form, which loads and saves back to itself. A generation continuing it runs: finite logits,
 * or TL_ERR_NUMERIC, or TL_ERR_SEQ_TOO_LONG when the blob already fills the context. */
#include <string.h>

#include "fuzz_util.h"

enum { KV_MODE_AT = 40, WINDOW_AT = 48, N_TOKENS_AT = 56, KV_START_AT = 64, MAX_NEW = 2, BLOCK = 4 };

static tl_model* models[2]; /* by tl_kv_mode */
static uint32_t vocab;

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    const tu_spec spec = fuzz_blob_model_spec();
    models[TL_KV_INT8] = fuzz_open_spec(&spec, TL_KV_INT8);
    models[TL_KV_INT4] = fuzz_open_spec(&spec, TL_KV_INT4);
    vocab = spec.vocab;
    return 0;
}

/* The kv_start a writer with blocks of BLOCK stores a version-1 blob from (§7.3). */
static uint64_t written_kv_start(uint64_t n, uint32_t window) {
    if (window == 0) return 0;
    if (window == 1) return n;
    const uint64_t first = n + 1 > window ? n + 1 - window : 0;
    return first / BLOCK * BLOCK;
}

/* p saved: malloc'd, *n its size. */
static uint8_t* saved(const tl_prefix* p, size_t* n) {
    size_t wrote = 0;
    FUZZ_REQUIRE(tl_prefix_save(p, NULL, 0, n) == TL_OK, "size query: %s", tl_last_error());
    uint8_t* bytes = malloc(*n);
    FUZZ_REQUIRE(bytes != NULL, "%zu bytes", *n);
    FUZZ_REQUIRE(tl_prefix_save(p, bytes, *n, &wrote) == TL_OK && wrote == *n, "save: %s", tl_last_error());
    return bytes;
}

static void require_same(const uint8_t* a, size_t na, const uint8_t* b, size_t nb, const char* what) {
    FUZZ_REQUIRE(na == nb, "%s: %zu bytes, was %zu", what, na, nb);
    for (size_t i = 0; i < na; i++)
        FUZZ_REQUIRE(a[i] == b[i], "%s: byte %zu is %u, was %u", what, i, a[i], b[i]);
}

static void check_saves_back(tl_model* m, const tl_prefix* p, const uint8_t* blob, size_t n) {
    size_t n1 = 0;
    uint8_t* once = saved(p, &n1);
    const int writers_form = tu_get_u32(blob + 8) != 1 ||
                             tu_get_u64(blob + KV_START_AT) ==
                                 written_kv_start(tu_get_u64(blob + N_TOKENS_AT), tu_get_u32(blob + WINDOW_AT));
    if (writers_form) {
        require_same(once, n1, blob, n, "an accepted blob saved again");
    } else {
        tl_prefix* q = NULL;
        FUZZ_REQUIRE(tl_prefix_load(m, once, n1, &q) == TL_OK, "the saved form does not load: %s", tl_last_error());
        size_t n2 = 0;
        uint8_t* twice = saved(q, &n2);
        require_same(twice, n2, once, n1, "the saved form saved again");
        free(twice);
        tl_prefix_free(q);
    }
    free(once);
}

static void check_continues(const tl_prefix* p) {
    tl_gen_params g = tl_gen_params_default();
    g.max_tokens = MAX_NEW;
    size_t n_tokens = 0, nbytes = 0;
    uint32_t loops = 0, window = 0;
    tl_prefix_info(p, &n_tokens, &loops, &window, &nbytes);
    g.cache_window = window;
    int32_t tokens[MAX_NEW];
    float* logits = calloc((size_t)MAX_NEW * vocab, sizeof(float));
    FUZZ_REQUIRE(logits != NULL, "logits");
    size_t n = 0;
    const tl_status st = tl_generate_from_prefix(p, (const int32_t[]){1}, 1, &g, tokens, &n, logits);
    FUZZ_REQUIRE(st == TL_OK || st == TL_ERR_NUMERIC || st == TL_ERR_SEQ_TOO_LONG, "status %d (%s)", st,
                 tl_last_error());
    if (st == TL_OK) FUZZ_REQUIRE(fuzz_all_finite(logits, n * vocab), "non-finite logits returned as OK");
    free(logits);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    uint8_t* blob = fuzz_sealed_copy(data, size);
    const int int4 = size >= KV_MODE_AT + 4 && tu_get_u32(blob + KV_MODE_AT) == TL_KV_INT4;
    tl_prefix* p = NULL;
    tl_model* m = models[int4 ? TL_KV_INT4 : TL_KV_INT8];
    const tl_status st = tl_prefix_load(m, blob, size, &p);
    FUZZ_REQUIRE(st == TL_OK || st == TL_ERR_OUT_OF_MEMORY ||
                 (st == TL_ERR_BAD_FILE && strncmp(tl_last_error(), "bad prefix blob: ", 17) == 0),
                 "status %d (%s)", st, tl_last_error());
    fuzz_verdict(st);
    FUZZ_REQUIRE((st == TL_OK) == (p != NULL), "status %d with prefix %p", st, (void*)p);
    if (p) {
        check_saves_back(m, p, blob, size);
        check_continues(p);
    }
    tl_prefix_free(p);
    free(blob);
    return 0;
}
