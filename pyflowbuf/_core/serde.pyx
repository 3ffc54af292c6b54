"""RecordWriter and RecordReader: records serialized straight into segments.

Records are a 4-byte little-endian length and the payload, spanning buffers
freely. Fixed-width records (NumPy arrays) go into their own buffers, back to
back, one memcpy per buffer, and come back as NumPy views. Every batch API
crosses from Python into C once per call.
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
from libc.math cimport floor, isfinite
from libc.string cimport memcpy

from pyflowbuf._core.channel cimport EVT_BARRIER, EVT_CANCEL_BARRIER, EVT_END_OF_PARTITION, BufferQueue, InputGate
from pyflowbuf._core.errors cimport check
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool, RecordView
from pyflowbuf.includes.arena cimport fb_pool_recycle, fb_pool_request, fb_segment_ptr
from pyflowbuf.includes.errors cimport *
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
KINDS = {"bytes": KIND_BYTES, "int64": KIND_INT64, "float64": KIND_FLOAT64,
         "str": KIND_STR, "pickle": KIND_PICKLE, "struct": KIND_STRUCT, "number": KIND_NUMBER}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
cdef object _NEED_MORE = object()
cdef object _pickle_dumps = pickle.dumps
cdef object _pickle_loads = pickle.loads


cdef int _kind_code(object kind) except -1:
    if isinstance(kind, int) and kind in _KIND_NAMES:
        return kind
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}") from None


# Key hashes must agree between processes and across restarts (keyed state is
# restored wherever the key lands), so nothing here may use hash(): it is salted
# per process for str/bytes and based on identity for most objects. Keys that
# compare equal must hash equal too (1, 1.0 and True are one dict key), so
# numbers hash by value, not by type.
cdef uint64_t _TUPLE_SEED = 0x9e3779b97f4a7c15ULL
cdef uint64_t _FROZENSET_SEED = 0x2545f4914f6cdd1dULL
cdef uint64_t _NONE_HASH = 0x6a09e667f3bcc909ULL


cdef uint64_t _stable_hash(object key) except? 0:
    cdef const char *p
    cdef Py_ssize_t n
    cdef long long v
    cdef int overflow = 0
    cdef uint64_t h
    cdef Py_ssize_t i
    cdef type t = type(key)
    # subclasses (IntEnum, namedtuple...) take the same paths by their value
    # as a str / int / tuple: no method they might override is called
    if isinstance(key, str):
        return _hash_str(key)
    if isinstance(key, int):
        v = PyLong_AsLongLongAndOverflow(key, &overflow)
        if overflow == 0:
            return fb_mix64(<uint64_t>v)
        return _hash_bigint(int.__index__(key))
    if t is bytes:
        return fb_hash_bytes(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
    if isinstance(key, tuple):
        h = _TUPLE_SEED
        for i in range(PyTuple_GET_SIZE(key)):
            h = fb_mix64(h ^ _stable_hash(<object>PyTuple_GET_ITEM(key, i)))
        return h
    return _stable_hash_other(key)


cdef uint64_t _hash_str(object key) except? 0:
    cdef const char *p
    cdef Py_ssize_t n
    try:
        p = PyUnicode_AsUTF8AndSize(key, &n)
    except UnicodeEncodeError:
        # lone surrogates (file names from os.fsdecode) are valid str keys too
        data = str.encode(key, "utf-8", "surrogatepass")
        return fb_hash_bytes(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    return fb_hash_bytes(p, n)


cdef uint64_t _hash_bigint(object key) except? 0:
    # beyond 64 bits: the minimal two's-complement bytes, which every process agrees on
    data = key.to_bytes((key.bit_length() + 8) >> 3, "little", signed=True)
    return fb_hash_bytes(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


cdef uint64_t _hash_float(double d) except? 0:
    cdef uint64_t bits
    if isfinite(d) and d == floor(d):
        # an integral float is equal to an int, so it must go where that int goes
        if -9223372036854775808.0 <= d < 9223372036854775808.0:
            return fb_mix64(<uint64_t><long long>d)
        return _hash_bigint(int(d))
    memcpy(&bits, &d, 8)
    return fb_mix64(bits ^ 0x243f6a8885a308d3ULL)


cdef uint64_t _stable_hash_other(object key) except? 0:
    cdef Py_buffer view
    cdef uint64_t h
    if key is None:
        return _NONE_HASH
    if isinstance(key, float):
        return _hash_float(PyFloat_AsDouble(key))
    if isinstance(key, (bytes, bytearray, memoryview)):
        PyObject_GetBuffer(key, &view, PyBUF_SIMPLE)
        try:
            return fb_hash_bytes(<const char *>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
    if isinstance(key, frozenset):
        # a sum does not depend on the iteration order, which differs between
        # processes (it follows the salted hash of the elements)
        h = _FROZENSET_SEED
        for item in key:
            h += _stable_hash(item)
        return fb_mix64(h ^ <uint64_t>len(key))
    if PyIndex_Check(key):
        # NumPy integers equal the int they index as, and hash as it
        try:
            as_int = PyNumber_Index(key)
        except TypeError:
            pass
        else:
            return _stable_hash(as_int)
    t = type(key)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    raise _errors.KeyTypeError(
        f"a key_by key of type {name} has no hash that is the same in every process (hash() of "
        f"{name} is salted per process or based on identity), so equal keys could reach different "
        "subtasks or restored state; give key_by a key function returning str, int, float, bytes, "
        "None, or tuples/frozensets of them (e.g. str(...) or an id)")


cdef int64_t _timeout_ns(object timeout, str name="timeout") except? -2:
    """None: no limit (-1); otherwise seconds >= 0 as nanoseconds."""
    if timeout is None:
        return -1
    if not timeout >= 0:
        raise ValueError(f"{name} must be >= 0 or None, got {timeout!r}")
    return <int64_t>(timeout * 1e9)


def stable_hash(key):
    """The process-independent hash used for key partitioning: the same in every
    process and run, and equal for keys that compare equal (1, 1.0 and True).
    Keys of other types than None, bool, int, float, str, bytes (bytearray,
    memoryview), tuple and frozenset raise KeyTypeError."""
    return _stable_hash(key)


# ---------------------------------------------------------------- struct records
#
# One value per record: a tag byte, then the content. Lengths and counts are
# LEB128 varints; ints within 64 bits are zigzag varints, bigger ones their
# minimal two's-complement bytes; floats their 8 IEEE-754 bytes (little-endian).
# Only exact types are written, so a record reads back as the same types: a
# tuple stays a tuple, a list a list, True is not 1. Reading builds nothing but
# these builtins and calls no code the sender could choose, so bytes from
# another process are safe to decode; anything malformed is a CorruptRecordError.

cdef enum:
    S_NONE = 0
    S_FALSE = 1
    S_TRUE = 2
    S_INT = 3
    S_BIGINT = 4
    S_FLOAT = 5
    S_STR = 6
    S_BYTES = 7
    S_TUPLE = 8
    S_LIST = 9
    S_DICT = 10
    # deeper is almost surely a container holding itself; it also bounds the
    # C stack the recursive encoder and decoder use
    STRUCT_MAX_DEPTH = 100

STRUCT_TYPES = "None, bool, int, float, str, bytes and tuples, lists and dicts of them"


cdef int _pb_grow(Packbuf *b, size_t need) except -1:
    cdef size_t cap = b.cap if b.cap else 256
    cdef char *p
    while cap - b.len < need:
        cap *= 2
    p = <char *>PyMem_Realloc(b.p, cap)
    if p is NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int _pb_reserve(Packbuf *b, size_t need) except -1:
    if b.cap - b.len < need:
        return _pb_grow(b, need)
    return 0


cdef inline void _pb_head(Packbuf *b, unsigned char tag, uint64_t v) noexcept:
    # the caller reserved 11 bytes: the tag and a varint of at most 10
    b.p[b.len] = <char>tag
    b.len += 1
    while v >= 0x80:
        b.p[b.len] = <char>((v & 0x7f) | 0x80)
        b.len += 1
        v >>= 7
    b.p[b.len] = <char>v
    b.len += 1


cdef str _type_name(object o):
    t = type(o)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


cdef object _struct_refusal(object o):
    return _errors.RecordTypeError(
        f"a struct record cannot hold a {_type_name(o)}: it carries {STRUCT_TYPES}, exact types only, "
        "so that every record reads back as it was written; declare kind='pickle' for other objects "
        "(in one process, or across processes with allow_pickle=True)")


cdef object _too_deep():
    return _errors.RecordTypeError(
        f"a struct record nested deeper than {STRUCT_MAX_DEPTH} levels (a container that holds itself?)")


cdef int _pack_bigint(Packbuf *b, object o) except -1:
    data = o.to_bytes((o.bit_length() + 8) >> 3, "little", signed=True)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    _pb_reserve(b, 11 + <size_t>n)
    _pb_head(b, S_BIGINT, <uint64_t>n)
    memcpy(b.p + b.len, PyBytes_AS_STRING(data), n)
    b.len += n
    return 0


cdef int _pack(Packbuf *b, object o, int depth) except -1:
    cdef type t = type(o)
    cdef long long v
    cdef int overflow = 0
    cdef Py_ssize_t n, i, pos = 0
    cdef const char *s
    cdef double d
    cdef uint64_t bits
    cdef PyObject *k
    cdef PyObject *val
    if t is str:
        s = PyUnicode_AsUTF8AndSize(o, &n)
        _pb_reserve(b, 11 + <size_t>n)
        _pb_head(b, S_STR, <uint64_t>n)
        memcpy(b.p + b.len, s, n)
        b.len += n
        return 0
    if t is int:
        v = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow:
            return _pack_bigint(b, o)
        _pb_reserve(b, 11)
        _pb_head(b, S_INT, (<uint64_t>v << 1) ^ <uint64_t>(v >> 63))
        return 0
    if t is tuple or t is list or t is dict:
        if depth >= STRUCT_MAX_DEPTH:
            raise _too_deep()
        _pb_reserve(b, 11)
        # Only exact builtins are visited below, so no Python code runs that
        # could change a container while it is being written.
        if t is tuple:
            n = PyTuple_GET_SIZE(o)
            _pb_head(b, S_TUPLE, <uint64_t>n)
            for i in range(n):
                _pack(b, <object>PyTuple_GET_ITEM(o, i), depth + 1)
        elif t is list:
            n = PyList_GET_SIZE(o)
            _pb_head(b, S_LIST, <uint64_t>n)
            for i in range(n):
                _pack(b, <object>PyList_GET_ITEM(o, i), depth + 1)
        else:
            _pb_head(b, S_DICT, <uint64_t>PyDict_Size(o))
            while PyDict_Next(o, &pos, &k, &val):
                _pack(b, <object>k, depth + 1)
                _pack(b, <object>val, depth + 1)
        return 0
    if t is float:
        d = PyFloat_AS_DOUBLE(o)
        memcpy(&bits, &d, 8)
        _pb_reserve(b, 9)
        b.p[b.len] = <char>S_FLOAT
        fb_store_le64(b.p + b.len + 1, bits)
        b.len += 9
        return 0
    if o is None or t is bool:
        _pb_reserve(b, 1)
        b.p[b.len] = <char>(S_NONE if o is None else S_TRUE if o is True else S_FALSE)
        b.len += 1
        return 0
    if t is bytes:
        n = PyBytes_GET_SIZE(o)
        _pb_reserve(b, 11 + <size_t>n)
        _pb_head(b, S_BYTES, <uint64_t>n)
        memcpy(b.p + b.len, PyBytes_AS_STRING(o), n)
        b.len += n
        return 0
    raise _struct_refusal(o)


cdef int _struct_fits(object o, int depth) except -1:
    """1 if ``_pack`` takes ``o`` (text that UTF-8 cannot encode aside), without encoding it."""
    cdef type t = type(o)
    cdef Py_ssize_t pos = 0
    cdef PyObject *k
    cdef PyObject *val
    if t is str or t is int or t is float or t is bytes or t is bool or o is None:
        return 1
    if t is tuple or t is list or t is dict:
        if depth >= STRUCT_MAX_DEPTH:
            return 0
        if t is dict:
            while PyDict_Next(o, &pos, &k, &val):
                if not _struct_fits(<object>k, depth + 1) or not _struct_fits(<object>val, depth + 1):
                    return 0
            return 1
        for item in o:
            if not _struct_fits(item, depth + 1):
                return 0
        return 1
    return 0


cdef object _corrupt(str what):
    return _errors.CorruptRecordError(f"corrupt struct record: {what}")


cdef int _read_varint(const char **pp, const char *end, uint64_t *out) except -1:
    cdef const char *p = pp[0]
    cdef uint64_t v = 0, c
    cdef int shift = 0
    while True:
        if p >= end:
            raise _corrupt("it ends inside a number")
        c = <unsigned char>p[0]
        p += 1
        if shift == 63 and c > 1:
            raise _corrupt("a number does not fit 64 bits")
        v |= (c & 0x7f) << shift
        if c < 0x80:
            break
        shift += 7
    pp[0] = p
    out[0] = v
    return 0


cdef Py_ssize_t _read_len(const char **pp, const char *end, Py_ssize_t unit) except -1:
    """A length or count; ``unit`` is the fewest bytes each unit takes, so a
    count can be refused before anything is allocated for it."""
    cdef uint64_t n
    _read_varint(pp, end, &n)
    if n > <uint64_t>((end - pp[0]) // unit):
        raise _corrupt(f"a length of {n} runs past the record's end")
    return <Py_ssize_t>n


cdef object _unpack(const char **pp, const char *end, int depth):
    cdef const char *p = pp[0]
    cdef unsigned char tag
    cdef uint64_t u
    cdef Py_ssize_t n, i
    cdef double d
    if p >= end:
        raise _corrupt("it ends where a value should start")
    tag = <unsigned char>p[0]
    pp[0] = p + 1
    if tag == S_STR:
        n = _read_len(pp, end, 1)
        p = pp[0]
        pp[0] = p + n
        try:
            return PyUnicode_DecodeUTF8(p, n, "strict")
        except UnicodeDecodeError as exc:
            raise _corrupt(f"text that is not UTF-8 ({exc.reason})") from None
    if tag == S_INT:
        _read_varint(pp, end, &u)
        return PyLong_FromLongLong(<long long>((u >> 1) ^ (0 - (u & 1))))
    if tag == S_TUPLE or tag == S_LIST or tag == S_DICT:
        if depth >= STRUCT_MAX_DEPTH:
            raise _corrupt(f"nested deeper than {STRUCT_MAX_DEPTH} levels")
        n = _read_len(pp, end, 2 if tag == S_DICT else 1)
        if tag == S_TUPLE:
            tup = PyTuple_New(n)
            for i in range(n):
                item = _unpack(pp, end, depth + 1)
                Py_INCREF(item)  # SET_ITEM steals it
                PyTuple_SET_ITEM(tup, i, item)
            return tup
        if tag == S_LIST:
            lst = PyList_New(n)
            for i in range(n):
                item = _unpack(pp, end, depth + 1)
                Py_INCREF(item)
                PyList_SET_ITEM(lst, i, item)
            return lst
        dct = {}
        for i in range(n):
            key = _unpack(pp, end, depth + 1)
            value = _unpack(pp, end, depth + 1)
            try:
                dct[key] = value
            except TypeError:
                raise _corrupt(f"a dict key of type {type(key).__name__} (not hashable)") from None
        return dct
    if tag == S_FLOAT:
        if end - pp[0] < 8:
            raise _corrupt("it ends inside a float")
        u = fb_load_le64(pp[0])
        pp[0] += 8
        memcpy(&d, &u, 8)
        return PyFloat_FromDouble(d)
    if tag == S_NONE:
        return None
    if tag == S_TRUE:
        return True
    if tag == S_FALSE:
        return False
    if tag == S_BYTES or tag == S_BIGINT:
        n = _read_len(pp, end, 1)
        p = pp[0]
        pp[0] = p + n
        data = PyBytes_FromStringAndSize(p, n)
        return data if tag == S_BYTES else int.from_bytes(data, "little", signed=True)
    raise _corrupt(f"unknown tag {tag:#04x}")


cdef object _unpack_record(const char *p, Py_ssize_t n):
    cdef const char *cur = p
    cdef const char *end = p + n
    obj = _unpack(&cur, end, 0)
    if cur != end:
        raise _corrupt(f"{end - cur} bytes follow the value")
    return obj


def pack_struct(obj):
    """Encode one struct record to ``bytes`` (RecordTypeError for what it cannot carry)."""
    cdef Packbuf b
    b.p = NULL
    b.len = b.cap = 0
    try:
        _pack(&b, obj, 0)
        return PyBytes_FromStringAndSize(b.p, <Py_ssize_t>b.len)
    finally:
        PyMem_Free(b.p)


def unpack_struct(data):
    """Decode one struct record from a bytes-like object (CorruptRecordError if malformed)."""
    cdef Py_buffer view
    if PyBytes_CheckExact(data):
        return _unpack_record(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _unpack_record(<const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


def pack_struct_batch(records):
    """``[pack_struct(r) for r in records]`` in one call; a bad record's error names its index."""
    cdef Packbuf b
    cdef list out = []
    cdef Py_ssize_t i = 0
    b.p = NULL
    b.cap = 0
    try:
        for i, rec in enumerate(records):
            b.len = 0
            _pack(&b, rec, 0)
            PyList_Append(out, PyBytes_FromStringAndSize(b.p, <Py_ssize_t>b.len))
    except (TypeError, ValueError) as exc:
        raise _at_index(exc, i, f"record {i} of the batch: {exc}") from exc
    finally:
        PyMem_Free(b.p)
    return out


def unpack_struct_batch(records):
    """``[unpack_struct(r) for r in records]`` in one call."""
    cdef list out = []
    for rec in records:
        PyList_Append(out, unpack_struct(rec))
    return out


def struct_fits(obj):
    """True when ``obj`` can be a struct record (checked without encoding it)."""
    return bool(_struct_fits(obj, 0))


cdef int _number_fits(int kind, object rec) except -1:
    # what the writer's PyLong_AsLongLong / PyFloat_AsDouble take (__index__, __float__)
    try:
        if kind == KIND_INT64:
            PyLong_AsLongLong(rec)
        else:
            PyFloat_AsDouble(rec)
    except Exception:
        return 0
    return 1


cdef inline int _fits(int kind, object rec) except -1:
    cdef type t = type(rec)
    cdef int overflow = 0
    if kind == KIND_INT64:
        if t is int:
            PyLong_AsLongLongAndOverflow(rec, &overflow)
            return overflow == 0
        if isinstance(rec, (float, bool)):
            return 0
        return _number_fits(kind, rec)
    if kind == KIND_FLOAT64:
        return 1 if t is float else _number_fits(kind, rec)
    if kind == KIND_STR:
        return isinstance(rec, str)
    if kind == KIND_BYTES:
        return t is bytes or (not isinstance(rec, str) and PyObject_CheckBuffer(rec))
    if kind == KIND_STRUCT:
        return _struct_fits(rec, 0)
    if kind == KIND_NUMBER:
        return t is int or t is float or _as_number(rec) is not None
    return 1


cdef object _as_number(object rec):
    """``rec`` as the exact int or float a number stream carries, for the
    other numbers that are plainly one of them (a float subclass such as
    np.float64, an IntEnum, NumPy integer and float scalars); None for
    anything else (bool, Decimal, Fraction, longdouble: no silent rounding)."""
    if isinstance(rec, bool):
        return None
    if isinstance(rec, float):
        return PyFloat_FromDouble(PyFloat_AsDouble(rec))
    if isinstance(rec, int):
        return int(rec)
    if isinstance(rec, np.integer) and not isinstance(rec, np.timedelta64):
        return int(rec)
    if isinstance(rec, np.floating) and (<object>rec).dtype.itemsize <= 8:
        return float(rec)
    return None


def first_misfit(list records, kind):
    """Index of the first record a stream of core ``kind`` cannot carry, or -1.
    It accepts what a RecordWriter of that kind accepts (text UTF-8 cannot
    encode and objects pickle refuses aside), for records that are handed on
    in the process without being written."""
    cdef int k = _kind_code(kind)
    cdef Py_ssize_t i, n = PyList_GET_SIZE(records)
    if k == KIND_PICKLE:
        return -1
    for i in range(n):
        if not _fits(k, <object>PyList_GET_ITEM(records, i)):
            return i
    return -1


def number_kind(list records):
    """The kind for a known list of records that a first int or float record
    would make ``number``: ``int64`` when every record is an int that fits 64
    bits, ``float64`` when every one is a float, ``number`` otherwise."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(records)
    cdef int ints = 0, floats = 0, overflow = 0
    cdef type t
    for i in range(n):
        rec = <object>PyList_GET_ITEM(records, i)
        t = type(rec)
        if t is int:
            PyLong_AsLongLongAndOverflow(rec, &overflow)
            if overflow:
                return "number"
            ints = 1
        elif t is float:
            floats = 1
        else:
            return "number"
        if ints and floats:
            return "number"
    return "float64" if floats else "int64"


def conform_batch(list records, kind):
    """``first_misfit``, and the records that fit but are not of the exact
    type a reader of the stream returns (an int or a NumPy scalar in a
    float64 stream, an ``np.int64`` in an int64 stream) replaced in
    ``records`` by that type: a record handed to a chained operator is then
    the value it would be after serialization, so chaining changes no value."""
    cdef int k = _kind_code(kind)
    cdef Py_ssize_t i, n = PyList_GET_SIZE(records)
    cdef int overflow = 0
    cdef type t
    if k == KIND_PICKLE:
        return -1
    if k == KIND_FLOAT64:
        for i in range(n):
            rec = <object>PyList_GET_ITEM(records, i)
            if type(rec) is not float:
                if not _fits(k, rec):
                    return i
                records[i] = PyFloat_FromDouble(PyFloat_AsDouble(rec))
        return -1
    if k == KIND_INT64:
        for i in range(n):
            rec = <object>PyList_GET_ITEM(records, i)
            t = type(rec)
            if t is int:
                PyLong_AsLongLongAndOverflow(rec, &overflow)
                if overflow:
                    return i
            elif not _fits(k, rec):
                return i
            else:
                records[i] = PyLong_FromLongLong(PyLong_AsLongLong(rec))
        return -1
    if k == KIND_NUMBER:
        for i in range(n):
            rec = <object>PyList_GET_ITEM(records, i)
            t = type(rec)
            if t is not int and t is not float:
                rec = _as_number(rec)
                if rec is None:
                    return i
                records[i] = rec
        return -1
    for i in range(n):
        if not _fits(k, <object>PyList_GET_ITEM(records, i)):
            return i
    return -1


cdef object _at_index(BaseException exc, Py_ssize_t i, str msg):
    """``exc`` again with ``msg``, and ``record_index`` for the caller to show the record."""
    try:
        new = type(exc)(msg)
    except Exception:  # e.g. UnicodeEncodeError takes 5 arguments
        new = (TypeError if isinstance(exc, TypeError) else ValueError)(msg)
    new.record_index = i
    return new


@cython.final
cdef class RecordWriter:
    """Serializes records into buffers of a LocalBufferPool and hands finished
    buffers to one BufferQueue per subpartition.

    A buffer is handed over when it is full, on ``flush()`` (the runtime calls
    it on the buffer timeout and before it idles) and before events. When the
    pool is dry the writer parks (GIL released) until the consumer recycles a
    buffer: that is the backpressure; the time is counted in
    ``backpressure_ns``.
    """

    def __cinit__(self, LocalBufferPool pool not None, queues, kind="bytes",
                  max_record_size=DEFAULT_MAX_RECORD_SIZE, request_timeout=None):
        queues = list(queues)
        if not queues:
            raise ValueError("a RecordWriter needs at least one subpartition queue")
        for q in queues:
            if not isinstance(q, BufferQueue):
                raise TypeError(f"queues must be BufferQueues, got {type(q).__name__}")
            if (<BufferQueue>q).network_pool is not pool.network_pool:
                raise ValueError("queues must belong to the pool's NetworkBufferPool")
        if not isinstance(max_record_size, int) or not 0 < max_record_size < (1 << 32):
            raise ValueError(f"max_record_size must be in 1..2**32-1, got {max_record_size!r}")
        self.kind = _kind_code(kind)
        self.pool = pool
        self.p = pool.p
        self.a = pool.a
        if self.p is NULL:
            raise _errors.PoolDestroyedError("the LocalBufferPool was destroyed")
        self.queues = queues
        self.num_channels = len(queues)
        self.max_record_size = max_record_size
        self.request_timeout_ns = _timeout_ns(request_timeout, "request_timeout")
        self.builders = <Builder *>PyMem_Calloc(self.num_channels, sizeof(Builder))
        if self.builders is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef int i
        if self.builders is not NULL:
            for i in range(self.num_channels):
                if self.builders[i].active:
                    fb_pool_recycle(self.p, self.builders[i].seg)
            PyMem_Free(self.builders)
        PyMem_Free(self.pack.p)

    cdef int _new_segment(self, int ch, uint16_t type, uint32_t width) except -1:
        cdef uint32_t seg
        cdef int rc
        cdef int64_t t0
        cdef LocalBufferPool pool = self.pool
        if pool.p is NULL or pool._destroy_pending:  # destroyed: self.p may already be freed
            raise _errors.PoolDestroyedError("the writer's LocalBufferPool was destroyed")
        rc = fb_pool_request(self.p, &seg)
        if rc == FB_E_UNAVAILABLE:
            t0 = fb_monotonic_ns()
            pool._waiters += 1
            try:
                with nogil:
                    rc = pool.request_wait(&seg, self.request_timeout_ns)
            finally:
                pool.leave_wait()
            self.backpressure_ns += fb_monotonic_ns() - t0
            if rc == FB_E_CANCELLED and pool._destroy_pending:
                raise _errors.PoolDestroyedError("the writer's LocalBufferPool was destroyed while it waited")
        if rc != FB_OK:
            check(rc, "requesting an output buffer")
        cdef Builder *b = &self.builders[ch]
        b.seg = seg
        b.base = fb_segment_ptr(self.a, seg)
        b.pos = 0
        b.cap = <uint32_t>self.a.segment_size
        cdef uint32_t want = (<BufferQueue>self.queues[ch]).buffer_size
        if 0 < want < b.cap:
            b.cap = want    # buffer debloating: ship once the consumer's size is in
        b.type = type
        b.width = width
        b.active = 1
        return 0

    cdef int _finish(self, int ch) except -1:
        cdef Builder *b = &self.builders[ch]
        if not b.active:
            return 0
        b.active = 0
        if b.pos == 0:
            fb_pool_recycle(self.p, b.seg)
            return 0
        cdef fb_bufdesc d
        d.pool = self.p
        d.seg = b.seg
        d.size = b.pos
        d.width = b.width
        d.type = b.type
        d.flags = 0
        d.aux = 0
        cdef BufferQueue q = <BufferQueue>self.queues[ch]
        cdef int rc
        rc = q.push(&d, False)
        if rc != 0:
            fb_pool_recycle(self.p, d.seg)
            check(rc, "handing a buffer to its subpartition")
        self.buffers_out += 1
        return 0

    cdef int _copy_chunks(self, int ch, const char *src, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        cdef uint32_t k
        while n > 0:
            if not b.active:
                self._new_segment(ch, FB_DATA_RECORDS, 0)
                if b.cap < n:
                    # a debloated size never refuses or shreds a record: its
                    # buffer may hold up to the rest of it (one segment at most)
                    b.cap = <uint32_t>min(<uint64_t>n, self.a.segment_size)
            k = b.cap - b.pos
            if k > n:
                k = n
            memcpy(b.base + b.pos, src, k)
            b.pos += k
            src += k
            n -= k
            self._copied += k
            if b.pos == b.cap:
                self._finish(ch)
        return 0

    cdef int _write_span(self, int ch, const char *data, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        cdef char hdr[4]
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        if b.active and b.type != FB_DATA_RECORDS:
            self._finish(ch)
        fb_store_le32(hdr, n)
        self._copied = 0
        try:
            self._copy_chunks(ch, hdr, 4)
            self._copy_chunks(ch, data, n)
        except BaseException as exc:
            if self._copied:
                # Part of the record is already in buffers (maybe shipped): later
                # records would be read as its rest. Refuse them; end_input()
                # still works, so the consumer sees a truncated stream, not garbage.
                self._is_broken = True
                self.broken = (f"subpartition {ch} holds a half-written record ({self._copied} of "
                               f"{n + 4} bytes) after {type(exc).__name__}: {exc}; the writer cannot "
                               "take more records")
            raise
        self.records_out += 1
        self.bytes_out += n
        return 0

    cdef inline int _write_raw(self, int ch, const char *data, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        if b.active and b.type == FB_DATA_RECORDS and b.cap - b.pos > n + 4 and not self._is_broken:
            fb_store_le32(b.base + b.pos, n)
            memcpy(b.base + b.pos + 4, data, n)
            b.pos += n + 4
            self.records_out += 1
            self.bytes_out += n
            return 0
        return self._write_span(ch, data, n)

    cdef int _write_obj(self, int ch, object rec) except -1:
        cdef Py_buffer view
        cdef Py_ssize_t n
        cdef const char *p
        cdef char tmp[16]
        cdef long long iv
        cdef double dv
        cdef uint64_t bits
        cdef int overflow = 0
        if self.kind == KIND_BYTES:
            if PyBytes_CheckExact(rec):
                n = PyBytes_GET_SIZE(rec)
                if n > self.max_record_size:
                    self._too_large(n)
                return self._write_raw(ch, PyBytes_AS_STRING(rec), <uint32_t>n)
            if isinstance(rec, str):
                raise TypeError("a bytes stream got a str record; encode it or use kind='str'")
            PyObject_GetBuffer(rec, &view, PyBUF_SIMPLE)
            try:
                if view.len > self.max_record_size:
                    self._too_large(view.len)
                self._write_raw(ch, <const char *>view.buf, <uint32_t>view.len)
            finally:
                PyBuffer_Release(&view)
            return 0
        if self.kind == KIND_INT64:
            if isinstance(rec, float) or isinstance(rec, bool):
                raise TypeError(f"an int64 stream got a {type(rec).__name__} record")
            iv = PyLong_AsLongLong(rec)
            fb_store_le64(tmp, <uint64_t>iv)
            return self._write_raw(ch, tmp, 8)
        if self.kind == KIND_FLOAT64:
            dv = PyFloat_AsDouble(rec)
            memcpy(tmp, &dv, 8)
            return self._write_raw(ch, tmp, 8)
        if self.kind == KIND_STR:
            if not isinstance(rec, str):
                raise TypeError(f"a str stream got a {type(rec).__name__} record")
            p = PyUnicode_AsUTF8AndSize(rec, &n)
            if n > self.max_record_size:
                self._too_large(n)
            return self._write_raw(ch, p, <uint32_t>n)
        if self.kind == KIND_NUMBER:
            # an int that fits 64 bits as int64 writes it, a float and a larger
            # int as the struct codec does: exact types, any int size
            if type(rec) is not int and type(rec) is not float:
                num = _as_number(rec)
                if num is None:
                    raise TypeError(f"a number stream takes int and float records, got {type(rec).__name__}")
                rec = num
            if type(rec) is float:
                dv = PyFloat_AS_DOUBLE(rec)
                memcpy(&bits, &dv, 8)
                tmp[0] = <char>S_FLOAT
                fb_store_le64(tmp + 1, bits)
                return self._write_raw(ch, tmp, 9)
            iv = PyLong_AsLongLongAndOverflow(rec, &overflow)
            if not overflow:
                # 8 bytes, as int64 writes it: a float is 9 and a larger int at least 11
                fb_store_le64(tmp, <uint64_t>iv)
                return self._write_raw(ch, tmp, 8)
            self.pack.len = 0
            _pack(&self.pack, rec, 0)
            return self._write_raw(ch, self.pack.p, <uint32_t>self.pack.len)
        if self.kind == KIND_STRUCT:
            self.pack.len = 0
            _pack(&self.pack, rec, 0)
            if self.pack.len > self.max_record_size:
                self._too_large(self.pack.len)
            self._write_raw(ch, self.pack.p, <uint32_t>self.pack.len)
            if self.pack.cap > (1 << 20):
                # one huge record should not keep its scratch area for the writer's lifetime
                PyMem_Free(self.pack.p)
                self.pack.p = NULL
                self.pack.cap = 0
            return 0
        data = _pickle_dumps(rec, 5)
        n = PyBytes_GET_SIZE(data)
        if n > self.max_record_size:
            self._too_large(n)
        return self._write_raw(ch, PyBytes_AS_STRING(data), <uint32_t>n)

    def _too_large(self, Py_ssize_t n):
        raise _errors.RecordTooLargeError(
            f"record of {n} bytes exceeds max_record_size={self.max_record_size}")

    cdef int _channel(self, int ch) except -1:
        if not 0 <= ch < self.num_channels:
            raise IndexError(f"subpartition {ch} out of range (writer has {self.num_channels})")
        return ch

    def write(self, record):
        """Write one record to subpartition 0."""
        return self._write_obj(0, record)

    def write_to(self, record, int channel):
        """Write one record to ``channel``."""
        return self._write_obj(self._channel(channel), record)

    def write_batch(self, records, int channel=0):
        """Write a list of records to one subpartition in a single call.

        On a bad record the records before it are written, nothing of it is,
        and the error says which index failed."""
        self._channel(channel)
        return self._write_many(records, 0, channel, None)

    def write_batch_rebalance(self, records):
        """Round-robin over subpartitions, record by record (Flink's rebalance)."""
        return self._write_many(records, 1, 0, None)

    def write_batch_keyed(self, records, keys):
        """Send each record to ``stable_hash(key) % num_channels``."""
        return self._write_many(records, 2, 0, keys)

    def write_batch_broadcast(self, records):
        """Write every record to every subpartition."""
        return self._write_many(records, 3, 0, None)

    def write_batch_to(self, records, channels):
        """Write record i to subpartition ``channels[i]``."""
        return self._write_many(records, 4, 0, channels)

    cdef object _write_many(self, records, int mode, int channel, object keys):
        if not isinstance(records, list):
            records = list(records)
        cdef Py_ssize_t i = 0, n = PyList_GET_SIZE(records)
        cdef int ch = channel, j
        cdef int nch = self.num_channels
        if keys is not None:
            if not isinstance(keys, list):
                keys = list(keys)
            if len(keys) != n:
                raise ValueError(f"got {n} records but {len(keys)} keys/channels")
        try:
            for i in range(n):
                rec = <object>PyList_GET_ITEM(records, i)
                if mode == 1:
                    ch = self.rr_next
                    self.rr_next = ch + 1 if ch + 1 < nch else 0
                elif mode == 2:
                    ch = <int>(_stable_hash(<object>PyList_GET_ITEM(keys, i)) % <uint64_t>nch)
                elif mode == 4:
                    ch = self._channel(<object>PyList_GET_ITEM(keys, i))
                if mode == 3:
                    for j in range(nch):
                        self._write_obj(j, rec)
                else:
                    self._write_obj(ch, rec)
        except Exception as exc:
            if isinstance(exc, _errors.FlowBufError) and not isinstance(exc, (ValueError, TypeError)):
                raise  # no buffer / cancelled / destroyed: not about this record
            raise _at_index(exc, i, f"record {i} of the batch ({i} written before it): {exc}") from exc
        return n

    def write_array(self, arr, int channel=0):
        """Write the rows of a NumPy array (any fixed-width dtype, structured
        ones too) as fixed-width records: one memcpy per buffer, GIL released."""
        self._channel(channel)
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        a = np.ascontiguousarray(arr)
        cdef Py_ssize_t w = a.itemsize
        cdef Py_ssize_t count = a.size if a.ndim <= 1 else a.shape[0]
        if a.ndim > 1:
            w = a.itemsize * (a.size // a.shape[0]) if a.shape[0] else a.itemsize
        if w <= 0 or w > self.a.segment_size:
            raise ValueError(f"fixed-width record of {w} bytes does not fit a {self.a.segment_size} B segment; "
                             "use write_batch for variable-size records")
        cdef const unsigned char[::1] src = a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)
        cdef const char *p = <const char *>&src[0] if src.shape[0] else NULL
        cdef Builder *b = &self.builders[channel]
        cdef Py_ssize_t left = count, k
        while left > 0:
            if b.active and (b.type != FB_DATA_FIXED or b.width != w or b.cap - b.pos < w):
                self._finish(channel)
            if not b.active:
                self._new_segment(channel, FB_DATA_FIXED, <uint32_t>w)
                if b.cap < w:
                    b.cap = <uint32_t>w    # a debloated size still takes one row
            k = (b.cap - b.pos) // w
            if k > left:
                k = left
            with nogil:
                memcpy(b.base + b.pos, p, k * w)
            b.pos += <uint32_t>(k * w)
            p += k * w
            left -= k
            if b.cap - b.pos < w:
                self._finish(channel)
        self.records_out += count
        self.bytes_out += count * w
        return count

    def flush(self, int channel=-1):
        """Hand every partly filled buffer to its consumer now."""
        cdef int i
        if channel >= 0:
            self._finish(self._channel(channel))
        else:
            for i in range(self.num_channels):
                self._finish(i)

    def broadcast_event(self, int kind, long long aux=0, int flags=0, bint priority=False):
        """Flush, then send an event to every subpartition. A priority event
        (unaligned barrier) overtakes buffers already queued."""
        if self.ended:
            raise _errors.ChannelClosedError("end_input() was called: the subpartitions have ended")
        if not priority:
            self.flush()
        for q in self.queues:
            (<BufferQueue>q).push_event(kind, aux, flags, priority)

    def end_input(self):
        """Flush and send end-of-partition to every consumer."""
        if self.ended:
            return
        self.broadcast_event(EVT_END_OF_PARTITION)
        self.ended = True
        if not self._is_broken:
            # the same flag as a cut record: refuses writes at no cost on the fast path
            self._is_broken = True
            self.broken = "end_input() was called: the subpartitions have ended"

    def cancel(self):
        """Wake a writer parked on a dry pool or full queue; it raises CancelledError."""
        self.pool.cancel_waiters()
        for q in self.queues:
            (<BufferQueue>q).cancel()

    @property
    def pending_bytes(self):
        """Bytes written into buffers not yet handed over."""
        cdef int i
        cdef uint64_t t = 0
        for i in range(self.num_channels):
            if self.builders[i].active:
                t += self.builders[i].pos
        return t


@cython.final
cdef class RecordReader:
    """Reads records from an InputGate, one deserializer per channel.

    A record that lies inside one buffer is read in place: at least
    ``zero_copy_min`` bytes come back as a read-only memoryview over the
    segment (the segment is not recycled while the view lives), smaller ones as
    ``bytes`` because copying a few bytes costs less than creating a view. A
    record spanning buffers is assembled once into a new ``bytes``.
    """

    def __cinit__(self, gate, kind="bytes", zero_copy_min=DEFAULT_ZERO_COPY_MIN,
                  max_record_size=DEFAULT_MAX_RECORD_SIZE):
        if isinstance(gate, BufferQueue):
            gate = InputGate([gate])
        if not isinstance(gate, InputGate):
            raise TypeError(f"gate must be an InputGate or BufferQueue, got {type(gate).__name__}")
        if zero_copy_min < 0:
            raise ValueError(f"zero_copy_min must be >= 0, got {zero_copy_min}")
        self.gate = gate
        self.kind = _kind_code(kind)
        if not isinstance(max_record_size, int) or not 0 < max_record_size < (1 << 32):
            raise ValueError(f"max_record_size must be in 1..2**32-1, got {max_record_size!r}")
        self.zero_copy_min = zero_copy_min
        self.max_record_size = max_record_size
        self.nch = self.gate.num_channels
        q0 = self.gate.channels[0]
        self.arena_owner = (<BufferQueue>q0).network_pool
        for q in self.gate.channels:
            if (<BufferQueue>q).network_pool is not self.arena_owner:
                raise ValueError("all channels of a RecordReader's gate must share one NetworkBufferPool")
        self.a = self.arena_owner.a
        self.chs = <ChanState *>PyMem_Calloc(self.nch, sizeof(ChanState))
        self.recording = <unsigned char *>PyMem_Calloc(self.nch, 1)
        if self.chs is NULL or self.recording is NULL:
            raise MemoryError()
        self.cur_ch = -1
        self.recorded = [[] for _ in range(self.nch)]

    def __dealloc__(self):
        cdef int i
        cdef ChanState *c
        PyMem_Free(self.recording)
        if self.chs is NULL:
            return
        for i in range(self.nch):
            c = &self.chs[i]
            Py_XDECREF(c.partial)
            if c.has_cur:
                if c.cur_buf is not NULL:
                    Py_DECREF(<object>c.cur_buf)  # its dealloc recycles once views are gone
                elif c.cur.pool is not NULL:
                    fb_pool_recycle(c.cur.pool, c.cur.seg)
        PyMem_Free(self.chs)

    cdef int _release_current(self, ChanState *c) except -1:
        cdef PyObject *b = c.cur_buf
        c.has_cur = 0
        if b is not NULL:
            c.cur_buf = NULL
            (<Buffer>b).release_or_defer()
            Py_DECREF(<object>b)
        elif c.cur.pool is not NULL:
            fb_pool_recycle(c.cur.pool, c.cur.seg)
        else:
            self._replay_cur = None     # a replayed buffer: its bytes were the memory
        return 0

    cdef object _make(self, ChanState *c, const char *p, uint32_t n):
        cdef Buffer buf
        cdef double dv
        cdef uint64_t u
        if self.kind == KIND_BYTES:
            if n >= self.zero_copy_min and c.cur.pool is not NULL:
                if c.cur_buf is NULL:
                    buf = Buffer.wrap(&c.cur, self.arena_owner)
                    Py_INCREF(buf)
                    c.cur_buf = <PyObject *>buf
                return RecordView.memoryview_of(<Buffer>c.cur_buf, <char *>p, n)
            return PyBytes_FromStringAndSize(p, n)
        if self.kind == KIND_INT64:
            if n != 8:
                raise _errors.CorruptRecordError(f"int64 record of {n} bytes")
            return PyLong_FromLongLong(<long long>fb_load_le64(p))
        if self.kind == KIND_FLOAT64:
            if n != 8:
                raise _errors.CorruptRecordError(f"float64 record of {n} bytes")
            memcpy(&dv, p, 8)
            return PyFloat_FromDouble(dv)
        if self.kind == KIND_STR:
            return PyUnicode_DecodeUTF8(p, n, "strict")
        if self.kind == KIND_NUMBER:
            if n == 8:
                return PyLong_FromLongLong(<long long>fb_load_le64(p))
            if n == 9 and <unsigned char>p[0] == S_FLOAT:
                u = fb_load_le64(p + 1)
                memcpy(&dv, &u, 8)
                return PyFloat_FromDouble(dv)
            return _unpack_record(p, n)
        if self.kind == KIND_STRUCT:
            return _unpack_record(p, n)
        mv = PyMemoryView_FromMemory(<char *>p, n, 0x100)
        try:
            return _pickle_loads(mv)
        finally:
            mv.release()

    cdef int _check_len(self, uint32_t n) except -1:
        if n > self.max_record_size:
            raise _errors.CorruptRecordError(
                f"record length {n} exceeds max_record_size={self.max_record_size}")
        return 0

    cdef object _decode_one(self, ChanState *c):
        cdef uint32_t size = c.cur.size, rem, n, take
        cdef const char *p
        if c.pos >= size:
            return _NEED_MORE
        rem = size - c.pos
        if c.cur.type == FB_DATA_FIXED:
            n = c.cur.width
            if rem < n:
                raise _errors.CorruptRecordError(f"fixed-width buffer ends inside a {n}-byte record")
            p = c.base + c.pos
            c.pos += n
            return self._make(c, p, n)
        if c.partial is NULL and c.hdr_have == 0:
            if rem >= 4:
                n = fb_load_le32(c.base + c.pos)
                self._check_len(n)
                if rem - 4 >= n:
                    p = c.base + c.pos + 4
                    c.pos += 4 + n
                    return self._make(c, p, n)
                return self._start_partial(c, n, c.base + c.pos + 4, rem - 4)
            memcpy(c.hdr, c.base + c.pos, rem)
            c.hdr_have = rem
            c.pos = size
            return _NEED_MORE
        if c.hdr_have > 0:
            take = 4 - c.hdr_have
            if take > rem:
                take = rem
            memcpy(c.hdr + c.hdr_have, c.base + c.pos, take)
            c.hdr_have += take
            c.pos += take
            rem -= take
            if c.hdr_have < 4:
                return _NEED_MORE
            c.hdr_have = 0
            n = fb_load_le32(c.hdr)
            self._check_len(n)
            if rem >= n:
                p = c.base + c.pos
                c.pos += n
                return self._make(c, p, n)
            return self._start_partial(c, n, c.base + c.pos, rem)
        take = c.partial_len - c.partial_have
        if take > rem:
            take = rem
        memcpy(PyBytes_AS_STRING_raw(c.partial) + c.partial_have, c.base + c.pos, take)
        c.partial_have += take
        c.pos += take
        if c.partial_have < c.partial_len:
            return _NEED_MORE
        obj = <object>c.partial
        Py_DECREF(obj)  # drop the reference the state held; `obj` keeps one
        c.partial = NULL
        if self.kind == KIND_BYTES:
            return obj
        return self._make_from_assembled(obj)

    cdef object _start_partial(self, ChanState *c, uint32_t n, const char *src, uint32_t have):
        c.partial = PyBytes_FromStringAndSize_raw(NULL, n)
        memcpy(PyBytes_AS_STRING_raw(c.partial), src, have)
        c.partial_len = n
        c.partial_have = have
        c.pos = c.cur.size
        return _NEED_MORE

    cdef object _make_from_assembled(self, object b):
        # only for typed kinds: _make decodes them without looking at the channel
        cdef ChanState tmp
        tmp.cur_buf = NULL
        return self._make(&tmp, PyBytes_AS_STRING(b), <uint32_t>PyBytes_GET_SIZE(b))

    cdef int _next_buffer(self, int64_t timeout_ns) except -2:
        """Take the next buffer from the gate. Returns 1 with cur_ch set, 0 when
        nothing came (timeout, event pending, or all channels finished)."""
        cdef fb_bufdesc d
        cdef int ch = -1, rc
        cdef ChanState *c
        cdef InputGate gate = self.gate
        cdef int64_t deadline = fb_monotonic_ns() + timeout_ns if timeout_ns > 0 else -1
        while True:
            if self._event is not None or self.finished_count >= self.nch:
                return 0
            if self._replay:
                return self._next_replayed()
            rc = gate.poll(&d, &ch)
            if rc == FB_E_UNAVAILABLE and timeout_ns != 0:
                if deadline >= 0:
                    timeout_ns = deadline - fb_monotonic_ns()
                    if timeout_ns < 0:
                        timeout_ns = 0
                with nogil:
                    rc = gate.poll_wait(&d, &ch, timeout_ns)
            if rc == FB_E_UNAVAILABLE or rc == FB_E_TIMEOUT:
                return 0
            check(rc, "reading the input gate")
            c = &self.chs[ch]
            if d.type != FB_DATA_EVENT:
                if self.recording[ch]:
                    self._record(ch, &d)
                break
            if d.width != EVT_END_OF_PARTITION:
                self._event = (ch, d.width, d.aux, d.flags)
                self.event_mark = d.seg
                if self.recording[ch] and d.width != EVT_BARRIER and d.width != EVT_CANCEL_BARRIER:
                    self._record(ch, &d)
                return 0
            if c.partial is not NULL or c.hdr_have:
                raise _errors.CorruptRecordError(
                    f"channel {ch} ended inside a record (truncated stream)")
            if not c.finished:  # a repeated end-of-partition must not end another channel
                c.finished = 1
                self.finished_count += 1
            # one channel ended: go on with the others (the loop top stops after the last)
        self.buffers_in += 1
        self.bytes_in += d.size
        c.cur = d
        c.base = fb_segment_ptr(self.a, d.seg)
        c.pos = 0
        c.has_cur = 1
        c.cur_buf = NULL
        self.cur_ch = ch
        return 1

    cdef int _record(self, int ch, fb_bufdesc *d) except -1:
        """A copy of a buffer (or event) taken from a recorded channel: the
        segment is recycled as usual once read, the copy goes to the checkpoint."""
        cdef object payload = None
        if d.type != FB_DATA_EVENT:
            payload = PyBytes_FromStringAndSize(fb_segment_ptr(self.a, d.seg), d.size)
        (<list>self.recorded[ch]).append((d.type, d.width, d.flags, d.aux, payload))
        return 0

    cdef int _next_replayed(self) except -2:
        """The next item of in-flight input being replayed after a restore."""
        cdef int ch
        cdef ChanState *c
        ch, item = self._replay.popleft()
        dtype, width, flags, aux, payload = item
        if dtype == FB_DATA_EVENT:
            self._event = (ch, width, aux, flags)
            return 0
        c = &self.chs[ch]
        self._replay_cur = payload
        c.cur.pool = NULL
        c.cur.seg = 0
        c.cur.size = <uint32_t>len(payload)
        c.cur.width = width
        c.cur.type = dtype
        c.cur.flags = flags
        c.cur.aux = aux
        c.base = PyBytes_AS_STRING(payload)
        c.pos = 0
        c.has_cur = 1
        c.cur_buf = NULL
        self.buffers_in += 1
        self.bytes_in += c.cur.size
        self.cur_ch = ch
        return 1

    # ---- unaligned checkpoints ----
    def poll_priority(self):
        """Take an event from a priority lane now, leaving all data where it
        is: a task waiting for output buffers (backpressure) still takes an
        overtaking barrier. ``(channel, kind, aux, flags)`` or None."""
        cdef fb_bufdesc d
        cdef int ch
        cdef InputGate gate = self.gate
        if self._event is not None or self._replay:
            return None
        for ch in range(self.nch):
            if gate.poll_priority(&d, ch) == FB_OK:
                if d.type != FB_DATA_EVENT:
                    raise _errors.CorruptRecordError(f"a data buffer in the priority lane of channel {ch}")
                self.event_mark = d.seg
                return (ch, d.width, d.aux, d.flags)
        return None

    def start_recording(self, int ch):
        """Record a copy of every buffer (and event) taken from ``ch`` from now
        on: in-flight input of an unaligned checkpoint."""
        self._ch_index(ch)
        self.recording[ch] = 1

    def stop_recording(self, int ch):
        """Stop recording ``ch``; returns what was recorded, in order."""
        self._ch_index(ch)
        self.recording[ch] = 0
        out = self.recorded[ch]
        self.recorded[ch] = []
        return out

    def is_recording(self, int ch):
        return bool(self.recording[self._ch_index(ch)])

    def unread_prefix(self, int ch):
        """What this reader took from ``ch`` but has not handed out yet, as one
        data item (or None): the start of a record that spans buffers, or the
        rest of a buffer left after a batch ended mid-buffer. After a restore
        it is read again first, so a record cut by the snapshot is whole."""
        cdef ChanState *c = &self.chs[self._ch_index(ch)]
        cdef bytes data
        if c.partial is not NULL:
            data = (<uint32_t>c.partial_len).to_bytes(4, "little") + \
                PyBytes_FromStringAndSize(PyBytes_AS_STRING(<object>c.partial), c.partial_have)
        elif c.hdr_have:
            data = PyBytes_FromStringAndSize(c.hdr, c.hdr_have)
        elif self.cur_ch == ch and c.has_cur and c.pos < c.cur.size:
            data = PyBytes_FromStringAndSize(c.base + c.pos, c.cur.size - c.pos)
            return (c.cur.type, c.cur.width, 0, 0, data)
        else:
            return None
        return (FB_DATA_RECORDS, 0, 0, 0, data)

    def replay(self, items):
        """In-flight input to read before anything from the gate: an iterable
        of ``(channel, (type, width, flags, aux, payload))`` in order."""
        import collections
        for ch, item in items:
            self._ch_index(ch)
            if item[0] != FB_DATA_EVENT and not isinstance(item[4], bytes):
                raise TypeError("a replayed data item needs bytes as its payload")
        if self._replay is None:
            self._replay = collections.deque()
        self._replay.extend(items)

    def take_over(self, RecordReader old not None):
        """Carry recording and replay state over from the reader this one
        replaces (nothing was decoded by the old one)."""
        if old.nch != self.nch:
            raise ValueError("readers of different gates")
        memcpy(self.recording, old.recording, self.nch)
        self.recorded = old.recorded
        old.recorded = [[] for _ in range(old.nch)]
        self._replay, old._replay = old._replay, None

    @property
    def replaying(self):
        return bool(self._replay) or self._replay_cur is not None

    cdef int _ch_index(self, int ch) except -1:
        if not 0 <= ch < self.nch:
            raise IndexError(f"channel {ch} out of range (reader has {self.nch})")
        return ch

    cdef object _next_record(self, int64_t timeout_ns):
        """A record, or _NEED_MORE when none is available within the timeout."""
        cdef ChanState *c
        cdef int64_t deadline = -1
        while True:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = self._decode_one(c)
                if rec is not _NEED_MORE:
                    self.records_in += 1
                    if c.pos >= c.cur.size:
                        # consumed: give the segment back now, not at the next read
                        self._release_current(c)
                        self.cur_ch = -1
                    return rec
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(timeout_ns):
                return _NEED_MORE

    def poll(self):
        """The next record if one is available now, else None."""
        rec = self._next_record(0)
        return None if rec is _NEED_MORE else rec

    def read(self, timeout=None):
        """The next record, waiting up to ``timeout`` s (None: until one comes).
        Returns None on timeout, at an event (see ``take_event``) and at the end."""
        rec = self._next_record(_timeout_ns(timeout))
        return None if rec is _NEED_MORE else rec

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            rec = self._next_record(-1)
            if rec is not _NEED_MORE:
                return rec
            if self.finished_count >= self.nch:
                raise StopIteration
            if self._event is not None:
                self._event = None  # plain iteration skips events

    def read_batch(self, Py_ssize_t max_records=4096, timeout=None):
        """Up to ``max_records`` records in one call. Blocks (GIL released) for
        the first one up to ``timeout`` s; returns early, possibly empty, at an
        event or the end of input."""
        cdef list out = []
        cdef int64_t t = _timeout_ns(timeout)
        cdef ChanState *c
        while PyList_GET_SIZE(out) < max_records:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = self._decode_one(c)
                if rec is not _NEED_MORE:
                    PyList_Append(out, rec)
                    if c.pos < c.cur.size:
                        continue
                    rec = _NEED_MORE
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(0 if PyList_GET_SIZE(out) else t):
                break
        self.records_in += PyList_GET_SIZE(out)
        return out

    def read_array(self, dtype, timeout=None):
        """The rest of the next fixed-width buffer as a read-only NumPy view
        (zero copy; the segment is held until the array is gone). None on
        timeout, at an event or at the end."""
        cdef cnp.dtype dt = dtype if type(dtype) is not type and isinstance(dtype, np.dtype) else np.dtype(dtype)
        cdef ChanState *c
        cdef int64_t t = _timeout_ns(timeout)
        cdef Buffer buf
        while True:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                if c.pos < c.cur.size:
                    break
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(t):
                return None
        if c.cur.type != FB_DATA_FIXED:
            raise TypeError("read_array() got a buffer of variable-size records; use read_batch()")
        if c.cur.width != dt.itemsize:
            raise ValueError(f"buffer holds {c.cur.width}-byte records, dtype {dt} has itemsize {dt.itemsize}")
        if c.cur.pool is NULL:      # replayed after a restore: over its bytes
            arr = np.frombuffer(self._replay_cur, dtype=dt, offset=c.pos)
            self.records_in += arr.shape[0]
            c.pos = c.cur.size
            self._release_current(c)
            self.cur_ch = -1
            return arr
        if c.cur_buf is NULL:
            buf = Buffer.wrap(&c.cur, self.arena_owner)
            Py_INCREF(buf)
            c.cur_buf = <PyObject *>buf
        # A NumPy array straight over the segment, its base the view that keeps
        # the segment from being recycled: no memoryview, no np.frombuffer.
        rv = RecordView.new(<Buffer>c.cur_buf, c.base + c.pos, c.cur.size - c.pos)
        cdef cnp.npy_intp dims[1]
        dims[0] = (c.cur.size - c.pos) // c.cur.width
        Py_INCREF(dt)  # NewFromDescr steals a reference
        arr = PyArray_NewFromDescr(<PyTypeObject *>np.ndarray, dt, 1, dims, NULL, c.base + c.pos, 0, None)
        Py_INCREF(rv)  # SetBaseObject steals one too
        cnp.PyArray_SetBaseObject(arr, rv)
        self.records_in += (c.cur.size - c.pos) // c.cur.width
        c.pos = c.cur.size
        self._release_current(c)
        self.cur_ch = -1
        return arr

    def set_kind(self, kind):
        """Set the record kind before the first record is decoded (the runtime
        learns an inferred kind from the producer)."""
        self.kind = _kind_code(kind)

    def take_event(self):
        """The pending event as ``(channel, kind, aux, flags)``, or None."""
        ev = self._event
        self._event = None
        return ev

    @property
    def finished(self):
        """True once every channel delivered end-of-partition."""
        return self.finished_count >= self.nch

    @property
    def channels_finished(self):
        return tuple(bool(self.chs[i].finished) for i in range(self.nch))

    @property
    def num_channels(self):
        return self.nch

    def channel_finished(self, int ch):
        """True once channel ``ch`` delivered end-of-partition: barrier
        alignment waits for no barrier from a channel that has ended."""
        if not 0 <= ch < self.nch:
            raise IndexError(f"channel {ch} out of range (reader has {self.nch})")
        return bool(self.chs[ch].finished)

    @property
    def held_buffers(self):
        """Buffers this reader holds (current ones, views not counted)."""
        return sum(1 for i in range(self.nch) if self.chs[i].has_cur)
