/* pack.c — repack a linear's weights at load time for its SIMD kernel (matmul.h).
 *
 * Rows are grouped in tiles of TR rows (8 for AVX2, 16 for AVX-512 and AMX); padded rows and
 * columns hold weight 0.
 *  int8: packed[tile][Kp/4][TR][4] bytes (Kp = cols_padded): 4 consecutive k of each row side
 *        by side, so one vector holds TR rows x 4 k and a broadcast 4-byte activation word
 *        multiplies it; on AMX, 16 consecutive k/4 steps of a tile are a TDPBSSD B operand.
 *        16-row tiles keep corr[row] = 128 * Σ_k w (mod 2^32), the offset that vpdpbusd's u8
 *        (q + 128) activations add.
 *  int4: packed[tile][K/8][TR][4] bytes: byte b of a row holds k = 8s+b in its low nibble and
 *        k = 8s+4+b in its high nibble, each as w + 8 (0 .. 15); the kernels unpack with a mask
 *        and subtract 8. mult[tile][g][TR] = m as i32, corr[row] = Σ_g m * 128 * Σ_{k∈g} w,
 *        the offset that the u8 (q + 128) activation trick adds (removed modulo 2^32). */
#include <string.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "cpu/matmul.h"

static int int4_at(const tl_linear_src* s, size_t row, size_t k) {
    uint8_t byte = s->w4[row * (s->cols / 2) + k / 2];
    int nib = (k & 1) ? byte >> 4 : byte & 15;
    return (nib ^ 8) - 8;
}

static void pack_int8(tl_linear* L) {
    const tl_linear_src* s = &L->src;
    const uint32_t TR = L->tile_rows, steps = L->cols_padded / 4;
    uint8_t* out = L->packed;
    for (uint32_t tile = 0; tile < L->rows_padded / TR; tile++)
        for (uint32_t st = 0; st < steps; st++)
            for (uint32_t r = 0; r < TR; r++)
                for (uint32_t b = 0; b < 4; b++) {
                    const size_t row = (size_t)tile * TR + r, k = 4 * (size_t)st + b;
                    *out++ = (uint8_t)((row < s->rows && k < s->cols) ? s->w8[row * s->cols + k] : 0);
                }
    for (uint32_t row = 0; L->corr && row < s->rows; row++) {
        uint32_t wsum = 0; /* modulo 2^32, as the kernels compute */
        for (uint32_t k = 0; k < s->cols; k++) wsum += (uint32_t)(int32_t)s->w8[(size_t)row * s->cols + k];
        L->corr[row] = (int32_t)(128u * wsum);
    }
}

static void pack_int4(tl_linear* L) {
    const tl_linear_src* s = &L->src;
    const uint32_t TR = L->tile_rows, steps = s->cols / 8, groups = s->cols / s->group_size;
    uint8_t* out = L->packed;
    for (uint32_t tile = 0; tile < L->rows_padded / TR; tile++)
        for (uint32_t st = 0; st < steps; st++)
            for (uint32_t r = 0; r < TR; r++)
                for (uint32_t b = 0; b < 4; b++) {
                    const size_t row = (size_t)tile * TR + r, k = 8 * (size_t)st + b;
                    const int lo = row < s->rows ? int4_at(s, row, k) : 0;
                    const int hi = row < s->rows ? int4_at(s, row, k + 4) : 0;
                    *out++ = (uint8_t)((lo + 8) | (hi + 8) << 4);
                }
    for (uint32_t row = 0; row < L->rows_padded; row++) {
        uint32_t corr = 0; /* modulo 2^32, as the kernels compute */
        for (uint32_t g = 0; g < groups; g++) {
            const int32_t m = row < s->rows ? s->mult[(size_t)row * groups + g] : 0;
            L->mult[((size_t)(row / TR) * groups + g) * TR + row % TR] = m;
            int32_t wsum = 0;
            for (uint32_t k = g * s->group_size; row < s->rows && k < (g + 1) * s->group_size; k++)
                wsum += int4_at(s, row, k);
            corr += (uint32_t)m * 128u * (uint32_t)wsum;
        }
        L->corr[row] = (int32_t)corr;
    }
}

tl_status tl_linear_prepare(tl_linear* L, const tl_linear_src* src, tl_isa isa) {
    memset(L, 0, sizeof *L);
    L->src = *src;
    L->isa = isa;
    if (isa == TL_ISA_SCALAR || (src->group_size && src->group_size % 8)) {
        L->isa = TL_ISA_SCALAR;
        return TL_OK;
    }
    L->tile_rows = isa == TL_ISA_AVX2 ? 8 : 16;
    const uint32_t col_unit = isa == TL_ISA_AMX ? 64 : 8;
    L->rows_padded = (src->rows + L->tile_rows - 1) / L->tile_rows * L->tile_rows;
    L->cols_padded = (src->cols + col_unit - 1) / col_unit * col_unit;
    const size_t cells = (size_t)L->rows_padded * L->cols_padded;
    L->scale = tl_alloc_zeroed(L->rows_padded, sizeof(float));
    if (src->group_size) {
        const size_t groups = src->cols / src->group_size;
        L->packed = tl_alloc((size_t)L->rows_padded * src->cols / 2);
        L->mult = tl_alloc(groups * L->rows_padded * sizeof(int32_t));
        L->corr = tl_alloc(L->rows_padded * sizeof(int32_t));
    } else {
        L->packed = tl_alloc(cells);
        if (L->tile_rows == 16) L->corr = tl_alloc_zeroed(L->rows_padded, sizeof(int32_t));
    }
    /* int4 keeps corr at every tile height; int8 only for 16-row tiles */
    const bool needs_corr = src->group_size || L->tile_rows == 16;
    if (!L->scale || !L->packed || (src->group_size && !L->mult) || (needs_corr && !L->corr)) {
        tl_linear_release(L);
        return tl_fail_oom("repacked weights");
    }
    memcpy(L->scale, src->scale, src->rows * sizeof(float));
    if (src->group_size) pack_int4(L);
    else pack_int8(L);
    L->src.w8 = NULL; /* the SIMD kernels read the packed form only: the source may go */
    L->src.w4 = L->src.mult = NULL;
    L->src.scale = NULL;
    return TL_OK;
}

void tl_linear_release(tl_linear* L) {
    tl_free(L->packed);
    tl_free(L->mult);
    tl_free(L->corr);
    tl_free(L->scale);
    L->packed = NULL;
    L->mult = L->corr = NULL;
    L->scale = NULL;
}

size_t tl_linear_bytes(const tl_linear* L) {
    size_t bytes = 0;
    if (L->packed) bytes += tl_alloc_size(L->packed);
    if (L->mult) bytes += tl_alloc_size(L->mult);
    if (L->corr) bytes += tl_alloc_size(L->corr);
    if (L->scale) bytes += tl_alloc_size(L->scale);
    return bytes;
}
