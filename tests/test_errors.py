"""Every error path of the core gives a clear, typed error at the boundary
where the bad input enters, and leaves the objects usable and consistent."""
import gc
import pickle
import struct
import threading
import time

import numpy as np
import pytest

from pyflowbuf import errors
from pyflowbuf._core.memory import NetworkBufferPool, Notifier
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf._core.channel import END_OF_PARTITION
from pyflowbuf._core.errors import error_for_code

# ----------------------------------------------------------------- the hierarchy


@pytest.mark.parametrize("exc, builtin", [
    (errors.InsufficientBuffersError, MemoryError),
    (errors.BufferRequestTimeout, TimeoutError),
    (errors.PoolDestroyedError, RuntimeError),
    (errors.BufferRecycledError, BufferError),
    (errors.RecordTooLargeError, ValueError),
    (errors.CorruptRecordError, ValueError),
    (errors.ChannelClosedError, RuntimeError),
    (errors.ProtocolError, ConnectionError),
    (errors.JobFailedError, RuntimeError),
    (errors.CancelledError, errors.FlowBufError),
])
def test_errors_subclass_flowbuf_error_and_a_builtin(exc, builtin):
    assert issubclass(exc, errors.FlowBufError)
    assert issubclass(exc, builtin)
    assert exc.__name__ in errors.__all__


@pytest.mark.parametrize("code, exc, text", [
    (-1, errors.BufferRequestTimeout, "no buffer available"),
    (-2, errors.BufferRequestTimeout, "timed out waiting for a buffer"),
    (-3, MemoryError, "out of memory"),
    (-4, ValueError, "invalid argument"),
    (-5, errors.PoolDestroyedError, "the buffer pool was destroyed"),
    (-6, errors.InsufficientBuffersError, "insufficient number of network buffers"),
    (-7, errors.FlowBufError, "queue full"),
    (-8, errors.ChannelClosedError, "channel closed"),
    (-9, errors.RecordTooLargeError, "record too large"),
    (-10, errors.CorruptRecordError, "corrupt record stream"),
    (-11, errors.CancelledError, "cancelled"),
    (-99, errors.FlowBufError, "error code -99"),
])
def test_c_codes_translate_to_typed_errors(code, exc, text):
    err = error_for_code(code, "where")
    assert type(err) is exc
    assert str(err) == f"{text}: where"
    assert str(error_for_code(code)) == text


# ----------------------------------------------------------------- invalid configuration


@pytest.mark.parametrize("args, exc, message", [
    ((0, 4096), ValueError, "num_segments must be >= 1, got 0"),
    ((-3, 4096), ValueError, "num_segments must be >= 1, got -3"),
    ((2**31, 4096), ValueError, "num_segments must be < 2**31, got 2147483648"),
    (("8", 4096), TypeError, "num_segments must be an int, got str"),
    ((8, 1000), ValueError, "segment_size must be a power of two between 256 and 1048576, got 1000"),
    ((8, 128), ValueError, "segment_size must be a power of two between 256 and 1048576, got 128"),
    ((8, 2**21), ValueError, "segment_size must be a power of two between 256 and 1048576, got 2097152"),
    ((8, 0), ValueError, "segment_size must be >= 1, got 0"),
    ((8, 4096.0), TypeError, "segment_size must be an int, got float"),
    ((True, 4096), TypeError, "num_segments must be an int, got bool"),
])
def test_network_pool_config_errors_name_the_parameter(args, exc, message):
    with pytest.raises(exc) as ei:
        NetworkBufferPool(*args)
    assert str(ei.value) == message


@pytest.mark.parametrize("size", [256, 512, 1 << 20])
def test_segment_size_limits_are_inclusive(size):
    assert NetworkBufferPool(1, size).segment_size == size


@pytest.mark.parametrize("args, exc, message", [
    ((3, 2), ValueError, "min_size (3) must be <= max_size (2)"),
    ((0, 0), ValueError, "max_size must be >= 1, got 0"),
    ((-1, 2), ValueError, "min_size must be >= 0, got -1"),
    ((1.0, 2), TypeError, "min_size must be an int, got float"),
    ((1, None), TypeError, "max_size must be an int, got NoneType"),
])
def test_create_pool_config_errors_name_the_parameter(args, exc, message):
    nbp = NetworkBufferPool(4, 256)
    with pytest.raises(exc) as ei:
        nbp.create_pool(*args)
    assert str(ei.value) == message
    assert nbp.unreserved_segments == 4 and nbp.live_pools == 0


def test_writer_and_reader_config_errors():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4)
    q = BufferQueue(nbp)
    with pytest.raises(ValueError, match="needs at least one subpartition queue"):
        RecordWriter(pool, [])
    with pytest.raises(TypeError, match="queues must be BufferQueues, got int"):
        RecordWriter(pool, [q, 3])
    with pytest.raises(TypeError):
        RecordWriter("pool", [q])
    for bad in (0, -1, 2**32, 1.5):
        with pytest.raises(ValueError, match=r"max_record_size must be in 1..2\*\*32-1"):
            RecordWriter(pool, [q], max_record_size=bad)
        with pytest.raises(ValueError, match=r"max_record_size must be in 1..2\*\*32-1"):
            RecordReader(q, max_record_size=bad)
    for bad in ("nope", 99, None):
        with pytest.raises(ValueError, match="kind must be one of"):
            RecordWriter(pool, [q], kind=bad)
        with pytest.raises(ValueError, match="kind must be one of"):
            RecordReader(q, kind=bad)
    with pytest.raises(ValueError, match="request_timeout must be >= 0 or None, got -1"):
        RecordWriter(pool, [q], request_timeout=-1)
    with pytest.raises(ValueError, match="zero_copy_min must be >= 0, got -1"):
        RecordReader(q, zero_copy_min=-1)
    with pytest.raises(TypeError, match="gate must be an InputGate or BufferQueue, got list"):
        RecordReader([q])
    r = RecordReader(q)
    for call in (lambda: r.read(timeout=-1), lambda: r.read_batch(timeout=-0.5),
                 lambda: r.read_array("u1", timeout=float("nan"))):
        with pytest.raises(ValueError, match="timeout must be >= 0 or None"):
            call()
    assert pool.in_use == 0


def test_write_array_rejects_what_is_not_fixed_width():
    nbp = NetworkBufferPool(4, 256)
    w = RecordWriter(nbp.create_pool(0, 4), [BufferQueue(nbp)])
    with pytest.raises(ValueError, match="fixed-width record of 300 bytes does not fit a 256 B segment"):
        w.write_array(np.zeros(2, dtype="V300"))
    with pytest.raises(ValueError, match="fixed-width record of 0 bytes"):
        w.write_array(np.zeros((4, 0)))
    with pytest.raises(TypeError):
        w.write_array(np.array([object(), object()]))  # pointers are not data
    assert w.pending_bytes == 0 and w.records_out == 0
    assert w.write_array(np.zeros(0, dtype="<i4")) == 0


def test_notifier_and_pool_timeouts_reject_negative():
    with pytest.raises(ValueError, match="timeout must be >= 0 or None, got -0.1"):
        Notifier().wait(0, -0.1)
    nbp = NetworkBufferPool(1, 256)
    with pytest.raises(ValueError, match="timeout must be >= 0 or None, got -2"):
        nbp.create_pool(0, 1).request_blocking(-2)


# ----------------------------------------------------------------- timeouts and cancellation


@pytest.mark.timeout(30)
def test_writer_request_timeout_raises_buffer_request_timeout():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q], request_timeout=0.2)
    w.write(b"a" * 100)
    w.flush()  # the only segment now sits in the queue, unread
    t0 = time.monotonic()
    with pytest.raises(errors.BufferRequestTimeout, match="requesting an output buffer") as ei:
        w.write(b"b")
    assert 0.15 <= time.monotonic() - t0 < 3
    assert isinstance(ei.value, TimeoutError)
    assert w.backpressure_ns >= 0.15e9
    assert w.records_out == 1 and w.pending_bytes == 0


@pytest.mark.timeout(30)
def test_cancelled_pool_raises_in_the_waiter(threads):
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(1, 1)
    held = pool.request()
    t = threads.start(pool.request_blocking, 30)
    time.sleep(0.1)
    pool.cancel_waiters()
    t.join(5)
    assert type(t.result.get("error")) is errors.CancelledError
    held.recycle()


# ----------------------------------------------------------------- use after recycle / double release


def test_use_after_recycle_and_double_release():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    b = pool.request()
    b.recycle()
    with pytest.raises(errors.BufferRecycledError, match="double release"):
        b.recycle()
    for use in (lambda: b.write(b"x"), b.memory, lambda: b.set_meta(1), lambda: memoryview(b), b.release,
                lambda: BufferQueue(nbp).push_buffer(b)):
        with pytest.raises(errors.BufferRecycledError):
            use()
    assert nbp.available_segments == 2 and pool.in_use == 0

    b = pool.request()
    view = memoryview(b)
    b.release()  # deferred until the view goes
    with pytest.raises(errors.BufferRecycledError, match="double release"):
        b.release()
    with pytest.raises(BufferError, match="live view"):
        b.recycle()
    with pytest.raises(errors.BufferRecycledError, match="used after it was released"):
        b.write(b"x")
    assert pool.in_use == 1
    view.release()
    assert pool.in_use == 0 and nbp.available_segments == 2


def test_destroyed_pool_errors():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(1, 2)
    pool.destroy()
    for call in (pool.request, lambda: pool.request_blocking(0), lambda: pool.set_size(1, 1)):
        with pytest.raises(errors.PoolDestroyedError, match="destroyed"):
            call()
    with pytest.raises(errors.PoolDestroyedError):
        RecordWriter(pool, [BufferQueue(nbp)])


def test_writer_on_a_pool_destroyed_after_it_was_made():
    """The writer keeps the pool object but must not touch the freed C pool."""
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(2, 4)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    pool.destroy()
    with pytest.raises(errors.PoolDestroyedError):
        w.write(b"abc")
    with pytest.raises(errors.PoolDestroyedError):
        w.write_array(np.arange(3))
    assert len(q) == 0
    assert nbp.available_segments == 4 and nbp.unreserved_segments == 4


def test_writer_pool_destroyed_mid_stream_keeps_what_it_has():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    w.write(b"kept")
    pool.destroy()
    w.write(b"also fits in the open buffer")
    with pytest.raises(errors.PoolDestroyedError):
        w.write(b"x" * 300)  # fills the open buffer, then needs a new segment
    w.end_input()
    r = RecordReader(q)
    assert [r.read(timeout=0), r.read(timeout=0)] == [b"kept", b"also fits in the open buffer"]
    # the record cut short by the failure is not delivered as if it were whole
    with pytest.raises(errors.CorruptRecordError, match="ended inside a record"):
        r.read(timeout=0)
    del w, r
    gc.collect()
    assert nbp.available_segments == 4


@pytest.mark.timeout(30)
def test_a_record_cut_by_a_failed_write_is_never_delivered_as_garbage():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q], request_timeout=0.05)
    r = RecordReader(q)
    with pytest.raises(errors.BufferRequestTimeout):
        w.write(b"B" * 300)  # 4 + 252 bytes go out in the only segment, 48 are missing
    assert w.broken is not None and "half-written record (256 of 304 bytes)" in w.broken
    assert r.poll() is None  # the consumer takes that buffer; the segment is free again
    retries = [b"r%07d" % i for i in range(6)]
    # the writer refuses to go on: later records would be read as the rest of the cut one
    with pytest.raises(errors.ChannelClosedError, match="half-written record"):
        w.write_batch(retries)
    with pytest.raises(errors.ChannelClosedError, match="half-written record"):
        w.write(b"x")
    # ending the stream still works, and the consumer learns the stream was cut
    w.end_input()
    with pytest.raises(errors.CorruptRecordError, match="ended inside a record"):
        list(r)


def test_a_write_that_fails_before_any_byte_leaves_the_writer_usable():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q], request_timeout=0.05)
    r = RecordReader(q)
    w.write(b"A" * 248)  # fills the only segment exactly: 4 + 248 = 252, then 4 free
    w.flush()
    with pytest.raises(errors.BufferRequestTimeout):
        w.write(b"C" * 10)  # no segment: nothing of it was written
    assert w.broken is None
    assert bytes(r.poll()) == b"A" * 248
    w.write(b"C" * 10)
    w.end_input()
    assert [bytes(x) for x in r] == [b"C" * 10]


@pytest.mark.timeout(30)
def test_destroy_while_a_thread_waits_wakes_it_without_freeing_under_it():
    import threading
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(1, 1)
    held = pool.request()
    caught = []

    def waiter():
        try:
            pool.request_blocking(timeout=10)
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 5
    while nbp.notifier is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    pool.destroy()
    t.join(5)
    assert not t.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], errors.PoolDestroyedError)
    assert pool.destroyed
    held.recycle()
    assert nbp.available_segments == 2


# ----------------------------------------------------------------- records: too large, wrong kind, bad batch


def _pipe(kind="bytes", max_record_size=64 * 1024 * 1024, segment_size=256, segments=32):
    nbp = NetworkBufferPool(segments, segment_size)
    pool = nbp.create_pool(0, segments)
    q = BufferQueue(nbp)
    return nbp, q, RecordWriter(pool, [q], kind=kind, max_record_size=max_record_size)


@pytest.mark.parametrize("kind, ok, too_big", [
    ("bytes", b"x" * 10, b"x" * 11),
    ("bytes", bytearray(10), memoryview(b"y" * 11)),
    ("str", "é" * 5, "é" * 5 + "x"),  # the UTF-8 length counts: 10 and 11 bytes
    ("pickle", b"0123", b"01234"),  # pickled sizes: limit and limit + 1
])
def test_record_too_large(kind, ok, too_big):
    limit = len(pickle.dumps(ok, 5)) if kind == "pickle" else 10
    nbp, q, w = _pipe(kind, max_record_size=limit)
    w.write(ok)
    pending = w.pending_bytes
    with pytest.raises(errors.RecordTooLargeError, match=rf"record of {limit + 1} bytes exceeds max_record_size={limit}$") as ei:
        w.write(too_big)
    assert isinstance(ei.value, ValueError)
    assert w.pending_bytes == pending and w.records_out == 1  # nothing of it was written
    w.end_input()
    got = list(RecordReader(q, kind=kind))
    assert [bytes(g) if isinstance(g, memoryview) else g for g in got] == [ok if kind != "bytes" else bytes(ok)]


@pytest.mark.parametrize("kind, bad, exc, match", [
    ("bytes", "text", TypeError, "a bytes stream got a str record; encode it or use kind='str'"),
    ("bytes", 5, TypeError, "bytes-like object is required"),
    ("bytes", memoryview(b"abcdef")[::2], BufferError, "not C-contiguous"),
    ("int64", 1.5, TypeError, "an int64 stream got a float record"),
    ("int64", True, TypeError, "an int64 stream got a bool record"),
    ("int64", "7", TypeError, "cannot be interpreted as an integer"),
    ("int64", 2**63, OverflowError, "too big|out of range"),
    ("int64", -(2**63) - 1, OverflowError, "too big|out of range"),
    ("float64", "1.0", TypeError, "must be real number, not str"),
    ("float64", None, TypeError, "must be real number, not NoneType"),
    ("str", b"bytes", TypeError, "a str stream got a bytes record"),
    ("str", "\ud800", UnicodeEncodeError, "surrogates not allowed"),
    ("pickle", threading.Lock(), TypeError, "cannot pickle"),
])
def test_wrong_record_types_are_rejected_without_writing(kind, bad, exc, match):
    nbp, q, w = _pipe(kind)
    good = {"bytes": b"ok", "int64": 1, "float64": 2.5, "str": "ok", "pickle": {"ok": 1}}[kind]
    w.write(good)
    pending = w.pending_bytes
    with pytest.raises(exc, match=match):
        w.write(bad)
    assert w.pending_bytes == pending and w.records_out == 1
    w.write(good)
    w.end_input()
    assert list(RecordReader(q, kind=kind)) == [good, good]


@pytest.mark.parametrize("kind, records, bad_index, exc", [
    ("bytes", [b"a", b"b", "c", b"d"], 2, TypeError),
    ("bytes", [b"a", b"x" * 11, b"d"], 1, errors.RecordTooLargeError),
    ("int64", [1, 2, 3, 2**64, 5], 3, OverflowError),
    ("int64", [1.0], 0, TypeError),
    ("float64", [1.0, 2.0, "3"], 2, TypeError),
    ("str", ["a", "b", "\udc80", "d"], 2, ValueError),  # UnicodeEncodeError (5-argument constructor)
    ("str", ["a", 1], 1, TypeError),
    ("pickle", [1, (2, 3), lambda: 0], 2, pickle.PicklingError),
    ("pickle", [1, threading.Lock()], 1, TypeError),
    ("pickle", [1, 2, 3, (lambda: (lambda: 0))()], 3, (AttributeError, pickle.PicklingError)),  # local object
])
def test_bad_record_in_batch_writes_those_before_it_and_none_of_it(kind, records, bad_index, exc):
    nbp, q, w = _pipe(kind, max_record_size=10 if kind == "bytes" else 1000)
    with pytest.raises(exc) as ei:
        w.write_batch(records)
    assert f"record {bad_index} of the batch ({bad_index} written before it)" in str(ei.value)
    assert ei.value.__cause__ is not None
    assert w.records_out == bad_index
    good = {"bytes": b"ok", "int64": 1, "float64": 2.5, "str": "ok", "pickle": {"ok": 1}}[kind]
    w.write_batch([good])  # the stream is still well formed
    w.end_input()
    got = list(RecordReader(q, kind=kind))
    if kind == "bytes":
        got = [bytes(g) for g in got]
    assert got == records[:bad_index] + [good]


def test_bad_record_in_broadcast_and_keyed_batches():
    nbp = NetworkBufferPool(16, 256)
    pool = nbp.create_pool(0, 16)
    qs = [BufferQueue(nbp) for _ in range(2)]
    w = RecordWriter(pool, qs, kind="int64")
    with pytest.raises(TypeError, match=r"record 2 of the batch \(2 written before it\)"):
        w.write_batch_broadcast([1, 2, "x", 4])
    with pytest.raises(TypeError, match=r"record 1 of the batch"):
        w.write_batch_keyed([10, None], ["a", "b"])
    w.end_input()
    got = [list(RecordReader(q, kind="int64")) for q in qs]
    assert got[0][:2] == [1, 2] and got[1][:2] == [1, 2]
    assert sorted(got[0][2:] + got[1][2:]) == [10]


# ----------------------------------------------------------------- corrupt input on the reading side


def _raw(nbp, pool, q, data, data_type="records", width=0):
    b = pool.request()
    assert b.write(data) == len(data)
    b.set_meta(len(data), data_type, width=width)
    q.push_buffer(b)


@pytest.fixture
def raw_pipe():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(0, 8)
    q = BufferQueue(nbp)
    yield nbp, pool, q
    del q
    gc.collect()
    assert nbp.available_segments == 8


def test_length_over_reader_limit_is_corrupt(raw_pipe):
    nbp, pool, q = raw_pipe
    _raw(nbp, pool, q, struct.pack("<I", 1000) + b"xx")
    r = RecordReader(q, max_record_size=100)
    with pytest.raises(errors.CorruptRecordError, match="record length 1000 exceeds max_record_size=100") as ei:
        r.read(timeout=0)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(errors.CorruptRecordError):
        r.read(timeout=0)  # it stays corrupt; no record is invented


def test_garbage_length_prefix_is_corrupt(raw_pipe):
    nbp, pool, q = raw_pipe
    _raw(nbp, pool, q, struct.pack("<I", 3) + b"abc" + b"\xff\xff\xff\xff" + b"junk")
    r = RecordReader(q)
    assert r.read(timeout=0) == b"abc"
    with pytest.raises(errors.CorruptRecordError, match="record length 4294967295 exceeds max_record_size=67108864"):
        r.read(timeout=0)


def test_split_length_prefix_over_the_limit_is_corrupt(raw_pipe):
    nbp, pool, q = raw_pipe
    hdr = struct.pack("<I", 5000)
    _raw(nbp, pool, q, hdr[:2])
    _raw(nbp, pool, q, hdr[2:] + b"x")
    r = RecordReader(q, max_record_size=4096)
    with pytest.raises(errors.CorruptRecordError, match="record length 5000"):
        r.read(timeout=0)


@pytest.mark.parametrize("stream", [
    struct.pack("<I", 10) + b"only5",  # ends inside the payload
    struct.pack("<I", 10)[:3],  # ends inside the length prefix
])
def test_truncated_stream_is_corrupt(raw_pipe, stream):
    nbp, pool, q = raw_pipe
    _raw(nbp, pool, q, stream)
    q.push_event(END_OF_PARTITION)
    r = RecordReader(q)
    with pytest.raises(errors.CorruptRecordError, match="channel 0 ended inside a record"):
        list(r)


def test_wrong_sized_fixed_records_are_corrupt(raw_pipe):
    nbp, pool, q = raw_pipe
    _raw(nbp, pool, q, struct.pack("<I", 3) + b"abc")
    _raw(nbp, pool, q, b"\x00" * 4, data_type="fixed", width=4)
    _raw(nbp, pool, q, b"\x01" * 10, data_type="fixed", width=4)
    r = RecordReader(q, kind="int64")
    with pytest.raises(errors.CorruptRecordError, match="int64 record of 3 bytes"):
        r.read(timeout=0)
    with pytest.raises(errors.CorruptRecordError, match="int64 record of 4 bytes"):
        r.read(timeout=0)
    r = RecordReader(q)  # bytes: 4-byte records, then a buffer that ends 2 bytes into one
    assert [r.read(timeout=0), r.read(timeout=0)] == [b"\x01" * 4] * 2
    with pytest.raises(errors.CorruptRecordError, match="fixed-width buffer ends inside a 4-byte record"):
        r.read(timeout=0)
    del r


def test_float_and_str_decoding_errors(raw_pipe):
    nbp, pool, q = raw_pipe
    _raw(nbp, pool, q, struct.pack("<I", 2) + b"\xc3\x28")  # invalid UTF-8
    with pytest.raises(UnicodeDecodeError):
        RecordReader(q, kind="str").read(timeout=0)
    q2 = BufferQueue(nbp)
    _raw(nbp, pool, q2, struct.pack("<I", 4) + b"abcd")
    with pytest.raises(errors.CorruptRecordError, match="float64 record of 4 bytes"):
        RecordReader(q2, kind="float64").read(timeout=0)
    q3 = BufferQueue(nbp)
    _raw(nbp, pool, q3, struct.pack("<I", 3) + b"not")
    with pytest.raises(pickle.UnpicklingError):
        RecordReader(q3, kind="pickle").read(timeout=0)
    del q2, q3


def test_gate_and_queue_errors():
    nbp = NetworkBufferPool(2, 256)
    with pytest.raises(ValueError, match="an InputGate needs at least one channel"):
        InputGate([])
    with pytest.raises(TypeError, match="channels must be BufferQueues"):
        InputGate([object()])
    with pytest.raises(ValueError, match="capacity must be >= 2, got 0"):
        BufferQueue(nbp, capacity=0)
    g = InputGate([BufferQueue(nbp)])
    with pytest.raises(IndexError, match=r"channel 3 out of range \(gate has 1\)"):
        g.block(3)


def test_mixing_network_pools_is_refused():
    """A descriptor only names a segment index: read against another arena it
    would point outside it. Every place where two arenas could meet says no."""
    n1, n2 = NetworkBufferPool(4, 256), NetworkBufferPool(64, 4096)
    p2 = n2.create_pool(0, 64)
    q1, q2 = BufferQueue(n1), BufferQueue(n2)
    b = p2.request()
    b.write(b"x" * 4000)
    with pytest.raises(ValueError, match="another NetworkBufferPool"):
        q1.push_buffer(b)
    assert len(q1) == 0 and not b.recycled
    with pytest.raises(ValueError, match="queues must belong to the pool's NetworkBufferPool"):
        RecordWriter(p2, [q2, q1])
    with pytest.raises(ValueError, match="share one NetworkBufferPool"):
        RecordReader(InputGate([q2, q1]))
    b.recycle()
    assert n2.available_segments == 64 and n1.available_segments == 4


@pytest.mark.parametrize("make", [
    lambda nbp: RecordWriter(None, [BufferQueue(nbp)]),
    lambda nbp: BufferQueue(None, capacity=4),
    lambda nbp: BufferQueue(nbp).push_buffer(None),
    lambda nbp: RecordReader(None),
    lambda nbp: InputGate([None]),
])
def test_none_where_an_object_belongs_is_a_type_error(make):
    with pytest.raises(TypeError):
        make(NetworkBufferPool(2, 256))


def test_nothing_is_accepted_after_end_input():
    nbp = NetworkBufferPool(8, 256)
    q = BufferQueue(nbp)
    w = RecordWriter(nbp.create_pool(0, 8), [q])
    r = RecordReader(q)
    w.write(b"last")
    w.end_input()
    w.end_input()  # idempotent
    for attempt in (lambda: w.write(b"late"), lambda: w.write_batch([b"a", b"b"]),
                    lambda: w.write_array(np.zeros(4, np.int64)), lambda: w.broadcast_event(16)):
        with pytest.raises(errors.ChannelClosedError, match="end_input"):
            attempt()
    assert [bytes(x) for x in r] == [b"last"]
