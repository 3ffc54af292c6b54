"""Durable checkpoint storage: directory layout, state file format, safe value codec.

Layout
======
One directory per checkpoint under ``checkpoint_dir`` (a local path or any fsspec
URL: ``s3://bucket/job``, ``hdfs://...``, ``memory://...``)::

    checkpoint_dir/
      chk-41/                      complete: holds _metadata
        _metadata
        map_0-1f0c9a3be27d4c55.state
        ...
      chk-42/                      in progress: task files, no _metadata yet

A task writes its file under a temporary name in the checkpoint's directory and
renames it when the file is whole. The coordinator writes ``_metadata`` (also
temporary name, then rename) only after every task has acknowledged; a
checkpoint is complete exactly when a valid ``_metadata`` exists and every task
file it lists is there with the recorded size and valid checksums. On object
stores, where a rename is a copy, that rule alone is what makes a checkpoint
complete: readers never trust a directory without metadata.

File format (version 1)
=======================
Task state files and ``_metadata`` share one container format; integers are
little-endian.

Header, 16 bytes::

    magic       8 bytes   b"\\x89PFBCKP\\n"
    version     u16       1
    file_kind   u16       1 = task state, 2 = checkpoint metadata, 3 = bare value
    header_crc  u32       CRC-32 (zlib.crc32) of the 12 bytes above

Then sections, each::

    kind        u16       1 INFO, 2 STATE, 3 INFLIGHT, 4 METADATA, 5 VALUE, 0xFFFF END
    flags       u16       bit 0: the value holds pickled objects; other bits are 0
    name_len    u32
    payload_len u64
    header_crc  u32       CRC-32 of the 16 bytes above (a reader trusts the
                          lengths only after this matches)
    name        name_len bytes, UTF-8 (an in-flight section's channel id)
    payload     payload_len bytes
    body_crc    u32       CRC-32 of name + payload

The last section is END; its payload is ``u64 sections_before_end, u64
offset_of_end``, and the file ends right after it, so a truncated file, a
dropped section or trailing garbage are all detected.

Value payload (INFO, STATE, METADATA, VALUE)::

    n_buffers   u32
    reserved    u32       0
    tree_len    u64
    n_buffers x (offset u64, length u64)   offsets from the payload's start
    tree        tree_len bytes: MessagePack (msgpack.org spec) of the value
    buffers     out-of-band raw bytes (NumPy array data, Arrow IPC streams),
                each starting at a 64-byte-aligned file offset, zero padding between

In-flight payload (one INFLIGHT section per channel and write call)::

    n_buffers   u32
    reserved    u32       0
    n_buffers x length u64
    the buffers' bytes, back to back (buffer boundaries are kept)

A task file holds INFO (``checkpoint_id``, ``task_key``, ``alignment``,
``created``, ``writer``), any number of INFLIGHT sections, exactly one STATE
section and END. ``_metadata`` holds one METADATA section and END.

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
"""
from __future__ import annotations

import io
import logging
import math
import os
import pickle
import re
import reprlib
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, Iterable, Iterator, Mapping

import fsspec
import msgpack
import numpy as np
from numpy.lib import format as _npformat

from pyflowbuf._version import __version__
from pyflowbuf.errors import ConfigurationError, FlowBufError

log = logging.getLogger("pyflowbuf.checkpoint")

# ---------------------------------------------------------------------------- errors


class CheckpointError(FlowBufError):
    """Base class of the checkpoint storage errors."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint (or a state file) is torn or corrupt: bad checksum, truncated,
    missing task file, malformed value. ``checkpoint_id``, ``path`` and ``reason``
    say which and why."""

    def __init__(self, reason, *, checkpoint_id=None, path=None):
        where = []
        if checkpoint_id is not None:
            where.append(f"checkpoint {checkpoint_id}")
        if path is not None:
            where.append(str(path))
        super().__init__(f"{' '.join(where)}: {reason}" if where else reason)
        self.reason = reason
        self.checkpoint_id = checkpoint_id
        self.path = path


class UnsafeCommitError(CorruptCheckpointError):
    """A sink commit a restore would carry out is not one this job's sinks can
    produce (a rename out of or into another directory, of a file that is not
    a pending part file): refused before any file moves. ``action`` is it."""

    def __init__(self, reason, *, action=None, checkpoint_id=None, path=None):
        super().__init__(reason, checkpoint_id=checkpoint_id, path=path)
        self.action = action


class IncompatibleCheckpointError(CheckpointError, ConfigurationError):
    """The checkpoint was taken of other input: a source's recorded identity
    (its kind, paths, settings, the fingerprint of what it had read) does not
    match the source being restored. ``source`` names it."""

    def __init__(self, message, *, source=None):
        super().__init__(message)
        self.source = source


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No such checkpoint, or it is not complete (no ``_metadata``)."""


class TaskStateNotFoundError(CheckpointError, KeyError):
    """The complete checkpoint holds no state for this task key."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class CheckpointStateError(CheckpointError, RuntimeError):
    """The operation does not fit the checkpoint's state: writing to an aborted or
    subsumed checkpoint, aborting or completing a complete one."""


class UnsupportedStateError(CheckpointError, TypeError):
    """At snapshot time: the state holds a value that is not plain data and
    ``allow_pickle`` is off (or it cannot be pickled). ``type_name`` and
    ``where`` (a path such as ``state['counts'][3]``) name it."""

    def __init__(self, message, *, type_name=None, where=None):
        super().__init__(message)
        self.type_name = type_name
        self.where = where


class PickleNotAllowedError(CheckpointError, PermissionError):
    """At restore time: the stored state holds a pickled object and this reader
    did not opt in with ``allow_pickle=True``. ``type_name`` names the type the
    writer recorded (informative only: nothing was unpickled)."""

    def __init__(self, message, *, type_name=None):
        super().__init__(message)
        self.type_name = type_name


# ---------------------------------------------------------------------------- format constants

MAGIC = b"\x89PFBCKP\n"
FORMAT_VERSION = 1
FILE_TASK_STATE, FILE_METADATA, FILE_VALUE = 1, 2, 3
SEC_INFO, SEC_STATE, SEC_INFLIGHT, SEC_METADATA, SEC_VALUE, SEC_END = 1, 2, 3, 4, 5, 0xFFFF
FLAG_PICKLE = 1

_FILE_HEADER = struct.Struct("<8sHHI")
_SEC_HEADER = struct.Struct("<HHIQI")
_SEC_HEADER_BODY = struct.Struct("<HHIQ")
_CRC = struct.Struct("<I")
_VALUE_PREFIX = struct.Struct("<IIQ")
_PAIR = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_INFLIGHT_PREFIX = struct.Struct("<II")

_KNOWN_SECTIONS = {SEC_INFO, SEC_STATE, SEC_INFLIGHT, SEC_METADATA, SEC_VALUE, SEC_END}
_FILE_KINDS = {FILE_TASK_STATE, FILE_METADATA, FILE_VALUE}
_MAX_NAME = 1 << 16
_ALIGN = 64
_ZEROS = bytes(_ALIGN)
# Arrays smaller than this go inline in the tree; an out-of-band buffer costs a
# 16-byte table entry plus alignment padding.
INLINE_MAX = 4096
# Each extension level is a Python call on both sides; bounding it keeps a hostile
# file from exhausting the interpreter stack and guarantees that whatever was
# written can be read back.
MAX_EXT_DEPTH = 100
_VERIFY_CHUNK = 1 << 20

EXT_TUPLE, EXT_SET, EXT_FROZENSET, EXT_BIGINT, EXT_COMPLEX = 1, 2, 3, 4, 5  # 6 is reserved
EXT_NDARRAY, EXT_NPSCALAR, EXT_ARROW_BATCH, EXT_ARROW_TABLE, EXT_PICKLE = 7, 8, 9, 10, 64

PLAIN_TYPES = ("None, bool, int, float, complex, str, bytes, tuple, list, dict, "
               "set, frozenset, NumPy arrays and scalars, Arrow RecordBatch and Table")

# ---------------------------------------------------------------------------- value codec


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
            import pyarrow as pa
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
    """Encode ``value`` by the rules in the module docstring.

    Raises UnsupportedStateError naming the type and its place in ``value`` when
    something is not plain data and ``allow_pickle`` is off. The out-of-band
    buffers are views of the caller's arrays: do not mutate them until written."""
    return _Encoder(allow_pickle).encode(value)


class _Corrupt(Exception):
    pass


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
            import pyarrow as pa
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


# ---------------------------------------------------------------------------- container writer


class _ContainerWriter:
    """Writes the container format to a binary file object, one write per piece,
    so caller memory (segments, arrays) goes to the file without being joined."""

    def __init__(self, f, file_kind: int):
        self._f = f
        self.pos = 0
        self.sections = 0
        head = struct.pack("<8sHH", MAGIC, FORMAT_VERSION, file_kind)
        self._raw(head + _CRC.pack(zlib.crc32(head)))

    def _raw(self, data):
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n:
            self._f.write(data)
            self.pos += n

    def section(self, kind: int, name: str, pieces, flags: int = 0) -> int:
        name_b = name.encode("utf-8")
        if len(name_b) > _MAX_NAME:
            raise ValueError(f"section name longer than {_MAX_NAME} bytes")
        plen = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        head = _SEC_HEADER_BODY.pack(kind, flags, len(name_b), plen)
        self._raw(head + _CRC.pack(zlib.crc32(head)) + name_b)
        crc = zlib.crc32(name_b)
        for p in pieces:
            crc = zlib.crc32(p, crc)
            self._raw(p)
        self._raw(_CRC.pack(crc))
        self.sections += 1
        return plen

    def value_section(self, kind: int, name: str, enc: EncodedValue) -> int:
        n = len(enc.buffers)
        payload_at = self.pos + _SEC_HEADER.size + len(name.encode("utf-8"))
        cursor = _VALUE_PREFIX.size + _PAIR.size * n + len(enc.tree)
        table, body = [], []
        for buf in enc.buffers:
            pad = -(payload_at + cursor) % _ALIGN
            if pad:
                body.append(memoryview(_ZEROS)[:pad])
            cursor += pad
            table.append(_PAIR.pack(cursor, buf.nbytes))
            body.append(buf)
            cursor += buf.nbytes
        prefix = _VALUE_PREFIX.pack(n, 0, len(enc.tree)) + b"".join(table)
        flags = FLAG_PICKLE if enc.pickled else 0
        return self.section(kind, name, [prefix, enc.tree, *body], flags)

    def inflight_section(self, channel: str, views) -> int:
        prefix = _INFLIGHT_PREFIX.pack(len(views), 0) + b"".join(_U64.pack(v.nbytes) for v in views)
        self.section(SEC_INFLIGHT, channel, [prefix, *views])
        return sum(v.nbytes for v in views)

    def end(self):
        self.section(SEC_END, "", [_PAIR.pack(self.sections, self.pos)])


# ---------------------------------------------------------------------------- container reader


class _MemSource:
    """Parses from one in-memory buffer; payloads come back as views of it."""

    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0

    def take(self, n: int):
        if self.pos + n > len(self.data):
            raise _Corrupt(f"truncated: needs {self.pos + n} bytes, has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def payload(self, n: int, crc: int, keep: bool):
        view = self.take(n)
        return view, zlib.crc32(view, crc)

    def at_eof(self) -> bool:
        return self.pos == len(self.data)


class _StreamSource:
    """Parses from a file object in bounded chunks, checking CRCs without holding
    the payloads (unless asked to keep one)."""

    def __init__(self, f, size: int):
        self.f = f
        self.size = size  # known from the file system: lengths beyond it are corrupt, not allocated
        self.pos = 0
        self._chunk = None

    def _need(self, n: int):
        if self.pos + n > self.size:
            raise _Corrupt(f"truncated: needs {self.pos + n} bytes, has {self.size}")

    def _read_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = self.f.readinto(view[got:])
            if not n:
                break
            got += n
        self.pos += got
        return got

    def take(self, n: int):
        self._need(n)
        buf = bytearray(n)
        if self._read_into(memoryview(buf)) != n:
            raise _Corrupt(f"truncated at byte {self.pos}")
        return memoryview(buf)

    def payload(self, n: int, crc: int, keep: bool):
        if keep:
            view = self.take(n)
            return view, zlib.crc32(view, crc)
        self._need(n)
        if self._chunk is None:
            self._chunk = memoryview(bytearray(min(n, _VERIFY_CHUNK) or 1))
        left = n
        while left:
            part = self._chunk[:min(left, len(self._chunk))]
            got = self._read_into(part)
            if got != len(part):
                raise _Corrupt(f"truncated at byte {self.pos}")
            crc = zlib.crc32(part, crc)
            left -= got
        return None, crc

    def at_eof(self) -> bool:
        return not self.f.read(1)


@dataclass
class _Section:
    kind: int
    flags: int
    name: str
    payload: memoryview | None
    size: int


def _parse(src, expect_kind: int, keep=lambda kind: True) -> Iterator[_Section]:
    """Yield the sections of a container, END excluded, checking every CRC,
    length and the END record. Raises _Corrupt."""
    head = src.take(_FILE_HEADER.size)
    magic, version, file_kind, crc = _FILE_HEADER.unpack(head)
    if magic != MAGIC:
        raise _Corrupt("not a pyflowbuf checkpoint file (bad magic)")
    if zlib.crc32(head[:12]) != crc:
        raise _Corrupt("file header checksum mismatch")
    if version != FORMAT_VERSION:
        raise _Corrupt(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if file_kind != expect_kind:
        raise _Corrupt(f"file kind {file_kind}, expected {expect_kind}")
    count = 0
    while True:
        start = src.pos
        sh = src.take(_SEC_HEADER.size)
        kind, flags, name_len, plen, hcrc = _SEC_HEADER.unpack(sh)
        if zlib.crc32(sh[:16]) != hcrc:
            raise _Corrupt(f"section header checksum mismatch at byte {start}")
        if kind not in _KNOWN_SECTIONS or flags & ~FLAG_PICKLE or name_len > _MAX_NAME:
            raise _Corrupt(f"unknown section kind {kind} / flags {flags:#x} at byte {start}")
        name_b = src.take(name_len)
        body_crc = zlib.crc32(name_b)
        payload, body_crc = src.payload(plen, body_crc, kind == SEC_END or keep(kind))
        (stored,) = _CRC.unpack(src.take(4))
        if stored != body_crc:
            raise _Corrupt(f"section checksum mismatch at byte {start} (kind {kind})")
        if kind == SEC_END:
            if plen != _PAIR.size or _PAIR.unpack(payload) != (count, start):
                raise _Corrupt("END record does not match the sections before it")
            if not src.at_eof():
                raise _Corrupt("bytes after the END section")
            return
        try:
            name = bytes(name_b).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"section name is not UTF-8: {e}") from e
        count += 1
        yield _Section(kind, flags, name, payload, plen)


def _split_value(payload: memoryview):
    """(tree view, buffer views) of a value section payload."""
    if len(payload) < _VALUE_PREFIX.size:
        raise _Corrupt("value section too short")
    n, reserved, tree_len = _VALUE_PREFIX.unpack(payload[:_VALUE_PREFIX.size])
    table_end = _VALUE_PREFIX.size + _PAIR.size * n
    if reserved or table_end + tree_len > len(payload):
        raise _Corrupt("value section table does not fit its payload")
    cursor = table_end + tree_len
    buffers = []
    for i in range(n):
        off, length = _PAIR.unpack(payload[_VALUE_PREFIX.size + _PAIR.size * i:][:_PAIR.size])
        if off < cursor or off + length > len(payload):
            raise _Corrupt(f"out-of-band buffer {i} lies outside its section")
        buffers.append(payload[off:off + length])
        cursor = off + length
    return payload[table_end:table_end + tree_len], buffers


def _split_inflight(payload: memoryview) -> list:
    if len(payload) < _INFLIGHT_PREFIX.size:
        raise _Corrupt("in-flight section too short")
    n, reserved = _INFLIGHT_PREFIX.unpack(payload[:_INFLIGHT_PREFIX.size])
    at = _INFLIGHT_PREFIX.size + _U64.size * n
    if reserved or at > len(payload):
        raise _Corrupt("in-flight section table does not fit its payload")
    lengths = [_U64.unpack(payload[_INFLIGHT_PREFIX.size + 8 * i:][:8])[0] for i in range(n)]
    if at + sum(lengths) != len(payload):
        raise _Corrupt("in-flight buffer lengths do not add up to the section")
    views = []
    for length in lengths:
        views.append(payload[at:at + length].toreadonly())
        at += length
    return views


def _decode_section(sec: _Section, allow_pickle: bool):
    tree, buffers = _split_value(sec.payload)
    return _Decoder(buffers, allow_pickle).decode(tree)


def dumps(value, *, allow_pickle: bool = False) -> bytes:
    """A standalone file (kind 3) holding one value, in the checkpoint format."""
    out = io.BytesIO()
    w = _ContainerWriter(out, FILE_VALUE)
    w.value_section(SEC_VALUE, "value", encode_value(value, allow_pickle=allow_pickle))
    w.end()
    return out.getvalue()


def loads(data, *, allow_pickle: bool = False):
    """Inverse of ``dumps``. Arrays come back as views of ``data`` when it is
    writable (a bytearray), otherwise of a private copy."""
    mv = _byte_view(data)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    try:
        sections = list(_parse(_MemSource(mv), FILE_VALUE))
        if [s.kind for s in sections] != [SEC_VALUE]:
            raise _Corrupt("expected exactly one value section")
        return _decode_section(sections[0], allow_pickle)
    except (PickleNotAllowedError, CheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(str(e)) from e


# ---------------------------------------------------------------------------- records

ALIGNMENTS = ("aligned", "unaligned")
COMPLETED = "COMPLETED"
INCOMPLETE = "INCOMPLETE"
CORRUPT = "CORRUPT"

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_TASK_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*-[0-9a-f]{16}\.state$")
_CHK_DIR = re.compile(r"^chk-(0|[1-9][0-9]*)$")
METADATA_FILE = "_metadata"


def task_file_name(task_key: str) -> str:
    """The file a task's state goes to: a readable prefix of the key plus a hash of
    the whole key, so distinct keys never collide and any key is a safe name on
    every file system."""
    prefix = _SAFE_CHARS.sub("_", task_key)[:80].lstrip(".-") or "task"
    digest = blake2b(task_key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{prefix}-{digest}.state"


def _check_id(checkpoint_id) -> int:
    if type(checkpoint_id) is not int and not isinstance(checkpoint_id, np.integer):
        raise TypeError(f"checkpoint_id must be an int, got {type(checkpoint_id).__name__}")
    cid = int(checkpoint_id)
    if cid < 0:
        raise ValueError(f"checkpoint_id must be >= 0, got {cid}")
    return cid


def _check_key(task_key) -> str:
    if type(task_key) is not str or not task_key:
        raise TypeError(f"task_key must be a non-empty str, got {task_key!r}")
    return task_key


def _check_alignment(alignment) -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    return alignment


@dataclass(frozen=True)
class TaskStateHandle:
    """What a task acknowledges to the coordinator: where its state went and how
    big it is. ``to_dict()`` is plain data, to cross processes."""

    checkpoint_id: int
    task_key: str
    file: str             # name inside the checkpoint directory
    size: int             # bytes of the file
    state_bytes: int      # bytes of the encoded operator state
    inflight_bytes: int   # bytes of persisted in-flight buffers (unaligned checkpoints)
    alignment: str = "aligned"
    inflight_buffers: int = 0

    def to_dict(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "task_key": self.task_key, "file": self.file,
                "size": self.size, "state_bytes": self.state_bytes, "inflight_bytes": self.inflight_bytes,
                "alignment": self.alignment, "inflight_buffers": self.inflight_buffers}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TaskStateHandle":
        h = cls(**{k: d[k] for k in ("checkpoint_id", "task_key", "file", "size", "state_bytes",
                                     "inflight_bytes", "alignment", "inflight_buffers")})
        ints = (h.checkpoint_id, h.size, h.state_bytes, h.inflight_bytes, h.inflight_buffers)
        if (not all(type(v) is int and v >= 0 for v in ints) or type(h.task_key) is not str
                or h.alignment not in ALIGNMENTS or type(h.file) is not str or not _TASK_FILE.match(h.file)):
            raise ValueError(f"invalid task state handle {reprlib.repr(dict(d))}")
        return h


@dataclass(frozen=True)
class CheckpointMetadata:
    """A complete checkpoint, as recorded in its ``_metadata``. Times are epoch
    seconds, ``duration`` seconds from trigger to completion."""

    checkpoint_id: int
    trigger_time: float
    completion_time: float
    duration: float
    status: str
    tasks: Mapping[str, TaskStateHandle]
    properties: dict = field(default_factory=dict)
    path: str = ""

    @property
    def state_bytes(self) -> int:
        return sum(t.state_bytes for t in self.tasks.values())

    @property
    def inflight_bytes(self) -> int:
        return sum(t.inflight_bytes for t in self.tasks.values())

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tasks.values())

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, "checkpoint_id": self.checkpoint_id,
                "trigger_time": self.trigger_time, "completion_time": self.completion_time,
                "duration": self.duration, "status": self.status,
                "tasks": [t.to_dict() for t in self.tasks.values()], "properties": self.properties}

    @classmethod
    def from_dict(cls, d: Mapping, path: str = "") -> "CheckpointMetadata":
        if type(d) is not dict or d.get("format") != FORMAT_VERSION:
            raise ValueError("metadata is not a format-1 dict")
        tasks = {}
        for t in d["tasks"]:
            h = TaskStateHandle.from_dict(t)
            if h.task_key in tasks:
                raise ValueError(f"task {h.task_key!r} listed twice")
            tasks[h.task_key] = h
        m = cls(d["checkpoint_id"], d["trigger_time"], d["completion_time"], d["duration"], d["status"],
                tasks, d["properties"], path)
        times = (m.trigger_time, m.completion_time, m.duration)
        if (type(m.checkpoint_id) is not int or type(m.properties) is not dict or m.status != COMPLETED
                or not all(type(t) in (int, float) for t in times)):
            raise ValueError("metadata fields have the wrong types")
        if any(h.checkpoint_id != m.checkpoint_id for h in tasks.values()):
            raise ValueError("a task handle belongs to another checkpoint")
        return m


@dataclass
class TaskSnapshot:
    """One task's state read back from a checkpoint. ``inflight`` maps each
    channel to its buffers in the order written (read-only views of the file's
    bytes; NumPy arrays in ``state`` are writable views of the same bytes)."""

    checkpoint_id: int
    task_key: str
    alignment: str
    state: Any
    inflight: dict
    state_bytes: int
    inflight_bytes: int


@dataclass
class CheckpointInfo:
    """A checkpoint directory as ``scan()`` found it: COMPLETED (``metadata`` set),
    INCOMPLETE (no metadata: in progress or abandoned) or CORRUPT (``error``)."""

    checkpoint_id: int
    path: str
    status: str
    metadata: CheckpointMetadata | None = None
    error: CheckpointError | None = None


# ---------------------------------------------------------------------------- writing a task's state


class TaskStateWriter:
    """Writes one task's state file: in-flight sections as they come, the operator
    state once, then ``commit()`` renames the temporary file into place.

    Use as a context manager: leaving the block commits, an exception aborts
    (the temporary file is removed). Buffers handed to ``write_inflight`` and
    arrays in the state are written from their own memory, one write each; they
    must not change until the call returns."""

    def __init__(self, storage: "CheckpointStorage", checkpoint_id: int, task_key: str, alignment: str):
        self._storage = storage
        self.checkpoint_id = checkpoint_id
        self.task_key = task_key
        self.alignment = alignment
        self.handle: TaskStateHandle | None = None
        self.state_bytes = 0
        self.inflight_bytes = 0
        self._inflight_buffers = 0
        self._state_written = False
        self._done = False
        self._fs = storage.fs
        directory = storage.checkpoint_path(checkpoint_id)
        self.file = task_file_name(task_key)
        self._final = f"{directory}/{self.file}"
        self._tmp = f"{directory}/.{self.file}.{uuid.uuid4().hex}.tmp"
        self._fs.makedirs(directory, exist_ok=True)
        self._f = self._fs.open(self._tmp, "wb")
        try:
            self._w = _ContainerWriter(self._f, FILE_TASK_STATE)
            info = {"checkpoint_id": checkpoint_id, "task_key": task_key, "alignment": alignment,
                    "created": time.time(), "writer": f"pyflowbuf {__version__}"}
            self._w.value_section(SEC_INFO, "info", encode_value(info))
        except BaseException:
            self.abort()
            raise

    def _check_open(self):
        if self._done:
            raise CheckpointStateError(f"the state file of task {self.task_key!r} is already closed")

    def write_inflight(self, channel: str, buffers: Iterable) -> int:
        """Persist in-flight buffers of one input channel (any objects with the
        buffer protocol: pyflowbuf Buffers, memoryviews, bytes, arrays). Calls
        for the same channel append. Returns the bytes of data written."""
        self._check_open()
        if type(channel) is not str:
            raise TypeError(f"channel must be a str, got {type(channel).__name__}")
        views = [_byte_view(b) for b in buffers]
        try:
            n = self._w.inflight_section(channel, views)
        except BaseException:
            self.abort()
            raise
        self.inflight_bytes += n
        self._inflight_buffers += len(views)
        return n

    def write_state(self, state) -> int:
        """Encode and write the operator state (once). Returns its encoded size.
        UnsupportedStateError (the file stays open) if it is not plain data and
        the storage does not allow pickle."""
        self._check_open()
        if self._state_written:
            raise CheckpointStateError(f"the state of task {self.task_key!r} was already written")
        return self._write_encoded_state(encode_value(state, allow_pickle=self._storage.allow_pickle))

    def _write_encoded_state(self, enc: EncodedValue) -> int:
        try:
            self.state_bytes = self._w.value_section(SEC_STATE, "state", enc)
        except BaseException:
            self.abort()
            raise
        self._state_written = True
        return self.state_bytes

    def commit(self) -> TaskStateHandle:
        """Finish the file, make it durable and rename it into place."""
        self._check_open()
        if not self._state_written:
            raise CheckpointStateError(f"task {self.task_key!r}: write_state() before commit()")
        try:
            self._storage._raise_if_dead(self.checkpoint_id)
            self._w.end()
            size = self._w.pos
            self._storage._sync_file(self._f)
            self._f.close()
            self._fs.mv(self._tmp, self._final)
            self._storage._sync_dir(self._final.rsplit("/", 1)[0])
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and self._storage._is_dead(self.checkpoint_id):
                raise CheckpointStateError(
                    f"checkpoint {self.checkpoint_id} was aborted while task {self.task_key!r} wrote") from e
            raise
        self._done = True
        self.handle = TaskStateHandle(self.checkpoint_id, self.task_key, self.file, size, self.state_bytes,
                                      self.inflight_bytes, self.alignment, self._inflight_buffers)
        return self.handle

    def abort(self) -> None:
        """Drop the temporary file; the checkpoint gets nothing from this task."""
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except Exception:
            pass
        try:
            self._fs.rm(self._tmp)
        except (FileNotFoundError, OSError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


# ---------------------------------------------------------------------------- the storage


class CheckpointStorage:
    """Checkpoints of one job under ``checkpoint_dir`` (path or fsspec URL).

    retained
        How many complete checkpoints ``complete()`` keeps (the newest).
    allow_pickle
        Opt-in, as on the wire: without it, state that is not plain data is
        refused at snapshot time and stored pickles are refused at restore time.
    fsync
        On a local file system, fsync files and directories before a rename is
        reported done (other file systems are as durable as their put is).
    storage_options
        Passed to fsspec (credentials, endpoints...).
    """

    def __init__(self, checkpoint_dir, retained: int = 2, allow_pickle: bool = False, *,
                 fsync: bool = True, storage_options: Mapping | None = None):
        if type(retained) is not int or retained < 1:
            raise ValueError(f"retained must be an int >= 1, got {retained!r}")
        self.fs, root = fsspec.core.url_to_fs(os.fspath(checkpoint_dir), **dict(storage_options or {}))
        self.root = root.rstrip("/") or "/"
        self.retained = retained
        self.allow_pickle = bool(allow_pickle)
        from fsspec.implementations.local import LocalFileSystem
        self._local = isinstance(self.fs, LocalFileSystem)
        self._fsync = fsync and self._local
        self._lock = threading.Lock()
        self._aborted: set[int] = set()
        self._completed_max = -1

    def __repr__(self):
        return f"CheckpointStorage({self.url!r}, retained={self.retained}, allow_pickle={self.allow_pickle})"

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.root)

    def checkpoint_path(self, checkpoint_id: int) -> str:
        return f"{self.root.rstrip('/')}/chk-{_check_id(checkpoint_id)}"

    # -- durability helpers

    def _sync_file(self, f):
        if self._fsync:
            f.flush()
            os.fsync(f.fileno())

    def _sync_dir(self, path):
        if self._fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _is_dead(self, cid: int) -> bool:
        with self._lock:
            return cid in self._aborted or cid < self._completed_max

    def _raise_if_dead(self, cid: int):
        with self._lock:
            if cid in self._aborted:
                raise CheckpointStateError(f"checkpoint {cid} was aborted")
            if cid < self._completed_max:
                raise CheckpointStateError(
                    f"checkpoint {cid} is subsumed: checkpoint {self._completed_max} already completed")

    # -- writing

    def task_writer(self, checkpoint_id: int, task_key: str, *, alignment: str = "aligned") -> TaskStateWriter:
        """A writer for one task's state file (for in-flight data that arrives
        piecewise during an unaligned checkpoint)."""
        cid = _check_id(checkpoint_id)
        _check_key(task_key)
        _check_alignment(alignment)
        self._raise_if_dead(cid)
        return TaskStateWriter(self, cid, task_key, alignment)

    def write_task_state(self, checkpoint_id: int, task_key: str, state, inflight: Mapping | None = None, *,
                         alignment: str = "aligned") -> TaskStateHandle:
        """Write one task's state (and in-flight buffers: channel -> buffers)
        to a temporary file, then rename it. The handle's ``size`` is the bytes
        written; give the handle to ``complete()``."""
        state_enc = encode_value(state, allow_pickle=self.allow_pickle)  # refuse before creating anything
        with self.task_writer(checkpoint_id, task_key, alignment=alignment) as w:
            for channel, buffers in (inflight or {}).items():
                w.write_inflight(channel, buffers)
            w._write_encoded_state(state_enc)
        return w.handle

    def complete(self, checkpoint_id: int, tasks, *, trigger_time: float | None = None,
                 duration: float | None = None, properties: Mapping | None = None) -> CheckpointMetadata:
        """Every task acknowledged: check their files, write ``_metadata`` last,
        then keep only the newest ``retained`` complete checkpoints.

        ``tasks``: the TaskStateHandles (or their dicts), as a list or a mapping.
        ``trigger_time``: epoch seconds (default now); ``duration`` defaults to
        now minus trigger_time. ``properties``: plain data stored as is."""
        cid = _check_id(checkpoint_id)
        self._raise_if_dead(cid)
        items = tasks.values() if isinstance(tasks, Mapping) else tasks
        handles = {}
        for h in items:
            h = TaskStateHandle.from_dict(h.to_dict() if isinstance(h, TaskStateHandle) else h)
            if h.checkpoint_id != cid:
                raise ValueError(f"task {h.task_key!r} acknowledged checkpoint {h.checkpoint_id}, not {cid}")
            if h.task_key in handles:
                raise ValueError(f"task {h.task_key!r} acknowledged twice")
            handles[h.task_key] = h
        directory = self.checkpoint_path(cid)
        meta_path = f"{directory}/{METADATA_FILE}"
        if self.fs.exists(meta_path):
            raise CheckpointStateError(f"checkpoint {cid} is already complete")
        for h in handles.values():
            try:
                size = self.fs.size(f"{directory}/{h.file}")
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint {cid}: the state file of task {h.task_key!r} "
                                              f"({h.file}) does not exist") from None
            if size != h.size:
                raise CorruptCheckpointError(f"the state file of task {h.task_key!r} has {size} bytes, "
                                             f"the task wrote {h.size}", checkpoint_id=cid, path=h.file)
        now = time.time()
        trigger = now if trigger_time is None else float(trigger_time)
        meta = CheckpointMetadata(cid, trigger, now, now - trigger if duration is None else float(duration),
                                  COMPLETED, handles, dict(properties or {}), self.fs.unstrip_protocol(directory))
        enc = encode_value(meta.to_dict())  # properties must be plain data: no pickle in metadata
        self.fs.makedirs(directory, exist_ok=True)
        tmp = f"{directory}/.{METADATA_FILE}.{uuid.uuid4().hex}.tmp"
        try:
            with self.fs.open(tmp, "wb") as f:
                w = _ContainerWriter(f, FILE_METADATA)
                w.value_section(SEC_METADATA, "metadata", enc)
                w.end()
                self._sync_file(f)
            self.fs.mv(tmp, meta_path)
        except BaseException:
            try:
                self.fs.rm(tmp)
            except (FileNotFoundError, OSError):
                pass
            raise
        self._sync_dir(directory)
        self._sync_dir(self.root)
        with self._lock:
            self._completed_max = max(self._completed_max, cid)
            self._aborted = {a for a in self._aborted if a > self._completed_max}
        self._prune()
        return meta

    def abort(self, checkpoint_id: int) -> None:
        """Discard a pending checkpoint and its files; later writes to it raise
        CheckpointStateError. A complete checkpoint cannot be aborted."""
        cid = _check_id(checkpoint_id)
        directory = self.checkpoint_path(cid)
        if self.fs.exists(f"{directory}/{METADATA_FILE}"):
            raise CheckpointStateError(f"checkpoint {cid} is complete; abort() only discards pending ones")
        with self._lock:
            self._aborted.add(cid)
        try:
            self.fs.rm(directory, recursive=True)
        except FileNotFoundError:
            pass

    def _remove(self, cid: int, why: str):
        directory = self.checkpoint_path(cid)
        log.info("removing checkpoint %d (%s) from %s", cid, why, self.url)
        try:
            # metadata first: a crash mid-removal leaves an incomplete checkpoint,
            # never one that looks complete but lacks files
            try:
                self.fs.rm(f"{directory}/{METADATA_FILE}")
            except FileNotFoundError:
                pass
            self.fs.rm(directory, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove checkpoint %d at %s: %s", cid, directory, e)

    def _prune(self):
        """Keep the newest ``retained`` complete checkpoints; remove every other
        directory below the newest complete one (superseded, abandoned, corrupt).
        Directories above it are checkpoints still in progress."""
        kept = 0
        for cid in sorted(self._ids(), reverse=True):
            if kept >= self.retained:
                self._remove(cid, f"beyond the {self.retained} retained")
                continue
            info = self._probe(cid, verify=False)
            if info.status == COMPLETED:
                kept += 1
            elif kept:
                why = "abandoned" if info.status == INCOMPLETE else f"corrupt: {info.error.reason}"
                self._remove(cid, why)

    # -- reading

    def _ids(self) -> list[int]:
        try:
            self.fs.invalidate_cache(self.root)
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for name in names:
            m = _CHK_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
            if m:
                ids.append(int(m.group(1)))
        return sorted(set(ids))

    def checkpoint_ids(self) -> list[int]:
        """The ids of every ``chk-<id>`` directory, complete or not, ascending."""
        return self._ids()

    def _read_metadata(self, cid: int) -> CheckpointMetadata:
        directory = self.checkpoint_path(cid)
        path = f"{directory}/{METADATA_FILE}"
        try:
            with self.fs.open(path, "rb") as f:
                data = bytearray(f.read())
        except FileNotFoundError:
            if self.fs.exists(directory):
                raise CheckpointNotFoundError(f"checkpoint {cid} is not complete (no {METADATA_FILE})") from None
            raise CheckpointNotFoundError(f"no checkpoint {cid} under {self.url}") from None
        try:
            sections = list(_parse(_MemSource(memoryview(data)), FILE_METADATA))
            if [s.kind for s in sections] != [SEC_METADATA] or sections[0].flags:
                raise _Corrupt("expected exactly one metadata section")
            meta = CheckpointMetadata.from_dict(_decode_section(sections[0], False),
                                                self.fs.unstrip_protocol(directory))
            if meta.checkpoint_id != cid:
                raise _Corrupt(f"metadata describes checkpoint {meta.checkpoint_id}")
        except CheckpointError as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=path) from e
        except Exception as e:
            raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=path) from e
        return meta

    def _verify_task_file(self, meta: CheckpointMetadata, h: TaskStateHandle, path: str):
        with self.fs.open(path, "rb") as f:
            src = _StreamSource(f, h.size)
            kinds = []
            for sec in _parse(src, FILE_TASK_STATE, keep=lambda kind: kind == SEC_INFO):
                kinds.append(sec.kind)
                if sec.kind == SEC_INFO:
                    _check_info(_decode_section(sec, False), meta.checkpoint_id, h)
            _check_layout(kinds)
            if src.pos != h.size:
                raise _Corrupt(f"file has {src.pos} bytes, metadata says {h.size}")

    def load_metadata(self, checkpoint_id: int, *, verify: bool = True) -> CheckpointMetadata:
        """The metadata of a complete checkpoint, after checking that every task
        file exists with its recorded size and (``verify``) that every checksum
        in it holds. Raises CheckpointNotFoundError or CorruptCheckpointError."""
        cid = _check_id(checkpoint_id)
        meta = self._read_metadata(cid)
        directory = self.checkpoint_path(cid)
        for h in meta.tasks.values():
            path = f"{directory}/{h.file}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"the state file of task {h.task_key!r} ({h.file}) is missing",
                                             checkpoint_id=cid, path=path) from None
            if size != h.size:
                raise CorruptCheckpointError(
                    f"the state file of task {h.task_key!r} has {size} bytes, metadata says {h.size} (torn)",
                    checkpoint_id=cid, path=path)
            if verify:
                try:
                    self._verify_task_file(meta, h, path)
                except CheckpointError as e:
                    raise CorruptCheckpointError(f"task {h.task_key!r}: {e}", checkpoint_id=cid, path=path) from e
                except Exception as e:
                    raise CorruptCheckpointError(f"task {h.task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        return meta

    def _probe(self, cid: int, verify: bool) -> CheckpointInfo:
        path = self.fs.unstrip_protocol(self.checkpoint_path(cid))
        try:
            return CheckpointInfo(cid, path, COMPLETED, metadata=self.load_metadata(cid, verify=verify))
        except CorruptCheckpointError as e:
            return CheckpointInfo(cid, path, CORRUPT, error=e)
        except CheckpointNotFoundError as e:
            return CheckpointInfo(cid, path, INCOMPLETE, error=e)

    def _report(self, info: CheckpointInfo):
        if info.status == CORRUPT:
            log.warning("skipping corrupt checkpoint %d: %s", info.checkpoint_id, info.error)
        elif info.status == INCOMPLETE:
            log.info("skipping checkpoint %d: %s", info.checkpoint_id, info.error)

    def scan(self, *, verify: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint directory, oldest first, with what it is."""
        return [self._probe(cid, verify) for cid in self._ids()]

    def list_complete(self, *, verify: bool = True) -> list[CheckpointMetadata]:
        """The complete, intact checkpoints, oldest first; corrupt ones are
        logged (warning) and left out."""
        out = []
        for info in self.scan(verify=verify):
            self._report(info)
            if info.metadata is not None:
                out.append(info.metadata)
        return out

    def latest(self, *, verify: bool = True) -> CheckpointMetadata | None:
        """The newest complete, intact checkpoint, or None. Newer torn or corrupt
        ones are logged (warning) and skipped in favour of older ones. With
        ``verify`` every task file's checksums are checked (it reads them all);
        without, only the metadata and the files' sizes."""
        for cid in sorted(self._ids(), reverse=True):
            info = self._probe(cid, verify)
            if info.metadata is not None:
                return info.metadata
            self._report(info)
        return None

    def read_task_state(self, checkpoint_id: int, task_key: str, *,
                        metadata: CheckpointMetadata | None = None) -> TaskSnapshot:
        """Read one task's state and in-flight buffers from a complete checkpoint
        (every checksum is checked). Raises CheckpointNotFoundError,
        TaskStateNotFoundError, CorruptCheckpointError, PickleNotAllowedError."""
        cid = _check_id(checkpoint_id)
        _check_key(task_key)
        if metadata is None or metadata.checkpoint_id != cid:
            metadata = self._read_metadata(cid)
        h = metadata.tasks.get(task_key)
        if h is None:
            raise TaskStateNotFoundError(f"checkpoint {cid} holds no state for task {task_key!r}")
        path = f"{self.checkpoint_path(cid)}/{h.file}"
        try:
            size = self.fs.size(path)
            if size != h.size:  # before allocating what the metadata claims
                raise CorruptCheckpointError(f"the state file of task {task_key!r} has {size} bytes, "
                                             f"metadata says {h.size} (torn)", checkpoint_id=cid, path=path)
            with self.fs.open(path, "rb") as f:
                data = bytearray(h.size)
                got = _StreamSource(f, h.size)._read_into(memoryview(data))
                extra = f.read(1)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"the state file of task {task_key!r} is missing",
                                         checkpoint_id=cid, path=path) from None
        try:
            if got != h.size or extra:
                raise _Corrupt(f"the file does not have the {h.size} bytes the metadata records (torn)")
            state, inflight, kinds = None, {}, []
            for sec in _parse(_MemSource(memoryview(data)), FILE_TASK_STATE):
                kinds.append(sec.kind)
                if sec.kind == SEC_INFO:
                    _check_info(_decode_section(sec, False), cid, h)
                elif sec.kind == SEC_INFLIGHT:
                    inflight.setdefault(sec.name, []).extend(_split_inflight(sec.payload))
                elif sec.kind == SEC_STATE:
                    state = _decode_section(sec, self.allow_pickle)
            _check_layout(kinds)
        except PickleNotAllowedError:
            raise
        except CheckpointError as e:
            raise CorruptCheckpointError(f"task {task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        except Exception as e:
            raise CorruptCheckpointError(f"task {task_key!r}: {e}", checkpoint_id=cid, path=path) from e
        return TaskSnapshot(cid, task_key, h.alignment, state, inflight, h.state_bytes, h.inflight_bytes)


def _check_info(info, cid: int, h: TaskStateHandle):
    if type(info) is not dict:
        raise _Corrupt("INFO section is not a dict")
    found = (info.get("checkpoint_id"), info.get("task_key"), info.get("alignment"))
    if found != (cid, h.task_key, h.alignment):
        raise _Corrupt(f"file belongs to checkpoint {found[0]}, task {found[1]!r} ({found[2]}), "
                       f"not checkpoint {cid}, task {h.task_key!r} ({h.alignment})")


def _check_layout(kinds: list):
    if not kinds or kinds[0] != SEC_INFO or kinds.count(SEC_INFO) != 1 or kinds.count(SEC_STATE) != 1 \
            or not set(kinds) <= {SEC_INFO, SEC_STATE, SEC_INFLIGHT}:
        raise _Corrupt(f"task file sections {kinds} are not INFO, then in-flight sections and one STATE")
