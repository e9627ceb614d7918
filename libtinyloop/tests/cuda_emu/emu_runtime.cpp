/* emu_runtime.cpp — the CUDA runtime calls of the emulation (tests only): device memory as host
 * memory, streams whose work waits until the host synchronizes, events, stream-ordered memory
 * pools, stream capture into graphs with their instantiation, update and replay, device
 * properties, the last error, and failures injected on purpose.
 *
 * Rules kept as a GPU keeps them, so that a host-side slip fails a test:
 *   - Work queued on a stream (kernels, copies, sets, stream-ordered frees, event records) runs
 *     only when the host waits for it: cudaStreamSynchronize, cudaEventSynchronize (up to the
 *     event), cudaDeviceSynchronize, cudaFree / cudaFreeHost (they synchronize the device), a
 *     copy into pageable memory (synchronous). Reading an output before waiting sees old bytes.
 *   - Fresh device and pinned memory holds the poison byte (TINYLOOP_CUDA_EMU_POISON). Every
 *     allocation is its own heap block, so AddressSanitizer checks each kernel access.
 *   - A copy names its direction: device ends must lie inside one device allocation, host ends
 *     outside every one (cudaErrorInvalidValue otherwise). An async copy from pageable memory
 *     reads it at the call, as the driver stages it.
 *   - While a thread captures a stream, its synchronizing calls (cudaMalloc, cudaFree,
 *     cudaMemcpy, cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize) fail with
 *     cudaErrorStreamCaptureUnsupported and invalidate the capture; so does work another thread
 *     queues on the capturing stream, or an async copy from pageable memory into it.
 *   - cudaGraphExecUpdate succeeds only for the same sequence of node kinds and kernels.
 * Failures on purpose: TINYLOOP_CUDA_EMU_FAIL="call:n[,call:n...]" makes the n-th use (from 1)
 * of each named call fail (allocations with cudaErrorMemoryAllocation, others with
 * cudaErrorUnknown); the count restarts when the variable changes. One lock serializes the
 * device: calls from several host threads are safe. TINYLOOP_CUDA_EMU_REPORT names a file that
 * gets each kernel's launch count at exit. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emu_internal.h"

/* ---- the objects behind the handles ------------------------------------------------------- */

namespace {

/* One unit of stream work. */
struct work {
    enum kind { kernel, copy, set, release, record } what;
    tl_emu::launch_shape shape;              /* kernel                                   */
    std::function<void()> body;              /* kernel                                   */
    void* dst;                               /* copy, set, release                       */
    const void* src;                         /* copy                                     */
    std::shared_ptr<std::vector<char>> staged; /* copy from pageable memory: its bytes    */
    size_t bytes;                            /* copy, set                                */
    int value;                               /* set                                      */
    tl_emu_event* event;                     /* record                                   */
};

}  // namespace

struct tl_emu_stream {
    std::deque<work> queue;
    bool capturing = false;
    bool capture_invalid = false;
    std::thread::id capture_thread;
    std::vector<work> captured;
};

struct tl_emu_event {
    tl_emu_stream* stream = nullptr; /* where it was recorded last */
    uint64_t pending = 0;            /* records of it still queued */
};

struct tl_emu_graph {
    std::vector<work> nodes;
};

struct tl_emu_pool {
    int device;
};

namespace tl_emu {

/* ---- settings ------------------------------------------------------------------------------- */

static long env_long(const char* name, long fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end;
    const long x = strtol(v, &end, 0);
    if (*end) {
        fprintf(stderr, "tinyloop CUDA emulation: %s=%s is not a number\n", name, v);
        abort();
    }
    return x;
}

static settings read_settings() {
    settings s;
    const char* o = getenv("TINYLOOP_CUDA_EMU_ORDER");
    s.schedule = order::random;
    if (o && strcmp(o, "forward") == 0) s.schedule = order::forward;
    else if (o && strcmp(o, "reverse") == 0) s.schedule = order::reverse;
    else if (o && *o && strcmp(o, "random") != 0) {
        fprintf(stderr, "tinyloop CUDA emulation: TINYLOOP_CUDA_EMU_ORDER=%s (forward, reverse or random)\n", o);
        abort();
    }
    s.seed = (uint64_t)env_long("TINYLOOP_CUDA_EMU_SEED", 1);
    s.devices = (int)env_long("TINYLOOP_CUDA_EMU_DEVICES", 1);
    s.sms = (int)env_long("TINYLOOP_CUDA_EMU_SMS", 132);
    s.pools = env_long("TINYLOOP_CUDA_EMU_POOLS", 1) != 0;
    s.poison = (unsigned char)env_long("TINYLOOP_CUDA_EMU_POISON", 0x7f);
    s.memory = (size_t)env_long("TINYLOOP_CUDA_EMU_MEMORY", 80L << 30);
    return s;
}

const settings& config() {
    static const settings s = read_settings();
    return s;
}

}  // namespace tl_emu

using tl_emu::config;

namespace {

/* ---- state ---------------------------------------------------------------------------------- */

enum class mem { device, pinned };

struct allocation {
    size_t bytes;
    mem kind;
};

struct device_state {
    std::recursive_mutex lock;
    std::map<uintptr_t, allocation> allocations;
    size_t device_bytes = 0;
    tl_emu_stream legacy;                      /* the NULL stream            */
    std::vector<tl_emu_stream*> streams;       /* created ones               */
    std::map<std::string, unsigned long> calls;  /* injectable calls so far    */
    std::string fail_spec;                     /* TINYLOOP_CUDA_EMU_FAIL seen */
    std::map<std::string, unsigned long> launches;
};

device_state& dev() {
    static device_state* d = new device_state; /* never destroyed: calls may come at exit */
    return *d;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;
thread_local tl_emu_stream* capturing = nullptr; /* the stream this thread captures */

cudaError_t fail(cudaError_t e) {
    last_error = e;
    return e;
}

/* Whether the injection spec makes this use of `call` fail. */
bool injected(const char* call) {
    device_state& d = dev();
    const char* spec = getenv("TINYLOOP_CUDA_EMU_FAIL");
    const std::string now = spec ? spec : "";
    if (now != d.fail_spec) {
        d.fail_spec = now;
        d.calls.clear();
    }
    if (now.empty()) return false;
    const unsigned long n = ++d.calls[call];
    const size_t len = strlen(call);
    for (const char* p = now.c_str(); *p;) {
        const char* comma = strchr(p, ',');
        const size_t item = comma ? (size_t)(comma - p) : strlen(p);
        if (item > len + 1 && strncmp(p, call, len) == 0 && p[len] == ':' && strtoul(p + len + 1, NULL, 10) == n)
            return true;
        p += item + (comma ? 1 : 0);
    }
    return false;
}

/* The allocation holding [p, p + bytes), or NULL. */
const allocation* find(const void* p, size_t bytes, uintptr_t* base) {
    device_state& d = dev();
    auto it = d.allocations.upper_bound((uintptr_t)p);
    if (it == d.allocations.begin()) return nullptr;
    --it;
    const uintptr_t off = (uintptr_t)p - it->first;
    if (off >= it->second.bytes || bytes > it->second.bytes - off) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

bool on_device(const void* p, size_t bytes) {
    const allocation* a = find(p, bytes, nullptr);
    return a && a->kind == mem::device;
}

bool is_device_address(const void* p) { return on_device(p, 1); }

bool is_pinned(const void* p, size_t bytes) {
    const allocation* a = find(p, bytes, nullptr);
    return a && a->kind == mem::pinned;
}

cudaError_t allocate(void** p, size_t bytes, mem kind) {
    device_state& d = dev();
    *p = nullptr;
    if (bytes == 0) return cudaSuccess;
    if (kind == mem::device && bytes > config().memory - d.device_bytes) return fail(cudaErrorMemoryAllocation);
    void* q = nullptr;
    if (posix_memalign(&q, 256, bytes) != 0) return fail(cudaErrorMemoryAllocation);
    memset(q, config().poison, bytes);
    d.allocations[(uintptr_t)q] = allocation{bytes, kind};
    if (kind == mem::device) d.device_bytes += bytes;
    *p = q;
    return cudaSuccess;
}

cudaError_t deallocate(void* p, mem kind) {
    device_state& d = dev();
    if (!p) return cudaSuccess;
    auto it = d.allocations.find((uintptr_t)p);
    if (it == d.allocations.end() || it->second.kind != kind) return fail(cudaErrorInvalidValue);
    if (kind == mem::device) d.device_bytes -= it->second.bytes;
    d.allocations.erase(it);
    free(p);
    return cudaSuccess;
}

void execute(work& w) {
    switch (w.what) {
    case work::kernel: tl_emu::run_grid(w.shape, w.body); break;
    case work::copy: memcpy(w.dst, w.staged ? w.staged->data() : w.src, w.bytes); break;
    case work::set: memset(w.dst, w.value, w.bytes); break;
    case work::release: deallocate(w.dst, mem::device); break;
    case work::record: w.event->pending--; break;
    }
}

/* Run s's queued work; with `until`, only up to that event's last queued record. */
void drain(tl_emu_stream* s, tl_emu_event* until = nullptr) {
    while (!s->queue.empty() && !(until && until->pending == 0)) {
        work w = std::move(s->queue.front());
        s->queue.pop_front();
        execute(w);
    }
}

void drain_all() {
    device_state& d = dev();
    drain(&d.legacy);
    for (tl_emu_stream* s : d.streams) drain(s);
}

tl_emu_stream* stream_of(cudaStream_t s) { return s ? s : &dev().legacy; }

/* For a call that synchronizes: refused (and the capture invalidated) while this thread captures. */
bool refused_in_capture() {
    if (!capturing) return false;
    capturing->capture_invalid = true;
    fail(cudaErrorStreamCaptureUnsupported);
    return true;
}

/* Queue w on s, or add it to s's capture. */
cudaError_t enqueue(cudaStream_t stream, work w) {
    tl_emu_stream* s = stream_of(stream);
    if (s->capturing) {
        if (std::this_thread::get_id() != s->capture_thread) {
            s->capture_invalid = true;
            return fail(cudaErrorStreamCaptureWrongThread);
        }
        if (w.staged || w.what == work::release) {
            s->capture_invalid = true;
            return fail(cudaErrorStreamCaptureUnsupported);
        }
        s->captured.push_back(std::move(w));
        return cudaSuccess;
    }
    s->queue.push_back(std::move(w));
    return cudaSuccess;
}

/* Whether a copy of `bytes` from src to dst in direction `kind` has the ends it names. */
bool copy_ends_ok(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDeviceToDevice) return false;
    if (bytes == 0) return true;
    return (dst_dev ? on_device(dst, bytes) : !is_device_address(dst)) &&
           (src_dev ? on_device(src, bytes) : !is_device_address(src));
}

void report_launches() {
    const char* path = getenv("TINYLOOP_CUDA_EMU_REPORT");
    if (!path || !*path) return;
    FILE* f = fopen(path, "a");
    if (!f) return;
    std::lock_guard<std::recursive_mutex> g(dev().lock);
    for (const auto& [name, n] : dev().launches) fprintf(f, "%s %lu\n", name.c_str(), n);
    fclose(f);
}

}  // namespace

namespace tl_emu {

void enqueue_kernel(const launch_shape& shape, cudaStream_t stream, std::function<void()> body) {
    std::lock_guard<std::recursive_mutex> g(dev().lock);
    const dim3 b = shape.block, gr = shape.grid;
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (threads == 0 || threads > 1024 || b.z > 64 || gr.x == 0 || gr.y == 0 || gr.z == 0 || gr.x > 0x7fffffffu ||
        gr.y > 65535 || gr.z > 65535 || shape.shmem > 48 * 1024) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    static bool reporting = (atexit(report_launches), true);
    (void)reporting;
    dev().launches[shape.name]++;
    work w{};
    w.what = work::kernel;
    w.shape = shape;
    w.body = std::move(body);
    enqueue(stream, std::move(w));
}

}  // namespace tl_emu

#define LOCKED std::lock_guard<std::recursive_mutex> guard_(dev().lock)

/* ---- errors and devices ----------------------------------------------------------------------- */

cudaError_t cudaGetLastError(void) {
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

const char* cudaGetErrorString(cudaError_t err) {
    switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from "
                                                   "another thread";
    case cudaErrorGraphExecUpdateFailure: return "the graph update was not performed because it included changes "
                                                 "which violated constraints specific to instantiated graph update";
    default: return "unknown error";
    }
}

cudaError_t cudaGetDeviceCount(int* n) {
    LOCKED;
    *n = 0;
    if (injected("cudaGetDeviceCount")) return fail(cudaErrorUnknown);
    if (config().devices < 1) return fail(cudaErrorNoDevice);
    *n = config().devices;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    *device = current_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice);
    current_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "CUDA emulation on the CPU");
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = config().sms;
    prop->totalGlobalMem = config().memory;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
    if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice);
    if (attr != cudaDevAttrMemoryPoolsSupported) return fail(cudaErrorInvalidValue);
    *value = config().pools ? 1 : 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    LOCKED;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    drain_all();
    return cudaSuccess;
}

/* ---- memory ----------------------------------------------------------------------------------- */

cudaError_t cudaMalloc(void** p, size_t bytes) {
    LOCKED;
    *p = nullptr;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    if (injected("cudaMalloc")) return fail(cudaErrorMemoryAllocation);
    return allocate(p, bytes, mem::device);
}

cudaError_t cudaFree(void* p) {
    LOCKED;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    drain_all();
    return deallocate(p, mem::device);
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
    LOCKED;
    *p = nullptr;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    if (injected("cudaMallocHost")) return fail(cudaErrorMemoryAllocation);
    return allocate(p, bytes, mem::pinned);
}

cudaError_t cudaFreeHost(void* p) {
    LOCKED;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    drain_all();
    return deallocate(p, mem::pinned);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    LOCKED;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    if (!copy_ends_ok(dst, src, bytes, kind)) return fail(cudaErrorInvalidValue);
    drain(&dev().legacy);
    if (bytes) memcpy(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    LOCKED;
    if (injected("cudaMemcpyAsync")) return fail(cudaErrorUnknown);
    if (!copy_ends_ok(dst, src, bytes, kind)) return fail(cudaErrorInvalidValue);
    if (bytes == 0) return cudaSuccess;
    work w{};
    w.what = work::copy;
    w.dst = dst;
    w.src = src;
    w.bytes = bytes;
    const bool host_src = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
    const bool host_dst = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
    if (host_dst && !is_pinned(dst, bytes)) { /* into pageable memory: synchronous */
        if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
        drain(stream_of(stream));
        memcpy(dst, src, bytes);
        return cudaSuccess;
    }
    if (host_src && !is_pinned(src, bytes)) /* from pageable memory: staged now */
        w.staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    return enqueue(stream, std::move(w));
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
    LOCKED;
    if (bytes && !on_device(p, bytes)) return fail(cudaErrorInvalidValue);
    work w{};
    w.what = work::set;
    w.dst = p;
    w.bytes = bytes;
    w.value = value;
    return enqueue(stream, std::move(w));
}

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
    if (!config().pools || props->location.id < 0 || props->location.id >= config().devices)
        return fail(cudaErrorInvalidValue);
    *pool = new tl_emu_pool{props->location.id};
    return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
    delete pool;
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void* value) {
    return pool && attr == cudaMemPoolAttrReleaseThreshold && value ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool, cudaStream_t stream) {
    LOCKED;
    *p = nullptr;
    if (!pool) return fail(cudaErrorInvalidValue);
    if (stream_of(stream)->capturing) { /* a graph allocation node: not emulated */
        stream_of(stream)->capture_invalid = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    if (injected("cudaMallocFromPoolAsync")) return fail(cudaErrorMemoryAllocation);
    return allocate(p, bytes, mem::device);
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
    LOCKED;
    if (!p) return cudaSuccess;
    if (!dev().allocations.count((uintptr_t)p)) return fail(cudaErrorInvalidValue);
    work w{};
    w.what = work::release;
    w.dst = p;
    return enqueue(stream, std::move(w));
}

/* ---- streams and events ----------------------------------------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
    LOCKED;
    (void)flags;
    *stream = new tl_emu_stream;
    dev().streams.push_back(*stream);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    LOCKED;
    if (!stream) return fail(cudaErrorInvalidResourceHandle);
    drain(stream);
    auto& all = dev().streams;
    for (size_t i = 0; i < all.size(); i++)
        if (all[i] == stream) all.erase(all.begin() + (long)i);
    delete stream;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    LOCKED;
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    if (stream_of(stream)->capturing) return fail(cudaErrorStreamCaptureUnsupported);
    drain(stream_of(stream));
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    LOCKED;
    (void)mode;
    if (!stream || stream->capturing || capturing) return fail(cudaErrorInvalidValue);
    if (injected("cudaStreamBeginCapture")) return fail(cudaErrorUnknown);
    stream->capturing = true;
    stream->capture_invalid = false;
    stream->capture_thread = std::this_thread::get_id();
    stream->captured.clear();
    capturing = stream;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
    LOCKED;
    *graph = nullptr;
    if (!stream || !stream->capturing) return fail(cudaErrorInvalidValue);
    if (stream->capture_thread != std::this_thread::get_id()) return fail(cudaErrorStreamCaptureWrongThread);
    stream->capturing = false;
    capturing = nullptr;
    if (stream->capture_invalid) {
        stream->captured.clear();
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    *graph = new tl_emu_graph{std::move(stream->captured)};
    stream->captured.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
    LOCKED;
    const tl_emu_stream* s = stream_of(stream);
    *status = !s->capturing ? cudaStreamCaptureStatusNone
        : s->capture_invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
    (void)flags;
    *event = new tl_emu_event;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    LOCKED;
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    if (event->pending && event->stream) drain(event->stream, event); /* its queued records point at it */
    delete event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    LOCKED;
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    if (stream_of(stream)->capturing) { /* an event node: not emulated */
        stream_of(stream)->capture_invalid = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    work w{};
    w.what = work::record;
    w.event = event;
    event->stream = stream_of(stream);
    event->pending++;
    return enqueue(stream, std::move(w));
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    LOCKED;
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    if (event->stream) drain(event->stream, event);
    return cudaSuccess;
}

/* ---- graphs ----------------------------------------------------------------------------------- */

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
    LOCKED;
    (void)flags;
    *exec = nullptr;
    if (!graph) return fail(cudaErrorInvalidValue);
    if (injected("cudaGraphInstantiate")) return fail(cudaErrorUnknown);
    *exec = new tl_emu_graph{graph->nodes};
    return cudaSuccess;
}

cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
    LOCKED;
    if (!exec || !graph) return fail(cudaErrorInvalidValue);
    bool same = exec->nodes.size() == graph->nodes.size();
    bool same_kernels = true;
    for (size_t i = 0; same && i < graph->nodes.size(); i++) {
        const work &a = exec->nodes[i], &b = graph->nodes[i];
        same = a.what == b.what;
        if (same && a.what == work::kernel && a.shape.kernel != b.shape.kernel) same_kernels = false;
    }
    if (info)
        info->result = !same ? cudaGraphExecUpdateErrorTopologyChanged
            : !same_kernels ? cudaGraphExecUpdateErrorFunctionChanged : cudaGraphExecUpdateSuccess;
    if (!same || !same_kernels || injected("cudaGraphExecUpdate")) return fail(cudaErrorGraphExecUpdateFailure);
    exec->nodes = graph->nodes;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    LOCKED;
    if (!exec) return fail(cudaErrorInvalidValue);
    if (stream_of(stream)->capturing) return fail(cudaErrorStreamCaptureUnsupported);
    if (injected("cudaGraphLaunch")) return fail(cudaErrorUnknown);
    for (const work& w : exec->nodes) {
        if (w.what == work::kernel) dev().launches[w.shape.name]++;
        stream_of(stream)->queue.push_back(w);
    }
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}
