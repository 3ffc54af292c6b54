"""RecordWriter and RecordReader: records serialized straight into segments.

Records are a 4-byte little-endian length and the payload, spanning buffers
freely. On a timestamped stream (``timestamped=True`` on both ends, decided
per stream) the length also covers the record's event time, a little-endian
float64 ahead of the payload. Fixed-width records (NumPy arrays) go into their own buffers, back to
back, one memcpy per buffer, and come back as NumPy views. Every batch API
crosses from Python into C once per call.

One extension module, written in parts by concept (each ``include``d below):
serde_kinds.pxi (record kinds and what a stream of a kind carries),
serde_hash.pxi (the stable key hash), serde_ts.pxi (a batch's timestamps), serde_struct.pxi (the struct codec),
record_writer.pxi, record_deserializer.pxi (the per-channel half of the
reader) and record_reader.pxi. serde.pxd declares the classes for cimporters.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.buffer cimport PyObject_CheckBuffer
from cpython.dict cimport PyDict_Next, PyDict_Size
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_AsDouble, PyFloat_FromDouble
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLong, PyLong_AsLongLongAndOverflow, PyLong_FromLongLong
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Realloc
from cpython.number cimport PyIndex_Check, PyNumber_Index
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_New, PyTuple_SET_ITEM
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.math cimport INFINITY, floor, isfinite
from libc.string cimport memcpy

from pyflowbuf._core.channel cimport BufferQueue, InputGate
from pyflowbuf._core.errors cimport check
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool, RecordView
from pyflowbuf.includes.arena cimport fb_pool_recycle, fb_pool_request, fb_segment_ptr
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.events cimport FB_EVT_BARRIER, FB_EVT_CANCEL_BARRIER, FB_EVT_END_OF_PARTITION
from pyflowbuf.includes.park cimport fb_monotonic_ns
from pyflowbuf.includes.ring cimport FB_DATA_EVENT, FB_DATA_FIXED, FB_DATA_RECORDS, fb_bufdesc
from pyflowbuf.includes.serde cimport *

import pickle

import numpy as np

cimport numpy as cnp
from cpython.object cimport PyTypeObject

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewFromDescr(PyTypeObject *subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, object obj)

from pyflowbuf import errors as _errors

cdef extern from "Python.h":
    PyObject *PyBytes_FromStringAndSize_raw "PyBytes_FromStringAndSize"(const char *, Py_ssize_t) except NULL
    char *PyBytes_AS_STRING_raw "PyBytes_AS_STRING"(PyObject *) nogil

DEFAULT_MAX_RECORD_SIZE = 64 * 1024 * 1024
DEFAULT_ZERO_COPY_MIN = 4096
cdef object _NEED_MORE = object()
cdef object _pickle_dumps = pickle.dumps
cdef object _pickle_loads = pickle.loads


cdef int64_t _timeout_ns(object timeout, str name="timeout") except? -2:
    """None: no limit (-1); otherwise seconds >= 0 as nanoseconds."""
    if timeout is None:
        return -1
    if not timeout >= 0:
        raise ValueError(f"{name} must be >= 0 or None, got {timeout!r}")
    return <int64_t>(timeout * 1e9)


cdef object _at_index(BaseException exc, Py_ssize_t i, str msg):
    """``exc`` again with ``msg``, and ``record_index`` for the caller to show the record."""
    try:
        new = type(exc)(msg)
    except Exception:  # e.g. UnicodeEncodeError takes 5 arguments
        new = (TypeError if isinstance(exc, TypeError) else ValueError)(msg)
    new.record_index = i
    return new


# The module's parts, by concept; the order matters only for module-level
# names used when a later part is executed (KINDS, the DEFAULT_* sizes).
include "serde_kinds.pxi"
include "serde_ts.pxi"
include "serde_hash.pxi"
include "serde_struct.pxi"
include "record_writer.pxi"
include "record_deserializer.pxi"
include "record_reader.pxi"
