/* matmul.c — run a prepared linear over the thread pool: rows are cut into blocks of whole
 * tiles and each block runs every token through its path's kernel (on AMX, the tile kernel
 * for TL_AMX_MIN_TOKENS tokens or more, else AVX-512). Blocks write disjoint outputs and
 * compute exact integers, so the split never changes a result. */
#include "cpu/matmul.h"

#include <string.h>

enum {
    ITEMS_PER_THREAD = 8, /* blocks per pool thread: small enough to even out a slow thread */
    BLOCK_TILES = 4       /* blocks hold whole kernel panels (the widest is 4 tiles)        */
};

typedef struct linear_job {
    const tl_linear* lin;
    const tl_acts* acts;
    tl_gemm_fn kernel; /* NULL: the AMX tile kernel */
    uint32_t rows_per_item;
    float* y;
    size_t y_stride;
    bool accumulate;
} linear_job;

static void run_rows(void* ctx, size_t item, unsigned worker) {
    const linear_job* job = ctx;
    const tl_acts* A = job->acts;
    const uint32_t R = job->lin->src.rows;
    const uint32_t row0 = (uint32_t)item * job->rows_per_item;
    const uint32_t row1 = row0 + job->rows_per_item < R ? row0 + job->rows_per_item : R;
    if (job->kernel) job->kernel(job->lin, A, row0, row1, job->y, job->y_stride, job->accumulate);
    else tl_gemm_amx(job->lin, A, row0, row1, job->y, job->y_stride, job->accumulate,
                     A->scratch ? A->scratch + worker * A->scratch_bytes : NULL);
}

static bool on_tiles(tl_isa isa, size_t n) { return isa == TL_ISA_AMX && n >= TL_AMX_MIN_TOKENS; }

size_t tl_linear_scratch_bytes(tl_isa isa, size_t n, size_t cols) {
    return on_tiles(isa, n) ? tl_amx_scratch_bytes(cols) : 0;
}

static size_t tile_rows_of(size_t n) { return (n + 15) / 16 * 16; }

size_t tl_acts_tiled_bytes(tl_isa isa, size_t n, size_t cols) {
    return on_tiles(isa, n) ? tile_rows_of(n) * tl_acts_stride(cols) : 0;
}

/* item = a token tile: its 16 rows of q (zeros past n) into acts->tiled, one 16 x 64 block per
 * 64 columns. */
static void tile_rows(void* ctx, size_t item, unsigned worker) {
    (void)worker;
    const tl_acts* A = ctx;
    const size_t blocks = A->stride / 64;
    int8_t* out = A->tiled + item * blocks * 1024;
    for (size_t kb = 0; kb < blocks; kb++)
        for (size_t r = 0; r < 16; r++, out += 64) {
            const size_t t = 16 * item + r;
            if (t < A->n) memcpy(out, A->q + t * A->stride + 64 * kb, 64);
            else memset(out, 0, 64);
        }
}

void tl_acts_finish_row(tl_acts* A, size_t t) {
    const size_t K = A->stride; /* a local: the u8 stores below could alias *A, which kept GCC from vectorizing */
    const int8_t* q = A->q + t * K;
    uint8_t* qx = A->qx + t * K;
    for (size_t k = 0; k < K; k++) qx[k] = (uint8_t)q[k] ^ 0x80;
}

void tl_linear_run(const tl_linear* lin, const tl_acts* acts, float* y, size_t y_stride,
                   bool accumulate, tl_pool* pool) {
    linear_job job = {lin, acts, tl_gemm_scalar, 0, y, y_stride, accumulate};
    uint32_t tile = 16;
    if (lin->isa == TL_ISA_AVX2) job.kernel = tl_gemm_avx2;
    if (lin->isa == TL_ISA_AVX512_VNNI || lin->isa == TL_ISA_AMX) job.kernel = tl_gemm_avx512;
    if (on_tiles(lin->isa, acts->n)) {
        job.kernel = NULL;
        tl_pool_run(pool, tile_rows_of(acts->n) / 16, tile_rows, (void*)acts);
    }
    if (lin->isa != TL_ISA_SCALAR) tile = lin->tile_rows;
    const uint32_t R = lin->src.rows;
    const uint32_t tiles = (R + tile - 1) / tile;
    const uint32_t want_items = ITEMS_PER_THREAD * tl_pool_threads(pool);
    const uint32_t tiles_per_item = (tiles + want_items - 1) / want_items;
    job.rows_per_item = ((tiles_per_item + BLOCK_TILES - 1) / BLOCK_TILES) * BLOCK_TILES * tile;
    if (job.rows_per_item == 0) job.rows_per_item = BLOCK_TILES * tile;
    tl_pool_run(pool, (R + job.rows_per_item - 1) / job.rows_per_item, run_rows, &job);
}
