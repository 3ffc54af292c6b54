from libc.stdint cimport uint32_t, uint64_t

cdef extern from "fb_mpmc.h" nogil:
    ctypedef struct fb_mpmc:
        pass
    int fb_mpmc_init(fb_mpmc *q, uint64_t min_capacity)
    void fb_mpmc_free(fb_mpmc *q)
    int fb_mpmc_push(fb_mpmc *q, uint32_t value)
    int fb_mpmc_pop(fb_mpmc *q, uint32_t *value)
    uint64_t fb_mpmc_size(fb_mpmc *q)
