/* attention.cu — exact two-pass attention (docs/spec.md §4.1) over the paged device KV cache,
 * one thread block per (row, query head), matching attention.c's tl_attend bit for bit:
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
 * Every sum is an exact integer and every maximum is over NaN-free partial maxima, so the
 * split over threads cannot change a bit. Visible keys are positions lo .. pos (lo = pos + 1 - W
 * with a window W, else 0); key k = j - lo lives in the row's span holding j, slot j - start.
 * The per-key S_j (then U_j, as bits) go to scratch `scores` [rows][H][max_keys].
 * Cache layout per (layer, kv head): kq [bs][D] i8, vq [bs][D] i8, sk [bs] f32, sv [bs] f32. */
#include "common.cuh"

enum {
    ATT_THREADS = 256,
    ATT_MAX_D = 1024,
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

/* CW consecutive value bytes (CW = 8, 4 or 2; the address is CW-aligned), loaded raw: NW
 * words of 4 bytes, or for CW = 2 the two bytes themselves; value_at gives byte b, signed. */
template <int CW>
struct value_words {
    enum { NW = CW >= 4 ? CW / 4 : 2 };
    int w[NW];
};

template <int CW>
static __device__ __forceinline__ void load_values(const int8_t* p, value_words<CW>* out) {
    if constexpr (CW == 8) {
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

template <int CW>
static __device__ __forceinline__ int value_at(const value_words<CW>& v, int b) {
    if constexpr (CW == 2) return v.w[b];
    else return (int8_t)(v.w[b / 4] >> (8 * (b % 4))); /* byte b % 4 of word b / 4 (little-endian) */
}

/* Pass 3: num_d = Σ_k U_k * vq_kd exactly, then o_d = ((f32)num_d / (f32)den) * svmax.
 * Thread = (column unit u: CW bytes of d, key lane gl); lane gl takes a contiguous range of
 * keys, walked span segment by span segment, four keys' loads in flight at a time. The lanes'
 * i64 partial sums meet in `part` ([ATT_THREADS * 8]) and are added in lane order. */
template <int CW>
static __device__ void accumulate_values(const key_finder& f, const float* sc, uint32_t lo, int nvis, int D,
                                         float fden, float svmax, float* o, long long* part) {
    const int tid = threadIdx.x;
    const int nc = D / CW;
    const int ncu = nc < ATT_THREADS ? nc : ATT_THREADS;
    const int ng = ATT_THREADS / ncu;
    const int u = tid % ncu, gl = tid / ncu;
    const int per = (nvis + ng - 1) / ng;
    const int k0 = gl * per, k1 = k0 + per < nvis ? k0 + per : nvis;
    const size_t bsD = (size_t)f.block_size * D;
    for (int u0 = 0; u0 < nc; u0 += ncu) {
        const int col = u0 + u;
        long long acc[CW];
        #pragma unroll
        for (int i = 0; i < CW; i++) acc[i] = 0;
        if (gl < ng && col < nc && k0 < k1) {
            key_cursor cur;
            cursor_init(&cur);
            const uint32_t jend = lo + (uint32_t)k1;
            for (uint32_t j = lo + (uint32_t)k0; j < jend;) {
                const int8_t* base;
                uint32_t slot;
                if (!find_key(f, &cur, j, &base, &slot)) {
                    j++;
                    continue;
                }
                const uint32_t n = (cur.end < jend ? cur.end : jend) - j; /* keys j .. j+n-1: this span */
                const int8_t* v = base + bsD + (size_t)slot * D + (size_t)col * CW;
                const float* uk = sc + (j - lo);
                uint32_t i = 0;
                for (; i + 4 <= n; i += 4) {
                    long long U[4];
                    value_words<CW> w[4];
                    #pragma unroll
                    for (int q = 0; q < 4; q++) {
                        U[q] = __float_as_int(uk[i + q]);
                        load_values<CW>(v + (size_t)(i + q) * D, &w[q]);
                    }
                    #pragma unroll
                    for (int q = 0; q < 4; q++)
                        #pragma unroll
                        for (int b = 0; b < CW; b++) acc[b] += U[q] * value_at<CW>(w[q], b);
                }
                for (; i < n; i++) {
                    const long long U = __float_as_int(uk[i]);
                    value_words<CW> w;
                    load_values<CW>(v + (size_t)i * D, &w);
                    #pragma unroll
                    for (int b = 0; b < CW; b++) acc[b] += U * value_at<CW>(w, b);
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
            o[(size_t)u0 * CW + e] = ((float)num / fden) * svmax;
        }
        __syncthreads(); /* part is rewritten by the next round */
    }
}

/* Block r_local * H + h: query head h of row row0 + r_local. */
static __global__ void __launch_bounds__(ATT_THREADS, 3)
attention_kernel(const tl_cuda_row* rows, const tl_cuda_span* spans, size_t row0, const float* qkv, size_t qkv_dim,
                 float* out, size_t out_stride, float* scores, uint32_t max_keys, int H, int G, int D,
                 uint32_t layer, uint32_t block_size, size_t head_bytes) {
    __shared__ __align__(16) int8_t qq[ATT_MAX_D];
    __shared__ long long part[ATT_THREADS * 8];
    __shared__ float shf[32];
    __shared__ long long sh64[32];
    const int tid = threadIdx.x;
    const size_t r = row0 + blockIdx.x / (unsigned)H;
    const int h = (int)(blockIdx.x % (unsigned)H);
    const tl_cuda_row row = rows[r];
    const uint32_t pos = row.pos;
    const uint32_t lo = (row.window && pos + 1 > row.window) ? pos + 1 - row.window : 0;
    const int nvis = (int)(pos - lo + 1);
    const int g = h / (H / G);
    float* o = out + r * out_stride + (size_t)h * D;
    float* sc = scores + (size_t)blockIdx.x * max_keys;

    /* (qq, sq) = Q8(qh); qq zero-padded to a multiple of 16 bytes */
    const int Dpad = (D + 15) & ~15;
    for (int i = D + tid; i < Dpad; i += ATT_THREADS) qq[i] = 0;
    int unused;
    const float sq = tl_cu_block_q8(qkv + r * qkv_dim + (size_t)h * D, D, qq, &unused, shf);
    const float c = sq / sqrtf((float)D);
    __syncthreads(); /* qq complete */

    /* the row's spans; first = the last span starting at or before lo */
    key_finder f;
    f.sp = spans + row.first_span;
    f.n = (int)row.n_spans;
    f.block_size = block_size;
    f.head_off = ((size_t)layer * G + g) * head_bytes;
    f.first = 0;
    for (int a = 0, b = f.n - 1; a <= b;) {
        const int mid = (a + b) / 2;
        if (f.sp[mid].start <= lo) {
            f.first = mid;
            a = mid + 1;
        } else {
            b = mid - 1;
        }
    }
    f.first_start = f.n > 0 ? f.sp[f.first].start : 0;
    const size_t bsD = (size_t)block_size * D;

    /* pass 1: scores, M, svmax */
    float m_part = -INFINITY, sv_part = -INFINITY;
    key_cursor cur;
    cursor_init(&cur);
    for (int k = tid; k < nvis; k += ATT_THREADS) {
        const int8_t* base;
        uint32_t slot;
        if (!find_key(f, &cur, lo + (uint32_t)k, &base, &slot)) continue;
        const float* sk = (const float*)(base + 2 * bsD);
        const int dot = dot_key(qq, base + (size_t)slot * D, D);
        const float s = ((float)dot * c) * sk[slot];
        sc[k] = s;
        m_part = tl_fmax(m_part, s);
        sv_part = tl_fmax(sv_part, sk[block_size + slot]);
    }
    const float M = tl_cu_block_max(m_part, shf);
    const float svmax = tl_cu_block_max(sv_part, shf);
    if (!(svmax > 0.0f)) { /* every visible value row is zero (uniform over the block) */
        for (int d = tid; d < D; d += ATT_THREADS) o[d] = 0.0f;
        return;
    }

    /* pass 2: E_j into den, U_j (as bits) over S_j */
    const float kappa = 16777216.0f / svmax; /* 2^24 / svmax */
    long long den_part = 0;
    bool nan_part = false;
    cursor_init(&cur);
    for (int k = tid; k < nvis; k += ATT_THREADS) {
        const int8_t* base;
        uint32_t slot;
        if (!find_key(f, &cur, lo + (uint32_t)k, &base, &slot)) continue;
        const float sv = ((const float*)(base + 2 * bsD))[block_size + slot];
        const float e = tl_exp2s((sc[k] - M) * TL_LOG2E);
        den_part += (long long)tl_rint(e * 16777216.0f); /* E_j = rint(e_j * 2^24) <= 2^24 */
        const float uf = tl_rint(e * (sv * kappa));      /* <= 2^24 + 2, or NaN if sv = inf */
        nan_part |= uf != uf;
        sc[k] = __int_as_float(uf == uf ? (int)uf : 0);
    }
    const long long den = tl_cu_block_sum(den_part, sh64);
    if (__syncthreads_or(nan_part)) { /* also publishes every U_j to the block */
        for (int d = tid; d < D; d += ATT_THREADS) o[d] = __int_as_float(0x7fc00000); /* C's NAN */
        return;
    }

    /* pass 3: num_d, then o_d */
    const float fden = (float)den;
    if ((D & 7) == 0) accumulate_values<8>(f, sc, lo, nvis, D, fden, svmax, o, part);
    else if ((D & 3) == 0) accumulate_values<4>(f, sc, lo, nvis, D, fden, svmax, o, part);
    else accumulate_values<2>(f, sc, lo, nvis, D, fden, svmax, o, part);
}

tl_status tl_cu_attention(tl_cuda* c, const tl_cuda_row* rows, const tl_cuda_span* spans, size_t T,
                          const float* qkv, float* o, uint32_t layer, uint32_t block_size, size_t head_bytes,
                          uint32_t max_keys, float* scores, size_t score_rows) {
    const tl_config* cfg = &c->cfg;
    const size_t H = cfg->n_heads, G = cfg->n_kv_heads, D = cfg->head_dim;
    if (D > ATT_MAX_D || block_size == 0 || score_rows == 0)
        return tl_fail(TL_ERR_INTERNAL, "CUDA attention: unsupported geometry (D %zu, block %u)", D, block_size);
    const size_t qkv_dim = (H + 2 * G) * D;
    for (size_t r0 = 0; r0 < T; r0 += score_rows) {
        const size_t n = T - r0 < score_rows ? T - r0 : score_rows;
        attention_kernel<<<(unsigned)(n * H), ATT_THREADS, 0, c->stream>>>(
            rows, spans, r0, qkv, qkv_dim, o, H * D, scores, max_keys, (int)H, (int)G, (int)D, layer, block_size,
            head_bytes);
        TL_CU_TRY(tl_cu_launched("attention kernel"));
    }
    return TL_OK;
}

/* Rows per attention launch so that the scores scratch stays within SCORE_CAP_BYTES. */
size_t tl_cu_attention_rows(const tl_cuda* c, size_t T, uint32_t max_keys) {
    const size_t per_row = (size_t)c->cfg.n_heads * max_keys * sizeof(float);
    size_t rows = SCORE_CAP_BYTES / (per_row ? per_row : 1);
    if (rows < 1) rows = 1;
    const size_t max_grid = 0x7fffffffu / (c->cfg.n_heads ? c->cfg.n_heads : 1); /* blocks per launch */
    if (rows > max_grid) rows = max_grid;
    return rows < T ? rows : T;
}
