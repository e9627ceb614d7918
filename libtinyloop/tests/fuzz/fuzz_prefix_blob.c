/* fuzz_prefix_blob.c — libFuzzer target: tl_prefix_load of the fuzzer's bytes as a prefix blob
 * (docs/spec.md §7), blob_bytes and checksum made consistent (fuzz_util.h), into the model of
 * fuzz_blob_model_spec with the KV mode the blob's kv_mode field names (so both record forms
 * get past that rule).
 *
 * Invariants: the load succeeds, or fails as TL_ERR_BAD_FILE with a "bad prefix blob: " message
 * (or TL_ERR_OUT_OF_MEMORY), and returns a prefix exactly when it succeeds. A blob it accepts
 * saves back to the same bytes (§7.3: the writer's form is the only one a reader accepts), and
 * a generation continuing it runs: finite logits, or TL_ERR_NUMERIC, or TL_ERR_SEQ_TOO_LONG
 * when the blob already fills the context. */
#include <string.h>

#include "fuzz_util.h"

enum { KV_MODE_AT = 40, MAX_NEW = 2 };

static tl_model* models[2]; /* by tl_kv_mode */
static uint32_t vocab;

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    const tu_spec spec = fuzz_blob_model_spec();
    models[TL_KV_INT8] = fuzz_open_spec(&spec, TL_KV_INT8);
    models[TL_KV_INT4] = fuzz_open_spec(&spec, TL_KV_INT4);
    vocab = spec.vocab;
    return 0;
}

static void check_saves_back(const tl_prefix* p, const uint8_t* blob, size_t n) {
    size_t need = 0, wrote = 0;
    FUZZ_REQUIRE(tl_prefix_save(p, NULL, 0, &need) == TL_OK, "size query: %s", tl_last_error());
    FUZZ_REQUIRE(need == n, "an accepted %zu-byte blob saves as %zu bytes", n, need);
    uint8_t* again = malloc(n);
    FUZZ_REQUIRE(again != NULL, "%zu bytes", n);
    FUZZ_REQUIRE(tl_prefix_save(p, again, n, &wrote) == TL_OK && wrote == n, "save: %s", tl_last_error());
    for (size_t i = 0; i < n; i++)
        FUZZ_REQUIRE(again[i] == blob[i], "an accepted blob saves back with byte %zu changed (%u, was %u)", i,
                     again[i], blob[i]);
    free(again);
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
    const tl_status st = tl_prefix_load(models[int4 ? TL_KV_INT4 : TL_KV_INT8], blob, size, &p);
    FUZZ_REQUIRE(st == TL_OK || st == TL_ERR_OUT_OF_MEMORY ||
                 (st == TL_ERR_BAD_FILE && strncmp(tl_last_error(), "bad prefix blob: ", 17) == 0),
                 "status %d (%s)", st, tl_last_error());
    fuzz_verdict(st);
    FUZZ_REQUIRE((st == TL_OK) == (p != NULL), "status %d with prefix %p", st, (void*)p);
    if (p) {
        check_saves_back(p, blob, size);
        check_continues(p);
    }
    tl_prefix_free(p);
    free(blob);
    return 0;
}
