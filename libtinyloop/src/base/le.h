/* le.h — little-endian fields of the on-disk formats (the model file, the prefix blob), read
 * and written byte by byte: right on any host, from any alignment. */
#ifndef TL_LE_H
#define TL_LE_H

#include <stdint.h>
#include <string.h>

static inline uint32_t rd_u32(const uint8_t* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t rd_u64(const uint8_t* p) { return rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static inline float rd_f32(const uint8_t* p) {
    const uint32_t u = rd_u32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void wr_u32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i);
}
static inline void wr_u64(uint8_t* p, uint64_t v) {
    wr_u32(p, (uint32_t)v);
    wr_u32(p + 4, (uint32_t)(v >> 32));
}
static inline void wr_f32(uint8_t* p, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    wr_u32(p, u);
}

#endif
