# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the struct
# codec (records of builtins). Uses the cimports at the top of serde.pyx.

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
