/* fuzz_util.c — the harnesses' shared set-up (fuzz_util.h). */
#include "fuzz_util.h"

#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

uint8_t* fuzz_sealed_copy(const uint8_t* data, size_t n) {
    uint8_t* x = malloc(n ? n : 1);
    FUZZ_REQUIRE(x != NULL, "cannot copy %zu bytes", n);
    if (n) memcpy(x, data, n);
    if (n >= 24) tu_put_u64(x + 16, n);
    if (n >= 28) tu_fix_checksum(x, n);
    return x;
}

tu_spec fuzz_blob_model_spec(void) {
    tu_spec s = tu_spec_rich();
    s.vocab = 64, s.d = 32, s.heads = 4, s.kv_heads = 2, s.head_dim = 8, s.ffn = 48, s.max_seq = 24;
    s.hf = 0, s.meta = 0;
    return s;
}

tl_block_model fuzz_block_model(uint32_t kv_bits) {
    return (tl_block_model){0x5eed1e55u, 6000, FUZZ_BLOCK_MAX_SEQ, 97, tl_kv_geom_make(8, 2, 12, kv_bits)};
}

const char* fuzz_memory_file(const uint8_t* bytes, size_t n) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("tinyloop-fuzz", MFD_CLOEXEC);
        if (fd < 0) {
            perror("memfd_create");
            exit(2);
        }
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (n && pwrite(fd, bytes, n, 0) != (ssize_t)n)) {
        perror("writing the in-memory file");
        exit(2);
    }
    return path;
}

tl_model* fuzz_open_spec(const tu_spec* spec, tl_kv_mode mode) {
    size_t n = 0;
    uint8_t* bytes = tu_model_bytes(spec, &n);
    tl_model_params p = tl_model_params_default();
    p.n_threads = 1, p.kv_block_size = 4, p.kv_mode = mode;
    tl_model* m = NULL;
    const tl_status st = tl_model_open(fuzz_memory_file(bytes, n), &p, &m);
    free(bytes);
    if (st != TL_OK) {
        fprintf(stderr, "cannot open the harness's model: %s\n", tl_last_error());
        exit(2);
    }
    return m;
}

const char* fuzz_verdicts_path(void) {
    const char* path = getenv("TINYLOOP_FUZZ_VERDICTS");
    return path && *path ? path : NULL;
}

void fuzz_verdict(tl_status st) {
    const char* path = fuzz_verdicts_path();
    if (!path) return;
    FILE* f = fopen(path, "a");
    FUZZ_REQUIRE(f != NULL, "cannot append to %s", path);
    if (st == TL_OK) fputs("accepted", f);
    for (const char* c = st == TL_OK ? "" : tl_last_error(); *c; c++) fputc(*c == '\n' ? ' ' : *c, f);
    fputc('\n', f);
    fclose(f);
}

int fuzz_all_finite(const float* x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}
