cdef extern from "fb_errors.h" nogil:
    enum:
        FB_OK
        FB_E_UNAVAILABLE
        FB_E_TIMEOUT
        FB_E_NOMEM
        FB_E_INVALID
        FB_E_DESTROYED
        FB_E_INSUFFICIENT
        FB_E_FULL
        FB_E_CLOSED
        FB_E_RECORD_TOO_LARGE
        FB_E_CORRUPT
        FB_E_CANCELLED
