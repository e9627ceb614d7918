/* matmul_scalar.c — the portable linear kernel, reading the file's own layout. It is the
 * reference the SIMD paths are tested against: a plain exact integer dot product per
 * (token, row), in i32 (the loader proved every partial sum fits). */
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

void tl_gemm_scalar(const tl_linear* L, const tl_acts* A, uint32_t row0, uint32_t row1,
                    float* y, size_t y_stride, bool accumulate) {
    const tl_linear_src* s = &L->src;
    const size_t K = s->cols;
    for (uint32_t j = row0; j < row1; j++) {
        for (size_t t = 0; t < A->n; t++) {
            const int8_t* q = A->q + t * A->stride;
            const int32_t acc = s->group_size
                ? dot_int4(q, s->w4 + (size_t)j * (K / 2), s->mult + (size_t)j * (K / s->group_size), K,
                           s->group_size)
                : dot_int8(q, s->w8 + (size_t)j * K, K);
            tl_emit(&y[t * y_stride + j], acc, A->scale[t], s->scale[j], accumulate);
        }
    }
}
