/* test_cuda_emu.cpp — the CUDA emulation's own tests: that what it runs behaves as a GPU would
 * where libtinyloop's kernels depend on it, and that the mistakes it exists to catch are caught.
 *
 *   - barriers: a block reading its neighbours' shared-memory writes gets them with __syncthreads
 *     and, under every schedule (forward, reverse, random), does not without it;
 *   - warp shuffles and __syncthreads_or give the lockstep results; __dp4a its wrapped sum;
 *   - wmma s8 x s8 -> s32 equals a plain product, and a store writes only each lane's share;
 *   - stream work runs when the host waits, not before; fresh memory holds the poison byte;
 *   - capture, instantiate, update and replay of a graph; calls a capture forbids invalidate it;
 *   - copies whose ends do not match their direction are refused; TINYLOOP_CUDA_EMU_FAIL fails
 *     the call it names;
 *   - in child processes, the faults that stop a run: a divergent barrier, a shuffle with an
 *     exited lane, a deadlock, a misaligned wmma pointer. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <mma.h>

static int failures;

#define EXPECT(cond, ...)                                                               \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            failures++;                                                                 \
            fprintf(stderr, "%s:%d: EXPECT(%s) failed: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                               \
            fputc('\n', stderr);                                                        \
        }                                                                               \
    } while (0)

enum { N = 128 };

/* out[i] = the value thread i ^ 1 wrote to shared memory (its index + base: no launch leaves the
 * next one's values), with or without a barrier between. */
static __global__ void neighbour_kernel(int* out, int base, int barrier) {
    __shared__ int sh[N];
    sh[threadIdx.x] = (int)threadIdx.x + base;
    if (barrier) __syncthreads();
    out[threadIdx.x] = sh[threadIdx.x ^ 1];
}

/* Runs neighbour_kernel; true if every thread saw its neighbour's value. */
static bool neighbours_seen(int base, bool barrier) {
    int* d = nullptr;
    int h[N];
    cudaMalloc((void**)&d, sizeof h);
    TL_CU_LAUNCH(neighbour_kernel, 1, N, 0, nullptr)(d, base, barrier ? 1 : 0);
    cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    cudaFree(d);
    for (int i = 0; i < N; i++)
        if (h[i] != (i ^ 1) + base) return false;
    return true;
}

static void test_barriers() {
    EXPECT(neighbours_seen(1000, true), "with __syncthreads every thread sees its neighbour's write");
    EXPECT(!neighbours_seen(2000, false), "without __syncthreads some thread reads before its neighbour wrote");
}

/* out[block * 64 + t] = warp sum of t by shuffles; ors[block] = __syncthreads_or(t == block). */
static __global__ void warp_kernel(int* out, int* ors) {
    int v = (int)threadIdx.x;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    out[blockIdx.x * 64 + threadIdx.x] = v;
    const int any = __syncthreads_or((int)threadIdx.x == (int)blockIdx.x);
    if (threadIdx.x == 0) ors[blockIdx.x] = any;
}

static void test_warps() {
    int *d, *o;
    cudaMalloc((void**)&d, 2 * 64 * sizeof(int));
    cudaMalloc((void**)&o, 2 * sizeof(int));
    TL_CU_LAUNCH(warp_kernel, 2, 64, 0, nullptr)(d, o);
    int h[128], ors[2];
    cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    cudaMemcpy(ors, o, sizeof ors, cudaMemcpyDeviceToHost);
    for (int i = 0; i < 128; i++) {
        const int w = i % 64 / 32;
        EXPECT(h[i] == 32 * 31 / 2 + 32 * 32 * w, "thread %d: warp sum %d", i, h[i]);
    }
    EXPECT(ors[0] == 1 && ors[1] == 1, "__syncthreads_or: %d %d", ors[0], ors[1]);
    cudaFree(d);
    cudaFree(o);
    EXPECT(__dp4a((int)0x80ff7f01, (int)0x7f7f7f7f, 5) == 5 + 127 * (1 + 127 - 1 - 128), "dp4a");
    EXPECT(__dp4a((int)0x80808080, (int)0x80808080, 0x7fffffff) == (int)(0x7fffffffu + 4u * 16384u), "dp4a wraps");
}

using namespace nvcuda;

/* c = a (16 x 16, row-major) times b (16 x 16 given as its columns) in one warp; then each lane
 * copies the stored tile to out, with __syncwarp between when `sync`. */
static __global__ void wmma_kernel(const int8_t* a, const int8_t* bt, int* c, int* out, int sync) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc;
    wmma::fill_fragment(acc, 3);
    wmma::load_matrix_sync(fa, (const signed char*)a, 16);
    wmma::load_matrix_sync(fb, (const signed char*)bt, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
    if (sync) __syncwarp();
    for (int e = 0; e < 256; e++) out[threadIdx.x * 256 + e] = c[e];
}

static void test_wmma() {
    int8_t a[256], bt[256];
    uint64_t s = 12345;
    for (int i = 0; i < 256; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        a[i] = (int8_t)(s >> 33);
        bt[i] = (int8_t)(s >> 41);
    }
    for (int sync = 1; sync >= 0; sync--) {
        int8_t *da, *db;
        int *dc, *dout;
        cudaMalloc((void**)&da, 256);
        cudaMalloc((void**)&db, 256);
        cudaMalloc((void**)&dc, 256 * sizeof(int));
        cudaMalloc((void**)&dout, 32 * 256 * sizeof(int));
        cudaMemcpy(da, a, 256, cudaMemcpyHostToDevice);
        cudaMemcpy(db, bt, 256, cudaMemcpyHostToDevice);
        TL_CU_LAUNCH(wmma_kernel, 1, 32, 0, nullptr)(da, db, dc, dout, sync);
        static int out[32 * 256];
        cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost);
        bool all_lanes_right = true;
        for (int lane = 0; lane < 32; lane++)
            for (int m = 0; m < 16; m++)
                for (int n = 0; n < 16; n++) {
                    int want = 3;
                    for (int k = 0; k < 16; k++) want += a[m * 16 + k] * bt[n * 16 + k];
                    all_lanes_right &= out[lane * 256 + m * 16 + n] == want;
                }
        if (sync) EXPECT(all_lanes_right, "wmma with __syncwarp: every lane reads a * b + 3");
        else EXPECT(!all_lanes_right, "wmma without __syncwarp: a lane reads elements not yet stored");
        cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dout);
    }
}

static __global__ void fill_kernel(int* p, int value) { p[threadIdx.x] = value; }

static void test_streams_and_poison() {
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    int *d, *pinned;
    cudaMalloc((void**)&d, 32 * sizeof(int));
    cudaMallocHost((void**)&pinned, 32 * sizeof(int));
    unsigned char fresh;
    memcpy(&fresh, pinned, 1);
    EXPECT(fresh == 0x7f || getenv("TINYLOOP_CUDA_EMU_POISON"), "fresh pinned memory: %#x", fresh);
    TL_CU_LAUNCH(fill_kernel, 1, 32, 0, st)(d, 42);
    cudaMemcpyAsync(pinned, d, 32 * sizeof(int), cudaMemcpyDeviceToHost, st);
    EXPECT(pinned[5] != 42, "the copy ran before the host waited");
    EXPECT(cudaStreamSynchronize(st) == cudaSuccess, "sync");
    EXPECT(pinned[5] == 42, "after the wait: %d", pinned[5]);
    EXPECT(cudaMemcpy(pinned, d, 4, cudaMemcpyHostToDevice) == cudaErrorInvalidValue, "a copy with swapped ends");
    EXPECT(cudaGetLastError() == cudaErrorInvalidValue && cudaGetLastError() == cudaSuccess, "last error, once");
    EXPECT(cudaMemcpyAsync(d + 31, pinned, 8, cudaMemcpyHostToDevice, st) == cudaErrorInvalidValue,
           "a copy past the end of its allocation");
    cudaGetLastError();
    cudaFreeHost(pinned);
    cudaFree(d);
    cudaStreamDestroy(st);
}

static void test_graphs() {
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    int *d, *h;
    cudaMalloc((void**)&d, 32 * sizeof(int));
    cudaMallocHost((void**)&h, 32 * sizeof(int));
    cudaGraph_t g;
    EXPECT(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "begin capture");
    TL_CU_LAUNCH(fill_kernel, 1, 32, 0, st)(d, 7);
    cudaMemcpyAsync(h, d, 32 * sizeof(int), cudaMemcpyDeviceToHost, st);
    EXPECT(cudaStreamEndCapture(st, &g) == cudaSuccess && g, "end capture");
    cudaStreamSynchronize(st);
    EXPECT(h[0] != 7, "a capture runs nothing");
    cudaGraphExec_t exec;
    EXPECT(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess, "instantiate");
    cudaGraphLaunch(exec, st);
    cudaStreamSynchronize(st);
    EXPECT(h[0] == 7 && h[31] == 7, "replay: %d", h[0]);
    h[0] = 0;
    cudaGraphLaunch(exec, st);
    cudaStreamSynchronize(st);
    EXPECT(h[0] == 7, "second replay: %d", h[0]);

    cudaGraph_t g2, g3;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    TL_CU_LAUNCH(fill_kernel, 1, 32, 0, st)(d, 9);
    cudaMemcpyAsync(h, d, 32 * sizeof(int), cudaMemcpyDeviceToHost, st);
    cudaStreamEndCapture(st, &g2);
    cudaGraphExecUpdateResultInfo info;
    EXPECT(cudaGraphExecUpdate(exec, g2, &info) == cudaSuccess, "update with new arguments");
    cudaGraphLaunch(exec, st);
    cudaStreamSynchronize(st);
    EXPECT(h[0] == 9, "updated replay: %d", h[0]);
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    TL_CU_LAUNCH(fill_kernel, 1, 32, 0, st)(d, 1);
    cudaStreamEndCapture(st, &g3);
    EXPECT(cudaGraphExecUpdate(exec, g3, &info) == cudaErrorGraphExecUpdateFailure &&
               info.result == cudaGraphExecUpdateErrorTopologyChanged, "another topology is refused");
    cudaGetLastError();

    cudaGraph_t bad;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    EXPECT(cudaStreamSynchronize(st) == cudaErrorStreamCaptureUnsupported, "a sync while capturing");
    void* p;
    EXPECT(cudaMalloc(&p, 16) == cudaErrorStreamCaptureUnsupported, "cudaMalloc while capturing");
    EXPECT(cudaStreamEndCapture(st, &bad) == cudaErrorStreamCaptureInvalidated && !bad, "the capture is invalid");
    cudaGetLastError();
    cudaGraphDestroy(g), cudaGraphDestroy(g2), cudaGraphDestroy(g3);
    cudaGraphExecDestroy(exec);
    cudaFree(d);
    cudaFreeHost(h);
    cudaStreamDestroy(st);
}

static void test_injected_failures() {
    setenv("TINYLOOP_CUDA_EMU_FAIL", "cudaMalloc:2,cudaGraphInstantiate:1", 1);
    void *a, *b, *c;
    EXPECT(cudaMalloc(&a, 8) == cudaSuccess, "first cudaMalloc");
    EXPECT(cudaMalloc(&b, 8) == cudaErrorMemoryAllocation && !b, "second cudaMalloc fails on purpose");
    EXPECT(cudaMalloc(&c, 8) == cudaSuccess, "third cudaMalloc");
    unsetenv("TINYLOOP_CUDA_EMU_FAIL");
    cudaGetLastError();
    cudaFree(a);
    cudaFree(c);
}

/* ---- faults, each in a child process: it must stop with the message ------------------------ */

static __global__ void divergent_barrier_kernel(int*) {
    if (threadIdx.x < 32) return;
    __syncthreads();
}

static __global__ void exited_lane_kernel(int* p) {
    if (threadIdx.x == 3) return;
    p[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static __global__ void deadlock_kernel(int* p) {
    if (threadIdx.x < 16) p[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
    else __syncthreads();
}

static __global__ void misaligned_wmma_kernel(int* p) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc;
    wmma::fill_fragment(acc, 0);
    wmma::store_matrix_sync(p + 1, acc, 16, wmma::mem_row_major);
}

static void expect_fault(void (*kernel)(int*), unsigned threads, const char* message) {
    int pipe_fd[2];
    if (pipe(pipe_fd) != 0) return;
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(pipe_fd[1], 2);
        int* d;
        cudaMalloc((void**)&d, 4096);
        TL_CU_LAUNCH(kernel, 1, threads, 0, nullptr)(d);
        cudaDeviceSynchronize();
        _exit(0);
    }
    close(pipe_fd[1]);
    char text[4096] = "";
    size_t n = 0;
    ssize_t r;
    while (n + 1 < sizeof text && (r = read(pipe_fd[0], text + n, sizeof text - 1 - n)) > 0) n += (size_t)r;
    text[n] = 0;
    close(pipe_fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT && strstr(text, message),
           "want an abort saying \"%s\"; got status %#x and: %s", message, status, text);
}

static void test_faults() {
    expect_fault(divergent_barrier_kernel, 64, "__syncthreads reached by 32 threads while 32 exited");
    expect_fault(exited_lane_kernel, 32, "a lane of warp 0 exited");
    expect_fault(deadlock_kernel, 64, "deadlock");
    expect_fault(misaligned_wmma_kernel, 32, "must be 32-byte aligned");
}

int main() {
    test_barriers();
    test_warps();
    test_wmma();
    test_streams_and_poison();
    test_graphs();
    test_injected_failures();
    test_faults();
    printf("test_cuda_emu: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
