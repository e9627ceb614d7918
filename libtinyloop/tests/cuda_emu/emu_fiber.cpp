/* emu_fiber.cpp — cooperative fibers for the CUDA emulation's threads (tests only): a context
 * switch of the x86-64 System V callee-saved registers (rbx, rbp, r12-r15) and the stack pointer,
 * a few nanoseconds where ucontext's makes a system call per switch. The floating-point control
 * state (MXCSR, x87) is the OS thread's, shared by its fibers: no kernel changes it.
 * Under AddressSanitizer every switch is announced (__sanitizer_start/finish_switch_fiber), so
 * its stack checks follow the fiber that runs.
 *
 * A new fiber's stack, from its initial stack pointer S (16-byte aligned) up: r15, r14,
 * r13 = entry, r12 = arg, rbx, rbp and the return address tl_emu_fiber_start, which calls
 * entry(arg) with the stack aligned as after a call: S + 56 is 16-byte aligned. */
#include "emu_internal.h"

#if !defined(__x86_64__)
#error "the CUDA emulation's fibers are written for x86-64"
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define TL_EMU_ASAN 1
#endif

extern "C" void tl_emu_swap(void** save_sp, void* next_sp);
extern "C" void tl_emu_fiber_start(void);

__asm__(R"(
    .text
    .globl tl_emu_swap
    .hidden tl_emu_swap
    .type tl_emu_swap, @function
tl_emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tl_emu_swap, .-tl_emu_swap

    .globl tl_emu_fiber_start
    .hidden tl_emu_fiber_start
    .type tl_emu_fiber_start, @function
tl_emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size tl_emu_fiber_start, .-tl_emu_fiber_start
)");

namespace tl_emu {

void fiber_init(fiber* f, void* stack_lo, size_t size, void (*entry)(void*), void* arg) {
#ifdef TL_EMU_ASAN
    __asan_unpoison_memory_region(stack_lo, size); /* no stale red zones from the last fiber here */
#endif
    const uintptr_t top = ((uintptr_t)stack_lo + size) & ~(uintptr_t)15;
    uint64_t* s = (uint64_t*)(top - 72); /* S + 56 = top - 16 */
    s[0] = 0;                                   /* r15 */
    s[1] = 0;                                   /* r14 */
    s[2] = (uint64_t)(uintptr_t)entry;          /* r13 */
    s[3] = (uint64_t)(uintptr_t)arg;            /* r12 */
    s[4] = 0;                                   /* rbx */
    s[5] = 0;                                   /* rbp */
    s[6] = (uint64_t)(uintptr_t)&tl_emu_fiber_start;
    f->sp = s;
    f->stack_lo = stack_lo;
    f->stack_size = size;
    f->fake_stack = NULL;
}

#ifdef TL_EMU_ASAN
/* The bounds of the OS thread's own stack (a fiber record with stack_lo NULL), learned when the
 * first fiber starts: the scheduler, on that stack, starts it. */
static thread_local const void* os_lo;
static thread_local size_t os_size;
#endif

void fiber_switch(fiber* from, fiber* to, bool exiting) {
#ifdef TL_EMU_ASAN
    const void* lo = to->stack_lo ? to->stack_lo : os_lo;
    const size_t size = to->stack_lo ? to->stack_size : os_size;
    __sanitizer_start_switch_fiber(exiting ? NULL : &from->fake_stack, lo, size);
    tl_emu_swap(&from->sp, to->sp);
    const void* ignored_lo;
    size_t ignored_size;
    __sanitizer_finish_switch_fiber(from->fake_stack, &ignored_lo, &ignored_size);
#else
    (void)exiting;
    tl_emu_swap(&from->sp, to->sp);
#endif
}

void fiber_started() {
#ifdef TL_EMU_ASAN
    const void* lo;
    size_t size;
    __sanitizer_finish_switch_fiber(NULL, &lo, &size);
    if (!os_lo) {
        os_lo = lo;
        os_size = size;
    }
#endif
}

}  // namespace tl_emu
