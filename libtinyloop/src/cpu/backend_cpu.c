/* backend_cpu.c — the CPU backend: the linears repacked once at open (pack.c) and the host pass
 * (forward.c) over them. Its KV blocks hold their data in host memory (no allocator). */
#include "cpu/backend_cpu.h"

#include <stdio.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/engine.h"
#include "cpu/forward.h"
#include "cpu/isa.h"

typedef struct cpu_backend {
    tl_backend base;
    tl_isa isa;
    tl_linear* linears; /* [n_linears], indexed like tl_file.linears */
    size_t n_linears;
    size_t weight_bytes;
} cpu_backend;

static tl_status cpu_forward(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, float* logits_all,
                             float* logits_last, float* last_hidden, float* loop_states) {
    const tl_part whole = {.depth = s->loops, .logits_all = logits_all, .logits_last = logits_last,
                           .loop_states = loop_states};
    return tl_cpu_forward(((cpu_backend*)b)->linears, s, tokens, T, s->n, &whole, last_hidden);
}

static tl_status cpu_forward_part(tl_backend* b, tl_seq* s, const int32_t* tokens, size_t T, size_t pos0,
                                  const tl_part* part) {
    return tl_cpu_forward(((cpu_backend*)b)->linears, s, tokens, T, pos0, part, NULL);
}

static tl_status cpu_kv_from_rows(tl_backend* b, tl_seq* s, uint32_t slot, size_t pos0, size_t T, const int8_t* q,
                                  const float* a) {
    return tl_cpu_kv_from_rows(((cpu_backend*)b)->linears, s, slot, pos0, T, q, a);
}

static tl_status cpu_forward_batch(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, size_t B,
                                   float* const* logits, const tl_exit* exits, uint32_t* depths) {
    return tl_cpu_forward_spans(((cpu_backend*)b)->linears, seqs, tokens, NULL, B, logits, exits, depths);
}

static tl_status cpu_forward_spans(tl_backend* b, tl_seq* const* seqs, const int32_t* tokens, const size_t* counts,
                                   size_t S, float* const* logits, const tl_exit* exits, uint32_t* depths) {
    return tl_cpu_forward_spans(((cpu_backend*)b)->linears, seqs, tokens, counts, S, logits, exits, depths);
}

static tl_status cpu_forward_wave(tl_backend* b, tl_seq* s, const tl_wave_row* rows, size_t R) {
    return tl_cpu_forward_wave(((cpu_backend*)b)->linears, s, rows, R);
}

static tl_status cpu_head_logits(tl_backend* b, const tl_engine* e, const float* x, float* logits) {
    const cpu_backend* cpu = (const cpu_backend*)b;
    return tl_cpu_head_logits(&cpu->linears[cpu->n_linears - 1], e, x, logits);
}

static void cpu_info(const tl_backend* b, tl_backend_info* out) {
    const cpu_backend* cpu = (const cpu_backend*)b;
    *out = (tl_backend_info){TL_DEVICE_CPU, cpu->weight_bytes, 0, {0}};
    snprintf(out->name, sizeof out->name, "cpu (%s)", tl_isa_name(cpu->isa));
}

static void cpu_free(tl_backend* b) {
    cpu_backend* cpu = (cpu_backend*)b;
    for (size_t i = 0; cpu->linears && i < cpu->n_linears; i++) tl_linear_release(&cpu->linears[i]);
    tl_free(cpu->linears);
    tl_free(cpu);
}

static const tl_backend_iface cpu_iface = {.forward = cpu_forward,
                                           .forward_batch = cpu_forward_batch,
                                           .forward_spans = cpu_forward_spans,
                                           .head_logits = cpu_head_logits,
                                           .info = cpu_info,
                                           .free = cpu_free,
                                           .forward_part = cpu_forward_part,
                                           .kv_from_rows = cpu_kv_from_rows,
                                           .forward_wave = cpu_forward_wave,
                                           .adaptive = true};

tl_status tl_backend_cpu_new(tl_engine* e, tl_backend** out) {
    *out = NULL;
    cpu_backend* cpu = tl_alloc_zeroed(1, sizeof *cpu);
    if (!cpu) return tl_fail_oom("CPU backend");
    cpu->base.iface = &cpu_iface;
    cpu->isa = e->isa;
    cpu->n_linears = e->file.n_linears;
    cpu->linears = tl_alloc_zeroed(cpu->n_linears, sizeof *cpu->linears);
    tl_status st = cpu->linears ? TL_OK : tl_fail_oom("linears");
    for (size_t i = 0; st == TL_OK && i < cpu->n_linears; i++) {
        st = tl_linear_prepare(&cpu->linears[i], &e->file.linears[i], e->isa);
        if (st == TL_OK) cpu->weight_bytes += tl_linear_bytes(&cpu->linears[i]);
        if (st == TL_OK && !tl_linear_reads_src(&cpu->linears[i])) tl_file_release_linear(&e->file, i);
    }
    if (st != TL_OK) {
        cpu_free(&cpu->base);
        return st;
    }
    *out = &cpu->base;
    return TL_OK;
}
