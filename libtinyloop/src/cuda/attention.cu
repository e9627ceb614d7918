/* attention.cu — exact two-pass attention (docs/spec.md §4.1) over the paged device KV cache,
 * matching attention.c's tl_attend bit for bit. Per (row, query head):
 *
 *   (qq, sq) = Q8(qh);  c = sq / sqrt((f32)D)
 *   pass 1   S_j = ((f32)(qq . kq_j) * c) * sk_j for every visible key (a thread per key),
 *            M = NaN-ignoring max of S, svmax = NaN-ignoring max of sv (both from -inf);
 *            !(svmax > 0) -> o = 0
 *   pass 2   e_j = exp2s((S_j - M) * LOG2E), den = Σ rint(e_j * 2^24) (i64),
 *            U_j = rint(e_j * (sv_j * κ)), κ = 2^24 / svmax; a NaN U_j -> o = NaN
 *   pass 3   num_d = Σ_j U_j * vq_jd (i64; threads split d into 8/4/2-byte units and the keys
 *            into contiguous ranges, then the partial sums add exactly),
 *            o_d = ((f32)num_d / (f32)den) * svmax
 *
 * Two launch shapes, by tl_cu_attention_splits:
 *   - one block per (row, head) runs the three passes over all its keys (prefill: T * H blocks
 *     already fill the device);
 *   - split (decode: a few rows leave most SMs idle with one block per (row, head)): n blocks per
 *     (row, head), block i over the i-th contiguous range of its keys. split_scores_kernel runs
 *     pass 1 on its range and stores its partial maxima; split_sums_kernel merges every range's
 *     maxima into M and svmax, then runs passes 2 and 3 on its range and stores the partial
 *     integer sums; split_merge_kernel adds those and divides. attention_split.h holds that
 *     arithmetic (shared with a CPU test) and says why the result is the unsplit one bit for bit:
 *     maxima of NaN-free partial maxima and exact integer sums do not depend on the partition.
 *
 * Every sum is an exact integer and every maximum is over NaN-free partial maxima, so the split
 * over threads or blocks cannot change a bit. Visible keys are positions lo .. e(pos) (core/attn_mask.h:
 * lo = pos + 1 - W with a window W, else 0; e(pos) = pos, or P - 1 inside an instruction block of
 * length P); key k = j - lo lives in the row's span holding j, slot j - start.
 * The per-key S_k (then U_k, as bits) go to scratch `scores` [rows][H][key_stride].
 * Cache layout per (layer, kv head): kq [bs][R], vq [bs][R], sk [bs] f32, sv [bs] f32 with rows of
 * R = D int8 values or, in the int4 KV mode, R = D / 2 bytes of packed Q4 values (kvcache.h),
 * which the passes unpack as they read them: the same integers, so the same formulas. */
#include "common.cuh"
#include "core/attn_mask.h"
#include "cuda/attention_split.h"

enum {
    ATT_THREADS = 256,
    ATT_MAX_D = 1024,
    MERGE_THREADS = 128,
    MAX_SPLITS = 16,    /* key ranges per (row, head), at most                                  */
    SPLIT_FILL = 2,     /* split until the launch has this many blocks per SM                   */
    SCORE_CAP_BYTES = 256 << 20 /* scores scratch: rows go in chunks that fit                  */
};

/* Index in sp[0 .. n) of the span holding position j, or -1; starts from `guess` (spans are
 * ordered and contiguous, so the guess from a full-block stride is usually right). */
static __device__ int find_span(const tl_cuda_span* sp, int n, int guess, uint32_t j) {
    int s = guess < n - 1 ? guess : n - 1;
    while (s > 0 && sp[s].start > j) s--;
    while (s < n - 1 && sp[s].start + sp[s].count <= j) s++;
    return (sp[s].start <= j && j - sp[s].start < sp[s].count) ? s : -1;
}

/* The row's spans, for finding where key j lives. */
typedef struct key_finder {
    const tl_cuda_span* sp;
    int n, first;             /* spans; the last one starting at or before lo          */
    uint32_t first_start, block_size;
    size_t head_off;          /* (layer, kv head) offset inside a block's data         */
    size_t row_bytes;         /* R: D, or D / 2 for packed Q4 rows                     */
    size_t scales_off;        /* sk [bs], then sv [bs]: after the rows, 4-byte aligned */
    bool packed;              /* the int4 KV mode                                      */
} key_finder;

/* The span a thread looked at last: keys of one thread mostly fall in it or the next. */
typedef struct key_cursor {
    uint32_t start, end;      /* positions [start, end) of the span; empty at first    */
    int s;
    const int8_t* base;       /* its block's (layer, kv head) arrays                   */
} key_cursor;

static __device__ __forceinline__ void cursor_init(key_cursor* cur) {
    cur->start = 1;
    cur->end = 0;
    cur->s = -1;
    cur->base = NULL;
}

/* Base of the (layer, kv head) arrays holding key j, and its slot; false if no span holds j. */
static __device__ __forceinline__ bool find_key(const key_finder& f, key_cursor* cur, uint32_t j,
                                                const int8_t** base, uint32_t* slot) {
    if (!(j >= cur->start && j < cur->end)) {
        if (f.n <= 0) return false;
        int s = -1;
        if (cur->s >= 0 && cur->s + 1 < f.n && j >= cur->end) {
            const tl_cuda_span next = f.sp[cur->s + 1];
            if (j >= next.start && j - next.start < next.count) s = cur->s + 1;
        }
        if (s < 0) {
            const int guess =
                j >= f.first_start ? f.first + (int)((j - f.first_start) / f.block_size) : f.first;
            s = find_span(f.sp, f.n, guess, j);
            if (s < 0) return false;
        }
        const tl_cuda_span sp = f.sp[s];
        cur->s = s;
        cur->start = sp.start;
        cur->end = sp.start + sp.count;
        cur->base = (const int8_t*)sp.data + f.head_off;
    }
    *base = cur->base;
    *slot = j - cur->start;
    return true;
}

/* Exact qq . k over D bytes; qq in shared memory, zero-padded to a multiple of 16. */
static __device__ __forceinline__ int dot_key(const int8_t* qq, const int8_t* k, int D) {
    int acc = 0;
    if ((D & 15) == 0) {
        const int4* k4 = (const int4*)k;
        const int4* q4 = (const int4*)qq;
        for (int i = 0; i < D / 16; i++) {
            const int4 a = k4[i], b = q4[i];
            acc = __dp4a(a.x, b.x, acc);
            acc = __dp4a(a.y, b.y, acc);
            acc = __dp4a(a.z, b.z, acc);
            acc = __dp4a(a.w, b.w, acc);
        }
    } else if ((D & 3) == 0) {
        const int* k1 = (const int*)k;
        const int* q1 = (const int*)qq;
        for (int i = 0; i < D / 4; i++) acc = __dp4a(k1[i], q1[i], acc);
    } else {
        for (int i = 0; i < D; i++) acc += (int)qq[i] * (int)k[i];
    }
    return acc;
}

/* Exact qq . k for a packed Q4 key row k (D / 2 bytes). */
static __device__ __forceinline__ int dot_key4(const int8_t* qq, const int8_t* k, int D) {
    int acc = 0;
    for (int i = 0; i < D / 2; i++) {
        const unsigned b = (uint8_t)k[i];
        acc += (int)qq[2 * i] * tl_cu_nibble(b, 0) + (int)qq[2 * i + 1] * tl_cu_nibble(b, 1);
    }
    return acc;
}

/* CW consecutive values of d (CW = 8, 4 or 2; the address is aligned to their bytes), loaded raw:
 * int8 rows: NW words of 4 bytes, or for CW = 2 the two bytes themselves; packed Q4 rows (P):
 * their CW / 2 bytes in one word. value_at gives value b, signed. */
template <int CW, bool P>
struct value_words {
    enum { NW = P ? 1 : CW >= 4 ? CW / 4 : 2 };
    int w[NW];
};

template <int CW, bool P>
static __device__ __forceinline__ void load_values(const int8_t* p, value_words<CW, P>* out) {
    if constexpr (P) {
        if constexpr (CW == 8) out->w[0] = *(const int*)p;
        else if constexpr (CW == 4) out->w[0] = *(const unsigned short*)p;
        else out->w[0] = (uint8_t)p[0];
    } else if constexpr (CW == 8) {
        const int2 v = *(const int2*)p;
        out->w[0] = v.x;
        out->w[1] = v.y;
    } else if constexpr (CW == 4) {
        out->w[0] = *(const int*)p;
    } else {
        out->w[0] = p[0];
        out->w[1] = p[1];
    }
}

template <int CW, bool P>
static __device__ __forceinline__ int value_at(const value_words<CW, P>& v, int b) {
    if constexpr (P) return tl_cu_nibble((unsigned)v.w[0] >> (8 * (b / 2)), b % 2); /* nibble b, little-endian */
    else if constexpr (CW == 2) return v.w[b];
    else return (int8_t)(v.w[b / 4] >> (8 * (b % 4))); /* byte b % 4 of word b / 4 (little-endian) */
}

/* Pass 3 over keys [kb, ke): num_d = Σ_k U_k * vq_kd exactly, handed to emit(d, num_d) for
 * every d < D. Thread = (column unit u: CW bytes of d, key lane gl); lane gl takes a contiguous
 * part of the range, walked span segment by span segment, four keys' loads in flight at a time.
 * The lanes' i64 partial sums meet in `part` ([ATT_THREADS * 8]) and are added in lane order. */
template <int CW, bool P, typename Emit>
static __device__ void accumulate_values(const key_finder& f, const float* sc, uint32_t lo, uint32_t kb,
                                         uint32_t ke, int D, long long* part, Emit emit) {
    const int tid = threadIdx.x;
    const int nc = D / CW;
    const int ncu = nc < ATT_THREADS ? nc : ATT_THREADS;
    const int ng = ATT_THREADS / ncu;
    const int u = tid % ncu, gl = tid / ncu;
    const uint32_t per = (ke - kb + ng - 1) / ng;
    const uint32_t k0 = kb + (uint32_t)gl * per, k1 = k0 + per < ke ? k0 + per : ke;
    const size_t R = f.row_bytes, bsR = (size_t)f.block_size * R;
    for (int u0 = 0; u0 < nc; u0 += ncu) {
        const int col = u0 + u;
        long long acc[CW];
        #pragma unroll
        for (int i = 0; i < CW; i++) acc[i] = 0;
        if (gl < ng && col < nc && k0 < k1) {
            key_cursor cur;
            cursor_init(&cur);
            const uint32_t jend = lo + k1;
            for (uint32_t j = lo + k0; j < jend;) {
                const int8_t* base;
                uint32_t slot;
                if (!find_key(f, &cur, j, &base, &slot)) {
                    j++;
                    continue;
                }
                const uint32_t n = (cur.end < jend ? cur.end : jend) - j; /* keys j .. j+n-1: this span */
                const int8_t* v = base + bsR + (size_t)slot * R + (size_t)col * (P ? CW / 2 : CW);
                const float* uk = sc + (j - lo);
                uint32_t i = 0;
                for (; i + 4 <= n; i += 4) {
                    long long U[4];
                    value_words<CW, P> w[4];
                    #pragma unroll
                    for (int q = 0; q < 4; q++) {
                        U[q] = __float_as_int(uk[i + q]);
                        load_values<CW, P>(v + (size_t)(i + q) * R, &w[q]);
                    }
                    #pragma unroll
                    for (int q = 0; q < 4; q++)
                        #pragma unroll
                        for (int b = 0; b < CW; b++) acc[b] += U[q] * value_at<CW, P>(w[q], b);
                }
                for (; i < n; i++) {
                    const long long U = __float_as_int(uk[i]);
                    value_words<CW, P> w;
                    load_values<CW, P>(v + (size_t)i * R, &w);
                    #pragma unroll
                    for (int b = 0; b < CW; b++) acc[b] += U * value_at<CW, P>(w, b);
                }
                j += n;
            }
        }
        if (gl < ng) {
            #pragma unroll
            for (int b = 0; b < CW; b++) part[(size_t)(gl * ncu + u) * CW + b] = acc[b];
        }
        __syncthreads();
        const int width = (nc - u0 < ncu ? nc - u0 : ncu) * CW; /* bytes of d in this round */
        for (int e = tid; e < width; e += ATT_THREADS) {
            const int cu = e / CW, b = e % CW;
            long long num = 0;
            for (int l = 0; l < ng; l++) num += part[(size_t)(l * ncu + cu) * CW + b];
            emit(u0 * CW + e, num);
        }
        __syncthreads(); /* part is rewritten by the next round */
    }
}

/* What every attention launch reads: the rows of a chunk starting at row0 and where each
 * (row, head) block puts its results. Block index hi (blockIdx.x) = row-local r * H + h. */
typedef struct att_args {
    const tl_cuda_row* rows;
    const tl_cuda_span* spans;
    size_t row0;
    const float* qkv;       /* [T][qkv_dim], rotated query heads first                  */
    size_t qkv_dim;
    float* out;             /* [T][out_stride]                                          */
    size_t out_stride;
    float* scores;          /* [heads][key_stride]                                      */
    uint32_t key_stride;
    int H, G, D;
    uint32_t layer, block_size;
    uint32_t loop_window;   /* 0, or loop attention's local one: W' = tl_loop_local_window */
    size_t head_bytes;
    uint32_t kv_bits;       /* 8, or 4: packed Q4 rows                                  */
    /* split launches only: grid (heads, n_splits) */
    uint32_t n_splits;
    tl_att_max* maxima;     /* [heads][n_splits]                                        */
    tl_att_sum* sums;       /* [heads][n_splits]                                        */
    int64_t* nums;          /* [heads][n_splits][D]                                     */
} att_args;

/* The (row, head) of block index hi and the keys it sees. */
typedef struct head_view {
    size_t r;               /* row                                                      */
    int h;                  /* query head                                               */
    uint32_t lo, nvis;      /* visible keys: positions lo .. lo + nvis - 1              */
    key_finder f;
} head_view;

static __device__ head_view view_of(const att_args& a, unsigned hi) {
    head_view v;
    v.r = a.row0 + hi / (unsigned)a.H;
    v.h = (int)(hi % (unsigned)a.H);
    const tl_cuda_row row = a.rows[v.r];
    const uint32_t window = a.loop_window ? tl_loop_local_window(row.window, a.loop_window) : row.window;
    v.lo = (uint32_t)tl_attn_first_key(row.pos, window);
    v.nvis = (uint32_t)tl_attn_last_key(row.pos, row.instruction) - v.lo + 1;
    /* the row's spans; first = the last span starting at or before lo */
    key_finder& f = v.f;
    f.sp = a.spans + row.first_span;
    f.n = (int)row.n_spans;
    f.block_size = a.block_size;
    f.head_off = ((size_t)a.layer * a.G + v.h / (a.H / a.G)) * a.head_bytes;
    f.row_bytes = (size_t)a.D * a.kv_bits / 8;
    f.scales_off = (2 * (size_t)a.block_size * f.row_bytes + 3) / 4 * 4; /* kvcache.h tl_kv_scales_offset */
    f.packed = a.kv_bits != 8;
    f.first = 0;
    for (int l = 0, u = f.n - 1; l <= u;) {
        const int mid = (l + u) / 2;
        if (f.sp[mid].start <= v.lo) {
            f.first = mid;
            l = mid + 1;
        } else {
            u = mid - 1;
        }
    }
    f.first_start = f.n > 0 ? f.sp[f.first].start : 0;
    return v;
}

/* Block index hi's output head: out [row][h * D ..). */
static __device__ float* out_of(const att_args& a, unsigned hi) {
    return a.out + (a.row0 + hi / (unsigned)a.H) * a.out_stride + (size_t)(hi % (unsigned)a.H) * a.D;
}

/* (qq, sq) = Q8 of the block's query head into shared qq, zero-padded to a multiple of 16 bytes;
 * returns c = sq / sqrt(D) once qq is complete. */
static __device__ float quantize_query(const att_args& a, const head_view& v, int8_t* qq, float* shf) {
    const int D = a.D, Dpad = (D + 15) & ~15;
    for (int i = D + threadIdx.x; i < Dpad; i += ATT_THREADS) qq[i] = 0;
    int unused;
    const float sq = tl_cu_block_q8(a.qkv + v.r * a.qkv_dim + (size_t)v.h * D, D, qq, &unused, shf);
    __syncthreads(); /* qq complete */
    return sq / sqrtf((float)D);
}

/* Pass 1 over keys [k0, k1): S_k into sc[k]; the block's NaN-ignoring maxima of S and sv (to
 * every thread; -inf for an empty range). */
static __device__ tl_att_max scores_pass(const head_view& v, const int8_t* qq, float c, int D, uint32_t k0,
                                         uint32_t k1, float* sc, float* shf) {
    const size_t R = v.f.row_bytes;
    float m_part = -INFINITY, sv_part = -INFINITY;
    key_cursor cur;
    cursor_init(&cur);
    for (uint32_t k = k0 + threadIdx.x; k < k1; k += ATT_THREADS) {
        const int8_t* base;
        uint32_t slot;
        if (!find_key(v.f, &cur, v.lo + k, &base, &slot)) continue;
        const float* sk = (const float*)(base + v.f.scales_off);
        const int8_t* row = base + (size_t)slot * R;
        const int dot = v.f.packed ? dot_key4(qq, row, D) : dot_key(qq, row, D);
        const float s = ((float)dot * c) * sk[slot];
        sc[k] = s;
        m_part = tl_fmax(m_part, s);
        sv_part = tl_fmax(sv_part, sk[v.f.block_size + slot]);
    }
    tl_att_max r;
    r.m = tl_cu_block_max(m_part, shf);
    r.svmax = tl_cu_block_max(sv_part, shf);
    return r;
}

/* Pass 2 over keys [k0, k1): U_k (as bits) over S_k in sc; returns the block's Σ E_k and sets
 * *nan when some U_k is NaN (both to every thread; the barrier also publishes every U_k). */
static __device__ long long weights_pass(const head_view& v, float M, float kappa, uint32_t k0, uint32_t k1,
                                         float* sc, long long* sh64, bool* nan) {
    long long den_part = 0;
    bool nan_part = false;
    key_cursor cur;
    cursor_init(&cur);
    for (uint32_t k = k0 + threadIdx.x; k < k1; k += ATT_THREADS) {
        const int8_t* base;
        uint32_t slot;
        if (!find_key(v.f, &cur, v.lo + k, &base, &slot)) continue;
        const float sv = ((const float*)(base + v.f.scales_off))[v.f.block_size + slot];
        int32_t u;
        den_part += tl_att_weight(sc[k], M, sv, kappa, &u, &nan_part);
        sc[k] = __int_as_float(u);
    }
    const long long den = tl_cu_block_sum(den_part, sh64);
    *nan = __syncthreads_or(nan_part) != 0;
    return den;
}

/* Pass 3 over keys [k0, k1), by the widest column unit D allows, on int8 or packed Q4 rows. */
template <bool P, typename Emit>
static __device__ void values_pass_rows(const head_view& v, const float* sc, int D, uint32_t k0, uint32_t k1,
                                        long long* part, Emit emit) {
    if ((D & 7) == 0) accumulate_values<8, P>(v.f, sc, v.lo, k0, k1, D, part, emit);
    else if ((D & 3) == 0) accumulate_values<4, P>(v.f, sc, v.lo, k0, k1, D, part, emit);
    else accumulate_values<2, P>(v.f, sc, v.lo, k0, k1, D, part, emit);
}

template <typename Emit>
static __device__ void values_pass(const head_view& v, const float* sc, int D, uint32_t k0, uint32_t k1,
                                   long long* part, Emit emit) {
    if (v.f.packed) values_pass_rows<true>(v, sc, D, k0, k1, part, emit);
    else values_pass_rows<false>(v, sc, D, k0, k1, part, emit);
}

static __device__ void fill(float* o, int D, float value) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = value;
}

static __device__ __forceinline__ float c_nan() { return __int_as_float(0x7fc00000); } /* C's NAN */

/* One block per (row, head): the three passes over every visible key. */
static __global__ void __launch_bounds__(ATT_THREADS, 3) attention_kernel(const att_args a) {
    __shared__ __align__(16) int8_t qq[ATT_MAX_D];
    __shared__ long long part[ATT_THREADS * 8];
    __shared__ float shf[32];
    __shared__ long long sh64[32];
    const head_view v = view_of(a, blockIdx.x);
    const int D = a.D;
    float* o = out_of(a, blockIdx.x);
    float* sc = a.scores + (size_t)blockIdx.x * a.key_stride;

    const float c = quantize_query(a, v, qq, shf);
    const tl_att_max mx = scores_pass(v, qq, c, D, 0, v.nvis, sc, shf);
    if (!(mx.svmax > 0.0f)) { /* every visible value row is zero (uniform over the block) */
        fill(o, D, 0.0f);
        return;
    }
    bool nan;
    const long long den = weights_pass(v, mx.m, tl_att_kappa(mx.svmax), 0, v.nvis, sc, sh64, &nan);
    if (nan) {
        fill(o, D, c_nan());
        return;
    }
    values_pass(v, sc, D, 0, v.nvis, part, [&](int d, long long num) { o[d] = tl_att_output(num, den, mx.svmax); });
}

/* Split launches, grid (heads, n_splits): block (hi, i) takes range i of (row, head) hi's keys. */

/* Pass 1 on the range: its partial maxima. */
static __global__ void __launch_bounds__(ATT_THREADS, 3) split_scores_kernel(const att_args a) {
    __shared__ __align__(16) int8_t qq[ATT_MAX_D];
    __shared__ float shf[32];
    const head_view v = view_of(a, blockIdx.x);
    const size_t at = (size_t)blockIdx.x * a.n_splits + blockIdx.y;
    uint32_t k0, k1;
    tl_att_split_range(v.nvis, a.n_splits, blockIdx.y, &k0, &k1);
    const float c = quantize_query(a, v, qq, shf);
    const tl_att_max mx = scores_pass(v, qq, c, a.D, k0, k1, a.scores + (size_t)blockIdx.x * a.key_stride, shf);
    if (threadIdx.x == 0) a.maxima[at] = mx;
}

/* The merged maxima, then passes 2 and 3 on the range: its partial den, NaN flag and num. */
static __global__ void __launch_bounds__(ATT_THREADS, 3) split_sums_kernel(const att_args a) {
    __shared__ long long part[ATT_THREADS * 8];
    __shared__ long long sh64[32];
    const tl_att_max mx = tl_att_merge_max(a.maxima + (size_t)blockIdx.x * a.n_splits, a.n_splits);
    if (!(mx.svmax > 0.0f)) return; /* the merge writes zeros without reading any sum */
    const head_view v = view_of(a, blockIdx.x);
    const size_t at = (size_t)blockIdx.x * a.n_splits + blockIdx.y;
    uint32_t k0, k1;
    tl_att_split_range(v.nvis, a.n_splits, blockIdx.y, &k0, &k1);
    float* sc = a.scores + (size_t)blockIdx.x * a.key_stride;
    bool nan;
    const long long den = weights_pass(v, mx.m, tl_att_kappa(mx.svmax), k0, k1, sc, sh64, &nan);
    if (threadIdx.x == 0) {
        a.sums[at].den = den;
        a.sums[at].nan = nan;
    }
    if (nan) return; /* the merge writes NaNs without reading any num */
    int64_t* num = a.nums + at * a.D;
    values_pass(v, sc, a.D, k0, k1, part, [&](int d, long long x) { num[d] = x; });
}

/* grid heads: the splits' sums merged, then the unsplit kernel's final step. */
static __global__ void __launch_bounds__(MERGE_THREADS) split_merge_kernel(const att_args a) {
    const int D = a.D;
    const uint32_t n = a.n_splits;
    const size_t at = (size_t)blockIdx.x * n;
    float* o = out_of(a, blockIdx.x);
    const tl_att_max mx = tl_att_merge_max(a.maxima + at, n);
    if (!(mx.svmax > 0.0f)) {
        fill(o, D, 0.0f);
        return;
    }
    bool nan = false;
    const int64_t den = tl_att_merge_den(a.sums + at, n, &nan);
    if (nan) {
        fill(o, D, c_nan());
        return;
    }
    for (int d = threadIdx.x; d < D; d += MERGE_THREADS)
        o[d] = tl_att_output(tl_att_merge_num(a.nums + at * D + d, n, (size_t)D), den, mx.svmax);
}

/* Byte offsets in the split scratch of `heads` (row, head)s with n splits: maxima, sums, nums. */
static void split_layout(size_t heads, uint32_t n, size_t D, size_t* sums_at, size_t* nums_at, size_t* bytes) {
    *sums_at = tl_cu_round_up(heads * n * sizeof(tl_att_max), 16);
    *nums_at = *sums_at + tl_cu_round_up(heads * n * sizeof(tl_att_sum), 16);
    *bytes = *nums_at + heads * n * D * sizeof(int64_t);
}

uint32_t tl_cu_attention_splits(const tl_cuda* c, size_t T) {
    const size_t heads = T * c->cfg.n_heads, target = (size_t)SPLIT_FILL * (size_t)c->sm_count;
    if (heads == 0 || heads >= target) return 1;
    const size_t n = (target + heads - 1) / heads;
    return n < MAX_SPLITS ? (uint32_t)n : (uint32_t)MAX_SPLITS;
}

/* The most any layer of the pass needs: a layer runs on its active rows x <= T, in launches of
 * at most score_rows rows, split tl_cu_attention_splits(c, x) ways (1 from some x on, since the
 * split count never grows with x). */
size_t tl_cu_attention_split_bytes(const tl_cuda* c, size_t T, size_t score_rows) {
    size_t most = 0;
    for (size_t x = 1; x <= T; x++) {
        const uint32_t n = tl_cu_attention_splits(c, x);
        if (n == 1) break;
        size_t sums_at, nums_at, bytes;
        split_layout((x < score_rows ? x : score_rows) * c->cfg.n_heads, n, c->cfg.head_dim, &sums_at, &nums_at,
                     &bytes);
        if (bytes > most) most = bytes;
    }
    return most;
}

tl_status tl_cu_attention(tl_cuda* c, const tl_cuda_row* rows, const tl_cuda_span* spans, size_t T,
                          const float* qkv, float* o, uint32_t layer, uint32_t loop_window, uint32_t block_size,
                          size_t head_bytes, uint32_t kv_bits, uint32_t key_stride, float* scores, size_t score_rows,
                          void* split_scratch) {
    const tl_config* cfg = &c->cfg;
    const size_t H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    const uint32_t n_splits = tl_cu_attention_splits(c, T);
    if (D > ATT_MAX_D || block_size == 0 || score_rows == 0)
        return tl_fail(TL_ERR_INTERNAL, "CUDA attention: unsupported geometry (D %zu, block %u)", D, block_size);
    if (n_splits > 1 && !split_scratch) return tl_fail(TL_ERR_INTERNAL, "CUDA attention: no split scratch");
    att_args a = {};
    a.rows = rows;
    a.spans = spans;
    a.qkv = qkv;
    a.qkv_dim = tl_qkv_rows(cfg);
    a.out = o;
    a.out_stride = H * D;
    a.scores = scores;
    a.key_stride = key_stride;
    a.H = (int)H;
    a.G = (int)G;
    a.D = (int)D;
    a.layer = layer;
    a.loop_window = loop_window;
    a.block_size = block_size;
    a.head_bytes = head_bytes;
    a.kv_bits = kv_bits;
    a.n_splits = n_splits;
    if (n_splits > 1) { /* the largest launch's layout; every launch of this call fits it */
        size_t sums_at, nums_at, bytes;
        split_layout((T < score_rows ? T : score_rows) * H, n_splits, D, &sums_at, &nums_at, &bytes);
        a.maxima = (tl_att_max*)split_scratch;
        a.sums = (tl_att_sum*)((char*)split_scratch + sums_at);
        a.nums = (int64_t*)((char*)split_scratch + nums_at);
    }
    for (size_t r0 = 0; r0 < T; r0 += score_rows) {
        const size_t n = T - r0 < score_rows ? T - r0 : score_rows;
        const unsigned heads = (unsigned)(n * H);
        a.row0 = r0;
        if (n_splits == 1) {
            TL_CU_LAUNCH(attention_kernel, heads, ATT_THREADS, 0, c->stream)(a);
            TL_CU_TRY(tl_cu_launched("attention kernel"));
            continue;
        }
        const dim3 grid(heads, n_splits);
        TL_CU_LAUNCH(split_scores_kernel, grid, ATT_THREADS, 0, c->stream)(a);
        TL_CU_TRY(tl_cu_launched("attention kernel (split scores)"));
        TL_CU_LAUNCH(split_sums_kernel, grid, ATT_THREADS, 0, c->stream)(a);
        TL_CU_TRY(tl_cu_launched("attention kernel (split sums)"));
        TL_CU_LAUNCH(split_merge_kernel, heads, MERGE_THREADS, 0, c->stream)(a);
        TL_CU_TRY(tl_cu_launched("attention kernel (split merge)"));
    }
    return TL_OK;
}

/* Rows per attention launch so that the scores scratch stays within SCORE_CAP_BYTES. */
size_t tl_cu_attention_rows(const tl_cuda* c, size_t T, uint32_t key_stride) {
    const size_t per_row = (size_t)c->cfg.n_heads * key_stride * sizeof(float);
    size_t rows = SCORE_CAP_BYTES / (per_row ? per_row : 1);
    if (rows < 1) rows = 1;
    const size_t max_grid = 0x7fffffffu / (c->cfg.n_heads ? c->cfg.n_heads : 1); /* blocks per launch */
    if (rows > max_grid) rows = max_grid;
    return rows < T ? rows : T;
}
