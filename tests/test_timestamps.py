"""Timestamps travel with records (issue 22, item 1).

Once ``assign_timestamps`` gave them, a record's time goes through map,
filter, flat_map (each output the time of its input), process (the context
reads it and may set it), union, connect, key_by and every exchange, local and
TCP, and through a restore (in-flight data of an unaligned checkpoint keeps
its times). A window result carries the window's max_timestamp, a join result
the larger of its two times. A stream without timestamps carries none.

Every test reads the times back with ``observe``: a keyed process function
that emits ``(record, ctx.timestamp)``.
"""
from __future__ import annotations

import glob
import math
import os
import time
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import FailOnceAfterCheckpoint
from pyflowbuf import errors
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter, ts_fill, ts_repeat, ts_select
from pyflowbuf.jobgraph.graph import has_timestamps
from pyflowbuf.windows import TimeWindow


def time_of(i: int) -> float:
    """Event time of record i: out of order by up to 1.5 s, exact in binary."""
    return i * 0.5 - (i % 4) * 0.5


def records(n: int) -> list:
    return [(i, time_of(i)) for i in range(n)]


def timed(env, n, **kw):
    return env.from_collection(records(n)).assign_timestamps(lambda r: r[1], out_of_orderness=2.0, **kw)


def _emit_with_time(key, record, state, ctx):
    return [(record, ctx.timestamp)]


def observe(stream, parallelism=None):
    """(record, its timestamp) for every record of ``stream``."""
    return (stream.key_by(lambda r: 0).process(_emit_with_time, parallelism=parallelism, name="observe")
            .collect(parallelism=parallelism))


# ---- each operator kind ----

@pytest.mark.parametrize("chaining", [True, False])
def test_map_filter_and_flat_map_keep_the_time_of_their_input(chaining):
    env = fb.Environment(parallelism=2, chaining=chaining, max_batch=16)
    s = timed(env, 200)
    mapped = observe(s.map(lambda r: ("m", r[0])))
    kept = observe(s.filter(lambda r: r[0] % 3 == 0))
    flat = observe(s.flat_map(lambda r: [("a", r[0]), ("b", r[0])] if r[0] % 2 else []))
    env.execute(timeout=60)
    assert sorted(mapped.result) == sorted((("m", i), time_of(i)) for i in range(200))
    assert sorted(kept.result) == sorted(((i, time_of(i)), time_of(i)) for i in range(0, 200, 3))
    assert sorted(flat.result) == sorted(((tag, i), time_of(i)) for i in range(1, 200, 2) for tag in "ab")


def test_process_reads_the_time_and_may_set_it_for_what_it_returns():
    def shift(key, record, state, ctx):
        assert ctx.timestamp == time_of(record[0])
        if record[0] % 2:
            ctx.timestamp = ctx.timestamp + 100.0
        return [("p", record[0])]

    env = fb.Environment(parallelism=2)
    out = observe(timed(env, 100).key_by(lambda r: r[0] % 5).process(shift))
    env.execute(timeout=60)
    assert sorted(out.result) == sorted((("p", i), time_of(i) + (100.0 if i % 2 else 0.0)) for i in range(100))


def test_keyed_process_without_context_reduce_and_map_batches_keep_times():
    env = fb.Environment(parallelism=2, chaining=False)
    s = timed(env, 60)
    counted = observe(s.key_by(lambda r: r[0] % 3).process(lambda k, r, state: [(k, r[0])]))
    reduced = observe(s.key_by(lambda r: r[0] % 3).reduce(lambda a, b: (b[0], a[1] + b[1])))
    env.execute(timeout=60)
    assert sorted(counted.result) == sorted(((i % 3, i), time_of(i)) for i in range(60))
    assert sorted(t for _, t in reduced.result) == sorted(time_of(i) for i in range(60))


def test_union_keeps_each_inputs_times():
    env = fb.Environment(parallelism=2, chaining=False)
    a = timed(env, 50).map(lambda r: ("a", r[0]))
    b = env.from_collection([(i, 1000.0 + i) for i in range(30)]).assign_timestamps(lambda r: r[1])
    out = observe(a.union(b.map(lambda r: ("b", r[0]))))
    env.execute(timeout=60)
    want = [(("a", i), time_of(i)) for i in range(50)] + [(("b", i), 1000.0 + i) for i in range(30)]
    assert sorted(out.result) == sorted(want)


def test_connect_map_and_process_keep_each_inputs_times():
    def on_a(key, r, state, ctx):
        return [("a", r[0])]

    def on_b(key, r, state, ctx):
        ctx.timestamp = ctx.timestamp - 0.25
        return [("b", r[0]), ("b2", r[0])]

    env = fb.Environment(parallelism=2, chaining=False)
    a = timed(env, 40)
    b = env.from_collection([(i, 500.0 + i) for i in range(20)]).assign_timestamps(lambda r: r[1])
    mapped = observe(a.connect(b).map(lambda r: ("a", r[0]), lambda r: ("b", r[0])))
    processed = observe(a.key_by(lambda r: r[0] % 4).connect(b.key_by(lambda r: r[0] % 4)).process(on_a, on_b))
    plain = observe(a.connect(b).process(lambda r, st: [("a", r[0])], lambda r, st: [("b", r[0])]))
    env.execute(timeout=60)
    want = [(("a", i), time_of(i)) for i in range(40)] + [(("b", i), 500.0 + i) for i in range(20)]
    assert sorted(mapped.result) == sorted(want)
    assert sorted(plain.result) == sorted(want)
    assert sorted(processed.result) == sorted(
        [(("a", i), time_of(i)) for i in range(40)]
        + [((tag, i), 499.75 + i) for i in range(20) for tag in ("b", "b2")])


@pytest.mark.parametrize("exchange", ["key_by", "rebalance", "broadcast", "forward"])
def test_every_local_exchange_carries_the_times(exchange):
    env = fb.Environment(parallelism=3, chaining=False, max_batch=7)
    s = timed(env, 120, parallelism=3)
    if exchange == "key_by":
        s = s.key_by(lambda r: r[0] % 7).map(lambda r: r)
    elif exchange == "rebalance":
        s = s.rebalance().map(lambda r: r, parallelism=2)
    elif exchange == "broadcast":
        s = s.broadcast().map(lambda r: r, parallelism=2)
    else:
        s = s.forward().map(lambda r: r)
    out = observe(s)
    env.execute(timeout=60)
    copies = 2 if exchange == "broadcast" else 1
    assert sorted(out.result) == sorted([((i, time_of(i)), time_of(i)) for i in range(120)] * copies)


def test_large_records_spanning_buffers_keep_their_times():
    env = fb.Environment(parallelism=2, chaining=False, segment_size=4096)
    s = env.from_collection([(i, "x" * (i * 300)) for i in range(40)]).assign_timestamps(lambda r: float(r[0]))
    out = observe(s.map(lambda r: (r[0], len(r[1]))))
    env.execute(timeout=60)
    assert sorted(out.result) == [((i, i * 300), float(i)) for i in range(40)]


def test_times_cross_tcp_between_workers():
    env = fb.Environment(workers=2, parallelism=2, chaining=False)
    s = timed(env, 300, parallelism=2)
    out = observe(s.map(lambda r: (r[0], r[0] * 2)).key_by(lambda r: r[0] % 5).map(lambda r: r), parallelism=2)
    env.execute(timeout=120)
    assert sorted(out.result) == sorted(((i, 2 * i), time_of(i)) for i in range(300))


# ---- windows and joins ----

def test_window_results_carry_max_timestamp_and_a_second_window_needs_no_new_assigner():
    env = fb.Environment(parallelism=2)
    s = timed(env, 200)
    per5 = (s.map(lambda r: (r[0] % 3, r[1]))       # an event-time operator after a map
             .key_by(lambda r: r[0]).window(fb.Tumbling(5.0))
             .aggregate(fb.Count(), window_function=lambda k, w, n: (k, w.start, n)))
    first = observe(per5)
    per10 = observe(per5.key_by(lambda r: r[0]).window(fb.Tumbling(10.0))
                    .process(lambda k, w, rs: [(k, w.start, sum(n for _, _, n in rs))]))
    env.execute(timeout=60)
    counts: dict = {}
    for i in range(200):
        start = math.floor(time_of(i) / 5.0) * 5.0
        counts[(i % 3, start)] = counts.get((i % 3, start), 0) + 1
    assert sorted(first.result) == sorted(((k, s0, n), math.nextafter(s0 + 5.0, -math.inf))
                                          for (k, s0), n in counts.items())
    per_ten: dict = {}
    for (k, s0), n in counts.items():
        start = math.floor(s0 / 10.0) * 10.0
        per_ten[(k, start)] = per_ten.get((k, start), 0) + n
    assert sorted(per10.result) == sorted(((k, s0, n), math.nextafter(s0 + 10.0, -math.inf))
                                          for (k, s0), n in per_ten.items())
    assert TimeWindow(0.0, 10.0).max_timestamp == math.nextafter(10.0, -math.inf)


@pytest.mark.parametrize("after_map", [False, True])
def test_late_records_keep_their_times(after_map):
    """late() is a side output, and side outputs keep their records' times:
    read again with the assigner's function where the window reads the
    assigner's stream, carried with the records after a map (issue 27)."""
    data = [(0, 10.0), (1, 11.0), (2, 30.0), (3, 1.0), (4, 31.0)]    # (3, 1.0) is late
    env = fb.Environment(parallelism=1, max_batch=1)
    s = env.from_collection(data).assign_timestamps(lambda r: r[1], watermark_interval=0)
    if after_map:
        s = s.map(lambda r: r)
    res = s.key_by(lambda r: 0).window(fb.Tumbling(10.0)).aggregate(fb.Count())
    late = observe(res.late())
    results = observe(res)
    # a window downstream reads them in event time (no "has no timestamps")
    res.late().key_by(lambda r: 0).window(fb.Tumbling(1.0)).allowed_lateness(100).aggregate(fb.Count())
    env.execute(timeout=60)
    assert late.result == [((3, 1.0), 1.0)]
    assert sorted(results.result) == [(2, math.nextafter(20.0, -math.inf)), (2, math.nextafter(40.0, -math.inf))]


def test_join_results_carry_the_larger_time():
    env = fb.Environment(parallelism=2)
    left = env.from_collection([("k", 1.0, "l1"), ("k", 7.0, "l2")]).assign_timestamps(lambda r: r[1])
    right = env.from_collection([("k", 3.0, "r1"), ("k", 12.0, "r2")]).assign_timestamps(lambda r: r[1])
    windowed = observe(left.join(right).where(lambda r: r[0]).equal_to(lambda r: r[0])
                       .window(fb.Tumbling(10.0)).apply(lambda a, b: (a[2], b[2])))
    interval = observe(left.key_by(lambda r: r[0]).interval_join(right.key_by(lambda r: r[0]), -3.0, 6.0)
                       .process(lambda a, b: [(a[2], b[2])]))
    env.execute(timeout=60)
    assert sorted(windowed.result) == [(("l1", "r1"), 3.0), (("l2", "r1"), 7.0)]
    # right times in [t - 3, t + 6]: l1 at 1 meets r1 at 3, l2 at 7 meets r2 at 12
    assert sorted(interval.result) == [(("l1", "r1"), 3.0), (("l2", "r2"), 12.0)]


# ---- streams without timestamps ----

def test_streams_without_timestamps_carry_none_and_windows_say_so():
    env = fb.Environment(parallelism=2)
    plain = env.from_collection(list(range(10)))
    out = observe(plain.map(lambda x: x + 1))
    assert not has_timestamps(plain.map(lambda x: x).node)
    mixed = plain.map(lambda x: (x, float(x))).union(timed(env, 5))
    with pytest.raises(errors.ConfigurationError, match="no timestamps"):
        mixed.key_by(lambda r: r[0]).window(fb.Tumbling(1.0))
    env.execute(timeout=60)
    assert sorted(out.result) == [(i + 1, None) for i in range(10)]


def test_on_end_outputs_get_the_highest_time_seen_unless_set():
    def on_end(key, state, ctx):
        return [("end", key)]

    env = fb.Environment(parallelism=1)
    out = observe(timed(env, 20).key_by(lambda r: r[0] % 2).process(lambda k, r, st, ctx: None, on_end=on_end))
    env.execute(timeout=60)
    high = max(time_of(i) for i in range(20))
    assert sorted(out.result) == [(("end", 0), high), (("end", 1), high)]


# ---- restore: checkpointed state and unaligned in-flight data ----



def slow(x):
    if x[0] % 20 == 0:
        time.sleep(0.002)
    return x


def restore_run(tmp_path, mode, n=1500):
    """A job that fails once after a checkpoint and restores; the in-flight
    bytes of the checkpoint it restored from."""
    fail = FailOnceAfterCheckpoint(n // 2)
    env = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, checkpoint_alignment=mode, segment_size=4096)
    fail.env = env
    s = env.from_iterable(records(n), rate_limit=3000).assign_timestamps(lambda r: r[1])
    # a slow stage keeps its input queues full: unaligned barriers overtake data
    s = s.map(lambda r: (r[0], r[0] % 7)).rebalance().map(slow, name="slow").key_by(lambda r: r[1]).map(fail)
    out = observe(s, parallelism=1)
    env.execute(timeout=120)
    restored = env.last_execution.restored_from
    assert fail.fired and restored is not None
    assert sorted(out.result) == sorted(((i, i % 7), time_of(i)) for i in range(n))
    return sum(c.get("inflight_bytes") or 0 for c in env.checkpoints() if c["id"] == restored)


def test_a_restore_from_an_aligned_checkpoint_keeps_the_times(tmp_path):
    restore_run(tmp_path, "aligned")


def test_a_restore_from_an_unaligned_checkpoint_replays_inflight_data_with_its_times(tmp_path):
    # every run checks the output; at least one must have replayed in-flight data
    for attempt in range(4):
        if restore_run(tmp_path / str(attempt), "unaligned"):
            return
    pytest.fail("no restore replayed in-flight data in 4 runs")


def test_replayed_inflight_buffers_keep_their_times():
    """The core of an unaligned restore: the buffers a reader recorded from a
    timestamped channel (in-flight data), replayed through a fresh reader,
    give back the records and their times, also where a record spans buffers
    and where a batch ended inside a buffer (its unread rest)."""
    net = NetworkBufferPool(64, 256)
    q = BufferQueue(net)
    w = RecordWriter(net.create_pool(1, 60), [q], kind="str", timestamped=True)
    reader = RecordReader(InputGate([q]), kind="str", timestamped=True)
    recs = ["r%d-" % i + "y" * (i * 37 % 600) for i in range(40)]
    times = [i * 0.25 for i in range(40)]
    w.write_batch(recs, 0, array("d", times))
    w.flush()
    got = reader.read_batch(15, timeout=0)
    assert list(reader.timestamps) == times[:len(got)]
    prefix = reader.unread_prefix(0)
    reader.start_recording(0)
    while reader.read_batch(100, timeout=0):
        pass
    inflight = ([prefix] if prefix is not None else []) + reader.stop_recording(0)
    fresh = RecordReader(InputGate([BufferQueue(net)]), kind="str", timestamped=True)
    fresh.replay([(0, item) for item in inflight])
    out, out_times = [], []
    while True:
        b = fresh.read_batch(100, timeout=0)
        if not b:
            break
        out += b
        out_times += list(fresh.timestamps)
    assert out == recs[len(got):]
    assert out_times == times[len(got):]


def test_timestamped_writer_and_reader_refuse_mismatches():
    net = NetworkBufferPool(8, 4096)
    q = BufferQueue(net)
    w = RecordWriter(net.create_pool(1, 4), [q], kind="int64", timestamped=True)
    with pytest.raises(TypeError, match="timestamps"):
        w.write_batch([1, 2])
    with pytest.raises(ValueError, match="2 records but 1 timestamps"):
        w.write_batch([1, 2], 0, array("d", [1.0]))
    with pytest.raises(TypeError, match="rows"):
        w.write_array([1, 2])
    plain = RecordWriter(net.create_pool(1, 4), [BufferQueue(net)], kind="int64")
    with pytest.raises(ValueError, match="timestamped=True"):
        plain.write_batch([1], 0, array("d", [1.0]))
    # a plain record read as a timestamped one is too short: a clear error, not garbage
    q3 = BufferQueue(net)
    w3 = RecordWriter(net.create_pool(1, 4), [q3], kind="str")
    w3.write_batch(["ab"])
    w3.flush()
    with pytest.raises(errors.CorruptRecordError, match="timestamped"):
        RecordReader(q3, kind="str", timestamped=True).read_batch(10, timeout=0)


def test_ts_helpers():
    ts = array("d", [1.0, 2.0, 3.0])
    assert list(ts_select(ts, [True, 0, "yes"])) == [1.0, 3.0]
    assert list(ts_repeat(ts, [0, 2, 1])) == [2.0, 2.0, 3.0]
    assert list(ts_fill(4.5, 2)) == [4.5, 4.5]
    with pytest.raises(ValueError):
        ts_select(ts, [True])
    with pytest.raises(ValueError):
        ts_repeat(ts, [1, -1, 0])


# ---- differential: a random chain against a plain-Python reference ----

STEPS = ["map", "filter", "flat_map", "process_set", "key_by", "rebalance", "union", "connect"]


def ref_step(step, items):
    """The reference: (record, time) pairs after one step."""
    if step == "map":
        return [((v * 3 + 1) % 1000, t) for v, t in items]
    if step == "filter":
        return [(v, t) for v, t in items if v % 3 != 0]
    if step == "flat_map":
        return [(w, t) for v, t in items if v % 2 for w in (v, v + 1)]
    if step == "process_set":
        return [(v, t + v % 5) for v, t in items]
    if step == "union":
        return items + [(v + 7, t) for v, t in items]
    if step == "connect":
        return [(v, t) for v, t in items] + [(v * 2, t) for v, t in items if v % 2 == 0]
    return items        # key_by, rebalance: the records as they are


def _set_time(key, v, state, ctx):
    ctx.timestamp = ctx.timestamp + v % 5
    return [v]


def pipe_step(step, s, p):
    if step == "map":
        return s.map(lambda v: (v * 3 + 1) % 1000)
    if step == "filter":
        return s.filter(lambda v: v % 3 != 0)
    if step == "flat_map":
        return s.flat_map(lambda v: [v, v + 1] if v % 2 else [])
    if step == "process_set":
        return s.key_by(lambda v: v % 4).process(_set_time)
    if step == "key_by":
        return s.key_by(lambda v: v % 5).map(lambda v: v)
    if step == "rebalance":
        return s.rebalance().map(lambda v: v, parallelism=p)
    if step == "union":
        return s.union(s.map(lambda v: v + 7))
    return s.connect(s.filter(lambda v: v % 2 == 0)).map(lambda v: v, lambda v: v * 2)


@settings(max_examples=12)
@given(values=st.lists(st.tuples(st.integers(0, 999), st.integers(-40, 40)), min_size=0, max_size=60),
       steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=4),
       parallelism=st.integers(1, 2), chaining=st.booleans())
def test_random_chains_match_the_reference(values, steps, parallelism, chaining):
    items = [(v, t * 0.5) for v, t in values]
    env = fb.Environment(parallelism=parallelism, chaining=chaining, max_batch=8)
    s = env.from_collection(items, kind="struct").assign_timestamps(lambda r: r[1]).map(lambda r: r[0])
    for step in steps:
        s = pipe_step(step, s, parallelism)
        items = ref_step(step, items)
    out = observe(s)
    env.execute(timeout=60)
    assert sorted(out.result) == sorted(items)


def test_processing_time_timer_outputs_carry_the_timer_time():
    registered = {}

    def fn(key, r, state, ctx):
        if "t" not in state:
            state["t"] = ctx.current_processing_time() + 0.05
            registered[key] = state["t"]
            ctx.register_processing_time_timer(state["t"])

    def on_timer(key, t, state, ctx):
        return [("timer", key)]

    env = fb.Environment(parallelism=1)
    s = env.from_iterable([(i, float(i)) for i in range(40)], rate_limit=100).assign_timestamps(lambda r: r[1])
    out = observe(s.key_by(lambda r: 0).process(fn, on_timer=on_timer))
    env.execute(timeout=60)
    assert out.result == [(("timer", 0), registered[0])]


def test_times_survive_flushing_after_every_record():
    env = fb.Environment(parallelism=2, chaining=False, buffer_timeout=0)
    out = observe(timed(env, 30).map(lambda r: r[0]).filter(lambda i: i % 2 == 0))
    env.execute(timeout=60)
    assert sorted(out.result) == sorted((i, time_of(i)) for i in range(0, 30, 2))


@pytest.mark.parametrize("chaining", [True, False])
def test_a_connect_of_a_timestamped_and_a_plain_stream_carries_none_chained_or_not(chaining):
    env = fb.Environment(parallelism=1, chaining=chaining)
    a = timed(env, 5).map(lambda r: r[0])
    b = env.from_collection([100, 101])
    out = observe(a.connect(b).map(lambda x: x, lambda x: x).forward())
    env.execute(timeout=60)
    assert sorted(out.result) == [(i, None) for i in (0, 1, 2, 3, 4, 100, 101)]


class FailInWorker:
    """Raises once (a marker file, since workers are processes) from the
    ``at``-th record on, once a checkpoint in ``chk`` is complete."""

    def __init__(self, marker, at, chk):
        self.marker, self.at, self.chk = str(marker), at, str(chk)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        if self.calls >= self.at and self.calls % 25 == 0 and glob.glob(os.path.join(self.chk, "chk-*", "_metadata")):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            raise RuntimeError("injected failure in a worker")
        return x


def test_a_restore_with_workers_keeps_the_times(tmp_path):
    n = 3000
    fail = FailInWorker(tmp_path / "fired", 400, tmp_path / "chk")
    env = fb.Environment(workers=2, parallelism=2, chaining=False, checkpoint_interval=0.05,
                         checkpoint_dir=tmp_path / "chk", restart_attempts=2, checkpoint_alignment="unaligned")
    s = env.from_iterable(records(n), rate_limit=6000).assign_timestamps(lambda r: r[1])
    s = s.map(lambda r: (r[0], r[0] % 7)).key_by(lambda r: r[1]).map(fail)
    out = observe(s, parallelism=1)
    env.execute(timeout=120)
    assert os.path.exists(tmp_path / "fired") and env.last_execution.restored_from is not None
    assert sorted(out.result) == sorted(((i, i % 7), time_of(i)) for i in range(n))


def test_an_operator_harness_feeds_and_shows_times():
    from pyflowbuf.testing import OperatorHarness

    env = fb.Environment()
    counts = (timed(env, 3).map(lambda r: ("k", r[0]))         # times travel: no timestamp function here
                           .key_by(lambda r: r[0]).window(fb.Tumbling(10.0)).aggregate(fb.Count()))
    h = OperatorHarness(counts)
    with pytest.raises(errors.ConfigurationError, match="timestamps="):
        h.process([("k", 1)])
    assert h.process([("k", 1), ("k", 2), ("k", 3)], timestamps=[1.0, 4.0, 12.0]) == []
    assert h.process_watermark(10.0) == [2]
    assert h.output_timestamps == [math.nextafter(10.0, -math.inf)]
    assert h.finish() == [1]
    assert h.output_timestamps[-1] == math.nextafter(20.0, -math.inf)
    with pytest.raises(errors.ConfigurationError, match="2 records but 1 timestamps"):
        OperatorHarness(counts).process([("k", 1), ("k", 2)], timestamps=[1.0])



def test_unkeyed_process_reads_and_sets_the_time():
    def fn(r, ctx):
        assert ctx.timestamp == time_of(r[0])
        ctx.timestamp = ctx.timestamp + 1000.0
        return [r[0]]

    env = fb.Environment(parallelism=2)
    out = observe(timed(env, 30).process(fn))
    env.execute(timeout=60)
    assert sorted(out.result) == sorted((i, time_of(i) + 1000.0) for i in range(30))


def test_trigger_windows_carry_max_timestamp_and_count_windows_carry_none():
    env = fb.Environment(parallelism=1)
    s = timed(env, 40).map(lambda r: (0, r[0]))
    early = observe(s.key_by(lambda r: r[0])
                     .window(fb.Tumbling(10.0), trigger=fb.ContinuousEventTimeTrigger(2.0))
                     .aggregate(fb.Count()))
    counted = s.key_by(lambda r: r[0]).window(fb.CountWindow(5)).aggregate(fb.Count())
    plain = observe(counted)
    with pytest.raises(errors.ConfigurationError, match="no timestamps"):
        counted.key_by(lambda n: 0).window(fb.Tumbling(1.0))
    env.execute(timeout=60)
    assert early.result and all(t in {math.nextafter(e, -math.inf) for e in (10.0, 20.0)} for _, t in early.result)
    assert plain.result == [(5, None)] * 8
