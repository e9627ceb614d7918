/* matmul_scalar.c — the portable linear kernel, reading the file's own layout. It is the
 * reference the SIMD paths are tested against: a plain exact integer dot product per
 * (q row, output row), in i32 (the loader proved every partial sum of an int8 row fits; a block
 * input's digit rows are such rows). */
#include "cpu/matmul_kernels.h"

static int32_t dot_int8(const int8_t* q, const int8_t* w, size_t K) {
    int32_t acc = 0;
    for (size_t k = 0; k < K; k++) acc += (int32_t)q[k] * w[k];
    return acc;
}

static int32_t dot_int4(const int8_t* q, const uint8_t* w4, const uint8_t* mult, size_t K,
                        size_t gs) {
    int32_t acc = 0;
    for (size_t g0 = 0; g0 < K; g0 += gs) {
        int32_t part = 0;
        for (size_t k = g0; k < g0 + gs; k += 2) {
            const uint8_t byte = w4[k / 2];
            part += (int32_t)q[k] * (((byte & 15) ^ 8) - 8);
            part += (int32_t)q[k + 1] * (((byte >> 4) ^ 8) - 8);
        }
        acc += (int32_t)mult[g0 / gs] * part;
    }
    return acc;
}

void tl_gemm_scalar(const tl_linear* L, const tl_acts* A, uint32_t row0, const tl_gemm_out* out) {
    const tl_linear_src* s = &L->src;
    const size_t K = s->cols, rows = tl_acts_rows(A);
    for (uint32_t j = row0; j < out->row1; j++) {
        for (size_t t = 0; t < rows; t++) {
            const int8_t* q = A->q + t * A->stride;
            const int32_t acc = s->group_size
                ? dot_int4(q, s->w4 + (size_t)j * (K / 2), s->mult + (size_t)j * (K / s->group_size), K,
                           s->group_size)
                : dot_int8(q, s->w8 + (size_t)j * K, K);
            tl_gemm_put(out, L, A, t, j, acc);
        }
    }
}
