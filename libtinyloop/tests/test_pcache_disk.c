/* test_pcache_disk.c — the prefix cache's disk tier (docs/spec.md §4.3.1) and its spilled
 * block file (§7.6).
 *
 * Through the public API, on a plain model (int8 and int4 KV, windows 0 and 6, a salt) and one
 * with a coda (per-depth trees): a tiny memory budget spills evicted blocks, one file per
 * spilled block, each named by the FNV-1a hash of §4.3.1 computed here from the tokens, laid
 * out as §7.6 says (parsed here field by field; without a coda its records equal a saved
 * prefix's KV of the same tokens); a second model on the same directory reads them back (disk
 * hits) with tokens and logits bit-identical to a model without a cache; close spills what is
 * cached; a deeper block replaces a shallower file and serves a shallower request; corrupted,
 * truncated, foreign-model, other-kv-mode and other-salt files are misses with unchanged
 * results; the open-time errors. Directly on the tier (this test links the library's
 * objects): the disk budget with its least-recently-used order (kept across a reopen by
 * modification time), the skip of a spill whose file already serves, device blocks staged
 * through their allocator's copies (a device without copies neither spills nor reads), and the
 * block-file reader under mutation (every truncation, every byte flipped, each field set to a
 * bad value, random damage with the checksum fixed): never a crash or an out-of-bounds read
 * (run under ASan), every failure TL_ERR_BAD_FILE naming the rule. Threads racing on one model
 * with a disk tier (run under TSan) and the scheduler under a KV budget get the cache-less
 * results. Every allocation of a model's life with a disk tier (open, disk hits, spills,
 * close) failing in turn: an out-of-memory error or the same tokens, and nothing leaked. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/alloc.h" /* tl_alloc_fail_after */
#include "core/block_file.h"
#include "core/kv_records.h"
#include "core/pcache_disk.h"
#include "test_util.h"

enum { BS = 4, HEADER = 96, N_PROMPTS = 12, MAX_NEW = 3, MAX_FILES = 256 };

static uint32_t V;

/* ---- directories ----------------------------------------------------------------------------- */

/* Remove every file of dir, then dir. */
static void remove_dir(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return;
    char path[1024];
    for (struct dirent* e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* The path of a directory of this process named `name`, not there (removed if it was). */
static char* fresh_dir(const char* name) {
    const char* tmp = getenv("TMPDIR");
    char* dir = malloc(512);
    snprintf(dir, 512, "%s/tltest-%d-%s", tmp && *tmp ? tmp : "/tmp", (int)getpid(), name);
    remove_dir(dir);
    return dir;
}

static void drop_dir(char* dir) {
    remove_dir(dir);
    free(dir);
}

/* The names of dir's entries other than . and .. (sorted), up to MAX_FILES; how many. */
typedef struct listing {
    char names[MAX_FILES][256];
    size_t n, blocks, bytes; /* entries; those named *.tlblock; the bytes of all */
} listing;

static int by_name(const void* a, const void* b) { return strcmp(a, b); }

static void list_dir(const char* dir, listing* l) {
    l->n = l->blocks = l->bytes = 0;
    DIR* d = opendir(dir);
    CHECK(d != NULL, "cannot list %s", dir);
    for (struct dirent* e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || l->n == MAX_FILES) continue;
        snprintf(l->names[l->n++], sizeof l->names[0], "%s", e->d_name);
        const size_t len = strlen(e->d_name);
        l->blocks += len > 8 && !strcmp(e->d_name + len - 8, ".tlblock");
        char path[1024];
        struct stat fs;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &fs) == 0) l->bytes += (size_t)fs.st_size;
    }
    if (d) closedir(d);
    qsort(l->names, l->n, sizeof l->names[0], by_name);
}

static uint8_t* read_path(const char* path, size_t* n) {
    *n = 0;
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t* b = malloc(size > 0 ? (size_t)size : 1);
    *n = fread(b, 1, (size_t)size, f);
    fclose(f);
    return b;
}

static void write_path(const char* path, const uint8_t* b, size_t n) {
    FILE* f = fopen(path, "wb");
    CHECK(f && fwrite(b, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

static int exists(const char* dir, const char* name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* ---- §4.3.1's name and §7.6's layout, computed here ------------------------------------------ */

typedef struct model_id {
    uint32_t checksum;
    uint64_t file_bytes;
} model_id;

static model_id id_of(const uint8_t* model_bytes) {
    return (model_id){tu_get_u32(model_bytes + 24), tu_get_u64(model_bytes + 16)};
}

static uint64_t fnv(uint64_t h, const uint8_t* p, size_t n) {
    while (n--) h = (h ^ *p++) * 0x100000001b3ull;
    return h;
}

static void expected_name(model_id id, uint32_t kv_mode, uint32_t window, uint32_t depth, const char* salt,
                          const int32_t* tokens, size_t n_tokens, char out[64]) {
    uint8_t key[32];
    tu_put_u32(key, id.checksum);
    tu_put_u64(key + 4, id.file_bytes);
    tu_put_u32(key + 12, kv_mode);
    tu_put_u32(key + 16, window);
    tu_put_u32(key + 20, depth);
    tu_put_u32(key + 24, BS);
    tu_put_u32(key + 28, (uint32_t)strlen(salt));
    uint64_t h = fnv(fnv(0xcbf29ce484222325ull, key, sizeof key), (const uint8_t*)salt, strlen(salt));
    for (size_t i = 0; i < n_tokens; i++) {
        uint8_t t[4];
        tu_put_u32(t, (uint32_t)tokens[i]);
        h = fnv(h, t, 4);
    }
    snprintf(out, 64, "%016llx.tlblock", (unsigned long long)h);
}

/* The header fields of a spilled block file, read at §7.6's offsets. */
typedef struct header {
    uint32_t version, header_bytes, checksum, model_checksum, kv_mode, window, tree_depth, block_size, salt_bytes,
        index, n_layers, G, D;
    uint64_t file_bytes, model_file_bytes;
} header;

static header parse(const uint8_t* b) {
    return (header){tu_get_u32(b + 8),  tu_get_u32(b + 12), tu_get_u32(b + 24), tu_get_u32(b + 28),
                    tu_get_u32(b + 40), tu_get_u32(b + 44), tu_get_u32(b + 48), tu_get_u32(b + 52),
                    tu_get_u32(b + 56), tu_get_u32(b + 60), tu_get_u32(b + 64), tu_get_u32(b + 68),
                    tu_get_u32(b + 72), tu_get_u64(b + 16), tu_get_u64(b + 32)};
}

/* ---- models ---------------------------------------------------------------------------------- */

typedef struct setup {
    const char* path;
    model_id id;
    tu_spec spec;
} setup;

static setup make_model(const char* name, tu_spec spec) {
    size_t n;
    uint8_t* bytes = tu_model_bytes(&spec, &n);
    setup s = {tu_write_file(name, bytes, n), id_of(bytes), spec};
    free(bytes);
    return s;
}

static tl_model* open_disk(const char* path, size_t cache, const char* dir, size_t disk, tl_kv_mode mode) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2;
    p.kv_block_size = BS;
    p.kv_mode = mode;
    p.prefix_cache_bytes = cache;
    p.prefix_cache_dir = dir;
    p.prefix_cache_disk_bytes = disk;
    tl_model* m = NULL;
    const tl_status st = tl_model_open(path, &p, &m);
    CHECK(st == TL_OK, "tl_model_open(%s, dir %s): %s", path, dir ? dir : "none", tl_last_error());
    return m;
}

/* A workload: prompts of 9 .. 22 tokens, most starting with one shared system prompt. */
typedef struct workload {
    int32_t tokens[N_PROMPTS][24];
    size_t n[N_PROMPTS];
} workload;

static workload make_workload(uint64_t seed) {
    workload w;
    uint64_t rng = seed;
    int32_t system[12];
    for (int i = 0; i < 12; i++) system[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    for (int p = 0; p < N_PROMPTS; p++) {
        w.n[p] = (size_t)tu_uniform(&rng, 9, 22);
        const size_t keep = p % 3 == 2 ? 0 : (size_t)tu_uniform(&rng, 4, 12);
        for (size_t i = 0; i < w.n[p]; i++) w.tokens[p][i] = i < keep ? system[i] : tu_uniform(&rng, 0, (int32_t)V - 1);
    }
    return w;
}

typedef struct request {
    uint32_t loops, window;
    const char* salt;
} request;

static tl_gen_params params_of(request r, int p) {
    tl_gen_params gp = tu_gen_params(MAX_NEW, r.loops, r.window, p % 2, (uint64_t)p);
    gp.cache_salt = r.salt;
    return gp;
}

/* Every prompt on m equals the cache-less model's. */
static void run_workload(tl_model* m, tl_model* plain, const workload* w, request r, const char* what) {
    for (int p = 0; p < N_PROMPTS; p++) {
        const tl_gen_params gp = params_of(r, p);
        tu_result got = tu_generate(m, w->tokens[p], w->n[p], &gp, V);
        tu_result want = tu_generate(plain, w->tokens[p], w->n[p], &gp, V);
        CHECK(tu_same_result(&got, &want), "%s, prompt %d: tokens or logits differ from no cache", what, p);
        tu_result_free(&got);
        tu_result_free(&want);
    }
}

/* The prompt and block of the workload a file is named for (its tokens then are known), or -1. */
static int owner_of(const setup* s, const workload* w, request r, uint32_t kv_mode, uint32_t depth,
                    const char* name, uint32_t* index) {
    char want[64];
    for (int p = 0; p < N_PROMPTS; p++)
        for (size_t i = 0; i < w->n[p] / BS; i++) {
            expected_name(s->id, kv_mode, r.window, depth, r.salt ? r.salt : "", w->tokens[p], (i + 1) * BS, want);
            if (!strcmp(want, name)) {
                *index = (uint32_t)i;
                return p;
            }
        }
    return -1;
}

/* File `name` of dir, §7.6 field by field: the block `index` of prompt p's tokens. With window
 * 0 its records equal those of a prefix of the same tokens (built and saved as a blob, §7.2). */
static void check_file(const setup* s, tl_model* m, const char* dir, const char* name, const workload* w, int p,
                       uint32_t index, request r, uint32_t kv_mode, uint32_t depth) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t n;
    uint8_t* b = read_path(path, &n);
    const header h = parse(b);
    const char* salt = r.salt ? r.salt : "";
    const uint32_t G = s->spec.kv_heads, D = s->spec.head_dim, R = kv_mode ? D / 2 : D;
    const size_t n_tokens = ((size_t)index + 1) * BS, record = 2 * (size_t)R + 8;
    const size_t want_bytes = HEADER + strlen(salt) + 4 * n_tokens + (size_t)h.n_layers * BS * G * record;
    CHECK(n >= HEADER && !memcmp(b, "TLPBLOCK", 8) && h.version == 1 && h.header_bytes == HEADER, "%s: header", name);
    CHECK(h.file_bytes == n && n == want_bytes, "%s: %zu bytes, file_bytes %llu, want %zu", name, n,
          (unsigned long long)h.file_bytes, want_bytes);
    uint8_t* zeroed = malloc(n);
    memcpy(zeroed, b, n);
    tu_put_u32(zeroed + 24, 0);
    CHECK(h.checksum == tu_crc32(zeroed, n), "%s: checksum", name);
    free(zeroed);
    CHECK(h.model_checksum == s->id.checksum && h.model_file_bytes == s->id.file_bytes && h.kv_mode == kv_mode,
          "%s: model or kv_mode", name);
    CHECK(h.window == r.window && h.tree_depth == depth && h.block_size == BS && h.salt_bytes == strlen(salt) &&
              h.index == index && h.G == G && h.D == D,
          "%s: key fields", name);
    const uint32_t n_layers = (uint32_t)(s->spec.n_pre + r.loops * (s->spec.n_core + s->spec.n_coda));
    CHECK(h.n_layers == n_layers, "%s: n_layers %u, want %u", name, h.n_layers, n_layers);
    CHECK(tu_get_u32(b + 76) == 0, "%s: instruction %u of a causal tree", name, tu_get_u32(b + 76));
    for (int k = 80; k < HEADER; k++) CHECK(b[k] == 0, "%s: reserved byte %d", name, k);
    CHECK(!memcmp(b + HEADER, salt, strlen(salt)), "%s: salt", name);
    for (size_t i = 0; i < n_tokens; i++)
        CHECK((int32_t)tu_get_u32(b + HEADER + strlen(salt) + 4 * i) == w->tokens[p][i], "%s: tokens[%zu]", name, i);
    if (r.window == 0 && s->spec.n_coda == 0 && n == want_bytes) { /* a prefix writes every depth's coda */
        tl_prefix* prefix = NULL;
        CHECK_OK(tl_prefix_build(m, w->tokens[p], n_tokens, r.loops, 0, 3, &prefix));
        size_t blob_n = 0;
        CHECK_OK(tl_prefix_save(prefix, NULL, 0, &blob_n));
        uint8_t* blob = malloc(blob_n);
        CHECK_OK(tl_prefix_save(prefix, blob, blob_n, &blob_n));
        const size_t kv_at = HEADER + 4 * n_tokens + 4 * (size_t)r.loops * s->spec.d; /* kv_start 0 */
        const uint8_t* records = b + HEADER + strlen(salt) + 4 * n_tokens;
        int same = 1;
        for (uint32_t l = 0; l < n_layers; l++)
            for (uint32_t t = 0; t < BS; t++)
                for (uint32_t g = 0; g < G; g++) {
                    const size_t pos = (size_t)index * BS + t;
                    const uint8_t* in_file = records + (((size_t)l * BS + t) * G + g) * record;
                    const uint8_t* in_blob = blob + kv_at + (((size_t)l * n_tokens + pos) * G + g) * record;
                    same &= !memcmp(in_file, in_blob, record);
                }
        CHECK(same, "%s: records differ from the KV of a prefix of the same tokens", name);
        free(blob);
        tl_prefix_free(prefix);
    }
    free(b);
}

/* ---- spill, names, disk hits ----------------------------------------------------------------- */

/* A budget of two blocks spills evicted blocks; a second model on the directory reads them back. */
static void test_spill_and_hits(const setup* s, tl_kv_mode mode, request r, const char* what) {
    char* dir = fresh_dir("spill");
    const uint32_t depth = s->spec.n_coda ? r.loops : 0;
    const workload w = make_workload(17 + r.loops);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, mode);
    const size_t n_layers = s->spec.n_pre + r.loops * (s->spec.n_core + s->spec.n_coda);
    const size_t R = mode ? s->spec.head_dim / 2 : s->spec.head_dim;
    const size_t head = ((2 * BS * R + 3) / 4 * 4 + 8 * BS + 63) / 64 * 64; /* kvcache.h's head_bytes */
    const size_t block = 64 + n_layers * s->spec.kv_heads * head;
    tl_model* m = open_disk(s->path, 2 * block + block / 2, dir, 0, mode);
    run_workload(m, plain, &w, r, what);
    tl_prefix_cache_stats st = tu_cache_stats(m);
    listing* l = malloc(sizeof *l);
    list_dir(dir, l);
    CHECK(st.evicted_blocks > 0 && st.spilled_blocks > 0, "%s: %llu evicted, %llu spilled", what,
          (unsigned long long)st.evicted_blocks, (unsigned long long)st.spilled_blocks);
    CHECK(l->n == l->blocks && l->blocks == st.spilled_blocks, "%s: %zu entries, %zu block files, %llu spilled", what,
          l->n, l->blocks, (unsigned long long)st.spilled_blocks);
    for (size_t i = 0; i < l->n; i++) {
        uint32_t index = 0;
        const int p = owner_of(s, &w, r, mode, depth, l->names[i], &index);
        CHECK(p >= 0, "%s: file %s is named for no block of the workload", what, l->names[i]);
        if (p >= 0) check_file(s, plain, dir, l->names[i], &w, p, index, r, mode, depth);
    }
    CHECK(st.disk_bytes == l->bytes && st.disk_budget_bytes == 0, "%s: disk_bytes %zu, the files %zu", what,
          st.disk_bytes, l->bytes);
    const size_t cached = st.blocks;
    tl_model_free(m); /* close spills what is cached */
    list_dir(dir, l);
    CHECK(l->blocks >= st.spilled_blocks && l->blocks <= st.spilled_blocks + cached,
          "%s: %zu files after close, %llu spilled, %zu cached", what, l->blocks, (unsigned long long)st.spilled_blocks,
          cached);

    /* a fresh model: its first lookup is served from disk alone */
    m = open_disk(s->path, 2 * block + block / 2, dir, 0, mode);
    const tl_gen_params gp = params_of(r, 0);
    tu_result got = tu_generate(m, w.tokens[0], w.n[0], &gp, V);
    tu_result want = tu_generate(plain, w.tokens[0], w.n[0], &gp, V);
    CHECK(tu_same_result(&got, &want), "%s: the first request from disk differs from no cache", what);
    tu_result_free(&got);
    tu_result_free(&want);
    st = tu_cache_stats(m);
    CHECK(st.disk_hit_blocks > 0 && st.hit_tokens == st.disk_hit_blocks * BS, "%s: %llu disk hits, %llu hit tokens",
          what, (unsigned long long)st.disk_hit_blocks, (unsigned long long)st.hit_tokens);
    run_workload(m, plain, &w, r, what);
    CHECK(tu_cache_stats(m).disk_hit_blocks > st.disk_hit_blocks, "%s: the workload again read nothing from disk",
          what);
    tl_model_free(m);
    tl_model_free(plain);
    free(l);
    drop_dir(dir);
}

/* With a big budget nothing is evicted: close writes every cached block; a reopen counts them. */
static void test_close_spills(const setup* s) {
    char* dir = fresh_dir("close");
    const workload w = make_workload(5);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    tl_model* m = open_disk(s->path, 1 << 24, dir, 0, TL_KV_INT8);
    const request r = {2, 0, NULL};
    run_workload(m, plain, &w, r, "close");
    const tl_prefix_cache_stats st = tu_cache_stats(m);
    listing* l = malloc(sizeof *l);
    list_dir(dir, l);
    CHECK(st.spilled_blocks == 0 && l->n == 0 && st.blocks > 0, "close: %llu spilled before close",
          (unsigned long long)st.spilled_blocks);
    CHECK_OK(tl_model_prefix_cache_clear(m)); /* clear writes nothing */
    list_dir(dir, l);
    CHECK(l->n == 0, "clear wrote %zu files", l->n);
    run_workload(m, plain, &w, r, "close");
    const size_t cached = tu_cache_stats(m).blocks;
    tl_model_close(m);
    list_dir(dir, l);
    CHECK(l->n == cached && l->blocks == cached, "close wrote %zu files for %zu cached blocks", l->n, cached);
    const size_t bytes = l->bytes;
    tl_model_free(m);
    m = open_disk(s->path, 1 << 24, dir, 1 << 20, TL_KV_INT8);
    const tl_prefix_cache_stats reopened = tu_cache_stats(m);
    CHECK(reopened.disk_bytes == bytes && reopened.disk_budget_bytes == 1 << 20 && reopened.blocks == 0,
          "reopen: disk_bytes %zu, the files %zu", reopened.disk_bytes, bytes);
    /* every block of prompt 0 is on disk: its lookup reads them all, cached but not inserted */
    const tl_gen_params gp = params_of(r, 0);
    tu_result got = tu_generate(m, w.tokens[0], w.n[0], &gp, V);
    tu_result want = tu_generate(plain, w.tokens[0], w.n[0], &gp, V);
    CHECK(tu_same_result(&got, &want), "after close, prompt 0: tokens or logits differ");
    tu_result_free(&got);
    tu_result_free(&want);
    const tl_prefix_cache_stats first = tu_cache_stats(m);
    CHECK(first.disk_hit_blocks == (w.n[0] - 1) / BS && first.blocks == w.n[0] / BS &&
              first.inserted_blocks == first.blocks - first.disk_hit_blocks,
          "after close, prompt 0 (%zu tokens): %llu disk hits, %zu blocks, %llu inserted", w.n[0],
          (unsigned long long)first.disk_hit_blocks, first.blocks, (unsigned long long)first.inserted_blocks);
    run_workload(m, plain, &w, r, "after close");
    CHECK(tu_cache_stats(m).disk_hit_blocks > 0, "after close: no disk hit");
    tl_model_free(m);
    tl_model_free(plain);
    free(l);
    drop_dir(dir);
}

/* Close spills the least recently used node first and, among the nodes of one tick, the deeper
 * block first: under a disk budget of three files, the last three written stay. Prompt A's
 * blocks a0 a1 a2 (one insert), then B's b0 b1: written a2 a1 a0 b1 b0, keeping a0 b1 b0. */
static void test_close_order(const setup* s) {
    char* dir = fresh_dir("order");
    int32_t a[13], b[9];
    uint64_t rng = 123;
    for (int i = 0; i < 13; i++) a[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    for (int i = 0; i < 9; i++) b[i] = (a[i] + 1) % (int32_t)V;
    const size_t n_layers = s->spec.n_pre + 2 * s->spec.n_core, record = 2 * (size_t)s->spec.head_dim + 8;
    size_t size[3]; /* of a file of block 0, 1, 2 */
    for (size_t i = 0; i < 3; i++) size[i] = HEADER + 4 * (i + 1) * BS + n_layers * BS * s->spec.kv_heads * record;
    tl_model* m = open_disk(s->path, 1 << 24, dir, 2 * size[0] + size[1], TL_KV_INT8);
    const tl_gen_params gp = tu_gen_params(1, 2, 0, 0, 1);
    tu_result r = tu_generate(m, a, 13, &gp, V);
    tu_result_free(&r);
    r = tu_generate(m, b, 9, &gp, V);
    tu_result_free(&r);
    CHECK(tu_cache_stats(m).blocks == 5, "close order: %zu blocks cached, want 5", tu_cache_stats(m).blocks);
    tl_model_free(m);
    const int32_t* prompt[5] = {a, a, a, b, b};
    const size_t index[5] = {0, 1, 2, 0, 1};
    const int kept[5] = {1, 0, 0, 1, 1};
    for (int k = 0; k < 5; k++) {
        char name[64];
        expected_name(s->id, 0, 0, 0, "", prompt[k], (index[k] + 1) * BS, name);
        CHECK(exists(dir, name) == kept[k], "close order: the file of %c%zu %s", k < 3 ? 'a' : 'b', index[k],
              kept[k] ? "was removed" : "stayed");
    }
    drop_dir(dir);
}

/* Without a coda a deeper block replaces a shallower file and serves a shallower request. */
static void test_depths(const setup* s) {
    char* dir = fresh_dir("depths");
    const workload w = make_workload(9);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    const int32_t* prompt = w.tokens[1];
    const size_t n = w.n[1];
    char name[64];
    expected_name(s->id, 0, 0, 0, "", prompt, BS, name);
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    const uint32_t loops[3] = {2, 3, 2};
    size_t sizes[3];
    for (int k = 0; k < 3; k++) {
        tl_model* m = open_disk(s->path, 1 << 24, dir, 0, TL_KV_INT8);
        const tl_gen_params gp = tu_gen_params(MAX_NEW, loops[k], 0, 0, 1);
        tu_result got = tu_generate(m, prompt, n, &gp, V);
        tu_result want = tu_generate(plain, prompt, n, &gp, V);
        CHECK(tu_same_result(&got, &want), "depths, run %d: tokens or logits differ", k);
        tu_result_free(&got);
        tu_result_free(&want);
        const uint64_t hits = tu_cache_stats(m).disk_hit_blocks;
        CHECK(hits == (k == 2 ? (n - 1) / BS : 0), "depths, run %d: %llu disk hits", k, (unsigned long long)hits);
        tl_model_free(m);
        struct stat fs;
        sizes[k] = stat(path, &fs) == 0 ? (size_t)fs.st_size : 0;
    }
    CHECK(sizes[0] > 0 && sizes[1] > sizes[0] && sizes[2] == sizes[1], "depths: file sizes %zu, %zu, %zu", sizes[0],
          sizes[1], sizes[2]);
    tl_model_free(plain);
    drop_dir(dir);
}

/* ---- bad files are misses -------------------------------------------------------------------- */

/* The files a model writes at close for `prompt` (n tokens) at depth 2: their names, bytes. */
typedef struct saved {
    char names[8][64];
    uint8_t* bytes[8];
    size_t n[8], count;
} saved;

static saved spill_prompt(const char* path, tl_kv_mode mode, const char* dir, const int32_t* prompt, size_t n,
                          model_id id, const char* salt) {
    saved sv = {.count = n / BS};
    tl_model* m = open_disk(path, 1 << 24, dir, 0, mode);
    tl_gen_params gp = tu_gen_params(1, 2, 0, 0, 1);
    gp.cache_salt = salt;
    tu_result r = tu_generate(m, prompt, n, &gp, V);
    tu_result_free(&r);
    tl_model_free(m);
    for (size_t i = 0; i < sv.count; i++) {
        expected_name(id, mode, 0, 0, salt ? salt : "", prompt, (i + 1) * BS, sv.names[i]);
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, sv.names[i]);
        sv.bytes[i] = read_path(p, &sv.n[i]);
        CHECK(sv.bytes[i] != NULL, "file %s was not written", sv.names[i]);
    }
    return sv;
}

static void free_saved(saved* sv) {
    for (size_t i = 0; i < sv->count; i++) free(sv->bytes[i]);
}

/* Put the saved files back, block `which` replaced by bytes[0 .. n) (NULL: removed), then a
 * fresh model on dir: the same result as no cache, with `which` disk hits. */
static void check_miss(const setup* s, tl_model* plain, const char* dir, const saved* sv, size_t which,
                       const uint8_t* bytes, size_t n, const int32_t* prompt, size_t n_prompt, const char* what) {
    char path[1024];
    for (size_t i = 0; i < sv->count; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, sv->names[i]);
        if (i != which) write_path(path, sv->bytes[i], sv->n[i]);
        else if (bytes) write_path(path, bytes, n);
        else unlink(path);
    }
    tl_model* m = open_disk(s->path, 1 << 24, dir, 0, TL_KV_INT8);
    const tl_gen_params gp = tu_gen_params(MAX_NEW, 2, 0, 1, 3);
    tu_result got = tu_generate(m, prompt, n_prompt, &gp, V);
    tu_result want = tu_generate(plain, prompt, n_prompt, &gp, V);
    CHECK(tu_same_result(&got, &want), "%s: tokens or logits differ from no cache", what);
    const uint64_t hits = tu_cache_stats(m).disk_hit_blocks;
    CHECK(hits == which, "%s: %llu disk hits, want %zu", what, (unsigned long long)hits, which);
    tu_result_free(&got);
    tu_result_free(&want);
    tl_model_free(m);
}

static void test_bad_files(const setup* s, const setup* other, const char* path4) {
    char* dir = fresh_dir("bad");
    int32_t prompt[13];
    uint64_t rng = 99;
    for (int i = 0; i < 13; i++) prompt[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    saved sv = spill_prompt(s->path, TL_KV_INT8, dir, prompt, 13, s->id, NULL);
    check_miss(s, plain, dir, &sv, 3, NULL, 0, prompt, 13, "every file intact"); /* 3 = all of (13 - 1) / 4 */
    const size_t which = 1, n = sv.n[which];
    uint8_t* x = malloc(n + 1);
    const size_t at[] = {0, 9, 17, 25, 30, 45, 61, 66, 80, HEADER + 3, HEADER + 4 * 8 + 1, n / 2, n - 1};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        memcpy(x, sv.bytes[which], n);
        x[at[k]] ^= 0x21;
        char what[64];
        snprintf(what, sizeof what, "byte %zu flipped", at[k]);
        check_miss(s, plain, dir, &sv, which, x, n, prompt, 13, what);
    }
    const size_t lengths[] = {0, 50, HEADER - 1, HEADER, n - 1};
    for (size_t k = 0; k < sizeof lengths / sizeof lengths[0]; k++)
        check_miss(s, plain, dir, &sv, which, sv.bytes[which], lengths[k], prompt, 13, "truncated");
    memcpy(x, sv.bytes[which], n);
    x[n] = 0;
    check_miss(s, plain, dir, &sv, which, x, n + 1, prompt, 13, "a byte appended");
    memcpy(x, sv.bytes[which], n); /* valid checksum, a key value of -128 */
    x[HEADER + 4 * 8 + 5] = 0x80;
    tu_fix_checksum(x, n);
    check_miss(s, plain, dir, &sv, which, x, n, prompt, 13, "a -128 with its checksum");
    memcpy(x, sv.bytes[which], n); /* valid checksum, another window */
    tu_put_u32(x + 44, 6);
    tu_fix_checksum(x, n);
    check_miss(s, plain, dir, &sv, which, x, n, prompt, 13, "another window");
    memcpy(x, sv.bytes[which], n); /* valid checksum, another token */
    tu_put_u32(x + HEADER + 4 * 6, (uint32_t)(prompt[6] + 1) % V);
    tu_fix_checksum(x, n);
    check_miss(s, plain, dir, &sv, which, x, n, prompt, 13, "another token");

    /* the same tokens spilled by another model, by an int4-KV model, under a salt */
    char* elsewhere = fresh_dir("bad-other");
    const char* kinds[3] = {"another model", "kv_mode int4", "a salt"};
    for (int k = 0; k < 3; k++) {
        remove_dir(elsewhere);
        saved o = k == 0 ? spill_prompt(other->path, TL_KV_INT8, elsewhere, prompt, 13, other->id, NULL)
                  : k == 1 ? spill_prompt(path4, TL_KV_INT4, elsewhere, prompt, 13, s->id, NULL)
                           : spill_prompt(s->path, TL_KV_INT8, elsewhere, prompt, 13, s->id, "tenant");
        check_miss(s, plain, dir, &sv, which, o.bytes[which], o.n[which], prompt, 13, kinds[k]);
        free_saved(&o);
    }
    drop_dir(elsewhere);
    check_miss(s, plain, dir, &sv, 0, NULL, 0, prompt, 13, "the first file removed");
    free(x);
    free_saved(&sv);
    tl_model_free(plain);
    drop_dir(dir);
}

/* ---- open ------------------------------------------------------------------------------------ */

static void test_open_errors(const setup* s) {
    tl_model_params p = tl_model_params_default();
    p.prefix_cache_dir = "/tmp";
    tl_model* m = NULL;
    CHECK_STATUS(tl_model_open(s->path, &p, &m), TL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tl_last_error(), "prefix_cache_dir needs prefix_cache_bytes > 0") != NULL, "message: %s",
          tl_last_error());
    p.prefix_cache_bytes = 1 << 20;
    p.prefix_cache_dir = s->path; /* a file */
    CHECK_STATUS(tl_model_open(s->path, &p, &m), TL_ERR_IO);
    CHECK(strstr(tl_last_error(), s->path) && strstr(tl_last_error(), "not a directory"), "message: %s",
          tl_last_error());
    char* dir = fresh_dir("missing/below");
    p.prefix_cache_dir = dir;
    CHECK_STATUS(tl_model_open(s->path, &p, &m), TL_ERR_IO);
    CHECK(strstr(tl_last_error(), dir) && strstr(tl_last_error(), "cannot be created") &&
              strstr(tl_last_error(), strerror(ENOENT)),
          "message: %s", tl_last_error());
    CHECK(m == NULL, "a failed open returned a model");
    free(dir);
    dir = fresh_dir("made"); /* created when missing, one level */
    p.prefix_cache_dir = dir;
    CHECK_OK(tl_model_open(s->path, &p, &m));
    struct stat fs;
    CHECK(stat(dir, &fs) == 0 && S_ISDIR(fs.st_mode), "%s was not created", dir);
    tl_model_free(m);
    drop_dir(dir);
}

/* ---- the tier directly ----------------------------------------------------------------------- */

static tl_block_model block_model(uint32_t kv_bits) {
    return (tl_block_model){0x12345678u, 4242, 64, V, tl_kv_geom_make(BS, 2, 12, kv_bits)};
}

/* A block of n_layers at block index `index` into t (emptied first), every value random and
 * valid: rows never -128 (int8) or the nibble -8 (int4), scales >= 0. */
static tl_kv_block* random_block(const tl_block_model* m, tl_kv_table* t, uint32_t n_layers, uint32_t index,
                                 uint64_t* rng) {
    const tl_kv_geom* g = &m->geom;
    tl_kv_clear(t);
    CHECK_OK(tl_kv_reserve(t, g, n_layers, (size_t)index * BS, BS));
    tl_kv_block* b = t->spans[0].block;
    const size_t R = tl_kv_row_bytes(g);
    for (uint32_t l = 0; l < n_layers; l++)
        for (uint32_t h = 0; h < g->n_kv_heads; h++) {
            int8_t* rows[2] = {tl_kv_keys(g, b, l, h), tl_kv_values(g, b, l, h)};
            for (int k = 0; k < 2; k++)
                for (size_t i = 0; i < BS * R; i++) {
                    uint8_t v = (uint8_t)tu_next(rng);
                    if (g->kv_bits == 8 && v == 0x80) v = 0x7f;
                    if (g->kv_bits == 4 && (v & 0x0f) == 0x08) v ^= 0x01;
                    if (g->kv_bits == 4 && (v & 0xf0) == 0x80) v ^= 0x10;
                    rows[k][i] = (int8_t)v;
                }
            for (uint32_t t2 = 0; t2 < BS; t2++) {
                tl_kv_key_scales(g, b, l, h)[t2] = (float)(tu_next(rng) % 1000) / 64.0f;
                tl_kv_value_scales(g, b, l, h)[t2] = (float)(tu_next(rng) % 1000) / 32.0f;
            }
        }
    return b;
}

static uint64_t name_of(const tl_block_model* m, const tl_block_place* at) {
    return tl_block_name_more(tl_block_name_start(m, at, strlen(at->salt)),
                              at->tokens, ((size_t)at->index + 1) * BS);
}

static void file_name(const tl_block_model* m, const tl_block_place* at, char out[32]) {
    tl_block_name_format(name_of(m, at), out);
}

/* Whether fetching `at` gives back exactly block b's values (its layer count too). */
static int fetch_equals(tl_pdisk* d, const tl_block_model* m, const tl_block_place* at, uint32_t n_layers,
                        tl_kv_block* b) {
    tl_kv_table t = {0};
    const bool hit = tl_pdisk_fetch(d, at, name_of(m, at), n_layers, &t);
    const tl_kv_geom* g = &m->geom;
    int same = hit && t.n_spans == 1 && t.spans[0].start == at->index * BS && t.spans[0].count == BS;
    if (same) {
        tl_kv_block* got = t.spans[0].block;
        same = got->n_layers == b->n_layers && got->start == b->start;
        for (uint32_t l = 0; same && l < b->n_layers; l++)
            for (uint32_t h = 0; h < g->n_kv_heads; h++) {
                const size_t rows = BS * tl_kv_row_bytes(g);
                same &= !memcmp(tl_kv_keys(g, got, l, h), tl_kv_keys(g, b, l, h), rows) &&
                        !memcmp(tl_kv_values(g, got, l, h), tl_kv_values(g, b, l, h), rows) &&
                        !memcmp(tl_kv_key_scales(g, got, l, h), tl_kv_key_scales(g, b, l, h), 2 * BS * sizeof(float));
            }
    }
    tl_kv_clear(&t);
    return same;
}

static void set_mtime(const char* dir, const char* name, time_t when) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    const struct timespec times[2] = {{when, 0}, {when, 0}};
    CHECK(utimensat(AT_FDCWD, path, times, 0) == 0, "utimensat(%s)", path);
}

/* The disk budget, least recently used first, across a reopen; the spill rules. */
static void test_tier_budget(void) {
    char* dir = fresh_dir("tier");
    const tl_block_model m = block_model(8);
    uint64_t rng = 1;
    int32_t tokens[5][BS];
    tl_block_place at[5];
    char names[5][32];
    for (int k = 0; k < 5; k++) {
        for (int i = 0; i < BS; i++) tokens[k][i] = tu_uniform(&rng, 0, (int32_t)V - 1);
        at[k] = (tl_block_place){"", 0, 0, 0, tokens[k], 0};
        file_name(&m, &at[k], names[k]);
    }
    const size_t one = tl_block_file_size(&m, 0, 0, 2);
    CHECK(one == HEADER + 4 * BS + 2 * BS * 2 * (2 * 12 + 8), "file size %zu", one);
    tl_pdisk* d = NULL;
    CHECK_OK(tl_pdisk_open(dir, 3 * one, &m, &d));
    tl_kv_table t = {0};
    tl_kv_block* blocks[5];
    tl_kv_table keep[5] = {{0}};
    for (int k = 0; k < 5; k++) {
        blocks[k] = random_block(&m, &t, 2, 0, &rng);
        CHECK_OK(tl_kv_share(&keep[k], &t));
    }
    for (int k = 0; k < 3; k++) CHECK(tl_pdisk_spill(d, &at[k], name_of(&m, &at[k]), blocks[k]), "spill %d", k);
    CHECK(tl_pdisk_bytes(d) == 3 * one, "disk bytes %zu", tl_pdisk_bytes(d));
    /* a spill whose file serves writes nothing and is no use: 0 stays the least recently used */
    CHECK(!tl_pdisk_spill(d, &at[0], name_of(&m, &at[0]), blocks[0]), "a file that serves was written again");
    CHECK(fetch_equals(d, &m, &at[1], 2, blocks[1]), "block 1 read back differs"); /* order 0, 2, 1 */
    CHECK(!fetch_equals(d, &m, &at[2], 3, blocks[2]), "a block of 2 layers served 3");
    CHECK(tl_pdisk_spill(d, &at[3], name_of(&m, &at[3]), blocks[3]), "spill 3");
    CHECK(!exists(dir, names[0]) && exists(dir, names[1]) && exists(dir, names[2]) && exists(dir, names[3]),
          "the least recently used file (0) was not the one removed");
    CHECK(tl_pdisk_bytes(d) == 3 * one, "disk bytes %zu", tl_pdisk_bytes(d));
    CHECK(!fetch_equals(d, &m, &at[0], 2, blocks[0]), "a removed file was read");
    tl_pdisk_free(d);

    /* a reopen orders by modification time: 2, 3, 1; reading 2 makes it the newest */
    set_mtime(dir, names[2], 1000000);
    set_mtime(dir, names[3], 2000000);
    set_mtime(dir, names[1], 3000000);
    char notes[1024]; /* not a block file: neither counted nor removed */
    snprintf(notes, sizeof notes, "%s/notes.txt", dir);
    write_path(notes, (const uint8_t*)"x", 1);
    CHECK_OK(tl_pdisk_open(dir, 3 * one, &m, &d));
    CHECK(tl_pdisk_bytes(d) == 3 * one, "reopen: disk bytes %zu", tl_pdisk_bytes(d));
    CHECK(fetch_equals(d, &m, &at[2], 1, blocks[2]), "block 2 read back differs after a reopen");
    CHECK(tl_pdisk_spill(d, &at[4], name_of(&m, &at[4]), blocks[4]), "spill 4");
    CHECK(!exists(dir, names[3]) && exists(dir, names[2]) && exists(dir, names[1]) && exists(dir, names[4]),
          "after a reopen the least recently used file (3) was not the one removed");

    /* a deeper block replaces a shallower file; a file over the whole budget is not written */
    tl_kv_block* deeper = random_block(&m, &t, 3, 0, &rng);
    CHECK(tl_pdisk_spill(d, &at[1], name_of(&m, &at[1]), deeper), "a deeper block was not written");
    CHECK(fetch_equals(d, &m, &at[1], 3, deeper), "the deeper block read back differs");
    CHECK(tl_pdisk_bytes(d) <= 3 * one && !exists(dir, names[2]) && exists(dir, names[4]),
          "disk bytes %zu (budget %zu), or not the least recently used file (2) removed", tl_pdisk_bytes(d), 3 * one);
    tl_pdisk_free(d);
    CHECK_OK(tl_pdisk_open(dir, one - 1, &m, &d));
    CHECK(!tl_pdisk_spill(d, &at[0], name_of(&m, &at[0]), blocks[0]) && !exists(dir, names[0]),
          "a file larger than the budget was written");
    tl_pdisk_free(d);

    /* no temporary file is left behind; a foreign file is left alone */
    listing* l = malloc(sizeof *l);
    list_dir(dir, l);
    for (size_t i = 0; i < l->n; i++) CHECK(strstr(l->names[i], ".tmp") == NULL, "left behind: %s", l->names[i]);
    CHECK(exists(dir, "notes.txt"), "a file not named *.tlblock was removed");
    free(l);
    for (int k = 0; k < 5; k++) tl_kv_clear(&keep[k]);
    tl_kv_clear(&t);
    drop_dir(dir);
}

/* A process id that no longer runs: a child's, reaped. */
static pid_t dead_pid(void) {
    const pid_t child = fork();
    if (child == 0) _exit(0);
    int status = 0;
    CHECK(child > 0 && waitpid(child, &status, 0) == child, "fork / waitpid");
    return child;
}

/* A writer killed between creating its temporary file and renaming it leaves the file: the
 * next open removes it (a budget would never count it), keeps a running process's, and counts
 * the block files as before. */
/* A tier with no budget in a fresh directory `name`, and one block of 2 layers at block 0 of
 * random tokens (no salt) to spill into it. */
typedef struct one_block {
    char* dir;
    tl_block_model m;
    int32_t tokens[BS];
    tl_block_place at;
    tl_kv_table t;
    tl_kv_block* b;
    tl_pdisk* d;
} one_block;

static void one_block_open(one_block* o, const char* name, uint64_t seed) {
    o->dir = fresh_dir(name);
    o->m = block_model(8);
    for (int i = 0; i < BS; i++) o->tokens[i] = tu_uniform(&seed, 0, (int32_t)V - 1);
    o->at = (tl_block_place){"", 0, 0, 0, o->tokens, 0};
    o->t = (tl_kv_table){0};
    o->b = random_block(&o->m, &o->t, 2, 0, &seed);
    o->d = NULL;
    CHECK_OK(tl_pdisk_open(o->dir, 0, &o->m, &o->d));
}

static void one_block_close(one_block* o) {
    tl_pdisk_free(o->d);
    tl_kv_clear(&o->t);
    drop_dir(o->dir);
}

static void test_stale_temps(void) {
    one_block o;
    one_block_open(&o, "temps", 5);
    const char* dir = o.dir;
    char name[32], stale[128], live[128], odd[128], path[1024];
    file_name(&o.m, &o.at, name);
    CHECK(tl_pdisk_spill(o.d, &o.at, name_of(&o.m, &o.at), o.b), "spill");
    const size_t bytes = tl_pdisk_bytes(o.d);
    tl_pdisk_free(o.d);
    snprintf(stale, sizeof stale, ".%s.%ld.0.tmp", name, (long)dead_pid());
    snprintf(live, sizeof live, ".%s.%ld.1.tmp", name, (long)getpid());
    snprintf(odd, sizeof odd, ".%s.x.2.tmp", name); /* not a pid: not ours to remove */
    const char* temps[] = {stale, live, odd};
    for (int k = 0; k < 3; k++) {
        snprintf(path, sizeof path, "%s/%s", dir, temps[k]);
        write_path(path, (const uint8_t*)"partial", 7);
    }
    CHECK_OK(tl_pdisk_open(dir, 0, &o.m, &o.d));
    CHECK(!exists(dir, stale), "a dead writer's temporary file was left");
    CHECK(exists(dir, live) && exists(dir, odd), "a running writer's (or a foreign) temporary file was removed");
    CHECK(exists(dir, name) && tl_pdisk_bytes(o.d) == bytes, "disk bytes %zu, were %zu", tl_pdisk_bytes(o.d), bytes);
    one_block_close(&o);
}

/* A full disk (here: a file size limit below one block file, so every write fails as it would
 * with ENOSPC): the spill is not written and counted as a failed write, no file or temporary
 * file is left, the tier's bytes stay 0, and a later spill with room succeeds. */
static void test_full_disk(void) {
    one_block o;
    one_block_open(&o, "full", 9);
    struct rlimit was;
    CHECK(getrlimit(RLIMIT_FSIZE, &was) == 0, "getrlimit");
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN); /* the write fails with EFBIG instead */
    const struct rlimit small = {HEADER, was.rlim_max};
    CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0, "setrlimit");
    const bool written = tl_pdisk_spill(o.d, &o.at, name_of(&o.m, &o.at), o.b);
    CHECK(setrlimit(RLIMIT_FSIZE, &was) == 0, "setrlimit back");
    signal(SIGXFSZ, old_handler);
    CHECK(!written && tl_pdisk_failed_writes(o.d) == 1 && tl_pdisk_bytes(o.d) == 0,
          "a write past the limit: written %d, failed writes %llu, bytes %zu", written,
          (unsigned long long)tl_pdisk_failed_writes(o.d), tl_pdisk_bytes(o.d));
    listing* l = malloc(sizeof *l);
    list_dir(o.dir, l);
    CHECK(l->n == 0, "a failed write left %zu files (%s)", l->n, l->n ? l->names[0] : "");
    free(l);
    CHECK(tl_pdisk_spill(o.d, &o.at, name_of(&o.m, &o.at), o.b) && tl_pdisk_failed_writes(o.d) == 1,
          "with room again the spill was not written");
    one_block_close(&o);
}

/* A file another tier (process) wrote joins this tier's index when a fetch reads it: counted in
 * its bytes, the most recently used, at its size now (a deeper file that replaced a counted one). */
static void test_tier_join(void) {
    char* dir = fresh_dir("join");
    const tl_block_model m = block_model(8);
    uint64_t rng = 5;
    int32_t tokens[3][BS];
    tl_block_place at[3];
    char names[3][32];
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < BS; i++) tokens[k][i] = tu_uniform(&rng, 0, (int32_t)V - 1);
        at[k] = (tl_block_place){"", 0, 0, 0, tokens[k], 0};
        file_name(&m, &at[k], names[k]);
    }
    const size_t one = tl_block_file_size(&m, 0, 0, 2), deep = tl_block_file_size(&m, 0, 0, 3);
    tl_kv_table t = {0}, keep[4] = {{0}};
    tl_kv_block* blocks[4];
    for (int k = 0; k < 4; k++) {
        blocks[k] = random_block(&m, &t, k == 3 ? 3 : 2, 0, &rng);
        CHECK_OK(tl_kv_share(&keep[k], &t));
    }
    tl_pdisk *d = NULL, *other = NULL;
    CHECK_OK(tl_pdisk_open(dir, 2 * one, &m, &d));
    CHECK_OK(tl_pdisk_open(dir, 0, &m, &other));
    CHECK(tl_pdisk_spill(d, &at[0], name_of(&m, &at[0]), blocks[0]), "spill 0");
    CHECK(tl_pdisk_spill(other, &at[1], name_of(&m, &at[1]), blocks[1]), "another tier's spill 1");
    CHECK(tl_pdisk_bytes(d) == one, "disk bytes %zu before the read, want %zu", tl_pdisk_bytes(d), one);
    CHECK(fetch_equals(d, &m, &at[1], 2, blocks[1]), "another tier's file read back differs");
    CHECK(tl_pdisk_bytes(d) == 2 * one, "disk bytes %zu after the read, want %zu", tl_pdisk_bytes(d), 2 * one);
    CHECK(tl_pdisk_spill(d, &at[2], name_of(&m, &at[2]), blocks[2]), "spill 2");
    CHECK(!exists(dir, names[0]) && exists(dir, names[1]) && exists(dir, names[2]) && tl_pdisk_bytes(d) == 2 * one,
          "the file read (1) was not the most recently used: %zu bytes", tl_pdisk_bytes(d));
    CHECK(tl_pdisk_spill(other, &at[1], name_of(&m, &at[1]), blocks[3]), "another tier's deeper spill 1");
    CHECK(fetch_equals(d, &m, &at[1], 2, blocks[3]), "the deeper file read back differs");
    CHECK(tl_pdisk_bytes(d) == one + deep, "disk bytes %zu after reading a deeper file, want %zu", tl_pdisk_bytes(d),
          one + deep);
    tl_pdisk_free(other);
    tl_pdisk_free(d);
    for (int k = 0; k < 4; k++) tl_kv_clear(&keep[k]);
    tl_kv_clear(&t);
    drop_dir(dir);
}

/* A device whose memory is the host's, copied by its hooks (NULL hooks: a device without). */
static void* fake_alloc(void* ctx, size_t bytes) { return calloc(1, bytes); }
static void fake_free(void* ctx, void* data) { free(data); }
static int fake_copy(void* ctx, void* to, const void* from, size_t bytes) {
    memcpy(to, from, bytes);
    return 0;
}

/* Device blocks go through the staging hooks: the file of a device block is the host block's
 * file, and a fetch fills a device block with the same values; without hooks, neither. */
static void test_tier_device(void) {
    char* dir = fresh_dir("device");
    const tl_kv_allocator dev = {fake_alloc, fake_free, NULL, fake_copy, fake_copy, fake_copy};
    const tl_kv_allocator no_copy = {fake_alloc, fake_free, NULL, NULL, NULL, NULL};
    const tl_block_model host = block_model(8);
    tl_block_model m = host;
    m.geom.device = &dev;
    uint64_t rng = 77;
    int32_t tokens[BS];
    for (int i = 0; i < BS; i++) tokens[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    const tl_block_place at = {"", 0, 0, 0, tokens, 0};
    tl_kv_table t = {0}, h = {0};
    tl_kv_block* b = random_block(&m, &t, 2, 0, &rng);
    CHECK_OK(tl_kv_reserve(&h, &host.geom, 2, 0, BS));
    memcpy(h.spans[0].block->data, b->data, 2 * host.geom.n_kv_heads * host.geom.head_bytes);
    const size_t n = tl_block_file_size(&host, 0, 0, 2);
    uint8_t* want = malloc(n);
    CHECK_OK(tl_block_file_encode(&host, &at, h.spans[0].block, NULL, want));
    tl_pdisk* d = NULL;
    CHECK_OK(tl_pdisk_open(dir, 0, &m, &d));
    CHECK(tl_pdisk_spill(d, &at, name_of(&m, &at), b), "a device block was not spilled");
    char name[32], path[1024];
    file_name(&m, &at, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t got_n;
    uint8_t* got = read_path(path, &got_n);
    CHECK(got && got_n == n && !memcmp(got, want, n), "a device block's file differs from the host block's");
    CHECK(fetch_equals(d, &m, &at, 2, h.spans[0].block), "a fetch into a device block differs");
    tl_pdisk_free(d);
    m.geom.device = &no_copy;
    CHECK_OK(tl_pdisk_open(dir, 0, &m, &d));
    tl_kv_table none = {0};
    CHECK(!tl_pdisk_fetch(d, &at, name_of(&m, &at), 2, &none) && none.n_spans == 0,
          "a device without copies fetched a block");
    tl_kv_clear(&none);
    unlink(path);
    CHECK(!tl_pdisk_spill(d, &at, name_of(&m, &at), b) && !exists(dir, name), "a device without copies spilled");
    tl_pdisk_free(d);
    free(got);
    free(want);
    tl_kv_clear(&t);
    tl_kv_clear(&h);
    drop_dir(dir);
}

/* ---- the reader under mutation --------------------------------------------------------------- */

/* What a check is for: the model, the place and the layer count a lookup needs. */
typedef struct check_for {
    const tl_block_model* m;
    const tl_block_place* at;
    uint32_t n_layers;
} check_for;

/* Checking bytes[0 .. n) for ctx (a check_for) either passes or fails as TL_ERR_BAD_FILE naming
 * the spilled block file; 1 when it passes. */
static int try_check(void* ctx, const uint8_t* bytes, size_t n, const char* what, size_t k) {
    const check_for* f = ctx;
    const tl_status st = tl_block_file_check(f->m, bytes, n, f->at, f->n_layers);
    CHECK(st == TL_OK || (st == TL_ERR_BAD_FILE && strstr(tl_last_error(), "bad spilled block file: ")),
          "%s at %zu: status %d (%s)", what, k, st, tl_last_error());
    return st == TL_OK;
}

static void check_bad(const tl_block_model* m, const uint8_t* bytes, size_t n, const tl_block_place* at,
                      uint32_t n_layers, const char* want, const char* what) {
    const tl_status st = tl_block_file_check(m, bytes, n, at, n_layers);
    CHECK(st == TL_ERR_BAD_FILE, "%s: status %d", what, st);
    CHECK(strstr(tl_last_error(), want) != NULL, "%s: message \"%s\" lacks \"%s\"", what, tl_last_error(), want);
}

static void test_mutations(uint32_t kv_bits) {
    const tl_block_model m = block_model(kv_bits);
    uint64_t rng = 21;
    int32_t tokens[2 * BS];
    for (int i = 0; i < 2 * BS; i++) tokens[i] = tu_uniform(&rng, 0, (int32_t)V - 1);
    const tl_block_place at = {"ab", 6, 0, 1, tokens, 0};
    tl_kv_table t = {0};
    tl_kv_block* b = random_block(&m, &t, 2, 1, &rng);
    const size_t n = tl_block_file_size(&m, 2, 1, 2);
    uint8_t* file = malloc(n);
    CHECK_OK(tl_block_file_encode(&m, &at, b, NULL, file));
    CHECK_OK(tl_block_file_check(&m, file, n, &at, 2));
    CHECK_OK(tl_block_file_check(&m, file, n, &at, 1));
    check_for two = {&m, &at, 2};
    const int passed = tu_mutate(try_check, &two, file, n, tu_next(&rng), 2000);
    printf("mutations of a %zu-byte int%u block file: %d of the checksum-fixed ones still pass\n", n, kv_bits, passed);

    const size_t R = tl_kv_row_bytes(&m.geom), records = HEADER + 2 + 4 * 2 * BS, last = n - (2 * R + 8);
    uint8_t* x = malloc(n);
    const tu_field cases[] = {
        {0, 1, 'X', "bad magic"},
        {8, 4, 2, "version: unsupported 2"},
        {12, 4, 95, "header_bytes"},
        {16, 8, n + 1, "file_bytes: header says"},
        {28, 4, m.checksum ^ 1, "spilled by another model (checksum"},
        {32, 8, m.file_bytes + 1, "spilled by another model (file_bytes"},
        {40, 4, 5, "kv_mode: unknown 5"},
        {40, 4, kv_bits == 8 ? 1 : 0, kv_bits == 8 ? "spilled with kv_mode int4; this model runs int8"
                                                    : "spilled with kv_mode int8; this model runs int4"},
        {68, 4, 3, "n_kv_heads: 3"},
        {72, 4, 14, "head_dim: 14"},
        {52, 4, 0, "block_size: 0"},
        {52, 4, 65537, "block_size: 65537"},
        {56, 4, 65537, "salt_bytes: 65537"},
        {60, 4, 16, "block_index: 16"},
        {60, 4, 0xffffffffu, "block_index"},
        {64, 4, 0, "n_layers: 0"},
        {64, 4, 65537, "n_layers: 65537"},
        {64, 4, 3, "file_bytes: "},
        {56, 4, 3, "file_bytes: "},
        {76, 4, 1, "instruction: 1, the request's 0"},
        {80, 4, 1, "reserved: header bytes 80 .. 95"},
        {92, 4, 1u << 24, "reserved"},
        {HEADER + 2 + 4 * 3, 4, V, "tokens[3]"},
        {HEADER + 2 + 4 * 5, 4, 0xffffffffu, "tokens[5]: -1"},
        {records + 1, 1, 0x80, kv_bits == 8 ? "the key row holds -128" : "the key row holds the nibble -8"},
        {last + 2 * R - 1, 1, 0x08, kv_bits == 8 ? NULL : "the value row holds the nibble -8"},
        {last + 2 * R - 1, 1, 0x80, kv_bits == 8 ? "the value row holds -128" : "the value row holds the nibble -8"},
        {last + 2 * R, 4, 0xbf800000u, "the key scale is -1"},
        {last + 2 * R + 4, 4, 0x7fc00000u, "the value scale is nan"},
        {44, 4, 0, "window: 0, the request's 6"},
        {48, 4, 2, "tree_depth: 2"},
        {HEADER, 1, 'x', "salt"},
        {HEADER + 2 + 4 * 6, 4, (uint32_t)(tokens[6] + 1) % V, "tokens[6]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tu_field* c = &cases[i];
        if (!c->message) continue;
        memcpy(x, file, n);
        tu_set_field(x, c);
        if (c->at != 16) tu_fix_checksum(x, n);
        char what[48];
        snprintf(what, sizeof what, "field at %zu", c->at);
        check_bad(&m, x, n, &at, 2, c->message, what);
    }
    check_bad(&m, file, n, &at, 3, "n_layers: 2 does not serve a request of 3", "a shallower block");
    { /* a whole file of block size 2 (its records valid) the size of this one: never read as of size 4 */
        const size_t salt = n - HEADER - 4 * 2 * 2 - 2 * 2 * m.geom.n_kv_heads * (2 * R + 8);
        uint8_t* other = calloc(1, n); /* exactly n bytes: ASan sees any read past them */
        memcpy(other, file, HEADER);
        tu_put_u32(other + 52, 2);
        tu_put_u32(other + 56, (uint32_t)salt);
        tu_fix_checksum(other, n);
        check_bad(&m, other, n, &at, 2, "block_size: 2, this model's 4", "a file of another block size");
        free(other);
    }
    const tl_block_place coda = {"ab", 6, 2, 1, tokens, 0};
    memcpy(x, file, n);
    tu_put_u32(x + 48, 2);
    tu_fix_checksum(x, n);
    CHECK_OK(tl_block_file_check(&m, x, n, &coda, 2));
    check_bad(&m, x, n, &coda, 1, "does not serve", "a coda tree's block of other depth");
    memcpy(x, file, n); /* +inf scales are allowed */
    tu_put_u32(x + last + 2 * R, 0x7f800000u);
    tu_fix_checksum(x, n);
    CHECK_OK(tl_block_file_check(&m, x, n, &at, 2));

    /* the same damage through the directory: a miss, never a crash */
    char* dir = fresh_dir("fuzz");
    tl_pdisk* d = NULL;
    CHECK_OK(tl_pdisk_open(dir, 0, &m, &d));
    char name[32], path[1024];
    file_name(&m, &at, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    for (int k = 0; k < 200; k++) {
        memcpy(x, file, n);
        const size_t len = k % 4 == 0 ? (size_t)(tu_next(&rng) % n) : n;
        if (k % 4) x[tu_next(&rng) % n] ^= (uint8_t)(1 + tu_next(&rng) % 255);
        if (k % 2) tu_fix_checksum(x, len);
        write_path(path, x, len);
        tl_kv_table got = {0};
        const bool hit = tl_pdisk_fetch(d, &at, name_of(&m, &at), 2, &got);
        CHECK(hit == (tl_block_file_check(&m, x, len, &at, 2) == TL_OK) && got.n_spans == (hit ? 1u : 0u),
              "fetch of damaged file %d: hit %d", k, hit);
        tl_kv_clear(&got);
    }
    write_path(path, file, n);
    CHECK(fetch_equals(d, &m, &at, 2, b), "the intact file read back differs");
    tl_pdisk_free(d);
    drop_dir(dir);
    free(x);
    free(file);
    tl_kv_clear(&t);
}

/* ---- threads --------------------------------------------------------------------------------- */

typedef struct racer {
    tl_model* m;
    const workload* w;
    tu_result* want; /* [N_PROMPTS] */
    int seed;
} racer;

static void* race(void* arg) {
    racer* r = arg;
    const request req = {2, 0, NULL};
    for (int k = 0; k < 2 * N_PROMPTS; k++) {
        const int p = (k * 5 + r->seed) % N_PROMPTS;
        const tl_gen_params gp = params_of(req, p);
        tu_result got = tu_generate(r->m, r->w->tokens[p], r->w->n[p], &gp, V);
        CHECK(tu_same_result(&got, &r->want[p]), "thread %d, prompt %d: tokens or logits differ", r->seed, p);
        tu_result_free(&got);
    }
    return NULL;
}

static void test_threads(const setup* s) {
    char* dir = fresh_dir("threads");
    const workload w = make_workload(33);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    tu_result want[N_PROMPTS];
    for (int p = 0; p < N_PROMPTS; p++) {
        const tl_gen_params gp = params_of((request){2, 0, NULL}, p);
        want[p] = tu_generate(plain, w.tokens[p], w.n[p], &gp, V);
    }
    tl_model* m = open_disk(s->path, 4000, dir, 6000, TL_KV_INT8);
    enum { N = 4 };
    pthread_t threads[N];
    racer r[N];
    for (int i = 0; i < N; i++) {
        r[i] = (racer){m, &w, want, i};
        CHECK(pthread_create(&threads[i], NULL, race, &r[i]) == 0, "thread %d", i);
    }
    for (int i = 0; i < N; i++) pthread_join(threads[i], NULL);
    const tl_prefix_cache_stats st = tu_cache_stats(m);
    CHECK(st.spilled_blocks > 0 && st.disk_hit_blocks > 0 && st.disk_bytes <= 6000,
          "threads: %llu spilled, %llu disk hits, %zu disk bytes", (unsigned long long)st.spilled_blocks,
          (unsigned long long)st.disk_hit_blocks, st.disk_bytes);
    tl_model_free(m);
    for (int p = 0; p < N_PROMPTS; p++) tu_result_free(&want[p]);
    tl_model_free(plain);
    drop_dir(dir);
}

/* A disk budget under the cache's size: every model's files stay within it. */
static void test_disk_budget(const setup* s) {
    char* dir = fresh_dir("budget");
    const workload w = make_workload(41);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    const size_t budget = 5000; /* about four files of a depth-2 block */
    for (int k = 0; k < 2; k++) {
        tl_model* m = open_disk(s->path, 2500, dir, budget, TL_KV_INT8);
        for (int p = 0; p < N_PROMPTS; p++) {
            const tl_gen_params gp = params_of((request){2, 0, NULL}, p);
            tu_result got = tu_generate(m, w.tokens[p], w.n[p], &gp, V);
            tu_result want = tu_generate(plain, w.tokens[p], w.n[p], &gp, V);
            CHECK(tu_same_result(&got, &want), "disk budget, prompt %d: tokens or logits differ", p);
            tu_result_free(&got);
            tu_result_free(&want);
            const tl_prefix_cache_stats st = tu_cache_stats(m);
            CHECK(st.disk_bytes <= budget, "%zu disk bytes over a budget of %zu", st.disk_bytes, budget);
        }
        tl_model_free(m);
        listing* l = malloc(sizeof *l);
        list_dir(dir, l);
        CHECK(l->bytes <= budget && l->n > 0, "after close: %zu bytes in %zu files, budget %zu", l->bytes, l->n,
              budget);
        free(l);
    }
    tl_model_free(plain);
    drop_dir(dir);
}

/* The scheduler's lookups read the disk tier too, under a KV budget: every request gets the
 * tokens of its own tl_generate on a cache-less model. */
static void test_sched(const setup* s) {
    char* dir = fresh_dir("sched");
    const workload w = make_workload(61);
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    tl_model* m = open_disk(s->path, 1 << 24, dir, 0, TL_KV_INT8);
    run_workload(m, plain, &w, (request){2, 0, NULL}, "sched, filling");
    tl_model_free(m); /* every block on disk */
    m = open_disk(s->path, 2500, dir, 0, TL_KV_INT8);
    tl_sched_params sp = tl_sched_params_default();
    sp.max_batch = 4;
    sp.step_tokens = 8;
    sp.kv_budget_bytes = 12000;
    tl_sched* sched = NULL;
    CHECK_OK(tl_sched_create(m, &sp, &sched));
    uint64_t ids[N_PROMPTS];
    int32_t want[N_PROMPTS][MAX_NEW], got[N_PROMPTS][MAX_NEW];
    size_t n_got[N_PROMPTS] = {0};
    const tl_gen_params gp = tu_gen_params(MAX_NEW, 2, 0, 0, 1);
    for (int p = 0; p < N_PROMPTS; p++) {
        size_t n;
        CHECK_OK(tl_generate(plain, w.tokens[p], w.n[p], &gp, want[p], &n, NULL));
        CHECK_OK(tl_sched_add(sched, w.tokens[p], w.n[p], &gp, &ids[p]));
    }
    tu_sched_drain(sched, ids, N_PROMPTS, &got[0][0], MAX_NEW, n_got, 1000);
    for (int p = 0; p < N_PROMPTS; p++)
        CHECK(n_got[p] == MAX_NEW && !memcmp(got[p], want[p], sizeof got[p]), "scheduled prompt %d: tokens differ", p);
    CHECK(tu_cache_stats(m).disk_hit_blocks > 0, "the scheduler read nothing from disk");
    tl_sched_free(sched);
    tl_model_free(m);
    tl_model_free(plain);
    drop_dir(dir);
}

/* ---- allocation failures --------------------------------------------------------------------- */

/* Open a model with a tiny cache on dir, three greedy prompts (disk hits, spills), close. */
static tl_status op_disk(const setup* s, const char* dir, const workload* w, int32_t want[3][MAX_NEW]) {
    tl_model_params p = tl_model_params_default();
    p.n_threads = 2;
    p.kv_block_size = BS;
    p.prefix_cache_bytes = 2500;
    p.prefix_cache_dir = dir;
    tl_model* m = NULL;
    tl_status st = tl_model_open(s->path, &p, &m);
    for (int k = 0; st == TL_OK && k < 3; k++) {
        const tl_gen_params gp = tu_gen_params(MAX_NEW, 2, 0, 0, 1);
        int32_t out[MAX_NEW];
        size_t n = 0;
        st = tl_generate(m, w->tokens[k], w->n[k], &gp, out, &n, NULL);
        if (st == TL_OK)
            CHECK(n == MAX_NEW && !memcmp(out, want[k], sizeof out), "prompt %d: tokens differ under failures", k);
    }
    tl_model_free(m);
    return st;
}

static void test_alloc_failures(const setup* s) {
    char* dir = fresh_dir("alloc");
    const workload w = make_workload(51);
    int32_t want[3][MAX_NEW];
    tl_model* plain = open_disk(s->path, 0, NULL, 0, TL_KV_INT8);
    for (int k = 0; k < 3; k++) {
        const tl_gen_params gp = tu_gen_params(MAX_NEW, 2, 0, 0, 1);
        size_t n;
        CHECK_OK(tl_generate(plain, w.tokens[k], w.n[k], &gp, want[k], &n, NULL));
    }
    tl_model_free(plain);
    CHECK_OK(op_disk(s, dir, &w, want)); /* the files the sweep reads */
    const size_t baseline = tu_memory().bytes_in_use, before = tu_memory().total_allocs;
    CHECK_OK(op_disk(s, dir, &w, want));
    const size_t n_allocs = tu_memory().total_allocs - before;
    int failures = 0;
    for (size_t k = 0; k < n_allocs && tu_failures <= 10; k++) {
        tl_alloc_fail_after((int64_t)k);
        const tl_status st = op_disk(s, dir, &w, want);
        tl_alloc_fail_after(-1);
        if (st != TL_OK) {
            failures++;
            CHECK(st == TL_ERR_OUT_OF_MEMORY && strstr(tl_last_error(), "out of memory"), "k=%zu: status %d: %s", k, st,
                  tl_last_error());
        }
        CHECK(tu_memory().bytes_in_use == baseline, "k=%zu: %zu bytes leaked", k, tu_memory().bytes_in_use - baseline);
    }
    printf("disk tier: %zu allocations, %d injected failures reported\n", n_allocs, failures);
    drop_dir(dir);
}

int main(void) {
    tu_spec spec = tu_spec_default();
    V = spec.vocab;
    const setup plain = make_model("pdisk.tinyloop", spec);
    tu_spec other_spec = spec;
    other_spec.seed = 2;
    const setup other = make_model("pdisk-other.tinyloop", other_spec);
    const setup coda = make_model("pdisk-coda.tinyloop", tu_spec_coda());
    test_open_errors(&plain);
    test_stale_temps();
    test_full_disk();
    test_tier_budget();
    test_tier_join();
    test_tier_device();
    test_mutations(8);
    test_mutations(4);
    test_spill_and_hits(&plain, TL_KV_INT8, (request){2, 0, NULL}, "int8");
    test_spill_and_hits(&plain, TL_KV_INT4, (request){3, 0, NULL}, "int4");
    test_spill_and_hits(&plain, TL_KV_INT8, (request){1, 6, "tenant"}, "window 6, salt");
    test_spill_and_hits(&coda, TL_KV_INT8, (request){2, 0, NULL}, "coda");
    test_close_spills(&plain);
    test_close_order(&plain);
    test_depths(&plain);
    test_bad_files(&plain, &other, plain.path);
    test_disk_budget(&plain);
    test_threads(&plain);
    test_sched(&plain);
    test_alloc_failures(&plain);
    return tu_finish("test_pcache_disk");
}
