/* cpu.h — which kernel paths this CPU can run. */
#ifndef TL_CPU_H
#define TL_CPU_H

#include <stdbool.h>

#include "tinyloop.h"

bool tl_isa_available(tl_isa isa);
tl_isa tl_isa_best(void); /* never TL_ISA_AUTO */

#endif
