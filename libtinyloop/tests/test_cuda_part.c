/* test_cuda_part.c — the CUDA backend's part pass (core/forward.h's tl_part) and what runs on it,
 * against the CPU backend bit for bit, on a CUDA device: a real one, or the CPU emulation of the
 * CUDA runtime (TINYLOOP_CUDA_EMULATION). Skipped, saying why, where tl_device_check finds no CUDA
 * device. Each model file is opened twice, on the CPU and on CUDA: a plain pre-norm model, a
 * Huginn-like one (prelude, core of 2 with injection and step norm, coda with coda norm, sandwich
 * blocks, qkv biases) also with int4 KV, one with a coda and no prelude, one of 5 token ids
 * (where drafts often agree), HRM-like ones (a two-state core, the attention gate; int8, and
 * int4 weights and KV with biases and post blocks), IQuest-Coder-Loop-like ones (loop attention;
 * int8, and int4 weights and KV with biases and sandwich blocks) and block activations (act_block:
 * the Huginn-like one in blocks of 4, int4 loop attention in blocks of 16). Checked:
 *  - the part passes of self-speculative decoding (docs/spec.md §5.6): drafts to L_d, row by row
 *    and as a chunk, their coda in depth L's slots, resumed to L by one verification pass; and a
 *    warm-start build's pass split at L_b and resumed (§5.4): every kept state, injected term,
 *    draft and verifier logit, final state and loop state, and every KV slot (copied back from
 *    the device), equals the CPU's;
 *  - self-speculative decoding through the public API (tl_generate greedy and sampled, alone and
 *    in tl_generate_batch beside a plain request): the CPU's plain tokens and logits, and the
 *    CPU's draft counters: drafts are drafted (and, summed, accepted) on CUDA, not decoded plainly;
 *  - warm start: a prefix built at L_b keeps its states on CUDA (the CPU's nbytes), and extended
 *    to L in one step or two saves the CPU's blob byte for byte (KV and states), the blob of a
 *    prefix built at L, and generates the CPU's tokens and logits;
 *  - an instruction block (prefix-LM): generations and a prefix with one, the CPU's;
 *  - a decode step allocates nothing on the host once its sequence's scratch has grown. */
#include <stdlib.h>
#include <string.h>

#include "core/forward.h"
#include "core/seq.h"
#include "test_kv.h"
#include "test_util.h"

enum { PROMPT = 9, MAX_ROWS = 18, MAX_NEW = 8, BLOCK = 4 };

static int32_t drawn[PROMPT + MAX_ROWS], tokens[PROMPT + MAX_ROWS]; /* tokens: drawn, mod the vocabulary */
static size_t total_drafted, total_accepted;

typedef struct pair {
    tl_model* cpu;
    tl_model* cuda;
    uint32_t V, d;
    const char* name;
} pair;

static tl_model* open_on(const char* path, tl_device device, tl_kv_mode kv_mode) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2;
    p.kv_block_size = BLOCK;
    p.kv_mode = kv_mode;
    p.device = device;
    tl_model* m = NULL;
    CHECK(tl_model_open(path, &p, &m) == TL_OK, "tl_model_open(%s, device %d): %s", path, (int)device, tl_last_error());
    return m;
}

static pair open_pair(const char* name, const tu_spec* spec, tl_kv_mode kv_mode) {
    const char* path = tu_write_model(name, spec);
    pair p = {open_on(path, TL_DEVICE_CPU, kv_mode), open_on(path, TL_DEVICE_CUDA, kv_mode), spec->vocab, spec->d,
              name};
    for (size_t i = 0; i < PROMPT + MAX_ROWS; i++) tokens[i] = drawn[i] % (int32_t)spec->vocab;
    return p;
}

static void close_pair(pair* p) {
    tl_model_free(p->cpu);
    tl_model_free(p->cuda);
}

/* A sequence's KV copied back to the host: a sequence of the same spans whose blocks are host
 * copies of its device blocks. */
typedef struct mirror {
    tl_seq s;
    tl_kv_block* blocks; /* [n_spans], the copies (data malloc'd) */
} mirror;

static mirror mirror_of(const tl_seq* s) {
    const tl_kv_geom* g = &s->engine->kv_geom;
    mirror m = {*s, calloc(s->kv.n_spans, sizeof(tl_kv_block))};
    m.s.kv.spans = calloc(s->kv.n_spans, sizeof *m.s.kv.spans);
    if (!m.blocks || !m.s.kv.spans) exit(2);
    for (size_t i = 0; i < s->kv.n_spans; i++) {
        const tl_kv_block* b = s->kv.spans[i].block;
        m.s.kv.spans[i] = s->kv.spans[i];
        if (!b) continue;
        m.blocks[i].n_layers = b->n_layers;
        m.blocks[i].data = malloc(b->bytes - 64);
        if (!m.blocks[i].data) exit(2);
        CHECK(g->device && g->device->download(g->device->ctx, m.blocks[i].data, b->data, b->bytes - 64) == 0,
              "copying a KV block back from the device failed");
        m.s.kv.spans[i].block = &m.blocks[i];
    }
    return m;
}

static void free_mirror(mirror* m) {
    for (size_t i = 0; i < m->s.kv.n_spans; i++) free(m->blocks[i].data);
    free(m->blocks);
    free(m->s.kv.spans);
}

/* ---- part passes ---------------------------------------------------------------------------- */

enum { DRAFT_ROWS, DRAFT_CHUNK, BUILD_SPLIT };

/* Everything one backend's split pass produced. */
typedef struct split {
    tl_seq* s;
    float *states, *injects, *drafts, *hidden, *logits, *loop_states, *kept;
} split;

/* The prompt into a sequence at depth L on m (a prefix build's run: every depth's coda slots),
 * KV reserved for `rows` rows after it, then those rows split at L_d as `how` says: drafts to
 * L_d (their coda in depth L's slots) row by row or as a chunk, then one verification from L_d;
 * or a warm-start build's pass to L_d (states kept), resumed to L. */
static split run_split(tl_model* m, const pair* p, uint32_t L, uint32_t Ld, size_t rows, int how) {
    const size_t d = p->d, V = p->V;
    split o = {NULL, calloc(rows * d, 4), calloc(rows * d, 4), calloc(rows * V, 4), calloc(rows * d, 4),
               calloc(rows * V, 4), calloc(L * d, 4), calloc(rows * d, 4)};
    CHECK_OK(tl_seq_create(m, L, 0, &o.s));
    const tl_run_opts opts = {.loop_states = o.loop_states};
    CHECK_OK(tl_seq_run(o.s, tokens, PROMPT, 0, &opts));
    CHECK_OK(tl_kv_reserve(&o.s->kv, &o.s->engine->kv_geom, o.s->n_layers, PROMPT, rows));
    const int32_t* after = tokens + PROMPT;
    if (how == BUILD_SPLIT) {
        const tl_part base = {.depth = Ld, .state_out = o.states, .inject_out = o.injects,
                              .loop_states = o.loop_states};
        CHECK_OK(tl_forward_part(o.s, after, rows, PROMPT, &base));
        const tl_part extend = {.first_iter = Ld, .depth = L, .state_in = o.states, .inject_in = o.injects,
                                .state_out = o.kept, .hidden_all = o.hidden, .logits_last = o.logits,
                                .loop_states = o.loop_states};
        CHECK_OK(tl_forward_part(o.s, NULL, rows, PROMPT, &extend));
        return o;
    }
    const size_t T = how == DRAFT_ROWS ? 1 : rows;
    for (size_t i = 0; i < rows; i += T) {
        const tl_part draft = {.depth = Ld, .coda_depth = L, .state_out = o.states + i * d,
                               .inject_out = o.injects + i * d, .logits_last = o.drafts + i * V};
        CHECK_OK(tl_forward_part(o.s, after + i, T, PROMPT + i, &draft));
    }
    const tl_part verify = {.first_iter = Ld, .depth = L, .state_in = o.states, .inject_in = o.injects,
                            .hidden_all = o.hidden, .logits_all = o.logits};
    CHECK_OK(tl_forward_part(o.s, NULL, rows, PROMPT, &verify));
    return o;
}

static void free_split(split* o) {
    tl_seq_free(o->s);
    free(o->states), free(o->injects), free(o->drafts), free(o->hidden), free(o->logits), free(o->loop_states);
    free(o->kept);
}

static void check_split(const pair* p, uint32_t L, uint32_t Ld, size_t rows, int how) {
    static const char* hows[] = {"drafts row by row", "drafts as a chunk", "a build split"};
    split a = run_split(p->cpu, p, L, Ld, rows, how), b = run_split(p->cuda, p, L, Ld, rows, how);
    const size_t d = p->d, V = p->V;
    const struct {
        const char* what;
        const float *x, *y;
        size_t n;
    } out[] = {{"kept states", a.states, b.states, rows * d},  {"injected terms", a.injects, b.injects, rows * d},
               {"draft logits", a.drafts, b.drafts, rows * V}, {"final states", a.hidden, b.hidden, rows * d},
               {"logits", a.logits, b.logits, rows * V},       {"loop states", a.loop_states, b.loop_states, L * d},
               {"extension's kept states", a.kept, b.kept, rows * d}};
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++)
        CHECK(tu_same_bits(out[i].x, out[i].y, out[i].n), "%s, L=%u L_d=%u, %zu rows, %s: %s differ from the CPU's",
              p->name, L, Ld, rows, hows[how], out[i].what);
    mirror kv = mirror_of(b.s);
    CHECK(tu_same_seq_kv(a.s, &kv.s, 0, PROMPT + rows, 1), "%s, L=%u L_d=%u, %zu rows, %s: KV differs from the "
          "CPU's", p->name, L, Ld, rows, hows[how]);
    free_mirror(&kv);
    free_split(&a);
    free_split(&b);
}

/* Each way of splitting, at a few depths (each pass costs seconds on the emulated device). */
static void part_passes(const pair* p) {
    check_split(p, 3, 1, 4, DRAFT_ROWS);
    check_split(p, 3, 2, 4, DRAFT_CHUNK);
    check_split(p, 2, 1, 4, BUILD_SPLIT);
    check_split(p, 3, 1, MAX_ROWS, DRAFT_CHUNK); /* more rows than a graph or a GEMV takes */
    check_split(p, 3, 2, MAX_ROWS, BUILD_SPLIT);
}

/* ---- through the public API ------------------------------------------------------------------ */

/* A speculative request on CUDA against plain decoding on the CPU, and against itself on the
 * CPU: the same tokens, logits and draft counters. */
static void check_speculative(const pair* p, uint32_t L, uint32_t Ld, uint32_t K, int sampled) {
    tl_gen_params gp = tu_gen_params(MAX_NEW, L, 0, sampled, 5);
    tu_result plain = tu_generate(p->cpu, tokens, PROMPT, &gp, p->V);
    gp.draft_loops = Ld;
    gp.n_draft = K;
    tl_draft_stats on_cpu = {0, 0}, on_cuda = {0, 0};
    gp.draft_stats = &on_cpu;
    tu_result cpu = tu_generate(p->cpu, tokens, PROMPT, &gp, p->V);
    gp.draft_stats = &on_cuda;
    tu_result cuda = tu_generate(p->cuda, tokens, PROMPT, &gp, p->V);
    CHECK(tu_same_result(&cuda, &plain), "%s, L=%u L_d=%u K=%u: CUDA's speculative generation differs from plain "
          "decoding on the CPU", p->name, L, Ld, K);
    CHECK(tu_same_result(&cpu, &plain), "%s: the CPU's speculative generation differs from its plain one", p->name);
    CHECK(on_cuda.drafted == on_cpu.drafted && on_cuda.accepted == on_cpu.accepted,
          "%s, L=%u L_d=%u K=%u: CUDA drafted %zu and accepted %zu, the CPU %zu and %zu", p->name, L, Ld, K,
          on_cuda.drafted, on_cuda.accepted, on_cpu.drafted, on_cpu.accepted);
    CHECK(cuda.n < 2 || on_cuda.drafted > 0, "%s: %zu tokens on CUDA and nothing drafted: decoded plainly", p->name,
          cuda.n);
    total_drafted += on_cuda.drafted;
    total_accepted += on_cuda.accepted;
    tu_result_free(&plain);
    tu_result_free(&cpu);
    tu_result_free(&cuda);
}

/* tl_generate_batch on CUDA: two speculative requests beside a plain one, each the CPU's plain
 * generation of it alone. */
static void check_batch(const pair* p) {
    enum { B = 3 };
    tl_gen_params gp[B] = {tu_gen_params(MAX_NEW, 3, 0, 0, 1), tu_gen_params(MAX_NEW, 2, 0, 1, 2),
                           tu_gen_params(MAX_NEW, 3, 0, 1, 3)};
    tl_request req[B];
    tl_request* ptrs[B];
    tu_result want[B], got[B];
    for (int i = 0; i < B; i++) {
        want[i] = tu_generate(p->cpu, tokens + i, PROMPT - i, &gp[i], p->V);
        gp[i].draft_loops = i == 2 ? 0 : 1;
        gp[i].n_draft = i == 2 ? 0 : 3;
        got[i] = tu_result_new(MAX_NEW, p->V);
        req[i] = (tl_request){sizeof req[i], NULL, tokens + i, PROMPT - i, &gp[i], got[i].tokens, got[i].logits, 0};
        ptrs[i] = &req[i];
    }
    CHECK_OK(tl_generate_batch(p->cuda, ptrs, B));
    for (int i = 0; i < B; i++) {
        got[i].n = req[i].n_out;
        CHECK(tu_same_result(&got[i], &want[i]), "%s: batch request %d on CUDA differs from plain decoding on the "
              "CPU", p->name, i);
        tu_result_free(&want[i]);
        tu_result_free(&got[i]);
    }
}

/* An instruction block (docs/spec.md §4.1) on CUDA: generations in prefill chunks smaller than
 * the block (one grown chunk, then one position a chunk), windowed or not, and from a prefix
 * built with the block, each the CPU's. */
static void check_instruction(const pair* p) {
    enum { P = 7 };
    for (uint32_t window = 0; window <= 3; window += 3) {
        tl_gen_params gp = tu_gen_params(MAX_NEW, 2, window, 1, 5);
        gp.instruction_length = P;
        gp.prefill_chunk = 1;
        tu_result want = tu_generate(p->cpu, tokens, PROMPT, &gp, p->V);
        tu_result got = tu_generate(p->cuda, tokens, PROMPT, &gp, p->V);
        CHECK(tu_same_result(&got, &want), "%s: P=%d, window %u: CUDA differs from the CPU", p->name, P, window);
        tu_result_free(&got);
        tl_prefix* x = NULL;
        CHECK_OK(tl_prefix_build_instruction(p->cuda, tokens, PROMPT - 2, P, 2, window, 2, 0, &x));
        gp.instruction_length = 0;
        got = tu_from_prefix(x, tokens + PROMPT - 2, 2, &gp, p->V);
        CHECK(tu_same_result(&got, &want), "%s: P=%d, window %u: from a CUDA prefix", p->name, P, window);
        tl_prefix_free(x);
        tu_result_free(&got);
        tu_result_free(&want);
    }
}

static size_t nbytes_of(const tl_prefix* x) {
    size_t n;
    tl_prefix_info(x, NULL, NULL, NULL, &n);
    return n;
}

/* A warm-start prefix built at L_b on each backend and extended to L (through `mid` when it is
 * between): the same blob, the blob of one built at L, and the same generations. */
static void check_warm(const pair* p, uint32_t Lb, uint32_t mid, uint32_t L, uint32_t window) {
    tl_prefix *warm[2], *built = NULL;
    tl_model* ms[2] = {p->cpu, p->cuda};
    for (int i = 0; i < 2; i++)
        CHECK_OK(tl_prefix_build_ex(ms[i], tokens, PROMPT + 6, Lb, window, i ? 0 : 3, TL_PREFIX_WARM_START, &warm[i]));
    CHECK(nbytes_of(warm[1]) == nbytes_of(warm[0]), "%s: a warm-start prefix holds %zu bytes on CUDA, %zu on the "
          "CPU (its states?)", p->name, nbytes_of(warm[1]), nbytes_of(warm[0]));
    for (int i = 0; i < 2; i++) {
        if (mid > Lb) CHECK_OK(tl_prefix_extend(warm[i], mid, i ? 8 : 0));
        CHECK_OK(tl_prefix_extend(warm[i], L, i ? 0 : 4));
    }
    CHECK_OK(tl_prefix_build_ex(p->cuda, tokens, PROMPT + 6, L, window, 0, TL_PREFIX_WARM_START, &built));
    tu_blob a = tu_save(warm[0]), b = tu_save(warm[1]), c = tu_save(built);
    CHECK(tu_same_blob(a, b), "%s, L_b=%u -> %u -> %u, window %u: the extended prefix's blob on CUDA differs from "
          "the CPU's", p->name, Lb, mid, L, window);
    CHECK(tu_same_blob(b, c), "%s, L_b=%u -> %u, window %u: an extended prefix on CUDA is not the one built at its "
          "depth", p->name, Lb, L, window);
    for (uint32_t loops = 1; loops <= L; loops += L - 1) {
        const tl_gen_params gp = tu_gen_params(6, loops, window, 1, 9);
        tu_result x = tu_from_prefix(warm[0], tokens + 1, 3, &gp, p->V);
        tu_result y = tu_from_prefix(warm[1], tokens + 1, 3, &gp, p->V);
        CHECK(tu_same_result(&x, &y), "%s: generations at depth %u from the extended prefix differ", p->name, loops);
        tu_result_free(&x);
        tu_result_free(&y);
    }
    free(a.bytes), free(b.bytes), free(c.bytes);
    tl_prefix_free(warm[0]);
    tl_prefix_free(warm[1]);
    tl_prefix_free(built);
}

/* Decode steps inside one KV block, after a first one grew the sequence's scratch: no host
 * allocation (the pass's arrays live in the scratch; docs/c-api.md). */
static void check_no_allocation(const pair* p) {
    tl_seq* s = NULL;
    float* logits = malloc(p->V * sizeof(float));
    CHECK_OK(tl_seq_create(p->cuda, 3, 0, &s));
    CHECK_OK(tl_seq_prefill(s, tokens, 2 * BLOCK + 1, 0, NULL));
    CHECK_OK(tl_seq_decode(s, tokens[0], logits));
    const size_t before = tu_memory().total_allocs;
    CHECK_OK(tl_seq_decode(s, tokens[1], logits));
    CHECK_OK(tl_seq_decode(s, tokens[2], logits));
    const size_t made = tu_memory().total_allocs - before;
    CHECK(made == 0, "%s: two decode steps on CUDA made %zu host allocations", p->name, made);
    tl_seq_free(s);
    free(logits);
}

enum { PARTS = 1, SPECULATE = 2, BATCH = 4, WARM = 8, ALLOCATIONS = 16 };

/* The checks `which` names on one model, opened on both devices. */
static void test_model(const char* name, const tu_spec* spec, tl_kv_mode kv_mode, int which) {
    pair p = open_pair(name, spec, kv_mode);
    tl_engine* e = NULL;
    if (p.cuda) CHECK_OK(tl_model_acquire(p.cuda, &e));
    if (e) CHECK(tl_has_part_pass(e), "%s: the CUDA backend has no part pass", name);
    if (p.cpu && e) {
        if ((which & PARTS) && tl_has_part_pass(e)) part_passes(&p);
        if (which & SPECULATE) {
            check_speculative(&p, 3, 1, 4, 0);
            check_speculative(&p, 3, 2, 2, 1);
        }
        if (which & BATCH) check_batch(&p);
        if (which & BATCH) check_instruction(&p);
        if (which & WARM) check_warm(&p, 1, 0, 3, 0);
        if (which & WARM) check_warm(&p, 1, 2, 3, 6);
        if (which & ALLOCATIONS) check_no_allocation(&p);
    }
    if (e) tl_engine_unref(e);
    close_pair(&p);
}

int main(void) {
    if (tl_device_check(TL_DEVICE_CUDA) != TL_OK) {
        printf("test_cuda_part: skipped (%s)\n", tl_last_error());
        return tu_finish("test_cuda_part");
    }
    uint64_t rng = 11;
    for (size_t i = 0; i < PROMPT + MAX_ROWS; i++) drawn[i] = tu_uniform(&rng, 0, 255);
    tu_spec plain = tu_spec_default();
    tu_spec huginn = tu_spec_huginn();
    tu_spec coda = tu_spec_coda();
    tu_spec tiny = tu_spec_default(); /* 5 ids: drafts often agree */
    tiny.vocab = 5;
    test_model("cuda-part-plain.tinyloop", &plain, TL_KV_INT8, PARTS | SPECULATE | WARM);
    test_model("cuda-part-huginn.tinyloop", &huginn, TL_KV_INT8, PARTS | SPECULATE | BATCH | WARM | ALLOCATIONS);
    test_model("cuda-part-huginn-int4.tinyloop", &huginn, TL_KV_INT4, PARTS | SPECULATE);
    test_model("cuda-part-coda.tinyloop", &coda, TL_KV_INT8, PARTS | WARM);
    test_model("cuda-part-tiny.tinyloop", &tiny, TL_KV_INT8, SPECULATE | BATCH);
    tu_spec hrm = tu_spec_hrm(), hrm4 = tu_spec_hrm(); /* a two-state core, the attention gate */
    hrm4.int4 = 1, hrm4.group_size = 16, hrm4.qkv_bias = 1, hrm4.layout = 2;
    test_model("cuda-part-hrm.tinyloop", &hrm, TL_KV_INT8, PARTS | SPECULATE | BATCH | WARM);
    test_model("cuda-part-hrm-int4.tinyloop", &hrm4, TL_KV_INT4, PARTS | SPECULATE | WARM);
    tu_spec loop = tu_spec_loop(), loop4 = tu_spec_loop(); /* loop attention */
    loop4.int4 = 1, loop4.group_size = 16, loop4.qkv_bias = 1, loop4.layout = 1;
    test_model("cuda-part-loop.tinyloop", &loop, TL_KV_INT8, PARTS | SPECULATE | BATCH | WARM);
    test_model("cuda-part-loop-int4.tinyloop", &loop4, TL_KV_INT4, PARTS | SPECULATE | WARM);
    tu_spec blocks = tu_spec_huginn(), blocks4 = loop4; /* block activations */
    blocks.version = 3, blocks.act_block = 4, blocks4.act_block = 16;
    test_model("cuda-part-act-block.tinyloop", &blocks, TL_KV_INT8, PARTS | SPECULATE | BATCH | WARM);
    test_model("cuda-part-act-block-int4.tinyloop", &blocks4, TL_KV_INT4, PARTS | SPECULATE);
    CHECK(total_accepted > 0, "no draft was ever accepted on CUDA (drafted %zu): the test proves little",
          total_drafted);
    printf("test_cuda_part: drafted %zu, accepted %zu on CUDA\n", total_drafted, total_accepted);
    return tu_finish("test_cuda_part");
}
