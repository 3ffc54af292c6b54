# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the
# timestamps of a batch on a timestamped stream. They travel beside the
# records as one ``array('d')`` per batch (no Python float per record); these
# helpers derive the times of an operator's output from its input's in one C
# loop, where an operator does not emit exactly one record per input.

from cpython cimport array as carray
import array as _array_mod
from numbers import Real as _Real

cdef carray.array _TS_TEMPLATE = _array_mod.array("d")


cdef carray.array _ts_array(const double *src, Py_ssize_t n):
    """A new array('d') of the ``n`` doubles at ``src``."""
    cdef carray.array out = carray.clone(_TS_TEMPLATE, n, False)
    if n:
        memcpy(out.data.as_doubles, src, n * sizeof(double))
    return out


def ts_select(timestamps, list mask):
    """The times of the records a filter keeps: ``timestamps[i]`` for each
    ``i`` with a true ``mask[i]``, as an array('d').

    Example::

        ts_select(array('d', [1, 2, 3]), [True, False, 1])     # array('d', [1.0, 3.0])
    """
    cdef const double[::1] src = timestamps
    cdef Py_ssize_t n = PyList_GET_SIZE(mask), i, k = 0
    if src.shape[0] != n:
        raise ValueError(f"{src.shape[0]} timestamps but a mask of {n}")
    cdef carray.array out = carray.clone(_TS_TEMPLATE, n, False)
    cdef double *dst = out.data.as_doubles
    for i in range(n):
        m = <object>PyList_GET_ITEM(mask, i)
        if m is True or (m is not False and m):
            dst[k] = src[i]
            k += 1
    carray.resize(out, k)
    return out


def ts_repeat(timestamps, list counts):
    """The times of a flat_map's output: ``timestamps[i]`` repeated
    ``counts[i]`` times, in order, as an array('d').

    Example::

        ts_repeat(array('d', [1, 2]), [2, 0])      # array('d', [1.0, 1.0])
    """
    cdef const double[::1] src = timestamps
    cdef Py_ssize_t n = PyList_GET_SIZE(counts), i, j, c, total = 0, k = 0
    if src.shape[0] != n:
        raise ValueError(f"{src.shape[0]} timestamps but {n} counts")
    for i in range(n):
        c = <Py_ssize_t>PyLong_AsLongLong(<object>PyList_GET_ITEM(counts, i))
        if c < 0:
            raise ValueError(f"a negative count: {c}")
        total += c
    cdef carray.array out = carray.clone(_TS_TEMPLATE, total, False)
    cdef double *dst = out.data.as_doubles
    cdef double t
    for i in range(n):
        c = <Py_ssize_t>PyLong_AsLongLong(<object>PyList_GET_ITEM(counts, i))
        t = src[i]
        for j in range(c):
            dst[k] = t
            k += 1
    return out


def ts_fill(double value, Py_ssize_t n):
    """``n`` times ``value``, as an array('d'): the time of every record one
    window firing (or one call) emits.

    Example::

        ts_fill(59.999, 3)       # array('d', [59.999, 59.999, 59.999])
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cdef carray.array out = carray.clone(_TS_TEMPLATE, n, False)
    cdef double *dst = out.data.as_doubles
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = value
    return out


def ts_apply(fn, list batch):
    """``fn(record)`` of each record of ``batch`` as an array('d'), and the
    highest of them (NaN if one is NaN): what an assigner makes of a batch,
    in one C loop. A time that is no real number (a datetime) raises
    TypeError: the caller converts those one by one.

    Example::

        ts_apply(lambda r: r[1], [("a", 2.0), ("b", 1)])    # (array('d', [2.0, 1.0]), 2.0)
    """
    cdef Py_ssize_t i, n = PyList_GET_SIZE(batch)
    cdef carray.array out = carray.clone(_TS_TEMPLATE, n, False)
    cdef double *dst = out.data.as_doubles
    cdef double high = -INFINITY, t
    cdef bint nan = False
    for i in range(n):
        v = fn(<object>PyList_GET_ITEM(batch, i))
        if type(v) is float:
            t = PyFloat_AS_DOUBLE(v)
        elif type(v) is int:
            t = PyFloat_AsDouble(v)
        elif isinstance(v, _Real) and not isinstance(v, bool):
            t = PyFloat_AsDouble(v)     # NumPy numbers; not datetime64, whose float() is in its unit
        else:
            raise TypeError(f"a timestamp of {type(v).__name__}")
        dst[i] = t
        if t != t:
            nan = True
        elif t > high:
            high = t
    return out, (float("nan") if nan else high)


def ts_max(timestamps):
    """The highest of a batch's times, NaN if any is NaN (-inf for none): an
    assigner's watermark and its check for records without a time, in one
    C loop.

    Example::

        ts_max(array('d', [3.0, 1.0]))      # 3.0
    """
    cdef const double[::1] src = timestamps
    cdef Py_ssize_t i, n = src.shape[0]
    cdef double high = -INFINITY, t
    for i in range(n):
        t = src[i]
        if t != t:
            return t
        if t > high:
            high = t
    return high
