/* isa.h — which kernel paths this CPU can run, and their names. */
#ifndef TL_ISA_H
#define TL_ISA_H

#include <stdbool.h>

#include "tinyloop.h"

/* Whether this CPU and build can run `isa`; for AMX this also obtains the process's permission
 * to use the tile state (once). */
bool tl_isa_available(tl_isa isa);
tl_isa tl_isa_best(void); /* never TL_ISA_AUTO */
/* "auto", "scalar", "avx2", "avx512-vnni", "amx" ("amx-emulated" in a TINYLOOP_AMX_EMULATION
 * build): what tl_model_runtime's device_name shows. */
const char* tl_isa_name(tl_isa isa);
/* The ISA a TINYLOOP_ISA value names: "auto", "scalar", "avx2", "avx512" or "avx512-vnni",
 * "amx". False for any other text. */
bool tl_isa_from_name(const char* name, tl_isa* out);

#endif
