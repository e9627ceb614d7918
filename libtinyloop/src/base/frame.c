/* frame.c — the header frame of the prefix blob and the spilled block file (frame.h). */
#include "base/frame.h"

#include <string.h>

#include "base/crc32.h"
#include "base/errors.h"
#include "base/le.h"

enum { CHECKSUM_AT = 24 };

void tl_frame_begin(const tl_frame* f, uint8_t* out, uint32_t version, uint64_t bytes) {
    memset(out, 0, TL_FRAME_HEADER_BYTES);
    memcpy(out, f->magic, 8);
    wr_u32(out + 8, version);
    wr_u32(out + 12, TL_FRAME_HEADER_BYTES);
    wr_u64(out + 16, bytes);
}

void tl_frame_seal(uint8_t* out, size_t bytes) { wr_u32(out + CHECKSUM_AT, tl_crc32(0, out, bytes)); }

tl_status tl_frame_check(const tl_frame* f, const uint8_t* b, size_t n) {
    if (n < TL_FRAME_HEADER_BYTES)
        return tl_fail_bad_file(f->what, "too small: %zu bytes < the %d-byte header", n, TL_FRAME_HEADER_BYTES);
    if (memcmp(b, f->magic, 8) != 0) return tl_fail_bad_file(f->what, "bad magic, expected \"%.8s\"", f->magic);
    const uint32_t version = rd_u32(b + 8);
    if (version < f->min_version || version > f->max_version) {
        if (f->min_version == f->max_version)
            return tl_fail_bad_file(f->what, "version: unsupported %u, expected %u", version, f->min_version);
        return tl_fail_bad_file(f->what, "version: unsupported %u, expected %u or %u", version, f->min_version,
                                f->max_version);
    }
    if (rd_u32(b + 12) != TL_FRAME_HEADER_BYTES)
        return tl_fail_bad_file(f->what, "header_bytes: must be %d, got %u", TL_FRAME_HEADER_BYTES, rd_u32(b + 12));
    if (rd_u64(b + 16) != n)
        return tl_fail_bad_file(f->what, "%s: header says %llu, %s has %zu bytes", f->size_field,
                                (unsigned long long)rd_u64(b + 16), f->noun, n);
    const uint8_t zero[4] = {0};
    uint32_t crc = tl_crc32(0, b, CHECKSUM_AT);
    crc = tl_crc32(crc, zero, sizeof zero);
    crc = tl_crc32(crc, b + CHECKSUM_AT + 4, n - CHECKSUM_AT - 4);
    if (crc != rd_u32(b + CHECKSUM_AT))
        return tl_fail_bad_file(f->what, "checksum mismatch: header 0x%08x, computed 0x%08x", rd_u32(b + CHECKSUM_AT),
                                crc);
    return TL_OK;
}
