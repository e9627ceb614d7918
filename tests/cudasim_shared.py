"""A thread-safe `cuda.shared.array` for numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).

The simulator runs each GPU thread of a block as a Python thread, and its shared-array call
looks the array up by the calling source line and creates it when missing, with no lock: two
threads of a block that reach the line together could each create their own array, one then
writing tiles the others never see and reading uninitialized memory. That is the one unguarded
state we found after a speculative-decoding property failed once on the simulator under load
(a plain prefill's first token differed, an int32 overflow warned in the linear kernel) and
passed when replayed; a stress test did not reproduce the race. On a GPU there is nothing to
fix. `install()` does the same lookup under a lock.
"""
import sys
import threading
import traceback

import numpy as np

_LOCK = threading.Lock()


def install():
    """Make the simulator's static shared arrays one per (block launch, source line), always."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    shared = kernelapi.FakeCUDAShared
    dynamic = shared.array

    def array(self, shape, dtype):
        if shape == 0:                           # dynamic shared memory: one buffer, no lookup
            return dynamic(self, shape, dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]   # the kernel's line
        with _LOCK:
            found = self._allocations.get(caller)
            if found is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    shared.array = array
