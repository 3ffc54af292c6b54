"""BufferQueue (subpartition queue with a priority lane) and InputGate."""
import gc
import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyflowbuf import errors
from pyflowbuf._core.memory import Buffer, NetworkBufferPool, Notifier
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf._core.channel import BARRIER, CANCEL_BARRIER, END_OF_DATA, END_OF_PARTITION, USER_EVENT


def filled(pool, payload):
    b = pool.request()
    assert b is not None
    assert b.write(payload) == len(payload)
    return b


def framed(*records):
    return b"".join(struct.pack("<I", len(r)) + r for r in records)


def test_event_constants():
    assert (END_OF_PARTITION, BARRIER, CANCEL_BARRIER, END_OF_DATA, USER_EVENT) == (0, 1, 4, 8, 16)


def test_queue_is_fifo_and_moves_ownership():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(0, 8)
    q = BufferQueue(nbp)
    assert len(q) == 0 and q.backlog == 0 and q.pop_buffer() is None
    sent = []
    for i in range(5):
        b = filled(pool, bytes([i]) * (i + 1))
        q.push_buffer(b)
        assert b.recycled  # the queue owns the segment now
        with pytest.raises(errors.BufferRecycledError):
            b.recycle()
        with pytest.raises(errors.BufferRecycledError):
            b.write(b"x")
        sent.append(b.segment_index)
    assert q.backlog == 5 and len(q) == 5 and q.priority_backlog == 0
    assert q.buffers_pushed == 5 and q.bytes_pushed == 1 + 2 + 3 + 4 + 5
    assert repr(q) == "BufferQueue(backlog=5, pushed=5)"
    assert pool.in_use == 5
    for i in range(5):
        b = q.pop_buffer()
        assert isinstance(b, Buffer)
        assert b.segment_index == sent[i]
        assert bytes(memoryview(b)) == bytes([i]) * (i + 1)
        assert b.size == i + 1 and b.data_type == "records"
        assert q.backlog == 4 - i
        b.recycle()
    assert pool.in_use == 0 and nbp.available_segments == 8
    assert q.pop_buffer() is None


def test_push_rejects_released_buffers_and_live_views():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    q = BufferQueue(nbp)
    b = filled(pool, b"abc")
    b.recycle()
    with pytest.raises(errors.BufferRecycledError, match="released buffer"):
        q.push_buffer(b)
    b = filled(pool, b"abc")
    mv = memoryview(b)
    with pytest.raises(BufferError, match="live views"):
        q.push_buffer(b)
    assert len(q) == 0 and not b.recycled
    mv.release()
    q.push_buffer(b)
    assert len(q) == 1
    with pytest.raises(TypeError):
        q.push_buffer(b"not a buffer")


def test_events_take_no_segment():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(1, 1)
    held = pool.request()  # the pool is dry
    q = BufferQueue(nbp)
    q.push_event(BARRIER, aux=42, flags=3)
    q.push_event(END_OF_PARTITION)
    q.push_event(USER_EVENT, aux=-(2**63), flags=7)
    assert q.backlog == 3 and q.bytes_pushed == 0
    assert q.pop_buffer() == (BARRIER, 42, 3)
    assert q.pop_buffer() == (END_OF_PARTITION, 0, 0)
    assert q.pop_buffer() == (USER_EVENT, -(2**63), 7)
    assert q.pop_buffer() is None
    assert nbp.available_segments == 0
    held.recycle()


def test_priority_lane_overtakes_queued_data():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4)
    q = BufferQueue(nbp)
    q.push_buffer(filled(pool, b"first"))
    q.push_event(BARRIER, aux=1)
    q.push_buffer(filled(pool, b"second"))
    q.push_event(BARRIER, aux=2, priority=True)
    q.push_buffer(filled(pool, b"urgent"), priority=True)
    assert q.backlog == 3 and q.priority_backlog == 2 and len(q) == 5
    out = []
    while (item := q.pop_buffer()) is not None:
        if isinstance(item, Buffer):
            out.append(bytes(memoryview(item)))
            item.recycle()
        else:
            out.append(item)
    assert out == [(BARRIER, 2, 0), b"urgent", b"first", (BARRIER, 1, 0), b"second"]
    assert nbp.available_segments == 4


def test_dropped_queue_recycles_what_it_holds():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4)
    q = BufferQueue(nbp)
    for _ in range(2):
        q.push_buffer(filled(pool, b"x"))
    q.push_buffer(filled(pool, b"p"), priority=True)
    q.push_event(BARRIER)
    q.push_event(BARRIER, priority=True)
    assert nbp.available_segments == 1
    del q
    gc.collect()
    assert nbp.available_segments == 4 and pool.in_use == 0


def test_queue_capacity_validation():
    nbp = NetworkBufferPool(4, 256)
    with pytest.raises(ValueError, match="capacity must be >= 2, got 1"):
        BufferQueue(nbp, capacity=1)
    with pytest.raises(TypeError):
        BufferQueue("not a pool")


@pytest.mark.timeout(30)
def test_full_queue_blocks_the_producer_without_spinning(threads):
    nbp = NetworkBufferPool(4, 256)
    q = BufferQueue(nbp, capacity=2)
    q.push_event(USER_EVENT, aux=0)
    q.push_event(USER_EVENT, aux=1)
    t = threads.start(q.push_event, USER_EVENT, 2)
    time.sleep(0.1)
    assert t.is_alive() and len(q) == 2
    cpu0 = time.process_time()
    time.sleep(0.4)
    assert time.process_time() - cpu0 < 0.1
    assert q.pop_buffer() == (USER_EVENT, 0, 0)
    threads.join(5)
    assert [q.pop_buffer(), q.pop_buffer(), q.pop_buffer()] == [(USER_EVENT, 1, 0), (USER_EVENT, 2, 0), None]


@pytest.mark.timeout(30)
def test_cancel_wakes_a_producer_blocked_on_a_full_queue(threads):
    nbp = NetworkBufferPool(4, 256)
    q = BufferQueue(nbp, capacity=2)
    q.push_event(USER_EVENT)
    q.push_event(USER_EVENT)
    t = threads.start(q.push_event, USER_EVENT)
    time.sleep(0.1)
    assert t.is_alive()
    q.cancel()
    t.join(5)
    assert isinstance(t.result.get("error"), errors.CancelledError)
    assert len(q) == 2


@pytest.mark.timeout(60)
def test_events_through_a_small_queue_in_order(threads):
    nbp = NetworkBufferPool(4, 256)
    q = BufferQueue(nbp, capacity=4)
    n = 5000

    def produce():
        for i in range(n):
            q.push_event(USER_EVENT, aux=i)

    threads.start(produce)
    got = []
    deadline = time.monotonic() + 40
    while len(got) < n and time.monotonic() < deadline:
        item = q.pop_buffer()
        if item is None:
            time.sleep(0)
            continue
        assert len(q) <= 4
        got.append(item[1])
    threads.join(5)
    assert got == list(range(n))


# ----------------------------------------------------------------- InputGate


def test_gate_validation():
    nbp = NetworkBufferPool(4, 256)
    with pytest.raises(ValueError, match="at least one channel"):
        InputGate([])
    with pytest.raises(TypeError, match="channels must be BufferQueues, got str"):
        InputGate([BufferQueue(nbp), "q"])
    gate = InputGate([BufferQueue(nbp), BufferQueue(nbp)])
    assert gate.num_channels == 2 and len(gate.channels) == 2
    assert isinstance(gate.notifier, Notifier)
    for bad in (-1, 2):
        with pytest.raises(IndexError, match=f"channel {bad} out of range"):
            gate.block(bad)
        with pytest.raises(IndexError):
            gate.is_blocked(bad)
    assert repr(gate) == "InputGate(channels=2, queued=0)"


def _one_record_buffers(pool, q, values):
    for v in values:
        b = filled(pool, framed(struct.pack("<q", v)))
        q.push_buffer(b)


def test_gate_reads_round_robin_across_channels():
    nbp = NetworkBufferPool(16, 256)
    pool = nbp.create_pool(0, 16)
    qs = [BufferQueue(nbp) for _ in range(3)]
    _one_record_buffers(pool, qs[0], [0, 3, 6, 9])
    _one_record_buffers(pool, qs[1], [1, 4])
    _one_record_buffers(pool, qs[2], [2, 5, 7])
    gate = InputGate(qs)
    assert gate.queued_buffers == 9
    r = RecordReader(gate, kind="int64")
    got = r.read_batch(100, timeout=0)
    # ch0, ch1, ch2, ch0, ch1, ch2, ch0, (ch1 dry) ch2, ch0
    assert got == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert gate.queued_buffers == 0
    del r, got
    gc.collect()
    assert nbp.available_segments == 16


def test_priority_events_first_and_blocked_channels_skipped():
    nbp = NetworkBufferPool(16, 256)
    pool = nbp.create_pool(0, 16)
    qs = [BufferQueue(nbp) for _ in range(2)]
    _one_record_buffers(pool, qs[0], [10, 11])
    _one_record_buffers(pool, qs[1], [20, 21])
    gate = InputGate(qs)
    r = RecordReader(gate, kind="int64")
    gate.block(0)
    assert gate.is_blocked(0) and not gate.is_blocked(1)
    assert [r.poll(), r.poll(), r.poll()] == [20, 21, None]
    qs[0].push_event(BARRIER, aux=5, priority=True)  # priority events pass a blocked channel
    assert r.poll() is None
    assert r.take_event() == (0, BARRIER, 5, 0)
    assert r.take_event() is None
    gate.resume(0)
    assert not gate.is_blocked(0)
    assert [r.poll(), r.poll(), r.poll()] == [10, 11, None]
    gate.block(0), gate.block(1)
    gate.resume()  # all
    assert not gate.is_blocked(0) and not gate.is_blocked(1)


@pytest.mark.timeout(30)
def test_empty_gate_read_times_out_without_spinning():
    nbp = NetworkBufferPool(2, 256)
    gate = InputGate([BufferQueue(nbp)])
    r = RecordReader(gate)
    assert r.poll() is None
    cpu0, t0 = time.process_time(), time.monotonic()
    assert r.read(timeout=0.5) is None
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert 0.45 <= wall < 3
    assert cpu < 0.15, f"an idle reader burned {cpu:.3f} s CPU"
    assert gate.idle_ns >= 0.45e9


@pytest.mark.timeout(30)
def test_blocked_reader_wakes_on_push(threads):
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    q = BufferQueue(nbp)
    r = RecordReader(InputGate([q]), kind="int64")
    t = threads.start(r.read, 10)
    time.sleep(0.2)
    assert t.is_alive()
    _one_record_buffers(pool, q, [77])
    threads.join(5)
    assert t.result["value"] == 77


@pytest.mark.timeout(30)
def test_cancelled_gate_wakes_blocked_reader(threads):
    nbp = NetworkBufferPool(2, 256)
    gate = InputGate([BufferQueue(nbp)])
    r = RecordReader(gate)
    t = threads.start(r.read, None)
    time.sleep(0.2)
    assert t.is_alive()
    gate.cancel()
    t.join(5)
    assert isinstance(t.result.get("error"), errors.CancelledError)


def test_shared_notifier_hears_pushes_to_any_gate():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4)
    note = Notifier()
    q1, q2 = BufferQueue(nbp), BufferQueue(nbp)
    g1, g2 = InputGate([q1], notifier=note), InputGate([q2], notifier=note)
    assert g1.notifier is note and g2.notifier is note
    token = note.prepare()
    q2.push_buffer(filled(pool, framed(b"hi")))
    assert note.wait(token, 1) is True  # woken, not timed out
    assert RecordReader(g2).poll() == b"hi"
    token = note.prepare()
    assert note.wait(token, 0.01) is False


@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 10**6)), max_size=40))
def test_queue_order_matches_a_model(ops):
    """Any mix of data buffers, events and priority items comes out as two
    FIFO lanes, priority first; nothing leaks."""
    nbp = NetworkBufferPool(48, 256)
    pool = nbp.create_pool(0, 48)
    q = BufferQueue(nbp)
    normal, prio = [], []
    for what, priority, v in ops:
        lane = prio if priority else normal
        if what == 0:
            q.push_event(USER_EVENT, aux=v, priority=priority)
            lane.append((USER_EVENT, v, 0))
        else:
            q.push_buffer(filled(pool, v.to_bytes(4, "little")), priority=priority)
            lane.append(v.to_bytes(4, "little"))
    out = []
    while (item := q.pop_buffer()) is not None:
        if isinstance(item, Buffer):
            out.append(bytes(memoryview(item)))
            item.recycle()
        else:
            out.append(item)
    assert out == prio + normal
    assert nbp.available_segments == 48


@pytest.mark.timeout(60)
def test_writer_and_reader_threads_through_three_channels(threads, make_network_pool, no_leaks):
    """Three writer threads, one reader over an InputGate of their queues,
    one small pool each: every record once, in order per channel."""
    nbp = make_network_pool(12, 256)
    pools = [nbp.create_pool(1, 4) for _ in range(3)]
    qs = [BufferQueue(nbp) for _ in range(3)]
    n = 3000

    def produce(ch):
        w = RecordWriter(pools[ch], [qs[ch]], kind="int64")
        for start in range(0, n, 100):
            w.write_batch([ch * 10**6 + i for i in range(start, start + 100)])
        w.end_input()

    for ch in range(3):
        threads.start(produce, ch)
    r = RecordReader(InputGate(qs), kind="int64")
    got = list(r)
    threads.join(30)
    per = {ch: [v - ch * 10**6 for v in got if v // 10**6 == ch] for ch in range(3)}
    assert all(per[ch] == list(range(n)) for ch in range(3))
    assert len(got) == 3 * n
    assert r.finished and r.channels_finished == (True, True, True)
    assert all(p.in_use == 0 for p in pools)
    no_leaks(nbp)
