# Part of serde.pyx (included; one module, pyflowbuf._core.serde): record
# kinds and the checks of what a stream of a kind carries (number_kind,
# conform_batch, first_misfit). Uses the cimports at the top of serde.pyx.

KINDS = {"bytes": KIND_BYTES, "int64": KIND_INT64, "float64": KIND_FLOAT64,
         "str": KIND_STR, "pickle": KIND_PICKLE, "struct": KIND_STRUCT, "number": KIND_NUMBER}
_KIND_NAMES = {v: k for k, v in KINDS.items()}


cdef int _kind_code(object kind) except -1:
    if isinstance(kind, int) and kind in _KIND_NAMES:
        return kind
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}") from None


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
