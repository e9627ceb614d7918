/* isa.c — run-time ISA detection (cpuid + OS register-state support via libgcc's
 * __builtin_cpu_supports). The SIMD kernels are compiled with function-level target
 * attributes, so the library itself needs no -march flag. */
#include "cpu/isa.h"

bool tl_isa_available(tl_isa isa) {
    switch (isa) {
    case TL_ISA_AUTO:
    case TL_ISA_SCALAR: return true;
#if defined(__x86_64__) && defined(__GNUC__)
    case TL_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2");
    case TL_ISA_AVX512_VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    case TL_ISA_AVX2:
    case TL_ISA_AVX512_VNNI: return false;
#endif
    }
    return false;
}

tl_isa tl_isa_best(void) {
    if (tl_isa_available(TL_ISA_AVX512_VNNI)) return TL_ISA_AVX512_VNNI;
    if (tl_isa_available(TL_ISA_AVX2)) return TL_ISA_AVX2;
    return TL_ISA_SCALAR;
}

const char* tl_isa_name(tl_isa isa) {
    switch (isa) {
    case TL_ISA_AUTO: return "auto";
    case TL_ISA_SCALAR: return "scalar";
    case TL_ISA_AVX2: return "avx2";
    case TL_ISA_AVX512_VNNI: return "avx512-vnni";
    }
    return "unknown";
}

TL_API bool tl_cpu_supports(tl_isa isa) { return tl_isa_available(isa); }
