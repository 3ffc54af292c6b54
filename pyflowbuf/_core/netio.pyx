"""The hot paths of the remote exchange, run without the GIL.

Data buffers cross a connection without Python. On the producer a SendPump
gathers the finished buffers of every SenderView against their credit and
writes them with one sendmsg, header and segment side by side. On the
consumer a ReceivePump reads BufferResponse headers, receives each payload
straight into a segment its channel reserved, pushes it to the channel's
BufferQueue, and turns recycled segments back into credit (AddCredit) on
the same thread. Everything rare (events, control frames, the priority lane,
odd or bad input, TCP-window-only mode) goes back to pyflowbuf.net, which
handles that one frame and re-enters the loop: every protocol decision and
error message stays in one place.

Flow-control state lives here too (ReceiverCredit, SenderView) so the loops
and Python share one set of books; the model-based tests drive them directly.

One module in five parts, by concept: netio_wire.pxi (the socket), netio_tls.pxi
(mutual TLS 1.3 with libssl, in these same loops), netio_send.pxi
(SenderView, SendPump), netio_credit.pxi (ReceiverCredit), netio_receive.pxi
(ReceivePump).
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove, memset

from pyflowbuf._core.channel cimport BufferQueue
from pyflowbuf.includes.events cimport FB_EVT_BARRIER
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool, Notifier
from pyflowbuf.includes.arena cimport (FB_POOL_INUSE, fb_arena, fb_pool, fb_pool_recycle, fb_pool_recycle_many,
                                       fb_pool_request, fb_segment_ptr)
from pyflowbuf.includes.atomic cimport *
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.net cimport *
from pyflowbuf.includes.park cimport *
from pyflowbuf.includes.ring cimport *
from pyflowbuf.includes.tls cimport *

import os
import socket
import time

from pyflowbuf.errors import (CancelledError, ConnectionLostError, FlowBufError, InsufficientBuffersError,
                              ProtocolError, TLSError)

DATA = 0
EVENT = 1
BACKLOG = 2

# The wire format's constants as the C loops use them (csrc/fb_net.h,
# csrc/fb_ring.h), for pyflowbuf.net.frames: defined once, on the C side.
WIRE_MAGIC = <uint32_t>FB_NET_MAGIC    # an unsigned 32-bit word on the wire
WIRE_FRAME_HEADER_SIZE = FB_NET_FRAME_HEADER
WIRE_BUFFER_HEADER_SIZE = FB_NET_BUFFER_HEADER
WIRE_ADD_CREDIT_SIZE = FB_NET_ADD_CREDIT_SIZE
WIRE_RECEIVER_ID_SIZE = FB_NET_RID
WIRE_BUFFER_RESPONSE = FB_NET_MSG_BUFFER_RESPONSE
WIRE_ADD_CREDIT = FB_NET_MSG_ADD_CREDIT
WIRE_DATA_RECORDS = FB_DATA_RECORDS
WIRE_DATA_FIXED = FB_DATA_FIXED
WIRE_DATA_EVENT = FB_DATA_EVENT

# what SendPump.run / ReceivePump.run return (a failed system call raises instead)
cdef enum:
    RUN_PYTHON = 1     # the next item or frame needs the Python path
    RUN_DIRTY = 2      # the set of views changed
    RUN_IDLE = 3       # nothing happened within the timeout
    RUN_CLOSED = 4
    RUN_FRAME = 5      # a frame for Python is staged in the reader
    RUN_BROKEN = 6     # (SendPump) the queue handed over something that is not a data buffer

PYTHON = RUN_PYTHON
DIRTY = RUN_DIRTY
IDLE = RUN_IDLE
CLOSED = RUN_CLOSED
FRAME = RUN_FRAME

cdef enum:
    SEQ_MASK = 0x7FFFFFFF
    MAX_BATCH = 16          # buffers per gathered send
    WAKE_BATCH = 4          # buffers received per consumer wake-up, at most
    RX_PYTHON = 1
    RX_LOST = 2             # recv failed (errno in err_a)
    RX_TRUNCATED = 3        # the peer closed mid-payload (err_a of err_b bytes)
    RX_CANCELLED = 4        # the channel's queue was cancelled while full


cdef extern from "<errno.h>" nogil:
    enum:
        EAGAIN
        EWOULDBLOCK
        ETIMEDOUT


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN


cdef extern from "<sys/socket.h>" nogil:
    Py_ssize_t send(int fd, const void *buf, size_t n, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL


ctypedef void *ReceiverCredit_ptr
ctypedef void *SenderView_ptr


cdef Py_ssize_t _send_dontwait(int fd, bytes b):
    return send(fd, <const char *>b, len(b), MSG_DONTWAIT | MSG_NOSIGNAL)


include "netio_tls.pxi"
include "netio_wire.pxi"
include "netio_send.pxi"
include "netio_credit.pxi"
include "netio_receive.pxi"
