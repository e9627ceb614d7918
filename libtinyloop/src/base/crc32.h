/* crc32.h — CRC-32 with the zlib polynomial (reflected 0xedb88320, init and final xor
 * 0xffffffff), incremental: crc = tl_crc32(crc, data, n), starting from crc = 0. */
#ifndef TL_CRC32_H
#define TL_CRC32_H

#include <stddef.h>
#include <stdint.h>

uint32_t tl_crc32(uint32_t crc, const void* data, size_t n);

#endif
