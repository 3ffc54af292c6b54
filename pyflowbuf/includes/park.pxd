from libc.stdint cimport int64_t, uint32_t

cdef extern from "fb_park.h" nogil:
    ctypedef struct fb_event:
        uint32_t epoch
        uint32_t waiters
    int fb_event_init(fb_event *e)
    void fb_event_destroy(fb_event *e)
    uint32_t fb_event_prepare(fb_event *e)
    void fb_event_cancel(fb_event *e)
    int fb_event_wait(fb_event *e, uint32_t token, int64_t timeout_ns)
    void fb_event_notify(fb_event *e)
    void fb_event_notify_all(fb_event *e)
    int fb_event_fd_open(fb_event *e, int *wr)
    void fb_event_fd_close(fb_event *e, int rd, int wr)
    void fb_event_fd_drain(int rd)
    int64_t fb_monotonic_ns()
