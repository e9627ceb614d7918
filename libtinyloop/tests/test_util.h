/* test_util.h — shared helpers of the C tests: CHECK macros that count failures (a test
 * binary exits nonzero when any check failed), a deterministic RNG, a bitwise CRC-32, and a
 * writer of valid random `.tinyloop` files (an independent implementation of docs/spec.md §6,
 * so the loader is tested against a second reading of the spec). */
#ifndef TL_TEST_UTIL_H
#define TL_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tinyloop.h"

extern int tu_failures;

#define CHECK(cond, ...)                                                             \
    do {                                                                             \
        if (!(cond)) {                                                               \
            tu_failures++;                                                           \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                            \
            fputc('\n', stderr);                                                     \
        }                                                                            \
    } while (0)

#define CHECK_STATUS(expr, want)                                                           \
    do {                                                                                   \
        tl_status got_ = (expr);                                                           \
        CHECK(got_ == (want), "%s returned %d (%s), want %d; last error: %s", #expr, got_, \
              tl_status_string(got_), (int)(want), tl_last_error());                       \
    } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, TL_OK)

/* Delete the files tu_write_file wrote, print a summary, and return the process exit code
 * (1 if any check failed). */
int tu_finish(const char* test_name);

/* SplitMix64 stream. */
uint64_t tu_next(uint64_t* state);
int32_t tu_uniform(uint64_t* state, int32_t lo, int32_t hi); /* inclusive */

uint32_t tu_crc32(const uint8_t* data, size_t n); /* bitwise reference */

typedef struct tu_spec {
    uint32_t vocab, d, heads, kv_heads, head_dim, ffn, n_pre, loops, max_seq;
    uint32_t int4, group_size, tied;
    int32_t eos;
    uint64_t seed;
} tu_spec;

tu_spec tu_spec_default(void); /* a small int8 GQA model */
/* The bytes of a valid model file (malloc'd), *n its size. */
uint8_t* tu_model_bytes(const tu_spec* spec, size_t* n);
/* Recompute the header checksum after editing bytes. */
void tu_fix_checksum(uint8_t* bytes, size_t n);
/* Write bytes to $TMPDIR/tltest-<pid>-<name> (replacing an earlier one of that name);
 * returns its path (valid until tu_finish, which deletes the file). */
const char* tu_write_file(const char* name, const uint8_t* bytes, size_t n);
/* Write a model and open it with the given threads / ISA (block size 4 to exercise paging). */
const char* tu_write_model(const char* name, const tu_spec* spec);
tl_model* tu_open(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size);

/* Exact comparison of float arrays by bit pattern. */
int tu_same_bits(const float* a, const float* b, size_t n);

#endif
