/* test_util.h — shared helpers of the C tests: CHECK macros that count failures (a test
 * binary exits nonzero when any check failed), a deterministic RNG, a bitwise CRC-32, and a
 * writer of valid random `.tinyloop` files of version 3, 2 or 1 (an independent implementation
 * of docs/spec.md §6, so the loader is tested against a second reading of the spec), and
 * generations kept for a bit-exact comparison (tu_result). */
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
    /* version 2 (docs/spec.md §1, §6.1) */
    uint32_t version;     /* 2, or 1: then every field below keeps its default (§6.5)     */
    uint32_t n_core;      /* k, the core's blocks                                        */
    uint32_t n_coda;      /* blocks after the core                                       */
    uint32_t layout;      /* 0 pre, 1 sandwich, 2 post                                   */
    uint32_t qkv_bias, injection, step_norm, coda_norm;
    float embed_scale;
    uint32_t hf;          /* tokenizer 2 (hf) with a meta.tokenizer_json                   */
    uint32_t meta;        /* also meta.architecture and meta.tokenizer_config             */
    /* version 3 (docs/spec.md §5.7, §6.3) */
    uint32_t exit_gate;   /* exit_gate.w, .s, .b; needs version 3                          */
    float exit_threshold; /* header offset 216, written in version 3                       */
    uint32_t core_cycles; /* header offset 220: a two-state core (§1); needs version 3     */
    uint32_t attn_gate;   /* header offset 224: H * D gate rows in attn_qkv (§4); version 3 */
    uint32_t loop_window; /* header offset 228: loop attention (§4), each core block's
                             loop_gate.w, .s, .b; version 3                                   */
    uint32_t act_block;   /* header offset 232: block activations (§2.2.1); version 3       */
} tu_spec;

/* A small int8 GQA model of one core block, written as version 2 (the tokenizer is bytes
 * when vocab >= 256, else none). */
tu_spec tu_spec_default(void);
/* tu_spec_default with every version-2 option: a core of 2 after the prelude, a coda of 1,
 * sandwich blocks, qkv biases, injection, both norms, an embedding scale of 2, an hf
 * tokenizer and every meta.* text. */
tu_spec tu_spec_rich(void);
/* A Huginn-like model: tu_spec_rich without the tokenizer and meta.* texts. */
tu_spec tu_spec_huginn(void);
/* tu_spec_default with a coda of 1 and no prelude (no injection, no coda_norm). */
tu_spec tu_spec_coda(void);
/* An HRM-like version-3 model (docs/spec.md §1): a two-state core of 2 + 2 blocks, 2 low cycles,
 * the attention gate, a prelude and a coda of 1 (HRM has neither: they test the slots). */
tu_spec tu_spec_hrm(void);
/* An IQuest-Coder-Loop-like version-3 model (docs/spec.md §1, §4): loop attention with a window
 * of 3 over a core of 2 blocks, 3 loops, a prelude and a coda of 1 (IQuest has neither: they test
 * the slots). */
tu_spec tu_spec_loop(void);
/* w, the core's layers per iteration (docs/spec.md §1) of k core blocks: k, or with `cycles`
 * >= 1 (a two-state core) (cycles + 1) * k / 2. */
uint32_t tu_core_width(uint32_t k, uint32_t cycles);
/* The bytes of a valid model file (malloc'd), *n its size; exits with status 2 on a spec that
 * version 1 cannot express, or an exit gate, a two-state core, the attention gate, loop
 * attention or block activations before version 3. */
uint8_t* tu_model_bytes(const tu_spec* spec, size_t* n);
/* Recompute the header checksum after editing bytes (a model file's, or a prefix blob's: both
 * at offset 24, the CRC-32 with the field read as zero). */
void tu_fix_checksum(uint8_t* bytes, size_t n);
/* A reader of the 96-byte-header formats (prefix blob, spilled block file) under test: 1 when
 * it accepts bytes[0 .. n), 0 when it refuses them (checking itself how it refused). */
typedef int (*tu_reader)(void* ctx, const uint8_t* bytes, size_t n, const char* what, size_t at);
/* `read` under mutation of bytes[0 .. n): every truncation (from the header on also made
 * consistent: size field at 16 and checksum), a flip of every byte (without the checksum fixed,
 * then, outside it, with), and `damage` random damages of 2 .. 9 bytes with the checksum fixed.
 * Each copy has exactly its bytes (ASan sees a read past them). Truncations and flips without
 * the checksum must be refused; returns how many of the checksum-fixed ones were accepted. */
int tu_mutate(tu_reader read, void* ctx, const uint8_t* bytes, size_t n, uint64_t seed, int damage);
/* One field set to a value (width 1, 4 or 8 bytes, little-endian) in bytes being edited. */
typedef struct tu_field {
    size_t at, width;
    uint64_t value;
    const char* message; /* the error it must give; NULL: accepted */
} tu_field;
void tu_set_field(uint8_t* bytes, const tu_field* f);
/* A saved prefix: tl_prefix_save's bytes (malloc'd) and their count. */
typedef struct tu_blob {
    uint8_t* bytes;
    size_t n;
} tu_blob;
/* p saved, and the saved bytes loaded into m (failures are failed checks). */
tu_blob tu_save(const tl_prefix* p);
tl_prefix* tu_load(tl_model* m, tu_blob b);
int tu_same_blob(tu_blob a, tu_blob b);
/* A tu_reader: tl_prefix_load into the model `m`, which may fail only as TL_ERR_BAD_FILE naming
 * the prefix blob, and returns a prefix exactly when it succeeds. */
int tu_try_load(void* m, const uint8_t* bytes, size_t n, const char* what, size_t at);
/* Little-endian fields of bytes being read or edited. */
uint32_t tu_get_u32(const uint8_t* p);
uint64_t tu_get_u64(const uint8_t* p);
void tu_put_u32(uint8_t* p, uint32_t v);
void tu_put_u64(uint8_t* p, uint64_t v);
/* Write bytes to $TMPDIR/tltest-<pid>-<name> (replacing an earlier one of that name);
 * returns its path (valid until tu_finish, which deletes the file). */
const char* tu_write_file(const char* name, const uint8_t* bytes, size_t n);
/* Write a model and open it with the given threads / ISA (block size 4 to exercise paging). */
const char* tu_write_model(const char* name, const tu_spec* spec);
tl_model* tu_open(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size);
/* §2.2 step 1: max |x_i| over x[n], NaN ignored (fmaxf), from 0. */
float tu_spec_amax(const float* x, size_t n);
/* §2.3 steps 2-4 in the spec's order: a = s / t from a row's integers q[n] (Q8's, Q4's or QB's)
 * and its scale s. */
float tu_spec_nq_scale(const int32_t* q, size_t n, float s, float eps);
/* tu_open in a KV mode. */
tl_model* tu_open_kv(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size, tl_kv_mode kv);
/* Open with 2 threads, blocks of 4 and an automatic prefix cache of cache_bytes (0: none). */
tl_model* tu_open_cached(const char* path, size_t cache_bytes);
/* m's prefix cache counters (a failure is counted as a failed check); the library's memory. */
tl_prefix_cache_stats tu_cache_stats(tl_model* m);
tl_memory_stats tu_memory(void);

/* Exact comparison of float arrays by bit pattern. */
int tu_same_bits(const float* a, const float* b, size_t n);

/* ---- generations -------------------------------------------------------------------------- */

/* What a generation emitted: its tokens and the logits each was sampled from. */
typedef struct tu_result {
    int32_t* tokens; /* [max_tokens]                   */
    float* logits;   /* [max_tokens][vocab]            */
    size_t n;        /* the tokens emitted             */
    uint32_t vocab;
} tu_result;

/* Zeroed room for max_tokens tokens and their logits over `vocab` (exits with status 2 when
 * memory runs out); release it with tu_result_free. */
tu_result tu_result_new(size_t max_tokens, uint32_t vocab);
void tu_result_free(tu_result* r);
/* Defaults, but max_tokens, loops, cache_window, a prefill in chunks of 2 and the seed;
 * greedy, or sampled at temperature 0.9. */
tl_gen_params tu_gen_params(size_t max_tokens, uint32_t loops, uint32_t window, int sampled, uint64_t seed);
/* tl_generate / tl_generate_from_prefix into a new result for gp->max_tokens tokens (a
 * failure is counted as a failed check). */
tu_result tu_generate(tl_model* m, const int32_t* prompt, size_t n, const tl_gen_params* gp, uint32_t vocab);
tu_result tu_from_prefix(const tl_prefix* p, const int32_t* suffix, size_t n, const tl_gen_params* gp,
                         uint32_t vocab);
/* Requests i < count (prompt[0 .. n[i]), gp[i]) run together by tl_generate_batch: whether each
 * gives tl_generate's tokens and logits alone (a failure is counted as a failed check). */
int tu_batch_agrees(tl_model* m, const int32_t* prompt, const size_t* n, const tl_gen_params* const* gp, size_t count,
                    uint32_t vocab);
/* Whether both emitted the same tokens, at least one, with bit-identical logits (two empty
 * results prove nothing, so they differ). */
int tu_same_result(const tu_result* a, const tu_result* b);
/* Step `s` until the n requests ids[0..n) have finished (at most max_steps steps; a failed step
 * is counted as a failed check): request i's tokens go to got[i * cap ..], at most cap of them,
 * n_got[i] their count. */
void tu_sched_drain(tl_sched* s, const uint64_t* ids, size_t n, int32_t* got, size_t cap, size_t* n_got,
                    int max_steps);

/* Requests i < count (prompt[0 .. n[i]), gp[i]) added to a scheduler of parameters sp and
 * drained (tu_sched_drain, at most 200 steps): whether each emits tl_generate's tokens alone (a
 * failure is counted as a failed check). */
int tu_sched_agrees(tl_model* m, const tl_sched_params* sp, const int32_t* prompt, const size_t* n,
                    const tl_gen_params* const* gp, size_t count, uint32_t vocab);

#endif
