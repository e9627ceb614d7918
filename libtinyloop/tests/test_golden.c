/* test_golden.c — reproduce the numpy reference bit for bit (vectors from make_golden.py).
 *
 * usage: test_golden GOLDEN_DIR
 * Runs every case of GOLDEN_DIR/manifest.txt on every kernel path this CPU has (scalar with
 * one thread and blocks of 16; each SIMD path with three threads and blocks of 4) and, where
 * a CUDA device is available (a GPU, or the emulated one of a TINYLOOP_CUDA_EMULATION build), on
 * it with blocks of 4 (only every n-th case of each model with TINYLOOP_GOLDEN_CUDA_EVERY=n: the
 * emulation is slow), and compares logits by bit pattern and tokens exactly; a hidden-state prefix (hprefix) also saves
 * numpy's blob byte for byte, and that blob loads and generates the same tokens. */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { MAX_FIELDS = 24 };

typedef struct fields {
    int n;
    char key[MAX_FIELDS][32];
    char value[MAX_FIELDS][256];
} fields;

static const char* golden_dir;

static const char* get(const fields* f, const char* key) {
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->key[i], key) == 0) return f->value[i];
    return NULL;
}

static uint64_t get_u64(const fields* f, const char* key) {
    const char* v = get(f, key);
    return v ? strtoull(v, NULL, 0) : 0;
}

static float get_f32(const fields* f, const char* key) {
    const uint32_t bits = (uint32_t)get_u64(f, key);
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Contents of a golden file (malloc'd); *n = bytes / elem. */
static void* load(const char* name, size_t elem, size_t* n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", golden_dir, name);
    FILE* f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    const long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    void* data = malloc(bytes ? (size_t)bytes : 1);
    if (fread(data, 1, (size_t)bytes, f) != (size_t)bytes) exit(2);
    fclose(f);
    *n = (size_t)bytes / elem;
    return data;
}

static tl_gen_params gen_params(const fields* f, int32_t** stops, size_t** lengths) {
    tl_gen_params gp = tl_gen_params_default();
    gp.max_tokens = get_u64(f, "max_tokens");
    gp.loops = (uint32_t)get_u64(f, "loops");
    gp.cache_window = (uint32_t)get_u64(f, "window");
    gp.temperature = get_f32(f, "temperature");
    gp.top_k = (int32_t)get_u64(f, "top_k");
    gp.top_p = get_f32(f, "top_p");
    gp.repetition_penalty = get_f32(f, "penalty");
    gp.seed = get_u64(f, "seed");
    gp.prefill_chunk = get_u64(f, "chunk");
    *stops = NULL;
    *lengths = NULL;
    if (get(f, "stops")) {
        size_t n_tokens;
        *stops = load(get(f, "stops"), sizeof(int32_t), &n_tokens);
        *lengths = calloc(MAX_FIELDS, sizeof(size_t));
        char list[256];
        snprintf(list, sizeof list, "%s", get(f, "stop_lengths"));
        for (char* tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) (*lengths)[gp.n_stop++] = strtoull(tok, NULL, 10);
        gp.stop_tokens = *stops;
        gp.stop_lengths = *lengths;
    }
    return gp;
}

/* An hprefix case: the prefix built here saves numpy's blob, which loads into a prefix that
 * generates what the built one does; got[*n_got] = the built one's tokens. */
static void hidden_prefix_case(const fields* f, tl_model* m, const int32_t* prompt, size_t n_prompt,
                               const tl_gen_params* gp, int32_t* got, size_t* n_got, const char* where) {
    size_t n_blob, n_saved = 0, n_again = 0;
    uint8_t* blob = load(get(f, "blob"), 1, &n_blob);
    const uint32_t flags = get_u64(f, "storage") == 1 ? TL_PREFIX_STORE_H8 : TL_PREFIX_STORE_H4;
    tl_prefix* p = NULL;
    tl_prefix* q = NULL;
    CHECK_OK(tl_prefix_build_ex(m, prompt, n_prompt, (uint32_t)get_u64(f, "prefix_loops"), gp->cache_window,
                                gp->prefill_chunk, flags, &p));
    uint8_t* saved = malloc(n_blob);
    CHECK(tl_prefix_save(p, saved, n_blob, &n_saved) == TL_OK && n_saved == n_blob && !memcmp(saved, blob, n_blob),
          "%s: %s: the prefix built here saves %zu other bytes (numpy: %zu): %s", where, get(f, "blob"), n_saved,
          n_blob, tl_last_error());
    CHECK_OK(tl_generate_from_prefix(p, NULL, 0, gp, got, n_got, NULL));
    CHECK_OK(tl_prefix_load(m, blob, n_blob, &q));
    int32_t* again = calloc(gp->max_tokens, sizeof(int32_t));
    CHECK_OK(tl_generate_from_prefix(q, NULL, 0, gp, again, &n_again, NULL));
    CHECK(n_again == *n_got && memcmp(again, got, n_again * sizeof(int32_t)) == 0,
          "%s: %s: the loaded blob generates other tokens than the prefix built here", where, get(f, "blob"));
    free(again), free(saved), free(blob);
    tl_prefix_free(q);
    tl_prefix_free(p);
}

static void run_case(const char* kind, const fields* f, tl_model* m, const char* where) {
    size_t n_prompt, n_expect;
    int32_t* prompt = load(get(f, "prompt"), sizeof(int32_t), &n_prompt);
    tl_model_config cfg = {.size = sizeof cfg};
    CHECK_OK(tl_model_config_get(m, &cfg));
    const uint32_t V = cfg.vocab_size;
    if (strcmp(kind, "logits") == 0) {
        float* want = load(get(f, "expect"), sizeof(float), &n_expect);
        float* got = malloc(n_prompt * V * sizeof(float));
        tl_seq* s = NULL;
        CHECK_OK(tl_seq_create(m, (uint32_t)get_u64(f, "loops"), (uint32_t)get_u64(f, "window"), &s));
        CHECK_OK(tl_seq_prefill_all(s, prompt, n_prompt, get_u64(f, "chunk"), got));
        size_t bad = 0;
        while (bad < n_expect && memcmp(&got[bad], &want[bad], sizeof(float)) == 0) bad++;
        CHECK(n_expect == n_prompt * V && bad == n_expect,
              "%s: %s: first difference at position %zu, id %zu: %.9g vs numpy %.9g", where, get(f, "expect"),
              bad / V, bad % V, bad < n_expect ? (double)got[bad] : 0.0, bad < n_expect ? (double)want[bad] : 0.0);
        tl_seq_free(s);
        free(want), free(got);
    } else {
        int32_t* want = load(get(f, "expect"), sizeof(int32_t), &n_expect);
        int32_t* stops;
        size_t* lengths;
        tl_gen_params gp = gen_params(f, &stops, &lengths);
        int32_t* got = calloc(gp.max_tokens, sizeof(int32_t));
        size_t n_got = 0;
        if (strcmp(kind, "generate") == 0) {
            CHECK_OK(tl_generate(m, prompt, n_prompt, &gp, got, &n_got, NULL));
        } else if (strcmp(kind, "hprefix") == 0) {
            hidden_prefix_case(f, m, prompt, n_prompt, &gp, got, &n_got, where);
        } else {
            tl_prefix* p = NULL;
            CHECK_OK(tl_prefix_build(m, prompt, n_prompt, (uint32_t)get_u64(f, "prefix_loops"), gp.cache_window,
                                     gp.prefill_chunk, &p));
            CHECK_OK(tl_generate_from_prefix(p, NULL, 0, &gp, got, &n_got, NULL));
            tl_prefix_free(p);
        }
        CHECK(n_got == n_expect && memcmp(got, want, n_got * sizeof(int32_t)) == 0,
              "%s: %s: %zu tokens (first %d) vs numpy %zu (first %d)", where, get(f, "expect"), n_got,
              n_got ? got[0] : -1, n_expect, n_expect ? want[0] : -1);
        free(want), free(got), free(stops), free(lengths);
    }
    free(prompt);
}

typedef struct config {
    tl_isa isa;
    uint32_t threads, block_size;
    tl_device device;
} config;

static tl_model* open_on(const char* path, const config* c) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = c->threads;
    p.isa = c->isa;
    p.kv_block_size = c->block_size;
    p.device = c->device;
    tl_model* m = NULL;
    CHECK(tl_model_open(path, &p, &m) == TL_OK, "tl_model_open(%s) on device %d: %s", path, (int)c->device,
          tl_last_error());
    return m;
}

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_golden GOLDEN_DIR\n");
        return 2;
    }
    golden_dir = argv[1];
    char path[1024];
    snprintf(path, sizeof path, "%s/manifest.txt", golden_dir);
    FILE* manifest = fopen(path, "r");
    if (!manifest) {
        fprintf(stderr, "cannot open %s\n", path);
        return 2;
    }
    config configs[5] = {{TL_ISA_SCALAR, 1, 16, TL_DEVICE_CPU}};
    int n_configs = 1;
    for (tl_isa isa = TL_ISA_AVX2; isa <= TL_ISA_AMX; isa++)
        if (tl_cpu_supports(isa)) configs[n_configs++] = (config){isa, 3, 4, TL_DEVICE_CPU};
    if (tl_device_check(TL_DEVICE_CUDA) == TL_OK) configs[n_configs++] = (config){TL_ISA_AUTO, 1, 4, TL_DEVICE_CUDA};
    const char* every_env = getenv("TINYLOOP_GOLDEN_CUDA_EVERY");
    const int cuda_every = every_env && atoi(every_env) > 1 ? atoi(every_env) : 1;
    char line[4096], model_name[256] = "";
    tl_model* models[5] = {NULL};
    int n_cases = 0, n_cuda = 0, model_case = 0;
    while (fgets(line, sizeof line, manifest)) {
        char kind[32];
        fields f = {0};
        char* tok = strtok(line, " \n");
        if (!tok) continue;
        snprintf(kind, sizeof kind, "%s", tok);
        while ((tok = strtok(NULL, " \n")) && f.n < MAX_FIELDS) {
            char* eq = strchr(tok, '=');
            if (!eq) continue;
            *eq = 0;
            snprintf(f.key[f.n], sizeof f.key[f.n], "%s", tok);
            snprintf(f.value[f.n], sizeof f.value[f.n], "%s", eq + 1);
            f.n++;
        }
        if (strcmp(get(&f, "model"), model_name) != 0) {
            snprintf(model_name, sizeof model_name, "%s", get(&f, "model"));
            snprintf(path, sizeof path, "%s/%s", golden_dir, model_name);
            for (int c = 0; c < n_configs; c++) {
                tl_model_free(models[c]);
                models[c] = open_on(path, &configs[c]);
            }
            model_case = 0;
        }
        for (int c = 0; c < n_configs; c++) {
            if (configs[c].device == TL_DEVICE_CUDA && model_case % cuda_every != 0) continue;
            n_cuda += configs[c].device == TL_DEVICE_CUDA;
            char where[512];
            snprintf(where, sizeof where, "%s %s isa %d threads %u", model_name,
                     configs[c].device == TL_DEVICE_CUDA ? "cuda" : "cpu", configs[c].isa, configs[c].threads);
            if (models[c]) run_case(kind, &f, models[c], where);
        }
        n_cases++;
        model_case++;
        if (tu_failures > 30) break;
    }
    fclose(manifest);
    for (int c = 0; c < n_configs; c++) tl_model_free(models[c]);
    printf("test_golden: %d cases x %d kernel paths on the CPU, %d on CUDA\n", n_cases,
           n_configs - (configs[n_configs - 1].device == TL_DEVICE_CUDA), n_cuda);
    CHECK(n_cases > 0, "no cases in the manifest");
    return tu_finish("test_golden");
}
