"""Keeping a partition's batch order through operators with parallelism > 1.

``build(stream)`` receives an ``OrderedStream`` when order must be kept. It
records the user's operators. If all of them run with parallelism 1 the
runtime keeps order by itself (one FIFO chain) and the operators are replayed
unchanged on the real stream. Otherwise every input batch gets a sequence
number and travels as ``(seq, [records])``; each operator is lifted to act
on the list (map: each record; flat_map: concatenation; filter: keep or
drop) so that exactly one envelope per input batch reaches the sink, where a
reorder buffer hands the records back in input order. The reorder buffer is
bounded by what the pipeline holds in flight: a slow envelope backpressures
the source once its subtask's channel is full.

Envelopes use ``SequencedSerializer``: each record inside is encoded by the
Arrow / pandas / NumPy serializers (self-describing, zero-copy decode) or by
pickle for anything else.

Arrow batches of one partition share one schema. ``PartitionArrowSerializer``
keeps the ``arrow`` kind's record layout (a self-describing IPC stream) but
serializes a schema once and, when reading, parses it once: a record whose
schema bytes equal the last ones seen is decoded from its batch message alone.
Opening an IPC stream writer and reader per record cost more than the rest of
a 1,000-row batch's trip through the pipeline.
"""
from __future__ import annotations

import pickle
import struct
from typing import Any, Callable

from pyflowbuf import errors as _errors
from pyflowbuf.serializers import Serializer
from pyflowbuf.serializers_arrow import (
    _HDR, _PAD, DEFAULT_SEGMENT_SIZE, FLAG_PANDAS, MAGIC, TAG_ARROW, TAG_NUMPY, VERSION, ArrowSerializer,
    NumpySerializer, PandasSerializer, _check_header, _payload_offset, _tail_pad, pa)
from pyflowbuf.spark._schema import to_record_batch

TAG_SEQ = ord("S")
TAG_PICKLE = ord("P")
_SEQ_HDR = struct.Struct("<BBBBQ")   # magic, tag, version, flags, seq  (12 bytes)
_LEN = struct.Struct("<I")


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"   # an IPC stream's end marker
# Batches up to this size are serialized alone and joined to their header (one
# more copy); above it opening a stream writer costs less than that copy.
_SERIALIZE_MAX = 256 * 1024


def _has_dictionary(t) -> bool:
    return pa.types.is_dictionary(t) or any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def _bytes_view(rec) -> memoryview:
    """An unsigned-byte view (a pyarrow Buffer exports signed bytes, which
    compare unequal to ``bytes`` wherever a byte is >= 0x80)."""
    mv = rec if isinstance(rec, memoryview) else memoryview(rec)
    return mv if mv.format == "B" else mv.cast("B")


def _batch_message_schema(schema) -> bool:
    """Whether a batch of ``schema`` travels as one batch message: dictionary
    columns need their own messages (the stream path)."""
    return not any(_has_dictionary(f.type) for f in schema)


class PartitionArrowSerializer(ArrowSerializer):
    """Arrow RecordBatches whose schema rarely changes (a Spark partition's).

    Records have the ``arrow`` kind's layout: header, then an IPC stream of
    the schema, one batch and the end marker, so ``ArrowSerializer`` reads
    them and this class reads ``ArrowSerializer``'s. Writing serializes each
    new schema once and a batch up to 256 KiB alone (``RecordBatch.serialize``); reading
    compares the record's schema bytes with the last schema parsed and, when
    they match, decodes the batch message alone (``ipc.read_record_batch``).
    A new schema, dictionary columns or compression take ``ArrowSerializer``'s
    path. Records are decoded in place as ``ArrowSerializer``'s are; a payload
    that is not 8-byte aligned (a record that straddled segments) is copied
    once so that Arrow's buffers are aligned.

    ``accept_pandas=True`` also takes ``pandas.DataFrame`` records, converted
    as ``mapInArrow`` output is (``RecordBatch.from_pandas``, no index).
    """

    name = "spark-arrow"   # not "arrow": with accept_pandas it takes DataFrames too

    def __init__(self, segment_size: int = DEFAULT_SEGMENT_SIZE, *, accept_pandas: bool = False,
                 zero_copy: bool = True):
        super().__init__(segment_size, None, zero_copy)
        self.accept_pandas = bool(accept_pandas)
        # each cache is one attribute replaced whole: safe when subtasks share the instance
        self._encode_cache = None   # (schema, its IPC bytes or None when the batch path cannot serve it)
        self._decode_cache = None   # (schema IPC bytes, schema)

    def _as_batch(self, rec, i: int):
        if isinstance(rec, pa.RecordBatch):
            return rec
        if isinstance(rec, pa.Table):
            return super()._as_batch(rec, i)
        if self.accept_pandas:
            return to_record_batch(rec, i)   # its error names what mapInArrow output may be
        return super()._as_batch(rec, i)

    def _schema_bytes(self, schema):
        last = self._encode_cache
        if last is not None and (schema is last[0] or schema.equals(last[0], check_metadata=True)):
            return last[1]
        # a batch message alone cannot carry dictionaries: those batches take the stream path
        sb = schema.serialize().to_pybytes() if _batch_message_schema(schema) else None
        self._encode_cache = (schema, sb)
        return sb

    def _encode(self, batch, flags: int = 0):
        sb = self._schema_bytes(batch.schema)
        if sb is None or pa.ipc.get_record_batch_size(batch) > _SERIALIZE_MAX:
            # a large batch: the stream writer's fixed cost is small beside the
            # copy that joining a serialized message to its header would add
            return super()._encode(batch, flags)
        msg = batch.serialize()
        dlen = len(sb) + msg.size + len(_EOS)
        off = _payload_offset(_HDR.size, _HDR.size + dlen, self.segment_size)
        hdr = bytearray(off)
        _HDR.pack_into(hdr, 0, MAGIC, TAG_ARROW, VERSION, flags, off, dlen)
        return b"".join([hdr, sb, msg, _EOS, _PAD[:_tail_pad(off + dlen)]])

    def _decode_at(self, rec, off, dlen):
        cache = self._decode_cache
        if cache is not None:
            sb, schema = cache
            n = len(sb)
            mv = _bytes_view(rec)
            if dlen > n + len(_EOS) and mv[off:off + n] == sb:
                start, size = off + n, dlen - n - len(_EOS)
                buf = pa.py_buffer(mv)
                if (buf.address + start) % 8 or (not self.zero_copy and isinstance(rec, memoryview)):
                    # own, aligned memory: one copy of the message (bytes data is 16-aligned)
                    buf, start = pa.py_buffer(mv[start:start + size].tobytes()), 0
                try:
                    return pa.ipc.read_record_batch(buf.slice(start, size), schema)
                except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
                    raise _errors.CorruptRecordError(
                        f"arrow record of {dlen} payload bytes holds no valid batch message: {exc}") from exc
        batch = super()._decode_at(rec, off, dlen)
        if _batch_message_schema(batch.schema):
            sb = batch.schema.serialize().to_pybytes()
            if _bytes_view(rec)[off:off + len(sb)] == sb:   # a stream this class can take apart next time
                self._decode_cache = (sb, batch.schema)
        return batch


class SequencedSerializer(Serializer):
    """``(seq, [records])`` envelopes. Layout: a 12-byte header with the
    sequence number, then per record a u32 length and the record as its own
    serializer encodes it (length 4 mod 8, so every inner record starts where
    a standalone record would and decodes in place)."""

    name = "pyflowbuf-seq"
    core_kind = "bytes"
    zero_copy_min = 0
    in_process_only = True   # may carry pickled records

    def __init__(self):
        self.arrow = PartitionArrowSerializer()
        self.numpy = NumpySerializer()
        self._pandas = None

    @property
    def pandas(self):
        if self._pandas is None:   # pandas is imported only when a frame comes by
            self._pandas = PandasSerializer()
        return self._pandas

    def _encode_item(self, x):
        import numpy as np
        import pyarrow as pa

        if isinstance(x, (pa.RecordBatch, pa.Table)):
            return self.arrow.encode_one(x)
        mod = type(x).__module__
        if mod.startswith("pandas"):
            import pandas as pd

            if isinstance(x, (pd.DataFrame, pd.Series)):
                return self.pandas.encode_one(x)
        if isinstance(x, np.ndarray) and not x.dtype.hasobject:
            return self.numpy.encode_one(x)
        data = pickle.dumps(x, 5)
        off = _HDR.size
        hdr = bytearray(off)
        _HDR.pack_into(hdr, 0, MAGIC, TAG_PICKLE, VERSION, 0, off, len(data))
        return b"".join([hdr, data, _PAD[:_tail_pad(off + len(data))]])

    def encode_one(self, envelope):
        try:
            seq, items = envelope
        except (TypeError, ValueError):
            raise TypeError(f"a sequenced stream takes (seq, [records]) envelopes, got {type(envelope).__name__}")
        parts = [None]
        for x in items:
            rec = self._encode_item(x)
            parts.append(_LEN.pack(memoryview(rec).nbytes))
            parts.append(rec)
        hdr = bytearray(_SEQ_HDR.size)
        _SEQ_HDR.pack_into(hdr, 0, MAGIC, TAG_SEQ, VERSION, 0, seq)
        parts[0] = hdr
        return b"".join(parts)

    def encode_batch(self, records: list) -> list:
        return [self.encode_one(r) for r in records]

    def _decode_item(self, mv):
        try:
            tag, flags = mv[1], mv[3]
        except IndexError:
            raise _errors.CorruptRecordError("empty record inside a sequenced envelope") from None
        if tag == TAG_ARROW:
            return self.pandas.decode_one(mv) if flags & FLAG_PANDAS else self.arrow.decode_one(mv)
        if tag == TAG_NUMPY:
            return self.numpy.decode_one(mv)
        if tag == TAG_PICKLE:
            off, dlen = _check_header(mv, TAG_PICKLE, "pickled")
            return pickle.loads(mv[off:off + dlen])
        raise _errors.CorruptRecordError(f"unknown record tag {tag:#x} inside a sequenced envelope")

    def decode_one(self, rec):
        mv = rec if isinstance(rec, memoryview) else memoryview(rec)
        mv = mv.cast("B") if mv.format != "B" else mv
        try:
            magic, tag, version, _flags, seq = _SEQ_HDR.unpack_from(mv, 0)
        except struct.error as exc:
            raise _errors.CorruptRecordError("sequenced envelope shorter than its header") from exc
        if magic != MAGIC or tag != TAG_SEQ or version != VERSION:
            raise _errors.CorruptRecordError("not a pyflowbuf sequenced envelope")
        items = []
        p, n = _SEQ_HDR.size, mv.nbytes
        while p < n:
            if p + 4 > n:
                raise _errors.CorruptRecordError("sequenced envelope ends inside a length")
            (k,) = _LEN.unpack_from(mv, p)
            p += 4
            if p + k > n:
                raise _errors.CorruptRecordError("sequenced envelope ends inside a record")
            items.append(self._decode_item(mv[p:p + k]))
            p += k
        return seq, items

    def decode_batch(self, records: list) -> list:
        return [self.decode_one(r) for r in records]


# ---------------------------------------------------------------- the proxy

_PASS = object()


class OrderedStream:
    """What ``build`` gets when order is kept: ``map``, ``flat_map``,
    ``filter``, ``map_batches``, ``rebalance`` and ``forward`` with the
    signatures of ``pyflowbuf.Stream``. Other Stream methods (keyed state,
    sinks) need ``preserve_order=False``."""

    def __init__(self, ops: tuple = ()):
        self._ops = ops

    def _add(self, *op) -> "OrderedStream":
        return OrderedStream(self._ops + (op,))

    def map(self, fn: Callable, *, parallelism: int | None = None, name: str = "map", kind: Any = None):
        _check_fn(fn, "map")
        return self._add("map", fn, parallelism, name, kind)

    def map_batches(self, fn: Callable, *, parallelism: int | None = None, name: str = "map_batches",
                    kind: Any = None):
        _check_fn(fn, "map_batches")
        return self._add("map_batches", fn, parallelism, name, kind)

    def flat_map(self, fn: Callable, *, parallelism: int | None = None, name: str = "flat_map",
                 kind: Any = None):
        _check_fn(fn, "flat_map")
        return self._add("flat_map", fn, parallelism, name, kind)

    def filter(self, fn: Callable, *, parallelism: int | None = None, name: str = "filter"):
        _check_fn(fn, "filter")
        return self._add("filter", fn, parallelism, name, None)

    def rebalance(self):
        return self._add("rebalance", None, None, None, None)

    def forward(self):
        return self._add("forward", None, None, None, None)

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise AttributeError(
            f"{attr}() is not available while the partition's row order is preserved; pass "
            "preserve_order=False to get the full pyflowbuf Stream API (keyed operators, sinks)")

    # -- replay --
    def needs_sequencing(self, env_parallelism: int) -> bool:
        for op, _fn, p, _name, _kind in self._ops:
            if op in ("map", "map_batches", "flat_map", "filter") and (p or env_parallelism) > 1:
                return True
        return False

    def replay(self, stream, sequenced: bool):
        for op, fn, p, name, kind in self._ops:
            if op == "rebalance":
                stream = stream.rebalance()
            elif op == "forward":
                stream = stream.forward()
            elif not sequenced:
                if op == "filter":
                    stream = stream.filter(fn, parallelism=p, name=name)
                else:
                    stream = getattr(stream, op)(fn, parallelism=p, name=name, kind=kind)
            else:
                stream = stream.map(_lift(op, fn), parallelism=p, name=name, kind=SequencedSerializer())
        return stream


def _check_fn(fn, what):
    if not callable(fn):
        raise TypeError(f"{what} takes a function, got {type(fn).__name__}")


def _lift(op: str, fn: Callable) -> Callable:
    if op in ("map", "map_batches"):
        def lifted(env):
            return env[0], [fn(x) for x in env[1]]
    elif op == "flat_map":
        def lifted(env):
            return env[0], [y for x in env[1] for y in fn(x)]
    elif op == "filter":
        def lifted(env):
            return env[0], [x for x in env[1] if fn(x)]
    else:  # pragma: no cover
        raise ValueError(op)
    lifted.__name__ = getattr(fn, "__name__", op)
    return lifted


def _detach(x):
    """A copy of a record that may be a view over a segment. Records parked in
    the reorder buffer must not pin their producers' segments: a producer
    whose pool is pinned stops, and with it, through the shared source, the
    subtask that holds the record everybody waits for."""
    mod = type(x).__module__
    if mod.startswith("pyarrow"):
        import pyarrow as pa

        if isinstance(x, pa.RecordBatch):
            try:
                return pa.RecordBatch.from_arrays([pa.concat_arrays([c]) for c in x.columns], schema=x.schema)
            except (pa.ArrowException, TypeError):
                return x.take(pa.array(range(x.num_rows), pa.int64()))
        return x
    if mod == "numpy":
        import numpy as np

        if isinstance(x, np.ndarray) and x.base is not None:
            return x.copy()
        return x
    if isinstance(x, memoryview):
        return x.tobytes()
    return x   # pandas objects and pickled records are already copies


def reorder(envelopes):
    """Yield the records of ``(seq, items)`` envelopes in sequence order.
    Records that arrive early are copied while they wait (see ``_detach``)."""
    pending: dict = {}
    nxt = 0
    for seq, items in envelopes:
        if seq != nxt:
            pending[seq] = [_detach(x) for x in items]
            continue
        yield from items
        nxt += 1
        while nxt in pending:
            yield from pending.pop(nxt)
            nxt += 1
    if pending:
        raise RuntimeError(f"pyflowbuf: {len(pending)} batch(es) arrived without their predecessors "
                           f"(next expected {nxt}, have {sorted(pending)[:5]})")
