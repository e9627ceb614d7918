/* cuda_stub.c — the CUDA backend of a build without TINYLOOP_CUDA: probing says so, and
 * nothing else is reachable (no engine gets a tl_cuda without a successful probe). */
#include "cuda/device.h"
#include "base/errors.h"

tl_status tl_cuda_probe(int* n_devices) {
    *n_devices = 0;
    return tl_fail(TL_ERR_UNSUPPORTED, "libtinyloop was built without CUDA (rebuild with nvcc on PATH, "
                                       "or -DTINYLOOP_CUDA=ON)");
}

tl_status tl_cuda_create(const tl_file* file, int device, tl_cuda** out) {
    (void)file;
    (void)device;
    *out = NULL;
    int n_devices;
    return tl_cuda_probe(&n_devices);
}

void tl_cuda_free(tl_cuda* c) { (void)c; }
size_t tl_cuda_weight_bytes(const tl_cuda* c) { (void)c; return 0; }
const char* tl_cuda_device_name(const tl_cuda* c) { (void)c; return ""; }
void* tl_cuda_block_alloc(tl_cuda* c, size_t bytes) { (void)c; (void)bytes; return NULL; }
void tl_cuda_block_free(tl_cuda* c, void* data) { (void)c; (void)data; }
int tl_cuda_block_download(tl_cuda* c, void* host, const void* data, size_t bytes) {
    (void)c, (void)host, (void)data, (void)bytes;
    return -1;
}
int tl_cuda_block_upload(tl_cuda* c, void* data, const void* host, size_t bytes) {
    (void)c, (void)data, (void)host, (void)bytes;
    return -1;
}
int tl_cuda_block_copy(tl_cuda* c, void* dst, const void* src, size_t bytes) {
    (void)c, (void)dst, (void)src, (void)bytes;
    return -1;
}

tl_status tl_cuda_forward(tl_cuda* c, const tl_cuda_batch* batch) {
    (void)c;
    (void)batch;
    int n_devices;
    return tl_cuda_probe(&n_devices);
}

tl_status tl_cuda_kv_from_rows(tl_cuda* c, const tl_cuda_kv_rows* kv) {
    (void)c;
    (void)kv;
    int n_devices;
    return tl_cuda_probe(&n_devices);
}
