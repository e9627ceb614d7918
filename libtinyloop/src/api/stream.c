/* stream.c — one request's sampling state (generate.h): sample, record, stream, stop. */
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/generate.h"

tl_status tl_stream_init(tl_stream* s, const tl_engine* e, const tl_gen_params* p, int32_t* out_tokens,
                         float* out_logits, size_t* n_out) {
    memset(s, 0, sizeof *s);
    const uint32_t V = tl_engine_config(e)->vocab_size;
    s->p = p;
    s->sampler = (tl_sampler){p->temperature, p->top_k, p->top_p, p->repetition_penalty, p->seed};
    s->scratch = (tl_sample_scratch){tl_alloc(V * sizeof(float)), tl_alloc(V * sizeof(int32_t)),
                                     tl_alloc(V * sizeof(int64_t))};
    s->seen = tl_alloc_zeroed(V, 1);
    s->logits = tl_alloc(V * sizeof(float));
    s->out_tokens = out_tokens;
    s->out_logits = out_logits;
    s->n_out = n_out;
    *n_out = 0;
    if (!s->scratch.z || !s->scratch.order || !s->scratch.weights || !s->seen || !s->logits) {
        tl_stream_free(s);
        return tl_fail_oom("sampler");
    }
    return TL_OK;
}

void tl_stream_see(tl_stream* s, const int32_t* tokens, size_t n) {
    for (size_t i = 0; i < n; i++) s->seen[tokens[i]] = 1;
}

/* Whether the emitted tokens end with one of the stop sequences. */
static bool ends_with_stop(const tl_gen_params* p, const int32_t* emitted, size_t n) {
    const int32_t* stop = p->stop_tokens;
    for (size_t i = 0; i < p->n_stop; stop += p->stop_lengths[i], i++) {
        const size_t len = p->stop_lengths[i];
        if (len <= n && memcmp(emitted + n - len, stop, len * sizeof *stop) == 0) return true;
    }
    return false;
}

tl_status tl_stream_sample(tl_stream* s, int32_t* token) {
    const tl_config* c = tl_engine_config(s->seq->engine);
    const size_t i = s->n_emitted;
    tl_status st = tl_sample(&s->sampler, s->logits, c->vocab_size, s->seen, s->seq->n, &s->scratch, token);
    if (st != TL_OK) return st;
    s->out_tokens[i] = *token;
    if (s->out_logits) memcpy(s->out_logits + i * c->vocab_size, s->logits, c->vocab_size * sizeof(float));
    s->seen[*token] = 1;
    *s->n_out = s->n_emitted = i + 1;
    const tl_gen_params* p = s->p;
    const bool stop = (p->on_token && p->on_token(p->user_data, *token) != 0) ||
                      tl_is_stop_id(c, *token) || ends_with_stop(p, s->out_tokens, s->n_emitted);
    s->finish = stop ? TL_FINISH_STOP : s->n_emitted >= p->max_tokens ? TL_FINISH_LENGTH : TL_FINISH_NONE;
    s->done = s->finish != TL_FINISH_NONE;
    return TL_OK;
}

void tl_stream_free(tl_stream* s) {
    tl_free(s->scratch.z);
    tl_free(s->scratch.order);
    tl_free(s->scratch.weights);
    tl_free(s->seen);
    tl_free(s->logits);
    tl_seq_free(s->seq);
    memset(s, 0, sizeof *s);
}
