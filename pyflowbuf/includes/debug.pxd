cdef extern from "fb_debug.h" nogil:
    const int FB_DEBUG
