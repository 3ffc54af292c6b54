"""Serializers for Arrow RecordBatches, pandas DataFrames and NumPy arrays.

Registered at import as the record kinds ``"arrow"``, ``"pandas"`` and
``"numpy"`` (``pyflowbuf.serializers.get_serializer`` imports this module the
first time one of them is asked for). All three travel as the core ``bytes``
kind with ``zero_copy_min = 0``, so the RecordReader hands the decoder a
memoryview over the segment and the decoder wraps it without copying:

* ``arrow``: the record is an Arrow IPC stream (schema + one batch); the
  decoded RecordBatch's column buffers point into the segment, which stays
  pinned (not recycled) until the batch and every array sliced from it are
  gone.
* ``numpy``: a dtype + shape header and the raw C-order bytes; the decoded
  array is a read-only view over the segment.
* ``pandas``: DataFrame <-> Arrow (``RecordBatch.from_pandas`` /
  ``to_pandas``); converting to pandas copies, as pandas needs its own blocks.

Record layout (little-endian), shared by ``arrow`` and ``numpy``::

    0   u8   0xFB                magic
    1   u8   b'A' | b'N'          tag: arrow, numpy
    2   u8   1                    layout version
    3   u8   0                    flags (reserved)
    4   u32  off                  where the payload starts
    8   u32  dlen                 payload length
    12  ...  kind-specific header (numpy: ndim, descr length, shape, descr)
    off ...  payload (IPC stream / array bytes)
        ...  zero padding so that the record length is 4 (mod 8)

Alignment. The RecordWriter frames every record with a 4-byte length, so a
record whose length is 4 (mod 8) keeps the next record's payload at 4 (mod 8)
from the (segment-aligned) start of its buffer. A record that stays inside one
segment therefore starts at 4 (mod 8) and gets ``off`` = 4 (mod 8): its
payload is 8-byte aligned in place. A record larger than a segment is always
reassembled into a new ``bytes`` object, whose data is 16-byte aligned, so it
gets ``off`` = 0 (mod 8). Arrow buffers are then aligned in both cases and the
IPC reader never has to copy them (a record that spans segments only because
it started near the end of one is realigned by Arrow: correct, one copy).
"""
from __future__ import annotations

import ast
import copy
import struct
import threading
from typing import Any

import numpy as np

from pyflowbuf import errors as _errors
from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE
from pyflowbuf.kinds import Serializer, register_serializer

_LITERAL_LOCK = threading.Lock()

try:  # pyarrow and pandas are optional dependencies of pyflowbuf
    import pyarrow as pa
    import pyarrow.ipc  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without pyarrow
    pa = None

__all__ = ["ArrowSerializer", "PandasSerializer", "NumpySerializer", "DEFAULT_SEGMENT_SIZE"]

MAGIC = 0xFB
TAG_ARROW = ord("A")
TAG_NUMPY = ord("N")
VERSION = 1
_HDR = struct.Struct("<BBBBII")  # magic, tag, version, flags, off, dlen
_NP_META = struct.Struct("<II")  # ndim, descr length
_PAD = bytes(16)


def _payload_offset(meta_end: int, total_estimate: int, segment_size: int) -> int:
    """Where the payload should start: 4 (mod 8) for records that will likely
    sit inside one segment, 0 (mod 8) for records that certainly span and are
    therefore reassembled into an 8-aligned ``bytes``."""
    target = 0 if total_estimate + 4 > segment_size else 4
    return meta_end + (target - meta_end) % 8


def _tail_pad(total: int) -> int:
    """Padding that brings a record's length to 4 (mod 8)."""
    return (4 - total) % 8


def _check_header(rec, tag: int, what: str, with_flags: bool = False):
    try:
        magic, t, version, flags, off, dlen = _HDR.unpack_from(rec, 0)
    except (struct.error, TypeError) as exc:
        raise _errors.CorruptRecordError(f"{what} record of {_len(rec)} bytes is too short for its header") from exc
    if magic != MAGIC or t != tag:
        raise _errors.CorruptRecordError(
            f"not a pyflowbuf {what} record (magic {magic:#x}, tag {t:#x}); "
            "was the stream written with another kind?")
    if version != VERSION:
        raise _errors.CorruptRecordError(f"{what} record layout version {version} is not supported (expected {VERSION})")
    n = _len(rec)
    if off < _HDR.size or off + dlen > n:
        raise _errors.CorruptRecordError(
            f"{what} record header says payload at {off}+{dlen} but the record has {n} bytes")
    return (off, dlen, flags) if with_flags else (off, dlen)


def _len(rec) -> int:
    return rec.nbytes if isinstance(rec, memoryview) else len(rec)


def _require_pyarrow():
    if pa is None:  # pragma: no cover
        raise ImportError("the 'arrow' and 'pandas' record kinds need pyarrow: pip install 'pyflowbuf[arrow]'")


class ArrowSerializer(Serializer):
    """``pyarrow.RecordBatch`` records as Arrow IPC streams, decoded in place.

    A ``pyarrow.Table`` is accepted too and travels as one RecordBatch (its
    chunks are combined). Every record carries its schema (a few hundred
    bytes), so any reader can decode any record whatever the partitioning;
    the writer caches the serialized size of the last schema it saw.

    Parameters
    ----------
    segment_size
        The segment size of the pools the records travel through; only used
        to pick the alignment of large records (see the module docstring).
        In a job, the job's ``segment_size`` (``NetworkConfig``) is used
        whatever is given here (``for_segment_size``).
    compression
        ``None``, ``"lz4"`` or ``"zstd"``: IPC body compression (worth it only
        for the TCP exchange; decoding then allocates).
    zero_copy
        True (default): a record read from inside a segment is decoded in
        place, and the segment stays pinned while the batch (or any array
        taken from it) lives. A consumer that *keeps* many small batches
        (``list(Environment.execute_iter(...))``, a buffering operator) would pin
        its producer's whole pool and stall it: give such streams
        ``kind=ArrowSerializer(zero_copy=False)``, which copies those records
        (records larger than a segment are reassembled by the reader anyway
        and never pin).
    """

    name = "arrow"
    core_kind = "bytes"
    zero_copy_min = 0
    in_process_only = False

    def __init__(self, segment_size: int = DEFAULT_SEGMENT_SIZE, compression: str | None = None,
                 zero_copy: bool = True):
        _require_pyarrow()
        self.segment_size = int(segment_size)
        self.compression = compression
        self.zero_copy = bool(zero_copy)
        self._write_options = pa.ipc.IpcWriteOptions(compression=compression)
        # Copy a buffer only when its address does not suit its type (a record
        # that straddled segments unexpectedly); aligned records are untouched.
        self._read_options = pa.ipc.IpcReadOptions(ensure_alignment=pa.ipc.Alignment.DataTypeSpecific)
        self._schema_cache = None  # (schema, serialized size) of the last schema seen

    # -- encoding -------------------------------------------------------
    def _as_batch(self, rec, i: int):
        if isinstance(rec, pa.RecordBatch):
            return rec
        if isinstance(rec, pa.Table):
            batches = rec.combine_chunks().to_batches()
            if not batches:
                return pa.RecordBatch.from_pylist([], schema=rec.schema)
            return batches[0]
        raise TypeError(
            f"record {i}: an 'arrow' stream takes pyarrow.RecordBatch (or Table) records, "
            f"got {type(rec).__module__}.{type(rec).__qualname__}")

    def _schema_size(self, schema) -> int:
        # one attribute, replaced whole: safe when tasks share this serializer
        last = self._schema_cache
        if last is not None and (schema is last[0] or schema.equals(last[0], check_metadata=True)):
            return last[1]
        size = schema.serialize().size
        self._schema_cache = (schema, size)
        return size

    def encode_one(self, batch) -> Any:
        """One RecordBatch to one record (a ``pyarrow.Buffer``)."""
        batch = self._as_batch(batch, 0)
        return self._encode(batch)

    def _encode(self, batch, flags: int = 0):
        schema = batch.schema
        if self.compression is None:
            # exact size when there are no dictionaries: schema + batch + EOS
            est = self._schema_size(schema) + pa.ipc.get_record_batch_size(batch) + 8
            off = _payload_offset(_HDR.size, _HDR.size + est, self.segment_size)
            cap = off + est + 64  # dictionaries (if any) make it larger: fall back below
            buf = pa.allocate_buffer(cap)
            out = pa.FixedSizeBufferWriter(buf)
            out.write(_PAD[: off])
            try:
                with pa.ipc.new_stream(out, schema, options=self._write_options) as w:
                    w.write_batch(batch)
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError, IndexError):
                pass  # did not fit (dictionary batches): the generic path
            else:
                dlen = out.tell() - off
                total = off + dlen
                pad = _tail_pad(total)
                out.write(_PAD[:pad])
                _HDR.pack_into(buf, 0, MAGIC, TAG_ARROW, VERSION, flags, off, dlen)
                return buf.slice(0, total + pad)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema, options=self._write_options) as w:
            w.write_batch(batch)
        ipc = sink.getvalue()
        off = _payload_offset(_HDR.size, _HDR.size + ipc.size, self.segment_size)
        total = off + ipc.size
        hdr = bytearray(off)
        _HDR.pack_into(hdr, 0, MAGIC, TAG_ARROW, VERSION, flags, off, ipc.size)
        return b"".join([hdr, ipc, _PAD[: _tail_pad(total)]])

    def encode_batch(self, records: list) -> list:
        return [self._encode(self._as_batch(r, i)) for i, r in enumerate(records)]

    # -- decoding -------------------------------------------------------
    def decode_one(self, rec):
        """One record (memoryview, bytes or Buffer) back to a RecordBatch.
        Column buffers are views over ``rec``'s memory when it is aligned."""
        off, dlen = _check_header(rec, TAG_ARROW, "arrow")
        return self._decode_at(rec, off, dlen)

    def _decode_at(self, rec, off, dlen):
        buf = rec if isinstance(rec, pa.Buffer) else pa.py_buffer(rec)
        try:
            reader = pa.ipc.open_stream(buf.slice(off, dlen), options=self._read_options)
            batch = reader.read_next_batch()
        except (pa.ArrowException, OSError, StopIteration) as exc:
            raise _errors.CorruptRecordError(f"arrow record of {dlen} payload bytes is not a valid IPC stream: {exc}") from exc
        if not self.zero_copy and isinstance(rec, memoryview):
            # a view over a segment: copy the columns so that the batch can be
            # kept without pinning the segment
            batch = pa.RecordBatch.from_arrays([pa.concat_arrays([c]) for c in batch.columns], schema=batch.schema)
        return batch

    def decode_batch(self, records: list) -> list:
        return [self.decode_one(r) for r in records]

    def for_segment_size(self, segment_size: int) -> "ArrowSerializer":
        """A copy that aligns records for segments of ``segment_size`` (this
        one when it already does); its caches are replaced whole, never
        changed in place, so the copy may share them."""
        if int(segment_size) == self.segment_size:
            return self
        other = copy.copy(self)
        other.segment_size = int(segment_size)
        return other

    def __repr__(self):
        return (f"ArrowSerializer(segment_size={self.segment_size}, compression={self.compression!r}, "
                f"zero_copy={self.zero_copy})")


FLAG_PANDAS = 1   # the record was a pandas DataFrame
FLAG_SERIES = 2   # ... a pandas Series (sent as a one-column frame)
_SERIES_COL = "__pyflowbuf_series__"  # column name of an unnamed Series


class PandasSerializer(Serializer):
    """``pandas.DataFrame`` (and ``pandas.Series``) records, travelling as
    Arrow (see ArrowSerializer).

    The index is kept the way ``pyarrow.RecordBatch.from_pandas`` keeps it (a
    RangeIndex as metadata, other indexes as columns); column names become
    strings. A Series travels as a one-column frame and comes back as a Series
    with its name. Decoding calls ``to_pandas()``, which copies into pandas'
    own memory: the frames are writable and do not pin segments.
    """

    name = "pandas"
    core_kind = "bytes"
    zero_copy_min = 0
    in_process_only = False

    def __init__(self, segment_size: int = DEFAULT_SEGMENT_SIZE, compression: str | None = None,
                 preserve_index: bool | None = None):
        _require_pyarrow()
        import pandas  # noqa: F401  (fail early with a clear ImportError)

        self.arrow = ArrowSerializer(segment_size=segment_size, compression=compression)
        self.preserve_index = preserve_index

    def _to_batch(self, obj, i: int):
        import pandas as pd  # optional dependency, checked in __init__

        flags = FLAG_PANDAS
        if isinstance(obj, pd.Series):
            flags |= FLAG_SERIES
            obj = obj.to_frame(name=_SERIES_COL if obj.name is None else obj.name)
        elif not isinstance(obj, pd.DataFrame):
            raise TypeError(
                f"record {i}: a 'pandas' stream takes pandas.DataFrame or Series records, "
                f"got {type(obj).__module__}.{type(obj).__qualname__}")
        try:
            return pa.RecordBatch.from_pandas(obj, preserve_index=self.preserve_index), flags
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise TypeError(f"record {i}: DataFrame cannot be converted to Arrow: {exc}") from exc

    def encode_one(self, obj):
        batch, flags = self._to_batch(obj, 0)
        return self.arrow._encode(batch, flags)

    def encode_batch(self, records: list) -> list:
        out = []
        for i, obj in enumerate(records):
            batch, flags = self._to_batch(obj, i)
            out.append(self.arrow._encode(batch, flags))
        return out

    def decode_one(self, rec):
        off, dlen, flags = _check_header(rec, TAG_ARROW, "pandas", with_flags=True)
        df = self.arrow._decode_at(rec, off, dlen).to_pandas()
        if flags & FLAG_SERIES:
            s = df.iloc[:, 0]
            if s.name == _SERIES_COL:
                s.name = None
            return s
        return df

    def decode_batch(self, records: list) -> list:
        return [self.decode_one(r) for r in records]

    def for_segment_size(self, segment_size: int) -> "PandasSerializer":
        arrow = self.arrow.for_segment_size(segment_size)
        if arrow is self.arrow:
            return self
        other = copy.copy(self)
        other.arrow = arrow
        return other

    def __repr__(self):
        return f"PandasSerializer(preserve_index={self.preserve_index!r})"


class NumpySerializer(Serializer):
    """``numpy.ndarray`` records (any shape, any fixed-width dtype, structured
    ones too) as a dtype + shape header and the C-order bytes; decoded as a
    read-only view over the record (zero copy), 8-byte aligned in place.

    Object arrays have no byte representation: they raise TypeError (use the
    ``pickle`` kind). NumPy scalars are sent as 0-d arrays. ``zero_copy=False``
    returns writable copies instead of views (see ArrowSerializer).
    """

    name = "numpy"
    core_kind = "bytes"
    zero_copy_min = 0
    in_process_only = False

    def __init__(self, segment_size: int = DEFAULT_SEGMENT_SIZE, zero_copy: bool = True):
        self.segment_size = int(segment_size)
        self.zero_copy = bool(zero_copy)
        self._dtype_cache: dict[bytes, np.dtype] = {}
        self._descr_cache: dict[np.dtype, bytes] = {}

    def _descr(self, dt: np.dtype) -> bytes:
        d = self._descr_cache.get(dt)
        if d is None:
            d = repr(np.lib.format.dtype_to_descr(dt)).encode()
            self._descr_cache[dt] = d
        return d

    def _dtype(self, descr) -> np.dtype:
        key = bytes(descr)
        dt = self._dtype_cache.get(key)
        if dt is None:
            try:
                # one parse at a time: CPython 3.11's compiler state is not
                # safe from several threads (SystemError "AST constructor
                # recursion depth mismatch" under parallel decoders)
                with _LITERAL_LOCK:
                    literal = ast.literal_eval(key.decode())
                dt = np.lib.format.descr_to_dtype(literal)
            except (ValueError, SyntaxError, TypeError, UnicodeDecodeError) as exc:
                raise _errors.CorruptRecordError(f"numpy record has a bad dtype description {key[:80]!r}") from exc
            self._dtype_cache[key] = dt
        return dt

    def encode_one(self, arr):
        return self._encode(arr, 0)

    def _encode(self, arr, i: int):
        if isinstance(arr, np.generic):
            arr = np.asarray(arr)
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"record {i}: a 'numpy' stream takes numpy.ndarray records, got {type(arr).__qualname__}")
        if arr.dtype.hasobject:
            raise TypeError(f"record {i}: numpy arrays of dtype {arr.dtype} hold Python objects; "
                            "use kind='pickle' for them")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # (keeps ndim >= 1; 0-d arrays are contiguous)
        if arr.ndim > 64:
            raise ValueError(f"record {i}: {arr.ndim} dimensions is more than 64")
        descr = self._descr(arr.dtype)
        ndim = arr.ndim
        meta_end = _HDR.size + _NP_META.size + 8 * ndim + len(descr)
        off = _payload_offset(meta_end, meta_end + arr.nbytes, self.segment_size)
        total = off + arr.nbytes
        pad = _tail_pad(total)
        hdr = bytearray(off)
        _HDR.pack_into(hdr, 0, MAGIC, TAG_NUMPY, VERSION, 0, off, arr.nbytes)
        _NP_META.pack_into(hdr, _HDR.size, ndim, len(descr))
        p = _HDR.size + _NP_META.size
        if ndim:
            struct.pack_into(f"<{ndim}Q", hdr, p, *arr.shape)
        p += 8 * ndim
        hdr[p:p + len(descr)] = descr
        data = arr.reshape(-1).view(np.uint8).data if arr.nbytes else b""
        return b"".join([hdr, data, _PAD[:pad]])

    def encode_batch(self, records: list) -> list:
        return [self._encode(a, i) for i, a in enumerate(records)]

    def decode_one(self, rec):
        off, dlen = _check_header(rec, TAG_NUMPY, "numpy")
        try:
            ndim, dlen_descr = _NP_META.unpack_from(rec, _HDR.size)
            p = _HDR.size + _NP_META.size
            shape = struct.unpack_from(f"<{ndim}Q", rec, p) if ndim else ()
        except struct.error as exc:
            raise _errors.CorruptRecordError("numpy record header is truncated") from exc
        p += 8 * ndim
        if p + dlen_descr > off:
            raise _errors.CorruptRecordError("numpy record header overlaps its data")
        mv = rec if isinstance(rec, memoryview) else memoryview(rec)
        dt = self._dtype(mv[p:p + dlen_descr])
        count = 1
        for s in shape:
            count *= s
        if count * dt.itemsize != dlen:
            raise _errors.CorruptRecordError(
                f"numpy record: shape {shape} of {dt} needs {count * dt.itemsize} bytes, header says {dlen}")
        if dt.itemsize == 0 or count == 0:
            arr = np.empty(shape, dtype=dt)
            arr.flags.writeable = False
            return arr
        arr = np.frombuffer(mv, dtype=dt, count=count, offset=off).reshape(shape)
        if not self.zero_copy and isinstance(rec, memoryview):
            return arr.copy()   # writable, and does not pin the segment
        arr.flags.writeable = False
        return arr

    def decode_batch(self, records: list) -> list:
        return [self.decode_one(r) for r in records]

    def for_segment_size(self, segment_size: int) -> "NumpySerializer":
        """A copy that aligns records for segments of ``segment_size`` (see
        ArrowSerializer.for_segment_size); the dtype caches are shared."""
        if int(segment_size) == self.segment_size:
            return self
        other = copy.copy(self)
        other.segment_size = int(segment_size)
        return other

    def __repr__(self):
        return f"NumpySerializer(segment_size={self.segment_size})"


if pa is not None:
    register_serializer("arrow", ArrowSerializer)
    try:
        import pandas as _pd  # noqa: F401

        register_serializer("pandas", PandasSerializer)
    except ImportError:  # pragma: no cover
        pass
register_serializer("numpy", NumpySerializer)
