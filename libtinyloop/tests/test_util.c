/* test_util.c — see test_util.h. */
#include "test_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int tu_failures;

enum { MAX_FILES = 64 };
static char written[MAX_FILES][512];
static int n_written;

int tu_finish(const char* test_name) {
    for (int i = 0; i < n_written; i++) unlink(written[i]);
    n_written = 0;
    if (tu_failures) fprintf(stderr, "%s: %d check(s) FAILED\n", test_name, tu_failures);
    else printf("%s: all checks passed\n", test_name);
    return tu_failures ? 1 : 0;
}

uint64_t tu_next(uint64_t* s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int32_t tu_uniform(uint64_t* s, int32_t lo, int32_t hi) {
    return lo + (int32_t)(tu_next(s) % (uint64_t)(hi - lo + 1));
}

uint32_t tu_crc32(const uint8_t* p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
    }
    return ~c;
}

tu_spec tu_spec_default(void) {
    tu_spec s = {.vocab = 256, .d = 48, .heads = 4, .kv_heads = 2, .head_dim = 12, .ffn = 80,
                 .n_pre = 1, .loops = 3, .max_seq = 96, .eos = -1, .seed = 1,
                 .version = 2, .n_core = 1, .embed_scale = 1.0f};
    return s;
}

tu_spec tu_spec_rich(void) {
    tu_spec s = tu_spec_default();
    s.n_core = 2, s.n_coda = 1, s.layout = 1, s.qkv_bias = 1, s.injection = 1, s.step_norm = 1;
    s.coda_norm = 1, s.embed_scale = 2.0f, s.hf = 1, s.meta = 1;
    return s;
}

tu_spec tu_spec_huginn(void) {
    tu_spec s = tu_spec_rich();
    s.hf = 0, s.meta = 0;
    return s;
}

tu_spec tu_spec_coda(void) {
    tu_spec s = tu_spec_default();
    s.n_coda = 1, s.n_pre = 0;
    return s;
}

tu_spec tu_spec_hrm(void) {
    tu_spec s = tu_spec_default();
    s.version = 3, s.n_core = 4, s.core_cycles = 2, s.attn_gate = 1, s.n_coda = 1, s.embed_scale = 1.5f;
    return s;
}

tu_spec tu_spec_loop(void) {
    tu_spec s = tu_spec_default();
    s.version = 3, s.n_core = 2, s.loop_window = 3, s.n_coda = 1;
    return s;
}

uint32_t tu_core_width(uint32_t k, uint32_t cycles) { return cycles ? (cycles + 1) * (k / 2) : k; }

/* ---- file writer ---------------------------------------------------------------------- */

/* What a tensor holds, which says how it is filled. */
typedef enum kind {
    K_EMB_W, K_EMB_S, K_ROPE_COS, K_ROPE_SIN, K_WEIGHTS, K_MULT, K_SCALE, K_BIAS, K_GAIN, K_TEXT
} kind;

typedef struct tensor {
    char name[48];
    uint32_t dtype, ndim;
    uint64_t dims[2];
    uint64_t offset, nbytes;
    kind kind;
    uint32_t K;         /* K_SCALE: the linear's inputs                                  */
    float gain;         /* K_SCALE: the output's rough standard deviation                */
    const char* text;   /* K_TEXT                                                         */
} tensor;

static void put32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t* p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void putf(uint8_t* p, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put32(p, u);
}

static tensor* add(tensor* t, size_t* n, const char* name, kind k, uint32_t dtype, uint64_t d0, uint64_t d1) {
    tensor* x = &t[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->kind = k;
    x->dtype = dtype;
    x->ndim = d1 ? 2 : 1;
    x->dims[0] = d0;
    x->dims[1] = d1;
    x->nbytes = d0 * (d1 ? d1 : 1) * (dtype == 1 ? 4 : 1);
    return x;
}

/* Linear `prefix`, y[R] from x[K], its output of rough standard deviation `gain`. */
static void add_linear(const tu_spec* s, tensor* t, size_t* n, const char* prefix, uint32_t R, uint32_t K,
                       float gain) {
    char name[48];
    snprintf(name, sizeof name, "%s.w", prefix);
    add(t, n, name, K_WEIGHTS, s->int4 ? 3 : 2, R, s->int4 ? K / 2 : K);
    if (s->int4) {
        snprintf(name, sizeof name, "%s.m", prefix);
        add(t, n, name, K_MULT, 3, R, K / s->group_size);
    }
    snprintf(name, sizeof name, "%s.s", prefix);
    tensor* sc = add(t, n, name, K_SCALE, 1, R, 0);
    sc->K = K;
    sc->gain = gain;
}

static void add_f32(tensor* t, size_t* n, kind k, uint64_t len, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void add_f32(tensor* t, size_t* n, kind k, uint64_t len, const char* fmt, ...) {
    char name[48];
    va_list args;
    va_start(args, fmt);
    vsnprintf(name, sizeof name, fmt, args);
    va_end(args);
    add(t, n, name, k, 1, len, 0);
}

static void add_text(tensor* t, size_t* n, const char* name, const char* text) {
    add(t, n, name, K_TEXT, 3, strlen(text), 0)->text = text;
}

/* The tensors of docs/spec.md §6.3 in the required order (version 1: the core block is
 * `loop`); returns the count. */
static size_t layout(const tu_spec* s, tensor* t) {
    const uint32_t V = s->vocab, d = s->d, H = s->heads, G = s->kv_heads, D = s->head_dim, F = s->ffn;
    const uint32_t QKV = (H * (s->attn_gate ? 2 : 1) + 2 * G) * D; /* the gate's rows last */
    const int post = s->layout != 0;
    size_t n = 0;
    add(t, &n, "tok_emb.w", K_EMB_W, 2, V, d);
    add(t, &n, "tok_emb.s", K_EMB_S, 1, V, 0);
    add(t, &n, "rope.cos", K_ROPE_COS, 1, s->max_seq, D / 2);
    add(t, &n, "rope.sin", K_ROPE_SIN, 1, s->max_seq, D / 2);
    for (uint32_t b = 0; b < s->n_pre + s->n_core + s->n_coda; b++) {
        char p[16], name[48];
        if (b < s->n_pre) snprintf(p, sizeof p, "pre.%u", b);
        else if (s->version == 1) snprintf(p, sizeof p, "loop");
        else if (b < s->n_pre + s->n_core) snprintf(p, sizeof p, "core.%u", b - s->n_pre);
        else snprintf(p, sizeof p, "coda.%u", b - s->n_pre - s->n_core);
        snprintf(name, sizeof name, "%s.attn_qkv", p);
        add_linear(s, t, &n, name, QKV, d, 1.0f);
        if (s->qkv_bias) add_f32(t, &n, K_BIAS, QKV, "%s.attn_qkv.b", p);
        snprintf(name, sizeof name, "%s.attn_out", p);
        add_linear(s, t, &n, name, d, H * D, 0.5f);
        if (post) add_f32(t, &n, K_GAIN, d, "%s.attn_post_norm", p);
        snprintf(name, sizeof name, "%s.ffn_gate_up", p);
        add_linear(s, t, &n, name, 2 * F, d, 1.0f);
        snprintf(name, sizeof name, "%s.ffn_down", p);
        add_linear(s, t, &n, name, d, F, 0.5f);
        if (post) add_f32(t, &n, K_GAIN, d, "%s.ffn_post_norm", p);
        if (s->loop_window && b >= s->n_pre && b < s->n_pre + s->n_core) { /* int8 whatever the format */
            snprintf(name, sizeof name, "%s.loop_gate.w", p);
            add(t, &n, name, K_EMB_W, 2, H, D);
            add_f32(t, &n, K_EMB_S, H, "%s.loop_gate.s", p);
            add_f32(t, &n, K_BIAS, H, "%s.loop_gate.b", p);
        }
    }
    if (s->injection) {
        add_linear(s, t, &n, "core.adapter_state", d, d, 0.7f);
        add_linear(s, t, &n, "core.adapter_inject", d, d, 0.7f);
    }
    if (s->step_norm) add_f32(t, &n, K_GAIN, d, "core.step_norm");
    if (s->coda_norm) add_f32(t, &n, K_GAIN, d, "coda.input_norm");
    if (!s->tied) add_linear(s, t, &n, "head", V, d, 3.0f);
    if (s->exit_gate) { /* int8 whatever the weight format: one row, its scale and bias */
        add(t, &n, "exit_gate.w", K_EMB_W, 2, 1, d);
        add(t, &n, "exit_gate.s", K_EMB_S, 1, 1, 0);
        add(t, &n, "exit_gate.b", K_BIAS, 1, 1, 0);
    }
    if (s->meta) {
        add_text(t, &n, "meta.architecture", "TinyLoopTestForCausalLM");
        add_text(t, &n, "meta.tokenizer_config", "{\"add_bos_token\": false}");
    }
    if (s->hf) add_text(t, &n, "meta.tokenizer_json", "{\"model\": {\"vocab\": {\"caf\xc3\xa9\": 0}}}");
    return n;
}

/* Row scale making a linear's output roughly unit-variance (times `gain`). */
static float row_scale(const tu_spec* s, uint32_t K, float gain) {
    const float w_std = s->int4 ? 4.6f * 128.0f : 73.0f;
    return gain / (w_std * sqrtf((float)K));
}

static float uniform01(uint64_t* rng) { return (float)(tu_next(rng) >> 40) / 16777216.0f; }

/* Tensor x's values at data + x->offset. */
static void fill(const tu_spec* s, uint8_t* data, const tensor* x, uint64_t* rng) {
    uint8_t* p = data + x->offset;
    const uint32_t half = s->head_dim / 2;
    switch (x->kind) {
    case K_EMB_W:
        for (uint64_t k = 0; k < x->nbytes; k++) p[k] = (uint8_t)(int8_t)tu_uniform(rng, -127, 127);
        break;
    case K_EMB_S:
        for (uint64_t v = 0; v < x->dims[0]; v++) putf(p + 4 * v, (0.8f + 0.4f * uniform01(rng)) / 73.0f);
        break;
    case K_ROPE_COS:
    case K_ROPE_SIN:
        for (uint32_t pos = 0; pos < s->max_seq; pos++)
            for (uint32_t j = 0; j < half; j++) {
                const double angle = pos * pow(10000.0, -2.0 * j / s->head_dim);
                putf(p + 4 * ((uint64_t)pos * half + j), (float)(x->kind == K_ROPE_COS ? cos(angle) : sin(angle)));
            }
        break;
    case K_WEIGHTS:
        for (uint64_t k = 0; k < x->nbytes; k++)
            p[k] = s->int4 ? (uint8_t)tu_uniform(rng, 0, 255) : (uint8_t)(int8_t)tu_uniform(rng, -127, 127);
        break;
    case K_MULT:
        for (uint64_t k = 0; k < x->nbytes; k++) p[k] = (uint8_t)tu_uniform(rng, 1, 255);
        break;
    case K_SCALE:
        for (uint64_t r = 0; r < x->dims[0]; r++)
            putf(p + 4 * r, row_scale(s, x->K, x->gain) * (0.75f + 0.5f * uniform01(rng)));
        break;
    case K_BIAS:
        for (uint64_t r = 0; r < x->dims[0]; r++) putf(p + 4 * r, 0.5f * uniform01(rng) - 0.25f);
        break;
    case K_GAIN:
        for (uint64_t r = 0; r < x->dims[0]; r++) putf(p + 4 * r, 0.5f + uniform01(rng));
        break;
    case K_TEXT: memcpy(p, x->text, x->nbytes); break;
    }
}

uint8_t* tu_model_bytes(const tu_spec* s, size_t* n_out) {
    if (s->version == 1 && (s->n_core != 1 || s->n_coda || s->layout || s->qkv_bias || s->injection ||
                            s->step_norm || s->coda_norm || s->embed_scale != 1.0f || s->hf || s->meta)) {
        fprintf(stderr, "tu_model_bytes: version 1 has one core block and none of the version-2 options\n");
        exit(2);
    }
    if ((s->exit_gate || s->core_cycles || s->attn_gate || s->loop_window || s->act_block) && s->version < 3) {
        fprintf(stderr, "tu_model_bytes: an exit gate, a two-state core, the attention gate, loop attention or "
                        "block activations need version 3\n");
        exit(2);
    }
    const uint32_t blocks = s->n_pre + s->n_core + s->n_coda;
    tensor* t = calloc(4 + 18 * (size_t)blocks + 6 + 2 + 3 + 3 + 3, sizeof *t);
    const size_t n = layout(s, t);
    const uint64_t data_offset = (256 + 96 * n + 63) / 64 * 64;
    uint64_t end = data_offset;
    for (size_t i = 0; i < n; i++) {
        t[i].offset = (end + 63) / 64 * 64;
        end = t[i].offset + t[i].nbytes;
    }
    uint8_t* f = calloc(1, end);
    memcpy(f, "TINYLOOP", 8);
    put32(f + 8, s->version);
    put32(f + 12, 256);
    put64(f + 16, end);
    put32(f + 28, (uint32_t)n);
    put64(f + 32, 256);
    put64(f + 40, data_offset);
    const uint32_t cfg[12] = {s->vocab, s->d, s->heads, s->kv_heads, s->head_dim, s->ffn, s->n_pre, s->loops,
                              s->max_seq, s->int4 ? 2 : 1, s->int4 ? s->group_size : 0, s->tied};
    for (int i = 0; i < 12; i++) put32(f + 48 + 4 * i, cfg[i]);
    put32(f + 96, (uint32_t)-1);
    put32(f + 100, (uint32_t)s->eos);
    put32(f + 104, s->hf ? 2 : s->vocab >= 256 ? 1 : 0);
    putf(f + 108, 10000.0f);
    putf(f + 112, 1e-5f);
    memcpy(f + 120, "c-test-model", 12);
    if (s->version >= 2) {
        const uint32_t v2[6] = {s->n_core, s->n_coda, s->layout, s->qkv_bias, s->injection, s->step_norm};
        for (int i = 0; i < 6; i++) put32(f + 184 + 4 * i, v2[i]);
        putf(f + 208, s->embed_scale);
        put32(f + 212, s->coda_norm);
    }
    if (s->version >= 3) {
        putf(f + 216, s->exit_threshold);
        put32(f + 220, s->core_cycles);
        put32(f + 224, s->attn_gate);
        put32(f + 228, s->loop_window);
        put32(f + 232, s->act_block);
    }
    uint64_t rng = s->seed;
    for (size_t i = 0; i < n; i++) {
        uint8_t* e = f + 256 + 96 * i;
        memcpy(e, t[i].name, strlen(t[i].name));
        put32(e + 48, t[i].dtype);
        put32(e + 52, t[i].ndim);
        put64(e + 56, t[i].dims[0]);
        put64(e + 64, t[i].ndim > 1 ? t[i].dims[1] : 0);
        put64(e + 88, t[i].offset);
        fill(s, f, &t[i], &rng);
    }
    free(t);
    tu_fix_checksum(f, end);
    *n_out = end;
    return f;
}

void tu_fix_checksum(uint8_t* bytes, size_t n) {
    if (n < 28) return;
    put32(bytes + 24, 0);
    put32(bytes + 24, tu_crc32(bytes, n));
}

static int mutated(tu_reader read, void* ctx, const uint8_t* x, size_t n, const char* what, size_t at) {
    uint8_t* copy = malloc(n ? n : 1);
    if (!copy) exit(2);
    memcpy(copy, x, n);
    const int accepted = read(ctx, copy, n, what, at);
    free(copy);
    return accepted;
}

int tu_mutate(tu_reader read, void* ctx, const uint8_t* bytes, size_t n, uint64_t seed, int damage) {
    uint8_t* x = malloc(n);
    if (!x) exit(2);
    int accepted = 0;
    for (size_t len = 0; len < n; len++) {
        memcpy(x, bytes, len);
        CHECK(!mutated(read, ctx, x, len, "truncation", len), "a truncation to %zu bytes was accepted", len);
        if (len < 96) continue;
        tu_put_u64(x + 16, len);
        tu_fix_checksum(x, len);
        CHECK(!mutated(read, ctx, x, len, "consistent truncation", len),
              "a consistent truncation to %zu bytes was accepted", len);
    }
    uint64_t rng = seed;
    for (size_t at = 0; at < n; at++) {
        memcpy(x, bytes, n);
        x[at] ^= (uint8_t)(1 + tu_next(&rng) % 255);
        CHECK(!mutated(read, ctx, x, n, "flip", at), "a flip at %zu was accepted without its checksum", at);
        if (at < 24 || at >= 28) {
            tu_fix_checksum(x, n);
            accepted += mutated(read, ctx, x, n, "flip with checksum", at);
        }
    }
    for (int k = 0; k < damage; k++) {
        memcpy(x, bytes, n);
        for (int j = 2 + (int)(tu_next(&rng) % 8); j > 0; j--) x[tu_next(&rng) % n] = (uint8_t)tu_next(&rng);
        tu_fix_checksum(x, n);
        accepted += mutated(read, ctx, x, n, "damage", (size_t)k);
    }
    free(x);
    return accepted;
}

void tu_set_field(uint8_t* bytes, const tu_field* f) {
    if (f->width == 8) tu_put_u64(bytes + f->at, f->value);
    else if (f->width == 4) tu_put_u32(bytes + f->at, (uint32_t)f->value);
    else bytes[f->at] = (uint8_t)f->value;
}

tu_blob tu_save(const tl_prefix* p) {
    tu_blob b = {NULL, 0};
    CHECK_OK(tl_prefix_save(p, NULL, 0, &b.n));
    b.bytes = malloc(b.n);
    if (!b.bytes) exit(2);
    size_t n = 0;
    CHECK_OK(tl_prefix_save(p, b.bytes, b.n, &n));
    CHECK(n == b.n, "save wrote %zu bytes, the size query said %zu", n, b.n);
    return b;
}

tl_prefix* tu_load(tl_model* m, tu_blob b) {
    tl_prefix* p = NULL;
    CHECK_OK(tl_prefix_load(m, b.bytes, b.n, &p));
    return p;
}

int tu_same_blob(tu_blob a, tu_blob b) { return a.n == b.n && memcmp(a.bytes, b.bytes, a.n) == 0; }

int tu_try_load(void* m, const uint8_t* bytes, size_t n, const char* what, size_t at) {
    tl_prefix* p = NULL;
    const tl_status st = tl_prefix_load(m, bytes, n, &p);
    CHECK(st == TL_OK || (st == TL_ERR_BAD_FILE && strstr(tl_last_error(), "bad prefix blob: ")),
          "%s at %zu: status %d (%s)", what, at, st, tl_last_error());
    CHECK((st == TL_OK) == (p != NULL), "%s at %zu: status %d with prefix %p", what, at, st, (void*)p);
    tl_prefix_free(p);
    return st == TL_OK;
}

uint32_t tu_get_u32(const uint8_t* p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
uint64_t tu_get_u64(const uint8_t* p) { return tu_get_u32(p) | (uint64_t)tu_get_u32(p + 4) << 32; }
void tu_put_u32(uint8_t* p, uint32_t v) { put32(p, v); }
void tu_put_u64(uint8_t* p, uint64_t v) { put64(p, v); }

const char* tu_write_file(const char* name, const uint8_t* bytes, size_t n) {
    const char* dir = getenv("TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/tltest-%d-%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
    int slot = 0;
    while (slot < n_written && strcmp(written[slot], path) != 0) slot++;
    if (slot == n_written) {
        if (n_written == MAX_FILES) {
            fprintf(stderr, "tu_write_file: too many files\n");
            exit(2);
        }
        snprintf(written[n_written++], sizeof written[0], "%s", path);
    }
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
    return written[slot];
}

const char* tu_write_model(const char* name, const tu_spec* spec) {
    size_t n;
    uint8_t* bytes = tu_model_bytes(spec, &n);
    const char* path = tu_write_file(name, bytes, n);
    free(bytes);
    return path;
}

float tu_spec_amax(const float* x, size_t n) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

float tu_spec_nq_scale(const int32_t* q, size_t n, float s, float eps) {
    int64_t ss = 0;
    for (size_t i = 0; i < n; i++) ss += (int64_t)q[i] * q[i];
    float t = (float)ss;
    t = t * s;
    t = t * s;
    t = t / (float)n;
    t = t + eps;
    return s / sqrtf(t);
}

tl_model* tu_open(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size) {
    return tu_open_kv(path, threads, isa, block_size, TL_KV_INT8);
}

tl_model* tu_open_kv(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size, tl_kv_mode kv) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = threads;
    p.isa = isa;
    p.kv_block_size = block_size;
    p.kv_mode = kv;
    tl_model* m = NULL;
    tl_status st = tl_model_open(path, &p, &m);
    CHECK(st == TL_OK, "tl_model_open(%s): %s", path, tl_last_error());
    return m;
}

tl_model* tu_open_cached(const char* path, size_t cache_bytes) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2;
    p.kv_block_size = 4;
    p.prefix_cache_bytes = cache_bytes;
    tl_model* m = NULL;
    tl_status st = tl_model_open(path, &p, &m);
    CHECK(st == TL_OK, "tl_model_open(%s): %s", path, tl_last_error());
    return m;
}

tl_prefix_cache_stats tu_cache_stats(tl_model* m) {
    tl_prefix_cache_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    CHECK_OK(tl_model_prefix_cache_stats(m, &s));
    return s;
}

tl_memory_stats tu_memory(void) {
    tl_memory_stats st = {.size = sizeof st};
    CHECK_OK(tl_memory_stats_get(&st));
    return st;
}

int tu_same_bits(const float* a, const float* b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }

/* ---- generations -------------------------------------------------------------------------- */

tu_result tu_result_new(size_t max_tokens, uint32_t vocab) {
    const size_t cells = max_tokens * vocab;
    tu_result r = {calloc(max_tokens, sizeof(int32_t)), calloc(cells, sizeof(float)), 0, vocab};
    if ((max_tokens && !r.tokens) || (cells && !r.logits)) {
        fprintf(stderr, "tu_result_new: out of memory for %zu tokens of %u logits\n", max_tokens, vocab);
        exit(2);
    }
    return r;
}

void tu_result_free(tu_result* r) {
    free(r->tokens);
    free(r->logits);
    *r = (tu_result){NULL, NULL, 0, 0};
}

tl_gen_params tu_gen_params(size_t max_tokens, uint32_t loops, uint32_t window, int sampled, uint64_t seed) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = max_tokens;
    gp.loops = loops;
    gp.cache_window = window;
    gp.temperature = sampled ? 0.9f : 0.0f;
    gp.seed = seed;
    gp.prefill_chunk = 2;
    return gp;
}

tu_result tu_generate(tl_model* m, const int32_t* prompt, size_t n, const tl_gen_params* gp, uint32_t vocab) {
    tu_result r = tu_result_new(gp->max_tokens, vocab);
    CHECK_OK(tl_generate(m, prompt, n, gp, r.tokens, &r.n, r.logits));
    return r;
}

int tu_batch_agrees(tl_model* m, const int32_t* prompt, const size_t* n, const tl_gen_params* const* gp, size_t count,
                    uint32_t vocab) {
    tu_result* got = calloc(count, sizeof *got);
    tl_request* reqs = calloc(count, sizeof *reqs);
    tl_request** ptrs = calloc(count, sizeof *ptrs);
    if (!got || !reqs || !ptrs) exit(2);
    for (size_t i = 0; i < count; i++) {
        got[i] = tu_result_new(gp[i]->max_tokens, vocab);
        reqs[i] = (tl_request){sizeof reqs[i], NULL, prompt, n[i], gp[i], got[i].tokens, got[i].logits, 0};
        ptrs[i] = &reqs[i];
    }
    CHECK_OK(tl_generate_batch(m, ptrs, count));
    int agree = 1;
    for (size_t i = 0; i < count; i++) {
        got[i].n = reqs[i].n_out;
        tu_result want = tu_generate(m, prompt, n[i], gp[i], vocab);
        agree = agree && tu_same_result(&want, &got[i]);
        tu_result_free(&want), tu_result_free(&got[i]);
    }
    free(got), free(reqs), free(ptrs);
    return agree;
}

tu_result tu_from_prefix(const tl_prefix* p, const int32_t* suffix, size_t n, const tl_gen_params* gp,
                         uint32_t vocab) {
    tu_result r = tu_result_new(gp->max_tokens, vocab);
    CHECK_OK(tl_generate_from_prefix(p, suffix, n, gp, r.tokens, &r.n, r.logits));
    return r;
}

int tu_same_result(const tu_result* a, const tu_result* b) {
    return a->n == b->n && a->n > 0 && a->vocab == b->vocab &&
           memcmp(a->tokens, b->tokens, a->n * sizeof(int32_t)) == 0 &&
           tu_same_bits(a->logits, b->logits, a->n * a->vocab);
}

int tu_sched_agrees(tl_model* m, const tl_sched_params* sp, const int32_t* prompt, const size_t* n,
                    const tl_gen_params* const* gp, size_t count, uint32_t vocab) {
    size_t cap = 1;
    for (size_t i = 0; i < count; i++) cap = gp[i]->max_tokens > cap ? gp[i]->max_tokens : cap;
    uint64_t* ids = calloc(count, sizeof *ids);
    int32_t* got = calloc(count * cap, sizeof *got);
    size_t* n_got = calloc(count, sizeof *n_got);
    if (!ids || !got || !n_got) exit(2);
    tl_sched* s = NULL;
    CHECK_OK(tl_sched_create(m, sp, &s));
    int agree = s != NULL;
    for (size_t i = 0; s && i < count; i++) CHECK_OK(tl_sched_add(s, prompt, n[i], gp[i], &ids[i]));
    if (s) tu_sched_drain(s, ids, count, got, cap, n_got, 200);
    for (size_t i = 0; s && i < count; i++) {
        tu_result want = tu_generate(m, prompt, n[i], gp[i], vocab);
        const int same = n_got[i] == want.n && !memcmp(got + i * cap, want.tokens, want.n * sizeof(int32_t));
        CHECK(same, "scheduled request %zu: %zu tokens, tl_generate %zu", i, n_got[i], want.n);
        agree = agree && same;
        tu_result_free(&want);
    }
    tl_sched_free(s);
    free(ids), free(got), free(n_got);
    return agree;
}

void tu_sched_drain(tl_sched* s, const uint64_t* ids, size_t n, int32_t* got, size_t cap, size_t* n_got,
                    int max_steps) {
    size_t finished = 0;
    for (int step = 0; step < max_steps && finished < n; step++) {
        uint64_t event_ids[8];
        int32_t tokens[8];
        uint8_t finish[8];
        size_t n_events = 0;
        CHECK_OK(tl_sched_step(s, event_ids, tokens, finish, 8, &n_events));
        for (size_t e = 0; e < n_events; e++)
            for (size_t i = 0; i < n; i++)
                if (event_ids[e] == ids[i] && n_got[i] < cap) {
                    got[i * cap + n_got[i]++] = tokens[e];
                    finished += finish[e] != TL_FINISH_NONE;
                }
    }
}
