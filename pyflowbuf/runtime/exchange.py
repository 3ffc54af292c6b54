"""The two sides of an exchange inside a task: OutputSide (a ResultPartition
with its RecordWriter) and InputSide (an InputGate with its RecordReader).
Both decide the record encoding once per stream, not per record."""
from __future__ import annotations

import threading

import numpy as np

from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.serializers import CoreSerializer, get_serializer, infer_kind


class EdgeKind:
    """The record kind of one edge, fixed by the graph or by the first record a
    producer emits (set once, shared by all producers and consumers)."""

    def __init__(self, kind, producers: int = 1):
        self._lock = threading.Lock()
        self.value = None if kind is None else self._resolve(kind)
        self._open_producers = producers

    @staticmethod
    def _resolve(kind):
        if isinstance(kind, np.dtype):
            return kind
        return get_serializer(kind)

    def resolve_from(self, record):
        if self.value is None:
            with self._lock:
                if self.value is None:
                    self.value = self._resolve(infer_kind(record))
        return self.value

    def producer_ended_empty(self):
        """A producer ended without writing; once all have, any kind will do."""
        with self._lock:
            self._open_producers -= 1
            if self._open_producers <= 0 and self.value is None:
                self.value = CoreSerializer("bytes")

    @property
    def is_rows(self):
        return isinstance(self.value, np.dtype)


class OutputSide:
    """One ResultPartition of a subtask: a LocalBufferPool, one BufferQueue per
    subpartition, and the partitioner deciding where each record goes."""

    def __init__(self, pool, queues, partitioner, key_fn, kind: EdgeKind, max_record_size):
        self.pool = pool
        self.queues = queues
        self.partitioner = partitioner
        self.key_fn = key_fn
        self.kind = kind
        self.max_record_size = max_record_size
        self.writer = None
        self._rr = 0
        self.records_out = 0

    def _open_writer(self, first):
        kind = self.kind.resolve_from(first)
        core = "bytes" if isinstance(kind, np.dtype) else kind.core_kind
        self.writer = RecordWriter(self.pool, self.queues, kind=core, max_record_size=self.max_record_size)
        self.serializer = None if isinstance(kind, np.dtype) else kind
        self.dtype = kind if isinstance(kind, np.dtype) else None
        if self.dtype is not None and self.partitioner == "hash":
            raise ValueError("key_by on a rows (NumPy) stream is not supported; map rows to records first")

    def emit(self, batch: list) -> None:
        w = self.writer
        if w is None:
            self._open_writer(batch[0])
            w = self.writer
        if self.dtype is not None:
            self._emit_arrays(batch)
            return
        ser = self.serializer
        if type(ser) is not CoreSerializer:
            batch = ser.encode_batch(batch)
        part = self.partitioner
        if part == "forward" or w.num_channels == 1:
            w.write_batch(batch)
        elif part == "rebalance":
            w.write_batch_rebalance(batch)
        elif part == "hash":
            key_fn = self.key_fn
            if type(ser) is not CoreSerializer:
                raise ValueError("key_by needs records of a core kind (bytes/int64/float64/str/pickle)")
            w.write_batch_keyed(batch, [key_fn(x) for x in batch])
        else:
            w.write_batch_broadcast(batch)

    def _emit_arrays(self, batch):
        w, n = self.writer, self.writer.num_channels
        for arr in batch:
            arr = np.asarray(arr)
            if arr.dtype != self.dtype:
                raise TypeError(f"a rows stream of dtype {self.dtype} got an array of dtype {arr.dtype}")
            if self.partitioner == "broadcast":
                for ch in range(n):
                    w.write_array(arr, ch)
            else:
                ch = 0
                if self.partitioner == "rebalance" and n > 1:
                    ch, self._rr = self._rr, (self._rr + 1) % n
                w.write_array(arr, ch)

    def flush(self):
        if self.writer is not None:
            self.writer.flush()

    def end_input(self):
        if self.writer is None:
            # nothing was written: still tell every consumer this partition is done
            self.kind.producer_ended_empty()
            RecordWriter(self.pool, self.queues).end_input()
            return
        self.writer.end_input()

    def cancel(self):
        self.pool.cancel_waiters()
        for q in self.queues:
            q.cancel()

    @property
    def backpressure_ns(self):
        return 0 if self.writer is None else self.writer.backpressure_ns

    @property
    def records(self):
        return 0 if self.writer is None else self.writer.records_out

    @property
    def bytes(self):
        return 0 if self.writer is None else self.writer.bytes_out


class InputSide:
    """An InputGate and its RecordReader for one subtask."""

    def __init__(self, gate, kind: EdgeKind, max_record_size, producer_pools):
        self.gate = gate
        self.kind = kind
        self.producer_pools = producer_pools
        self.reader = RecordReader(gate, max_record_size=max_record_size)
        self._configured = False
        self.decode = None
        self.dtype = None

    def _configure(self):
        kind = self.kind.value
        if kind is None:
            return False
        if isinstance(kind, np.dtype):
            self.dtype = kind
        else:
            self.reader.set_kind(kind.core_kind)
            if type(kind) is not CoreSerializer:
                self.decode = kind.decode_batch
                if kind.zero_copy_min == 0:
                    # must be set before the first record: rebuild the reader
                    self.reader = RecordReader(self.gate, kind=kind.core_kind, zero_copy_min=0,
                                               max_record_size=self.reader.max_record_size)
        self._configured = True
        return True

    def read(self, max_records, timeout):
        """A batch of records ([] on timeout/event/end)."""
        if not self._configured and not self._configure():
            # No producer has fixed the kind yet, so nothing can be decoded: park
            # until a producer pushes (it fixes the kind before its first write).
            n = self.gate.notifier
            token = n.prepare()
            if self._configure():
                n.cancel()
            else:
                n.wait(token, 0.05 if timeout is None else min(timeout, 0.05))
                return []
        if self.dtype is not None:
            arr = self.reader.read_array(self.dtype, timeout=timeout)
            return [] if arr is None else [arr]
        batch = self.reader.read_batch(max_records, timeout=timeout)
        if self.decode is not None and batch:
            batch = self.decode(batch)
        return batch

    def release(self):
        """Once nothing reads this input any more: drop the reader, giving back
        the buffers it still holds (a failed or cancelled job stops mid-buffer)."""
        r = self.reader
        if r is not None:
            self._final = (r.bytes_in, r.finished)
            self.reader = None

    @property
    def finished(self):
        r = self.reader      # read once: release() may run in another thread
        return self._final[1] if r is None else r.finished

    @property
    def bytes_in(self):
        r = self.reader
        return self._final[0] if r is None else r.bytes_in

    @property
    def in_pool_usage(self):
        cap = sum(p.max_size for p in self.producer_pools) or 1
        return min(1.0, self.gate.queued_buffers / cap)
