/* test_loader.c — the `.tinyloop` reader against valid and hostile files (docs/spec.md §6):
 * named rule violations, truncation at many lengths, random byte flips with the checksum
 * fixed up, huge dimensions and offsets. Every bad file must give TL_ERR_BAD_FILE (never a
 * crash or an out-of-bounds read: run under ASan), and every accepted file must run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

static void put32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t* p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* Offset of table entry `name` (or -1). */
static long entry_of(const uint8_t* f, const char* name) {
    const uint32_t n = f[28] | f[29] << 8 | f[30] << 16 | (uint32_t)f[31] << 24;
    for (uint32_t i = 0; i < n; i++)
        if (strcmp((const char*)f + 256 + 96 * i, name) == 0) return 256 + 96 * (long)i;
    return -1;
}

/* Open bytes as a model; returns the status, and runs a token through an accepted model. */
static tl_status try_open(const uint8_t* bytes, size_t n) {
    const char* path = tu_write_file("hostile.tinyloop", bytes, n);
    tl_model* m = NULL;
    tl_model_params p = tl_model_params_default();
    p.n_threads = 1;
    tl_status st = tl_model_open(path, &p, &m);
    CHECK((st == TL_OK) == (m != NULL), "handle set iff TL_OK");
    if (st == TL_OK) {
        tl_seq* s = NULL;
        const int32_t tokens[3] = {1, 2, 3};
        CHECK_OK(tl_seq_create(m, 0, 0, &s));
        tl_status run = tl_seq_prefill(s, tokens, 3, 0, NULL);
        CHECK(run == TL_OK, "accepted file cannot run: %s", tl_last_error());
        tl_seq_free(s);
    } else {
        CHECK(st == TL_ERR_BAD_FILE, "status %d (%s) for a bad file: %s", st, tl_status_string(st), tl_last_error());
        CHECK(strlen(tl_last_error()) > 0, "empty error message");
    }
    tl_model_free(m);
    return st;
}

typedef void (*edit_fn)(uint8_t* f, size_t n);

/* Apply an edit to a fresh valid file (checksum fixed) and expect a message containing `needle`. */
static void expect_rule(const char* what, edit_fn edit, const char* needle, int fix_crc) {
    tu_spec spec = tu_spec_default();
    size_t n;
    uint8_t* f = tu_model_bytes(&spec, &n);
    edit(f, n);
    if (fix_crc) tu_fix_checksum(f, n);
    tl_status st = try_open(f, n);
    CHECK(st == TL_ERR_BAD_FILE, "%s: accepted", what);
    CHECK(strstr(tl_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what, tl_last_error(), needle);
    free(f);
}

static void e_magic(uint8_t* f, size_t n) { (void)n, f[0] = 'X'; }
static void e_version(uint8_t* f, size_t n) { (void)n, put32(f + 8, 2); }
static void e_header_bytes(uint8_t* f, size_t n) { (void)n, put32(f + 12, 128); }
static void e_file_bytes(uint8_t* f, size_t n) { put64(f + 16, n + 1); }
static void e_checksum(uint8_t* f, size_t n) { f[n - 1] ^= 1; }
static void e_vocab(uint8_t* f, size_t n) { (void)n, put32(f + 48, 1); }
static void e_kv_heads(uint8_t* f, size_t n) { (void)n, put32(f + 60, 3); }
static void e_head_dim(uint8_t* f, size_t n) { (void)n, put32(f + 64, 13); }
static void e_heads_dims(uint8_t* f, size_t n) { (void)n, put32(f + 56, 1u << 20), put32(f + 60, 1); }
static void e_n_pre(uint8_t* f, size_t n) { (void)n, put32(f + 72, 65); }
static void e_loops(uint8_t* f, size_t n) { (void)n, put32(f + 76, 0); }
static void e_format(uint8_t* f, size_t n) { (void)n, put32(f + 84, 3); }
static void e_group(uint8_t* f, size_t n) { (void)n, put32(f + 88, 4); }
static void e_tied(uint8_t* f, size_t n) { (void)n, put32(f + 92, 2); }
static void e_eos(uint8_t* f, size_t n) { (void)n, put32(f + 100, 256); }
static void e_eps(uint8_t* f, size_t n) { (void)n, put32(f + 112, 0x7fc00000); }
static void e_name(uint8_t* f, size_t n) { (void)n, memset(f + 120, 'a', 64); }
static void e_name_utf8(uint8_t* f, size_t n) { (void)n, f[120] = 0xc0, f[121] = 0x80; }
static void e_flags(uint8_t* f, size_t n) { (void)n, put32(f + 116, 1); }
static void e_reserved(uint8_t* f, size_t n) { (void)n, f[200] = 1; }
static void e_table_offset(uint8_t* f, size_t n) { (void)n, put64(f + 32, 320); }
static void e_n_tensors(uint8_t* f, size_t n) { (void)n, put32(f + 28, 0x7fffffff); }
static void e_data_offset(uint8_t* f, size_t n) { (void)n, put64(f + 40, get64(f + 40) + 1); }
static void e_dtype(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "tok_emb.s") + 48, 9); }
static void e_wrong_dtype(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "tok_emb.s") + 48, 3); }
static void e_ndim(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "tok_emb.s") + 52, 5); }
static void e_dims_zero(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "tok_emb.w") + 64, 0); }
static void e_huge_dims(uint8_t* f, size_t n) {
    (void)n;
    const long e = entry_of(f, "tok_emb.w");
    put64(f + e + 56, 1ull << 62);
    put64(f + e + 64, 1ull << 62);
}
static void e_huge_offset(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "loop.attn_qkv.s") + 88, ~63ull); }
static void e_misaligned(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "tok_emb.s") + 88, get64(f + entry_of(f, "tok_emb.s") + 88) + 4); }
static void e_overlap(uint8_t* f, size_t n) {
    (void)n;
    put64(f + entry_of(f, "tok_emb.s") + 88, get64(f + entry_of(f, "tok_emb.w") + 88));
}
static void e_duplicate(uint8_t* f, size_t n) { (void)n, memcpy(f + entry_of(f, "tok_emb.s"), "tok_emb.w", 10); }
static void e_unprintable(uint8_t* f, size_t n) { (void)n, f[entry_of(f, "tok_emb.s")] = 0x07; }
static void e_unexpected(uint8_t* f, size_t n) { (void)n, memcpy(f + entry_of(f, "tok_emb.s"), "tok_emb.x", 10); }
static void e_shape(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "tok_emb.s") + 56, 255); }
static void e_scale_nan(uint8_t* f, size_t n) { (void)n, put32(f + get64(f + entry_of(f, "loop.ffn_down.s") + 88) + 8, 0x7fc00000); }
static void e_scale_negative(uint8_t* f, size_t n) { (void)n, put32(f + get64(f + entry_of(f, "tok_emb.s") + 88), 0xbf800000); }
static void e_rope(uint8_t* f, size_t n) { (void)n, put32(f + get64(f + entry_of(f, "rope.sin") + 88) + 4, 0x3f800001); }

static void test_rules(void) {
    expect_rule("magic", e_magic, "magic", 1);
    expect_rule("version", e_version, "version", 1);
    expect_rule("header_bytes", e_header_bytes, "header_bytes", 1);
    expect_rule("file_bytes", e_file_bytes, "file_bytes", 1);
    expect_rule("checksum", e_checksum, "checksum", 0);
    expect_rule("vocab_size", e_vocab, "vocab_size", 1);
    expect_rule("n_kv_heads", e_kv_heads, "n_kv_heads", 1);
    expect_rule("head_dim", e_head_dim, "head_dim", 1);
    expect_rule("n_heads * head_dim", e_heads_dims, "n_heads * head_dim", 1);
    expect_rule("n_pre_blocks", e_n_pre, "n_pre_blocks", 1);
    expect_rule("default_loops", e_loops, "default_loops", 1);
    expect_rule("weight_format", e_format, "weight_format", 1);
    expect_rule("group_size", e_group, "group_size", 1);
    expect_rule("tied_head", e_tied, "tied_head", 1);
    expect_rule("eos_id", e_eos, "eos_id", 1);
    expect_rule("rms_eps", e_eps, "rms_eps", 1);
    expect_rule("name", e_name, "name", 1);
    expect_rule("name utf-8", e_name_utf8, "UTF-8", 1);
    expect_rule("flags", e_flags, "flags", 1);
    expect_rule("reserved", e_reserved, "reserved", 1);
    expect_rule("table_offset", e_table_offset, "table_offset", 1);
    expect_rule("n_tensors", e_n_tensors, "tensor table", 1);
    expect_rule("data_offset", e_data_offset, "data_offset", 1);
    expect_rule("dtype code", e_dtype, "dtype code", 1);
    expect_rule("dtype", e_wrong_dtype, "dtype", 1);
    expect_rule("ndim", e_ndim, "ndim", 1);
    expect_rule("dims", e_dims_zero, "dims", 1);
    expect_rule("huge dims", e_huge_dims, "past the end", 1);
    expect_rule("huge offset", e_huge_offset, "past the end", 1);
    expect_rule("misaligned", e_misaligned, "multiple of 64", 1);
    expect_rule("overlap", e_overlap, "overlap", 1);
    expect_rule("duplicate", e_duplicate, "duplicate", 1);
    expect_rule("unprintable", e_unprintable, "printable", 1);
    expect_rule("unexpected", e_unexpected, "unexpected tensor", 1);
    expect_rule("shape", e_shape, "shape", 1);
    expect_rule("scale NaN", e_scale_nan, "scales must be finite", 1);
    expect_rule("scale < 0", e_scale_negative, "scales must be finite", 1);
    expect_rule("rope", e_rope, "|v| <= 1", 1);
}

/* The checksum comes before every rule of the config, table, tensor set and values: with the
 * checksum left stale, those edits must report it. (The loader checks the structure before it
 * reads the data, the one pass that sums every byte, and holds back what it found till then.) */
static void test_checksum_first(void) {
    static const struct {
        const char* what;
        edit_fn edit;
    } later[] = {{"vocab_size", e_vocab},     {"name", e_name},           {"flags", e_flags},
                 {"reserved", e_reserved},    {"table_offset", e_table_offset},
                 {"n_tensors", e_n_tensors},  {"data_offset", e_data_offset},
                 {"dtype code", e_dtype},     {"huge offset", e_huge_offset},
                 {"overlap", e_overlap},      {"duplicate", e_duplicate},
                 {"unexpected", e_unexpected}, {"shape", e_shape},
                 {"scale NaN", e_scale_nan},  {"rope", e_rope}};
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++)
        expect_rule(later[i].what, later[i].edit, "checksum mismatch", 0);
}

static void test_int4_bound(void) {
    tu_spec spec = tu_spec_default();
    spec.int4 = 1;
    spec.group_size = 16;
    spec.d = 8192; /* 127 * 8 * 8192 * 255 < 2^31, * 256 would not: m is u8, so use K */
    spec.heads = 2, spec.kv_heads = 1, spec.head_dim = 8, spec.ffn = 16, spec.vocab = 4, spec.max_seq = 4;
    size_t n;
    uint8_t* f = tu_model_bytes(&spec, &n);
    CHECK(try_open(f, n) == TL_OK, "int4 model at the bound edge: %s", tl_last_error());
    free(f);
    spec.d = 8320; /* 127 * 8 * 8320 * m > 2^31 - 1 for m >= 254 (the writer draws m up to 255) */
    f = tu_model_bytes(&spec, &n);
    long e = entry_of(f, "pre.0.attn_qkv.m");
    memset(f + get64(f + e + 88), 255, 4);
    tu_fix_checksum(f, n);
    CHECK(try_open(f, n) == TL_ERR_BAD_FILE && strstr(tl_last_error(), "accumulator bound"),
          "int4 bound: %s", tl_last_error());
    free(f);
}

static void test_truncation_and_flips(void) {
    tu_spec spec = tu_spec_default();
    spec.int4 = 1;
    spec.group_size = 8;
    size_t n;
    uint8_t* f = tu_model_bytes(&spec, &n);
    CHECK(try_open(f, n) == TL_OK, "valid int4 file: %s", tl_last_error());
    uint8_t* g = malloc(n);
    /* truncation: every length in the header and table, then a spread over the data */
    for (size_t len = 0; len < n; len += len < 2048 ? 1 : 97) {
        memcpy(g, f, len);
        CHECK(try_open(g, len) == TL_ERR_BAD_FILE, "truncated to %zu accepted", len);
    }
    /* same lengths with file_bytes and checksum patched to match: the structure must catch it */
    for (size_t len = 256; len < n; len += len < 2048 ? 13 : 331) {
        memcpy(g, f, len);
        put64(g + 16, len);
        tu_fix_checksum(g, len);
        CHECK(try_open(g, len) == TL_ERR_BAD_FILE, "truncated (patched) to %zu accepted", len);
    }
    /* random byte flips with the checksum fixed: any outcome but a crash, mostly in the header */
    uint64_t rng = 99;
    for (int round = 0; round < 1500; round++) {
        memcpy(g, f, n);
        const int flips = tu_uniform(&rng, 1, 3);
        for (int k = 0; k < flips; k++) {
            const size_t at = round % 3 ? (size_t)tu_uniform(&rng, 0, 255 + 96 * 40) % n : tu_next(&rng) % n;
            g[at] ^= (uint8_t)tu_uniform(&rng, 1, 255);
        }
        tu_fix_checksum(g, n);
        try_open(g, n);
    }
    free(g);
    free(f);
}

static void test_paths(void) {
    tl_model* m = NULL;
    CHECK_STATUS(tl_model_open("/nonexistent/model.tinyloop", NULL, &m), TL_ERR_IO);
    CHECK(m == NULL && strstr(tl_last_error(), "cannot open"), "%s", tl_last_error());
    CHECK_STATUS(tl_model_open("/tmp", NULL, &m), TL_ERR_IO);
    /* A FIFO with no writer: opening must not block waiting for one (the test would hang). */
    char fifo[64];
    snprintf(fifo, sizeof fifo, "/tmp/tl-test-fifo-%ld", (long)getpid());
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    CHECK_STATUS(tl_model_open(fifo, NULL, &m), TL_ERR_IO);
    CHECK(m == NULL && strstr(tl_last_error(), "not a regular file"), "%s", tl_last_error());
    unlink(fifo);
    CHECK_STATUS(tl_model_open(NULL, NULL, &m), TL_ERR_INVALID_ARGUMENT);
    tu_spec spec = tu_spec_default();
    spec.tied = 1;
    spec.n_pre = 0;
    spec.vocab = 263;
    spec.eos = 5;
    m = tu_open(tu_write_model("tied.tinyloop", &spec), 2, TL_ISA_AUTO, 0);
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_OK(tl_model_config_get(m, &cfg));
    CHECK(cfg.vocab_size == 263 && cfg.tied_head == 1 && cfg.n_pre_blocks == 0 && cfg.eos_id == 5 &&
              cfg.tokenizer == 1 && strcmp(cfg.name, "c-test-model") == 0 && cfg.rms_eps == 1e-5f,
          "config round trip");
    tl_model_free(m);
}

int main(void) {
    test_rules();
    test_checksum_first();
    test_int4_bound();
    test_truncation_and_flips();
    test_paths();
    return tu_finish("test_loader");
}
