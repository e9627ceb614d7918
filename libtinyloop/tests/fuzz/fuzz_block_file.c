/* fuzz_block_file.c — libFuzzer target: the prefix cache disk tier's reader of a spilled block
 * file (docs/spec.md §7.6, core/block_file.h) on the fuzzer's bytes, file_bytes and checksum
 * made consistent (fuzz_util.h). The tier's model is fixed (fuzz_block_model); the KV mode is
 * the one the file's kv_mode field names, and the place a lookup asks for is the one the file
 * claims (window, tree depth, instruction length, salt, block index, tokens, layer count), so a file that is whole
 * gets through every rule to the records.
 *
 * Invariants: tl_block_file_check passes or fails as TL_ERR_BAD_FILE naming the spilled block
 * file, never reading outside the bytes; a file it passes decodes into a block, and that block
 * encodes back to the same bytes (the writer's form is the only one the reader accepts). */
#include <string.h>

#include "fuzz_util.h"

enum { KV_MODE_AT = 40, INSTRUCTION_AT = 76 };

/* The place the file claims, copied out of it where it holds one (else zeros: the check fails
 * before it reads them). salt: room for TL_BLOCK_MAX_SALT bytes and a NUL. */
static tl_block_place claimed_place(const uint8_t* f, size_t n, const tl_block_model* m, char* salt,
                                    int32_t* tokens) {
    tl_block_place at = {salt, 0, 0, 0, tokens, 0};
    salt[0] = 0;
    if (n < TL_BLOCK_HEADER_BYTES) return at;
    at.window = tu_get_u32(f + 44), at.tree_depth = tu_get_u32(f + 48), at.index = tu_get_u32(f + 60);
    at.instruction = tu_get_u32(f + INSTRUCTION_AT);
    const size_t salt_bytes = tu_get_u32(f + 56);
    if (salt_bytes > TL_BLOCK_MAX_SALT || TL_BLOCK_HEADER_BYTES + salt_bytes > n) return at;
    memcpy(salt, f + TL_BLOCK_HEADER_BYTES, salt_bytes);
    salt[salt_bytes] = 0;
    const uint64_t n_tokens = ((uint64_t)at.index + 1) * m->geom.block_size;
    if (n_tokens > m->max_seq_len || TL_BLOCK_HEADER_BYTES + salt_bytes + 4 * n_tokens > n) return at;
    for (uint64_t i = 0; i < n_tokens; i++)
        tokens[i] = (int32_t)tu_get_u32(f + TL_BLOCK_HEADER_BYTES + salt_bytes + 4 * i);
    return at;
}

static void check_round_trip(const tl_block_model* m, const tl_block_place* at, const uint8_t* f, size_t n) {
    const uint32_t n_layers = tl_block_file_layers(f);
    tl_kv_table t = {0};
    const tl_status st = tl_kv_reserve(&t, &m->geom, n_layers, (size_t)at->index * m->geom.block_size,
                                       m->geom.block_size);
    if (st == TL_ERR_OUT_OF_MEMORY) return;
    FUZZ_REQUIRE(st == TL_OK, "reserve: %s", tl_last_error());
    tl_kv_block* b = t.spans[t.n_spans - 1].block;
    FUZZ_REQUIRE(tl_block_file_decode(m, f, b, NULL) == TL_OK, "decode: %s", tl_last_error());
    const size_t size = tl_block_file_size(m, strlen(at->salt), at->index, n_layers);
    FUZZ_REQUIRE(size == n, "a passed %zu-byte file encodes as %zu bytes", n, size);
    uint8_t* again = malloc(size);
    FUZZ_REQUIRE(again != NULL, "%zu bytes", size);
    FUZZ_REQUIRE(tl_block_file_encode(m, at, b, NULL, again) == TL_OK, "encode: %s", tl_last_error());
    for (size_t i = 0; i < n; i++)
        FUZZ_REQUIRE(again[i] == f[i], "a passed file encodes back with byte %zu changed (%u, was %u)", i, again[i],
                     f[i]);
    free(again);
    tl_kv_clear(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static char salt[TL_BLOCK_MAX_SALT + 1];
    static int32_t tokens[FUZZ_BLOCK_MAX_SEQ];
    uint8_t* f = fuzz_sealed_copy(data, size);
    const int int4 = size >= KV_MODE_AT + 4 && tu_get_u32(f + KV_MODE_AT) == TL_KV_INT4;
    const tl_block_model m = fuzz_block_model(int4 ? 4 : 8);
    const tl_block_place at = claimed_place(f, size, &m, salt, tokens);
    const uint32_t n_layers = size >= TL_BLOCK_HEADER_BYTES ? tl_block_file_layers(f) : 1;
    const tl_status st = tl_block_file_check(&m, f, size, &at, n_layers);
    FUZZ_REQUIRE(st == TL_OK || (st == TL_ERR_BAD_FILE && strstr(tl_last_error(), "bad spilled block file: ")),
                 "status %d (%s)", st, tl_last_error());
    fuzz_verdict(st);
    if (st == TL_OK) check_round_trip(&m, &at, f, size);
    free(f);
    return 0;
}
