/* crc32.c — slice-by-8 CRC-32 (zlib's polynomial). Tables are built once, thread-safely. */
#include "base/crc32.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int s = 1; s < 8; s++) table[s][i] = (table[s - 1][i] >> 8) ^ table[0][table[s - 1][i] & 0xff];
}

uint32_t tl_crc32(uint32_t crc, const void* data, size_t n) {
    pthread_once(&table_once, build_table);
    const unsigned char* p = data;
    uint32_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo, hi;  /* little-endian words; the file format is little-endian too */
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^
            table[4][lo >> 24] ^ table[3][hi & 0xff] ^ table[2][(hi >> 8) & 0xff] ^
            table[1][(hi >> 16) & 0xff] ^ table[0][hi >> 24];
    }
    for (; n > 0; n--, p++) c = table[0][(c ^ *p) & 0xff] ^ (c >> 8);
    return ~c;
}
