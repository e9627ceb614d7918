/* isa.h — which kernel paths this CPU can run, and their names. */
#ifndef TL_ISA_H
#define TL_ISA_H

#include <stdbool.h>

#include "tinyloop.h"

bool tl_isa_available(tl_isa isa);
tl_isa tl_isa_best(void); /* never TL_ISA_AUTO */
/* "auto", "scalar", "avx2", "avx512-vnni" (what tl_model_runtime's device_name shows). */
const char* tl_isa_name(tl_isa isa);

#endif
