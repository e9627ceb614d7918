/* attention_amx.c — the exact attention (docs/spec.md §4.1) of a tile of up to 16 queries at
 * consecutive positions p0 .. p0+m-1 of one head, as a prefill chunk has them, with its two
 * integer products on AMX tiles (amx_tiles.h: real, or emulated in the test build). Every query
 * gets exactly tl_attend's bits:
 *
 *   keys     the union of the visible keys, lo(p0) .. hi, hi = e(p0+m-1) = max(p0+m-1, P-1), e the
 *            last visible key (tl_attn_last_key, non-decreasing in the position; P the instruction
 *            length, 0 for none); a window gives each query its own lo, and keys past a query's
 *            e(p_q) are beyond its row. Query q sees the keys [lo_q - lo(p0), e(p_q) - lo(p0)] of
 *            that range, and every max and sum below runs over that part of its row only.
 *   scores   C[j][q] = Σ_d kq_jd qq_qd by TDPBSSD with the key rows as A (16 keys x 64 bytes of d,
 *            straight from an int8 cache when D is a multiple of 64 and 16 keys of one block are
 *            at hand, else copied (or unpacked, from an int4 cache) into zero-padded rows) and
 *            the queries as B (VNNI: 4 d of one query side by side, zero past D and past m):
 *            the exact int32 dot (|.| <= 127^2 D).
 *            Then S = ((f32)dot * c_q) * sk_j, c_q = sq_q / sqrt(D): the spec's two multiplies.
 *   per row  svmax, the zero and infinite branches, M, kappa, U_j and den: kern's own max,
 *            weights and output kernels on the query's contiguous row, as tl_attend calls them
 *            (a max over one call instead of one per segment can differ only in the sign of a
 *            zero result, which no output depends on; den is an integer sum).
 *   values   num_qd = Σ_j U_qj vq_jd exactly: 0 <= U <= 2^24 + 2 is split into four 7-bit limbs
 *            U = u0 + 2^7 u1 + 2^14 u2 + 2^21 u3 (each 0 .. 127, an int8), U = 0 for keys the query
 *            does not see, and each limb is a TDPBSSD GEMM: A = the limbs [16 queries][64 keys],
 *            B = the value rows of 64 keys in VNNI layout (4 keys of one d side by side; an int4
 *            cache's rows unpacked on the way), one
 *            16-wide tile of d per B. An int32 accumulator sums at most 127 * 127 per key, so it
 *            is flushed into the i64 sums every 1024 key blocks (65536 keys: < 2^31 / 16129);
 *            then num = Σ_l 2^(7l) C_l in i64.
 *
 * Scratch (scratch->tile, tl_attn_tile_bytes) is O(keys * (128 + D)) bytes: the score rows, the
 * limbs, the packed values and the row pointers of the whole union; the query and key tiles are
 * O(D); from an int4 cache, also the union's key rows unpacked. Its buffers are laid out for
 * scratch->tile_keys keys whatever a tile's union, so that the values packed once (and an int4
 * cache's keys unpacked once: tl_attn_pack_slice) serve every later tile whose queries see keys
 * from position 0 up to at most the packed ones: a chunk's tiles then pack each value row (and
 * unpack each int4 key row) once per (layer, kv head) instead of once per tile. Tiles: 0..3
 * accumulators, 4..5 A, 6..7 B, all 16 rows x 64 bytes. Code outside the tile primitives is
 * plain C, so this file builds on every CPU with the emulation. */
#include <math.h>
#include <string.h>

#include "cpu/amx_tiles.h"
#include "cpu/attention_kernels.h"

enum {
    TQ = TL_ATTN_TILE,              /* queries per tile (A rows of the value GEMM, B columns of the scores) */
    KB = TL_TILE_BYTES,             /* bytes of one tile row: 64 d of a key, or 64 keys of a limb          */
    TILE_BYTES = TL_TILE_ROWS * KB,
    DT = KB / 4,                    /* int32 columns of an accumulator: 16 d or 16 queries                 */
    LIMBS = 4,
    LIMB_BITS = 7,
    FLUSH_BLOCKS = 1024             /* key blocks an int32 accumulator takes between flushes              */
};

_Static_assert((int)TQ == (int)TL_TILE_ROWS && (int)TQ == (int)DT,
               "a tile of queries fills one tile's rows and columns");

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* The tile's buffers in scratch->tile, for up to n keys (padded to whole key blocks) of head size
 * D; the row strides are n_pad. */
typedef struct tile_buffers {
    size_t n_pad;           /* keys rounded up to 64                                        */
    size_t Dp;              /* D rounded up to 64: the k extent of the score products       */
    size_t n_dt;            /* 16-wide d tiles of the value GEMM, even (pairs of B tiles)    */
    int8_t* qpack;          /* [Dp / 4][TQ][4] the queries as B (zero past D and past m)    */
    int8_t* stage;          /* [TQ][Dp] key rows copied for a score product, zero past D    */
    int8_t* keys;           /* [n_pad][Dp] an int4 cache: the keys unpacked, zero past D    */
    int8_t* zeros;          /* [Dp] the value row of the keys past the union                */
    int8_t* group;          /* [4][Dp] an int4 cache: the value rows of a key group unpacked */
    const int8_t** vrow;    /* [n_pad] the value row of each key (packed for int4)          */
    float* sk;              /* [n_pad] key scales                                           */
    float* sv;              /* [n_pad] value scales                                         */
    float* scores;          /* [TQ][n_pad] S of every query against every key of the union */
    int8_t* limbs;          /* [LIMBS][TQ][n_pad] the limbs of U, zero where a query sees no key */
    int8_t* vpack;          /* [n_pad / 64][n_dt][16 rows][64] the values as B tiles         */
    int64_t* num;           /* [TQ][D]                                                      */
} tile_buffers;

/* Carves b out of base (or only measures, with base NULL); returns the bytes used. */
static size_t carve(uint8_t* base, size_t n_keys, const tl_kv_geom* g, tile_buffers* b) {
    const size_t D = g->head_dim;
    size_t used = 0;
#define TAKE(field, bytes)                                       \
    do {                                                         \
        b->field = base ? (void*)(base + used) : NULL;          \
        used += round_up((bytes), 64);                           \
    } while (0)
    b->n_pad = round_up(n_keys, KB);
    b->Dp = round_up(D, KB);
    b->n_dt = round_up((D + DT - 1) / DT, 2);
    TAKE(qpack, TQ * b->Dp);
    TAKE(stage, TQ * b->Dp);
    TAKE(keys, g->kv_bits == 8 ? 0 : b->n_pad * b->Dp);
    TAKE(zeros, b->Dp);
    TAKE(group, 4 * b->Dp);
    TAKE(vrow, b->n_pad * sizeof(const int8_t*));
    TAKE(sk, b->n_pad * sizeof(float));
    TAKE(sv, b->n_pad * sizeof(float));
    TAKE(scores, TQ * b->n_pad * sizeof(float));
    TAKE(limbs, LIMBS * TQ * b->n_pad);
    TAKE(vpack, b->n_pad * DT * b->n_dt);
    TAKE(num, TQ * D * sizeof(int64_t));
#undef TAKE
    return used;
}

size_t tl_attn_tile_bytes(size_t max_keys, const tl_kv_geom* g) {
    tile_buffers b;
    return carve(NULL, max_keys, g, &b);
}

/* ---- scores --------------------------------------------------------------------------------- */

/* Query q's row of scores for the n <= 16 keys k (cache rows, consecutive), which are keys
 * col .. col+n-1 of the union: C[j][q] = kq_j . qq_q on the tiles, then the spec's multiplies.
 * unpacked: an int4 cache's keys col .. as tl_attn_pack_slice unpacked them, or NULL. */
TL_TILES static void score_keys(const tile_buffers* b, const tl_kv_geom* g, const int8_t* k, size_t n, size_t m,
                                const float* c, size_t col, bool unpacked) {
    const size_t D = g->head_dim, R = tl_kv_row_bytes(g);
    const int8_t* rows = k;
    size_t stride = D;
    if (unpacked) { /* 16 rows of b->keys (col a multiple of 16): past n, zero rows or later keys, unused */
        rows = b->keys + col * b->Dp;
        stride = b->Dp;
    } else if (g->kv_bits != 8) { /* int4: unpacked into the staging rows (zero past D) */
        for (size_t j = 0; j < n; j++) tl_kv_unpack4(k + j * R, D, b->stage + j * b->Dp);
        rows = b->stage;
        stride = b->Dp;
    } else if (n < TL_TILE_ROWS || D % KB) { /* a tile would read past these keys or past D: copy */
        for (size_t j = 0; j < n; j++) memcpy(b->stage + j * b->Dp, k + j * D, D);
        rows = b->stage;
        stride = b->Dp;
    }
    tl_tile_zero(0);
    for (size_t kb = 0; kb < b->Dp / KB; kb++) {
        tl_tile_load(4, rows + KB * kb, stride);
        tl_tile_load(6, b->qpack + TILE_BYTES * kb, KB);
        tl_tile_dpbssd(0, 4, 6);
    }
    int32_t dots[TL_TILE_ROWS][DT]; /* [key][query] */
    tl_tile_store(0, &dots[0][0], sizeof dots[0]);
    const float* sk = b->sk + col;
    for (size_t q = 0; q < m; q++) {
        float* s = b->scores + q * b->n_pad + col;
        for (size_t j = 0; j < n; j++) s[j] = ((float)dots[j][q] * c[q]) * sk[j];
    }
}

/* ---- values --------------------------------------------------------------------------------- */

/* Keys 4g .. 4g+3 of the union into B row g % 16 of each d tile of key block g / 16:
 * out[dt][4 dd + i] = v_{4g+i}[16 dt + dd], zero past D and past the union's n keys (int4 rows
 * unpacked first). */
static void pack_value_group(const tile_buffers* b, size_t g, size_t n, size_t D, bool packed) {
    const int8_t* r[4];
    for (size_t i = 0; i < 4; i++) {
        if (4 * g + i >= n) {
            r[i] = b->zeros;
        } else if (packed) {
            tl_kv_unpack4(b->vrow[4 * g + i], D, b->group + i * b->Dp);
            r[i] = b->group + i * b->Dp;
        } else {
            r[i] = b->vrow[4 * g + i];
        }
    }
    int8_t* out = b->vpack + (g / 16) * b->n_dt * TILE_BYTES + (g % 16) * KB;
    const size_t full = D / DT;
    for (size_t dt = 0; dt < full; dt++)
        for (size_t dd = 0; dd < DT; dd++)
            for (size_t i = 0; i < 4; i++) out[dt * TILE_BYTES + 4 * dd + i] = r[i][DT * dt + dd];
    for (size_t dt = full; dt < b->n_dt; dt++)
        for (size_t dd = 0; dd < DT; dd++)
            for (size_t i = 0; i < 4; i++)
                out[dt * TILE_BYTES + 4 * dd + i] = DT * dt + dd < D ? r[i][DT * dt + dd] : 0;
}

/* The limbs of u[0 .. n) (each 0 .. 2^24 + 2) into limb rows l at out + l * stride. */
static void split_limbs(const int32_t* restrict u, size_t n, int8_t* restrict out, size_t stride) {
    int8_t* restrict l0 = out;
    int8_t* restrict l1 = out + stride;
    int8_t* restrict l2 = out + 2 * stride;
    int8_t* restrict l3 = out + 3 * stride;
    for (size_t j = 0; j < n; j++) {
        const uint32_t x = (uint32_t)u[j];
        l0[j] = (int8_t)(x & 127);
        l1[j] = (int8_t)(x >> LIMB_BITS & 127);
        l2[j] = (int8_t)(x >> 2 * LIMB_BITS & 127);
        l3[j] = (int8_t)(x >> 3 * LIMB_BITS);
    }
}

/* num[q][d] += 2^(7l) acc_l[q][d] + 2^(7(l+1)) acc_l+1[q][d] for d tile dt (d < D). */
static void add_limb_sums(int64_t* num, size_t D, size_t dt, int l, const int32_t lo[TQ][DT],
                          const int32_t hi[TQ][DT]) {
    const int64_t w_lo = (int64_t)1 << (LIMB_BITS * l), w_hi = (int64_t)1 << (LIMB_BITS * (l + 1));
    const size_t d0 = DT * dt, nd = D - d0 < DT ? D - d0 : DT;
    for (size_t q = 0; q < TQ; q++)
        for (size_t dd = 0; dd < nd; dd++) num[q * D + d0 + dd] += w_lo * lo[q][dd] + w_hi * hi[q][dd];
}

/* num = Σ_l 2^(7l) limbs_l · values over the first `blocks` key blocks: d tiles (dt, dt+1) x limbs
 * (l, l+1) per pass, the accumulators flushed every FLUSH_BLOCKS blocks. */
TL_TILES static void value_sums(const tile_buffers* b, size_t D, size_t blocks) {
    const size_t limb_stride = TQ * b->n_pad;
    memset(b->num, 0, TQ * D * sizeof(int64_t));
    for (size_t dt = 0; dt < b->n_dt; dt += 2)
        for (int l = 0; l < LIMBS; l += 2)
            for (size_t b0 = 0; b0 < blocks; b0 += FLUSH_BLOCKS) {
                const size_t b1 = blocks - b0 < FLUSH_BLOCKS ? blocks : b0 + FLUSH_BLOCKS;
                tl_tile_zero(0);
                tl_tile_zero(1);
                tl_tile_zero(2);
                tl_tile_zero(3);
                for (size_t kb = b0; kb < b1; kb++) {
                    const int8_t* B = b->vpack + (kb * b->n_dt + dt) * TILE_BYTES;
                    tl_tile_load(4, b->limbs + l * limb_stride + KB * kb, b->n_pad);
                    tl_tile_load(5, b->limbs + (l + 1) * limb_stride + KB * kb, b->n_pad);
                    tl_tile_load(6, B, KB);
                    tl_tile_load(7, B + TILE_BYTES, KB);
                    tl_tile_dpbssd(0, 4, 6);
                    tl_tile_dpbssd(1, 5, 6);
                    tl_tile_dpbssd(2, 4, 7);
                    tl_tile_dpbssd(3, 5, 7);
                }
                int32_t acc[4][TQ][DT]; /* [limb l, l+1 of dt; l, l+1 of dt + 1][query][d] */
                tl_tile_store(0, &acc[0][0][0], sizeof acc[0][0]);
                tl_tile_store(1, &acc[1][0][0], sizeof acc[1][0]);
                tl_tile_store(2, &acc[2][0][0], sizeof acc[2][0]);
                tl_tile_store(3, &acc[3][0][0], sizeof acc[3][0]);
                add_limb_sums(b->num, D, dt, l, acc[0], acc[1]);
                if (DT * (dt + 1) < D) add_limb_sums(b->num, D, dt + 1, l, acc[2], acc[3]);
            }
}

/* ---- the values, packed once ------------------------------------------------------------------ */

/* b->vrow[i] = the value row of key lo + i for keys lo .. hi; with unpack_keys (an int4 cache),
 * b->keys row i = key lo + i unpacked (zero past D), and zero rows up to the next 16 keys. */
static void value_rows(const tile_buffers* b, const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer,
                       uint32_t kv_head, size_t lo, size_t hi, bool unpack_keys) {
    const size_t R = tl_kv_row_bytes(g), D = g->head_dim;
    tl_attn_segment seg;
    size_t si = tl_kv_find(kv, lo), col = 0, len;
    while ((len = tl_attn_next_segment(kv, &si, lo, hi, &seg))) {
        const int8_t* values = tl_kv_values(g, seg.block, layer, kv_head) + seg.from * R;
        const int8_t* keys = tl_kv_keys(g, seg.block, layer, kv_head) + seg.from * R;
        for (size_t j = 0; j < len; j++) {
            b->vrow[col + j] = values + j * R;
            if (!unpack_keys) continue;
            tl_kv_unpack4(keys + j * R, D, b->keys + (col + j) * b->Dp);
            memset(b->keys + (col + j) * b->Dp + D, 0, b->Dp - D);
        }
        col += len;
    }
    if (unpack_keys) memset(b->keys + col * b->Dp, 0, (round_up(col, TL_TILE_ROWS) - col) * b->Dp);
}

void tl_attn_pack_slice(const tl_kv_geom* g, const tl_kv_table* kv, uint32_t layer, uint32_t kv_head, size_t n,
                        tl_attn_scratch* s) {
    tile_buffers b;
    carve(s->tile, s->tile_keys, g, &b);
    memset(b.zeros, 0, b.Dp);
    value_rows(&b, g, kv, layer, kv_head, 0, n - 1, g->kv_bits != 8);
    for (size_t grp = 0; grp < round_up(n, KB) / 4; grp++) pack_value_group(&b, grp, n, g->head_dim, g->kv_bits != 8);
}

/* ---- the tile --------------------------------------------------------------------------------- */

TL_TILES void tl_attend_tile(const tl_attn_kernels* kern, const tl_kv_geom* g, const tl_kv_table* kv,
                             uint32_t layer, uint32_t kv_head, size_t p0, size_t m, uint32_t window,
                             size_t instruction, const float* q, size_t q_stride, float* o, size_t o_stride,
                             size_t packed_keys, tl_attn_scratch* s) {
    const size_t D = g->head_dim, R = tl_kv_row_bytes(g), lo = tl_attn_first_key(p0, window),
                 hi = tl_attn_last_key(p0 + m - 1, instruction), n = hi - lo + 1, n_pad = round_up(n, KB);
    const bool packed = lo == 0 && hi < packed_keys; /* tl_attn_pack_slice packed this union */
    const bool unpacked = packed && g->kv_bits != 8;   /* and unpacked its int4 keys            */
    tile_buffers b;
    carve(s->tile, s->tile_keys, g, &b);
    tl_tiles_configure(&tl_tiles_full);

    /* the queries: (qq, sq) = Q8(q_i), c_i = sq / sqrt(D), qq into B */
    float c[TQ];
    memset(b.qpack, 0, TQ * b.Dp);
    memset(b.stage, 0, TQ * b.Dp);
    memset(b.zeros, 0, b.Dp);
    for (size_t i = 0; i < m; i++) {
        c[i] = kern->quantize(q + i * q_stride, D, 127, s->qq) / sqrtf((float)D);
        for (size_t d = 0; d < D; d++) b.qpack[(d / 4) * KB + 4 * i + d % 4] = s->qq[d];
    }

    /* pass 1 over the union: scales, scores */
    tl_attn_segment seg;
    size_t si = tl_kv_find(kv, lo), col = 0, len;
    while ((len = tl_attn_next_segment(kv, &si, lo, hi, &seg))) {
        const int8_t* keys = tl_kv_keys(g, seg.block, layer, kv_head) + seg.from * R;
        memcpy(b.sk + col, tl_kv_key_scales(g, seg.block, layer, kv_head) + seg.from, len * sizeof(float));
        memcpy(b.sv + col, tl_kv_value_scales(g, seg.block, layer, kv_head) + seg.from, len * sizeof(float));
        for (size_t j0 = 0; j0 < len && !unpacked; j0 += TL_TILE_ROWS)
            score_keys(&b, g, keys + j0 * R, len - j0 < TL_TILE_ROWS ? len - j0 : TL_TILE_ROWS, m, c, col + j0, false);
        col += len;
    }
    for (size_t j0 = 0; j0 < n && unpacked; j0 += TL_TILE_ROWS) /* the int4 keys tl_attn_pack_slice unpacked */
        score_keys(&b, g, NULL, n - j0 < TL_TILE_ROWS ? n - j0 : TL_TILE_ROWS, m, c, j0, true);

    /* per query, on its own visible row: the branches of §4.1, M, kappa, U (as limbs), den */
    float svmax[TQ];
    int64_t den[TQ];
    bool nan_weight[TQ];
    for (size_t row = 0; row < LIMBS * TQ; row++) memset(b.limbs + row * b.n_pad, 0, n_pad);
    for (size_t i = 0; i < m; i++) {
        const size_t first = tl_attn_first_key(p0 + i, window) - lo,
                     count = tl_attn_last_key(p0 + i, instruction) - lo - first + 1;
        svmax[i] = kern->max(b.sv + first, count, -INFINITY);
        nan_weight[i] = false;
        den[i] = 0;
        if (!(svmax[i] > 0.0f)) continue; /* every visible value row is zero */
        const float* row = b.scores + i * b.n_pad + first;
        const float M = kern->max(row, count, -INFINITY);
        const float kappa = 16777216.0f / svmax[i]; /* 2^24 / svmax */
        den[i] = kern->weights(row, b.sv + first, count, M, kappa, s->u, &nan_weight[i]);
        split_limbs(s->u, count, b.limbs + i * b.n_pad + first, TQ * b.n_pad);
    }

    /* pass 2: the value sums of every query at once (past n, the packed values may be later keys':
     * their limbs are zero) */
    if (!packed) {
        value_rows(&b, g, kv, layer, kv_head, lo, hi, false);
        for (size_t grp = 0; grp < n_pad / 4; grp++) pack_value_group(&b, grp, n, D, g->kv_bits != 8);
    }
    value_sums(&b, D, n_pad / KB);
    tl_tiles_release();

    for (size_t i = 0; i < m; i++) {
        float* oi = o + i * o_stride;
        if (!(svmax[i] > 0.0f))
            for (size_t d = 0; d < D; d++) oi[d] = 0.0f;
        else if (nan_weight[i])
            for (size_t d = 0; d < D; d++) oi[d] = NAN;
        else
            kern->output(b.num + i * D, D, den[i], svmax[i], oi);
    }
}
