/* emu_internal.h — what the CUDA emulation's files share (tests only): its settings from the
 * environment, the fibers a block's threads run on, and the grid runner the streams call. */
#ifndef TL_CUDA_EMU_INTERNAL_H
#define TL_CUDA_EMU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <functional>

#include "cuda_runtime.h"

namespace tl_emu {

enum class order { forward, reverse, random };

/* The emulated device, from the environment (docs/gpu.md lists the variables). */
struct settings {
    order schedule;      /* TINYLOOP_CUDA_EMU_ORDER: forward | reverse | random (default)        */
    uint64_t seed;       /* TINYLOOP_CUDA_EMU_SEED (default 1): the random order's               */
    int devices;         /* TINYLOOP_CUDA_EMU_DEVICES (default 1)                                */
    int sms;             /* TINYLOOP_CUDA_EMU_SMS: multiprocessors reported (default 132)        */
    bool pools;          /* TINYLOOP_CUDA_EMU_POOLS=0: no stream-ordered memory pools            */
    unsigned char poison; /* TINYLOOP_CUDA_EMU_POISON: the byte fresh memory holds (default 0x7f) */
    size_t memory;       /* TINYLOOP_CUDA_EMU_MEMORY: device bytes (default 80 GiB)              */
};
const settings& config();

/* A fiber: a stack and the saved stack pointer of a suspended context. */
struct fiber {
    void* sp;
    void* stack_lo;      /* the stack's lowest usable byte (NULL: the OS thread's own stack) */
    size_t stack_size;
    void* fake_stack;    /* AddressSanitizer's bookkeeping across switches */
};
/* Make f start entry(arg) on [stack_lo, stack_lo + size) at its first resumption. */
void fiber_init(fiber* f, void* stack_lo, size_t size, void (*entry)(void*), void* arg);
/* Suspend `from` and resume `to`; `exiting`: `from` is never resumed again. */
void fiber_switch(fiber* from, fiber* to, bool exiting);
/* Called first thing on a fiber's own stack, once: completes the switch into it. */
void fiber_started();

/* Run every block of a launch now, on the calling thread (emu_block.cpp). */
void run_grid(const launch_shape& shape, const std::function<void()>& body);

}  // namespace tl_emu

#endif
