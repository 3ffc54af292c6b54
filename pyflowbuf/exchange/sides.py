"""The two sides of an exchange inside a task: OutputSide (a ResultPartition
with its RecordWriter) and InputSide (an InputGate with its RecordReader).
Both decide the record encoding once per stream, not per record. A task with
several inputs reads them through a MultiInput: one InputSide per input.

On a timestamped stream (``JobEdge.timestamped``) both ends frame each record
with its event time: ``OutputSide.emit(batch, ts)`` takes the batch's times (an
array('d')), and after ``InputSide.read`` the side's ``ts`` holds the times of
the batch read; a stream without timestamps carries none and pays nothing."""
from __future__ import annotations

import copy
import functools
import threading
import weakref
import time

import numpy as np

from pyflowbuf import errors
from pyflowbuf._validation import check_keys
from pyflowbuf._core.events import BARRIER, BARRIER_UNALIGNED, EVT_KIND, EVT_WATERMARK
from pyflowbuf._core.serde import DEFAULT_ZERO_COPY_MIN, RecordReader, RecordWriter
from pyflowbuf.serializers import CoreSerializer, get_serializer, infer_kind, record_type_error


# EVT_KIND and EVT_WATERMARK (their payloads: csrc/fb_events.h) are imported
# above and stay importable from here.
_NEVER = (1 << 32) - 1  # a zero_copy_min no record reaches: always copies


def kind_code(name: str) -> int:
    raw = name.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"kind name {name!r} is longer than 8 bytes")
    return int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True)


def kind_name(code: int) -> str:
    return code.to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii")


class EdgeKind:
    """The record kind of one edge: fixed by the graph (``fixed``), or inferred
    from the first record a producer emits (set once, shared by the producers
    in this process; consumers learn it from the EVT_KIND event)."""

    def __init__(self, kind):
        self._lock = threading.Lock()
        self.fixed = kind is not None
        self.value = None if kind is None else self._resolve(kind)

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

    @property
    def is_rows(self):
        return isinstance(self.value, np.dtype)


class OutputSide:
    """One ResultPartition of a subtask: a LocalBufferPool, one BufferQueue per
    subpartition, and the partitioner deciding where each record goes.

    Built complete by the deployment; what is known only later has one
    declared step each: ``produced_by`` (the task names the operator whose
    records it writes) and ``overtaken_listener`` (the subtask's
    checkpointing, for unaligned checkpoints).

    max_parallelism
        key_by: route by key group (pyflowbuf.checkpoint.keygroups); 0 routes
        by hash modulo the subpartitions (an exchange outside a job's graph).
    consumer
        The operator a key_by feeds, to blame a bad key on it.
    tag, source_node
        A side output's partition: the tag's name and the id of the node that
        emits to it (None: the chain's main output).
    remote
        Unaligned checkpoints: whether another process reads each
        subpartition (None: none does).
    key_codec_error
        key_by in a job that checkpoints keyed state: ``key_codec_error(key)``
        says why the checkpoint codec cannot store a key (None: it can).
    """

    # key_by: whether the keys of the first batch were checked (check_keys)
    keys_checked = False

    def __init__(self, pool, queues, partitioner, key_fn, kind: EdgeKind, max_record_size, timestamped=False, *,
                 max_parallelism: int = 0, consumer: str | None = None, tag: str | None = None,
                 source_node=None, remote: list | None = None, key_codec_error=None):
        self.pool = pool
        self.timestamped = timestamped
        self.queues = queues
        self.partitioner = partitioner
        self.key_fn = key_fn
        self.kind = kind
        self.max_record_size = max_record_size
        self.max_parallelism = max_parallelism
        self.consumer = consumer
        self.tag = tag
        self.source_node = source_node
        self.key_codec_error = key_codec_error
        self.writer = None
        self._rr = 0
        self.records_out = 0
        # the operator (or source) whose records this side writes, for error
        # messages (``produced_by``); the job failure names it either way
        self.producer = None
        # unaligned checkpoints: which subpartitions another process reads,
        # where each aligned barrier went into each queue (so the alignment
        # timeout can send an overtaking copy that stops there), and who hears
        # what a network sender's overtaking barrier passed
        self.remote = [False] * len(queues) if remote is None else list(remote)
        if len(self.remote) != len(queues):
            raise ValueError(f"remote names {len(self.remote)} subpartitions, the side has {len(queues)}")
        self.barrier_marks: dict = {}
        self.overtaken_listener = None
        me = weakref.ref(self)     # no cycle through the queues: they outlive nothing
        for sub, q in enumerate(queues):
            q.overtaken_sink = functools.partial(_overtaken, me, sub)

    def produced_by(self, name: str) -> None:
        """The operator (or source) whose records this side writes: its task
        says, once it knows which operator of its chain feeds the side."""
        self.producer = name

    def _open_writer(self, first):
        kind = self.kind.resolve_from(first)
        core = "bytes" if isinstance(kind, np.dtype) else kind.core_kind
        self.writer = RecordWriter(self.pool, self.queues, kind=core, max_record_size=self.max_record_size,
                                   timestamped=self.timestamped)
        # the batch kinds align records by segment: the job's segments, not their default
        self.serializer = None if isinstance(kind, np.dtype) else kind.for_segment_size(self.pool.segment_size)
        self.dtype = kind if isinstance(kind, np.dtype) else None
        if self.dtype is not None and self.partitioner == "hash":
            raise ValueError("key_by on a rows (NumPy) stream is not supported; map rows to records first")
        if not self.kind.fixed:
            self.writer.broadcast_event(EVT_KIND, kind_code(kind.name))

    def emit(self, batch: list, ts=None) -> None:
        """Write ``batch`` (``ts``: its records' times, for a timestamped stream;
        ignored on one without)."""
        w = self.writer
        if w is None:
            self._open_writer(batch[0])
            w = self.writer
        if self.dtype is not None:
            self._emit_arrays(batch)
            return
        ser = self.serializer
        part = self.partitioner
        records = batch
        if part == "hash" and (w.num_channels > 1 or not self.keys_checked):
            # keys come from the records as the user's function sees them,
            # before a serializer turns them into bytes
            key_fn = self.key_fn
            try:
                keys = [key_fn(x) for x in batch]
                if not self.keys_checked:
                    # once, at every parallelism: one subtask routes no key,
                    # and a bad key would be a wrong answer or fail later
                    self.keys_checked = True
                    check_keys(keys, self.consumer or "?", key_fn, self.key_codec_error)
            except Exception as exc:
                raise self._key_by_failed(exc)
        if type(ser) is not CoreSerializer:
            batch = ser.encode_batch(batch)
        if not self.timestamped:
            ts = None
        elif ts is None:
            raise errors.FlowBufError(
                f"operator {self.producer!r} emitted {len(batch)} record(s) without timestamps on a "
                "stream that carries them")
        try:
            if part == "forward" or w.num_channels == 1:
                w.write_batch(batch, 0, ts)
            elif part == "rebalance":
                w.write_batch_rebalance(batch, ts)
            elif part == "hash":
                w.write_batch_keyed(batch, keys, ts, self.max_parallelism)
            else:
                w.write_batch_broadcast(batch, ts)
        except errors.KeyTypeError as exc:
            raise self._key_by_failed(exc)
        except TypeError as exc:
            # The C writer type-checks as it writes and says which index
            # failed; show the record itself instead.
            i = getattr(exc, "record_index", None)
            if i is None or type(ser) is not CoreSerializer or isinstance(exc, errors.KeyTypeError):
                raise
            reason = str(exc.__cause__ or exc)
            raise record_type_error(ser, records[i], operator=self.producer, reason=reason) from exc

    def _key_by_failed(self, exc):
        """The key function ran here, in the producer's task, but the fault is
        key_by's: the failure names it (``failed_operator``, read by the job)."""
        exc.failed_operator = f"key_by (into {self.consumer!r})" if self.consumer else "key_by"
        return exc

    def _emit_arrays(self, batch):
        w, n = self.writer, self.writer.num_channels
        for arr in batch:
            arr = np.asarray(arr)
            if arr.dtype != self.dtype:
                raise errors.RecordTypeError(
                    f"a rows stream of dtype {self.dtype} got an array of dtype {arr.dtype}")
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

    def broadcast_event(self, kind: int, aux: int = 0, flags: int = 0, priority: bool = False) -> None:
        """Send an event (a checkpoint barrier, a cancel marker) to every
        consumer, after the records written before it: partly filled buffers
        ship first, so the event keeps its place in every subpartition. A
        priority event (an unaligned barrier) overtakes what is queued: those
        buffers, shipped just before, are what it overtook."""
        if self.writer is not None:
            self.writer.flush()
        if kind == BARRIER and not priority:
            marks = self.barrier_marks
            marks[aux] = [q.push_position for q in self.queues]
            if len(marks) > 4:
                del marks[min(marks)]
        if self.writer is not None:
            self.writer.broadcast_event(kind, aux, flags, priority)
            return
        for q in self.queues:      # nothing written yet: no buffer to ship first
            q.push_event(kind, aux, flags, priority)

    def convert_barrier(self, checkpoint_id: int) -> None:
        """The alignment timeout passed: send an overtaking copy of aligned
        barrier n, which overtakes only what was queued before the original
        (a consumer past the original ignores it)."""
        marks = self.barrier_marks.pop(checkpoint_id, None)
        if marks is None:
            return
        for q, mark in zip(self.queues, marks):
            q.push_event(BARRIER, checkpoint_id, BARRIER_UNALIGNED, True, mark)

    @property
    def kind_name(self):
        """The inferred record kind's name (a consumer restored from in-flight
        data must learn it before that data), or None when the graph fixed it."""
        if self.kind.fixed or self.kind.value is None or self.kind.is_rows:
            return None
        return self.kind.value.name

    def replay(self, sub: int, items, kind_name=None) -> None:
        """Re-send in-flight output recorded by an unaligned checkpoint to
        subpartition ``sub``, before any new record: through this side's pool,
        so it waits for buffers like any output (backpressure holds)."""
        q = self.queues[sub]
        if kind_name is not None:
            q.push_event(EVT_KIND, kind_code(kind_name))
        for dtype, width, flags, aux, payload in items:
            if payload is None:
                q.push_event(width, aux, flags)
                continue
            buf = self.pool.request_blocking()
            buf.write(payload)
            buf.set_meta(len(payload), "fixed" if dtype == 1 else "records", width, flags, aux)
            q.push_buffer(buf)

    def end_input(self):
        if self.writer is None:
            # nothing was written: still tell every consumer this partition is done
            RecordWriter(self.pool, self.queues).end_input()
            return
        self.writer.end_input()

    def cancel(self):
        self.pool.cancel_waiters()
        for q in self.queues:
            q.cancel()

    @property
    def backpressure_ns(self):
        """Time spent waiting for an output buffer, the wait in progress
        included (a source blocked for seconds is backpressured all along,
        not busy until its wait ends)."""
        w = self.writer
        if w is None:
            return 0
        since = w.wait_since_ns
        return w.backpressure_ns + (time.monotonic_ns() - since if since else 0)

    @property
    def records(self):
        return 0 if self.writer is None else self.writer.records_out

    @property
    def bytes(self):
        return 0 if self.writer is None else self.writer.bytes_out


def _overtaken(side_ref, sub, checkpoint_id, items):
    """A network sender's word on barrier ``checkpoint_id`` in subpartition
    ``sub`` of an OutputSide (see ``OutputSide.overtaken_listener``)."""
    side = side_ref()
    listener = None if side is None else side.overtaken_listener
    if listener is not None:
        listener(checkpoint_id, sub, items)


class InputSide:
    """An InputGate and its RecordReader for one subtask.

    The reader starts undecided unless the graph fixed the kind: the first
    thing each producer sends is EVT_KIND (or end-of-partition), never data,
    so nothing is decoded before the kind is known."""

    def __init__(self, gate, kind: EdgeKind, max_record_size, producer_pools,
                 remote_channels=(), allow_pickle=False, owned=False, timestamped=False):
        self.gate = gate
        self.timestamped = timestamped
        self.ts = None          # timestamped: the times of the batch read last
        # owned: hand out records that own their memory (no views pinning
        # segments), for consumers that keep records (the iterator sink)
        self.owned = owned
        self.producer_pools = producer_pools
        self.remote_channels = tuple(remote_channels)
        self.allow_pickle = allow_pickle
        self.reader = RecordReader(gate, max_record_size=max_record_size,
                                   zero_copy_min=_NEVER if owned else DEFAULT_ZERO_COPY_MIN,
                                   timestamped=timestamped)
        self.kind = None
        self.decode = None
        self.dtype = None
        self._event = None
        self.fixed_kind = kind.fixed
        if kind.fixed:
            self._configure(kind.value)

    def _configure(self, kind):
        if self.kind is not None:
            if kind.name != self.kind.name:
                raise TypeError(
                    f"producers of one stream inferred different record kinds ({self.kind.name} and "
                    f"{kind.name}); give the operator an explicit kind=")
            return
        if self.remote_channels and getattr(kind, "in_process_only", False) and not self.allow_pickle:
            raise errors.FlowBufError(
                f"a {kind.name!r} stream would unpickle bytes received from another process; give the "
                "operator a kind= that crosses processes (int64, float64, str, bytes, struct for tuples, "
                "lists and dicts of plain values, arrow, pandas, numpy) or pass "
                "Environment(allow_pickle=True) if every worker is trusted")
        self.kind = kind
        if isinstance(kind, np.dtype):
            self.dtype = kind
            return
        if type(kind) is not CoreSerializer:
            if self.owned and getattr(kind, "zero_copy", False):
                kind = copy.copy(kind)
                kind.zero_copy = False
            self.decode = kind.decode_batch
            if kind.zero_copy_min != self.reader.zero_copy_min:
                # nothing has been decoded yet, so a fresh reader loses nothing
                old = self.reader
                self.reader = RecordReader(self.gate, kind=kind.core_kind, zero_copy_min=kind.zero_copy_min,
                                           max_record_size=old.max_record_size, timestamped=self.timestamped)
                self.reader.take_over(old)
                return
        self.reader.set_kind(kind.core_kind)

    def read(self, max_records, timeout):
        """A batch of records ([] on timeout, at an event, at the end)."""
        while True:
            if self.dtype is not None:
                arr = self.reader.read_array(self.dtype, timeout=timeout)
                if arr is not None:
                    return [arr.copy() if self.owned else arr]
            else:
                batch = self.reader.read_batch(max_records, timeout=timeout)
                if batch:
                    if self.timestamped:
                        self.ts = self.reader.timestamps
                    return self.decode(batch) if self.decode is not None else batch
            event = self.reader.take_event()
            if event is None:
                return []
            if event[1] != EVT_KIND:
                self._event = event
                return []
            self._configure(get_serializer(kind_name(event[2])))
            timeout = 0

    @property
    def kind_name(self):
        """The record kind learnt from the producers (None if not yet, or
        fixed by the graph, or rows): restored in-flight input needs it first."""
        k = self.kind
        if k is None or isinstance(k, np.dtype) or self.fixed_kind:
            return None
        return k.name

    def take_event(self):
        """The event that ended the last read, as (channel, kind, aux, flags)."""
        ev, self._event = self._event, None
        return ev

    @property
    def has_event(self):
        """An event ended the last read and was not taken yet: data behind it
        must wait until it is handled."""
        return self._event is not None

    @property
    def notifier(self):
        return self.gate.notifier

    @property
    def num_channels(self):
        return self.gate.num_channels

    def channel_finished(self, channel):
        """Whether ``channel`` delivered its end-of-partition."""
        r = self.reader
        if r is None:
            return self._final[2][channel]
        return r.channel_finished(channel)

    def block(self, channel):
        """Read no data from ``channel`` until ``resume`` (barrier alignment)."""
        self.gate.block(channel)

    def resume(self, channel=-1):
        self.gate.resume(channel)

    def cancel(self):
        self.gate.cancel()

    @property
    def cancelled(self):
        return bool(self.gate.cancelled)

    @property
    def idle_ns(self):
        return self.gate.idle_ns

    def release(self):
        """Once nothing reads this input any more: drop the reader, giving back
        the buffers it still holds (a failed or cancelled job stops mid-buffer)."""
        r = self.reader
        if r is not None:
            self._final = (r.bytes_in, r.finished, r.channels_finished)
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


class MultiInput:
    """The inputs of a subtask that reads several streams (union, connect).

    One InputSide per input, each with its own InputGate and RecordReader (the
    inputs may carry different record kinds), every gate parking on one
    shared Notifier so that a push to any channel of any input wakes the task.
    Reads take the inputs in turn, so a busy input cannot starve another.

    ``read`` returns ``(input_index, batch)``; an event (a barrier, say) ends
    a read of its input with ``(input_index, [])``, and until ``take_event``
    hands it out as ``(input_index, event)`` no input is read any further, so
    the task sees each event in its place in the stream. Alignment blocks and
    resumes single channels with ``block(input_index, channel)`` and
    ``resume(input_index, channel)``.
    """

    def __init__(self, sides):
        sides = list(sides)
        if len(sides) < 2:
            raise ValueError(f"a MultiInput reads at least two inputs, got {len(sides)}")
        notifier = sides[0].gate.notifier
        if any(s.gate.notifier is not notifier for s in sides):
            # a push to a gate with another notifier would not wake the task
            raise ValueError("the gates of a MultiInput must share one Notifier")
        self.sides = sides
        self.notifier = notifier
        self._next = 0
        self._wait_ns = 0

    @property
    def num_inputs(self):
        return len(self.sides)

    def _poll(self, max_records):
        """(input_index, batch) of the next input with something now, starting
        after the one read last; (i, []) at an event of input i; (-1, []) when
        nothing is there."""
        sides = self.sides
        n = len(sides)
        for k in range(n):
            i = self._next + k
            if i >= n:
                i -= n
            side = sides[i]
            if side.finished:
                continue
            batch = side.read(max_records, 0)
            if batch:
                self._next = i + 1 if i + 1 < n else 0
                return i, batch
            if side.has_event:
                return i, batch
        return -1, []

    def read(self, max_records, timeout):
        """``(input_index, batch)``: records of one input, waiting up to
        ``timeout`` s (None: no limit) when no input has any; ``(i, [])`` at an
        event of input i (see ``take_event``); ``(-1, [])`` on timeout, at the
        end, or after a wake-up that brought no records (a mail, a resumed
        channel), so the task gets to look at its mailbox."""
        for i, side in enumerate(self.sides):
            if side.has_event:
                return i, []
        got = self._poll(max_records)
        if got[0] >= 0 or timeout == 0:
            return got
        notifier = self.notifier
        token = notifier.prepare()
        waiting = False
        try:
            # after prepare(): a push from here on wakes the wait below
            got = self._poll(max_records)
            if got[0] >= 0 or self.finished:
                return got
            if any(s.cancelled for s in self.sides):
                raise errors.CancelledError("reading the input gates: cancelled")
            waiting = True
        finally:
            if not waiting:
                notifier.cancel()     # wait() retires the waiter itself
        t0 = time.monotonic_ns()
        notifier.wait(token, timeout)
        self._wait_ns += time.monotonic_ns() - t0
        return self._poll(max_records)

    def take_event(self):
        """``(input_index, (channel, kind, aux, flags))`` of the event that ended
        the last read, or None."""
        for i, side in enumerate(self.sides):
            if side.has_event:
                return i, side.take_event()
        return None

    def block(self, input_index, channel):
        self.sides[input_index].block(channel)

    def resume(self, input_index, channel=-1):
        self.sides[input_index].resume(channel)

    def channel_finished(self, input_index, channel):
        return self.sides[input_index].channel_finished(channel)

    def cancel(self):
        for s in self.sides:
            s.cancel()

    def release(self):
        for s in self.sides:
            s.release()

    @property
    def finished(self):
        """Every input delivered end-of-partition on every channel."""
        return all(s.finished and not s.has_event for s in self.sides)

    @property
    def idle_ns(self):
        return self._wait_ns + sum(s.idle_ns for s in self.sides)

    @property
    def bytes_in(self):
        return sum(s.bytes_in for s in self.sides)

    @property
    def in_pool_usage(self):
        cap = sum(p.max_size for s in self.sides for p in s.producer_pools) or 1
        return min(1.0, sum(s.gate.queued_buffers for s in self.sides) / cap)
