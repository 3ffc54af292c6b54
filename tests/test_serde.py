"""RecordWriter / RecordReader: framing, spanning, kinds, arrays, partitioning,
zero copy, events, backpressure across threads."""
import gc
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyflowbuf import errors, stable_hash
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf._core.channel import BARRIER, END_OF_PARTITION, USER_EVENT
from pyflowbuf._core.serde import DEFAULT_ZERO_COPY_MIN

from pipeline_helpers import wait_for
from reference_model import RefRecordStream, fixed_buffer_counts, parse_records, ref_stable_hash
from strategies import (
    boundary_sizes, float64s, int64s, payload, record_streams, segment_sizes, segments_needed, small_segment_sizes,
    texts, write_ops)


class Pipe:
    """One writer, ``channels`` subpartition queues, a pool big enough for
    everything written before reading (single-threaded tests)."""

    def __init__(self, segment_size=256, segments=64, channels=1, kind="bytes", pool_min=0, **writer_kw):
        self.nbp = NetworkBufferPool(segments, segment_size)
        self.pool = self.nbp.create_pool(pool_min, segments)
        self.queues = [BufferQueue(self.nbp) for _ in range(channels)]
        self.writer = RecordWriter(self.pool, self.queues, kind=kind, **writer_kw)
        self.kind = kind

    def reader(self, channel=None, **kw):
        gate = self.queues[channel] if channel is not None else InputGate(self.queues)
        return RecordReader(gate, kind=kw.pop("kind", self.kind), **kw)

    def drain_buffers(self, channel=0):
        """Pop every queued item of a channel: bytes for buffers, tuples for events."""
        out = []
        while (item := self.queues[channel].pop_buffer()) is not None:
            if isinstance(item, tuple):
                out.append(item)
            else:
                out.append(bytes(memoryview(item)))
                item.recycle()
        return out

    def assert_no_leaks(self):
        if self.nbp.available_segments != self.nbp.total_segments:
            gc.collect()  # only when something may still wait for the collector (it is slow)
        assert self.pool.in_use == 0
        assert self.nbp.available_segments == self.nbp.total_segments


def as_bytes(rec):
    return rec.tobytes() if isinstance(rec, memoryview) else rec


# ----------------------------------------------------------------- round trips


@given(record_streams(), st.sampled_from([0, 1, 64, DEFAULT_ZERO_COPY_MIN, 2**31]), st.data())
def test_bytes_round_trip_over_segment_edges(stream, zero_copy_min, data):
    segment_size, records = stream
    flush_after = data.draw(st.sets(st.integers(0, max(0, len(records) - 1))))
    ref = RefRecordStream(segment_size)
    p = Pipe(segment_size, segments_needed(records, segment_size, len(flush_after)))
    for i, rec in enumerate(records):
        p.writer.write(rec)
        ref.write(rec)
        if i in flush_after:
            p.writer.flush()
            ref.flush()
    assert p.writer.pending_bytes == len(ref.cur)
    p.writer.end_input()
    ref.flush()
    assert p.queues[0].backlog == len(ref.buffers) + 1  # + end of partition
    assert p.writer.buffers_out == len(ref.buffers)
    assert p.writer.records_out == len(records)
    assert p.writer.bytes_out == sum(map(len, records))

    r = p.reader(zero_copy_min=zero_copy_min)
    got = list(r)
    assert [as_bytes(g) for g in got] == records
    for i, (g, rec) in enumerate(zip(got, records)):
        if len(rec) < zero_copy_min or ref.spans(i):
            assert type(g) is bytes, (i, len(rec))
        elif ref.in_one_buffer(i):
            assert type(g) is memoryview and g.readonly, (i, len(rec))
    assert r.finished and r.held_buffers == 0
    assert (r.records_in, r.bytes_in, r.buffers_in) == (
        len(records), sum(len(b) for b in ref.buffers), len(ref.buffers))
    got = g = None
    p.assert_no_leaks()


@given(segment_sizes.flatmap(lambda s: st.tuples(st.just(s), write_ops(s))))
def test_buffers_match_reference_framing(case):
    """Differential: the bytes and buffer boundaries the writer hands over are
    exactly those of the pure-Python framing, flushes included."""
    segment_size, ops = case
    ref = RefRecordStream(segment_size)
    records = []
    for op in ops:
        if op[0] == "write":
            records.append(payload(op[1], op[2]))
    p = Pipe(segment_size, segments_needed(records, segment_size, len(ops)))
    k = 0
    for op in ops:
        if op[0] == "write":
            p.writer.write(records[k])
            ref.write(records[k])
            k += 1
        else:
            p.writer.flush()
            ref.flush()
        assert p.writer.pending_bytes == len(ref.cur)
    p.writer.end_input()
    ref.flush()
    items = p.drain_buffers()
    assert items[-1] == (END_OF_PARTITION, 0, 0)
    assert items[:-1] == ref.buffers
    assert all(0 < len(b) <= segment_size for b in ref.buffers)
    assert parse_records(items[:-1]) == records
    p.assert_no_leaks()


@pytest.mark.parametrize("segment_size", [256, 4096, 65536])
def test_every_boundary_size_alone_and_back_to_back(segment_size):
    sizes = boundary_sizes(segment_size)
    # each boundary size after every offset that leaves 0..5 bytes before the segment end
    records = []
    for n in sizes:
        for pad in range(6):
            records.append(payload(max(0, segment_size - 8 - 4 - pad), n * 7 + pad))
            records.append(payload(n, n + pad))
    p = Pipe(segment_size, segments_needed(records, segment_size))
    p.writer.write_batch(records)
    p.writer.end_input()
    got = [as_bytes(g) for g in p.reader(zero_copy_min=0)]
    assert got == records
    del got
    p.assert_no_leaks()


@given(small_segment_sizes, st.lists(int64s, max_size=200))
def test_int64_round_trip(segment_size, values):
    p = Pipe(segment_size, segments_needed([b"x" * 8] * len(values), segment_size), kind="int64")
    p.writer.write_batch(values)
    p.writer.end_input()
    got = list(p.reader())
    assert got == values and all(type(v) is int for v in got)
    p.assert_no_leaks()


@given(small_segment_sizes, st.lists(float64s, max_size=200))
def test_float64_round_trip_bit_exact(segment_size, values):
    p = Pipe(segment_size, segments_needed([b"x" * 8] * len(values), segment_size), kind="float64")
    for v in values:
        p.writer.write(v)
    p.writer.end_input()
    got = list(p.reader())
    assert [struct.pack("<d", v) for v in got] == [struct.pack("<d", v) for v in values]
    p.assert_no_leaks()


@given(small_segment_sizes, st.lists(texts, max_size=50))
def test_str_round_trip(segment_size, values):
    encoded = [v.encode() for v in values]
    p = Pipe(segment_size, segments_needed(encoded, segment_size), kind="str")
    p.writer.write_batch(values)
    p.writer.end_input()
    assert p.writer.bytes_out == sum(map(len, encoded))
    assert list(p.reader()) == values
    p.assert_no_leaks()


_picklable = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5)
    | st.tuples(inner, inner),
    max_leaves=20)


@given(small_segment_sizes, st.lists(_picklable, max_size=30))
def test_pickle_round_trip(segment_size, values):
    sizes = [pickle.dumps(v, 5) for v in values]
    p = Pipe(segment_size, segments_needed(sizes, segment_size), kind="pickle")
    p.writer.write_batch(values)
    p.writer.end_input()
    assert list(p.reader()) == values
    p.assert_no_leaks()


@given(record_streams(max_records=12))
def test_batch_and_single_writes_produce_identical_buffers(stream):
    segment_size, records = stream
    a = Pipe(segment_size, segments_needed(records, segment_size))
    b = Pipe(segment_size, segments_needed(records, segment_size))
    a.writer.write_batch(records)
    for rec in records:
        b.writer.write(rec)
    a.writer.end_input(), b.writer.end_input()
    assert a.drain_buffers() == b.drain_buffers()


def test_bytes_kind_accepts_any_contiguous_buffer():
    p = Pipe()
    arr = np.arange(4, dtype="<u2")
    p.writer.write_batch([b"a", bytearray(b"bc"), memoryview(b"def"), arr, b""])
    p.writer.end_input()
    assert [as_bytes(x) for x in p.reader()] == [b"a", b"bc", b"def", arr.tobytes(), b""]


def test_kind_names_and_codes():
    for code, name in enumerate(["bytes", "int64", "float64", "str", "pickle"]):
        p = Pipe(kind=name)
        assert p.writer.kind == code
        assert p.reader().kind == code
        assert RecordWriter(p.pool, p.queues, kind=code).kind == code


# ----------------------------------------------------------------- zero copy


def test_zero_copy_threshold():
    p = Pipe(4096, 8)
    p.writer.write_batch([b"a" * 99, b"b" * 100, b"c" * 101, b""])
    p.writer.end_input()
    r = p.reader(zero_copy_min=100)
    small, exact, big, empty = list(r)
    assert type(small) is bytes and small == b"a" * 99
    assert type(exact) is memoryview and exact == b"b" * 100
    assert type(big) is memoryview and big == b"c" * 101
    assert type(empty) is bytes and empty == b""
    assert exact.readonly and big.readonly
    with pytest.raises(TypeError):
        big[0] = 0


def test_view_keeps_its_segment_until_it_dies():
    p = Pipe(256, 4)
    p.writer.write_batch([b"v" * 100, b"w" * 100])
    p.writer.end_input()
    r = p.reader(zero_copy_min=0)
    first, second = list(r)
    assert r.finished and r.held_buffers == 0
    assert p.pool.in_use == 1  # the reader let go; the views did not
    assert p.nbp.available_segments == 3
    del first
    assert p.pool.in_use == 1  # one live view is enough
    assert second.tobytes() == b"w" * 100  # still intact: nobody reused the segment
    second.release()
    assert p.pool.in_use == 0
    p.assert_no_leaks()


def test_view_outlives_reader_and_writer():
    p = Pipe(256, 4)
    p.writer.write(b"z" * 200)
    p.writer.end_input()
    r = p.reader(zero_copy_min=0)
    view = r.read()
    del r, p.writer, p.queues
    gc.collect()
    assert p.pool.in_use == 1
    assert view.tobytes() == b"z" * 200
    del view
    p.assert_no_leaks()


@pytest.mark.timeout(60)
def test_a_wait_in_progress_is_visible_to_a_sampler(threads):
    """A writer parked on a dry pool says since when (``wait_since_ns``):
    a metrics sample taken during a wait longer than its period counts the
    wait as backpressure, not as work; the wait is added once when it ends."""
    from pyflowbuf.exchange.sides import OutputSide

    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    r = RecordReader(q, zero_copy_min=0)
    w.write(b"a" * 250)
    w.flush()
    view = r.read()                  # held: the one segment stays taken
    assert w.wait_since_ns == 0 and w.backpressure_ns == 0
    t = threads.start(lambda: w.write(b"b" * 10))
    wait_for(lambda: w.wait_since_ns != 0, "the writer to park")
    first = OutputSide.backpressure_ns.fget(types.SimpleNamespace(writer=w))
    wait_for(lambda: OutputSide.backpressure_ns.fget(types.SimpleNamespace(writer=w)) > first,
             "the wait in progress to grow")
    assert w.backpressure_ns == 0 and t.is_alive()       # nothing added until it ends
    del view
    threads.join(10)
    assert w.wait_since_ns == 0 and w.backpressure_ns > 0
    w.end_input()
    assert [as_bytes(x) for x in r] == [b"b" * 10]


@pytest.mark.timeout(60)
def test_held_view_backpressures_the_writer(threads):
    """A consumer that keeps views keeps segments: a writer with a 2-segment
    pool blocks until the views are dropped."""
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    r = RecordReader(q, zero_copy_min=0)
    w.write(b"a" * 250)
    w.flush()
    w.write(b"b" * 250)
    w.flush()
    views = [r.read(), r.read()]
    assert pool.in_use == 2
    t = threads.start(lambda: (w.write(b"c" * 10), w.end_input()))
    time.sleep(0.3)
    assert t.is_alive()  # parked on the dry pool
    del views[0]  # the first buffer's last view (the reader still holds the second buffer)
    threads.join(10)
    assert [as_bytes(x) for x in r] == [b"c" * 10]
    assert w.backpressure_ns >= 0.1e9  # it waited (generous: the thread may start late)
    del views
    gc.collect()
    assert nbp.available_segments == 2


# ----------------------------------------------------------------- arrays


_dtypes = st.sampled_from([
    np.dtype("i1"), np.dtype("<i4"), np.dtype("<f8"), np.dtype("<u2"),
    np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "S3")]),
    np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4")]),
])


@given(small_segment_sizes, _dtypes, st.lists(st.integers(0, 300), min_size=1, max_size=4), st.integers(0, 2**31))
def test_arrays_round_trip_as_views(segment_size, dtype, batch_sizes, seed):
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, 255, n * dtype.itemsize, dtype=np.uint8).view(dtype) for n in batch_sizes]
    counts = fixed_buffer_counts(segment_size, dtype.itemsize, batch_sizes)
    p = Pipe(segment_size, len(counts) + 1)
    for b in batches:
        assert p.writer.write_array(b) == len(b)
    p.writer.end_input()
    assert p.writer.buffers_out == len(counts)
    assert p.writer.records_out == sum(batch_sizes)
    r = p.reader()
    arrays = []
    while (a := r.read_array(dtype)) is not None:
        assert a.dtype == dtype and not a.flags.writeable and not a.flags.owndata
        arrays.append(a)
    assert r.finished
    assert [len(a) for a in arrays] == counts
    assert p.pool.in_use == len(counts)  # every array still views its segment
    joined = np.concatenate(arrays) if arrays else np.empty(0, dtype)
    expect = np.concatenate(batches)
    assert joined.tobytes() == expect.tobytes()
    del arrays, a
    p.assert_no_leaks()


def test_two_dimensional_array_rows_are_records():
    p = Pipe(256, 4)
    a = np.arange(60, dtype="<i2").reshape(20, 3)
    assert p.writer.write_array(a) == 20
    p.writer.end_input()
    got = p.reader().read_array(np.dtype(("<i2", 3)))
    assert got.shape == (20, 3)
    assert (got == a).all()


def test_records_and_arrays_interleave_on_one_channel():
    p = Pipe(256, 8)
    p.writer.write(b"before")
    p.writer.write_array(np.arange(3, dtype="<i4"))
    p.writer.write_array(np.arange(3, 5, dtype="<i4"))
    p.writer.write(b"after")
    p.writer.end_input()
    r = p.reader()
    assert r.read() == b"before"
    assert r.read_array("<i4").tolist() == [0, 1, 2, 3, 4]
    assert r.read() == b"after"
    assert r.read() is None and r.finished
    # the fixed-width buffer can also be read record by record
    p2 = Pipe(256, 4)
    p2.writer.write_array(np.array([1, 2], dtype="<i8"))
    p2.writer.end_input()
    assert list(p2.reader(kind="int64")) == [1, 2]


def test_read_array_type_errors_keep_the_buffer():
    p = Pipe(256, 4)
    p.writer.write(b"variable")
    p.writer.flush()
    p.writer.write_array(np.arange(4, dtype="<i4"))
    p.writer.end_input()
    r = p.reader()
    with pytest.raises(TypeError, match="variable-size records"):
        r.read_array("<i4")
    assert r.read() == b"variable"
    with pytest.raises(ValueError, match="buffer holds 4-byte records, dtype int64 has itemsize 8"):
        r.read_array("<i8")
    assert r.read_array("<i4").tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------- partitioning


def read_channel(p, ch, **kw):
    return [as_bytes(x) if isinstance(x, memoryview) else x for x in p.reader(channel=ch, **kw)]


def test_rebalance_round_robin_continues_across_calls():
    p = Pipe(channels=3, kind="int64")
    p.writer.write_batch_rebalance(list(range(5)))
    p.writer.write_batch_rebalance(list(range(5, 10)))
    p.writer.end_input()
    assert [read_channel(p, ch) for ch in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@given(st.lists(st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=8), st.binary(max_size=8),
                          st.tuples(st.integers(), st.text(max_size=4))), max_size=60),
       st.integers(1, 5))
def test_keyed_partitioning_matches_reference_hash(keys, channels):
    p = Pipe(channels=channels, kind="pickle", segments=64)
    records = [(i, k) for i, k in enumerate(keys)]
    p.writer.write_batch_keyed(records, keys)
    p.writer.end_input()
    for ch in range(channels):
        expect = [rec for rec, k in zip(records, keys) if ref_stable_hash(k) % channels == ch]
        assert read_channel(p, ch) == expect


def test_broadcast_and_explicit_channels():
    p = Pipe(channels=3, kind="str")
    p.writer.write_batch_broadcast(["x", "y"])
    p.writer.write_batch_to(["to2", "to0", "to2b"], [2, 0, 2])
    p.writer.write_to("one", 1)
    p.writer.end_input()
    assert read_channel(p, 0) == ["x", "y", "to0"]
    assert read_channel(p, 1) == ["x", "y", "one"]
    assert read_channel(p, 2) == ["x", "y", "to2", "to2b"]


def test_partitioning_argument_errors():
    p = Pipe(channels=2)
    with pytest.raises(ValueError, match="got 2 records but 1 keys/channels"):
        p.writer.write_batch_keyed([b"a", b"b"], ["k"])
    with pytest.raises(IndexError, match=r"subpartition 2 out of range \(writer has 2\)"):
        p.writer.write_batch_to([b"a", b"b"], [0, 2])
    with pytest.raises(IndexError):
        p.writer.write_to(b"a", -1)
    with pytest.raises(IndexError):
        p.writer.write_batch([b"a"], channel=5)
    with pytest.raises(IndexError):
        p.writer.write_array(np.arange(3), channel=2)
    with pytest.raises(IndexError):
        p.writer.flush(7)
    p.writer.end_input()
    assert read_channel(p, 0) == [b"a"]  # the record before the bad channel index
    assert read_channel(p, 1) == []


def test_stable_hash_matches_reference():
    keys = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 + 5, True, "", "abc", "ünï", b"", b"\x00\xff",
            (1, "a", b"b"), (), ((1, 2), 3)]
    for k in keys:
        assert stable_hash(k) == ref_stable_hash(k), k
    assert stable_hash("abc") != stable_hash("abd")


def test_stable_hash_is_the_same_in_every_process():
    code = "from pyflowbuf import stable_hash; print(stable_hash('key-1'), stable_hash(b'k'), stable_hash(('a', 1)))"
    outs = set()
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, timeout=60).stdout)
    assert outs == {f"{stable_hash('key-1')} {stable_hash(b'k')} {stable_hash(('a', 1))}\n"}


# ----------------------------------------------------------------- events and end of input


def test_events_interrupt_reads_and_iteration_skips_them():
    p = Pipe(channels=2, kind="int64")
    p.writer.write_batch([1, 2])
    p.writer.broadcast_event(BARRIER, aux=7, flags=1)
    p.writer.write_batch([3])
    p.writer.end_input()
    r = p.reader(channel=0)
    assert [r.read(), r.read(), r.read()] == [1, 2, None]
    assert r.take_event() == (0, BARRIER, 7, 1)
    assert r.take_event() is None
    assert [r.read(), r.read()] == [3, None]
    assert r.finished
    assert list(p.reader(channel=1)) == []  # channel 1: barrier, end; iteration skips the event


def test_priority_event_overtakes_queued_records():
    p = Pipe(kind="int64")
    p.writer.write_batch([1, 2])
    p.writer.flush()
    p.writer.write_batch([3])  # still in the writer's buffer
    p.writer.broadcast_event(BARRIER, aux=9, priority=True)
    assert p.writer.pending_bytes == 12
    p.writer.end_input()
    r = p.reader()
    assert r.read() is None
    assert r.take_event() == (0, BARRIER, 9, 0)
    assert r.read_batch() == [1, 2, 3]


def test_read_batch_stops_at_events_and_end():
    p = Pipe(kind="int64")
    p.writer.write_batch(list(range(10)))
    p.writer.broadcast_event(USER_EVENT, aux=1)
    p.writer.write_batch(list(range(10, 15)))
    p.writer.end_input()
    r = p.reader()
    assert r.read_batch(4) == [0, 1, 2, 3]
    assert r.read_batch() == [4, 5, 6, 7, 8, 9]
    assert r.read_batch() == []
    assert r.take_event() == (0, USER_EVENT, 1, 0)
    assert r.read_batch() == [10, 11, 12, 13, 14]
    assert r.read_batch() == [] and r.finished
    assert r.records_in == 15


def test_end_input_is_idempotent_and_finishes_every_channel():
    p = Pipe(channels=2)
    p.writer.end_input()
    p.writer.end_input()
    assert p.writer.ended
    assert [len(q) for q in p.queues] == [1, 1]
    r = p.reader()
    assert r.channels_finished == (False, False)
    assert list(r) == []
    assert r.finished and r.channels_finished == (True, True)
    assert r.read(timeout=0) is None and r.poll() is None and r.read_array("u1") is None


def test_reader_stops_only_when_all_channels_ended():
    p = Pipe(channels=2, kind="int64")
    p.writer.write_to(1, 0)
    p.writer.flush()
    p.queues[0].push_event(END_OF_PARTITION)
    r = p.reader()
    assert r.read(timeout=0.05) == 1
    assert r.read(timeout=0.05) is None
    assert not r.finished and r.channels_finished == (True, False)
    p.writer.write_to(2, 1)
    p.writer.flush()
    p.queues[1].push_event(END_OF_PARTITION)
    assert list(r) == [2]
    assert r.finished


def test_one_channel_ending_is_not_a_timeout():
    """read() returns None only on timeout, at an event or at the very end:
    the end of one channel while another still has records is none of those."""
    p = Pipe(channels=3, kind="int64")
    p.writer.write_batch_to([1, 2, 3, 4], [1, 1, 2, 2])
    p.writer.end_input()
    r = p.reader()
    got = []
    while (rec := r.read(timeout=5)) is not None:
        got.append(rec)
    assert sorted(got) == [1, 2, 3, 4] and r.finished
    assert r.take_event() is None


def test_repeated_end_of_partition_does_not_end_another_channel():
    p = Pipe(channels=2, kind="int64")
    p.queues[0].push_event(END_OF_PARTITION)
    p.queues[0].push_event(END_OF_PARTITION)  # a duplicate (e.g. replayed) end marker
    p.writer.write_to(5, 1)
    p.writer.flush(1)
    r = p.reader()
    assert r.read(timeout=0.05) == 5
    assert r.read(timeout=0.05) is None
    assert not r.finished and r.channels_finished == (True, False)
    p.queues[1].push_event(END_OF_PARTITION)
    assert r.read(timeout=0.05) is None and r.finished


def test_dropped_writer_and_reader_return_their_segments():
    p = Pipe(256, 8)
    p.writer.write(b"x" * 300)  # one full buffer queued, one partly filled in the writer
    assert p.pool.in_use == 2
    del p.writer
    gc.collect()
    assert p.pool.in_use == 1
    r = p.reader()
    assert r.poll() is None  # the spanning record's start is read, its end never came
    assert r.held_buffers == 0
    del r
    p.assert_no_leaks()


def test_per_channel_deserializers_reassemble_interleaved_spans():
    """Two channels whose records span buffers; the gate alternates between
    them, so each channel's half-read record must wait for its own next buffer."""
    seg = 256
    nbp = NetworkBufferPool(64, seg)
    pools = [nbp.create_pool(0, 32) for _ in range(2)]
    qs = [BufferQueue(nbp) for _ in range(2)]
    writers = [RecordWriter(pools[c], [qs[c]]) for c in range(2)]
    expect = {0: [], 1: []}
    for i in range(12):
        for c in range(2):
            rec = bytes([c]) + payload(seg - 6 + i * 37, i * 2 + c)
            writers[c].write(rec)
            expect[c].append(rec)
    for w in writers:
        w.end_input()
    got = [as_bytes(x) for x in RecordReader(InputGate(qs), zero_copy_min=0)]
    assert [g for g in got if g[0] == 0] == expect[0]
    assert [g for g in got if g[0] == 1] == expect[1]


# ----------------------------------------------------------------- threads


@pytest.mark.timeout(120)
def test_producer_consumer_threads_small_pool_exactly_once(threads):
    """A writer thread and a reader thread through a 4-segment pool: every
    record arrives once and in order, the pool never holds more than 4
    segments, and every segment is back at the end."""
    seg = 256
    nbp = NetworkBufferPool(4, seg)
    pool = nbp.create_pool(1, 4)
    q = BufferQueue(nbp)
    n = 20000
    sizes = [0, 1, 3, 4, seg - 8, seg - 4, seg, seg + 1, 2 * seg + 1, 17, 100]
    records = [i.to_bytes(4, "little") + b"\xab" * sizes[i % len(sizes)] for i in range(n)]
    stop = threading.Event()
    samples = []

    def produce():
        w = RecordWriter(pool, [q])
        for start in range(0, n, 500):
            w.write_batch(records[start:start + 250])
            for rec in records[start + 250:start + 500]:
                w.write(rec)
        w.end_input()
        return w.backpressure_ns

    def consume():
        r = RecordReader(q, zero_copy_min=64)
        out = []
        for k, rec in enumerate(r):
            out.append(bytes(rec))
            if k % 5000 == 0:
                time.sleep(0.01)  # a slow consumer: the producer must wait
        return out

    def sample():
        while not stop.is_set():
            samples.append(pool.in_use)
            time.sleep(0.0002)

    sampler = threads.start(sample)
    producer = threads.start(produce)
    consumer = threads.start(consume)
    producer.join(100)
    consumer.join(100)
    stop.set()
    threads.join(10)
    got = consumer.result["value"]
    assert len(got) == n
    assert got == records  # exactly once, in order
    assert samples and max(samples) <= 4
    assert producer.result["value"] > 0  # it did wait on the dry pool
    del got
    gc.collect()
    assert pool.in_use == 0
    assert nbp.available_segments == nbp.total_segments


@pytest.mark.timeout(60)
def test_writer_blocked_on_dry_pool_does_not_spin(threads):
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    r = RecordReader(q)
    t = threads.start(lambda: ([w.write(b"x" * 200) for _ in range(6)], w.end_input()))
    time.sleep(0.2)
    assert t.is_alive() and pool.in_use == 2
    cpu0 = time.process_time()
    time.sleep(0.5)
    cpu = time.process_time() - cpu0
    assert cpu < 0.15, f"a writer under backpressure burned {cpu:.3f} s CPU"
    assert [len(x) for x in r] == [200] * 6
    threads.join(10)
    assert w.backpressure_ns >= 0.3e9


@pytest.mark.timeout(60)
def test_writer_cancel_wakes_a_blocked_writer(threads):
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    t = threads.start(lambda: [w.write(b"y" * 200) for _ in range(3)])
    time.sleep(0.2)
    assert t.is_alive()
    w.cancel()
    t.join(5)
    assert isinstance(t.result.get("error"), errors.CancelledError)
