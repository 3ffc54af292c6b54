"""The state value codec: a value as a MessagePack tree plus out-of-band buffers.

Value tree
==========
Plain MessagePack for None, bool, int (64-bit), float (64-bit), str (UTF-8;
lone surrogates are kept with "surrogatepass"), bytes (bin), list (array) and
dict (map; keys may be any encodable hashable value, insertion order kept).
Exact types only: subclasses (IntEnum, namedtuple, defaultdict...) are not plain
data. Everything else is a MessagePack extension type:

====  ===========  ===========================================================
code  type         ext payload
====  ===========  ===========================================================
1     tuple        MessagePack array of the items (encoded by these rules)
2     set          array
3     frozenset    array
4     int          beyond 64 bits: big-endian two's complement
5     complex      two float64 (real, imag)
7     numpy array  [descr, shape, fortran_order, data]; descr as in the .npy
                   format (numpy.lib.format.dtype_to_descr), data is bin
                   (small arrays) or the index of an out-of-band buffer
8     numpy scalar [descr, raw bytes]
9     RecordBatch  index of a buffer holding an Arrow IPC stream of one batch
10    Arrow Table  index of a buffer holding an Arrow IPC stream
64    pickled      [qualified type name, pickle bytes]; written and read only
                   with ``allow_pickle=True``
====  ===========  ===========================================================

bytearrays and memoryviews are written as bytes (msgpack packs bytearray
itself) and come back as bytes. Object arrays and NumPy's StringDType hold
pointers, so they count as not plain. Shared references are not preserved (an
object reachable twice is written twice).

Safety: restoring never runs code that the file chose. Without
``allow_pickle=True`` a pickled value is refused before anything is unpickled
(``PickleNotAllowedError``), dtypes that would hold pointers are refused, and
Arrow data is fully validated.

``encode_value`` / ``decode_value`` turn a value into an ``EncodedValue`` and
back; ``pyflowbuf.checkpoint.container`` lays it out in a value section.
"""
from __future__ import annotations

import math
import pickle
import re
import reprlib
import struct
from dataclasses import dataclass

import msgpack
import numpy as np
from numpy.lib import format as _npformat

from pyflowbuf.checkpoint.errors import (CheckpointError, CorruptCheckpointError, PickleNotAllowedError,
                                         UnsupportedStateError, _Corrupt)

# Arrays smaller than this go inline in the tree; an out-of-band buffer costs a
# 16-byte table entry plus alignment padding.
INLINE_MAX = 4096
# Each extension level is a Python call on both sides; bounding it keeps a hostile
# file from exhausting the interpreter stack and guarantees that whatever was
# written can be read back.
MAX_EXT_DEPTH = 100

EXT_TUPLE, EXT_SET, EXT_FROZENSET, EXT_BIGINT, EXT_COMPLEX = 1, 2, 3, 4, 5  # 6 is reserved
EXT_NDARRAY, EXT_NPSCALAR, EXT_ARROW_BATCH, EXT_ARROW_TABLE, EXT_PICKLE = 7, 8, 9, 10, 64

PLAIN_TYPES = ("None, bool, int, float, complex, str, bytes, tuple, list, dict, "
               "set, frozenset, NumPy arrays and scalars, Arrow RecordBatch and Table")


def _byte_view(obj) -> memoryview:
    """A flat unsigned-byte view of a contiguous buffer, without copying."""
    mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if mv.nbytes == 0:
        return memoryview(b"")
    return mv.cast("B")


def _type_name(obj) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _dtype_is_plain(dt: np.dtype) -> bool:
    if dt.hasobject:
        return False
    if dt.fields is not None:
        return all(_dtype_is_plain(f[0]) for f in dt.fields.values())
    if dt.subdtype is not None:
        return _dtype_is_plain(dt.subdtype[0])
    return dt.kind in "biufcmMSUV"


def _locate(root, target, path="state", depth=0):
    """Where ``target`` sits inside ``root``, for error messages only."""
    if root is target:
        return path
    if depth > MAX_EXT_DEPTH:
        return None
    t = type(root)
    if t is dict:
        for k, v in root.items():
            if k is target:
                return f"{path} (key {reprlib.repr(k)})"
            found = _locate(v, target, f"{path}[{reprlib.repr(k)}]", depth + 1)
            if found:
                return found
    elif t is list or t is tuple:
        for i, v in enumerate(root):
            found = _locate(v, target, f"{path}[{i}]", depth + 1)
            if found:
                return found
    elif t is set or t is frozenset:
        for v in root:
            found = _locate(v, target, f"{path}{{...}}", depth + 1)
            if found:
                return found
    return None


class _Unsupported(Exception):
    """Raised inside msgpack's default hook; turned into UnsupportedStateError
    with the value's path once msgpack has unwound."""

    def __init__(self, obj, why=None):
        super().__init__(obj)
        self.obj = obj
        self.why = why


@dataclass
class EncodedValue:
    """A value encoded for a value section: the MessagePack tree and the
    out-of-band buffers it refers to (views over the original memory)."""

    tree: bytes
    buffers: list
    pickled: list  # type names of the pickled objects, in encounter order

    @property
    def nbytes(self) -> int:
        return len(self.tree) + sum(b.nbytes for b in self.buffers)


class _Encoder:
    def __init__(self, allow_pickle: bool):
        self.allow_pickle = allow_pickle
        self.buffers: list[memoryview] = []
        self.pickled: list[str] = []
        # A Packer is busy while its default hook runs, so each extension
        # nesting level packs its payload with its own Packer.
        self._packers: list[msgpack.Packer] = []
        self._depth = 0

    def _packer(self, depth):
        while len(self._packers) <= depth:
            self._packers.append(msgpack.Packer(
                default=self._default, use_bin_type=True, strict_types=True, datetime=False,
                unicode_errors="surrogatepass"))
        return self._packers[depth]

    def encode(self, value) -> EncodedValue:
        try:
            tree = self._packer(0).pack(value)
        except _Unsupported as e:
            obj = e.obj
            where = _locate(value, obj) or "state"
            tname = _type_name(obj)
            if e.why:
                msg = f"cannot snapshot {where}: {e.why}"
            else:
                msg = (f"cannot snapshot {where}: {tname} is not plain data ({PLAIN_TYPES}); "
                       f"convert it, or open the storage with allow_pickle=True (restoring it then "
                       f"unpickles, which runs code named in the checkpoint)")
            raise UnsupportedStateError(msg, type_name=tname, where=where) from e.__cause__
        except (ValueError, RecursionError) as e:  # msgpack's nesting limit
            raise UnsupportedStateError(f"cannot snapshot state: {e}") from e
        return EncodedValue(tree, self.buffers, self.pickled)

    def _nested(self, value) -> bytes:
        depth = self._depth + 1
        if depth > MAX_EXT_DEPTH:
            raise _Unsupported(value, f"tuples/sets/arrays nest deeper than {MAX_EXT_DEPTH} levels")
        self._depth = depth
        try:
            return self._packer(depth).pack(value)
        finally:
            self._depth = depth - 1

    def _oob(self, view: memoryview) -> int:
        self.buffers.append(view)
        return len(self.buffers) - 1

    def _default(self, obj):
        t = type(obj)
        if t is tuple:
            return msgpack.ExtType(EXT_TUPLE, self._nested(list(obj)))
        if t is int:  # msgpack calls back only for ints beyond 64 bits
            return msgpack.ExtType(EXT_BIGINT, obj.to_bytes(obj.bit_length() // 8 + 1, "big", signed=True))
        if t is set:
            return msgpack.ExtType(EXT_SET, self._nested(list(obj)))
        if t is frozenset:
            return msgpack.ExtType(EXT_FROZENSET, self._nested(list(obj)))
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, struct.pack("<dd", obj.real, obj.imag))
        if t is memoryview:
            return obj.tobytes()
        if t is np.ndarray:
            if _dtype_is_plain(obj.dtype):
                return self._ndarray(obj)
        elif isinstance(obj, np.generic):
            if _dtype_is_plain(obj.dtype):
                # an empty np.str_ / np.bytes_ has itemsize 0 yet tobytes() gives padding
                raw = obj.tobytes() if obj.dtype.itemsize else b""
                return msgpack.ExtType(EXT_NPSCALAR, self._nested([_npformat.dtype_to_descr(obj.dtype), raw]))
        elif t.__module__.startswith("pyarrow"):
            import pyarrow as pa  # optional dependency; the value is an Arrow object, so it is installed
            if t is pa.RecordBatch or t is pa.Table:
                return self._arrow(obj, pa)
        return self._pickle(obj)

    def _ndarray(self, arr: np.ndarray):
        fortran = arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous
        if arr.nbytes == 0:
            data = b""
        else:
            flat = np.ascontiguousarray(arr.T if fortran else arr).reshape(-1).view(np.uint8)
            data = self._oob(memoryview(flat)) if flat.nbytes >= INLINE_MAX else flat.tobytes()
        payload = [_npformat.dtype_to_descr(arr.dtype), list(arr.shape), fortran, data]
        return msgpack.ExtType(EXT_NDARRAY, self._nested(payload))

    def _arrow(self, obj, pa):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, obj.schema) as writer:
            if type(obj) is pa.RecordBatch:
                writer.write_batch(obj)
            else:
                writer.write_table(obj)
        index = self._oob(_byte_view(sink.getvalue()))
        code = EXT_ARROW_BATCH if type(obj) is pa.RecordBatch else EXT_ARROW_TABLE
        return msgpack.ExtType(code, self._nested(index))

    def _pickle(self, obj):
        if not self.allow_pickle:
            raise _Unsupported(obj)
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            err = _Unsupported(obj, f"{_type_name(obj)} is not plain data and cannot be pickled: {e}")
            raise err from e
        self.pickled.append(_type_name(obj))
        return msgpack.ExtType(EXT_PICKLE, self._nested([_type_name(obj), data]))


def encode_value(value, *, allow_pickle: bool = False) -> EncodedValue:
    """Encode ``value`` by the rules in this module's docstring.

    Raises UnsupportedStateError naming the type and its place in ``value`` when
    something is not plain data and ``allow_pickle`` is off. The out-of-band
    buffers are views of the caller's arrays: do not mutate them until written."""
    return _Encoder(allow_pickle).encode(value)


def _arrow_is_safe(pa) -> bool:
    # pyarrow 14.0.0 and older unpickle arrow.py_extension_type columns on read
    # (CVE-2023-47248).
    try:
        parts = tuple(int(p) for p in re.findall(r"\d+", pa.__version__)[:3])
    except ValueError:
        return False
    return parts >= (14, 0, 1)


class _Decoder:
    def __init__(self, buffers, allow_pickle: bool):
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self._depth = 0

    def decode(self, data):
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=self._ext,
                               unicode_errors="surrogatepass")

    def _nested(self, data):
        depth = self._depth + 1
        if depth > MAX_EXT_DEPTH:
            raise _Corrupt(f"extension types nest deeper than {MAX_EXT_DEPTH} levels")
        self._depth = depth
        try:
            return self.decode(data)
        finally:
            self._depth = depth - 1

    def _buffer(self, index):
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise _Corrupt(f"reference to out-of-band buffer {index!r} of {len(self.buffers)}")
        return self.buffers[index]

    def _ext(self, code, data):
        if code == EXT_TUPLE:
            return tuple(self._list(data))
        if code == EXT_SET:
            return set(self._list(data))
        if code == EXT_FROZENSET:
            return frozenset(self._list(data))
        if code == EXT_BIGINT:
            return int.from_bytes(data, "big", signed=True)
        if code == EXT_COMPLEX:
            if len(data) != 16:
                raise _Corrupt("complex payload is not 16 bytes")
            return complex(*struct.unpack("<dd", data))
        if code == EXT_NDARRAY:
            return self._ndarray(data)
        if code == EXT_NPSCALAR:
            descr, raw = self._fields(data, 2)
            dt = self._dtype(descr)
            if type(raw) is not bytes or len(raw) != dt.itemsize:
                raise _Corrupt("numpy scalar bytes do not match its dtype")
            if dt.itemsize == 0:
                return dt.type("" if dt.kind == "U" else b"")
            return np.frombuffer(bytearray(raw), dtype=dt)[0]
        if code in (EXT_ARROW_BATCH, EXT_ARROW_TABLE):
            return self._arrow(code, self._nested(data))
        if code == EXT_PICKLE:
            tname, raw = self._fields(data, 2)
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"the stored state holds a pickled {tname!s:.200}; unpickling runs code that the "
                    f"checkpoint's writer chose, so it is refused unless the storage is opened with "
                    f"allow_pickle=True", type_name=str(tname))
            if type(raw) is not bytes:
                raise _Corrupt("pickled payload is not bytes")
            return pickle.loads(raw)
        raise _Corrupt(f"unknown extension type {code}")

    def _list(self, data):
        items = self._nested(data)
        if type(items) is not list:
            raise _Corrupt("collection payload is not an array")
        return items

    def _fields(self, data, n):
        items = self._nested(data)
        if type(items) is not list or len(items) != n:
            raise _Corrupt(f"extension payload is not an array of {n}")
        return items

    @staticmethod
    def _dtype(descr) -> np.dtype:
        try:
            dt = _npformat.descr_to_dtype(descr)
        except Exception as e:
            raise _Corrupt(f"invalid dtype description {reprlib.repr(descr)}: {e}") from e
        if not _dtype_is_plain(dt):
            raise _Corrupt(f"dtype {dt} holds pointers; refusing it")
        return dt

    def _ndarray(self, data):
        descr, shape, fortran, raw = self._fields(data, 4)
        dt = self._dtype(descr)
        if (type(shape) is not list or len(shape) > 64
                or not all(type(n) is int and n >= 0 for n in shape) or type(fortran) is not bool):
            raise _Corrupt(f"invalid array shape {reprlib.repr(shape)}")
        buf = raw if type(raw) is bytes else self._buffer(raw)
        count = math.prod(shape)
        if count * dt.itemsize != len(buf):
            raise _Corrupt(f"array of shape {shape} and dtype {dt} does not fit {len(buf)} bytes")
        order = "F" if fortran else "C"
        if count == 0 or dt.itemsize == 0:
            return np.zeros(shape, dtype=dt, order=order)
        if type(raw) is bytes:
            buf = bytearray(raw)  # inline bytes are immutable; restored state must be writable
        arr = np.frombuffer(buf, dtype=dt, count=count)
        return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)

    def _arrow(self, code, index):
        buf = self._buffer(index)
        try:
            import pyarrow as pa  # optional dependency
        except ImportError as e:
            raise CheckpointError("the stored state holds Arrow data; install pyarrow to restore it") from e
        if not _arrow_is_safe(pa) and not self.allow_pickle:
            raise PickleNotAllowedError(
                f"pyarrow {pa.__version__} may unpickle Arrow extension types while reading; "
                f"upgrade to pyarrow>=14.0.1 or open the storage with allow_pickle=True",
                type_name="pyarrow.RecordBatch")
        reader = pa.ipc.open_stream(pa.py_buffer(buf))
        if code == EXT_ARROW_BATCH:
            out = reader.read_next_batch()
            try:
                reader.read_next_batch()
            except StopIteration:
                pass
            else:
                raise _Corrupt("Arrow stream holds more than one RecordBatch")
        else:
            out = reader.read_all()
        out.validate(full=True)
        return out


def decode_value(tree, buffers=(), *, allow_pickle: bool = False):
    """Inverse of ``encode_value``. Raises CorruptCheckpointError for malformed
    input and PickleNotAllowedError for a pickled value without the opt-in."""
    try:
        return _Decoder(list(buffers), allow_pickle).decode(tree)
    except (PickleNotAllowedError, CheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"malformed value: {e}") from e
