/* generate.h — what tl_generate, tl_generate_from_prefix and tl_generate_batch share: request
 * checking, starting a request (its prompt run through the prefix cache, or its prefix
 * continued) and a request's sampling state, the stream. */
#ifndef TL_GENERATE_H
#define TL_GENERATE_H

#include <stdbool.h>

#include "core/exit_rule.h"
#include "core/prefix_cache.h"
#include "core/sampling.h"
#include "core/seq.h"

/* Check a request before any work: the prompt (or prefix + suffix) tokens, every parameter
 * (defaults overlaid with `given`, resolved into *p: loops 0 becomes the depth), the depth and
 * window against the prefix (without one, the depth's cache slots), and the total length. */
tl_status tl_gen_check(const tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n,
                       const tl_gen_params* given, tl_gen_params* p);

/* The automatic prefix cache's place (docs/spec.md §4.3) of a request p run in sequence s. */
tl_pcache_key tl_gen_cache_key(const tl_engine* e, const tl_seq* s, const tl_gen_params* p);

/* The rows of one batched pass, [capacity] each: row j runs the next tokens of seqs[j] under exit
 * rule exits[j] (docs/spec.md §5.7; rule TL_EXIT_NONE for a plain row), writes its logits to
 * logits[j] ([V]; NULL: none) and the core iterations it ran to depths[j]; marks is the pass's
 * scratch. A row is one token (a decode) unless counts is set: then row j is a span of
 * counts[j] tokens (a prefill chunk; more than one only on a backend with tl_has_mixed_pass, and
 * with an inactive exit rule), its tokens following the rows before it in `tokens`, its logits
 * those of its last token, and NULL logits are allowed only on such a backend. */
typedef struct tl_decode_rows {
    tl_seq** seqs;
    int32_t* tokens;       /* [token capacity]                                                 */
    float** logits;
    tl_exit* exits;
    uint32_t* depths;
    tl_kv_mark* marks;
    size_t* counts;        /* NULL: one token per row                                          */
    bool keep_window;      /* leave the blocks outside each window (the caller releases them)  */
} tl_decode_rows;

/* Rows for `capacity` sequences of one token each (span_tokens 0), or of spans of
 * span_tokens tokens in all (with counts). */
tl_status tl_decode_rows_alloc(tl_decode_rows* rows, size_t capacity, size_t span_tokens);
void tl_decode_rows_free(tl_decode_rows* rows);

/* The first n rows in one batched pass (tl_forward_batch, or with counts on a backend with a
 * mixed pass tl_forward_spans): each sequence's KV reserved, run, advanced and, unless
 * keep_window, released outside its window. All-or-nothing: on failure every table is rolled
 * back. TL_ERR_INVALID_ARGUMENT for a span of more than one token where generate.h's rows
 * above refuse it. The caller checks that each sequence has room for its tokens. */
tl_status tl_gen_run_rows(tl_engine* e, tl_decode_rows* rows, size_t n);

/* The exit rule of checked params p (TL_EXIT_NONE, or its resolved threshold and min_loops). */
static inline tl_exit tl_gen_exit(const tl_gen_params* p) {
    return (tl_exit){p->exit_rule, p->exit_threshold, p->min_loops};
}

/* One decode pass of `loops` core iterations into a request's depth_stats (NULL: none). */
static inline void tl_depth_count(tl_depth_stats* stats, uint32_t loops) {
    if (!stats) return;
    stats->tokens++;
    stats->loops += loops;
}

/* One request's sampling state (docs/spec.md §5): the ids of its history for the repetition
 * penalty, the logits to sample the next token from, its outputs and stop rules. */
typedef struct tl_stream {
    tl_seq* seq;              /* owned                                       */
    const tl_gen_params* p;   /* resolved (borrowed)                         */
    tl_sampler sampler;
    tl_sample_scratch scratch;
    uint8_t* seen;            /* [V] ids in the history                      */
    float* logits;            /* [V] logits of the next token                */
    int32_t* out_tokens;      /* [max_tokens]                                */
    float* out_logits;        /* NULL or [max_tokens][V]                     */
    size_t n_emitted;         /* tokens emitted: the next out_tokens index   */
    size_t* n_out;            /* out: n_emitted, written, never read back    */
    bool done;                /* a stop rule fired                           */
    tl_finish finish;         /* which kind, once done (TL_FINISH_STOP for a stop by on_token
                                 or on_prefill too)                          */
} tl_stream;

/* Start a checked request on a fresh stream: stream->seq holds the prompt (reusing the
 * automatic prefix cache, then offering it the prompt's blocks) or the prefix plus suffix,
 * and stream->logits those of its last token; stream->done if on_prefill stopped it. */
tl_status tl_gen_start(tl_engine* e, const tl_prefix* prefix, const int32_t* prompt, size_t n, tl_stream* stream);

/* A stream for checked params p, with outputs; the history starts empty. */
tl_status tl_stream_init(tl_stream* s, const tl_engine* e, const tl_gen_params* p, int32_t* out_tokens,
                         float* out_logits, size_t* n_out);
/* Mark tokens as part of the history. */
void tl_stream_see(tl_stream* s, const int32_t* tokens, size_t n);
/* Sample the next token from s->logits, record it, call on_token and check the stop rules
 * (setting s->done). Unless done, the caller runs *token to refill s->logits. */
tl_status tl_stream_sample(tl_stream* s, int32_t* token);
/* Free the scratch and the sequence. */
void tl_stream_free(tl_stream* s);

#endif
