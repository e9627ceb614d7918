/* alloc.c — counting, fault-injectable, 64-byte-aligned allocator (see alloc.h).
 * Layout of a block: [64-byte header holding the requested size][payload]. Counters are
 * process-wide atomics; the peak is raised with a compare-and-swap loop. */
#include "base/alloc.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/errors.h"

enum { HEADER = 64 };
#define HUGE_PAGE ((size_t)2 << 20)

static atomic_size_t bytes_in_use;
static atomic_size_t peak_bytes;
static atomic_size_t live_allocs;
static atomic_size_t total_allocs;
static atomic_int_fast64_t fail_countdown = -1;  /* -1 = injection off */

/* True when this allocation must fail by injection (consumes one countdown step). */
static int injected_failure(void) {
    int_fast64_t left = atomic_load(&fail_countdown);
    while (left >= 0) {
        if (atomic_compare_exchange_weak(&fail_countdown, &left, left - 1)) return left == 0;
    }
    return 0;
}

void* tl_alloc(size_t bytes) {
    if (bytes > SIZE_MAX - HEADER || injected_failure()) return NULL;
    void* base = NULL;
    /* Big blocks (repacked weights, long KV tables) start on a huge-page boundary and ask for
     * transparent huge pages: far fewer TLB misses while streaming weights. */
    const int huge = bytes >= 2 * HUGE_PAGE;
    if (posix_memalign(&base, huge ? HUGE_PAGE : HEADER, HEADER + bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (huge) madvise(base, (HEADER + bytes) / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
#endif
    memcpy(base, &bytes, sizeof bytes);
    size_t now = atomic_fetch_add(&bytes_in_use, bytes) + bytes;
    size_t peak = atomic_load(&peak_bytes);
    while (now > peak && !atomic_compare_exchange_weak(&peak_bytes, &peak, now)) {
    }
    atomic_fetch_add(&live_allocs, 1);
    atomic_fetch_add(&total_allocs, 1);
    return (char*)base + HEADER;
}

void* tl_alloc_zeroed(size_t count, size_t size) {
    if (size != 0 && count > SIZE_MAX / size) return NULL;
    void* p = tl_alloc(count * size);
    if (p) memset(p, 0, count * size);
    return p;
}

size_t tl_alloc_size(const void* p) {
    size_t bytes;
    memcpy(&bytes, (const char*)p - HEADER, sizeof bytes);
    return bytes;
}

void tl_free(void* p) {
    if (!p) return;
    atomic_fetch_sub(&bytes_in_use, tl_alloc_size(p));
    atomic_fetch_sub(&live_allocs, 1);
    free((char*)p - HEADER);
}

TL_API tl_status tl_memory_stats_get(tl_memory_stats* out) {
    if (!out || out->size < offsetof(tl_memory_stats, total_allocs))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_memory_stats_get: out is NULL or out->size too small");
    out->bytes_in_use = atomic_load(&bytes_in_use);
    out->peak_bytes = atomic_load(&peak_bytes);
    out->n_allocs = atomic_load(&live_allocs);
    if (out->size >= sizeof *out) out->total_allocs = atomic_load(&total_allocs);
    return TL_OK;
}

TL_API void tl_memory_reset_peak(void) { atomic_store(&peak_bytes, atomic_load(&bytes_in_use)); }

void tl_alloc_fail_after(int64_t n) { atomic_store(&fail_countdown, n < 0 ? -1 : n); }
