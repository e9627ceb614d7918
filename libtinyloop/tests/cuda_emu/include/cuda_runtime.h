/* cuda_runtime.h (CPU emulation, tests only) — the subset of the CUDA language and runtime that
 * libtinyloop's src/cuda/ kernels use, for compiling those files unchanged as host C++ (g++ or
 * clang++, -ffp-contract=off) and running them on the CPU: the build option
 * TINYLOOP_CUDA_EMULATION puts this folder before any CUDA toolkit on the include path.
 *
 * What it gives the device code:
 *   - __global__ / __device__ / __host__ / __forceinline__ / __launch_bounds__ / __align__ as plain
 *     C++; __shared__ as a static variable of the block (one block runs at a time);
 *   - threadIdx, blockIdx, blockDim, gridDim: set for the thread that runs (emu_block.cpp runs a
 *     block's threads as fibers on one OS thread);
 *   - __syncthreads(_or), __syncwarp and the warp shuffles as barriers with exact lockstep
 *     semantics, __dp4a, the bit casts; nvcuda::wmma in mma.h;
 *   - kernel launches written TL_CU_LAUNCH(kernel, grid, block, shmem, stream)(args...) (the form
 *     src/cuda/common.cuh uses, which nvcc compiles as kernel<<<...>>>(args...));
 *   - the runtime calls (memory, streams, events, memory pools, stream capture into graphs and their
 *     replay, device properties, errors) of emu_runtime.cpp.
 * Semantics the emulation enforces, so that a kernel bug fails a test instead of passing by luck:
 * the order in which a block's threads run between barriers, and the order of a grid's blocks,
 * come from TINYLOOP_CUDA_EMU_ORDER (forward, reverse, random with TINYLOOP_CUDA_EMU_SEED);
 * fresh device, pinned and shared memory holds a poison pattern; stream work runs only when the
 * host synchronizes; a barrier or full-mask warp operation some threads never reach, a deadlock,
 * a misaligned wmma pointer and a wrong launch shape stop the process with a message naming the
 * kernel (emu_block.cpp). The knobs are listed in docs/gpu.md. */
#ifndef TL_CUDA_EMU_RUNTIME_H
#define TL_CUDA_EMU_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

/* ---- the language ------------------------------------------------------------------------- */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* A block's shared variables are statics: one block runs at a time, so each is the block's own.
 * Without AddressSanitizer they live in one section that each block starts by poisoning; with
 * it they stay ordinary globals, whose red zones catch an access out of their bounds. */
#if defined(__SANITIZE_ADDRESS__)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("tl_emu_shared")))
#endif

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct __attribute__((aligned(8))) int2 {
    int x, y;
};

struct __attribute__((aligned(16))) int4 {
    int x, y, z, w;
};

/* The running thread's coordinates (emu_block.cpp sets them before resuming a thread). */
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

namespace tl_emu {
/* The warp exchange behind every warp operation: the calling lane's `value` goes to its warp,
 * the lane waits until every lane of the warp has arrived (full masks only: a lane that exited or
 * a partial mask stops the run), then gets the value of lane `src` (of the same exchange). */
uint64_t warp_exchange(unsigned mask, uint64_t value, int src_lane_xor, bool xor_mode, const char* what);
/* A block barrier; returns the OR of every thread's `predicate`. */
int block_barrier(int predicate);
/* Stop the run: a kernel broke a rule of the CUDA model (the message names it). */
[[noreturn]] void kernel_fault(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* This thread's lane (threadIdx linearised, mod 32). */
int lane_id();
}  // namespace tl_emu

static inline void __syncthreads() { (void)tl_emu::block_barrier(0); }
static inline int __syncthreads_or(int predicate) { return tl_emu::block_barrier(predicate != 0); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)tl_emu::warp_exchange(mask, 0, 0, true, "__syncwarp"); }

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "__shfl_xor_sync of this type");
    if (width != 32) tl_emu::kernel_fault("__shfl_xor_sync: width %d (only 32 is emulated)", width);
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = tl_emu::warp_exchange(mask, bits, lane_mask & 31, true, "__shfl_xor_sync");
    T r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

/* Σ of the four signed byte products of a and b, plus c (mod 2^32, as the instruction). */
static inline int __dp4a(int a, int b, int c) {
    uint32_t s = (uint32_t)c;
    for (int i = 0; i < 4; i++) s += (uint32_t)((int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i)));
    return (int)s;
}

static inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}

static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

/* ---- the runtime -------------------------------------------------------------------------- */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureWrongThread = 908,
    cudaErrorGraphExecUpdateFailure = 910,
    cudaErrorUnknown = 999
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3
} cudaMemcpyKind;

typedef struct tl_emu_stream* cudaStream_t;
typedef struct tl_emu_event* cudaEvent_t;
typedef struct tl_emu_graph* cudaGraph_t;
typedef struct tl_emu_graph* cudaGraphExec_t;
typedef struct tl_emu_pool* cudaMemPool_t;

enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2 };

typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;

typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;

typedef enum cudaGraphExecUpdateResult {
    cudaGraphExecUpdateSuccess = 0,
    cudaGraphExecUpdateErrorTopologyChanged = 2,
    cudaGraphExecUpdateErrorFunctionChanged = 4
} cudaGraphExecUpdateResult;

typedef struct cudaGraphExecUpdateResultInfo {
    cudaGraphExecUpdateResult result;
} cudaGraphExecUpdateResultInfo;

typedef struct cudaDeviceProp {
    char name[256];
    int major, minor;
    int multiProcessorCount;
    size_t totalGlobalMem;
    int warpSize;
    int maxThreadsPerBlock;
} cudaDeviceProp;

typedef struct cudaFuncAttributes {
    int maxThreadsPerBlock;
} cudaFuncAttributes;

enum cudaDeviceAttr { cudaDevAttrMemoryPoolsSupported = 115 };
enum cudaMemAllocationType { cudaMemAllocationTypePinned = 1 };
enum cudaMemLocationType { cudaMemLocationTypeDevice = 1 };
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };

typedef struct cudaMemLocation {
    enum cudaMemLocationType type;
    int id;
} cudaMemLocation;

typedef struct cudaMemPoolProps {
    enum cudaMemAllocationType allocType;
    int handleTypes;
    cudaMemLocation location;
} cudaMemPoolProps;

cudaError_t cudaGetLastError(void);
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void* value);
cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

template <typename F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, F* kernel) {
    attr->maxThreadsPerBlock = kernel ? 1024 : 0;
    return kernel ? cudaSuccess : cudaErrorInvalidValue;
}

/* ---- kernel launches ---------------------------------------------------------------------- */

namespace tl_emu {
struct launch_shape {
    const char* name;     /* the kernel as written at the launch */
    const void* kernel;   /* its identity (graph updates compare it) */
    dim3 grid, block;
    size_t shmem;
};
/* Queue the launch on `stream` (or record it into the stream's capture); `body` runs the kernel
 * as one thread. Sets the last error for a launch shape the device would refuse. */
void enqueue_kernel(const launch_shape& shape, cudaStream_t stream, std::function<void()> body);

template <typename... P>
struct launcher {
    launch_shape shape;
    cudaStream_t stream;
    void (*kernel)(P...);
    /* The arguments convert to the kernel's parameter types now, as a launch copies them. */
    template <typename... A>
    void operator()(A&&... args) const {
        auto k = kernel;
        std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
        enqueue_kernel(shape, stream, [k, params]() { std::apply(k, params); });
    }
};

template <typename... P>
launcher<P...> launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem,
                      cudaStream_t stream) {
    return launcher<P...>{{name, (const void*)kernel, grid, block, shmem}, stream, kernel};
}
}  // namespace tl_emu

#define TL_CU_LAUNCH(kernel, grid, block, shmem, stream) ::tl_emu::launch(#kernel, kernel, grid, block, shmem, stream)

#endif
