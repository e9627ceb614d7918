/* emu_block.cpp — how the CUDA emulation runs a launch (tests only): the grid's blocks one after
 * another, each block's threads as fibers on the calling OS thread, switched only at barriers
 * and warp operations, so every step between two of them is one thread's alone.
 *
 * The order of the blocks, and of the runnable threads after each barrier, follows
 * TINYLOOP_CUDA_EMU_ORDER: forward, reverse, or random (seeded by TINYLOOP_CUDA_EMU_SEED, the
 * launch and the block, so a run repeats). A kernel whose result depends on that order (a
 * missing barrier, a race on shared memory) gives different bits under another order and fails
 * the bit-exact tests. Rules a GPU leaves undefined stop the run (kernel_fault) with a message
 * naming the kernel and block:
 *   - __syncthreads must be reached by every thread of the block (none exited, none waiting at a
 *     warp operation: that is a deadlock);
 *   - a full-mask warp operation (shuffle, __syncwarp) by every lane of the warp, all 32 of them;
 *   - a block has 1 .. 1024 threads.
 * Warp operations are exchanges: each lane leaves its value in its warp's slot of the exchange's
 * generation (two alternating sets of slots: a lane cannot start the generation after next
 * before every lane has read this one), waits until the whole warp has arrived, then reads the
 * lane it asked for. Without AddressSanitizer, shared memory is poisoned before each block. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <vector>

#include "emu_internal.h"

__attribute__((tls_model("initial-exec"))) thread_local uint3 threadIdx;
__attribute__((tls_model("initial-exec"))) thread_local uint3 blockIdx;
__attribute__((tls_model("initial-exec"))) thread_local dim3 blockDim;
__attribute__((tls_model("initial-exec"))) thread_local dim3 gridDim;

#if !defined(__SANITIZE_ADDRESS__)
extern "C" char __start_tl_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_tl_emu_shared[] __attribute__((weak, visibility("hidden")));
#endif

namespace tl_emu {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr size_t STACK_BYTES = 512 << 10; /* AddressSanitizer's frames are larger */
#else
constexpr size_t STACK_BYTES = 128 << 10;
#endif
constexpr size_t GUARD_BYTES = 4096;      /* below each stack: an overflow faults */

enum class state : uint8_t { runnable, at_barrier, at_warp, done };

struct thread_slot {
    fiber f;
    uint3 tid;
    state st;
    int predicate;        /* __syncthreads_or's argument while at_barrier */
    unsigned exchanges;   /* warp exchanges this lane has made            */
    const char* waiting;  /* the warp operation it waits in               */
};

struct warp_slots {
    uint64_t value[2][32];
};

/* The block that runs on this OS thread. */
struct block_run {
    const launch_shape* shape;
    const std::function<void()>* body;
    std::vector<thread_slot> threads;
    std::vector<warp_slots> warps;
    fiber scheduler;
    std::vector<size_t> round;  /* the threads this round runs, in order */
    size_t next;          /* round[next] runs after the current thread */
    size_t current;
    bool in_thread;       /* a thread runs (else the scheduler does) */
    int barrier_or;
    uint64_t rng;
};

__attribute__((tls_model("initial-exec"))) thread_local block_run* running;
thread_local std::vector<void*> stacks; /* this OS thread's fiber stacks, reused */
uint64_t launches;                      /* guarded by the runtime's lock          */

void* stack_at(size_t i) {
    while (stacks.size() <= i) {
        void* p = mmap(NULL, STACK_BYTES + GUARD_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED || mprotect(p, GUARD_BYTES, PROT_NONE) != 0) {
            fprintf(stderr, "tinyloop CUDA emulation: no memory for a thread's stack\n");
            abort();
        }
        stacks.push_back((char*)p + GUARD_BYTES);
    }
    return stacks[i];
}

uint64_t next_random(uint64_t* s) { /* xorshift64* */
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* A nonzero xorshift state from a seed and a stream number (splitmix64's finalizer). */
uint64_t mix(uint64_t seed, uint64_t stream) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (stream + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (z ^ (z >> 31)) | 1;
}

/* Put items in the configured order (random: from *rng). */
void arrange(std::vector<size_t>& items, uint64_t* rng) {
    switch (config().schedule) {
    case order::forward: break;
    case order::reverse: std::reverse(items.begin(), items.end()); break;
    case order::random:
        for (size_t i = items.size(); i > 1; i--)
            std::swap(items[i - 1], items[(size_t)(((unsigned __int128)next_random(rng) * i) >> 64)]);
        break;
    }
}

/* The current thread stops (in state st): the next one of the round runs, straight from this
 * fiber, or the scheduler once the round is over. */
void yield(block_run* b, state st, bool exiting) {
    thread_slot& t = b->threads[b->current];
    t.st = st;
    if (b->next == b->round.size()) {
        b->in_thread = false;
        fiber_switch(&t.f, &b->scheduler, exiting);
        return;
    }
    const size_t i = b->round[b->next++];
    b->current = i;
    threadIdx = b->threads[i].tid;
    fiber_switch(&t.f, &b->threads[i].f, exiting);
}

void thread_main(void*) {
    fiber_started();
    block_run* b = running;
    (*b->body)();
    yield(b, state::done, true);
}

/* Release what can go on once no thread is runnable: each warp whose lanes all wait in a warp
 * operation, and the block barrier when every thread waits at it. False if nothing can. */
bool release(block_run* b) {
    const size_t n = b->threads.size();
    bool released = false;
    size_t done = 0, at_barrier = 0;
    for (size_t w = 0; w * 32 < n; w++) {
        const size_t lo = w * 32, hi = std::min(n, lo + 32);
        size_t waiting = 0, exited = 0;
        for (size_t i = lo; i < hi; i++) {
            waiting += b->threads[i].st == state::at_warp;
            exited += b->threads[i].st == state::done;
        }
        if (waiting > 0 && exited > 0)
            kernel_fault("%s: a lane of warp %zu exited, another waits in %s (a full-mask warp operation needs "
                         "every lane)", b->shape->name, w, b->threads[lo + (b->threads[lo].st == state::done)].waiting);
        if (waiting == hi - lo) {
            for (size_t i = lo; i < hi; i++) b->threads[i].st = state::runnable;
            released = true;
        }
    }
    int any = 0;
    for (const thread_slot& t : b->threads) {
        done += t.st == state::done;
        at_barrier += t.st == state::at_barrier;
        if (t.st == state::at_barrier) any |= t.predicate;
    }
    if (at_barrier > 0 && done > 0)
        kernel_fault("%s: __syncthreads reached by %zu threads while %zu exited (a barrier needs every thread)",
                     b->shape->name, at_barrier, done);
    if (at_barrier > 0 && at_barrier == n) {
        b->barrier_or = any;
        for (thread_slot& t : b->threads) t.st = state::runnable;
        released = true;
    }
    if (!released && done < n)
        kernel_fault("%s: deadlock: %zu threads wait at __syncthreads while others wait in warp operations",
                     b->shape->name, at_barrier);
    return released;
}

void run_block(block_run* b) {
#if !defined(__SANITIZE_ADDRESS__)
    char *lo = __start_tl_emu_shared, *hi = __stop_tl_emu_shared;
    if (lo != hi) memset(lo, config().poison, (size_t)(hi - lo));
#endif
    const dim3 bd = b->shape->block;
    const size_t n = (size_t)bd.x * bd.y * bd.z;
    for (size_t i = 0; i < n; i++) {
        thread_slot& t = b->threads[i];
        /* stack tops staggered by 64 bytes (mod 4 KiB): the threads' hot frames do not all fall in
         * the same cache sets */
        fiber_init(&t.f, stack_at(i), STACK_BYTES - i % 64 * 64, thread_main, NULL);
        t.tid = uint3{(unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y), (unsigned)(i / ((size_t)bd.x * bd.y))};
        t.st = state::runnable;
        t.exchanges = 0;
        t.waiting = "";
    }
    for (;;) {
        b->round.clear();
        for (size_t i = 0; i < n; i++)
            if (b->threads[i].st == state::runnable) b->round.push_back(i);
        if (b->round.empty()) {
            if (!release(b)) return; /* every thread is done */
            continue;
        }
        arrange(b->round, &b->rng);
        b->current = b->round[0];
        b->next = 1;
        threadIdx = b->threads[b->current].tid;
        b->in_thread = true;
        fiber_switch(&b->scheduler, &b->threads[b->current].f, false);
    }
}

}  // namespace

int lane_id() {
    const uint3 t = threadIdx;
    return (int)((t.x + blockDim.x * (t.y + blockDim.y * t.z)) & 31);
}

uint64_t warp_exchange(unsigned mask, uint64_t value, int src, bool xor_mode, const char* what) {
    block_run* b = running;
    if (!b) kernel_fault("%s called outside a kernel", what);
    const size_t i = b->current, lanes = std::min<size_t>(32, b->threads.size() - i / 32 * 32);
    if (mask != 0xffffffffu || lanes != 32)
        kernel_fault("%s: mask %#x in a warp of %zu lanes (only full masks over full warps are emulated)",
                     b->shape->name, mask, lanes);
    thread_slot& t = b->threads[i];
    warp_slots& w = b->warps[i / 32];
    const unsigned gen = t.exchanges++ & 1;
    const int lane = (int)(i % 32);
    w.value[gen][lane] = value;
    t.waiting = what;
    yield(b, state::at_warp, false);
    return w.value[gen][xor_mode ? (lane ^ src) : (src & 31)];
}

int block_barrier(int predicate) {
    block_run* b = running;
    if (!b) kernel_fault("__syncthreads called outside a kernel");
    thread_slot& t = b->threads[b->current];
    t.predicate = predicate;
    t.waiting = "__syncthreads";
    yield(b, state::at_barrier, false);
    return b->barrier_or;
}

void kernel_fault(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tinyloop CUDA emulation: ");
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (running) fprintf(stderr, " [block (%u, %u, %u)", blockIdx.x, blockIdx.y, blockIdx.z);
    if (running && running->in_thread) fprintf(stderr, ", thread (%u, %u, %u)", threadIdx.x, threadIdx.y, threadIdx.z);
    if (running) fprintf(stderr, "]");
    fprintf(stderr, "\n");
    fflush(stderr);
    abort();
}

void run_grid(const launch_shape& shape, const std::function<void()>& body) {
    const dim3 g = shape.grid, bd = shape.block;
    const size_t n = (size_t)bd.x * bd.y * bd.z, blocks = (size_t)g.x * g.y * g.z;
    block_run b;
    b.shape = &shape;
    b.body = &body;
    b.threads.resize(n);
    b.warps.resize((n + 31) / 32);
    b.scheduler = fiber{NULL, NULL, 0, NULL};
    b.current = 0;
    b.in_thread = false;
    b.barrier_or = 0;
    const uint64_t launch = ++launches;
    uint64_t rng = mix(config().seed, launch);
    std::vector<size_t> order(blocks);
    for (size_t i = 0; i < blocks; i++) order[i] = i;
    arrange(order, &rng);
    running = &b;
    blockDim = bd;
    gridDim = g;
    for (size_t k : order) {
        blockIdx = uint3{(unsigned)(k % g.x), (unsigned)(k / g.x % g.y), (unsigned)(k / ((size_t)g.x * g.y))};
        b.rng = mix(rng, k);
        run_block(&b);
    }
    running = NULL;
}

}  // namespace tl_emu
