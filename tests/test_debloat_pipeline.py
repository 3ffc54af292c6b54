"""Buffer debloating in running jobs: nothing lost or reordered (threads and
workers=2 over TCP), memory given back under backpressure and taken back
when the consumer speeds up, pools never below their minimum, figures in
env.metrics() and the JSON log."""
import json
import threading
import time

import pytest

import pyflowbuf as fb
from pipeline_helpers import cancel_and_join, wait_for

pytestmark = pytest.mark.timeout(120)

SEG = 32 * 1024
FAST = dict(debloat=True, debloat_period=0.03, debloat_samples=4)


def _gates(job):
    return [g for m in job.metrics().values() for g in (m.get("debloat") or [])]


def test_local_nothing_lost_or_reordered_with_large_records():
    """A slow consumer makes the sizes shrink to far below the records, some
    of which span several segments: every record arrives, in order."""
    env = fb.Environment(chaining=False, max_batch=16, **FAST)
    sizes = [(i * 7919) % (3 * SEG) for i in range(1500)]
    records = [i.to_bytes(4, "little") * (n // 4 + 1) for i, n in zip(range(1500), sizes)]
    seen_sizes = set()

    def slow(batch):
        time.sleep(0.002)
        return batch

    job_box = []

    def look(batch):
        for t in job_box[0].tasks:
            for g in getattr(t, "debloat_gates", None) or []:
                seen_sizes.add(g["buffer_size"])
        return batch

    out = (env.from_iterable(records, kind="bytes")
              .map(bytes, kind="bytes", name="copy")
              .map_batches(slow, kind="bytes", name="slow")
              .map_batches(look, kind="bytes", name="look")
              .collect())
    job_box.append(env.execute_async())
    job_box[0].join(100)
    assert out.result == records
    assert min(seen_sizes) < SEG, f"the sizes never shrank: {seen_sizes}"


def test_keyed_rebalance_order_per_key_with_parallelism():
    env = fb.Environment(2, chaining=False, max_batch=32, **FAST)
    n = 60_000

    def slow(x):
        if x % 500 == 0:
            time.sleep(0.01)
        return x

    out = (env.from_sequence(0, n, parallelism=1)
              .rebalance().map(lambda x: x, kind="int64", name="spread")
              .key_by(lambda x: x % 5).map(slow, kind="int64", name="slow")
              .collect())
    env.execute(100)
    got = out.result
    assert sorted(got) == list(range(n))
    for k in range(5):
        mine = [x for x in got if x % 5 == k]
        # one producer feeds each key's channel per spread subtask: per-producer order is kept
        assert sorted(mine) == list(range(k, n, 5))


def test_workers_2_nothing_lost_or_reordered():
    env = fb.Environment(2, workers=2, max_batch=64, **FAST)
    n = 100_000

    def slow(x):
        if x % 2000 == 0:
            time.sleep(0.02)
        return x

    out = (env.from_sequence(0, n, parallelism=1)
              .map(slow, kind="int64", name="slow", parallelism=1)
              .rebalance().map(lambda x: x * 2, kind="int64", name="double")
              .collect())
    env.execute(100)
    got = out.result
    assert sorted(got) == [2 * x for x in range(n)]
    # round robin from one producer: each consumer (one of them across TCP)
    # gets one residue class, and must hand it on in order
    for j in range(2):
        mine = [y for y in got if (y // 2) % 2 == j]
        assert mine == sorted(mine)


def test_workers_2_forward_keeps_order_and_reports_debloat():
    env = fb.Environment(1, workers=2, max_batch=32, **FAST)
    n = 40_000
    seen = []

    def slow(x):
        if x % 32 == 0:
            time.sleep(0.003)
        return x

    out = (env.from_sequence(0, n)
              .rebalance().map(slow, kind="int64", name="slow")
              .collect())
    ex = env.execute_async()
    while not ex.done:
        seen += _gates(ex)
        time.sleep(0.05)
    ex.join(100)
    assert out.result == list(range(n))
    assert seen, "no debloat figures reached the driver's metrics"


def test_memory_given_back_under_backpressure_and_taken_back():
    """A sink slow enough that its in-flight target is a few KiB: output
    pools drop to a few segments (never below their minimum) and the pages
    of freed segments leave the process; when the sink speeds up the pools
    get their segments back within a few periods."""
    slow = threading.Event()
    slow.set()
    period = 0.05

    def sink(batch):
        if slow.is_set():
            time.sleep(0.05)

    # about 30 KB/s at the sink and a 0.2 s target: a few KiB in flight
    env = fb.Environment(chaining=False, max_batch=8, output_buffers=(2, 256), debloat=True,
                         debloat_period=period, debloat_samples=4, debloat_target=0.2)
    (env.from_sequence(0, None, rate_limit=20_000)
        .map(lambda x: b"r" * 200, kind="bytes", name="pad")
        .sink(sink, batched=True, name="sink"))
    job = env.execute_async()
    try:
        pools = {}

        def sink_pool():
            for t in job.tasks:
                if t.vertex.name.startswith("pad") or any(n.name == "pad" for n in t.vertex.nodes):
                    return t.outputs[0].pool
            return None

        wait_for(lambda: sink_pool() is not None and sink_pool().in_use > 0, "data to flow", timeout=20)
        pool = sink_pool()
        # the configured bounds: the debloater may already have lowered the cap
        # by the time data is seen flowing (a loaded machine), never the floor
        lo, hi = 2, 256
        assert pool.min_size == lo and lo <= pool.max_size <= hi
        low = []

        def watch():
            low.append(pool.max_size)
            assert pool.min_size == lo and pool.max_size >= lo, "a pool went below its minimum"
            return pool.max_size <= 16 and pool.in_use <= 16

        wait_for(watch, lambda: f"the pool to give back segments: max {pool.max_size}, in use {pool.in_use}",
                 timeout=60)
        net = job.network_pool
        wait_for(lambda: net.resident_bytes < net.total_bytes / 2 and job._debloat_timer.released_bytes > 0,
                 lambda: f"resident memory to shrink: {net.resident_bytes} B, queues "
                 f"{[(q.buffer_size, q.desired_bytes, len(q)) for q in job._queues]}, released "
                 f"{job._debloat_timer.released_bytes}, gates {[getattr(t, 'debloat_gates', None) for t in job.tasks]}",
                 timeout=30)
        gates = [g for t in job.tasks for g in (getattr(t, "debloat_gates", None) or [])]
        assert any(g["buffer_size"] < SEG for g in gates)
        # throughput rises: the cap goes back up within a few periods
        slow.clear()
        t0 = time.monotonic()
        wait_for(lambda: pool.max_size >= hi // 2, lambda: f"memory to be taken back: max {pool.max_size}",
                 timeout=40 * period + 5)
        pools["took_back_s"] = time.monotonic() - t0
        assert pool.min_size == lo
    finally:
        cancel_and_join(job, failure_ok=True)
    assert pools["took_back_s"] < 40 * period + 5


def test_debloat_figures_in_metrics_and_json_log(tmp_path):
    log = tmp_path / "m.jsonl"
    env = fb.Environment(chaining=False, metrics_interval=0.1, metrics_log=str(log), max_batch=16, **FAST)

    def slow(batch):
        time.sleep(0.002)

    env.from_sequence(0, 30_000).sink(slow, batched=True, name="sink")
    env.execute(100)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows = [r for r in rows if r.get("debloat")]
    assert rows, "no debloat figures in the JSON log"
    g = rows[-1]["debloat"][0]
    assert set(g) >= {"buffer_size", "time_to_consume_s", "inflight_bytes", "segments_held"}
    assert "debloat_buffer_size" in rows[-1]
    m = env.metrics()
    assert any("debloat" in v for v in m.values())


def test_off_by_default_changes_nothing():
    env = fb.Environment(chaining=False)
    out = env.from_sequence(0, 1000).map(lambda x: x, kind="int64").collect()
    ex = env.execute_async()
    ex.join(60)
    assert out.result == list(range(1000))
    assert getattr(ex, "_debloat_timer", None) is None
    assert not any("debloat" in v for v in env.metrics().values())


def test_channels_start_small_when_debloating():
    """With debloating on, every channel starts at ``min_buffer_size``: what
    a slow sink's gate holds before the first measurement is buffers of that
    size, not 32 KiB ones. Counted: the bytes queued at the sink's gate once
    its producer is blocked, against the buffers queued. (No measurement
    runs: the period is longer than the test.) Before: the channels filled
    with whole segments, and the first aligned checkpoint waited 16 s
    behind them."""
    env = fb.Environment(chaining=False, debloat=True, debloat_period=600, min_buffer_size=512,
                         num_segments=64)
    release = threading.Event()

    def held(batch):
        release.wait(60)

    env.from_sequence(0, None).map(lambda x: x, kind="int64", name="map").sink(held, batched=True, name="sink")
    job = env.execute_async()
    try:
        src = next(t for t in job.tasks if t.vertex.name == "sequence")
        sink = next(t for t in job.tasks if t.vertex.name == "sink")
        assert all(q.buffer_size == 512 for q in job._queues)
        gate = sink.input.gate
        wait_for(lambda: all(not o.pool.available for o in src.outputs) and sum(gate.queued_per_channel()) >= 2,
                 timeout=60)
        assert sum(gate.queued_bytes_per_channel()) <= 512 * sum(gate.queued_per_channel())
    finally:
        release.set()
        cancel_and_join(job)


def test_the_first_tick_sizes_the_channels_of_a_fast_job():
    """A gate measures from the timer's start, so the first tick (a quarter
    period in) already sizes a fast job's channels up from min_buffer_size.
    Counted, not timed: once the first tick's mail has run, and no second
    tick has come, the channels are larger. Before, the gates were made at
    the first tick and measured nothing in it: the channels stayed at 256 B
    one tick longer (a 600 k-record job shipped 8.5 k buffers, 222 without
    debloating)."""
    env = fb.Environment(chaining=False, debloat=True, debloat_period=8.0)
    env.from_sequence(0, None).map(lambda x: x + 1, kind="int64", name="map").sink(
        lambda b: None, batched=True, name="sink")
    job = env.execute_async()
    try:
        timer = job._debloat_timer

        def first_tick_done():
            with timer.lock:
                return timer.ticks >= 1 and all(e[2][0] == 0 for e in timer._gates.values())
        wait_for(first_tick_done, "the first debloat tick's mail", timeout=60)
        with timer.lock:
            assert timer.ticks == 1            # (the next comes 2 s after it)
            sizes = [q.buffer_size for q in job._queues]
        assert all(s > env.min_buffer_size for s in sizes), sizes
    finally:
        cancel_and_join(job)
