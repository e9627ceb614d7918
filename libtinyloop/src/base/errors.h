/* errors.h — the thread-local error message behind tl_last_error().
 * Every failing path calls tl_fail(status, fmt, ...) and returns what it returns. */
#ifndef TL_ERRORS_H
#define TL_ERRORS_H

#include "tinyloop.h"

/* Set this thread's message (printf-style) and return `status`. */
tl_status tl_fail(tl_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* TL_ERR_BAD_FILE with "bad <what>: <message>" (what: "model file", "prefix blob"): the
 * on-disk formats' readers name the broken rule so. */
tl_status tl_fail_bad_file(const char* what, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* The canonical out-of-memory failure: TL_ERR_OUT_OF_MEMORY with "out of memory (<what>)". */
tl_status tl_fail_oom(const char* what);

#endif
