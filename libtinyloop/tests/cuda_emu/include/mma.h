/* mma.h (CPU emulation, tests only) — nvcuda::wmma for 16 x 16 x 16 tiles of 8-bit integers
 * accumulated in 32-bit integers, with the instruction's exact integer result (sums mod 2^32).
 *
 * Each lane holds whole A and B fragments but owns only its share of an accumulator, elements e
 * with e % 32 == lane, as the hardware spreads fragments over the warp's lanes (no code here may
 * index a fragment's elements, so nothing can tell): mma_sync computes that share, store_matrix_sync
 * writes it. The memory side keeps the hardware's rules:
 * load_matrix_sync reads the tile when the calling lane reaches it, store_matrix_sync writes only
 * the calling lane's share of the tile (elements e with e % 32 == lane), and neither synchronizes
 * the warp: a lane that reads the stored tile before a __syncwarp sees its neighbours' elements
 * unwritten, as on a GPU. The pointer must be 32-byte aligned and ldm a multiple of 16 bytes (of
 * 16 elements for 8-bit types, of 4 for int), else the run stops. */
#ifndef TL_CUDA_EMU_MMA_H
#define TL_CUDA_EMU_MMA_H

#include <stdint.h>

#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

/* A fragment: the whole tile, element (r, c) at v[r * 16 + c] (rows of A are m, of B k). */
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 is emulated");
    T v[256];
};

namespace detail {
template <typename T>
inline void check(const void* p, unsigned ldm, const char* what) {
    const unsigned quantum = 16 / sizeof(T); /* ldm counts elements: a multiple of 16 bytes */
    if (((uintptr_t)p & 31) != 0 || ldm % quantum != 0)
        tl_emu::kernel_fault("%s: pointer %p must be 32-byte aligned and ldm %u a multiple of %u", what, p, ldm,
                             quantum);
}

/* Element (r, c) of a tile stored at p with leading dimension ldm: row-major, or column-major. */
template <typename T>
inline T at(const T* p, unsigned ldm, bool col, int r, int c) {
    return col ? p[(size_t)c * ldm + r] : p[(size_t)r * ldm + c];
}
}  // namespace detail

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
    detail::check<T>(p, ldm, "wmma::load_matrix_sync");
    /* matrix_a (m, k) and matrix_b (k, n) both index (row, col) of their own shape */
    const bool col = std::is_same<Layout, col_major>::value;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.v[r * 16 + c] = detail::at(p, ldm, col, r, c);
}

template <typename T>
inline void fill_fragment(fragment<accumulator, 16, 16, 16, T>& f, T value) {
    for (int i = 0; i < 256; i++) f.v[i] = value;
}

/* d = a * b + c over 32-bit integers (the calling lane's share of d), each sum mod 2^32 as the
 * instruction (the library's exact sums never wrap). */
template <typename TA, typename TB, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, int>& d, const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TB, LB>& b, const fragment<accumulator, 16, 16, 16, int>& c) {
    for (int e = tl_emu::lane_id(); e < 256; e += 32) {
        const int m = e / 16, n = e % 16;
        uint32_t s = (uint32_t)c.v[e];
        for (int k = 0; k < 16; k++) s += (uint32_t)((int)a.v[m * 16 + k] * (int)b.v[k * 16 + n]);
        d.v[e] = (int)s;
    }
}

template <typename T>
inline void store_matrix_sync(T* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm, layout_t layout) {
    detail::check<T>(p, ldm, "wmma::store_matrix_sync");
    for (int e = tl_emu::lane_id(); e < 256; e += 32) {
        const int r = e / 16, c = e % 16;
        if (layout == mem_col_major) p[(size_t)c * ldm + r] = f.v[e];
        else p[(size_t)r * ldm + c] = f.v[e];
    }
}

}  // namespace wmma
}  // namespace nvcuda

#endif
