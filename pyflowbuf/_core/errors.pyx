"""The one place where C error codes become Python exceptions."""
from pyflowbuf.includes.errors cimport *

from pyflowbuf import errors as _e

_MESSAGES = {
    FB_E_UNAVAILABLE: (_e.BufferRequestTimeout, "no buffer available"),
    FB_E_TIMEOUT: (_e.BufferRequestTimeout, "timed out waiting for a buffer"),
    FB_E_NOMEM: (MemoryError, "out of memory"),
    FB_E_INVALID: (ValueError, "invalid argument"),
    FB_E_DESTROYED: (_e.PoolDestroyedError, "the buffer pool was destroyed"),
    FB_E_INSUFFICIENT: (_e.InsufficientBuffersError, "insufficient number of network buffers"),
    FB_E_FULL: (_e.FlowBufError, "queue full"),
    FB_E_CLOSED: (_e.ChannelClosedError, "channel closed"),
    FB_E_RECORD_TOO_LARGE: (_e.RecordTooLargeError, "record too large"),
    FB_E_CORRUPT: (_e.CorruptRecordError, "corrupt record stream"),
    FB_E_CANCELLED: (_e.CancelledError, "cancelled"),
}


cdef int raise_error(int rc, str context=None) except -1:
    exc, msg = _MESSAGES.get(rc, (_e.FlowBufError, f"error code {rc}"))
    if context:
        msg = f"{msg}: {context}"
    raise exc(msg)


def error_for_code(int rc, context=None):
    """Return the exception the core raises for C error code ``rc`` (for tests)."""
    try:
        raise_error(rc, context)
    except BaseException as exc:
        return exc
