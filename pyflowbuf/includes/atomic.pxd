from libc.stdint cimport int64_t

cdef extern from "fb_atomic.h" nogil:
    enum:
        __ATOMIC_RELAXED
        __ATOMIC_ACQUIRE
        __ATOMIC_RELEASE
        __ATOMIC_SEQ_CST
    int64_t fb_atomic_load_i64 "__atomic_load_n"(int64_t *p, int order)
    void fb_atomic_store_i64 "__atomic_store_n"(int64_t *p, int64_t v, int order)
    int64_t fb_atomic_add_i64 "__atomic_add_fetch"(int64_t *p, int64_t v, int order)
    int fb_atomic_load_int "__atomic_load_n"(int *p, int order)
    void fb_atomic_store_int "__atomic_store_n"(int *p, int v, int order)
