/* test_primitives.c — unit tests of the numerics primitives (docs/spec.md §2, §3, §5), each
 * against an independent reference written here: exp2s and log2s from the spec's bit patterns, Q8/NQ
 * edge cases, the sigmoid and the weightless RN, the rint helper, CRC-32, the counter RNG, int4
 * unpacking, every available matmul path against a naive exact reference (row inputs, and block
 * inputs on their digit rows), and sampling against a full-sort reference. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/attention.h"
#include "base/crc32.h"
#include "cpu/isa.h"
#include "cpu/matmul.h"
#include "core/numerics.h"
#include "cpu/quant.h"
#include "core/sampling.h"
#include "test_util.h"

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- exp2s ---------------------------------------------------------------------------- */

/* The spec's algorithm with the constants taken from the bit-pattern column. */
static float ref_exp2s(float x) {
    static const uint32_t c[7] = {0x3f800000, 0x3f317215, 0x3e75fed5, 0x3d634186,
                                  0x3c1e9e34, 0x3aa2b764, 0x39648c8e};
    x = (x >= -126.0f) ? x : -126.0f;
    x = (x <= 126.0f) ? x : 126.0f;
    const float n = floorf(x);
    const float f = x - n;
    float p = from_bits(c[6]);
    for (int i = 5; i >= 0; i--) {
        p = p * f;
        p = p + from_bits(c[i]);
    }
    return p * from_bits((uint32_t)((int)n + 127) << 23);
}

static void test_exp2(void) {
    CHECK(tl_f32_to_bits(TL_LOG2E) == 0x3fb8aa3b, "LOG2E bits %08x", tl_f32_to_bits(TL_LOG2E));
    CHECK(tl_exp2s(0.0f) == 1.0f, "exp2s(0) = %g", (double)tl_exp2s(0.0f));
    CHECK(tl_exp2s(-0.0f) == 1.0f, "exp2s(-0)");
    uint64_t rng = 7;
    for (int i = 0; i < 200000; i++) {
        const float x = (float)((double)(tu_next(&rng) >> 11) / 9007199254740992.0 * 300.0 - 150.0);
        const float got = tl_exp2s(x), want = ref_exp2s(x);
        CHECK(tl_f32_to_bits(got) == tl_f32_to_bits(want), "exp2s(%.9g) = %a, reference %a", (double)x,
              (double)got, (double)want);
        if (fabsf(x) <= 126.0f) {
            const double rel = fabs((double)got / exp2((double)x) - 1.0);
            CHECK(rel < 1e-7, "exp2s(%.9g) relative error %g", (double)x, rel);
        }
        if (tu_failures > 20) return;
    }
    const float specials[] = {126.0f, -126.0f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN, 1e-45f, -0.5f, 0.999999f};
    for (size_t i = 0; i < sizeof specials / sizeof *specials; i++) {
        const float got = tl_exp2s(specials[i]), want = ref_exp2s(specials[i]);
        CHECK(tl_f32_to_bits(got) == tl_f32_to_bits(want), "exp2s(%g)", (double)specials[i]);
        CHECK(isfinite(got) && got > 0 && got >= 1.17549435e-38f, "exp2s(%g) = %g is not normal", (double)specials[i],
              (double)got);
    }
    CHECK(tl_exp2s(NAN) == tl_exp2s(-126.0f), "NaN clamps to -126");
    /* silu in the spec's order */
    const float v = 0.7f, t = 1.0f + ref_exp2s(-v * TL_LOG2E);
    CHECK(tl_silu(v) == v / t, "silu");
}

/* ---- log2s ---------------------------------------------------------------------------- */

/* §2.8 with the constants taken from the bit-pattern column: e by a linear scan of the bits,
 * f by ldexpf. */
static float ref_log2s(uint64_t N) {
    static const uint32_t k[7] = {0x4038aa3b, 0x3f76384f, 0x3f13bb63, 0x3ed30bb1,
                                  0x3ea4258a, 0x3e864d42, 0x3e6347ab};
    int e = 62;
    while (!(N >> e)) e--;
    const float f = ldexpf((float)N, -e);
    const float s = (f - 1.0f) / (f + 1.0f), w = s * s;
    float p = from_bits(k[6]);
    for (int i = 5; i >= 0; i--) {
        p = p * w;
        p = p + from_bits(k[i]);
    }
    p = p * s;
    return (float)e + p;
}

/* Exact bits against the reference; the absolute error against log2 N below 2^-19 where the
 * result is below 32 (N < 2^32). Above, the last step's rounding alone reaches half an ulp,
 * 2^-19 in [32, 64), so the bound is 2^-18 there (the spec's "below 2^-19" holds for
 * N < 2^32 only: log2s(3525049182612) is 2.02e-6 off). */
static void check_log2s(uint64_t N) {
    const float got = tl_log2s(N), want = ref_log2s(N);
    CHECK(tl_f32_to_bits(got) == tl_f32_to_bits(want), "log2s(%llu) = %a, reference %a", (unsigned long long)N,
          (double)got, (double)want);
    const double err = (double)fabsl((long double)got - log2l((long double)N));
    const double bound = N < (1ull << 32) ? 1.0 / 524288.0 : 1.0 / 262144.0;
    CHECK(err < bound, "log2s(%llu) = %.9g, error %g >= %g", (unsigned long long)N, (double)got, err, bound);
}

static void test_log2(void) {
    /* K_k is the f32 nearest 2 / (ln 2 (2k + 1)); LN2 the f32 nearest ln 2 */
    static const uint32_t k[7] = {0x4038aa3b, 0x3f76384f, 0x3f13bb63, 0x3ed30bb1,
                                  0x3ea4258a, 0x3e864d42, 0x3e6347ab};
    for (int i = 0; i < 7; i++) {
        const float nearest = (float)(2.0L / (0.693147180559945309417232121458176568L * (2 * i + 1)));
        CHECK(tl_f32_to_bits(nearest) == k[i], "K%d: nearest f32 %08x, spec %08x", i, tl_f32_to_bits(nearest), k[i]);
    }
    CHECK(tl_f32_to_bits(TL_LN2) == 0x3f317218 && TL_LN2 == (float)0.693147180559945309417232121458176568L,
          "LN2 bits %08x", tl_f32_to_bits(TL_LN2));
    CHECK(tl_log2s(1) == 0.0f && tl_log2s(2) == 1.0f && tl_log2s(1u << 24) == 24.0f, "log2s of powers of two");
    for (uint64_t N = 1; N <= (1u << 18); N++) check_log2s(N);
    for (int e = 1; e <= 62; e++) { /* around every power of two, and at 2^e - 1, which rounds up to 2^e */
        const uint64_t p = 1ull << e;
        check_log2s(p - 1), check_log2s(p), check_log2s(p + 1), check_log2s(p + p / 3);
        if (tu_failures > 20) return;
    }
    check_log2s(UINT64_MAX >> 1); /* 2^63 - 1: f = 2 */
    uint64_t rng = 11;
    for (int i = 0; i < 200000; i++) {
        const uint64_t N = tu_next(&rng) >> (1 + tu_next(&rng) % 63); /* every magnitude below 2^63 */
        if (N) check_log2s(N);
        if (tu_failures > 20) return;
    }
}

/* ---- rint, Q8, NQ ---------------------------------------------------------------------- */

static void test_rint(void) {
    const float ties[][2] = {{0.5f, 0}, {1.5f, 2}, {2.5f, 2}, {-0.5f, -0.0f}, {-1.5f, -2}, {-2.5f, -2},
                             {126.5f, 126}, {8388607.5f, 8388608}, {16777215.0f, 16777215.0f}};
    for (size_t i = 0; i < sizeof ties / sizeof *ties; i++)
        CHECK(tl_rint(ties[i][0]) == ties[i][1], "rint(%g) = %g", (double)ties[i][0], (double)tl_rint(ties[i][0]));
    uint64_t rng = 3;
    for (int i = 0; i < 200000; i++) {
        const float x = from_bits((uint32_t)tu_next(&rng));
        if (!isfinite(x)) continue;
        CHECK(tl_rint(x) == rintf(x), "rint(%a)", (double)x);
        /* the branch-free variant, for |x| <= 2^22 (as integers: -0 and +0 agree) */
        const float small = (float)((double)(tu_next(&rng) >> 11) / 9007199254740992.0 * 8388608.0 - 4194304.0);
        CHECK((int32_t)tl_rint_small(small) == (int32_t)rintf(small), "rint_small(%a)", (double)small);
        const float half = (float)tu_uniform(&rng, -1000, 1000) + 0.5f;
        CHECK((int32_t)tl_rint_small(half) == (int32_t)rintf(half), "rint_small(%g)", (double)half);
        if (tu_failures > 20) return;
    }
}

static void test_quantize(void) {
    int8_t q[8];
    const float zeros[4] = {0, -0.0f, 0, 0};
    CHECK(tl_quantize_row(zeros, 4, 127, q) == 0.0f && !q[0] && !q[1], "zero row");
    const float tiny[3] = {5.42e-20f, -5.42e-20f, 1e-30f}; /* below 2^-64 = 5.421010862e-20 */
    CHECK(tl_quantize_row(tiny, 3, 127, q) == 0.0f && !q[0] && !q[1] && !q[2], "tiny row quantizes to zero");
    const float at_limit[2] = {from_bits(0x1f800000), 0};
    CHECK(tl_quantize_row(at_limit, 2, 127, q) == from_bits(0x1f800000) / 127.0f && q[0] == 127, "2^-64 row is live");
    /* amax 127 -> r = 1 exactly: ties go to even */
    const float halves[8] = {127, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f, 126.5f};
    const int8_t want[8] = {127, 2, 4, -2, -4, 0, 0, 126};
    CHECK(tl_quantize_row(halves, 8, 127, q) == 1.0f, "scale of amax 127");
    CHECK(memcmp(q, want, 8) == 0, "ties to even: %d %d %d %d %d %d %d %d", q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]);
    /* Q4: qmax 7 */
    const float q4in[3] = {7, 3.5f, -7};
    CHECK(tl_quantize_row(q4in, 3, 7, q) == 1.0f && q[0] == 7 && q[1] == 4 && q[2] == -7, "Q4");
    /* NaN and inf rows: defined results, no crash */
    const float with_nan[3] = {NAN, 2.0f, -1.0f};
    const float s = tl_quantize_row(with_nan, 3, 127, q);
    CHECK(s == 2.0f / 127.0f && q[0] == -127 && q[1] == 127, "NaN row: s=%g q0=%d", (double)s, q[0]);
    const float with_inf[3] = {INFINITY, 1.0f, -INFINITY};
    CHECK(isinf(tl_quantize_row(with_inf, 3, 127, q)) && q[1] == 0 && q[0] == -127 && q[2] == -127, "inf row");
    /* NQ against the formula written out */
    const float x[5] = {0.3f, -1.7f, 2.2f, 0.01f, -0.4f};
    int8_t qq[5];
    const float a = tl_rms_quantize_row(x, 5, 1e-5f, qq);
    int8_t q8[5];
    const float s8 = tl_quantize_row(x, 5, 127, q8);
    int64_t ss = 0;
    for (int i = 0; i < 5; i++) ss += q8[i] * q8[i];
    float t = (float)ss;
    t = t * s8;
    t = t * s8;
    t = t / 5.0f;
    t = t + 1e-5f;
    t = sqrtf(t);
    CHECK(a == s8 / t && memcmp(qq, q8, 5) == 0, "NQ");
    CHECK(tl_rms_quantize_row(zeros, 4, 1e-5f, q) == 0.0f, "NQ of zeros has a = 0");
}

/* §2.5's sigmoid (t = -v; e = exps(t); t = 1 + e; 1 / t, written here from ref_exp2s) and the
 * attention gate o * sig(z); §2.7's weightless RN, the bits of a gain of ones. */
static void test_sigmoid_and_plain_norm(void) {
    const float log2e = from_bits(0x3fb8aa3b);
    uint64_t rng = 5;
    for (int k = 0; k < 20000; k++) {
        const float v = k < 4 ? (float[]){NAN, -INFINITY, INFINITY, 0.0f}[k]
                              : from_bits((uint32_t)tu_next(&rng)) * (k % 2 ? 1.0f : 0x1p-100f);
        float t = -v;
        const float e = ref_exp2s(t * log2e);
        t = 1.0f + e;
        const float want = 1.0f / t, o = (float)tu_uniform(&rng, -1000, 1000) / 7.0f;
        CHECK(tl_f32_to_bits(tl_sigmoid(v)) == tl_f32_to_bits(want) || (isnan(v) && tl_sigmoid(v) == 1.0f),
              "sig(%g) = %g, want %g", (double)v, (double)tl_sigmoid(v), (double)want);
        float g = o;
        tl_gate_row(&g, &v, 1);
        CHECK(tl_f32_to_bits(g) == tl_f32_to_bits(o * want), "gate %g * sig(%g)", (double)o, (double)v);
    }
    CHECK(tl_sigmoid(NAN) == 1.0f && tl_sigmoid(0.0f) == 0.5f && tl_sigmoid(-200.0f) == 0x1p-126f, "sig edges");
    float x[67], ones[67], y1[67], y2[67];
    for (int round = 0; round < 200; round++) {
        const size_t n = (size_t)tu_uniform(&rng, 1, 67);
        for (size_t i = 0; i < n; i++) {
            x[i] = (float)tu_uniform(&rng, -100000, 100000) / (float)tu_uniform(&rng, 1, 100000);
            if (round % 9 == 1 && i == n / 2) x[i] = NAN;
            ones[i] = 1.0f;
        }
        tl_rms_norm_row(x, ones, n, 1e-6f, y1);
        tl_rms_norm_row(x, NULL, n, 1e-6f, y2);
        CHECK(memcmp(y1, y2, n * sizeof(float)) == 0, "weightless RN n=%zu round %d", n, round);
    }
}

/* The SIMD row forms (AVX2, AVX-512, each where this CPU has it) against the scalar ones, odd
 * lengths, NaN / inf / tie inputs. */
static void test_rows_simd(void) {
    const tl_row_kernels* forms[] = {&tl_rows_avx2, &tl_rows_avx512};
    const char* names[] = {"avx2", "avx512"};
    const bool present[] = {tl_isa_available(TL_ISA_AVX2), tl_isa_available(TL_ISA_AVX512_VNNI)};
    uint64_t rng = 77;
    float x[203], g1[203], g2[203], up[203];
    int8_t q1[203], q2[203];
    for (int round = 0; round < 3000; round++) {
        const size_t n = (size_t)tu_uniform(&rng, 1, 203);
        const float spread = from_bits((uint32_t)tu_uniform(&rng, 0x30000000, 0x4f000000));
        for (size_t i = 0; i < n; i++) {
            x[i] = (float)tu_uniform(&rng, -100000, 100000) / 100000.0f * spread;
            if (round % 4 == 0) x[i] = (float)tu_uniform(&rng, -254, 254) / 2.0f; /* ties */
            if (round % 50 == 1 && i % 7 == 3) x[i] = NAN;
            if (round % 97 == 2 && i == n / 2) x[i] = -INFINITY;
            if (round % 89 == 5) x[i] = (float)tu_uniform(&rng, -90, 90); /* silu's exp2s clamp */
            up[i] = (float)tu_uniform(&rng, -1000, 1000) / 100.0f;
        }
        const int qmax = round % 3 ? 127 : 7;
        for (size_t k = 0; k < sizeof forms / sizeof *forms; k++) {
            if (!present[k]) continue;
            const tl_row_kernels* r = forms[k];
            const float s1 = tl_quantize_row(x, n, qmax, q1), s2 = r->quantize(x, n, qmax, q2);
            CHECK(tl_f32_to_bits(s1) == tl_f32_to_bits(s2) && memcmp(q1, q2, n) == 0, "%s Q row n=%zu round %d",
                  names[k], n, round);
            const float a1 = tl_rms_quantize_row(x, n, 1e-6f, q1), a2 = r->rms_quantize(x, n, 1e-6f, q2);
            CHECK(tl_f32_to_bits(a1) == tl_f32_to_bits(a2) && memcmp(q1, q2, n) == 0, "%s NQ row n=%zu round %d",
                  names[k], n, round);
            memcpy(g1, x, n * sizeof(float));
            memcpy(g2, x, n * sizeof(float));
            tl_swiglu_row(g1, up, n);
            r->swiglu(g2, up, n);
            CHECK(memcmp(g1, g2, n * sizeof(float)) == 0, "%s swiglu row n=%zu round %d", names[k], n, round);
            memcpy(g1, up, n * sizeof(float));
            memcpy(g2, up, n * sizeof(float));
            tl_gate_row(g1, x, n);
            r->gate(g2, x, n);
            CHECK(memcmp(g1, g2, n * sizeof(float)) == 0, "%s gate row n=%zu round %d", names[k], n, round);
        }
        if (tu_failures > 20) return;
    }
}

/* ---- CRC and RNG ----------------------------------------------------------------------- */

static void test_crc_rng(void) {
    CHECK(tl_crc32(0, "123456789", 9) == 0xcbf43926u, "crc32 check value");
    uint8_t buf[3 * 256];
    for (int i = 0; i < 768; i++) buf[i] = (uint8_t)i;
    CHECK(tl_crc32(0, buf, 768) == 0xb0c0df2au, "crc32 of 0..255 x3");
    uint64_t rng = 11;
    for (size_t n = 0; n < 300; n += 7) {
        for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)tu_next(&rng);
        const size_t cut = n / 3;
        CHECK(tl_crc32(tl_crc32(0, buf, cut), buf + cut, n - cut) == tu_crc32(buf, n), "crc32 incremental, n=%zu", n);
    }
    /* values computed independently (Python big-int SplitMix64) */
    CHECK(tl_rng(0, 0) == 0xe220a8397b1dcdafull, "rng(0, 0)");
    CHECK(tl_rng(42, 7) == 0xccf635ee9e9e2fa4ull, "rng(42, 7)");
    CHECK(tl_rng(UINT64_MAX, 1ull << 40) == 0x68c83d31fa6f683full, "rng(2^64-1, 2^40)");
    CHECK(tl_rng(0x123456789abcdefull, 999999) == 0x1ffee2d5e612d1c3ull, "rng(0x123456789abcdef, 999999)");
}

/* ---- matmul paths ------------------------------------------------------------------------- */

typedef struct mm_case {
    uint32_t R, K, gs; /* gs 0 = int8 */
    size_t T;
    int extreme;       /* all weights and activations at their most negative */
    int digits;        /* block inputs (act_block): p in [-32385, 32385] on two digit rows a token */
} mm_case;

static int nibble_value(const uint8_t* w4, size_t k) {
    const int nib = (k & 1) ? w4[k / 2] >> 4 : w4[k / 2] & 15;
    return nib >= 8 ? nib - 16 : nib;
}

static void run_case(const mm_case* c, uint64_t* rng) {
    const size_t R = c->R, K = c->K, T = c->T, stride = tl_acts_stride(K);
    int8_t* w8 = malloc(R * K);
    uint8_t* w4 = malloc(R * K / 2 + 1);
    uint8_t* mult = malloc(c->gs ? R * (K / c->gs) : 1);
    float* ws = malloc(R * sizeof(float));
    enum { THREADS = 3 };
    const size_t rows = c->digits ? 2 * T : T;
    const size_t scratch_bytes = tl_linear_scratch_bytes(TL_ISA_AMX, rows, K);
    const size_t tiled_bytes = tl_acts_tiled_bytes(TL_ISA_AMX, rows, K);
    tl_acts A = {T, stride, calloc(rows, stride), calloc(rows, stride), malloc(T * sizeof(float)),
                 calloc(THREADS, scratch_bytes + 1), scratch_bytes, malloc(tiled_bytes + 1), c->digits,
                 c->digits ? malloc(THREADS * tl_acts_raw_bytes(T)) : NULL};
    memset(A.tiled, 0x5a, tiled_bytes); /* tl_linear_run rewrites all of it, padding rows included */
    int16_t* in = malloc(T * K * sizeof(int16_t)); /* each token's inputs: q, or block inputs p */
    const int16_t most = c->digits ? 32385 : 127;
    for (size_t i = 0; i < R * K; i++) w8[i] = c->extreme ? -128 : (int8_t)tu_uniform(rng, -128, 127);
    for (size_t i = 0; i < R * K / 2; i++) w4[i] = c->extreme ? 0x88 : (uint8_t)tu_next(rng);
    for (size_t i = 0; c->gs && i < R * (K / c->gs); i++) mult[i] = c->extreme ? 255 : (uint8_t)tu_uniform(rng, 0, 255);
    for (size_t j = 0; j < R; j++) ws[j] = (float)tu_uniform(rng, 1, 1000) / 4096.0f;
    for (size_t t = 0; t < T; t++) {
        for (size_t k = 0; k < K; k++) in[t * K + k] = c->extreme ? -most : (int16_t)tu_uniform(rng, -most, most);
        if (c->digits) tl_split_digits(in + t * K, K, A.q + 2 * t * stride, A.q + (2 * t + 1) * stride);
        for (size_t k = 0; !c->digits && k < K; k++) A.q[t * stride + k] = (int8_t)in[t * K + k];
        A.scale[t] = (float)tu_uniform(rng, 1, 1000) / 1024.0f;
    }
    const tl_linear_src src = {(uint32_t)R, (uint32_t)K, c->gs, c->gs ? NULL : w8, c->gs ? w4 : NULL,
                               c->gs ? mult : NULL, ws};
    /* naive reference: exact i64 sums */
    float* want = malloc(T * R * sizeof(float));
    for (size_t t = 0; t < T; t++)
        for (size_t j = 0; j < R; j++) {
            int64_t acc = 0;
            for (size_t k = 0; k < K; k++) {
                const int64_t w = c->gs ? (int64_t)nibble_value(w4 + j * (K / 2), k) * mult[j * (K / c->gs) + k / c->gs]
                                        : w8[j * K + k];
                acc += w * in[t * K + k];
            }
            CHECK(c->digits || (acc >= INT32_MIN && acc <= INT32_MAX), "test case breaks the accumulator bound");
            want[t * R + j] = 0.5f;
            tl_emit(&want[t * R + j], acc, A.scale[t], ws[j], true);
        }
    float* got = malloc(T * R * sizeof(float));
    tl_pool* pool;
    tl_pool_create(THREADS, &pool);
    for (tl_isa isa = TL_ISA_SCALAR; isa <= TL_ISA_AMX; isa++) {
        if (!tl_isa_available(isa)) continue;
        tl_linear lin;
        CHECK_OK(tl_linear_prepare(&lin, &src, isa));
        for (size_t r = 0; r < rows; r++) tl_acts_finish_row(&A, r);
        for (size_t i = 0; i < T * R; i++) got[i] = 0.5f;
        tl_linear_run(&lin, &A, got, R, true, pool);
        CHECK(tu_same_bits(got, want, T * R),
              "isa %d: R=%u K=%u gs=%u T=%zu extreme=%d digits=%d differs from the reference", isa, c->R, c->K, c->gs,
              c->T, c->extreme, c->digits);
        tl_linear_release(&lin);
    }
    tl_pool_destroy(pool);
    free(w8), free(w4), free(mult), free(ws), free(A.q), free(A.qx), free(A.scale), free(A.scratch), free(A.tiled),
        free(A.raw), free(in), free(want), free(got);
}

static void test_matmul(void) {
    uint64_t rng = 5;
    const uint32_t Rs[] = {1, 7, 8, 16, 17, 40, 100};
    const uint32_t Ks[] = {8, 16, 24, 40, 64, 96, 120};
    const size_t Ts[] = {1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 48}; /* 16+: AMX tiles */
    for (size_t r = 0; r < sizeof Rs / sizeof *Rs; r++)
        for (size_t k = 0; k < sizeof Ks / sizeof *Ks; k++)
            for (size_t t = 0; t < sizeof Ts / sizeof *Ts; t += 1 + (r + k) % 3) {
                mm_case c = {Rs[r], Ks[k], 0, Ts[t], 0, 0};
                run_case(&c, &rng);
                const uint32_t groups[] = {2, 6, 8, 16, 24, 40, 64};
                for (size_t g = 0; g < sizeof groups / sizeof *groups; g++)
                    if (Ks[k] % groups[g] == 0) {
                        c.gs = groups[g];
                        run_case(&c, &rng);
                    }
            }
    const uint32_t odd_K[] = {1, 3, 5, 13, 77};
    for (size_t k = 0; k < sizeof odd_K / sizeof *odd_K; k++) {
        mm_case c = {19, odd_K[k], 0, 6, 0, 0};
        run_case(&c, &rng);
    }
    /* accumulator extremes: int8 K = 2^16 (127 * 128 * K < 2^31), int4 K = 8192 with m = 255 */
    const mm_case big[] = {{3, 65536, 0, 2, 1, 0},  {17, 8192, 32, 3, 1, 0},  {9, 8192, 8192, 2, 1, 0},
                           {33, 65536, 0, 17, 1, 0}, {17, 8192, 32, 33, 1, 0}, {9, 8192, 8192, 16, 1, 0}};
    /* AMX token spans (token_span: 32 or 64 tokens at these K): several spans and a ragged tail */
    const mm_case spans[] = {{33, 8192, 0, 100, 0, 0}, {5, 32768, 0, 70, 0, 0}, {40, 8192, 0, 64, 0, 0}};
    for (size_t i = 0; i < sizeof spans / sizeof *spans; i++) run_case(&spans[i], &rng);
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) run_case(&big[i], &rng);
    /* block inputs on digit rows (docs/spec.md §3): decode, AMX tiles from 8 tokens (16 rows), rows
     * past one DIGIT_ROWS call (matmul.c), and sums past i32: 32385 * 128 * 2^16, 32385 * 8 * 255 * 8192 */
    const mm_case digits[] = {{17, 40, 0, 1, 0, 1},    {100, 64, 8, 3, 0, 1},   {300, 96, 0, 9, 0, 1},
                              {40, 120, 24, 17, 0, 1}, {600, 16, 16, 8, 0, 1},  {19, 13, 0, 2, 0, 1},
                              {3, 65536, 0, 1, 1, 1},  {17, 65536, 0, 8, 1, 1}, {17, 8192, 32, 3, 1, 1},
                              {17, 8192, 32, 8, 1, 1}};
    for (size_t i = 0; i < sizeof digits / sizeof *digits; i++) run_case(&digits[i], &rng);
}

/* ---- attention kernels ---------------------------------------------------------------- */

/* One SIMD set of segment kernels against the scalar ones: head sizes with and without SIMD
 * tails, segments longer than the i32 flush interval, extreme values, NaN and infinite inputs. */
static void check_attention_kernels(const tl_attn_kernels* simd, const char* name) {
    uint64_t rng = 21;
    const size_t Ds[] = {2, 12, 16, 20, 32, 40, 64, 66, 100, 128, 192, 520};
    /* every third one extreme; 4500 keys pass both SIMD paths' i32 flush intervals */
    const size_t ns[] = {1, 2, 7, 8, 9, 31, 4500, 513, 1100};
    for (size_t di = 0; di < sizeof Ds / sizeof *Ds; di++)
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            const size_t D = Ds[di], n = ns[ni];
            int8_t* k = malloc(n * D);
            int8_t* qq = malloc(D);
            int16_t* qq16 = malloc(D * sizeof(int16_t));
            float* sk = malloc(n * sizeof(float));
            float* sv = malloc(n * sizeof(float));
            float* s1 = malloc(n * sizeof(float));
            float* s2 = malloc(n * sizeof(float));
            int32_t* u1 = malloc(n * sizeof(int32_t));
            int32_t* u2 = malloc(n * sizeof(int32_t));
            int64_t* num1 = calloc(D, sizeof(int64_t));
            int64_t* num2 = calloc(D, sizeof(int64_t));
            const int extreme = ni % 3 == 0;
            for (size_t i = 0; i < n * D; i++) /* extreme: rows of -127 and 127 by turns */
                k[i] = extreme ? (i / D % 2 ? 127 : -127) : (int8_t)tu_uniform(&rng, -127, 127);
            for (size_t d = 0; d < D; d++) qq16[d] = qq[d] = extreme ? 127 : (int8_t)tu_uniform(&rng, -127, 127);
            for (size_t j = 0; j < n; j++) {
                sk[j] = (float)tu_uniform(&rng, 1, 1000) / 65536.0f;
                sv[j] = (float)tu_uniform(&rng, 0, 1000) / 4096.0f;
            }
            if (n > 8 && di % 2) sv[n / 2] = INFINITY; /* NaN weights */
            tl_attn_scratch scratch = {NULL, NULL, NULL, qq, qq16, NULL, NULL, 0};
            const float c = 0.37f;
            tl_attn_scalar.scores(&scratch, k, sk, n, D, c, s1);
            simd->scores(&scratch, k, sk, n, D, c, s2);
            CHECK(tu_same_bits(s1, s2, n), "%s attention scores D=%zu n=%zu", name, D, n);
            if (n > 3) s1[3] = s2[3] = NAN;
            float M = -INFINITY, svmax = 0;
            for (size_t j = 0; j < n; j++) M = tl_fmax(M, s1[j]), svmax = tl_fmax(svmax, sv[j]);
            for (size_t from = 0; from < n; from += n / 3 + 1) { /* a zero result's sign is free */
                const float m1 = tl_attn_scalar.max(s1 + from, n - from, -INFINITY);
                CHECK(m1 == simd->max(s2 + from, n - from, -INFINITY) && m1 == simd->max(s2 + from, n - from, m1),
                      "%s attention max D=%zu n=%zu from %zu", name, D, n, from);
            }
            if (svmax == 0) svmax = 1;
            const float kappa = 16777216.0f / svmax;
            bool nan1 = false, nan2 = false;
            const int64_t den1 = tl_attn_scalar.weights(s1, sv, n, M, kappa, u1, &nan1);
            const int64_t den2 = simd->weights(s2, sv, n, M, kappa, u2, &nan2);
            CHECK(den1 == den2 && nan1 == nan2 && memcmp(u1, u2, n * sizeof(int32_t)) == 0,
                  "%s attention weights D=%zu n=%zu", name, D, n);
            if (extreme)
                for (size_t j = 0; j < n; j++) u1[j] = u2[j] = 16777218; /* 2^24 + 2, the largest U */
            const tl_attn_rows one = {k, n};
            tl_attn_scalar.accumulate_segments(u1, &one, 1, D, num1);
            simd->accumulate_segments(u2, &one, 1, D, num2);
            CHECK(memcmp(num1, num2, D * sizeof(int64_t)) == 0, "%s attention accumulate D=%zu n=%zu", name, D, n);
            if (D > 1) num1[D - 1] = num2[D - 1] = -((int64_t)1 << 53) - 1; /* a conversion that rounds */
            float* o1 = malloc(D * sizeof(float));
            float* o2 = malloc(D * sizeof(float));
            const int64_t den = den1 > 0 ? den1 : 3;
            tl_attn_scalar.output(num1, D, den, svmax, o1);
            simd->output(num2, D, den, svmax, o2);
            CHECK(tu_same_bits(o1, o2, D), "%s attention output D=%zu n=%zu", name, D, n);
            free(o1), free(o2);
            free(k), free(qq), free(qq16), free(sk), free(sv), free(s1), free(s2), free(u1), free(u2), free(num1),
                free(num2);
        }
}

static void test_attention_kernels(void) {
    if (tl_isa_available(TL_ISA_AVX2)) check_attention_kernels(&tl_attn_avx2, "avx2");
    if (tl_isa_available(TL_ISA_AVX512_VNNI)) check_attention_kernels(&tl_attn_avx512, "avx512");
}

/* ---- sampling ------------------------------------------------------------------------------ */

static const float* ref_z;
static int ref_order(const void* a, const void* b) {
    const int32_t x = *(const int32_t*)a, y = *(const int32_t*)b;
    if (ref_z[x] != ref_z[y]) return ref_z[x] > ref_z[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* Spec §5.1 written out with a full sort of the vocabulary. */
static int32_t ref_sample(const tl_sampler* s, const float* logits, uint32_t V, const uint8_t* seen, uint64_t pos) {
    float* z = malloc(V * sizeof(float));
    int32_t* order = malloc(V * sizeof(int32_t));
    int64_t* w = malloc(V * sizeof(int64_t));
    for (uint32_t i = 0; i < V; i++) {
        z[i] = logits[i];
        if (s->penalty != 1.0f && seen[i]) z[i] = z[i] > 0 ? z[i] / s->penalty : z[i] * s->penalty;
        order[i] = (int32_t)i;
    }
    ref_z = z;
    qsort(order, V, sizeof *order, ref_order);
    int32_t result = order[0];
    if (s->temperature != 0.0f && !isinf(z[order[0]] / s->temperature)) {
        size_t kept = (s->top_k > 0 && (uint32_t)s->top_k < V) ? (size_t)s->top_k : V;
        const float m = z[order[0]] / s->temperature;
        int64_t total = 0;
        for (size_t i = 0; i < kept; i++) {
            w[i] = (int64_t)rintf(ref_exp2s((z[order[i]] / s->temperature - m) * TL_LOG2E) * 1048576.0f);
            total += w[i];
        }
        const int64_t P = (int64_t)rintf(s->top_p * 1048576.0f);
        size_t n = 0;
        int64_t cum = 0;
        while (n < kept) {
            cum += w[n++];
            if (cum * 1048576 >= P * total) break;
        }
        const uint64_t r = tl_rng(s->seed, pos) % (uint64_t)cum;
        int64_t run = 0;
        for (size_t i = 0; i < n; i++) {
            run += w[i];
            if ((uint64_t)run > r) {
                result = order[i];
                break;
            }
        }
    }
    free(z), free(order), free(w);
    return result;
}

static void test_sampling(void) {
    uint64_t rng = 9;
    const uint32_t V = 1000;
    float* logits = malloc(V * sizeof(float));
    uint8_t* seen = calloc(V, 1);
    tl_sample_scratch scratch = {malloc(V * sizeof(float)), malloc(V * sizeof(int32_t)), malloc(V * sizeof(int64_t))};
    const float temps[] = {0.0f, 0.05f, 0.7f, 1.0f, 2.5f, 1e-39f};
    const int32_t top_ks[] = {0, 1, 5, 50, 999, 1000, 5000};
    const float top_ps[] = {1.0f, 0.9f, 0.3f, 1e-7f};
    const float penalties[] = {1.0f, 1.3f, 0.8f};
    for (int round = 0; round < 1500; round++) {
        const float spread = (float)tu_uniform(&rng, 1, 40);
        for (uint32_t i = 0; i < V; i++) {
            logits[i] = (float)tu_uniform(&rng, -1000, 1000) / 1000.0f * spread;
            if (round % 5 == 0) logits[i] = (float)tu_uniform(&rng, -3, 3); /* many ties */
            seen[i] = tu_uniform(&rng, 0, 9) == 0;
        }
        tl_sampler s = {temps[round % 6], top_ks[round % 7], top_ps[round % 4], penalties[round % 3], tu_next(&rng)};
        const uint64_t pos = tu_next(&rng) % 5000;
        int32_t got = -1;
        CHECK_OK(tl_sample(&s, logits, V, seen, pos, &scratch, &got));
        const int32_t want = ref_sample(&s, logits, V, seen, pos);
        CHECK(got == want, "round %d: sampled %d, reference %d (T=%g k=%d p=%g rho=%g)", round, got, want,
              (double)s.temperature, s.top_k, (double)s.top_p, (double)s.penalty);
        if (tu_failures > 20) break;
    }
    /* z / T of the first candidate overflows to +inf, or to -inf with every logit negative (every
     * weight would be 0): the first candidate, id 7, whatever the seed (spec §5.1 step 5) */
    for (int sign = -1; sign <= 1; sign += 2)
        for (uint64_t seed = 0; seed < 4; seed++) {
            for (uint32_t i = 0; i < V; i++) logits[i] = (float)sign * 1e30f * (float)(2 + (i * 37 + 11) % 100);
            logits[7] = sign > 0 ? 3e38f : -1e30f; /* the largest */
            tl_sampler huge = {1e-30f, (int32_t)(seed % 2) * 5, 1.0f, 1.0f, seed};
            int32_t got = -1;
            CHECK_OK(tl_sample(&huge, logits, V, seen, seed, &scratch, &got));
            CHECK(got == 7, "z / T overflowing to %cinf: sampled %d, want 7", sign > 0 ? '+' : '-', got);
        }
    /* greedy without a penalty (one vectorised sweep): the lowest id of the maximum, -0 and +0
     * tying, over vocabularies shorter and longer than its lanes; a NaN or infinity anywhere
     * (in a lane or the tail) is still refused with the id that holds it */
    tl_sampler greedy = {0.0f, 0, 1.0f, 1.0f, 0};
    const uint32_t sizes[] = {1, 5, 16, 17, 999};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        const uint32_t n = sizes[k];
        for (uint32_t i = 0; i < n; i++) logits[i] = -1.0f - (float)(i % 7);
        logits[n - 1] = 0.0f;
        logits[n / 2] = -0.0f; /* ties with +0 and comes first */
        int32_t got = -1;
        CHECK_OK(tl_sample(&greedy, logits, n, seen, 0, &scratch, &got));
        CHECK(got == (int32_t)(n / 2), "greedy over %u logits: %d, want %u", n, got, n / 2);
        const float bad[] = {NAN, INFINITY, -INFINITY};
        for (size_t b = 0; b < 3; b++) {
            const uint32_t at = (uint32_t)(b * 7919u % n);
            const float kept = logits[at];
            logits[at] = bad[b];
            CHECK_STATUS(tl_sample(&greedy, logits, n, seen, 0, &scratch, &got), TL_ERR_NUMERIC);
            char want[64];
            snprintf(want, sizeof want, "logit %u is", at);
            CHECK(strstr(tl_last_error(), want) != NULL, "message: %s", tl_last_error());
            logits[at] = kept;
        }
    }
    logits[17] = NAN;
    tl_sampler s = {1.0f, 0, 1.0f, 1.0f, 0};
    int32_t tok;
    CHECK_STATUS(tl_sample(&s, logits, V, seen, 0, &scratch, &tok), TL_ERR_NUMERIC);
    CHECK(strstr(tl_last_error(), "non-finite logits") != NULL, "message: %s", tl_last_error());
    free(logits), free(seen), free(scratch.z), free(scratch.order), free(scratch.weights);
}

int main(void) {
    test_exp2();
    test_log2();
    test_rint();
    test_quantize();
    test_sigmoid_and_plain_norm();
    test_rows_simd();
    test_crc_rng();
    test_matmul();
    test_attention_kernels();
    test_sampling();
    return tu_finish("test_primitives");
}
