/* backend_cpu.h — the CPU backend (core/backend.h): the host pass of cpu/forward.c over every
 * linear repacked for the engine's kernel path; KV block data in host memory. */
#ifndef TL_BACKEND_CPU_H
#define TL_BACKEND_CPU_H

#include "core/backend.h"

/* The CPU backend of engine e (its file open and e->isa resolved): repacks every linear of
 * e->file for e->isa, releasing each file copy the kernels no longer read as it goes (so the
 * host holds one extra linear at a time). On failure (TL_ERR_OUT_OF_MEMORY) the backend
 * allocated nothing that stays. */
tl_status tl_backend_cpu_new(tl_engine* e, tl_backend** out);

#endif
