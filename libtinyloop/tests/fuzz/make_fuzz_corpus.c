/* make_fuzz_corpus.c — writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/):
 * small valid files of every kind each reader takes, so the fuzzers start past the magic and
 * the structure. Deterministic: the same bytes on every run (and checked into git; CI checks
 * that a fresh run writes exactly the files there).
 *   model_file/   version 1, 2 and 3 models: int8 and int4, every block layout and version-2
 *                 option, the bytes tokenizer, hf tokenizer meta texts, an exit gate, a
 *                 two-state core with the attention gate, loop attention, block activations
 *   prefix_blob/  blobs of fuzz_blob_model_spec's model: KV int8 and int4, a window, warm start
 *                 with states, hidden-state h8 and h4
 *   prefix_blob_model.tinyloop   that model's file (for the Python readers: readers_agree.py)
 *   block_file/   spilled blocks of fuzz_block_model's tier: int8 and int4, with a salt,
 *                 a coda depth, two layer counts
 * usage: make_fuzz_corpus OUT_DIR   (OUT_DIR/<target>/ are created; existing files replaced) */
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_util.h"

static const char* out_dir;

static void write_seed(const char* target, const char* name, const uint8_t* bytes, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", out_dir, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        exit(2);
    }
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

/* ---- model files ------------------------------------------------------------------------------ */

static tu_spec tiny(tu_spec s) {
    s.vocab = 40, s.d = 16, s.heads = 2, s.kv_heads = 1, s.head_dim = 8, s.ffn = 24;
    s.max_seq = 8, s.loops = 2;
    return s;
}

static void model_seeds(void) {
    struct {
        const char* name;
        tu_spec spec;
    } seeds[] = {
        {"v2-default", tiny(tu_spec_default())}, {"v2-rich-hf", tiny(tu_spec_rich())},
        {"v2-huginn", tiny(tu_spec_huginn())},   {"v2-coda", tiny(tu_spec_coda())},
        {"v1", tiny(tu_spec_default())},         {"v2-int4-post", tiny(tu_spec_huginn())},
        {"v3-exit-gate", tiny(tu_spec_default())}, {"v3-two-state", tiny(tu_spec_hrm())},
        {"v3-loop", tiny(tu_spec_loop())},      {"v3-act-block", tiny(tu_spec_huginn())},
    };
    seeds[0].spec.vocab = 256; /* the bytes tokenizer */
    seeds[4].spec.version = 1;
    seeds[5].spec.int4 = 1, seeds[5].spec.group_size = 8, seeds[5].spec.layout = 2, seeds[5].spec.tied = 1;
    seeds[6].spec.version = 3, seeds[6].spec.exit_gate = 1, seeds[6].spec.exit_threshold = 0.5f;
    seeds[9].spec.version = 3, seeds[9].spec.act_block = 8;
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        size_t n = 0;
        uint8_t* bytes = tu_model_bytes(&seeds[i].spec, &n);
        write_seed("model_file", seeds[i].name, bytes, n);
        free(bytes);
    }
}

/* ---- prefix blobs ----------------------------------------------------------------------------- */

static void blob_seed(tl_model* m, const char* name, uint32_t loops, uint32_t window, uint32_t flags) {
    const int32_t tokens[] = {3, 1, 4, 1, 5, 9, 2, 6, 5};
    tl_prefix* p = NULL;
    if (tl_prefix_build_ex(m, tokens, sizeof tokens / sizeof tokens[0], loops, window, 0, flags, &p) != TL_OK) {
        fprintf(stderr, "%s: %s\n", name, tl_last_error());
        exit(2);
    }
    const tu_blob b = tu_save(p);
    write_seed("prefix_blob", name, b.bytes, b.n);
    free(b.bytes);
    tl_prefix_free(p);
}

static void blob_seeds(void) {
    const tu_spec spec = fuzz_blob_model_spec();
    size_t n = 0;
    uint8_t* bytes = tu_model_bytes(&spec, &n);
    char path[1024];
    snprintf(path, sizeof path, "%s/prefix_blob_model.tinyloop", out_dir);
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
    free(bytes);
    tl_model* m8 = fuzz_open_spec(&spec, TL_KV_INT8);
    blob_seed(m8, "kv8", 2, 0, 0);
    blob_seed(m8, "kv8-window", 1, 6, 0);
    blob_seed(m8, "kv8-warm-states", 2, 0, TL_PREFIX_WARM_START);
    blob_seed(m8, "h8", 2, 0, TL_PREFIX_STORE_H8);
    blob_seed(m8, "h4", 3, 0, TL_PREFIX_STORE_H4);
    tl_model_free(m8);
    tl_model* m4 = fuzz_open_spec(&spec, TL_KV_INT4);
    blob_seed(m4, "kv4", 2, 0, 0);
    tl_model_free(m4);
}

/* ---- spilled block files ---------------------------------------------------------------------- */

/* A valid random record byte: never the int8 -128 nor the int4 nibble -8. */
static int8_t record_byte(uint64_t* rng, uint32_t kv_bits) {
    uint8_t v = (uint8_t)tu_next(rng);
    if (kv_bits == 8 && v == 0x80) v = 0x7f;
    if (kv_bits == 4 && (v & 0x0f) == 0x08) v ^= 0x01;
    if (kv_bits == 4 && (v & 0xf0) == 0x80) v ^= 0x10;
    return (int8_t)v;
}

static void block_seed(const char* name, uint32_t kv_bits, const char* salt, uint32_t depth, uint32_t index,
                       uint32_t n_layers) {
    const tl_block_model m = fuzz_block_model(kv_bits);
    const tl_kv_geom* g = &m.geom;
    uint64_t rng = 7 + kv_bits + index;
    int32_t tokens[FUZZ_BLOCK_MAX_SEQ];
    for (int i = 0; i < FUZZ_BLOCK_MAX_SEQ; i++) tokens[i] = tu_uniform(&rng, 0, (int32_t)m.vocab_size - 1);
    tl_kv_table t = {0};
    if (tl_kv_reserve(&t, g, n_layers, (size_t)index * g->block_size, g->block_size) != TL_OK) exit(2);
    tl_kv_block* b = t.spans[t.n_spans - 1].block;
    const size_t R = tl_kv_row_bytes(g);
    for (uint32_t l = 0; l < n_layers; l++)
        for (uint32_t h = 0; h < g->n_kv_heads; h++) {
            int8_t* rows[2] = {tl_kv_keys(g, b, l, h), tl_kv_values(g, b, l, h)};
            for (int k = 0; k < 2; k++)
                for (size_t i = 0; i < g->block_size * R; i++) rows[k][i] = record_byte(&rng, kv_bits);
            for (uint32_t p = 0; p < g->block_size; p++) {
                tl_kv_key_scales(g, b, l, h)[p] = (float)tu_uniform(&rng, 0, 999) / 64.0f;
                tl_kv_value_scales(g, b, l, h)[p] = (float)tu_uniform(&rng, 0, 999) / 32.0f;
            }
        }
    const tl_block_place at = {salt, 0, depth, index, tokens, 0};
    const size_t n = tl_block_file_size(&m, strlen(salt), index, n_layers);
    uint8_t* bytes = malloc(n);
    if (!bytes || tl_block_file_encode(&m, &at, b, NULL, bytes) != TL_OK) exit(2);
    write_seed("block_file", name, bytes, n);
    free(bytes);
    tl_kv_clear(&t);
}

static void block_seeds(void) {
    block_seed("int8", 8, "", 0, 0, 2);
    block_seed("int8-salt-coda", 8, "tenant-a", 2, 1, 3);
    block_seed("int4", 4, "", 0, 1, 1);
}

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    model_seeds();
    blob_seeds();
    block_seeds();
    return 0;
}
