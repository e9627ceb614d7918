/* test_kv_int4.c — the int4 KV mode (tl_model_params.kv_mode = TL_KV_INT4, docs/spec.md §4):
 * the nibble packing round-trips every Q4 value at every position; an int4 block is the exact
 * size the geometry promises, about half an int8 one; the mode is validated, size-versioned and
 * reported; and an int4 model gives identical tokens and bit-identical logits on every ISA this
 * CPU has, one thread or three, any chunk and block size (segments longer than the unpack buffer
 * included), with and without an automatic prefix cache hit, from an explicit prefix, with a
 * window, with speculative decoding and from a deepened warm-start prefix — while its logits
 * differ from the int8 mode's (the cache really holds Q4 values) and stay close to them. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/kvcache.h"
#include "test_util.h"

enum { MAX_NEW = 8, PROMPT_MAX = 300 };

/* ---- packing and geometry ---------------------------------------------------------------------- */

static void test_packing(void) {
    int8_t q[30], back[30], packed[15];
    for (int a = -7; a <= 7; a++)
        for (int b = -7; b <= 7; b++) {
            for (int i = 0; i < 30; i++) q[i] = (int8_t)(i % 2 ? b : a); /* a at even, b at odd positions */
            q[29 - (a + 7)] = (int8_t)-a;                                  /* and a few mixed ones */
            tl_kv_pack4(q, 30, packed);
            CHECK((uint8_t)packed[0] == (uint8_t)(((unsigned)a & 15u) | ((unsigned)b & 15u) << 4),
                  "pack4(%d, %d) = 0x%02x", a, b, (uint8_t)packed[0]);
            tl_kv_unpack4(packed, 30, back);
            CHECK(memcmp(q, back, sizeof q) == 0, "unpack4(pack4) differs for %d, %d", a, b);
        }
}

static size_t round64(size_t x) { return (x + 63) / 64 * 64; }

static void test_geometry(void) {
    const uint32_t sizes[] = {1, 4, 5, 16, 17, 300}, dims[] = {2, 6, 12, 64, 1024};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        for (size_t j = 0; j < sizeof dims / sizeof *dims; j++) {
            const size_t bs = sizes[i], D = dims[j];
            const tl_kv_geom g8 = tl_kv_geom_make(sizes[i], 3, dims[j], 8);
            const tl_kv_geom g4 = tl_kv_geom_make(sizes[i], 3, dims[j], 4);
            CHECK(tl_kv_row_bytes(&g8) == D && tl_kv_row_bytes(&g4) == D / 2, "row bytes %zu %zu",
                  tl_kv_row_bytes(&g8), tl_kv_row_bytes(&g4));
            CHECK(g8.head_bytes == round64(2 * bs * D + 8 * bs), "int8 head bytes %zu (bs %zu, D %zu)",
                  g8.head_bytes, bs, D);
            CHECK(g4.head_bytes == round64(bs * D + 8 * bs), "int4 head bytes %zu (bs %zu, D %zu)", g4.head_bytes,
                  bs, D);
            CHECK(tl_kv_block_bytes(&g4, 5) == 64 + 5 * 3 * g4.head_bytes, "int4 block bytes %zu",
                  tl_kv_block_bytes(&g4, 5));
            /* the rows halve; the scales and the 64-byte rounding stay */
            CHECK(2 * g4.head_bytes <= g8.head_bytes + 8 * bs + 128, "int4 %zu vs int8 %zu", g4.head_bytes,
                  g8.head_bytes);
            /* the arrays follow each other inside a head's bytes, the scales 4-byte aligned */
            tl_kv_block b = {.data = (void*)(uintptr_t)4096};
            char* keys = (char*)tl_kv_keys(&g4, &b, 1, 2);
            char* values = (char*)tl_kv_values(&g4, &b, 1, 2);
            char* scales = (char*)tl_kv_key_scales(&g4, &b, 1, 2);
            CHECK((uintptr_t)scales % 4 == 0 && scales - values >= (ptrdiff_t)(bs * D / 2) &&
                      values - keys == (ptrdiff_t)(bs * D / 2) &&
                      (char*)tl_kv_value_scales(&g4, &b, 1, 2) + 4 * bs <= keys + g4.head_bytes,
                  "int4 layout (bs %zu, D %zu)", bs, D);
        }
}

/* ---- the public API ---------------------------------------------------------------------------- */

typedef struct opening {
    tl_isa isa;
    uint32_t threads, block_size;
    size_t cache_bytes;
    tl_kv_mode kv_mode;
} opening;

static tl_model* open_model(const char* path, opening o) {
    tl_model_params p = tl_model_params_default();
    p.isa = o.isa;
    p.n_threads = o.threads;
    p.kv_block_size = o.block_size;
    p.prefix_cache_bytes = o.cache_bytes;
    p.kv_mode = o.kv_mode;
    tl_model* m = NULL;
    CHECK_OK(tl_model_open(path, &p, &m));
    return m;
}

static uint32_t vocab_of(tl_model* m) {
    tl_model_config c = {.size = sizeof c};
    CHECK_OK(tl_model_config_get(m, &c));
    return c.vocab_size;
}

/* What one generation gave. */
typedef struct result {
    int32_t tokens[MAX_NEW];
    size_t n;
    float* logits; /* [MAX_NEW][V] */
} result;

typedef struct request {
    const int32_t* prompt;
    size_t n, chunk;
    uint32_t window, n_draft; /* n_draft > 0: draft at depth 1 */
    size_t prefix_n;          /* > 0: the first prefix_n tokens through tl_prefix_build */
} request;

static result generate(tl_model* m, const request* r) {
    const uint32_t V = vocab_of(m);
    result out = {.n = 0, .logits = calloc((size_t)MAX_NEW * V, sizeof(float))};
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = MAX_NEW;
    gp.cache_window = r->window;
    gp.prefill_chunk = r->chunk;
    if (r->n_draft) gp.draft_loops = 1, gp.n_draft = r->n_draft;
    if (r->prefix_n) {
        tl_prefix* p = NULL;
        CHECK_OK(tl_prefix_build(m, r->prompt, r->prefix_n, 0, r->window, r->chunk, &p));
        if (p)
            CHECK_OK(tl_generate_from_prefix(p, r->prompt + r->prefix_n, r->n - r->prefix_n, &gp, out.tokens, &out.n,
                                             out.logits));
        tl_prefix_free(p);
    } else {
        CHECK_OK(tl_generate(m, r->prompt, r->n, &gp, out.tokens, &out.n, out.logits));
    }
    return out;
}

static int same_result(const result* a, const result* b, uint32_t V) {
    return a->n == b->n && memcmp(a->tokens, b->tokens, a->n * sizeof(int32_t)) == 0 &&
           tu_same_bits(a->logits, b->logits, a->n * V);
}

static int32_t prompt[PROMPT_MAX];

/* Every ISA, thread count and block size, each request shape: the scalar path's bits. */
static void test_identical_everywhere(const char* path, const uint32_t* blocks, size_t n_blocks,
                                      const request* reqs, size_t n_reqs) {
    tl_model* ref_model = open_model(path, (opening){TL_ISA_SCALAR, 1, 16, 0, TL_KV_INT4});
    if (!ref_model) return;
    const uint32_t V = vocab_of(ref_model);
    result* ref = calloc(n_reqs, sizeof *ref);
    for (size_t r = 0; r < n_reqs; r++) {
        request plain = reqs[r];
        plain.chunk = 0, plain.n_draft = 0, plain.prefix_n = 0;
        ref[r] = generate(ref_model, &plain);
        CHECK(ref[r].n == MAX_NEW, "reference request %zu emitted %zu tokens", r, ref[r].n);
    }
    size_t compared = 0;
    for (tl_isa isa = TL_ISA_SCALAR; isa <= TL_ISA_AMX; isa++) {
        if (!tl_cpu_supports(isa)) continue;
        for (size_t bi = 0; bi < n_blocks; bi++)
            for (int cached = 0; cached <= 1; cached++) { /* 1 thread without a prefix cache, 3 with one */
                const uint32_t threads = cached ? 3 : 1;
                tl_model* m = open_model(path, (opening){isa, threads, blocks[bi], cached ? 1 << 22 : 0, TL_KV_INT4});
                if (!m) continue;
                for (size_t r = 0; r < n_reqs; r++)
                    for (int again = 0; again <= cached; again++) { /* a miss, then a hit */
                        result got = generate(m, &reqs[r]);
                        CHECK(same_result(&got, &ref[r], V),
                              "isa %d, %u threads, block %u, cache %d (pass %d), request %zu: differs", (int)isa,
                              threads, blocks[bi], cached, again, r);
                        compared++;
                        free(got.logits);
                    }
                if (cached && blocks[bi] <= reqs[0].n) { /* the prompts fill a block */
                    tl_prefix_cache_stats st = {.size = sizeof st};
                    CHECK_OK(tl_model_prefix_cache_stats(m, &st));
                    CHECK(st.hit_tokens > 0, "isa %d block %u: the cache never hit", (int)isa, blocks[bi]);
                }
                tl_model_free(m);
            }
    }
    CHECK(compared > 0, "nothing compared");
    for (size_t r = 0; r < n_reqs; r++) free(ref[r].logits);
    free(ref);
    tl_model_free(ref_model);
}

/* A warm-start prefix deepened in place (its blocks' int4 rows copied into deeper blocks) is
 * the prefix built at that depth: the same generation, on every ISA. */
static void test_warm_start(const char* path) {
    const size_t n = 19;
    for (tl_isa isa = TL_ISA_SCALAR; isa <= TL_ISA_AMX; isa++) {
        if (!tl_cpu_supports(isa)) continue;
        tl_model* m = open_model(path, (opening){isa, 2, 4, 0, TL_KV_INT4});
        if (!m) continue;
        const uint32_t V = vocab_of(m);
        tl_gen_params gp = tl_gen_params_default();
        gp.max_tokens = MAX_NEW;
        tl_prefix *built = NULL, *deepened = NULL;
        CHECK_OK(tl_prefix_build(m, prompt, n, 4, 0, 0, &built));
        CHECK_OK(tl_prefix_build_ex(m, prompt, n, 2, 0, 5, TL_PREFIX_WARM_START, &deepened));
        CHECK_OK(tl_prefix_extend(deepened, 4, 3));
        result want = {.n = 0, .logits = calloc((size_t)MAX_NEW * V, sizeof(float))};
        result got = {.n = 0, .logits = calloc((size_t)MAX_NEW * V, sizeof(float))};
        if (built && deepened) {
            CHECK_OK(tl_generate_from_prefix(built, prompt + n, 3, &gp, want.tokens, &want.n, want.logits));
            CHECK_OK(tl_generate_from_prefix(deepened, prompt + n, 3, &gp, got.tokens, &got.n, got.logits));
            CHECK(want.n == MAX_NEW && same_result(&want, &got, V), "isa %d: the deepened prefix differs", (int)isa);
        }
        free(want.logits), free(got.logits);
        tl_prefix_free(built);
        tl_prefix_free(deepened);
        tl_model_free(m);
    }
}

/* int4 changes the logits (the cache holds Q4 values), but not by much. */
static void test_differs_from_int8(const char* path, const request* r) {
    tl_model* m8 = open_model(path, (opening){TL_ISA_AUTO, 2, 16, 0, TL_KV_INT8});
    tl_model* m4 = open_model(path, (opening){TL_ISA_AUTO, 2, 16, 0, TL_KV_INT4});
    if (!m8 || !m4) return;
    const uint32_t V = vocab_of(m8);
    /* the logits of the first token only: later ones follow different tokens when the argmax moves */
    result a = generate(m8, r), b = generate(m4, r);
    double diff = 0, mag = 0;
    for (uint32_t v = 0; v < V; v++) {
        diff += fabs((double)a.logits[v] - b.logits[v]);
        mag += fabs((double)a.logits[v]);
    }
    CHECK(!tu_same_bits(a.logits, b.logits, V), "int4 logits equal the int8 ones: the mode changed nothing");
    CHECK(diff < 0.25 * mag, "int4 logits far from int8: mean |diff| %g, mean |logit| %g", diff / V, mag / V);
    free(a.logits);
    free(b.logits);
    tl_model_free(m8);
    tl_model_free(m4);
}

/* Cached int4 blocks take the geometry's bytes: 64 + n_layers * G * round64(bs * D + 8 bs). */
static void test_block_bytes(const char* path, const tu_spec* spec, const request* r) {
    size_t bytes[2] = {0, 0}, blocks[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        tl_model* m = open_model(path, (opening){TL_ISA_AUTO, 2, 4, 1 << 22, i ? TL_KV_INT4 : TL_KV_INT8});
        if (!m) return;
        result got = generate(m, r);
        free(got.logits);
        tl_prefix_cache_stats st = {.size = sizeof st};
        CHECK_OK(tl_model_prefix_cache_stats(m, &st));
        bytes[i] = st.bytes_in_use;
        blocks[i] = st.blocks;
        tl_model_free(m);
    }
    const size_t layers = spec->n_pre + (size_t)spec->loops * (spec->n_core + spec->n_coda), bs = 4,
                 D = spec->head_dim;
    CHECK(blocks[0] > 0 && blocks[0] == blocks[1], "blocks cached: int8 %zu, int4 %zu", blocks[0], blocks[1]);
    CHECK(bytes[1] == blocks[1] * (64 + layers * spec->kv_heads * round64(bs * D + 8 * bs)),
          "int4 cache bytes %zu for %zu blocks", bytes[1], blocks[1]);
    CHECK(bytes[0] == blocks[0] * (64 + layers * spec->kv_heads * round64(2 * bs * D + 8 * bs)),
          "int8 cache bytes %zu for %zu blocks", bytes[0], blocks[0]);
}

static tl_kv_mode runtime_mode(tl_model* m) {
    tl_model_runtime rt = {.size = sizeof rt};
    CHECK_OK(tl_model_runtime_get(m, &rt));
    return rt.kv_mode;
}

static void test_params(const char* path) {
    tl_model_params p = tl_model_params_default();
    CHECK(p.kv_mode == TL_KV_INT8, "default kv_mode %d", (int)p.kv_mode);
    p.n_threads = 1;
    tl_model* m = NULL;
    for (int mode = TL_KV_INT8; mode <= TL_KV_INT4; mode++) {
        p.kv_mode = (tl_kv_mode)mode;
        CHECK_OK(tl_model_open(path, &p, &m));
        if (m)
            CHECK(runtime_mode(m) == (tl_kv_mode)mode, "runtime kv_mode %d, opened with %d", (int)runtime_mode(m),
                  mode);
        tl_model_free(m);
        m = NULL;
    }
    p.kv_mode = (tl_kv_mode)7;
    CHECK_STATUS(tl_model_open(path, &p, &m), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "kv_mode") && strstr(tl_last_error(), "7"), "error: %s", tl_last_error());
    /* a caller built before kv_mode: its size ends before the field, and what follows is not read */
    p.size = offsetof(tl_model_params, kv_mode);
    CHECK_OK(tl_model_open(path, &p, &m));
    if (m) CHECK(runtime_mode(m) == TL_KV_INT8, "an older caller got kv_mode %d", (int)runtime_mode(m));
    tl_model_free(m);
}

int main(void) {
    for (int i = 0; i < PROMPT_MAX; i++) prompt[i] = (int32_t)((i * 37 + 11) % 256);
    test_packing();
    test_geometry();

    const tu_spec plain = tu_spec_default(), rich = tu_spec_rich();
    const char* plain_path = tu_write_model("plain", &plain);
    const char* rich_path = tu_write_model("rich", &rich);
    test_params(plain_path);

    const request reqs[] = {
        {prompt, 23, 0, 0, 0, 0},  /* whole prompt                          */
        {prompt, 23, 5, 0, 0, 0},  /* chunks of 5                           */
        {prompt, 30, 4, 9, 0, 0},  /* a window of 9                         */
        {prompt, 23, 3, 0, 3, 0},  /* speculative: 3 drafted at depth 1     */
        {prompt, 27, 0, 0, 0, 18}, /* 18 tokens from a prefix, 9 appended   */
        {prompt, 27, 4, 7, 2, 13}, /* a windowed prefix, chunks, speculative */
    };
    const uint32_t blocks[] = {1, 4, 16};
    test_identical_everywhere(plain_path, blocks, 3, reqs, sizeof reqs / sizeof *reqs);
    test_identical_everywhere(rich_path, blocks + 1, 2, reqs, sizeof reqs / sizeof *reqs);
    const tu_spec hrm = tu_spec_hrm();
    test_identical_everywhere(tu_write_model("hrm", &hrm), blocks + 1, 1, reqs, sizeof reqs / sizeof *reqs);

    /* head_dim 64 (full AVX2 and AMX rows) and blocks longer than the 256 rows unpacked at a time */
    tu_spec wide = tu_spec_default();
    wide.head_dim = 64, wide.max_seq = 320, wide.loops = 2, wide.seed = 7;
    const char* wide_path = tu_write_model("wide", &wide);
    const request longer[] = {{prompt, 290, 0, 0, 0, 0}, {prompt, 290, 100, 270, 2, 0}};
    const uint32_t big[] = {300};
    test_identical_everywhere(wide_path, big, 1, longer, 2);

    test_warm_start(rich_path);
    test_differs_from_int8(plain_path, &reqs[0]);
    test_differs_from_int8(rich_path, &reqs[0]);
    test_block_bytes(plain_path, &plain, &reqs[0]);
    return tu_finish("test_kv_int4");
}
