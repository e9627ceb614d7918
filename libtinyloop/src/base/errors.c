/* errors.c — status names and the thread-local error message (tl_last_error).
 * Messages are formatted into a fixed per-thread buffer: reporting an error never allocates. */
#include "base/errors.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

tl_status tl_fail(tl_status status, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

tl_status tl_fail_bad_file(const char* what, const char* fmt, ...) {
    char msg[400];
    va_list args;
    va_start(args, fmt);
    vsnprintf(msg, sizeof msg, fmt, args);
    va_end(args);
    return tl_fail(TL_ERR_BAD_FILE, "bad %s: %s", what, msg);
}

tl_status tl_fail_oom(const char* what) {
    return tl_fail(TL_ERR_OUT_OF_MEMORY, "out of memory (%s)", what);
}

TL_API const char* tl_last_error(void) { return last_error; }

TL_API const char* tl_status_string(tl_status status) {
    switch (status) {
    case TL_OK: return "ok";
    case TL_ERR_INVALID_ARGUMENT: return "invalid argument";
    case TL_ERR_OUT_OF_RANGE: return "token id out of range";
    case TL_ERR_SEQ_TOO_LONG: return "sequence longer than max_seq_len";
    case TL_ERR_LOOPS_MISMATCH: return "loops mismatch";
    case TL_ERR_WINDOW_MISMATCH: return "cache_window mismatch";
    case TL_ERR_CLOSED: return "model was closed";
    case TL_ERR_OUT_OF_MEMORY: return "out of memory";
    case TL_ERR_BAD_FILE: return "bad model file";
    case TL_ERR_IO: return "i/o error";
    case TL_ERR_NUMERIC: return "non-finite logits";
    case TL_ERR_UNSUPPORTED: return "unsupported";
    case TL_ERR_WRONG_MODEL: return "object belongs to another model";
    case TL_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}
