from libc.stdint cimport int64_t, uint32_t, uint64_t

from pyflowbuf.includes.mpmc cimport fb_mpmc
from pyflowbuf.includes.park cimport fb_event

cdef extern from "fb_arena.h" nogil:
    enum:
        FB_DEFAULT_SEGMENT_SIZE
        FB_MIN_SEGMENT_SIZE
        FB_MAX_SEGMENT_SIZE
    ctypedef struct fb_arena:
        char *base
        uint64_t segment_size
        uint32_t num_segments
        uint32_t segment_shift
        fb_mpmc free_list
        int64_t unreserved
        uint32_t live_pools
        fb_event available
    ctypedef struct fb_pool:
        uint64_t state
        uint32_t max
        fb_arena *arena
        fb_event *listener
        uint64_t requested
        uint64_t recycled
    uint32_t FB_POOL_INUSE(uint64_t s)
    uint32_t FB_POOL_MIN(uint64_t s)
    uint32_t FB_POOL_DESTROYED(uint64_t s)
    char *fb_segment_ptr(fb_arena *a, uint32_t seg)
    int fb_arena_create(uint32_t num_segments, uint64_t segment_size, fb_arena **out)
    void fb_arena_decref(fb_arena *a)
    uint64_t fb_arena_available(fb_arena *a)
    int fb_pool_create(fb_arena *a, uint32_t min, uint32_t max, fb_pool **out)
    int fb_pool_request(fb_pool *p, uint32_t *seg)
    int fb_pool_recycle(fb_pool *p, uint32_t seg)
    void fb_pool_recycle_many(fb_pool *const *pools, const uint32_t *segs, int n)
    int fb_pool_set_min(fb_pool *p, uint32_t new_min)
    void fb_pool_set_max(fb_pool *p, uint32_t new_max)
    int fb_pool_destroy(fb_pool *p)
    uint64_t fb_arena_release(fb_arena *a, uint64_t keep)
    int64_t fb_arena_resident(fb_arena *a)
