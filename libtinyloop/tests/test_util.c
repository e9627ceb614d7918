/* test_util.c — see test_util.h. */
#include "test_util.h"

#include <math.h>
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
    tu_spec s = {256, 48, 4, 2, 12, 80, 1, 3, 96, 0, 0, 0, -1, 1};
    return s;
}

/* ---- file writer ---------------------------------------------------------------------- */

typedef struct tensor {
    char name[48];
    uint32_t dtype, ndim;
    uint64_t dims[2];
    uint64_t offset, nbytes;
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

static void add(tensor* t, size_t* n, const char* name, uint32_t dtype, uint64_t d0, uint64_t d1) {
    tensor* x = &t[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->dtype = dtype;
    x->ndim = d1 ? 2 : 1;
    x->dims[0] = d0;
    x->dims[1] = d1;
    x->nbytes = d0 * (d1 ? d1 : 1) * (dtype == 1 ? 4 : 1);
}

/* Row scale making a linear's output roughly unit-variance (times `gain`). */
static float row_scale(const tu_spec* s, uint32_t K, float gain) {
    const float w_std = s->int4 ? 4.6f * 128.0f : 73.0f;
    return gain / (w_std * sqrtf((float)K));
}

static void fill_linear(const tu_spec* s, uint8_t* data, tensor* t, size_t* i, uint32_t R, uint32_t K,
                        float gain, uint64_t* rng) {
    tensor* w = &t[(*i)++];
    for (uint64_t k = 0; k < w->nbytes; k++)
        data[w->offset + k] = s->int4 ? (uint8_t)tu_uniform(rng, 0, 255) : (uint8_t)(int8_t)tu_uniform(rng, -127, 127);
    if (s->int4) {
        tensor* m = &t[(*i)++];
        for (uint64_t k = 0; k < m->nbytes; k++) data[m->offset + k] = (uint8_t)tu_uniform(rng, 1, 255);
    }
    tensor* sc = &t[(*i)++];
    for (uint32_t r = 0; r < R; r++)
        putf(data + sc->offset + 4 * r, row_scale(s, K, gain) * (0.75f + 0.5f * (float)(tu_next(rng) >> 40) / 16777216.0f));
}

uint8_t* tu_model_bytes(const tu_spec* s, size_t* n_out) {
    const uint32_t V = s->vocab, d = s->d, H = s->heads, G = s->kv_heads, D = s->head_dim, F = s->ffn;
    const uint32_t blocks = s->n_pre + 1;
    tensor* t = calloc(4 + 3 * (4 * blocks + 1), sizeof *t);
    size_t n = 0;
    char name[48];
    add(t, &n, "tok_emb.w", 2, V, d);
    add(t, &n, "tok_emb.s", 1, V, 0);
    add(t, &n, "rope.cos", 1, s->max_seq, D / 2);
    add(t, &n, "rope.sin", 1, s->max_seq, D / 2);
    const char* parts[4] = {"attn_qkv", "attn_out", "ffn_gate_up", "ffn_down"};
    const uint32_t Rs[4] = {(H + 2 * G) * D, d, 2 * F, d}, Ks[4] = {d, H * D, d, F};
    for (uint32_t b = 0; b <= blocks; b++) {
        const int head = b == blocks;
        if (head && s->tied) break;
        for (int p = 0; p < (head ? 1 : 4); p++) {
            char prefix[40];
            if (head) snprintf(prefix, sizeof prefix, "head");
            else if (b < s->n_pre) snprintf(prefix, sizeof prefix, "pre.%u.%s", b, parts[p]);
            else snprintf(prefix, sizeof prefix, "loop.%s", parts[p]);
            const uint32_t R = head ? V : Rs[p], K = head ? d : Ks[p];
            snprintf(name, sizeof name, "%s.w", prefix);
            add(t, &n, name, s->int4 ? 3 : 2, R, s->int4 ? K / 2 : K);
            if (s->int4) {
                snprintf(name, sizeof name, "%s.m", prefix);
                add(t, &n, name, 3, R, K / s->group_size);
            }
            snprintf(name, sizeof name, "%s.s", prefix);
            add(t, &n, name, 1, R, 0);
        }
    }
    const uint64_t data_offset = (256 + 96 * n + 63) / 64 * 64;
    uint64_t end = data_offset;
    for (size_t i = 0; i < n; i++) {
        t[i].offset = (end + 63) / 64 * 64;
        end = t[i].offset + t[i].nbytes;
    }
    uint8_t* f = calloc(1, end);
    memcpy(f, "TINYLOOP", 8);
    put32(f + 8, 1);
    put32(f + 12, 256);
    put64(f + 16, end);
    put32(f + 28, (uint32_t)n);
    put64(f + 32, 256);
    put64(f + 40, data_offset);
    const uint32_t cfg[12] = {V, d, H, G, D, F, s->n_pre, s->loops, s->max_seq, s->int4 ? 2 : 1,
                              s->int4 ? s->group_size : 0, s->tied};
    for (int i = 0; i < 12; i++) put32(f + 48 + 4 * i, cfg[i]);
    put32(f + 96, (uint32_t)-1);
    put32(f + 100, (uint32_t)s->eos);
    put32(f + 104, V >= 256 ? 1 : 0);
    putf(f + 108, 10000.0f);
    putf(f + 112, 1e-5f);
    memcpy(f + 120, "c-test-model", 12);
    for (size_t i = 0; i < n; i++) {
        uint8_t* e = f + 256 + 96 * i;
        memcpy(e, t[i].name, strlen(t[i].name));
        put32(e + 48, t[i].dtype);
        put32(e + 52, t[i].ndim);
        put64(e + 56, t[i].dims[0]);
        put64(e + 64, t[i].ndim > 1 ? t[i].dims[1] : 0);
        put64(e + 88, t[i].offset);
    }
    uint64_t rng = s->seed;
    size_t i = 0;
    for (uint64_t k = 0; k < t[0].nbytes; k++) f[t[0].offset + k] = (uint8_t)(int8_t)tu_uniform(&rng, -127, 127);
    for (uint32_t v = 0; v < V; v++) putf(f + t[1].offset + 4 * v, (0.8f + 0.4f * (float)(tu_next(&rng) >> 40) / 16777216.0f) / 73.0f);
    for (uint32_t p = 0; p < s->max_seq; p++)
        for (uint32_t j = 0; j < D / 2; j++) {
            const double angle = p * pow(10000.0, -2.0 * j / D);
            putf(f + t[2].offset + 4 * ((uint64_t)p * (D / 2) + j), (float)cos(angle));
            putf(f + t[3].offset + 4 * ((uint64_t)p * (D / 2) + j), (float)sin(angle));
        }
    i = 4;
    for (uint32_t b = 0; b < blocks; b++) {
        const float gains[4] = {1.0f, 0.5f, 1.0f, 0.5f};
        for (int p = 0; p < 4; p++) fill_linear(s, f, t, &i, Rs[p], Ks[p], gains[p], &rng);
    }
    if (!s->tied) fill_linear(s, f, t, &i, V, d, 3.0f, &rng);
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

tl_model* tu_open(const char* path, uint32_t threads, tl_isa isa, uint32_t block_size) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = threads;
    p.isa = isa;
    p.kv_block_size = block_size;
    tl_model* m = NULL;
    tl_status st = tl_model_open(path, &p, &m);
    CHECK(st == TL_OK, "tl_model_open(%s): %s", path, tl_last_error());
    return m;
}

int tu_same_bits(const float* a, const float* b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }
