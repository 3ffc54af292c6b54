# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the
# stable key hash of key partitioning. Uses the cimports at the top of serde.pyx.

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


def stable_hash(key):
    """The process-independent hash used for key partitioning: the same in every
    process and run, and equal for keys that compare equal (1, 1.0 and True).
    Keys of other types than None, bool, int, float, str, bytes (bytearray,
    memoryview), tuple and frozenset raise KeyTypeError."""
    return _stable_hash(key)


cdef int _check_groups(long long max_parallelism, long long parallelism) except -1:
    if max_parallelism <= 0 or max_parallelism > 0xFFFFFFFF:
        raise ValueError(f"max_parallelism must be > 0 (the number of key groups), got {max_parallelism}")
    if parallelism <= 0 or parallelism > max_parallelism:
        raise ValueError(f"parallelism must be in 1..max_parallelism={max_parallelism} (each subtask owns "
                         f"at least one key group), got {parallelism}")
    return 0


def key_group(key, long long max_parallelism):
    """The key group of ``key``: ``stable_hash(key) % max_parallelism``."""
    _check_groups(max_parallelism, 1)
    return fb_key_group(_stable_hash(key), <uint32_t>max_parallelism)


def key_groups(keys, long long max_parallelism):
    """``[key_group(k, max_parallelism) for k in keys]`` in one call: the
    key group of each key (checkpoints split keyed state by it)."""
    _check_groups(max_parallelism, 1)
    cdef uint32_t m = <uint32_t>max_parallelism
    return [fb_key_group(_stable_hash(k), m) for k in keys]


def key_group_owner(long long max_parallelism, long long parallelism, long long group):
    """The subtask of ``parallelism`` that owns key group ``group``: the
    channel ``RecordWriter.write_batch_keyed`` sends the group's keys to
    (``group * parallelism // max_parallelism``, Flink's
    computeOperatorIndexForKeyGroup)."""
    _check_groups(max_parallelism, parallelism)
    if not 0 <= group < max_parallelism:
        raise ValueError(f"key group {group} is outside 0..{max_parallelism - 1}")
    return fb_key_group_owner(<uint32_t>group, <uint32_t>parallelism, <uint32_t>max_parallelism)


def key_group_range(long long max_parallelism, long long parallelism, long long index):
    """The key groups subtask ``index`` of ``parallelism`` owns, ``(start,
    end)``: exactly the groups ``g`` with ``key_group_owner(max_parallelism,
    parallelism, g) == index``."""
    _check_groups(max_parallelism, parallelism)
    if not 0 <= index < parallelism:
        raise ValueError(f"subtask index {index} is outside 0..{parallelism - 1}")
    return (fb_key_group_range_start(<uint32_t>index, <uint32_t>parallelism, <uint32_t>max_parallelism),
            fb_key_group_range_start(<uint32_t>index + 1, <uint32_t>parallelism, <uint32_t>max_parallelism))
