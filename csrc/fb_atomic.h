/* Thin names over the GCC/Clang __atomic builtins, so the rest of csrc/ reads
 * as the memory-order argument it makes. Plain integer fields are used (not
 * _Atomic) so Cython can declare the structs. */
#ifndef FB_ATOMIC_H
#define FB_ATOMIC_H
#include <stdint.h>

#define FB_CACHELINE 64
#define FB_ALIGNED __attribute__((aligned(FB_CACHELINE)))

#define fb_load_relaxed(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define fb_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define fb_load_seqcst(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define fb_store_relaxed(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define fb_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
/* weak CAS; on failure *expected is refreshed with the current value */
#define fb_cas(p, expected, desired) \
    __atomic_compare_exchange_n((p), (expected), (desired), 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
#define fb_fetch_add(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
#define fb_fetch_add_seqcst(p, v) __atomic_fetch_add((p), (v), __ATOMIC_SEQ_CST)
#define fb_fence_seqcst() __atomic_thread_fence(__ATOMIC_SEQ_CST)

/* Only used for the few instructions between a producer claiming a cell and
 * publishing it; never for waiting on availability (that parks, fb_park.h). */
static inline void fb_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
#endif
