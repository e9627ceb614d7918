/* version.c — ABI and library versions. TL_VERSION comes from the build (CMake's project
 * version, defined once in libtinyloop/CMakeLists.txt). */
#include "tinyloop.h"

#ifndef TL_VERSION
#error "TL_VERSION must be defined by the build"
#endif

TL_API int tl_abi_version(void) { return TL_ABI_VERSION; }

TL_API const char* tl_version_string(void) { return TL_VERSION; }
