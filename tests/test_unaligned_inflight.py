"""The in-flight data of an unaligned checkpoint, at the level of the core:
two producers write records (some spanning several segments) into two
channels of one input gate, the consumer reads at random, and each producer
sends an overtaking barrier at a random moment. The consumer does what a
subtask does: at the first barrier it snapshots, keeps what its reader holds
of each channel (a record cut by the snapshot), records the other channel
until the barrier arrives there, and takes along what each barrier overtook.

Property: for every channel, the in-flight data read back (replayed through
a fresh reader, as a restore does) is exactly the records that producer wrote
before its barrier and the consumer had not handed out before the snapshot,
in order.
"""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pyflowbuf._core.channel import BARRIER, BARRIER_UNALIGNED, BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter

SEG = 256


def record(ch: int, i: int, size: int) -> bytes:
    head = f"{ch}:{i}:".encode()
    return head + b"x" * max(0, size - len(head))


ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 1), st.integers(1, 6), st.integers(4, 700)),
    st.tuples(st.just("read"), st.integers(1, 9)),
    st.tuples(st.just("barrier"), st.integers(0, 1)),
), max_size=40)


def replay(items, kind="bytes"):
    """What a restored reader hands out from ``items`` of one channel."""
    net = NetworkBufferPool(4, SEG)
    reader = RecordReader(InputGate([BufferQueue(net)]), kind=kind)
    reader.replay([(0, item) for item in items])
    out = []
    while True:
        batch = reader.read_batch(4096, timeout=0)
        if not batch:
            assert reader.take_event() is None
            return out
        out.extend(bytes(r) if kind == "bytes" else r for r in batch)


@given(ops=ops)
def test_inflight_data_is_what_crossed_between_snapshot_and_barrier(ops):
    net = NetworkBufferPool(1024, SEG)
    queues = [BufferQueue(net), BufferQueue(net)]
    writers = [RecordWriter(net.create_pool(1, 400), [q], kind="bytes") for q in queues]
    reader = RecordReader(InputGate(queues), kind="bytes")
    written = [[], []]
    before_barrier = [None, None]
    handed_out = [[], []]            # before the snapshot
    snapshot = False
    inflight = [[], []]
    arrived = [False, False]

    def on_barrier(ev):
        nonlocal snapshot
        ch = ev[0]
        assert ev[1] == BARRIER and ev[3] & BARRIER_UNALIGNED
        k = queues[ch].overtaken(reader.event_mark)
        assert k >= 0
        if not snapshot:
            snapshot = True
            for c in (0, 1):
                prefix = reader.unread_prefix(c)
                inflight[c] = [prefix] if prefix is not None else []
                if c != ch and not arrived[c]:
                    reader.start_recording(c)
        else:
            inflight[ch] += reader.stop_recording(ch)
        inflight[ch] += queues[ch].copy_front(k)
        arrived[ch] = True

    def read(n):
        batch = reader.read_batch(n, timeout=0)
        for r in batch:
            r = bytes(r)
            ch = int(r.split(b":", 1)[0])
            if not snapshot:
                handed_out[ch].append(r)
        ev = reader.take_event()
        if ev is not None:
            on_barrier(ev)
        return batch or ev

    def barrier(ch):
        if before_barrier[ch] is None:
            writers[ch].flush()
            before_barrier[ch] = list(written[ch])
            queues[ch].push_event(BARRIER, 1, BARRIER_UNALIGNED, True)

    for op in ops:
        if op[0] == "write":
            _, ch, count, size = op
            recs = [record(ch, len(written[ch]) + i, size) for i in range(count)]
            writers[ch].write_batch(recs)
            written[ch] += recs
        elif op[0] == "read":
            read(op[1])
        else:
            barrier(op[1])
    for ch in (0, 1):
        barrier(ch)
    while not all(arrived):
        assert read(7), "the barriers must arrive"

    for ch in (0, 1):
        expect = before_barrier[ch][len(handed_out[ch]):]
        assert handed_out[ch] == before_barrier[ch][:len(handed_out[ch])]
        assert replay(inflight[ch]) == expect


def test_over_tcp_a_barrier_overtakes_a_channel_with_zero_credit():
    """The consumer reads nothing, so the sender spends its credit and the rest
    of the producer's buffers wait in the sender's queue. An overtaking barrier
    still crosses at once (it costs no credit) and arrives ahead of the buffers
    already received; the sender hands over copies of what it overtook there,
    the receiver's queue holds the rest: together, every record before it."""
    import threading
    import time

    from pyflowbuf.net import ConnectionManager, NetworkServer, new_secret

    secret = new_secret()
    nbp = NetworkBufferPool(256, 4096)
    server = NetworkServer(secret, max_buffer_size=4096)
    server.start()
    manager = ConnectionManager(secret)
    try:
        sq = BufferQueue(nbp)
        server.export("p", 0, sq, kind="int64")
        writer = RecordWriter(nbp.create_pool(16, 16), [sq], kind="int64", request_timeout=30)
        excl, floating = manager.create_input_pools(nbp, 1, 2, 2)
        rq = BufferQueue(nbp)
        gate = InputGate([rq])
        ch = manager.create_channel(server.address, "p", 0, rq, excl[0], floating, kind="int64")
        ch.attach_gate(gate)
        reader = RecordReader(gate, kind="int64")
        records = list(range(12 * 4096 // 12))          # about 12 buffers of 4 KiB
        writer.write_batch(records)
        writer.flush()
        deadline = time.monotonic() + 10
        while ch.credit.buffers_received < 4:           # the credit it had: 2 exclusive + 2 floating
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        received = ch.credit.buffers_received
        assert received == 4 and sq.backlog > 4          # zero credit left, the rest waits at the sender
        got = threading.Event()
        overtaken = []
        sq.overtaken_sink = lambda n, items: (overtaken.append((n, items)), got.set())
        writer.broadcast_event(BARRIER, 7, BARRIER_UNALIGNED, True)
        assert got.wait(5), "the barrier did not leave the sender without credit"
        while rq.priority_backlog < 1:                   # on its way over the wire
            assert time.monotonic() < deadline + 5
            time.sleep(0.005)
        assert reader.read_batch(10, timeout=5) == []    # the barrier comes first
        ev = reader.take_event()
        assert ev[:3] == (0, BARRIER, 7)
        k = rq.overtaken(reader.event_mark)
        assert k == received
        (n, at_sender), = overtaken
        assert n == 7 and len(at_sender) == sq.backlog >= 8
        assert replay(rq.copy_front(k) + at_sender, kind="int64") == records
    finally:
        manager.close()
        server.close()


@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), cut_extra=st.integers(0, 3),
       kind=st.sampled_from(["bytes", "int64"]))
def test_a_cut_record_whose_next_buffer_the_reader_already_took(sizes, cut_extra, kind):
    """A batch that ends with the last record of a buffer of channel 1 takes
    the next buffer from the gate before it returns: here channel 0's, the
    continuation of a record cut at the end of its previous buffer. The reader
    then holds both the start of that record and the whole unread buffer; a
    snapshot's prefix must hold both, or the continuation is in neither the
    prefix nor the recording and the restored channel is read out of step
    (a CorruptRecordError, or records silently lost). Checked against the
    model: the in-flight data of channel 0 replays as every record written to
    it and not handed out before the snapshot."""
    net = NetworkBufferPool(64, SEG)
    queues = [BufferQueue(net), BufferQueue(net)]
    writers = [RecordWriter(net.create_pool(1, 20), [q], kind=kind) for q in queues]
    reader = RecordReader(InputGate(queues), kind=kind)
    if kind == "int64":
        value = iter(range(1, 10**6))
        make = lambda size: next(value)  # noqa: E731 (int64: 12 bytes a record, the cut anywhere in one)
        sizes = sizes * 8
    else:
        counter = iter(range(10**6))
        make = lambda size: record(0, next(counter), size)  # noqa: E731
    written, handed_out = [], []

    def read(n):
        for r in reader.read_batch(n, timeout=0):
            r = bytes(r) if kind == "bytes" else r
            if r in written:
                handed_out.append(r)

    # channel 1 first, so that channel 0's buffer is the one the gate gave last
    writers[1].write(b"\0" * 8 if kind == "bytes" else 0)
    writers[1].flush()
    read(100)
    # channel 0: records until a buffer is full; the last one usually spans
    # into the next buffer, which stays in the writer for now
    for size in sizes:
        rec = make(size)
        writers[0].write(rec)
        written.append(rec)
        if writers[0].buffers_out:
            break
    for _ in range(cut_extra):
        rec = make(sizes[0])
        writers[0].write(rec)
        written.append(rec)
    read(1000)          # all of channel 0's first buffer, ending in the cut record's start
    # one record on channel 1, then the continuation of channel 0: the gate
    # gives channel 1's first (round robin), and the batch of one ends there
    writers[1].write(b"\0" * 8 if kind == "bytes" else 0)
    writers[1].flush()
    writers[0].flush()
    read(1)
    prefix = reader.unread_prefix(0)
    reader.start_recording(0)
    queues[0].push_event(BARRIER, 1, BARRIER_UNALIGNED, True)
    ev = reader.poll_priority()
    assert ev is not None and ev[0] == 0 and ev[1] == BARRIER
    k = queues[0].overtaken(reader.event_mark)
    items = ([prefix] if prefix is not None else []) + reader.stop_recording(0) + queues[0].copy_front(k)
    assert handed_out == written[:len(handed_out)]
    assert replay(items, kind) == written[len(handed_out):]
