cdef int raise_error(int rc, str context=*) except -1
cdef inline int check(int rc, str context=None) except -1:
    if rc >= 0:
        return rc
    return raise_error(rc, context)
