/* fuzz_util.h — what the libFuzzer harnesses of tests/fuzz/ share (docs/testing.md, "Fuzzing").
 *
 * - FUZZ_REQUIRE: a broken invariant aborts, so libFuzzer saves the input that broke it.
 * - fuzz_sealed_copy: the fuzzer's bytes in a private buffer of exactly their size, with the size
 *   field (u64 at 16) and the CRC-32 (u32 at 24) that the model file (§6.1), the prefix blob
 *   (§7.1) and the spilled block file (§7.6) share made consistent. A fuzzer cannot forge a
 *   CRC-32; the checksum and size rules themselves are the mutation tests' (tu_mutate), so the
 *   harnesses spend every execution on the rules behind them.
 * - The verdicts a harness writes for the readers-agree check (readers_agree.py).
 * - The models the harnesses load into, which make_fuzz_corpus writes the seeds for: their
 *   specs live here once, so a seed blob names the model the harness opens. */
#ifndef TL_FUZZ_UTIL_H
#define TL_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/block_file.h"
#include "test_util.h"
#include "tinyloop.h"

#define FUZZ_REQUIRE(cond, ...)                                                   \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "%s:%d: fuzz invariant %s broken: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fputc('\n', stderr);                                                  \
            abort();                                                              \
        }                                                                         \
    } while (0)

/* data[0 .. n) copied into a malloc'd buffer of exactly n bytes (ASan sees a read past them),
 * its size field and checksum set where the copy is long enough to hold them. */
uint8_t* fuzz_sealed_copy(const uint8_t* data, size_t n);

/* The model prefix blobs are loaded into: a prelude, a core of 2, a coda, injection, sandwich
 * blocks (every slot kind and both warm-start states). */
tu_spec fuzz_blob_model_spec(void);
/* The model of spec written to an anonymous in-memory file and opened with one thread, KV
 * blocks of 4 and KV mode `mode`; exits with status 2 when it cannot (a harness set-up error,
 * not a finding). */
tl_model* fuzz_open_spec(const tu_spec* spec, tl_kv_mode mode);
/* An anonymous in-memory file holding bytes[0 .. n), replacing what it held; returns its path
 * ("/proc/self/fd/N", valid for the process). One such file per process. */
const char* fuzz_memory_file(const uint8_t* bytes, size_t n);

/* The disk tier's model the block-file target reads for, with KV rows of kv_bits (8 or 4):
 * blocks of 8 positions, 2 KV heads of 12, max_seq_len FUZZ_BLOCK_MAX_SEQ, vocabulary 97. */
enum { FUZZ_BLOCK_MAX_SEQ = 64 };
tl_block_model fuzz_block_model(uint32_t kv_bits);

/* The readers-agree check (readers_agree.py): when TINYLOOP_FUZZ_VERDICTS names a file, each
 * input's verdict is appended to it as one line, "accepted" or the C reader's message (its
 * newlines as spaces), in the order libFuzzer runs the inputs (the order of its file
 * arguments). Returns that path, or NULL when unset. */
const char* fuzz_verdicts_path(void);
void fuzz_verdict(tl_status st);

/* Whether every one of the n floats is finite. */
int fuzz_all_finite(const float* x, size_t n);

#endif
