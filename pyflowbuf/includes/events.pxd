cdef extern from "fb_events.h" nogil:
    enum:
        FB_EVT_END_OF_PARTITION
        FB_EVT_BARRIER
        FB_EVT_CANCEL_BARRIER
        FB_EVT_END_OF_DATA
        FB_EVT_USER
        FB_EVT_KIND
        FB_EVT_WATERMARK
        FB_EVT_FLAG_UNALIGNED
        FB_EVT_FLAG_STOP
