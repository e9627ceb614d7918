/* versioned.h — filling a caller's output struct up to its own `size` (tinyloop.h conventions):
 * a caller built against an older, shorter struct gets the fields it knows. */
#ifndef TL_VERSIONED_H
#define TL_VERSIONED_H

#include <stddef.h>
#include <string.h>

/* Copy the first min(out->size, full_size) bytes of *full into *out, that count as its size. */
static inline void tl_copy_versioned(void* out, void* full, size_t full_size) {
    const size_t size = *(size_t*)out < full_size ? *(size_t*)out : full_size;
    *(size_t*)full = size;
    memcpy(out, full, size);
}

#endif
