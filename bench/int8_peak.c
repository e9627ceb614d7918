/* int8_peak.c — this machine's int8 multiply-add peak on one kernel path, for bench/bench_isa.py.
 *
 *     cc -O2 -mavx512f -mavx512vnni -mamx-tile -mamx-int8 -pthread bench/int8_peak.c -o int8_peak
 *     ./int8_peak amx|avx512-vnni THREADS
 *
 * amx:          each thread runs STEPS steps of four TDPBSSD on four independent accumulator
 *               tiles (tmm0..3 += {tmm4, tmm5} x {tmm6, tmm7}, every tile 16 rows x 64 bytes:
 *               16 x 16 x 64 multiply-adds per instruction), after asking Linux for the tile
 *               state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; it holds for the whole
 *               process).
 * avx512-vnni:  each thread runs STEPS steps of ACCS VPDPBUSD zmm on ACCS independent
 *               accumulators (16 lanes x 4 multiply-adds per instruction).
 * Independent accumulators hide the instruction's latency, so only its throughput counts.
 * Prints one number: int8 multiply-adds per second over all threads, in T MAC/s, the best of
 * REPEATS short runs (wall time from before the threads start to after they all end; short and
 * many, so that on a shared machine some run gets its cores to itself). Exit status 1, with the
 * reason on stderr, when the arguments are wrong or the tile request or a thread fails. The CPU
 * must have the path (bench_isa.py checks lscpu's flags first). Not here: checking the sums
 * (the kernels' exactness is libtinyloop's tests' job). */
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define STEPS 250000L
#define REPEATS 20
#define MAX_THREADS 256
#define ACCS 12
#define AMX_MACS_PER_STEP (4.0 * 16 * 16 * 64)
#define VNNI_MACS_PER_STEP (ACCS * 16.0 * 4)

struct tile_config {          /* the LDTILECFG memory layout, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0..7 all 16 rows x 64 bytes. A static object, not a local that is filled in: GCC's
 * _tile_loadconfig tells the compiler it reads only 8 bytes, so it may drop stores to a local. */
static const struct tile_config config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static void* run_amx(void* unused) {
    (void)unused;
    int8_t operand[16 * 64];
    for (int i = 0; i < 16 * 64; i++) operand[i] = (int8_t)(i * 37 + 11);
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64);
    _tile_loadd(7, operand, 64);
    for (long step = 0; step < STEPS; step++) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_release();
    return NULL;
}

static volatile int32_t sink; /* keeps the VNNI sums alive */

static void* run_vnni(void* unused) {
    (void)unused;
    const __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05060708);
    __m512i acc[ACCS];
    for (int i = 0; i < ACCS; i++) acc[i] = _mm512_set1_epi32(i);
    for (long step = 0; step < STEPS; step++) {
#pragma GCC unroll 12 /* ACCS: the accumulators stay in registers */
        for (int i = 0; i < ACCS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    }
    for (int i = 1; i < ACCS; i++) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
    sink = _mm512_reduce_add_epi32(acc[0]);
    return NULL;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char** argv) {
    const int amx = argc == 3 && strcmp(argv[1], "amx") == 0;
    const int vnni = argc == 3 && strcmp(argv[1], "avx512-vnni") == 0;
    const int threads = argc == 3 ? atoi(argv[2]) : 0;
    if (!(amx || vnni) || threads < 1 || threads > MAX_THREADS) {
        fprintf(stderr, "usage: %s amx|avx512-vnni THREADS (1 .. %d)\n", argv[0], MAX_THREADS);
        return 1;
    }
    if (amx && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: %s\n",
                strerror(errno));
        return 1;
    }
    pthread_t pool[MAX_THREADS];
    double best = 0.0;
    for (int repeat = 0; repeat < REPEATS; repeat++) {
        double start = seconds();
        for (int t = 0; t < threads; t++) {
            int err = pthread_create(&pool[t], NULL, amx ? run_amx : run_vnni, NULL);
            if (err) {
                fprintf(stderr, "pthread_create failed: %s\n", strerror(err));
                return 1;
            }
        }
        for (int t = 0; t < threads; t++) pthread_join(pool[t], NULL);
        double rate = (amx ? AMX_MACS_PER_STEP : VNNI_MACS_PER_STEP) * STEPS * threads / (seconds() - start);
        if (rate > best) best = rate;
    }
    printf("%.4f\n", best / 1e12);
    return 0;
}
