/* isa.c — run-time ISA detection, and the TINYLOOP_ISA override.
 *
 * AVX2 and AVX-512: cpuid + OS register-state support via libgcc's __builtin_cpu_supports; the
 * AVX-512 VNNI path asks for F, BW, DQ, VL and VNNI (every CPU with VNNI has the others).
 * AMX: cpuid leaf 7 (AMX-TILE, AMX-INT8), XCR0's tile bits (the OS manages the state), AVX-512
 * VNNI (the AMX path runs fewer than 16 rows on it), and Linux's permission for the 8 KiB tile
 * data state, requested once per process with arch_prctl(ARCH_REQ_XCOMP_PERM): the permission
 * is process-wide, so every pool thread may then run tiles. In a TINYLOOP_AMX_EMULATION build
 * (tests only) the tiles are plain C and AMX is available on every CPU with AVX2 (the rest of
 * the AMX path runs the AVX2 row and attention kernels), but never chosen by TL_ISA_AUTO. The
 * SIMD kernels are compiled with function-level target attributes, so the library itself needs
 * no -march flag. */
#include "cpu/isa.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(TL_AMX_EMULATION)
enum {
    CPUID7_EDX_AMX_TILE = 1u << 24,
    CPUID7_EDX_AMX_INT8 = 1u << 25,
    CPUID1_ECX_OSXSAVE = 1u << 27,
    XCR0_TILE = 3u << 17,           /* XTILECFG and XTILEDATA                        */
    ARCH_REQ_XCOMP_PERM = 0x1023,   /* <asm/prctl.h>, Linux 5.16+                    */
    XFEATURE_XTILEDATA = 18
};

static bool amx_detected;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void detect_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & CPUID1_ECX_OSXSAVE)) return;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    if ((d & (CPUID7_EDX_AMX_TILE | CPUID7_EDX_AMX_INT8)) != (CPUID7_EDX_AMX_TILE | CPUID7_EDX_AMX_INT8)) return;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & XCR0_TILE) != XCR0_TILE) return;
    if (!tl_isa_available(TL_ISA_AVX512_VNNI)) return;
#if defined(__linux__)
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
#endif
    amx_detected = true;
}

static bool amx_available(void) {
    pthread_once(&amx_once, detect_amx);
    return amx_detected;
}
#elif defined(TL_AMX_EMULATION)
static bool amx_available(void) { return tl_isa_available(TL_ISA_AVX2); }
#else
static bool amx_available(void) { return false; }
#endif

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
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#else
    case TL_ISA_AVX2:
    case TL_ISA_AVX512_VNNI: return false;
#endif
    case TL_ISA_AMX: return amx_available();
    }
    return false;
}

tl_isa tl_isa_best(void) {
#if !defined(TL_AMX_EMULATION)
    if (tl_isa_available(TL_ISA_AMX)) return TL_ISA_AMX;
#endif
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
#if defined(TL_AMX_EMULATION)
    case TL_ISA_AMX: return "amx-emulated";
#else
    case TL_ISA_AMX: return "amx";
#endif
    }
    return "unknown";
}

bool tl_isa_from_name(const char* name, tl_isa* out) {
    static const struct {
        const char* name;
        tl_isa isa;
    } names[] = {{"auto", TL_ISA_AUTO}, {"scalar", TL_ISA_SCALAR},     {"avx2", TL_ISA_AVX2},
                 {"avx512", TL_ISA_AVX512_VNNI}, {"avx512-vnni", TL_ISA_AVX512_VNNI}, {"amx", TL_ISA_AMX}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(name, names[i].name) == 0) {
            *out = names[i].isa;
            return true;
        }
    return false;
}

TL_API bool tl_cpu_supports(tl_isa isa) { return tl_isa_available(isa); }
