/* sampling.h — token sampling (docs/spec.md §5.1) and the counter-based generator (§5.2). */
#ifndef TL_SAMPLING_H
#define TL_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

typedef struct tl_sampler {
    float temperature;   /* >= 0; 0 = argmax                */
    int32_t top_k;       /* >= 0; 0 = off                   */
    float top_p;         /* (0, 1]                          */
    float penalty;       /* > 0; 1 = off                    */
    uint64_t seed;
} tl_sampler;

/* Working memory for vocabularies of V ids. */
typedef struct tl_sample_scratch {
    float* z;            /* [V] penalised logits             */
    int32_t* order;      /* [V] candidate ids                */
    int64_t* weights;    /* [V] fixed-point weights          */
} tl_sample_scratch;

/* rng(seed, pos): one SplitMix64 output at state seed + (pos + 1) * golden gamma. */
uint64_t tl_rng(uint64_t seed, uint64_t pos);

/* Sample the token that will occupy position `pos` from logits[V]. seen[i] != 0 marks the
 * ids of the history (prompt and emitted tokens) for the repetition penalty. Fails with
 * TL_ERR_NUMERIC on a NaN or infinite logit. */
tl_status tl_sample(const tl_sampler* s, const float* logits, uint32_t V, const uint8_t* seen,
                    uint64_t pos, tl_sample_scratch* scratch, int32_t* token);

#endif
