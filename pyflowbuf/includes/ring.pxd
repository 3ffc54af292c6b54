from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t

from pyflowbuf.includes.arena cimport fb_pool

cdef extern from "fb_ring.h" nogil:
    enum:
        FB_DATA_RECORDS
        FB_DATA_FIXED
        FB_DATA_EVENT
    ctypedef struct fb_bufdesc:
        fb_pool *pool
        uint32_t seg
        uint32_t size
        uint32_t width
        uint16_t type
        uint16_t flags
        int64_t aux
    ctypedef struct fb_ring:
        pass
    int fb_ring_init(fb_ring *r, uint64_t min_capacity)
    void fb_ring_free(fb_ring *r)
    fb_ring *fb_ring_new(uint64_t min_capacity)
    void fb_ring_delete(fb_ring *r)
    int fb_ring_push(fb_ring *r, const fb_bufdesc *d)
    int fb_ring_pop(fb_ring *r, fb_bufdesc *d)
    fb_bufdesc *fb_ring_peek(fb_ring *r)
    int fb_ring_was_empty(fb_ring *r)
    uint64_t fb_ring_size(fb_ring *r)
    uint64_t fb_ring_tail(fb_ring *r)
    uint64_t fb_ring_head(fb_ring *r)
    fb_bufdesc *fb_ring_at(fb_ring *r, uint64_t i)
