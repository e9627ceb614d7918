/* gemm.cu — the exact integer linear of docs/spec.md §3 on the device:
 *
 *   y[t][j] = ((f32) acc[t][j] * a[t]) * ws[j]   (or y += that, one f32 addition)
 *   y[t][j] = (((f32) acc[t][j] * a[t]) * ws[j]) + b[j]   (a linear with a bias: attn_qkv)
 *
 * acc is an exact integer that fits in i32 (the loader proved the bound for every partial sum),
 * so the tiling and summation order below cannot change it. Kernels:
 *   - int8, T >= 16: tensor cores (nvcuda::wmma, s8 x s8 -> s32, m16n16k16), 128 x 128 tiles;
 *   - int8, T < 16:  a warp per output row, __dp4a over 16-byte chunks (decode GEMV);
 *   - int4, T < 16 and group size % 8 == 0: a warp per output row, __dp4a on unpacked nibbles,
 *     each 8-element word's partial sum times its group multiplier;
 *   - int4 otherwise: acc = 128 * (q . hi) + (q . lo) with m*w = 128*hi + lo (device.cu), two
 *     int8 passes: the first stores q . hi as raw i32, the second adds 128 * raw (mod 2^32: the
 *     true acc fits in i32, so the wrap-around result is exact) before the epilogue.
 * Block inputs (act_block, docs/spec.md §3: p = 255 * h + l, each token's digit rows h and l in
 * q) run the same kernels on the 2T digit rows, their accumulators (each a row input's, exact in
 * i32) stored raw, then one more kernel combines acc = 255 * acc_h + acc_l in i64 and applies the
 * epilogue, (f32) of that integer rounding once.
 * Shapes: q [T_pad][cols_pad] i8 (digits: [2T_pad]), weights [rows_pad][cols_pad] i8, y [T][ys] f32. */
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

/* What emit does with an accumulator: MODE_COMBINE first adds 128 * raw (int4's second pass);
 * then MODE_RAW stores it in raw, else the epilogue. */
enum { MODE_EMIT = 0, MODE_RAW = 1, MODE_COMBINE = 2 };

enum {
    BM = TL_CU_TILE_M, BN = TL_CU_TILE_N, BK = TL_CU_TILE_K,
    TC_THREADS = 256,   /* 8 warps: 2 along M (64 tokens each) x 4 along N (32 rows each) */
    FRAG = 256,         /* bytes of one 16 x 16 i8 fragment, stored contiguously (ldm 16) */
    GEMV_WARPS = 8
};

/* Where and how results go. */
typedef struct gemm_out {
    const float* a;     /* [T] input scales                */
    const float* ws;    /* [rows_pad] row scales           */
    const float* bias;  /* [rows_pad], or NULL             */
    float* y;
    size_t ys;
    int32_t* raw;       /* [T][ldr], modes RAW/COMBINE     */
    size_t ldr;
    int mode;
    int accumulate;
    int T, R;
} gemm_out;

/* The epilogue of matmul_kernels.h tl_emit (+ the bias) of the exact integer acc. */
static __device__ __forceinline__ void epilogue(const gemm_out& o, int t, int j, long long acc) {
    float v = ((float)acc * o.a[t]) * o.ws[j];
    if (o.bias) v = v + o.bias[j];
    float* y = o.y + (size_t)t * o.ys + j;
    *y = o.accumulate ? *y + v : v;
}

/* Accumulator acc of row t, output j, as o.mode says. */
static __device__ __forceinline__ void emit(const gemm_out& o, int t, int j, int acc) {
    if (o.mode & MODE_COMBINE) acc = (int)((unsigned)o.raw[(size_t)t * o.ldr + j] * 128u + (unsigned)acc);
    if (o.mode & MODE_RAW) o.raw[(size_t)t * o.ldr + j] = acc;
    else epilogue(o, t, j, acc);
}

/* Token t's outputs from its digit rows' raw accumulators: acc = 255 * acc_h + acc_l (rows 2t and
 * 2t + 1 of raw), exact in i64, then the epilogue. grid T. */
static __global__ void __launch_bounds__(256) combine_digits_kernel(gemm_out o) {
    const size_t t = blockIdx.x;
    const int32_t* high = o.raw + 2 * t * o.ldr;
    const int32_t* low = high + o.ldr;
    for (int j = threadIdx.x; j < o.R; j += blockDim.x) epilogue(o, (int)t, j, 255LL * high[j] + low[j]);
}

/* ---- tensor cores ---------------------------------------------------------------------------- */

/* Tile (blockIdx.y, blockIdx.x) = tokens [m0, m0 + 128) x rows [n0, n0 + 128). Each step stages
 * 128 x 64 bytes of A and of W in shared memory, fragment by fragment (each 16 x 16 block
 * contiguous, so every fragment pointer is 256-byte aligned), double-buffered: the loads of
 * step k+1 are in flight while step k multiplies. A rows up to the grid's end exist (T_pad). */
static __global__ void __launch_bounds__(TC_THREADS)
gemm_tc_kernel(const int8_t* __restrict__ A, const int8_t* __restrict__ W, int ld, gemm_out o) {
    __shared__ __align__(128) int8_t sA[2][BM * BK];
    __shared__ __align__(128) int8_t sB[2][BN * BK];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;
    const size_t m0 = (size_t)blockIdx.y * BM, n0 = (size_t)blockIdx.x * BN;

    wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc[4][2];
    #pragma unroll
    for (int i = 0; i < 4; i++)
        #pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0);

    /* chunk c = tid + 256 * i: row c / 4, 16-byte column c % 4 of the 64-byte step */
    int4 ra[2], rb[2];
    int soff[2];
    const int8_t* pa[2];
    const int8_t* pb[2];
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = tid + TC_THREADS * i, row = c >> 2, kc = c & 3;
        soff[i] = ((row >> 4) * 4 + kc) * FRAG + (row & 15) * 16;
        pa[i] = A + (m0 + row) * ld + kc * 16;
        pb[i] = W + (n0 + row) * ld + kc * 16;
        ra[i] = *(const int4*)pa[i];
        rb[i] = *(const int4*)pb[i];
    }
    const int steps = ld / BK;
    for (int s = 0; s < steps; s++) {
        int8_t* a_buf = sA[s & 1];
        int8_t* b_buf = sB[s & 1];
        #pragma unroll
        for (int i = 0; i < 2; i++) {
            *(int4*)(a_buf + soff[i]) = ra[i];
            *(int4*)(b_buf + soff[i]) = rb[i];
        }
        __syncthreads();
        if (s + 1 < steps) {
            #pragma unroll
            for (int i = 0; i < 2; i++) {
                ra[i] = *(const int4*)(pa[i] + (size_t)(s + 1) * BK);
                rb[i] = *(const int4*)(pb[i] + (size_t)(s + 1) * BK);
            }
        }
        #pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa[4];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb[2];
            #pragma unroll
            for (int i = 0; i < 4; i++) wmma::load_matrix_sync(fa[i], a_buf + ((wm * 4 + i) * 4 + kk) * FRAG, 16);
            #pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], b_buf + ((wn * 2 + j) * 4 + kk) * FRAG, 16);
            #pragma unroll
            for (int i = 0; i < 4; i++)
                #pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        /* no barrier here: the next step writes the other buffer, and the step after that
         * writes this one only after every warp passed the next step's barrier */
    }

    __syncthreads(); /* every warp is done with the tiles: reuse sA[0] as per-warp staging */
    int* stage = (int*)sA[0] + warp * 256;
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const size_t t = m0 + (size_t)(wm * 4 + i) * 16 + (e >> 4);
                const size_t r = n0 + (size_t)(wn * 2 + j) * 16 + (e & 15);
                if (t < (size_t)o.T && r < (size_t)o.R) emit(o, (int)t, (int)r, stage[e]);
            }
            __syncwarp();
        }
    }
}

/* ---- dp4a GEMV (few tokens) ------------------------------------------------------------------ */

static __device__ __forceinline__ int warp_sum(int v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* A warp per output row j; lanes stride the row in 16-byte chunks; tokens in passes of TB. */
template <int TB>
static __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_i8_kernel(const int8_t* __restrict__ A, const int8_t* __restrict__ W, int ld, gemm_out o) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= o.R) return;
    const int4* w = (const int4*)(W + (size_t)j * ld);
    const int chunks = ld / 16;
    for (int t0 = 0; t0 < o.T; t0 += TB) {
        int acc[TB];
        for (int b = 0; b < TB; b++) acc[b] = 0;
        #pragma unroll 4
        for (int c = lane; c < chunks; c += 32) {
            const int4 wv = w[c];
            for (int b = 0; b < TB; b++) { /* rows past T exist (T_pad) and are never emitted */
                const int4 qv = ((const int4*)(A + (size_t)(t0 + b) * ld))[c];
                acc[b] = __dp4a(wv.x, qv.x, acc[b]);
                acc[b] = __dp4a(wv.y, qv.y, acc[b]);
                acc[b] = __dp4a(wv.z, qv.z, acc[b]);
                acc[b] = __dp4a(wv.w, qv.w, acc[b]);
            }
        }
        for (int b = 0; b < TB; b++) acc[b] = warp_sum(acc[b]);
        if (lane == 0)
            for (int b = 0; b < TB && t0 + b < o.T; b++) emit(o, t0 + b, j, acc[b]);
    }
}

/* Bytes of x hold 4-bit two's-complement values in 0 .. 15: sign-extend each to an i8 byte.
 * (n ^ 8) + 0x78 stays below 0x100 (no carry between bytes); ^ 0x80 then subtracts 0x80 mod
 * 256, so each byte becomes n ^ 8 - 8, the nibble's value. */
static __device__ __forceinline__ int sext_nibbles(unsigned x) {
    return (int)(((x ^ 0x08080808u) + 0x78787878u) ^ 0x80808080u);
}

/* int4 (group size % 8 == 0): a warp per output row; lane-strided 8-element words, each
 * Σ_{k in word} q_k w_jk (two dp4a) times the word's group multiplier. */
template <int TB>
static __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_i4_kernel(const int8_t* __restrict__ A, int ld, const uint32_t* __restrict__ W4,
               const uint8_t* __restrict__ M8, int words, gemm_out o) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= o.R) return;
    const uint32_t* w = W4 + (size_t)j * words;
    const uint8_t* m = M8 + (size_t)j * words;
    for (int t0 = 0; t0 < o.T; t0 += TB) {
        int acc[TB];
        for (int b = 0; b < TB; b++) acc[b] = 0;
        #pragma unroll 4
        for (int i = lane; i < words; i += 32) {
            const unsigned wv = w[i];
            const int mult = m[i];
            const int lo = sext_nibbles(wv & 0x0f0f0f0fu);        /* elements 8i .. 8i+3   */
            const int hi = sext_nibbles((wv >> 4) & 0x0f0f0f0fu); /* elements 8i+4 .. 8i+7 */
            for (int b = 0; b < TB; b++) {
                const int2 qv = ((const int2*)(A + (size_t)(t0 + b) * ld))[i];
                const int part = __dp4a(hi, qv.y, __dp4a(lo, qv.x, 0));
                acc[b] += mult * part;
            }
        }
        for (int b = 0; b < TB; b++) acc[b] = warp_sum(acc[b]);
        if (lane == 0)
            for (int b = 0; b < TB && t0 + b < o.T; b++) emit(o, t0 + b, j, acc[b]);
    }
}

/* ---- dispatch -------------------------------------------------------------------------------- */

static tl_status run_i8(tl_cuda* c, const int8_t* W, int ld, const int8_t* q, const gemm_out& o) {
    if (o.T >= TL_CU_GEMV_MAX_T) {
        const dim3 grid((unsigned)((o.R + BN - 1) / BN), (unsigned)((o.T + BM - 1) / BM));
        TL_CU_LAUNCH(gemm_tc_kernel, grid, TC_THREADS, 0, c->stream)(q, W, ld, o);
        return tl_cu_launched("tensor-core GEMM kernel");
    }
    const unsigned grid = (unsigned)((o.R + GEMV_WARPS - 1) / GEMV_WARPS);
    if (o.T == 1) TL_CU_LAUNCH(gemv_i8_kernel<1>, grid, GEMV_WARPS * 32, 0, c->stream)(q, W, ld, o);
    else if (o.T == 2) TL_CU_LAUNCH(gemv_i8_kernel<2>, grid, GEMV_WARPS * 32, 0, c->stream)(q, W, ld, o);
    else if (o.T <= 4) TL_CU_LAUNCH(gemv_i8_kernel<4>, grid, GEMV_WARPS * 32, 0, c->stream)(q, W, ld, o);
    else TL_CU_LAUNCH(gemv_i8_kernel<8>, grid, GEMV_WARPS * 32, 0, c->stream)(q, W, ld, o);
    return tl_cu_launched("GEMV kernel");
}

static tl_status run_i4(tl_cuda* c, const tl_cu_linear* L, const int8_t* q, const gemm_out& o) {
    const unsigned grid = (unsigned)((o.R + GEMV_WARPS - 1) / GEMV_WARPS);
    const int ld = (int)L->cols_pad, words = (int)(L->cols / 8);
    if (o.T == 1)
        TL_CU_LAUNCH(gemv_i4_kernel<1>, grid, GEMV_WARPS * 32, 0, c->stream)(q, ld, L->w4, L->m8, words, o);
    else if (o.T == 2)
        TL_CU_LAUNCH(gemv_i4_kernel<2>, grid, GEMV_WARPS * 32, 0, c->stream)(q, ld, L->w4, L->m8, words, o);
    else if (o.T <= 4)
        TL_CU_LAUNCH(gemv_i4_kernel<4>, grid, GEMV_WARPS * 32, 0, c->stream)(q, ld, L->w4, L->m8, words, o);
    else
        TL_CU_LAUNCH(gemv_i4_kernel<8>, grid, GEMV_WARPS * 32, 0, c->stream)(q, ld, L->w4, L->m8, words, o);
    return tl_cu_launched("int4 GEMV kernel");
}

/* The accumulators of o.T rows of q for L, emitted as o.mode says (MODE_EMIT or MODE_RAW); an
 * int4 linear of many rows in two passes through raw. */
static tl_status run_linear(tl_cuda* c, const tl_cu_linear* L, const int8_t* q, gemm_out o) {
    const int ld = (int)L->cols_pad, mode = o.mode;
    if (!L->group_size) return run_i8(c, L->w8, ld, q, o);
    if (o.T < TL_CU_GEMV_MAX_T && L->w4) return run_i4(c, L, q, o);
    if (!o.raw) return tl_fail(TL_ERR_INTERNAL, "CUDA backend: int4 linear without raw scratch");
    o.mode = MODE_RAW;
    TL_CU_TRY(run_i8(c, L->w_hi, ld, q, o));
    o.mode = MODE_COMBINE | mode;
    return run_i8(c, L->w_lo, ld, q, o);
}

tl_status tl_cu_linear_run(tl_cuda* c, const tl_cu_linear* L, const int8_t* q, const float* scale, size_t T,
                           float* y, size_t ys, bool accumulate, int32_t* raw, bool digits) {
    if (T == 0) return TL_OK;
    gemm_out o;
    o.a = scale;
    o.ws = L->scale;
    o.bias = L->bias;
    o.y = y;
    o.ys = ys;
    o.raw = raw;
    o.ldr = L->rows_pad;
    o.mode = MODE_EMIT;
    o.accumulate = accumulate ? 1 : 0;
    o.T = (int)T;
    o.R = (int)L->rows;
    if (!digits) return run_linear(c, L, q, o);
    if (!raw) return tl_fail(TL_ERR_INTERNAL, "CUDA backend: block inputs without raw scratch");
    o.mode = MODE_RAW;
    o.T = (int)(2 * T);
    TL_CU_TRY(run_linear(c, L, q, o));
    o.T = (int)T;
    TL_CU_LAUNCH(combine_digits_kernel, (unsigned)T, 256, 0, c->stream)(o);
    return tl_cu_launched("digit combination kernel");
}
