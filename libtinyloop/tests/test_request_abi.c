/* test_request_abi.c — tl_generate_batch across versions of tl_request. A caller compiled
 * against a newer header, whose tl_request has more fields (emulated by a padded struct with
 * this header's fields first), a caller compiled against this header, and a batch mixing the
 * two all get exactly the tokens and logits (bit patterns) of tl_generate for every request,
 * not only the first; the library writes nothing past its own fields. A size smaller than this
 * library's struct is refused with TL_ERR_INVALID_ARGUMENT naming the request, before any
 * request is touched; so is a request pointer given twice (two streams would share its n_out
 * and out_tokens), adjacent or not. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { N = 5, MAX_NEW = 7, PROMPT_MAX = 19 };

/* What a newer header's tl_request could look like: the same fields, then new ones. */
typedef struct newer_request {
    tl_request base;
    uint64_t future[6];
} newer_request;

static const uint64_t FUTURE = 0xa5a5a5a5deadbeefu;

static uint32_t V;
static int32_t prompts[N][PROMPT_MAX];
static size_t prompt_lengths[N];
static tl_gen_params params[N];

typedef struct outputs {
    int32_t tokens[N][MAX_NEW];
    float* logits[N]; /* [MAX_NEW][V] each */
    size_t n[N];
} outputs;

static void outputs_init(outputs* o) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < N; i++) o->logits[i] = calloc((size_t)MAX_NEW * V, sizeof(float));
}

static void outputs_free(outputs* o) {
    for (int i = 0; i < N; i++) free(o->logits[i]);
}

static void fill(tl_request* r, size_t size, int i, outputs* o) {
    memset(r, 0, sizeof *r);
    r->size = size;
    r->prompt = prompts[i];
    r->n_prompt = prompt_lengths[i];
    r->params = &params[i];
    r->out_tokens = o->tokens[i];
    r->out_logits = o->logits[i];
}

static void check_equal(const outputs* want, const outputs* got, const char* what) {
    for (int i = 0; i < N; i++) {
        CHECK(got->n[i] == want->n[i] && memcmp(got->tokens[i], want->tokens[i], want->n[i] * sizeof(int32_t)) == 0,
              "%s: request %d: tokens differ (%zu vs %zu emitted)", what, i, got->n[i], want->n[i]);
        CHECK(tu_same_bits(got->logits[i], want->logits[i], want->n[i] * V), "%s: request %d: logits differ", what, i);
    }
}

/* Every request as this header's struct, as the newer struct, or alternating (`mode` 0, 1, 2). */
static void check_batch(tl_model* m, const outputs* want, int mode, const char* what) {
    tl_request plain[N];
    newer_request newer[N];
    tl_request* batch[N];
    outputs got;
    outputs_init(&got);
    for (int i = 0; i < N; i++) {
        const int use_newer = mode == 1 || (mode == 2 && i % 2);
        if (use_newer) {
            fill(&newer[i].base, sizeof newer[i], i, &got);
            for (int j = 0; j < 6; j++) newer[i].future[j] = FUTURE;
            batch[i] = &newer[i].base;
        } else {
            fill(&plain[i], sizeof plain[i], i, &got);
            batch[i] = &plain[i];
        }
    }
    CHECK_OK(tl_generate_batch(m, batch, N));
    for (int i = 0; i < N; i++) got.n[i] = batch[i]->n_out;
    check_equal(want, &got, what);
    for (int i = 0; i < N; i++)
        if (mode == 1 || (mode == 2 && i % 2))
            for (int j = 0; j < 6; j++)
                CHECK(newer[i].future[j] == FUTURE, "%s: request %d: the field after the library's was written", what, i);
    outputs_free(&got);
}

/* N valid requests into o, each n_out = 77 and out_tokens all -1: a refused batch leaves
 * them so. */
static void fill_unwritten(tl_request r[N], outputs* o) {
    for (int k = 0; k < N; k++) {
        fill(&r[k], sizeof r[k], k, o);
        r[k].n_out = 77;
        for (int t = 0; t < MAX_NEW; t++) o->tokens[k][t] = -1;
    }
}

/* A request of `size` bytes among valid ones: refused, and no request written. */
static void check_refused(tl_model* m, size_t size) {
    outputs o;
    outputs_init(&o);
    tl_request r[N];
    tl_request* batch[N];
    fill_unwritten(r, &o);
    for (int i = 0; i < N; i++) batch[i] = &r[i];
    r[2].size = size;
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_INVALID_ARGUMENT);
    char want[128];
    snprintf(want, sizeof want, "request 2: size %zu is less than sizeof(tl_request) = %zu", size, sizeof(tl_request));
    CHECK(strstr(tl_last_error(), want) != NULL, "message: %s", tl_last_error());
    for (int i = 0; i < N; i++) CHECK(r[i].n_out == 77, "request %d was written although the batch was refused", i);
    outputs_free(&o);
}

/* batch[k] = &r[to[k]] for valid requests r, some given twice: refused naming the first
 * repeat, batch[j] the same as batch[i], and nothing written. */
static void check_aliased(tl_model* m, const int to[N], int j, int i) {
    outputs o;
    outputs_init(&o);
    tl_request r[N];
    tl_request* batch[N];
    fill_unwritten(r, &o);
    for (int k = 0; k < N; k++) batch[k] = &r[to[k]];
    CHECK_STATUS(tl_generate_batch(m, batch, N), TL_ERR_INVALID_ARGUMENT);
    char want[64];
    snprintf(want, sizeof want, "request %d is the same as request %d", j, i);
    CHECK(strstr(tl_last_error(), want) != NULL, "message: %s", tl_last_error());
    for (int k = 0; k < N; k++) {
        CHECK(r[k].n_out == 77, "request %d was written although the batch was refused", k);
        for (int t = 0; t < MAX_NEW; t++)
            CHECK(o.tokens[k][t] == -1, "request %d: out_tokens[%d] written although the batch was refused", k, t);
        for (size_t x = 0; x < (size_t)MAX_NEW * V; x++)
            CHECK(o.logits[k][x] == 0.0f, "request %d: out_logits[%zu] written although the batch was refused", k, x);
    }
    outputs_free(&o);
}

int main(void) {
    tu_spec spec = tu_spec_default();
    V = spec.vocab;
    const char* path = tu_write_model("request_abi.tinyloop", &spec);
    tl_model* m = tu_open(path, 2, TL_ISA_AUTO, 4);
    uint64_t rng = 11;
    outputs want;
    outputs_init(&want);
    for (int i = 0; i < N; i++) {
        prompt_lengths[i] = (size_t)tu_uniform(&rng, 1, PROMPT_MAX);
        for (size_t j = 0; j < prompt_lengths[i]; j++) prompts[i][j] = tu_uniform(&rng, 0, (int32_t)V - 1);
        params[i] = tl_gen_params_default();
        params[i].max_tokens = (size_t)tu_uniform(&rng, 2, MAX_NEW);
        params[i].loops = (uint32_t)tu_uniform(&rng, 1, 3);
        params[i].temperature = i % 2 ? 0.8f : 0.0f;
        params[i].seed = tu_next(&rng);
        CHECK_OK(tl_generate(m, prompts[i], prompt_lengths[i], &params[i], want.tokens[i], &want.n[i], want.logits[i]));
    }
    check_batch(m, &want, 0, "this header's tl_request");
    check_batch(m, &want, 1, "a newer, larger tl_request");
    check_batch(m, &want, 2, "both in one batch");
    check_refused(m, offsetof(tl_request, n_out)); /* an older struct, without the last field */
    check_refused(m, 0);                           /* size not set */
    check_aliased(m, (const int[N]){0, 1, 1, 3, 4}, 2, 1); /* adjacent */
    check_aliased(m, (const int[N]){0, 1, 2, 3, 0}, 4, 0); /* first and last */
    check_aliased(m, (const int[N]){3, 0, 0, 3, 3}, 2, 1); /* two repeated: the first repeat named */
    outputs_free(&want);
    tl_model_free(m);
    return tu_finish("test_request_abi");
}
