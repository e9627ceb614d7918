/* test_loader.c — the `.tinyloop` reader against valid and hostile files (docs/spec.md §6),
 * versions 3, 2 and 1: named rule violations (header fields, the tensor set of every version-2
 * option, of the exit gate and of loop attention, meta.* texts, value rules, exit_threshold), the
 * order in which
 * rules are reported, truncation at
 * many lengths, random byte flips with the checksum fixed up, huge dimensions and offsets.
 * Every bad file must give TL_ERR_BAD_FILE (never a crash or an out-of-bounds read: run under
 * ASan), and every accepted file must run; a version-1 file runs as the version-2 model it
 * describes (§6.5), bit for bit, and the config reaches tl_model_config_get. */
#include <stddef.h>
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

/* Apply an edit to a fresh valid file of `spec` (checksum fixed) and expect a message
 * containing `needle`. */
static void expect_rule_on(const tu_spec* spec, const char* what, edit_fn edit, const char* needle,
                           int fix_crc) {
    size_t n;
    uint8_t* f = tu_model_bytes(spec, &n);
    edit(f, n);
    if (fix_crc) tu_fix_checksum(f, n);
    tl_status st = try_open(f, n);
    CHECK(st == TL_ERR_BAD_FILE, "%s: accepted", what);
    CHECK(strstr(tl_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what, tl_last_error(), needle);
    free(f);
}

static void expect_rule(const char* what, edit_fn edit, const char* needle, int fix_crc) {
    const tu_spec spec = tu_spec_default();
    expect_rule_on(&spec, what, edit, needle, fix_crc);
}

static tu_spec v1_spec(void) {
    tu_spec s = tu_spec_default();
    s.version = 1;
    return s;
}

static void rename_entry(uint8_t* f, const char* from, const char* to) {
    const long e = entry_of(f, from);
    memset(f + e, 0, 48);
    memcpy(f + e, to, strlen(to));
}

static uint8_t* data_of(uint8_t* f, const char* name) { return f + get64(f + entry_of(f, name) + 88); }

static void e_magic(uint8_t* f, size_t n) { (void)n, f[0] = 'X'; }
static void e_version(uint8_t* f, size_t n) { (void)n, put32(f + 8, 4); }
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
static void e_reserved(uint8_t* f, size_t n) { (void)n, f[216] = 1; }
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
static void e_wrapping_dims(uint8_t* f, size_t n) { /* 2^63 * 2^63 * 1 * 1 is 0 mod 2^64 */
    (void)n;
    const long e = entry_of(f, "tok_emb.w");
    put32(f + e + 52, 4);
    for (int k = 0; k < 4; k++) put64(f + e + 56 + 8 * k, k < 2 ? 1ull << 63 : 1);
}
static void e_huge_offset(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "core.0.attn_qkv.s") + 88, ~63ull); }
static void e_misaligned(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "tok_emb.s") + 88, get64(f + entry_of(f, "tok_emb.s") + 88) + 4); }
static void e_overlap(uint8_t* f, size_t n) {
    (void)n;
    put64(f + entry_of(f, "tok_emb.s") + 88, get64(f + entry_of(f, "tok_emb.w") + 88));
}
static void e_duplicate(uint8_t* f, size_t n) { (void)n, memcpy(f + entry_of(f, "tok_emb.s"), "tok_emb.w", 10); }
static void e_unprintable(uint8_t* f, size_t n) { (void)n, f[entry_of(f, "tok_emb.s")] = 0x07; }
static void e_unexpected(uint8_t* f, size_t n) { (void)n, memcpy(f + entry_of(f, "tok_emb.s"), "tok_emb.x", 10); }
static void e_shape(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "tok_emb.s") + 56, 255); }
static void e_scale_nan(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.0.ffn_down.s") + 8, 0x7fc00000); }
static void e_scale_negative(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "tok_emb.s"), 0xbf800000); }
static void e_rope(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "rope.sin") + 4, 0x3f800001); }

/* version-2 header fields (docs/spec.md §6.1, offsets 184 .. 215) */
static void e_n_core(uint8_t* f, size_t n) { (void)n, put32(f + 184, 0); }
static void e_n_core_big(uint8_t* f, size_t n) { (void)n, put32(f + 184, 257); }
static void e_n_coda(uint8_t* f, size_t n) { (void)n, put32(f + 188, 65); }
static void e_n_layers(uint8_t* f, size_t n) { (void)n, put32(f + 184, 256), put32(f + 76, 256); }
static void e_layout(uint8_t* f, size_t n) { (void)n, put32(f + 192, 3); }
static void e_qkv_bias(uint8_t* f, size_t n) { (void)n, put32(f + 196, 2); }
static void e_injection(uint8_t* f, size_t n) { (void)n, put32(f + 200, 2); }
static void e_step_norm(uint8_t* f, size_t n) { (void)n, put32(f + 204, 0xffffffffu); }
static void e_embed_scale(uint8_t* f, size_t n) { (void)n, put32(f + 208, 0); }
static void e_embed_scale_inf(uint8_t* f, size_t n) { (void)n, put32(f + 208, 0x7f800000); }
static void e_coda_norm(uint8_t* f, size_t n) { (void)n, put32(f + 212, 2); }
static void e_tokenizer(uint8_t* f, size_t n) { (void)n, put32(f + 104, 3); }
/* the first broken rule wins: an n_core_blocks of 0 before a bad coda_norm */
static void e_two_fields(uint8_t* f, size_t n) { e_coda_norm(f, n), e_n_core(f, n); }
/* the tensor set of each option, against a header that says otherwise */
static void e_no_bias(uint8_t* f, size_t n) { (void)n, put32(f + 196, 0); }
static void e_wants_bias(uint8_t* f, size_t n) { (void)n, put32(f + 196, 1); }
static void e_pre_layout(uint8_t* f, size_t n) { (void)n, put32(f + 192, 0); }
static void e_wants_post(uint8_t* f, size_t n) { (void)n, put32(f + 192, 2); }
static void e_no_injection(uint8_t* f, size_t n) { (void)n, put32(f + 200, 0); }
static void e_wants_injection(uint8_t* f, size_t n) { (void)n, put32(f + 200, 1); }
static void e_wants_step_norm(uint8_t* f, size_t n) { (void)n, put32(f + 204, 1); }
static void e_wants_coda_norm(uint8_t* f, size_t n) { (void)n, put32(f + 212, 1); }
static void e_no_coda(uint8_t* f, size_t n) { (void)n, put32(f + 188, 0); }
static void e_wants_coda(uint8_t* f, size_t n) { (void)n, put32(f + 188, 1); }
static void e_wants_core(uint8_t* f, size_t n) { (void)n, put32(f + 184, 2); }
static void e_loop_name(uint8_t* f, size_t n) { (void)n, rename_entry(f, "core.0.attn_out.w", "loop.attn_out.w"); }
/* meta.* texts */
static void e_wants_hf(uint8_t* f, size_t n) { (void)n, put32(f + 104, 2); }
static void e_not_hf(uint8_t* f, size_t n) { (void)n, put32(f + 104, 1); }
static void e_meta_name(uint8_t* f, size_t n) { (void)n, rename_entry(f, "meta.architecture", "meta.arch"); }
static void e_meta_dtype(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "meta.tokenizer_json") + 48, 2); }
static void e_meta_ndim(uint8_t* f, size_t n) {
    (void)n;
    const long e = entry_of(f, "meta.tokenizer_config");
    put32(f + e + 52, 2);
    put64(f + e + 64, 1);
}
static void e_meta_utf8(uint8_t* f, size_t n) { (void)n, data_of(f, "meta.tokenizer_config")[3] = 0xff; }
static void e_meta_surrogate(uint8_t* f, size_t n) {
    (void)n, memcpy(data_of(f, "meta.architecture"), "\xed\xa0\x80", 3);
}
static void e_meta_cut(uint8_t* f, size_t n) { /* a text ending inside a character */
    (void)n;
    uint8_t* json = data_of(f, "meta.tokenizer_json");
    const long e = entry_of(f, "meta.tokenizer_json");
    const uint64_t len = get64(f + e + 56);
    const uint8_t* acute = memchr(json, 0xc3, len);
    put64(f + e + 56, (uint64_t)(acute - json) + 1);
}
/* values of the version-2 tensors, and their order: the required order, then the texts */
static void e_bias_nan(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "coda.0.attn_qkv.b") + 4, 0x7fc00000); }
static void e_gain_inf(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.1.ffn_post_norm") + 8, 0xff800000); }
static void e_step_gain(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.step_norm"), 0x7f800000); }
static void e_coda_gain(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "coda.input_norm") + 4, 0x7fc00001); }
static void e_adapter_scale(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.adapter_inject.s"), 0xbf800000); }
static void e_head_and_text(uint8_t* f, size_t n) { e_meta_utf8(f, n), put32(data_of(f, "head.s"), 0x7fc00000); }
static void e_text_and_gain(uint8_t* f, size_t n) { e_meta_utf8(f, n), e_coda_gain(f, n); }
static void e_gain_and_bias(uint8_t* f, size_t n) {
    e_gain_inf(f, n), put32(data_of(f, "pre.0.attn_qkv.b"), 0x7f800000);
}
/* version 1 (docs/spec.md §6.5) */
static void e_v1_hf(uint8_t* f, size_t n) { (void)n, put32(f + 104, 2); }
static void e_v1_reserved(uint8_t* f, size_t n) { (void)n, f[184] = 1; }
static void e_v1_core_name(uint8_t* f, size_t n) { (void)n, rename_entry(f, "loop.attn_out.w", "core.0.attn_out.w"); }
static void e_v1_meta(uint8_t* f, size_t n) { (void)n, rename_entry(f, "tok_emb.s", "meta.architecture"); }
/* version 3's exit gate (docs/spec.md §6.3) and exit_threshold (§6.1, checked in step 8) */
static void e_threshold_zero(uint8_t* f, size_t n) { (void)n, put32(f + 216, 0); }
static void e_threshold_above_1(uint8_t* f, size_t n) { (void)n, put32(f + 216, 0x3f800001); }
static void e_threshold_nan(uint8_t* f, size_t n) { (void)n, put32(f + 216, 0x7fc00000); }
static void e_threshold_half(uint8_t* f, size_t n) { (void)n, put32(f + 216, 0x3f000000); }
static void e_threshold_minus_zero(uint8_t* f, size_t n) { (void)n, put32(f + 216, 0x80000000); }
static void e_gate_in_v2(uint8_t* f, size_t n) { (void)n, put32(f + 8, 2); }
static void e_gate_dtype(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "exit_gate.w") + 48, 3); }
static void e_gate_shape(uint8_t* f, size_t n) {
    (void)n;
    const long e = entry_of(f, "exit_gate.w");
    put32(f + e + 52, 1);
    put64(f + e + 56, get64(f + e + 64));
    put64(f + e + 64, 0);
}
static void e_gate_scale(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "exit_gate.s"), 0xbf800000); }
static void e_gate_bias(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "exit_gate.b"), 0x7fc00000); }
static void e_gate_renamed(uint8_t* f, size_t n) { (void)n, rename_entry(f, "exit_gate.b", "exit_gate.bias"); }
static void e_v3_reserved(uint8_t* f, size_t n) { (void)n, f[236] = 1; }
/* version 3's core_cycles and attn_gate (docs/spec.md §6.1 offsets 220, 224; §6.3 step 2) */
static void e_cycles_big(uint8_t* f, size_t n) { (void)n, put32(f + 220, 257); }
static void e_cycles_on(uint8_t* f, size_t n) { (void)n, put32(f + 220, 1); }
static void e_cycles_and_injection(uint8_t* f, size_t n) { e_cycles_on(f, n), put32(f + 200, 1); }
static void e_cycles_and_step_norm(uint8_t* f, size_t n) { e_cycles_on(f, n), put32(f + 204, 1); }
/* 1 + 256 * (2 + 1) fits as one state; with (255 + 1) * 1 applications an iteration, 1 + 256 * 257 not */
static void e_cycles_layers(uint8_t* f, size_t n) { (void)n, put32(f + 76, 256), put32(f + 220, 255); }
static void e_gate_big(uint8_t* f, size_t n) { (void)n, put32(f + 224, 2); }
static void e_gate_on(uint8_t* f, size_t n) { (void)n, put32(f + 224, 1); }
static void e_gate_off(uint8_t* f, size_t n) { (void)n, put32(f + 224, 0); }
/* the first broken field wins: coda_norm before core_cycles before attn_gate */
static void e_cycles_and_gate(uint8_t* f, size_t n) { e_cycles_big(f, n), e_gate_big(f, n); }
static void e_coda_norm_and_cycles(uint8_t* f, size_t n) { e_cycles_big(f, n), put32(f + 212, 2); }
static void e_cycles_in_v2(uint8_t* f, size_t n) { (void)n, put32(f + 8, 2); }
static void e_attn_gate_in_v2(uint8_t* f, size_t n) { (void)n, put32(f + 8, 2), put32(f + 224, 1); }
/* version 3's loop_window and the loop gate (docs/spec.md §6.1 offset 228, §6.3) */
static void e_loop_big(uint8_t* f, size_t n) { (void)n, put32(f + 228, (1u << 20) + 1); }
static void e_loop_on(uint8_t* f, size_t n) { (void)n, put32(f + 228, 3); }
static void e_loop_off(uint8_t* f, size_t n) { (void)n, put32(f + 228, 0); }
static void e_loop_in_v2(uint8_t* f, size_t n) { (void)n, put32(f + 8, 2), put32(f + 228, 3); }
/* the first broken field wins: core_cycles before attn_gate before loop_window */
static void e_cycles_and_loop(uint8_t* f, size_t n) { e_cycles_big(f, n), e_loop_big(f, n); }
static void e_gate_and_loop(uint8_t* f, size_t n) { e_gate_big(f, n), e_loop_big(f, n); }
static void e_loop_gate_shape(uint8_t* f, size_t n) { (void)n, put64(f + entry_of(f, "core.1.loop_gate.w") + 64, 6); }
static void e_loop_gate_dtype(uint8_t* f, size_t n) { (void)n, put32(f + entry_of(f, "core.0.loop_gate.s") + 48, 2); }
static void e_loop_scale_nan(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.1.loop_gate.s") + 4, 0x7fc00000); }
static void e_loop_scale_negative(uint8_t* f, size_t n) {
    (void)n, put32(data_of(f, "core.0.loop_gate.s"), 0xbf800000);
}
static void e_loop_bias_inf(uint8_t* f, size_t n) { (void)n, put32(data_of(f, "core.0.loop_gate.b") + 12, 0x7f800000); }
/* the required order: core.0's loop gate ends its block's list, before core.1's tensors, after
 * core.0's ffn_down */
static void e_loop_scale_and_next(uint8_t* f, size_t n) {
    e_loop_scale_negative(f, n), put32(data_of(f, "core.1.attn_qkv.s"), 0x7fc00000);
}
static void e_down_and_loop_scale(uint8_t* f, size_t n) {
    e_loop_scale_negative(f, n), put32(data_of(f, "core.0.ffn_down.s"), 0x7fc00000);
}
static void e_threshold_and_reserved(uint8_t* f, size_t n) { e_threshold_zero(f, n), e_v3_reserved(f, n); }
static void e_scale_and_threshold(uint8_t* f, size_t n) { e_threshold_zero(f, n), e_gate_scale(f, n); }

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
    expect_rule("wrapping dims", e_wrapping_dims, "runs past the end of the file", 1);
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

static void test_v2_rules(void) {
    const tu_spec rich = tu_spec_rich();
    expect_rule("n_core_blocks 0", e_n_core, "n_core_blocks: must be an int in 1 .. 256, got 0", 1);
    expect_rule("n_core_blocks 257", e_n_core_big, "n_core_blocks: must be an int in 1 .. 256", 1);
    expect_rule("n_coda_blocks", e_n_coda, "n_coda_blocks: must be an int in 0 .. 64", 1);
    expect_rule("n_layers", e_n_layers,
                "n_pre_blocks + default_loops * (n_core_blocks + n_coda_blocks): must be <= 65536, got 65537", 1);
    expect_rule("block_layout", e_layout, "block_layout:", 1);
    expect_rule("qkv_bias", e_qkv_bias, "qkv_bias: must be 0 or 1, got 2", 1);
    expect_rule("injection", e_injection, "injection: must be 0 or 1", 1);
    expect_rule("step_norm", e_step_norm, "step_norm: must be 0 or 1", 1);
    expect_rule("embed_scale 0", e_embed_scale, "embed_scale: must be a finite float > 0", 1);
    expect_rule("embed_scale inf", e_embed_scale_inf, "embed_scale: must be a finite float > 0", 1);
    expect_rule("coda_norm", e_coda_norm, "coda_norm: must be 0 or 1", 1);
    expect_rule("tokenizer", e_tokenizer, "tokenizer: must be 0 (none), 1 (bytes) or 2 (hf), got 3", 1);
    expect_rule("first field wins", e_two_fields, "n_core_blocks", 1);
    expect_rule_on(&rich, "bias off", e_no_bias, "unexpected tensor 'pre.0.attn_qkv.b'", 1);
    expect_rule("bias on", e_wants_bias, "missing tensor 'pre.0.attn_qkv.b'", 1);
    expect_rule_on(&rich, "layout pre", e_pre_layout, "unexpected tensor 'pre.0.attn_post_norm'", 1);
    expect_rule("layout post", e_wants_post, "missing tensor 'pre.0.attn_post_norm'", 1);
    expect_rule_on(&rich, "injection off", e_no_injection, "unexpected tensor 'core.adapter_state.w'", 1);
    expect_rule("injection on", e_wants_injection, "missing tensor 'core.adapter_state.w'", 1);
    expect_rule("step_norm on", e_wants_step_norm, "missing tensor 'core.step_norm'", 1);
    expect_rule("coda_norm on", e_wants_coda_norm, "missing tensor 'coda.input_norm'", 1);
    expect_rule_on(&rich, "coda off", e_no_coda, "unexpected tensor 'coda.0.attn_qkv.w'", 1);
    expect_rule("coda on", e_wants_coda, "missing tensor 'coda.0.attn_qkv.w'", 1);
    expect_rule("core of 2", e_wants_core, "missing tensor 'core.1.attn_qkv.w'", 1);
    expect_rule("loop name in version 2", e_loop_name, "unexpected tensor 'loop.attn_out.w'", 1);
    expect_rule("hf without its text", e_wants_hf, "missing tensor 'meta.tokenizer_json'", 1);
    expect_rule_on(&rich, "text without hf", e_not_hf, "unexpected tensor 'meta.tokenizer_json'", 1);
    expect_rule_on(&rich, "meta name", e_meta_name, "unexpected tensor 'meta.arch'", 1);
    expect_rule_on(&rich, "meta dtype", e_meta_dtype, "tensor 'meta.tokenizer_json': dtype int8 != expected uint8", 1);
    expect_rule_on(&rich, "meta ndim", e_meta_ndim, "tensor 'meta.tokenizer_config': shape", 1);
    expect_rule_on(&rich, "meta UTF-8", e_meta_utf8, "tensor 'meta.tokenizer_config': not valid UTF-8 (byte 3)", 1);
    expect_rule_on(&rich, "meta surrogate", e_meta_surrogate, "tensor 'meta.architecture': not valid UTF-8", 1);
    expect_rule_on(&rich, "meta cut", e_meta_cut, "tensor 'meta.tokenizer_json': not valid UTF-8", 1);
    expect_rule_on(&rich, "bias NaN", e_bias_nan, "tensor 'coda.0.attn_qkv.b': values must be finite", 1);
    expect_rule_on(&rich, "gain -inf", e_gain_inf,
                   "tensor 'core.1.ffn_post_norm': values must be finite, found -inf", 1);
    expect_rule_on(&rich, "step gain", e_step_gain, "tensor 'core.step_norm': values must be finite", 1);
    expect_rule_on(&rich, "coda gain", e_coda_gain, "tensor 'coda.input_norm': values must be finite", 1);
    expect_rule_on(&rich, "adapter scale", e_adapter_scale,
                   "tensor 'core.adapter_inject.s': scales must be finite and >= 0", 1);
    expect_rule_on(&rich, "head before texts", e_head_and_text, "tensor 'head.s'", 1);
    expect_rule_on(&rich, "norms before texts", e_text_and_gain, "tensor 'coda.input_norm'", 1);
    expect_rule_on(&rich, "blocks in order", e_gain_and_bias, "tensor 'pre.0.attn_qkv.b'", 1);
    expect_rule_on(&rich, "reserved", e_reserved, "reserved: header bytes 216 .. 255 must be zero", 1);
    expect_rule_on(&rich, "checksum first", e_meta_utf8, "checksum mismatch", 0);
    expect_rule_on(&rich, "checksum first", e_n_layers, "checksum mismatch", 0);
}

static void test_v1_rules(void) {
    const tu_spec v1 = v1_spec();
    expect_rule_on(&v1, "v1 hf tokenizer", e_v1_hf, "tokenizer: 2 (hf) needs a version-2 file, got 2 in version 1", 1);
    expect_rule_on(&v1, "v1 reserved", e_v1_reserved, "reserved: header bytes 184 .. 255 must be zero", 1);
    expect_rule_on(&v1, "v1 version-2 field", e_n_core_big, "reserved: header bytes 184", 1);
    expect_rule_on(&v1, "v1 core name", e_v1_core_name, "unexpected tensor 'core.0.attn_out.w'", 1);
    expect_rule_on(&v1, "v1 meta", e_v1_meta, "unexpected tensor 'meta.architecture'", 1);
    expect_rule_on(&v1, "v1 scale", e_scale_negative, "tensor 'tok_emb.s': scales must be finite", 1);
    expect_rule_on(&v1, "v1 version", e_version, "version: unsupported 4, expected 1, 2 or 3", 1);
}

static tu_spec gate_spec(void) {
    tu_spec s = tu_spec_default();
    s.version = 3, s.exit_gate = 1, s.exit_threshold = 0.75f;
    return s;
}

static void test_v3_rules(void) {
    const tu_spec gate = gate_spec();
    tu_spec plain = tu_spec_default(); /* version 3 without the optional tensors */
    plain.version = 3;
    expect_rule_on(&gate, "threshold 0", e_threshold_zero,
                   "exit_threshold: must be a finite float in (0, 1] with an exit gate, got 0", 1);
    expect_rule_on(&gate, "threshold above 1", e_threshold_above_1, "exit_threshold: must be a finite float", 1);
    expect_rule_on(&gate, "threshold NaN", e_threshold_nan, "exit_threshold: must be a finite float", 1);
    expect_rule_on(&plain, "threshold without a gate", e_threshold_half,
                   "exit_threshold: must be 0 without an exit gate, got 0.5", 1);
    expect_rule_on(&plain, "-0 without a gate", e_threshold_minus_zero, "exit_threshold: must be 0 without", 1);
    expect_rule_on(&gate, "gate in version 2", e_gate_in_v2, "unexpected tensor 'exit_gate.", 1);
    expect_rule_on(&gate, "gate dtype", e_gate_dtype, "tensor 'exit_gate.w': dtype uint8 != expected int8", 1);
    expect_rule_on(&gate, "gate shape", e_gate_shape, "tensor 'exit_gate.w': shape", 1);
    expect_rule_on(&gate, "gate scale", e_gate_scale, "tensor 'exit_gate.s': scales must be finite and >= 0", 1);
    expect_rule_on(&gate, "gate bias", e_gate_bias, "tensor 'exit_gate.b': values must be finite", 1);
    expect_rule_on(&gate, "gate renamed", e_gate_renamed, "unexpected tensor 'exit_gate.bias'", 1);
    expect_rule_on(&gate, "reserved", e_v3_reserved, "reserved: header bytes 236 .. 255 must be zero", 1);
    expect_rule_on(&gate, "threshold before reserved", e_threshold_and_reserved, "exit_threshold", 1);
    expect_rule_on(&gate, "values before threshold", e_scale_and_threshold, "tensor 'exit_gate.s'", 1);
    expect_rule_on(&gate, "checksum first", e_threshold_zero, "checksum mismatch", 0);
}

static void test_v3_core_rules(void) {
    const tu_spec hrm = tu_spec_hrm();
    tu_spec plain = tu_spec_default(), huginn = tu_spec_huginn(), two = tu_spec_default();
    plain.version = huginn.version = two.version = 3;
    two.n_core = 2, two.n_coda = 1; /* one state, a core of two: the two-state width is what grows */
    expect_rule_on(&hrm, "core_cycles 257", e_cycles_big, "core_cycles: must be an int in 0 .. 256, got 257", 1);
    expect_rule_on(&plain, "odd core", e_cycles_on,
                   "n_core_blocks: must be even with core_cycles >= 1 (two stacks), got 1", 1);
    expect_rule_on(&two, "with injection", e_cycles_and_injection,
                   "injection: must be 0 with core_cycles >= 1, got 1", 1);
    expect_rule_on(&two, "with step_norm", e_cycles_and_step_norm,
                   "step_norm: must be 0 with core_cycles >= 1, got 1", 1);
    expect_rule_on(&huginn, "Huginn's options", e_cycles_on, "injection: must be 0 with core_cycles >= 1", 1);
    expect_rule_on(&two, "two-state n_layers", e_cycles_layers,
                   "n_pre_blocks + default_loops * ((core_cycles + 1) * n_core_blocks / 2 + n_coda_blocks): "
                   "must be <= 65536, got 65793", 1);
    expect_rule_on(&hrm, "attn_gate 2", e_gate_big, "attn_gate: must be 0 or 1, got 2", 1);
    expect_rule_on(&hrm, "core_cycles first", e_cycles_and_gate, "core_cycles:", 1);
    expect_rule_on(&hrm, "coda_norm first", e_coda_norm_and_cycles, "coda_norm:", 1);
    expect_rule_on(&hrm, "gate off", e_gate_off, "tensor 'pre.0.attn_qkv.w': shape does not match the config", 1);
    expect_rule_on(&plain, "gate on", e_gate_on, "tensor 'pre.0.attn_qkv.w': shape does not match the config", 1);
    expect_rule_on(&hrm, "gate rows in version 2", e_cycles_in_v2, "tensor 'pre.0.attn_qkv.w': shape", 1);
    two.core_cycles = 3;
    expect_rule_on(&two, "core_cycles in version 2", e_cycles_in_v2, "reserved: header bytes 216 .. 255", 1);
    expect_rule_on(&plain, "attn_gate in version 2", e_attn_gate_in_v2, "reserved: header bytes 216 .. 255", 1);
    expect_rule_on(&hrm, "checksum first", e_cycles_big, "checksum mismatch", 0);
}

static void test_v3_loop_rules(void) {
    const tu_spec loop = tu_spec_loop(), hrm = tu_spec_hrm();
    tu_spec plain = tu_spec_default(), gated = tu_spec_default(), v2 = tu_spec_default();
    plain.version = gated.version = 3;
    gated.attn_gate = 1;
    const struct {
        const tu_spec* spec;
        const char* what;
        edit_fn edit;
        const char* needle;
    } rules[] = {
        {&loop, "loop_window 2^20 + 1", e_loop_big, "loop_window: must be an int in 0 .. 1048576, got 1048577"},
        {&hrm, "with a two-state core", e_loop_on, "loop_window: needs core_cycles 0 (a one-state core), got 2"},
        {&gated, "with the attention gate", e_loop_on, "loop_window: excludes the attention gate (attn_gate 1), got 1"},
        {&hrm, "core_cycles before loop_window", e_cycles_and_loop, "core_cycles: must be an int"},
        {&loop, "attn_gate before loop_window", e_gate_and_loop, "attn_gate: must be 0 or 1, got 2"},
        {&plain, "loop gate missing", e_loop_on, "missing tensor 'core.0.loop_gate.w'"},
        {&loop, "loop gate unexpected", e_loop_off, "unexpected tensor 'core.0.loop_gate.w'"},
        {&loop, "loop gate shape", e_loop_gate_shape, "tensor 'core.1.loop_gate.w': shape does not match the config"},
        {&loop, "loop gate dtype", e_loop_gate_dtype, "tensor 'core.0.loop_gate.s': dtype int8"},
        {&loop, "loop scale NaN", e_loop_scale_nan,
         "tensor 'core.1.loop_gate.s': scales must be finite and >= 0, found nan"},
        {&loop, "loop scale < 0", e_loop_scale_negative,
         "tensor 'core.0.loop_gate.s': scales must be finite and >= 0, found -1"},
        {&loop, "loop bias inf", e_loop_bias_inf, "tensor 'core.0.loop_gate.b': values must be finite"},
        {&loop, "loop gate before core.1", e_loop_scale_and_next, "tensor 'core.0.loop_gate.s'"},
        {&loop, "loop gate after ffn_down", e_down_and_loop_scale, "tensor 'core.0.ffn_down.s'"},
        {&loop, "loop gate in version 2", e_cycles_in_v2, "unexpected tensor 'core.0.loop_gate.w'"},
        {&v2, "loop_window in version 2", e_loop_in_v2, "reserved: header bytes 216 .. 255"},
        {&v2, "loop_window set in version 2", e_loop_on, "reserved: header bytes 216 .. 255"},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++)
        expect_rule_on(rules[i].spec, rules[i].what, rules[i].edit, rules[i].needle, 1);
    expect_rule_on(&loop, "checksum first", e_loop_big, "checksum mismatch", 0);
}

/* The exit gate loads, with int8 or int4 weights (its own are int8 either way), runs, and
 * reaches tl_model_config_get, which a caller built before its fields gets without them. */
static void test_v3_exit_gate(void) {
    tu_spec specs[2] = {gate_spec(), gate_spec()};
    specs[1].int4 = 1, specs[1].group_size = 16, specs[1].exit_threshold = 1.0f;
    for (size_t i = 0; i < 2; i++) {
        size_t n;
        uint8_t* f = tu_model_bytes(&specs[i], &n);
        CHECK(try_open(f, n) == TL_OK, "exit gate model %zu: %s", i, tl_last_error());
        free(f);
        tl_model* m = tu_open(tu_write_model("gate.tinyloop", &specs[i]), 1, TL_ISA_AUTO, 0);
        if (!m) continue;
        tl_model_config cfg = {.size = sizeof cfg};
        CHECK_OK(tl_model_config_get(m, &cfg));
        CHECK(cfg.version == 3 && cfg.exit_gate == 1 && cfg.exit_threshold == specs[i].exit_threshold &&
                  cfg.n_stop_ids == 0,
              "exit gate model %zu: config %u %u %g", i, cfg.version, cfg.exit_gate, (double)cfg.exit_threshold);
        tl_model_config old;
        memset(&old, 0xab, sizeof old);
        old.size = offsetof(tl_model_config, exit_gate);
        CHECK_OK(tl_model_config_get(m, &old));
        CHECK(old.version == 3 && old.exit_gate == 0xababababu, "a tl_model_config without the gate's fields");
        tl_model_free(m);
    }
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

/* On an int4 file with every version-2 option (and so every kind of tensor). */
static void test_truncation_and_flips(void) {
    tu_spec spec = tu_spec_rich();
    spec.int4 = 1;
    spec.group_size = 8;
    size_t n;
    uint8_t* f = tu_model_bytes(&spec, &n);
    CHECK(try_open(f, n) == TL_OK, "valid int4 file: %s", tl_last_error());
    const uint32_t table_end = 256 + 96 * (f[28] | f[29] << 8);
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
    /* random byte flips with the checksum fixed: any outcome but a crash, mostly in the header
     * and the table */
    uint64_t rng = 99;
    for (int round = 0; round < 3000; round++) {
        memcpy(g, f, n);
        const int flips = tu_uniform(&rng, 1, 3);
        for (int k = 0; k < flips; k++) {
            const size_t at = round % 3 ? (size_t)tu_uniform(&rng, 0, (int32_t)table_end - 1) : tu_next(&rng) % n;
            g[at] ^= (uint8_t)tu_uniform(&rng, 1, 255);
        }
        tu_fix_checksum(g, n);
        try_open(g, n);
    }
    free(g);
    free(f);
}

/* The model of `sp` checked from its bytes, then opened from a file `file` with its config in
 * *cfg; NULL (a failure recorded) when it does not open. */
static tl_model* open_spec(const tu_spec* sp, const char* file, size_t i, tl_model_config* cfg) {
    size_t n;
    uint8_t* f = tu_model_bytes(sp, &n);
    CHECK(try_open(f, n) == TL_OK, "%s model %zu: %s", file, i, tl_last_error());
    free(f);
    tl_model* m = tu_open(tu_write_model(file, sp), 1, TL_ISA_AUTO, 0);
    if (m) {
        *cfg = (tl_model_config){.size = sizeof *cfg};
        CHECK_OK(tl_model_config_get(m, cfg));
    }
    return m;
}

/* Every version-2 option loads and runs, and reaches tl_model_config_get. */
static void test_v2_models(void) {
    tu_spec specs[5];
    specs[0] = tu_spec_rich();
    specs[1] = tu_spec_rich(); /* int4, tied head, post layout */
    specs[1].int4 = 1, specs[1].group_size = 16, specs[1].tied = 1, specs[1].layout = 2;
    specs[2] = tu_spec_default(); /* no prelude, a core of 3, a coda of 2, plain blocks */
    specs[2].n_pre = 0, specs[2].n_core = 3, specs[2].n_coda = 2, specs[2].loops = 2;
    specs[3] = tu_spec_default(); /* injection straight from the embedding, the texts without hf */
    specs[3].n_pre = 0, specs[3].injection = 1, specs[3].meta = 1, specs[3].embed_scale = 0.5f;
    specs[4] = tu_spec_default(); /* the deepest cache the header allows: 1 + 256 * 256 - 1 */
    specs[4].n_core = 255, specs[4].n_coda = 1, specs[4].loops = 255, specs[4].d = 8, specs[4].heads = 1;
    specs[4].kv_heads = 1, specs[4].head_dim = 8, specs[4].ffn = 8, specs[4].max_seq = 4;
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        const tu_spec* sp = &specs[i];
        tl_model_config cfg;
        tl_model* m = open_spec(sp, "v2.tinyloop", i, &cfg);
        if (!m) continue;
        CHECK(cfg.version == 2 && cfg.n_core_blocks == sp->n_core && cfg.n_coda_blocks == sp->n_coda &&
                  cfg.block_layout == sp->layout && cfg.qkv_bias == sp->qkv_bias &&
                  cfg.injection == sp->injection && cfg.step_norm == sp->step_norm &&
                  cfg.coda_norm == sp->coda_norm && cfg.embed_scale == sp->embed_scale &&
                  cfg.tokenizer == (sp->hf ? 2u : 1u) && cfg.tied_head == sp->tied &&
                  cfg.n_pre_blocks == sp->n_pre && cfg.default_loops == sp->loops,
              "v2 model %zu: config round trip", i);
        tl_model_free(m);
    }
}

/* Two-state cores and the attention gate (docs/spec.md §1, §4) load and run, with int8 or int4
 * weights, biases, a post layout, alone or together, and reach tl_model_config_get, which a
 * caller built before their fields gets without them. */
static void test_v3_core_models(void) {
    tu_spec specs[4] = {tu_spec_hrm(), tu_spec_hrm(), tu_spec_hrm(), tu_spec_hrm()};
    specs[1].int4 = 1, specs[1].group_size = 16, specs[1].qkv_bias = 1, specs[1].layout = 2, specs[1].tied = 1;
    specs[2].attn_gate = 0, specs[2].core_cycles = 256, specs[2].n_core = 2, specs[2].loops = 1; /* a wide core */
    specs[3].core_cycles = 0, specs[3].n_pre = 0, specs[3].n_coda = 0;                          /* the gate alone */
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        const tu_spec* sp = &specs[i];
        tl_model_config cfg;
        tl_model* m = open_spec(sp, "hrm.tinyloop", i, &cfg);
        if (!m) continue;
        CHECK(cfg.version == 3 && cfg.core_cycles == sp->core_cycles && cfg.attn_gate == sp->attn_gate &&
                  cfg.n_core_blocks == sp->n_core && cfg.qkv_bias == sp->qkv_bias && cfg.exit_gate == 0,
              "v3 core model %zu: config %u %u", i, cfg.core_cycles, cfg.attn_gate);
        tl_model_config old;
        memset(&old, 0xab, sizeof old);
        old.size = offsetof(tl_model_config, core_cycles);
        CHECK_OK(tl_model_config_get(m, &old));
        CHECK(old.size == offsetof(tl_model_config, core_cycles) && old.version == 3 &&
                  old.core_cycles == 0xababababu && old.attn_gate == 0xababababu,
              "a tl_model_config without the core's fields");
        tl_model_free(m);
    }
}

/* Loop attention (docs/spec.md §4) loads and runs, with int8 or int4 weights (the loop gate's
 * own are int8 either way), the largest window, no prelude or coda, and reaches
 * tl_model_config_get, which a caller built before its field gets without it. */
static void test_v3_loop_models(void) {
    tu_spec specs[3] = {tu_spec_loop(), tu_spec_loop(), tu_spec_loop()};
    specs[1].int4 = 1, specs[1].group_size = 16, specs[1].layout = 2, specs[1].qkv_bias = 1;
    specs[2].loop_window = 1u << 20, specs[2].n_pre = 0, specs[2].n_coda = 0, specs[2].n_core = 1;
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        const tu_spec* sp = &specs[i];
        tl_model_config cfg;
        tl_model* m = open_spec(sp, "loop.tinyloop", i, &cfg);
        if (!m) continue;
        CHECK(cfg.version == 3 && cfg.loop_window == sp->loop_window && cfg.core_cycles == 0 && cfg.attn_gate == 0 &&
                  cfg.n_core_blocks == sp->n_core,
              "v3 loop model %zu: config loop_window %u", i, cfg.loop_window);
        tl_model_config old;
        memset(&old, 0xab, sizeof old);
        old.size = offsetof(tl_model_config, loop_window);
        CHECK_OK(tl_model_config_get(m, &old));
        CHECK(old.size == offsetof(tl_model_config, loop_window) && old.attn_gate == 0 &&
                  old.loop_window == 0xababababu,
              "a tl_model_config without loop_window");
        tl_model_free(m);
    }
}

/* A version-1 file is the version-2 model it describes (docs/spec.md §6.5): the same tensors
 * under `loop` give the same logits, bit for bit, at every depth. */
static void test_v1_is_v2(void) {
    tu_spec v1 = v1_spec(), v2 = tu_spec_default();
    v1.n_pre = v2.n_pre = 2;
    tl_model* m1 = tu_open(tu_write_model("v1.tinyloop", &v1), 1, TL_ISA_AUTO, 0);
    tl_model* m2 = tu_open(tu_write_model("v2.tinyloop", &v2), 1, TL_ISA_AUTO, 0);
    if (!m1 || !m2) {
        tl_model_free(m1);
        tl_model_free(m2);
        return;
    }
    static const int32_t tokens[5] = {3, 1, 4, 1, 5};
    for (uint32_t loops = 1; loops <= 3; loops++) {
        float a[5 * 256], b[5 * 256];
        tl_seq *s1 = NULL, *s2 = NULL;
        CHECK_OK(tl_seq_create(m1, loops, 0, &s1));
        CHECK_OK(tl_seq_create(m2, loops, 0, &s2));
        CHECK_OK(tl_seq_prefill_all(s1, tokens, 5, 0, a));
        CHECK_OK(tl_seq_prefill_all(s2, tokens, 5, 0, b));
        CHECK(tu_same_bits(a, b, 5 * 256), "version 1 and 2 logits differ at depth %u", loops);
        tl_seq_free(s1);
        tl_seq_free(s2);
    }
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_OK(tl_model_config_get(m1, &cfg));
    CHECK(cfg.version == 1 && cfg.n_core_blocks == 1 && cfg.n_coda_blocks == 0 && cfg.block_layout == 0 &&
              cfg.qkv_bias == 0 && cfg.injection == 0 && cfg.step_norm == 0 && cfg.coda_norm == 0 &&
              cfg.embed_scale == 1.0f && cfg.n_pre_blocks == 2,
          "version-1 config reads as its version-2 model");
    /* a caller built before the version-2 fields gets the fields it knows, nothing past them */
    tl_model_config old;
    memset(&old, 0xab, sizeof old);
    old.size = offsetof(tl_model_config, version);
    CHECK_OK(tl_model_config_get(m2, &old));
    CHECK(old.size == offsetof(tl_model_config, version) && old.vocab_size == 256 &&
              strcmp(old.name, "c-test-model") == 0 && old.version == 0xababababu && old.embed_scale != 1.0f,
          "a short tl_model_config is filled up to its size only");
    tl_model_free(m1);
    tl_model_free(m2);
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
              cfg.tokenizer == 1 && strcmp(cfg.name, "c-test-model") == 0 && cfg.rms_eps == 1e-5f &&
              cfg.version == 2 && cfg.n_core_blocks == 1 && cfg.embed_scale == 1.0f && cfg.exit_gate == 0 &&
              cfg.exit_threshold == 0.0f,
          "config round trip");
    tl_model_free(m);
}

int main(void) {
    test_rules();
    test_v2_rules();
    test_v1_rules();
    test_v3_rules();
    test_v3_core_rules();
    test_v3_exit_gate();
    test_v3_core_models();
    test_v3_loop_rules();
    test_v3_loop_models();
    test_checksum_first();
    test_v2_models();
    test_v1_is_v2();
    test_int4_bound();
    test_truncation_and_flips();
    test_paths();
    return tu_finish("test_loader");
}
