/*
 * tinyloop.h — the C API of libtinyloop, the native backend of TinyLoop (CPU, and CUDA GPUs).
 *
 * TinyLoop runs looped (depth-recurrent, weight-shared) transformer language models stored in
 * `.tinyloop` files. Every result is bit-identical to the numerics contract in docs/spec.md,
 * whatever the thread count, SIMD path, prefill chunking, forking or prefix reuse.
 *
 * This header is the single source of truth of the C API: the Python binding derives its cffi
 * cdef from it mechanically (strip the `#` lines, TL_API and the extern "C" guard), so it holds
 * no other macros, no bitfields, no inline or variadic functions, and enums with explicit values.
 *
 * Conventions
 *  - Every fallible call returns a tl_status; on failure it sets a thread-local message that
 *    tl_last_error() returns. The library never exits or aborts on bad input.
 *  - Handles are opaque. Each `*_create` / `*_open` / `*_build` / `*_fork` has a matching
 *    `*_free`; `*_free(NULL)` is a no-op. Output handles are set only on TL_OK (else NULL).
 *  - Parameter structs are passed by pointer; their first field `size` must be set to
 *    sizeof(the struct) (the `*_default()` initializers do that), so the ABI can grow.
 *    Output structs are filled up to the caller's `size`.
 *  - Threading: a tl_model may be used from many threads at once. A tl_seq must be used by one
 *    thread at a time. A tl_prefix may be read from many threads at once, and tl_prefix_extend
 *    may deepen it meanwhile (it takes the prefix's internal lock).
 *    All models share one process-wide crew of worker threads (idle workers sleep); a call
 *    that finds it busy computes on the calling thread instead of waiting (docs/c-api.md).
 *  - Caller buffers are borrowed for the duration of the call only.
 */
#ifndef TINYLOOP_H
#define TINYLOOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && defined(TINYLOOP_BUILDING)
#define TL_API __declspec(dllexport)
#elif defined(_WIN32)
#define TL_API __declspec(dllimport)
#elif defined(__GNUC__)
#define TL_API __attribute__((visibility("default")))
#else
#define TL_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===== Versions ============================================================================ */

/* ABI version of this header, bumped on any incompatible change. A host compiled against it
 * may compare it with tl_abi_version(), the loaded library's, at run time. */
enum { TL_ABI_VERSION = 2 };
/* ABI version of the loaded library (TL_ABI_VERSION of the header it was built from).
 * Thread-safe. */
TL_API int tl_abi_version(void);
/* Library version, e.g. "0.1.0" (a static string; never free it). Thread-safe. */
TL_API const char* tl_version_string(void);

/* ===== Errors ============================================================================== */

typedef enum tl_status {
    TL_OK = 0,
    TL_ERR_INVALID_ARGUMENT = 1, /* a parameter breaks its documented rule                    */
    TL_ERR_OUT_OF_RANGE = 2,     /* a token id outside [0, vocab_size)                        */
    TL_ERR_SEQ_TOO_LONG = 3,     /* the sequence would exceed max_seq_len                     */
    TL_ERR_LOOPS_MISMATCH = 4,   /* more loops requested than a prefix was built with         */
    TL_ERR_WINDOW_MISMATCH = 5,  /* cache_window differs from the prefix's                    */
    TL_ERR_CLOSED = 6,           /* "model was closed"                                        */
    TL_ERR_OUT_OF_MEMORY = 7,    /* "out of memory"                                           */
    TL_ERR_BAD_FILE = 8,         /* the model file breaks docs/spec.md §6, a prefix blob §7   */
    TL_ERR_IO = 9,               /* the model file cannot be opened or read (or it shrank)    */
    TL_ERR_NUMERIC = 10,         /* non-finite logits during generation                       */
    TL_ERR_UNSUPPORTED = 11,     /* e.g. an ISA this CPU lacks                                 */
    TL_ERR_WRONG_MODEL = 12,     /* an object used with another model (reserved for bindings)  */
    TL_ERR_INTERNAL = 13         /* a bug in libtinyloop (e.g. a thread could not start)       */
} tl_status;

/* Static English name of a status, e.g. "out of memory". Thread-safe. */
TL_API const char* tl_status_string(tl_status status);
/* Message of the last failed call on this thread, naming the problem (e.g. "token id 300 at
 * index 2 is out of range [0, 256)"). Valid until the next failing call on this thread;
 * owned by the library. "" if nothing failed yet. */
TL_API const char* tl_last_error(void);

/* ===== CPU kernels ========================================================================= */

typedef enum tl_isa {
    TL_ISA_AUTO = 0,        /* the fastest path this CPU supports                            */
    TL_ISA_SCALAR = 1,      /* portable C                                                     */
    TL_ISA_AVX2 = 2,        /* AVX2                                                           */
    TL_ISA_AVX512_VNNI = 3, /* AVX-512 F/BW/VL + VNNI                                         */
    TL_ISA_AMX = 4          /* AMX-TILE + AMX-INT8 tiles for 16+ rows, AVX-512 VNNI for fewer    */
} tl_isa;

/* Whether this CPU (and build) can run `isa`. TL_ISA_AUTO and TL_ISA_SCALAR: always true. */
TL_API bool tl_cpu_supports(tl_isa isa);

/* ===== Devices ============================================================================= */

typedef enum tl_device {
    TL_DEVICE_AUTO = 0, /* today always the CPU: CUDA joins `auto` once verified on a GPU         */
    TL_DEVICE_CPU = 1,  /* the CPU kernels (tl_isa)                                              */
    TL_DEVICE_CUDA = 2  /* an NVIDIA GPU: the CUDA backend (a build with TINYLOOP_CUDA)          */
} tl_device;

/* TL_OK if `device` can run models here; otherwise TL_ERR_UNSUPPORTED with the reason in
 * tl_last_error() (e.g. "libtinyloop was built without CUDA", "no CUDA device: ...").
 * TL_ERR_INVALID_ARGUMENT for a value outside the enum. Thread-safe; never aborts, also on a
 * machine with no GPU driver. */
TL_API tl_status tl_device_check(tl_device device);

/* ===== Memory accounting ==================================================================== */

/* Counters over every allocation the library makes (the model's weights, as read from the file
 * or repacked for the kernels; KV blocks, prefixes, scratch). */
typedef struct tl_memory_stats {
    size_t size;         /* in: sizeof(tl_memory_stats)                                      */
    size_t bytes_in_use; /* bytes currently allocated                                        */
    size_t peak_bytes;   /* high-water mark since start or tl_memory_reset_peak()            */
    size_t n_allocs;     /* allocations currently live                                       */
    size_t total_allocs; /* allocations made since start (successful ones)                   */
} tl_memory_stats;

/* Snapshot of the counters, filled up to out->size. Thread-safe. TL_ERR_INVALID_ARGUMENT if
 * out is NULL or out->size does not cover the first three counters. */
TL_API tl_status tl_memory_stats_get(tl_memory_stats* out);
/* Set peak_bytes to the current bytes_in_use. Thread-safe. */
TL_API void tl_memory_reset_peak(void);

/* ===== Models ============================================================================== */

typedef struct tl_model tl_model;

/* The KV cache's storage of keys and values (docs/spec.md §4): Q8 rows of D bytes, or Q4 rows
 * (values -7 .. 7) packed two per byte, D / 2 bytes; attention is the same formula either way. */
typedef enum tl_kv_mode { TL_KV_INT8 = 0, TL_KV_INT4 = 1 } tl_kv_mode;

typedef struct tl_model_params {
    size_t size;            /* sizeof(tl_model_params)                                       */
    uint32_t n_threads;     /* at most this many threads (the caller's included) work on one of
                               this model's calls, from the process-wide crew, which grows to
                               the largest n_threads asked for; 0 = all online cores; <= 1024 */
    uint32_t kv_block_size; /* positions per KV cache block; 0 = 16                          */
    tl_isa isa;             /* kernel path; TL_ISA_AUTO = the one the environment variable
                               TINYLOOP_ISA names when it is set and not empty ("auto",
                               "scalar", "avx2", "avx512" or "avx512-vnni", "amx"; any other
                               value is TL_ERR_INVALID_ARGUMENT), else the best available. An
                               explicit isa ignores TINYLOOP_ISA. Forcing one the CPU or build
                               lacks, either way, is TL_ERR_UNSUPPORTED.                     */
    size_t prefix_cache_bytes; /* budget of the automatic prefix cache (docs/spec.md §4.3);
                               0 = no automatic prefix cache                                 */
    tl_device device;       /* where the forward pass runs; TL_DEVICE_AUTO = the CPU (for now).
                               TL_DEVICE_CUDA without a usable GPU is TL_ERR_UNSUPPORTED.    */
    int32_t device_index;   /* CUDA device ordinal (TL_DEVICE_CUDA only); default 0           */
    tl_kv_mode kv_mode;     /* how the KV cache stores keys and values (docs/spec.md §4):
                               TL_KV_INT8 (default) or TL_KV_INT4; a caller built before this
                               field passes a smaller size and gets TL_KV_INT8                */
    const char* prefix_cache_dir; /* the automatic prefix cache's disk tier (docs/spec.md
                               §4.3.1): evicted blocks (and, at close, the cached ones) are
                               written there and read back on a hit; NULL = none. Needs
                               prefix_cache_bytes > 0; created (one level) when missing;
                               not a directory / cannot be created: TL_ERR_IO. Copied.     */
    size_t prefix_cache_disk_bytes; /* budget of the files of that tier; 0 = no limit      */
} tl_model_params;

/* Defaults: all cores, blocks of 16, automatic ISA, no automatic prefix cache, device auto,
 * int8 KV cache. */
TL_API tl_model_params tl_model_params_default(void);

/* Read the file at `path` into memory, validate it (docs/spec.md §6) and prepare the kernels;
 * once this returns the file is never read again (it may be deleted, truncated or rewritten).
 * params may be NULL (defaults). On success *out owns a new model: release it with
 * tl_model_free. Errors: TL_ERR_IO, TL_ERR_BAD_FILE, TL_ERR_UNSUPPORTED, TL_ERR_OUT_OF_MEMORY,
 * TL_ERR_INVALID_ARGUMENT, TL_ERR_INTERNAL (a worker thread or the CUDA device could not start).
 * Thread-safe. */
TL_API tl_status tl_model_open(const char* path, const tl_model_params* params, tl_model** out);

/* The most stop ids a file carries besides eos_id (docs/spec.md §6.3). */
enum { TL_MAX_STOP_IDS = 16 };

/* The file's configuration (docs/spec.md §6.1). A version-1 file reports the version-2 model it
 * describes (§6.5): version 1, one core block, no coda, pre layout, embed_scale 1, no bias,
 * injection, step or coda norm. */
typedef struct tl_model_config {
    size_t size;            /* in: sizeof(tl_model_config)                                    */
    uint32_t vocab_size;
    uint32_t d_model;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t ffn_dim;
    uint32_t n_pre_blocks;
    uint32_t default_loops;
    uint32_t max_seq_len;
    uint32_t weight_format; /* 1 = int8, 2 = int4                                             */
    uint32_t group_size;    /* int4 group size; 0 for int8                                    */
    uint32_t tied_head;     /* 1: the LM head is the embedding                                */
    int32_t bos_id;         /* -1 = none                                                      */
    int32_t eos_id;         /* -1 = none                                                      */
    uint32_t tokenizer;     /* 0 = none, 1 = bytes, 2 = hf (a tokenizer.json the library does
                               not read: it is token-in, token-out)                         */
    float rope_theta;
    float rms_eps;
    char name[64];          /* UTF-8, NUL-terminated                                          */
    /* the version-2 fields (docs/spec.md §6.1); a caller built before them passes a smaller
       size and gets the fields before them only                                             */
    uint32_t version;       /* the file format version, 1, 2 or 3                             */
    uint32_t n_core_blocks; /* k: the core's blocks, applied `loops` times (docs/spec.md §1)  */
    uint32_t n_coda_blocks; /* blocks after the core                                          */
    uint32_t block_layout;  /* 0 = pre-norm, 1 = sandwich (Ouro), 2 = post-norm (Huginn)       */
    uint32_t qkv_bias;      /* 1: attn_qkv adds a bias                                        */
    uint32_t injection;     /* 1: the adapter starts every core iteration (§4.4)              */
    uint32_t step_norm;     /* 1: RMSNorm with a gain between core iterations                 */
    float embed_scale;      /* the embedding's multiplier (1 = none)                          */
    uint32_t coda_norm;     /* 1: RMSNorm with a gain after the last core iteration           */
    /* version 3 (docs/spec.md §6.3): the ids besides eos_id that end generation (§5.3), e.g.
       a chat model's end-of-turn token; a caller built before them gets the fields above     */
    uint32_t n_stop_ids;    /* 0 .. TL_MAX_STOP_IDS                                          */
    int32_t stop_ids[TL_MAX_STOP_IDS]; /* the first n_stop_ids, in the file's order          */
    /* version 3 (docs/spec.md §5.7, §6.3): adaptive depth's exit gate; a caller built before
       them gets the fields above                                                             */
    uint32_t exit_gate;     /* 1: the file carries the exit gate (exit_gate.w, .s, .b)        */
    float exit_threshold;   /* the gate rule's default threshold, in (0, 1]; 0 without a gate */
    /* version 3 (docs/spec.md §1, §4, §6.1): HRM's two-state core and attention gate; a caller
       built before them gets the fields above                                                */
    uint32_t core_cycles;   /* 0: one state; C >= 1: a two-state core (n_core_blocks / 2 low
                               blocks run C times, then the high ones, each iteration)        */
    uint32_t attn_gate;     /* 1: the attention output is gated, o *= sigmoid(gate)           */
    /* version 3 (docs/spec.md §1, §4, §6.1): IQuest-Coder Loop's loop attention; a caller built
       before it gets the fields above                                                        */
    uint32_t loop_window;   /* 0: none; W_l >= 1: core iterations i >= 1 mix a global attention
                               over iteration 0's KV and a local one over their own KV seen
                               through a window of W_l positions, gated per head             */
    /* version 3 (docs/spec.md §2.2.1, §3, §4, §6.1): block activations; a caller built before
       it gets the fields above                                                               */
    uint32_t act_block;     /* 0: one activation scale per row; B >= 1: every linear's input
                               row is quantized in blocks of B, each with its own multiplier
                               of the row's scale (hidden-state prefixes: h4 or kv only)     */
} tl_model_config;

/* Copy the configuration into *out, up to out->size (set by the caller). Thread-safe.
 * TL_ERR_CLOSED after tl_model_close. */
TL_API tl_status tl_model_config_get(const tl_model* model, tl_model_config* out);

/* How the model runs on this machine. */
typedef struct tl_model_runtime {
    size_t size;            /* in: sizeof(tl_model_runtime)                                   */
    tl_isa isa;             /* the kernel path chosen (never TL_ISA_AUTO)                     */
    uint32_t n_threads;     /* the resolved tl_model_params.n_threads (caller included)        */
    uint32_t kv_block_size; /* positions per KV block                                         */
    size_t weight_bytes;    /* bytes of weights the library holds in host memory              */
    tl_device device;       /* where the forward pass runs (never TL_DEVICE_AUTO)              */
    size_t device_weight_bytes; /* bytes of weights in device memory (0 on the CPU)            */
    char device_name[64];   /* e.g. "cpu (avx2)" or "NVIDIA H200 (sm_90)"; NUL-terminated     */
    tl_kv_mode kv_mode;     /* the KV mode the model runs in                                  */
} tl_model_runtime;

TL_API tl_status tl_model_runtime_get(const tl_model* model, tl_model_runtime* out);

/* Counters of the automatic prefix cache (all zero when the model has none). */
typedef struct tl_prefix_cache_stats {
    size_t size;               /* in: sizeof(tl_prefix_cache_stats)                          */
    uint64_t lookups;          /* tl_generate calls (and batch requests) that consulted it   */
    uint64_t hit_tokens;       /* prompt positions those calls took from cached blocks       */
    uint64_t prefilled_tokens; /* prompt positions they computed                              */
    uint64_t inserted_blocks;  /* blocks added                                                */
    uint64_t evicted_blocks;   /* blocks evicted to stay within the budget                    */
    size_t blocks;             /* blocks held now                                             */
    size_t bytes_in_use;       /* bytes of those blocks (each block's whole allocation)       */
    size_t budget_bytes;       /* tl_model_params.prefix_cache_bytes                          */
    uint64_t spilled_blocks;   /* blocks written to the disk tier (docs/spec.md §4.3.1)       */
    uint64_t disk_hit_blocks;  /* blocks lookups read back from it                           */
    size_t disk_bytes;         /* bytes of the tier's files now                               */
    size_t disk_budget_bytes;  /* tl_model_params.prefix_cache_disk_bytes (0: no limit)       */
    uint64_t disk_write_failures; /* spills whose file could not be written (a full disk, an I/O
                                     error): the cache goes on in memory; a caller built before
                                     this field passes a smaller size and gets the fields above */
} tl_prefix_cache_stats;

/* Snapshot of the counters. Thread-safe. TL_ERR_CLOSED after tl_model_close. */
TL_API tl_status tl_model_prefix_cache_stats(tl_model* model, tl_prefix_cache_stats* out);
/* Drop every cached block (blocks in use by sequences and prefixes live on in them); the
 * counters are kept. Thread-safe. TL_ERR_CLOSED after tl_model_close. */
TL_API tl_status tl_model_prefix_cache_clear(tl_model* model);

/* Mark the model closed: every later call with it (or with sequences and prefixes made from
 * it) returns TL_ERR_CLOSED ("model was closed"). The weights are released once no sequence,
 * prefix or running call uses them. Idempotent. The handle itself stays valid memory until
 * tl_model_free. Thread-safe. */
TL_API void tl_model_close(tl_model* model);
/* Close (if needed) and free the handle. NULL is a no-op. Not concurrently with other calls
 * on the same handle. */
TL_API void tl_model_free(tl_model* model);

/* ===== Sequences ============================================================================ */

/* A sequence: tokens run through the model at a fixed depth, with their KV cache. Holds a
 * reference to the model's weights. Use from one thread at a time. */
typedef struct tl_seq tl_seq;

/* An empty sequence at depth `loops` (0 = the model's default_loops; at most 1024, and at
 * most 65536 cache layers n_pre + loops * (k + n_coda), docs/spec.md §1: a deeper request,
 * here or in tl_prefix_build / tl_generate, is TL_ERR_INVALID_ARGUMENT) with sliding window
 * `cache_window` (0 = full context). *out is owned by the caller (tl_seq_free). Thread-safe
 * with respect to the model. */
TL_API tl_status tl_seq_create(tl_model* model, uint32_t loops, uint32_t cache_window,
                               tl_seq** out);

/* Append `n` >= 1 tokens, run in chunks of `chunk` tokens (0 = all at once; any chunking
 * gives identical results). logits_out: NULL, or [vocab_size] floats receiving the logits of
 * the last token. On any error the sequence is left unchanged. Errors include
 * TL_ERR_OUT_OF_RANGE (token ids), TL_ERR_SEQ_TOO_LONG, TL_ERR_CLOSED, TL_ERR_OUT_OF_MEMORY. */
TL_API tl_status tl_seq_prefill(tl_seq* seq, const int32_t* tokens, size_t n, size_t chunk,
                                float* logits_out);
/* As tl_seq_prefill, but logits_all ([n][vocab_size] floats, required) receives the logits
 * of every appended position. */
TL_API tl_status tl_seq_prefill_all(tl_seq* seq, const int32_t* tokens, size_t n, size_t chunk,
                                    float* logits_all);
/* Append one token; logits_out: NULL or [vocab_size] floats for its logits. */
TL_API tl_status tl_seq_decode(tl_seq* seq, int32_t token, float* logits_out);
/* Logits ([vocab_size] floats) of the sequence's last token, recomputed from its stored final
 * hidden state (so a sequence made from a prefix needs no prefill). TL_ERR_INVALID_ARGUMENT
 * on an empty sequence. */
TL_API tl_status tl_seq_last_logits(const tl_seq* seq, float* logits_out);
/* A new sequence with the same tokens and cache: every full KV block is shared, nothing is
 * copied; the two then evolve independently. *out owned by the caller. Do not call while
 * another thread uses `seq`. */
TL_API tl_status tl_seq_fork(const tl_seq* seq, tl_seq** out);
/* Give the empty sequence an instruction block of `instruction_length` positions (docs/spec.md
 * §4.1; 0 = causal, the default): positions 0 .. instruction_length-1 attend to each other
 * bidirectionally. Its first prefill (tl_seq_prefill, tl_seq_prefill_all, tl_seq_decode) must
 * then append at least that many tokens, else TL_ERR_INVALID_ARGUMENT and the sequence is
 * unchanged; the chunk holding position 0 grows to hold the whole block (docs/spec.md §4.2).
 * TL_ERR_INVALID_ARGUMENT on a sequence that holds tokens. Forks keep it. */
TL_API tl_status tl_seq_set_instruction(tl_seq* seq, size_t instruction_length);
/* The sequence's instruction length (0 for NULL; a sequence from a prefix has the prefix's). */
TL_API size_t tl_seq_instruction(const tl_seq* seq);
/* Tokens in the sequence (0 for NULL). */
TL_API size_t tl_seq_length(const tl_seq* seq);
/* Depth and window of the sequence (either pointer may be NULL). */
TL_API void tl_seq_shape(const tl_seq* seq, uint32_t* loops, uint32_t* cache_window);
/* Free the sequence and its references to KV blocks and weights. NULL is a no-op. */
TL_API void tl_seq_free(tl_seq* seq);

/* ===== Prefixes ============================================================================= */

/* A prompt prefix run once at depth L_b with window W: the KV of its n_layers(L_b) cache
 * layers (with a coda, its slots for every depth 1 .. L_b) and the last token's final state at
 * each depth, so sequences at any depth L <= L_b start from it with no recomputation
 * (docs/spec.md §5.4). Built with TL_PREFIX_WARM_START it can be deepened in place
 * (tl_prefix_extend); otherwise it never changes.
 * Holds a reference to the model's weights; shareable between threads. */
typedef struct tl_prefix tl_prefix;

/* tl_prefix_build_ex flags: TL_PREFIX_WARM_START keeps what tl_prefix_extend needs;
 * TL_PREFIX_STORE_H8 / TL_PREFIX_STORE_H4 make a hidden-state prefix (docs/spec.md §5.4.1). */
enum { TL_PREFIX_WARM_START = 1, TL_PREFIX_STORE_H8 = 2, TL_PREFIX_STORE_H4 = 4 };

/* What a prefix keeps at rest (docs/spec.md §5.4.1): its KV blocks, or each layer's input row
 * (int8 or int4), from which a sequence starting from it rebuilds its KV. */
typedef enum tl_prefix_storage { TL_STORE_KV = 0, TL_STORE_H8 = 1, TL_STORE_H4 = 2 } tl_prefix_storage;

/* Run tokens[0..n) (n >= 1, copied) at depth `loops` (0 = default) with window `cache_window`,
 * prefilling in chunks of `chunk` tokens (0 = all at once). *out owned by the caller
 * (tl_prefix_free). Thread-safe with respect to the model. */
TL_API tl_status tl_prefix_build(tl_model* model, const int32_t* tokens, size_t n,
                                 uint32_t loops, uint32_t cache_window, size_t chunk,
                                 tl_prefix** out);
/* As tl_prefix_build (which is this with flags 0); flags TL_PREFIX_WARM_START also keeps every
 * token's state after the last core iteration (4 * d_model bytes per token, twice that with
 * injection; none on a backend without a part pass, whose tl_prefix_extend rebuilds), so
 * tl_prefix_extend can deepen the prefix. TL_PREFIX_STORE_H8 or TL_PREFIX_STORE_H4 keeps each
 * layer's input row instead of the KV (docs/spec.md §5.4.1); refused (TL_ERR_INVALID_ARGUMENT)
 * with the other, with TL_PREFIX_WARM_START, or where the rows would take as many bytes as the
 * KV (the message says both sizes). Unknown flags: TL_ERR_INVALID_ARGUMENT. */
TL_API tl_status tl_prefix_build_ex(tl_model* model, const int32_t* tokens, size_t n, uint32_t loops,
                                    uint32_t cache_window, size_t chunk, uint32_t flags, tl_prefix** out);
/* As tl_prefix_build_ex (which is this with instruction_length 0) for a prompt whose first
 * instruction_length tokens are an instruction block (docs/spec.md §4.1, §5.4: they attend to
 * each other bidirectionally); instruction_length > n is TL_ERR_INVALID_ARGUMENT. Every sequence
 * and generation from the prefix has its instruction length (their suffix is causal), and
 * tl_prefix_save / tl_prefix_load keep it. */
TL_API tl_status tl_prefix_build_instruction(tl_model* model, const int32_t* tokens, size_t n,
                                             size_t instruction_length, uint32_t loops, uint32_t cache_window,
                                             size_t chunk, uint32_t flags, tl_prefix** out);
/* Deepen a warm-start prefix to depth `loops` in place, computing only iterations L_b ..
 * loops-1 of its tokens (in chunks of `chunk`, 0 = all at once): afterwards it is bit for bit
 * the prefix tl_prefix_build at `loops` makes (KV, states, every generation from it). A depth
 * <= the prefix's (0 included) is a no-op. A prefix built without the flag:
 * TL_ERR_LOOPS_MISMATCH ("... build it with TL_PREFIX_WARM_START to extend it"); loops >
 * 1024 or past the cache slots: TL_ERR_INVALID_ARGUMENT. All or nothing: on failure (out of
 * memory) the prefix is unchanged. Thread-safe with concurrent sequences and generations from
 * the prefix (those already started keep its old blocks) and with other extensions of it. On
 * a backend without a part pass (CUDA for now) it rebuilds the prefix from its tokens. */
TL_API tl_status tl_prefix_extend(tl_prefix* prefix, uint32_t loops, size_t chunk);
/* 1 if the prefix was built with TL_PREFIX_WARM_START, else 0 (NULL included). */
TL_API int tl_prefix_warm_start(const tl_prefix* prefix);
/* What the prefix keeps at rest (TL_STORE_KV for NULL). */
TL_API tl_prefix_storage tl_prefix_storage_get(const tl_prefix* prefix);
/* Facts about a prefix; any output pointer may be NULL. nbytes = the bytes of the KV blocks
 * it holds (each block's whole allocation, docs/c-api.md; for a hidden-state prefix instead
 * its rows, n_layers * (n - h_start) * (d_model + 4), or d_model / 2 + 4 for h4) + 4 * loops * d_model (its hidden
 * states) + 4 * n_tokens * d_model (warm start: its tokens' states; twice that with
 * injection) + 4 * n_tokens (its token copy). Thread-safe. */
TL_API void tl_prefix_info(const tl_prefix* prefix, size_t* n_tokens, uint32_t* loops,
                           uint32_t* cache_window, size_t* nbytes);
/* The prefix's instruction length, 0 .. its n_tokens (0 for NULL). */
TL_API size_t tl_prefix_instruction(const tl_prefix* prefix);
/* The prefix's own copy of its tokens (borrowed: valid while the prefix lives); *n (may be
 * NULL) receives their count. */
TL_API const int32_t* tl_prefix_tokens(const tl_prefix* prefix, size_t* n);
/* Free the prefix; blocks still shared by sequences live on in them. NULL is a no-op. */
TL_API void tl_prefix_free(tl_prefix* prefix);
/* Serialize the prefix (docs/spec.md §7). *size (required) receives the blob's byte count.
 * buf NULL: only that. Otherwise cap must be >= it (else TL_ERR_INVALID_ARGUMENT, *size still
 * set, so the caller can retry: an extension may grow the prefix between the calls) and the
 * blob is written. Thread-safe with generations and extensions of the prefix. */
TL_API tl_status tl_prefix_save(const tl_prefix* prefix, void* buf, size_t cap, size_t* size);
/* A prefix of `model` from a blob tl_prefix_save made (by this or another backend/process).
 * TL_ERR_BAD_FILE for a corrupted blob, one from another model or KV mode (message names
 * what); TL_ERR_OUT_OF_MEMORY; never reads past buf[0..n). *out owned by the caller. */
TL_API tl_status tl_prefix_load(tl_model* model, const void* buf, size_t n, tl_prefix** out);
/* A sequence continuing the prefix at depth `loops` (0 = the prefix's; must be <= the
 * prefix's, else TL_ERR_LOOPS_MISMATCH) with the prefix's window. Shares every prefix block;
 * copies none (a hidden-state prefix: the sequence gets its own blocks, the KV of the slots
 * depth `loops` reads rebuilt from the rows, docs/spec.md §5.4.1). *out owned by the caller.
 * Thread-safe (the prefix is only read). */
TL_API tl_status tl_seq_from_prefix(const tl_prefix* prefix, uint32_t loops, tl_seq** out);

/* ===== Generation =========================================================================== */

/* Called after each emitted token (in order, on the calling thread); return nonzero to stop
 * generation there: the call then returns TL_OK with the tokens emitted so far. */
typedef int (*tl_token_fn)(void* user_data, int32_t token);

/* Called after each prefill chunk of a generation's prompt (on the calling thread) with the
 * prompt positions ready so far, those taken from a prefix or the prefix cache included, and
 * their total; return nonzero to stop before any token is emitted: the call then returns TL_OK
 * with none. For progress displays and cancelling long prefills. */
typedef int (*tl_progress_fn)(void* user_data, size_t done, size_t total);

/* Self-speculative decoding (docs/spec.md §5.6): with n_draft = K > 0 a request at depth L
 * decodes in rounds: the same weights at depth draft_loops = L_d < L draft up to K tokens, one
 * pass at depth L verifies them all at once (resuming each drafted row at iteration L_d), and
 * the tokens the verifier samples are emitted while they agree with the drafts. The output,
 * tokens and logits, is exactly plain decoding's, greedy or sampled; only the speed differs.
 * A backend without a part pass (CUDA, for now) decodes plainly: drafted = accepted = 0. */
enum { TL_MAX_DRAFT = 64 };

/* A request's drafting so far: tokens drafted, and drafted tokens the verifier emitted too
 * (accepted <= drafted; accepted / drafted is the acceptance rate). */
typedef struct tl_draft_stats {
    size_t drafted, accepted;
} tl_draft_stats;

/* Adaptive depth (docs/spec.md §5.7): each decoded token (never a prompt token) may stop after
 * the first core iteration where its exit rule fires, at U = 1 .. loops iterations; the tokens
 * it skips read its last computed iteration's keys and values. TL_EXIT_GATE is Ouro's learned
 * exit gate (the model file must have one), TL_EXIT_LATENT Huginn's relative change of the
 * state between iterations; TL_EXIT_KL and TL_EXIT_ARGMAX (Huginn's kl and argmax-stability)
 * read the logits the token would have if it stopped: after each iteration but the last they
 * run the coda and the head on a copy of the state (a probe), and a token that exits keeps its
 * last probe's logits. Every backend decides the same exit, so the output is bit-identical
 * everywhere; it differs from plain decoding's (which is TL_EXIT_NONE) only where a token
 * exits early. */
typedef enum tl_exit_rule {
    TL_EXIT_NONE = 0,   /* every decoded token runs all loops                                */
    TL_EXIT_GATE = 1,   /* exit once the gate's exit probability (CDF) reaches the threshold */
    TL_EXIT_LATENT = 2, /* exit once |x_i - x_{i-1}| / |x_i| falls below the threshold        */
    TL_EXIT_KL = 3,     /* exit once KL(P_{i-1} || P_i) of the probes falls below the threshold
                           (from iteration 1 on)                                             */
    TL_EXIT_ARGMAX = 4  /* exit once the probes' argmax has stayed the same for `threshold`
                           more iterations                                                   */
} tl_exit_rule;

/* A request's decode passes so far and the core iterations they ran (loops / tokens is its
 * mean depth per decoded token). */
typedef struct tl_depth_stats {
    uint64_t tokens; /* decode passes                                                        */
    uint64_t loops;  /* the core iterations they ran                                         */
} tl_depth_stats;

typedef struct tl_gen_params {
    size_t size;               /* sizeof(tl_gen_params)                                        */
    size_t max_tokens;         /* tokens to emit at most; >= 1                                 */
    uint32_t loops;            /* depth; 0 = model default (or the prefix's, from a prefix)    */
    uint32_t cache_window;     /* sliding window; 0 = full. From a prefix: must equal the
                                  prefix's (TL_ERR_WINDOW_MISMATCH otherwise)                  */
    float temperature;         /* finite, >= 0; 0 = greedy (argmax, ties to the lowest id)     */
    int32_t top_k;             /* >= 0; 0 = off                                                */
    float top_p;               /* in (0, 1]; 1 = off                                           */
    float repetition_penalty;  /* finite, > 0; 1 = off                                         */
    uint64_t seed;             /* key of the counter-based generator (docs/spec.md §5.2)       */
    size_t prefill_chunk;      /* prompt tokens per forward chunk; 0 = the whole prompt        */
    const int32_t* stop_tokens;  /* all stop sequences, concatenated (borrowed)                */
    const size_t* stop_lengths;  /* [n_stop] lengths, each >= 1                                */
    size_t n_stop;             /* number of stop sequences                                     */
    tl_token_fn on_token;      /* NULL, or called after each emitted token (streaming, cancel) */
    void* user_data;           /* passed to on_token                                           */
    const char* cache_salt;    /* NULL or a NUL-terminated tenant key (borrowed): the automatic
                                  prefix cache shares blocks only between requests with equal
                                  salts (NULL and "" are equal)                               */
    tl_progress_fn on_prefill; /* NULL, or called after each prompt chunk (progress, cancel);
                                  gets user_data too                                          */
    uint32_t draft_loops;        /* self-speculative decoding's draft depth L_d: 1 <= L_d < loops
                                    when n_draft > 0 (ignored when n_draft == 0); 0 with
                                    draft_wave: the wave chooses it (docs/spec.md §5.6.1)     */
    uint32_t n_draft;            /* tokens drafted per round, 0 .. TL_MAX_DRAFT; 0 = plain decoding */
    tl_draft_stats* draft_stats; /* NULL, or zeroed after validation and updated after every round */
    /* adaptive depth (docs/spec.md §5.7); a caller built before these fields passes a smaller
       size and gets TL_EXIT_NONE                                                             */
    uint32_t exit_rule;          /* a tl_exit_rule; not with n_draft > 0; TL_EXIT_GATE needs a
                                    model with an exit gate; not on the CUDA backend yet      */
    float exit_threshold;        /* the rule's threshold q; 0 = the rule's default: for the gate
                                    the model file's exit_threshold, for latent 0.03, kl 0.001,
                                    argmax 5. Gate: in (0, 1] (1 never exits); latent and kl:
                                    finite and > 0; argmax: an integer in 1 .. 1024 (steps) */
    uint32_t min_loops;          /* iterations every decoded token runs at least; 0 = 1; else
                                    1 .. loops (loops: never exits)                          */
    tl_depth_stats* depth_stats; /* NULL, or zeroed after validation and updated after every
                                    decode pass (speculative rounds run none)                */
    /* the wave schedule (docs/spec.md §5.6.1); a caller built before this field passes a
       smaller size and gets rounds                                                          */
    uint32_t draft_wave;         /* 0 or 1. With n_draft > 0 and 1: tl_generate and
                                    tl_generate_from_prefix draft and verify in one pass per
                                    step, every position in flight running its next core
                                    iteration on the same weights (n_draft bounds the drafts
                                    in flight; loops holds them all); the tokens and logits
                                    are the same, the draft counts the wave's. Batches,
                                    schedulers and backends without a wave pass (CUDA) run
                                    rounds (at max(1, loops / 4) for draft_loops 0)          */
    /* the prefix-LM instruction block (docs/spec.md §4.1); a caller built before this field
       passes a smaller size and gets 0                                                      */
    size_t instruction_length;   /* P: prompt positions 0 .. P-1 attend to each other
                                    bidirectionally (HRM-Text's token_type_ids), every later
                                    position sees them causally; 0 = causal. At most the
                                    prompt's length (TL_ERR_INVALID_ARGUMENT otherwise). From a
                                    prefix it must be 0: the prefix's own applies
                                    (tl_prefix_build_instruction)                             */
} tl_gen_params;

/* max_tokens 32, default loops, full window, temperature 0, top_k 50, top_p 1, penalty 1,
 * seed 0, whole-prompt prefill, no stop sequences, no callbacks, no cache salt, plain decoding
 * (n_draft 0), no exit rule, no instruction block (causal). */
TL_API tl_gen_params tl_gen_params_default(void);

/* Run prompt[0..n) and sample until a stop rule (docs/spec.md §5.3). With an automatic prefix
 * cache the longest cached block-aligned prefix of the prompt is reused and only the rest is
 * prefilled (in chunks), then the prompt's full blocks are offered to the cache; the tokens
 * and logits are the same either way. out_tokens (capacity
 * params->max_tokens) receives the emitted tokens only, *n_out their count. out_logits: NULL
 * or [max_tokens][vocab_size] floats receiving the logits each emitted token was sampled from
 * (before penalty and temperature). Every parameter is validated before any work.
 * Thread-safe: many threads may generate with one model at once. */
TL_API tl_status tl_generate(tl_model* model, const int32_t* prompt, size_t n,
                             const tl_gen_params* params, int32_t* out_tokens, size_t* n_out,
                             float* out_logits);
/* As tl_generate on the prompt prefix.tokens + suffix[0..n_suffix) (suffix may be NULL with
 * n_suffix 0): identical tokens and logits, but the prefix's part is not recomputed. loops 0
 * means the prefix's depth; a larger depth is TL_ERR_LOOPS_MISMATCH, a different
 * cache_window TL_ERR_WINDOW_MISMATCH. Thread-safe: many threads may continue one prefix at
 * once (it is only read; no prefix block is copied). */
TL_API tl_status tl_generate_from_prefix(const tl_prefix* prefix, const int32_t* suffix,
                                         size_t n_suffix, const tl_gen_params* params,
                                         int32_t* out_tokens, size_t* n_out, float* out_logits);

/* One request of a batch. */
typedef struct tl_request {
    size_t size;                 /* sizeof(tl_request) as the caller compiled it: a newer,
                                    larger struct is read up to this library's fields          */
    const tl_prefix* prefix;     /* NULL, or a prefix of this model the prompt continues       */
    const int32_t* prompt;       /* the tokens (after the prefix's); may be NULL if n_prompt 0 */
    size_t n_prompt;             /* >= 1 without a prefix                                     */
    const tl_gen_params* params; /* NULL = tl_gen_params_default()                            */
    int32_t* out_tokens;         /* [params->max_tokens]: the emitted tokens                  */
    float* out_logits;           /* NULL or [max_tokens][vocab_size], as in tl_generate        */
    size_t n_out;                /* out: tokens emitted                                       */
} tl_request;

/* Generate for every request at once: each prompt is run (through the automatic prefix cache
 * when the model has one; a request with a prefix shares its blocks), then every live
 * sequence is decoded in one batched step per token (a speculative request, n_draft > 0, runs
 * a round of its own per step instead) until each meets its own stop rule.
 * Requests may differ in every parameter, depth and window included. Each request's tokens
 * and logits are bit-identical to tl_generate (or tl_generate_from_prefix) of it alone.
 * requests[0..n_requests) point to the requests (they need not be contiguous); each is read
 * up to its own `size`, which must cover this library's tl_request. Each pointer must be
 * distinct, and no two requests' output buffers may overlap. A NULL pointer, a short `size`
 * or a pointer given twice fails the call with TL_ERR_INVALID_ARGUMENT before anything is
 * written ("request 3 is the same as request 1"). Every request is then validated
 * before any work; the first invalid one fails the call with a message naming its index. On
 * a later failure (out of memory, non-finite logits) the call fails and each n_out says how
 * far its request got. Thread-safe like tl_generate. */
TL_API tl_status tl_generate_batch(tl_model* model, tl_request* const* requests, size_t n_requests);

/* ===== Continuous batching ================================================================= */

/* A scheduler: many requests of one model, run by iteration. Each tl_sched_step runs one
 * iteration: waiting requests join the running batch (in arrival order, while slots and the
 * KV budget allow), every decoding request computes one token (one batched pass) or, with
 * n_draft > 0, one round of self-speculative decoding (alone, emitting 1 .. K' tokens; plain
 * decoding in the batched pass on a backend without a part pass), and the prompts being
 * prefilled get chunks from what is left of the step's token budget, so a long prompt never
 * stalls the running streams; the decode rows and the prompt chunks run as one mixed pass that
 * reads each weight once (TINYLOOP_MIXED_PASS=0 when the scheduler is created: separate
 * passes, the same bits). Every prompt goes through the automatic prefix cache (when the
 * model has one), under its request's cache_salt; each chunk offers it its full blocks. When a
 * step would take the running requests' KV past the budget, the newest running request is
 * preempted: its KV is dropped and it waits at the head of the queue to be recomputed (its
 * prompt and the tokens it emitted), so it loses nothing. Every request's tokens are
 * bit-identical to tl_generate of it alone, whatever else runs (docs/c-api.md, "Continuous
 * batching"). Use a scheduler from one thread at a time; it holds a reference to the model's
 * weights. */
typedef struct tl_sched tl_sched;

typedef struct tl_sched_params {
    size_t size;            /* sizeof(tl_sched_params)                                        */
    size_t max_batch;       /* requests running at once (prefilling or decoding); 0 = 32      */
    size_t step_tokens;     /* positions one step computes at most: one per decoding request
                               (K' for a speculative round), the rest in prompt chunks;
                               0 = 512; must be >= max_batch                                   */
    size_t kv_budget_bytes; /* KV bytes the running requests may hold alone (blocks shared with
                               the prefix cache count against its budget); 0 = no limit. A
                               request that could not run within it alone is refused. Without
                               a prefix cache it is a hard bound after every step; with one,
                               a block the cache drops while a request shares it becomes that
                               request's alone, outside the step's plan.                     */
} tl_sched_params;

/* max_batch 32, step_tokens 512, no KV budget. */
TL_API tl_sched_params tl_sched_params_default(void);

/* A new, empty scheduler for `model`; params may be NULL (defaults). *out owned by the caller
 * (tl_sched_free). Thread-safe with respect to the model. */
TL_API tl_status tl_sched_create(tl_model* model, const tl_sched_params* params, tl_sched** out);
/* Cancel every request and free the scheduler. NULL is a no-op. */
TL_API void tl_sched_free(tl_sched* sched);

/* Queue a request: prompt[0..n) (n >= 1) and params (NULL = tl_gen_params_default()), checked
 * as tl_generate checks them; both are copied (stop sequences and cache_salt included).
 * params->prefill_chunk is not used (the scheduler chunks prompts by its token budget, which
 * changes no result); on_token, on_prefill, draft_stats and depth_stats must be NULL
 * (tl_sched_stats counts the drafted and accepted tokens, the decode passes and their loops, of
 * all requests). A request with an exit rule that is preempted recomputes its prompt, then
 * replays each token it decoded at the depth that token ran (docs/spec.md §5.7), so its KV is
 * again exactly the one it had. *id (required) receives the request's id, unique in this
 * scheduler, >= 1. TL_ERR_INVALID_ARGUMENT also when the request alone could need more KV than
 * kv_budget_bytes. */
TL_API tl_status tl_sched_add(tl_sched* sched, const int32_t* prompt, size_t n, const tl_gen_params* params,
                              uint64_t* id);
/* Remove request `id`, waiting or running; it emits nothing more and its KV is released.
 * TL_ERR_INVALID_ARGUMENT if no such request is queued (never added, finished or cancelled). */
TL_API tl_status tl_sched_cancel(tl_sched* sched, uint64_t id);

/* Why a request ended, reported with its last event. */
typedef enum tl_finish {
    TL_FINISH_NONE = 0,   /* still running                                                     */
    TL_FINISH_STOP = 1,   /* its token is a stop id (eos_id, stop_ids) or ends a stop sequence */
    TL_FINISH_LENGTH = 2, /* max_tokens reached                                                */
    TL_FINISH_ERROR = 3   /* its logits were not finite: no token (-1), the request is dropped */
} tl_finish;

/* Run one iteration and report what it emitted: event i is request ids[i] emitting tokens[i],
 * with finish[i] (a tl_finish) nonzero when that ended the request, which is then gone. Each
 * request gets at most one event per step, except a speculative one (n_draft > 0), which gets
 * one per token its round emits; a request's events come in the order of its tokens. The
 * arrays have room for `capacity` events, which must be >= max_batch; a round's K' is capped
 * so that the step's events fit `capacity` and its positions step_tokens while every other
 * running request keeps room for one (a step emits at most step_tokens events, so capacity >=
 * step_tokens never caps a round by events; the tokens are the same whatever the cap).
 * *n_events receives the count (0 when there is nothing to run). On TL_ERR_OUT_OF_MEMORY the
 * step ran what it could (a failed admission does not stop the running requests; a decode
 * pass or a round out of memory preempts the newest request and runs once more): its
 * *n_events events are valid, the rest is unchanged and the next step tries again. A
 * TL_FINISH_ERROR event leaves the sampler's message in tl_last_error() though the step
 * returns TL_OK. TL_ERR_CLOSED once the model is closed. */
TL_API tl_status tl_sched_step(tl_sched* sched, uint64_t* ids, int32_t* tokens, uint8_t* finish,
                               size_t capacity, size_t* n_events);

typedef struct tl_sched_stats {
    size_t size;               /* in: sizeof(tl_sched_stats)                                   */
    size_t running;            /* requests admitted (prefilling or decoding)                   */
    size_t waiting;            /* requests queued, the preempted included                      */
    uint64_t steps;            /* tl_sched_step calls that found requests running              */
    uint64_t prompt_tokens;    /* prompt positions prefilled (recomputation included)          */
    uint64_t cached_tokens;    /* prompt positions taken from the automatic prefix cache       */
    uint64_t generated_tokens; /* tokens emitted                                               */
    uint64_t preemptions;      /* requests preempted to stay within the KV budget              */
    uint64_t finished;         /* requests that ended by a stop rule (or TL_FINISH_ERROR)       */
    uint64_t cancelled;        /* requests removed by tl_sched_cancel                          */
    size_t kv_blocks;          /* KV blocks the running requests hold alone                    */
    size_t kv_bytes;           /* their bytes: what kv_budget_bytes bounds                     */
    size_t kv_budget_bytes;    /* tl_sched_params.kv_budget_bytes                              */
    uint64_t drafted_tokens;   /* tokens drafted by speculative rounds (K' each)               */
    uint64_t accepted_tokens;  /* drafted tokens the verifier emitted too (<= drafted_tokens)  */
    uint64_t decode_passes;    /* tokens sampled from a pass over an emitted token: every
                                  token of a non-speculative request but its first, as
                                  tl_depth_stats.tokens counts them for tl_generate          */
    uint64_t decode_loops;     /* the core iterations those passes ran for that token (the
                                  depth, for a preempted plain request's recomputation; replays
                                  are not counted): decode_loops / decode_passes is the mean
                                  depth per decoded token                                     */
    uint64_t mixed_passes;     /* steps whose decode rows and prompt chunks ran as one pass,
                                  reading each weight once (0 with TINYLOOP_MIXED_PASS=0 set
                                  when the scheduler was created)                             */
} tl_sched_stats;

/* Snapshot of the scheduler's counters, filled up to out->size. */
TL_API tl_status tl_sched_stats_get(const tl_sched* sched, tl_sched_stats* out);

/* The decode passes tl_sched_stats.decode_passes counts, by the core iterations they ran:
 * counts[u - 1] = the passes that ran u iterations (adaptive depth's exits, docs/spec.md §5.7;
 * a pass without an exit rule runs its request's loops), for u = 1 .. min(n, *n_depths), where
 * *n_depths (required) receives the deepest u counted so far (0 before any). counts may be NULL
 * with n 0 (ask for *n_depths first). */
TL_API tl_status tl_sched_depth_counts(const tl_sched* sched, uint64_t* counts, size_t n, size_t* n_depths);

#ifdef __cplusplus
}
#endif

#endif /* TINYLOOP_H */
