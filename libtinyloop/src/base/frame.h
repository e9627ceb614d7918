/* frame.h — the frame shared by the prefix blob (docs/spec.md §7.1) and the spilled block file
 * (§7.6): a 96-byte header opening with the magic (8 chars), u32 version, u32 header_bytes
 * (96), u64 size (the whole buffer) and a u32 CRC-32 (as §6.1) of the whole buffer with its own
 * 4 bytes read as zero, at offsets 0, 8, 12, 16 and 24, little-endian. */
#ifndef TL_FRAME_H
#define TL_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

enum { TL_FRAME_HEADER_BYTES = 96 };

/* One format's frame, for its errors: "bad <what>: <size_field>: header says 9, <noun> has 10
 * bytes". Versions min_version .. max_version, at most two of them. */
typedef struct tl_frame {
    const char* what;        /* "prefix blob"                      */
    const char* noun;        /* "blob", "the file"                 */
    const char* size_field;  /* "blob_bytes"                       */
    const char* magic;       /* [8] "TLPREFIX"                     */
    uint32_t min_version, max_version;
} tl_frame;

/* The header of a buffer of `bytes`: zeroed, then the magic, version, header_bytes and size
 * written (the checksum is tl_frame_seal's, once the rest is written). */
void tl_frame_begin(const tl_frame* f, uint8_t* out, uint32_t version, uint64_t bytes);
/* The checksum of out[0 .. bytes) (its field still zero) into its field. */
void tl_frame_seal(uint8_t* out, size_t bytes);
/* b[0 .. n) is whole: size, magic, version, header_bytes, size field, checksum, in that order;
 * else TL_ERR_BAD_FILE naming the first rule broken. Reads nothing past b[n - 1]. */
tl_status tl_frame_check(const tl_frame* f, const uint8_t* b, size_t n);

#endif
