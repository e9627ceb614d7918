/* kernel_tables.c — which form of the row and attention kernels a pass runs: by default the
 * widest that its kernel path (tl_isa) and the CPU both allow. Every form is bit-identical, so
 * the choice changes speed only. */
#include "cpu/attention_kernels.h"
#include "cpu/isa.h"
#include "cpu/row_kernels.h"

/* AVX-512 row kernels: the AVX-512 VNNI and AMX paths, on a CPU with AVX-512 (an AMX emulation
 * build runs its AMX path on AVX2 CPUs too). */
static bool wide_rows(tl_isa isa) {
    return (isa == TL_ISA_AVX512_VNNI || isa == TL_ISA_AMX) && tl_isa_available(TL_ISA_AVX512_VNNI);
}

tl_isa tl_widest_row_isa(tl_isa path) {
    if (path == TL_ISA_SCALAR) return TL_ISA_SCALAR;
    return wide_rows(path) ? TL_ISA_AVX512_VNNI : TL_ISA_AVX2;
}

const tl_row_kernels* tl_row_kernels_for(tl_isa row_isa) {
    if (row_isa == TL_ISA_SCALAR) return &tl_rows_scalar;
    return row_isa == TL_ISA_AVX512_VNNI ? &tl_rows_avx512 : &tl_rows_avx2;
}

const tl_attn_kernels* tl_attn_kernels_for(tl_isa row_isa) {
    if (row_isa == TL_ISA_SCALAR) return &tl_attn_scalar;
    return row_isa == TL_ISA_AVX512_VNNI ? &tl_attn_avx512 : &tl_attn_avx2;
}
