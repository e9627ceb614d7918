/* test_attention_split.c — the arithmetic of the CUDA backend's split decode attention
 * (src/cuda/attention_split.h), run on the CPU: one (row, head)'s keys are cut into n ranges as
 * attention.cu cuts them, each range computes its partial maxima and then its partial integer
 * sums with the header's functions, and the merged output must equal cpu/attention.c's unsplit
 * tl_attend bit for bit, for every n (ranges of one key, empty ranges), either merge order, and
 * the special branches of docs/spec.md §4.1 (all-zero values, infinite value scales, infinite
 * and NaN scores) and a negative maximum score, with and without a window. */
#include <math.h>
#include <string.h>

#include "core/kvcache.h"
#include "cpu/attention.h"
#include "cpu/quant.h"
#include "cuda/attention_split.h"
#include "test_util.h"

enum { BLOCK = 8, D_MAX = 64, KEYS_MAX = 200, SPLITS_MAX = KEYS_MAX + 8 };

/* Where position j's key lives. */
typedef struct key_ref {
    const int8_t* k;
    const int8_t* v;
    float sk, sv;
} key_ref;

static key_ref key_at(const tl_kv_geom* g, const tl_kv_table* kv, size_t j) {
    const tl_kv_span* sp = &kv->spans[tl_kv_find(kv, j)];
    const size_t slot = j - sp->start, D = g->head_dim;
    key_ref r = {tl_kv_keys(g, sp->block, 0, 0) + slot * D, tl_kv_values(g, sp->block, 0, 0) + slot * D,
                 tl_kv_key_scales(g, sp->block, 0, 0)[slot], tl_kv_value_scales(g, sp->block, 0, 0)[slot]};
    return r;
}

/* attention.cu's split path on the host: n ranges, pass 1 per range, merged maxima, passes 2 and
 * 3 per range, merged sums (in reverse range order if `reverse`), the final step. */
static void split_attend(const tl_kv_geom* g, const tl_kv_table* kv, size_t pos, uint32_t window, const float* qh,
                         uint32_t n, int reverse, float* o) {
    static tl_att_max maxima[SPLITS_MAX];
    static tl_att_sum sums[SPLITS_MAX];
    static int64_t nums[SPLITS_MAX * D_MAX];
    static float scores[KEYS_MAX];
    static int32_t u[KEYS_MAX];
    const size_t D = g->head_dim;
    const size_t lo = (window && pos + 1 > window) ? pos + 1 - window : 0;
    const uint32_t nvis = (uint32_t)(pos - lo + 1);
    int8_t qq[D_MAX];
    const float c = tl_quantize_row(qh, D, 127, qq) / sqrtf((float)D);

    for (uint32_t i = 0; i < n; i++) { /* split_scores_kernel */
        uint32_t k0, k1;
        tl_att_split_range(nvis, n, i, &k0, &k1);
        tl_att_max m = {-INFINITY, -INFINITY};
        for (uint32_t k = k0; k < k1; k++) {
            const key_ref r = key_at(g, kv, lo + k);
            int32_t dot = 0;
            for (size_t d = 0; d < D; d++) dot += (int32_t)qq[d] * r.k[d];
            scores[k] = ((float)dot * c) * r.sk;
            m.m = tl_fmax(m.m, scores[k]);
            m.svmax = tl_fmax(m.svmax, r.sv);
        }
        maxima[i] = m;
    }
    const tl_att_max mx = tl_att_merge_max(maxima, n);
    if (!(mx.svmax > 0.0f)) {
        for (size_t d = 0; d < D; d++) o[d] = 0.0f;
        return;
    }
    for (uint32_t i = 0; i < n; i++) { /* split_sums_kernel */
        uint32_t k0, k1;
        tl_att_split_range(nvis, n, i, &k0, &k1);
        bool nan = false;
        int64_t den = 0;
        for (uint32_t k = k0; k < k1; k++)
            den += tl_att_weight(scores[k], mx.m, key_at(g, kv, lo + k).sv, tl_att_kappa(mx.svmax), &u[k], &nan);
        sums[i] = (tl_att_sum){den, nan};
        for (size_t d = 0; d < D; d++) {
            int64_t num = 0;
            for (uint32_t k = k0; k < k1; k++) num += (int64_t)u[k] * key_at(g, kv, lo + k).v[d];
            nums[(size_t)i * D + d] = num;
        }
    }
    if (reverse) { /* the merge in another order must not change a bit */
        for (uint32_t i = 0, j = n - 1; i < j; i++, j--) {
            const tl_att_sum s = sums[i];
            sums[i] = sums[j];
            sums[j] = s;
            for (size_t d = 0; d < D; d++) {
                const int64_t t = nums[(size_t)i * D + d];
                nums[(size_t)i * D + d] = nums[(size_t)j * D + d];
                nums[(size_t)j * D + d] = t;
            }
        }
    }
    bool nan = false; /* split_merge_kernel */
    const int64_t den = tl_att_merge_den(sums, n, &nan);
    for (size_t d = 0; d < D; d++) o[d] = nan ? NAN : tl_att_output(tl_att_merge_num(nums + d, n, D), den, mx.svmax);
}

/* The ranges of every split count cover 0 .. nvis-1 once, in order. */
static void check_ranges(void) {
    for (uint32_t nvis = 1; nvis <= 70; nvis++)
        for (uint32_t n = 1; n <= 80; n++) {
            uint32_t next = 0;
            for (uint32_t i = 0; i < n; i++) {
                uint32_t k0, k1;
                tl_att_split_range(nvis, n, i, &k0, &k1);
                CHECK(k0 <= k1 && k1 <= nvis && (k0 == next || k0 == k1), "nvis %u, %u splits: range %u is [%u, %u)",
                      nvis, n, i, k0, k1);
                if (k1 > k0) next = k1;
            }
            CHECK(next == nvis, "nvis %u, %u splits cover %u keys", nvis, n, next);
        }
}

typedef enum {
    CASE_PLAIN,
    CASE_NEGATIVE_SCORES, /* every visible key points away from the query: M < 0 */
    CASE_ZERO_VALUES,
    CASE_INF_VALUE_SCALE,
    CASE_INF_SCORE,
    CASE_NAN_SCORE
} fill_case;

/* Random keys and values in every position of the table, then the case's special values among
 * the keys visible from pos (the infinite score: a key along the query qh, times sk = inf). */
static void fill(const tl_kv_geom* g, tl_kv_table* kv, size_t pos, uint32_t window, fill_case fc, const float* qh,
                 uint64_t* rng) {
    const size_t D = g->head_dim, lo = (window && pos + 1 > window) ? pos + 1 - window : 0;
    for (size_t i = 0; i < kv->n_spans; i++) {
        tl_kv_block* b = kv->spans[i].block;
        int8_t* k = tl_kv_keys(g, b, 0, 0);
        int8_t* v = tl_kv_values(g, b, 0, 0);
        float* sk = tl_kv_key_scales(g, b, 0, 0);
        float* sv = tl_kv_value_scales(g, b, 0, 0);
        for (size_t s = 0; s < kv->spans[i].count; s++) {
            for (size_t d = 0; d < D; d++) {
                k[s * D + d] = (int8_t)tu_uniform(rng, -127, 127);
                v[s * D + d] = (int8_t)tu_uniform(rng, -127, 127);
            }
            sk[s] = (float)tu_uniform(rng, 1, 4000) * 1e-5f; /* scores spread over many e-folds */
            sv[s] = (float)tu_uniform(rng, 1, 1000) * 1e-4f;
            const size_t j = kv->spans[i].start + s;
            const int visible = j >= lo && j <= pos;
            if (fc == CASE_NEGATIVE_SCORES && visible)
                for (size_t d = 0; d < D; d++)
                    k[s * D + d] = (int8_t)(qh[d] > 0.0f ? -tu_uniform(rng, 1, 127) : tu_uniform(rng, 1, 127));
            if (fc == CASE_ZERO_VALUES && visible) sv[s] = 0.0f;
            if (fc == CASE_INF_VALUE_SCALE && j == pos) sv[s] = INFINITY;
            if (fc == CASE_INF_SCORE && j == lo) {
                for (size_t d = 0; d < D; d++) k[s * D + d] = qh[d] > 0.0f ? 127 : qh[d] < 0.0f ? -127 : 0;
                sk[s] = INFINITY;
            }
            if (fc == CASE_NAN_SCORE && visible && j % 3 == 0) sk[s] = NAN;
        }
    }
}

int main(void) {
    check_ranges();
    uint64_t rng = 14;
    static const size_t dims[] = {64, 12, 6};
    static const uint32_t splits[] = {1, 2, 3, 4, 7, 16, 33};
    size_t compared = 0, nonzero = 0;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const size_t D = dims[di];
        const tl_kv_geom g = tl_kv_geom_make(BLOCK, 1, (uint32_t)D, 8);
        for (int fc = CASE_PLAIN; fc <= CASE_NAN_SCORE; fc++) {
            for (int windowed = 0; windowed <= 1; windowed++) {
                const size_t keys = (size_t)tu_uniform(&rng, 20, KEYS_MAX);
                const size_t pos = keys - 1;
                const uint32_t window = windowed ? (uint32_t)tu_uniform(&rng, 5, (int32_t)keys - 2) : 0;
                const uint32_t nvis = window ? window : (uint32_t)keys;
                float qh[D_MAX], ref[D_MAX], got[D_MAX];
                for (size_t d = 0; d < D; d++) qh[d] = (float)tu_uniform(&rng, -3000, 3000) * 1e-3f;
                tl_kv_table kv = {0};
                CHECK_OK(tl_kv_reserve(&kv, &g, 1, 0, keys));
                fill(&g, &kv, pos, window, (fill_case)fc, qh, &rng);

                static float s_scores[KEYS_MAX];
                static int32_t s_u[KEYS_MAX];
                int64_t s_num[D_MAX];
                int8_t s_qq[D_MAX];
                int16_t s_qq16[D_MAX];
                tl_attn_scratch scratch = {s_scores, s_u, s_num, s_qq, s_qq16, NULL, NULL, 0};
                tl_attend(&tl_attn_scalar, &g, &kv, 0, 0, pos, window, 0, qh, ref, &scratch);

                int expect_ok = 1;
                for (size_t d = 0; d < D; d++) {
                    const int is_nan = ref[d] != ref[d];
                    if (fc == CASE_ZERO_VALUES) expect_ok &= ref[d] == 0.0f;
                    if (fc == CASE_INF_VALUE_SCALE || fc == CASE_INF_SCORE) expect_ok &= is_nan;
                    if (fc == CASE_PLAIN || fc == CASE_NEGATIVE_SCORES || fc == CASE_NAN_SCORE) expect_ok &= !is_nan;
                    nonzero += ref[d] != 0.0f && !is_nan;
                }
                CHECK(expect_ok, "D %zu case %d window %u: the reference took another branch of §4.1", D, fc, window);

                const size_t n_fixed = sizeof splits / sizeof splits[0];
                for (size_t si = 0; si < n_fixed + 2; si++) { /* then one key a range, and empty ranges */
                    const uint32_t n = si < n_fixed ? splits[si] : si == n_fixed ? nvis : nvis + 5;
                    for (int reverse = 0; reverse <= 1; reverse++) {
                        memset(got, 0x55, sizeof got);
                        split_attend(&g, &kv, pos, window, qh, n, reverse, got);
                        CHECK(tu_same_bits(ref, got, D), "D %zu case %d window %u keys %u: %u splits%s differ", D, fc,
                              window, nvis, n, reverse ? " (reversed merge)" : "");
                        compared++;
                    }
                }
                tl_kv_clear(&kv);
            }
        }
    }
    CHECK(compared > 100 && nonzero > 100, "%zu comparisons, %zu nonzero outputs", compared, nonzero);
    return tu_finish("test_attention_split");
}
