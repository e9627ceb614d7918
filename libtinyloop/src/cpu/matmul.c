/* matmul.c — run a prepared linear over the thread pool: rows are cut into blocks of whole
 * tiles and each block runs every q row through its path's kernel (on AMX, the tile kernel
 * for TL_AMX_MIN_TOKENS q rows or more, else AVX-512). With digit rows (block inputs) a block
 * runs DIGIT_ROWS output rows at a time into the worker's raw accumulators and combines each
 * token's two digit sums there. Blocks write disjoint outputs and compute exact integers, so the
 * split never changes a result. */
#include "cpu/matmul.h"

#include <string.h>

enum {
    ITEMS_PER_THREAD = 8, /* blocks per pool thread: small enough to even out a slow thread      */
    BLOCK_TILES = 4,      /* blocks hold whole kernel panels (the widest is 4 tiles)             */
    DIGIT_ROWS = 256      /* output rows per kernel call on digit rows: whole panels, and their
                             raw accumulators (2n x 256 i32) stay in cache for the combination */
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

static void run_kernel(const linear_job* job, uint32_t row0, const tl_gemm_out* out, unsigned worker) {
    const tl_acts* A = job->acts;
    if (job->kernel) job->kernel(job->lin, A, row0, out);
    else tl_gemm_amx(job->lin, A, row0, out, A->scratch ? A->scratch + worker * A->scratch_bytes : NULL);
}

/* y rows [row0, row1) of every token from its digit rows' raw accumulators (DIGIT_ROWS apart,
 * from row0): acc = 255 * acc_h + acc_l, exact in i64 (docs/spec.md §3), then the epilogue. */
static void combine_digits(const linear_job* job, const int32_t* raw, uint32_t row0, uint32_t row1) {
    const tl_acts* A = job->acts;
    const float* ws = tl_linear_scales(job->lin);
    for (size_t t = 0; t < A->n; t++) {
        const int32_t* high = raw + 2 * t * DIGIT_ROWS;
        const int32_t* low = high + DIGIT_ROWS;
        float* y = job->y + t * job->y_stride;
        for (uint32_t j = row0; j < row1; j++)
            tl_emit(&y[j], 255 * (int64_t)high[j - row0] + low[j - row0], A->scale[t], ws[j], job->accumulate);
    }
}

static void run_rows(void* ctx, size_t item, unsigned worker) {
    const linear_job* job = ctx;
    const tl_acts* A = job->acts;
    const uint32_t R = job->lin->src.rows;
    const uint32_t row0 = (uint32_t)item * job->rows_per_item;
    const uint32_t row1 = row0 + job->rows_per_item < R ? row0 + job->rows_per_item : R;
    if (!A->digits) {
        const tl_gemm_out out = {.row1 = row1, .y = job->y, .y_stride = job->y_stride, .accumulate = job->accumulate};
        run_kernel(job, row0, &out, worker);
        return;
    }
    int32_t* raw = A->raw + worker * (tl_acts_raw_bytes(A->n) / sizeof(int32_t));
    for (uint32_t r0 = row0; r0 < row1; r0 += DIGIT_ROWS) {
        const uint32_t r1 = row1 - r0 < DIGIT_ROWS ? row1 : r0 + DIGIT_ROWS;
        const tl_gemm_out out = {.row1 = r1, .raw = raw, .raw_stride = DIGIT_ROWS, .raw_row0 = r0};
        run_kernel(job, r0, &out, worker);
        combine_digits(job, raw, r0, r1);
    }
}

static bool on_tiles(tl_isa isa, size_t n) { return isa == TL_ISA_AMX && n >= TL_AMX_MIN_TOKENS; }

size_t tl_linear_scratch_bytes(tl_isa isa, size_t n, size_t cols) {
    return on_tiles(isa, n) ? tl_amx_scratch_bytes(cols) : 0;
}

static size_t tile_rows_of(size_t n) { return (n + 15) / 16 * 16; }

size_t tl_acts_tiled_bytes(tl_isa isa, size_t n, size_t cols) {
    return on_tiles(isa, n) ? tile_rows_of(n) * tl_acts_stride(cols) : 0;
}

size_t tl_acts_raw_bytes(size_t n) { return 2 * n * DIGIT_ROWS * sizeof(int32_t); }

/* item = a tile of q rows: its 16 rows (zeros past the last) into acts->tiled, one 16 x 64 block
 * per 64 columns. */
static void tile_rows(void* ctx, size_t item, unsigned worker) {
    (void)worker;
    const tl_acts* A = ctx;
    const size_t blocks = A->stride / 64, rows = tl_acts_rows(A);
    int8_t* out = A->tiled + item * blocks * 1024;
    for (size_t kb = 0; kb < blocks; kb++)
        for (size_t r = 0; r < 16; r++, out += 64) {
            const size_t t = 16 * item + r;
            if (t < rows) memcpy(out, A->q + t * A->stride + 64 * kb, 64);
            else memset(out, 0, 64);
        }
}

void tl_acts_finish_row(tl_acts* A, size_t r) {
    const size_t K = A->stride; /* a local: the u8 stores below could alias *A, which kept GCC from vectorizing */
    const int8_t* q = A->q + r * K;
    uint8_t* qx = A->qx + r * K;
    for (size_t k = 0; k < K; k++) qx[k] = (uint8_t)q[k] ^ 0x80;
}

void tl_linear_run(const tl_linear* lin, const tl_acts* acts, float* y, size_t y_stride,
                   bool accumulate, tl_pool* pool) {
    linear_job job = {lin, acts, tl_gemm_scalar, 0, y, y_stride, accumulate};
    uint32_t tile = 16;
    if (lin->isa == TL_ISA_AVX2) job.kernel = tl_gemm_avx2;
    if (lin->isa == TL_ISA_AVX512_VNNI || lin->isa == TL_ISA_AMX) job.kernel = tl_gemm_avx512;
    if (on_tiles(lin->isa, tl_acts_rows(acts))) {
        job.kernel = NULL;
        tl_pool_run(pool, tile_rows_of(tl_acts_rows(acts)) / 16, tile_rows, (void*)acts);
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
