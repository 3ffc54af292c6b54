"""Backpressure through any number of stages: a slow sink slows the source
down. At every sample the source is ahead of the sink by at most what the
configured buffers (plus one batch per task) can hold, nothing is dropped, and
the pool never hands out more segments than configured."""
from __future__ import annotations

import itertools
import threading
import time

import pytest

import pyflowbuf as fb

pytestmark = pytest.mark.timeout(120)

RECORD_BYTES = 4 + 8          # an int64 record: length prefix + payload


class Probe:
    """Samples a running job every ``interval`` s from a side thread."""

    def __init__(self, env, pulled, sunk, interval=0.005):
        self.env, self.pulled, self.sunk, self.interval = env, pulled, sunk, interval
        self.samples = []          # (pulled, sunk, pool in use)
        self.pool_violations = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test probe", daemon=True)

    def _run(self):
        job = self.env.last_execution
        while not self._stop.is_set():
            sunk = self.sunk()          # read the sink first: pulled - sunk only grows by racing
            pulled = self.pulled()
            net = job.network_pool
            self.samples.append((pulled, sunk, net.in_use_segments))
            for t in job.tasks:
                for out in t.outputs:
                    if out.pool.in_use > out.pool.max_size:
                        self.pool_violations.append((t.task_name, out.pool.in_use, out.pool.max_size))
            time.sleep(self.interval)

    def start(self):
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.thread.join()


def run_probed(env, pulled, sunk, timeout=60):
    job = env.execute_async()
    probe = Probe(env, pulled, sunk)
    probe.start()
    try:
        job.join(timeout)
    finally:
        probe.stop()
    return job, probe


def bound_in_records(env, job):
    """Total buffer capacity of the job in records, plus one batch per task
    (being processed) and one for the source's pull."""
    pool = job.network_pool
    per_segment = pool.segment_size // RECORD_BYTES + 1
    return pool.total_segments * per_segment + (len(job.tasks) + 1) * env.max_batch


def counting_source(n):
    pulled = itertools.count()
    state = {"pulled": 0}

    def gen():
        for i in range(n):
            state["pulled"] = next(pulled) + 1
            yield i
    return gen, lambda: state["pulled"]


def slow_sink(every=20, pause=0.001):
    state = {"n": 0, "seen": []}
    lock = threading.Lock()

    def sink(x):
        with lock:
            state["n"] += 1
            state["seen"].append(x)
            n = state["n"]
        if n % every == 0:
            time.sleep(pause)
    return sink, state


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("p", [1, 2], ids=["p1", "p2"])
@pytest.mark.parametrize("partitioning", ["rebalance", "key_by"])
def test_slow_sink_blocks_the_source_through_every_stage(stages, p, partitioning):
    n = 40_000
    gen, pulled = counting_source(n)
    sink, state = slow_sink(every=40)                # at most ~40 k records/s
    env = fb.Environment(parallelism=p, chaining=False, segment_size=4096, max_batch=256,
                         num_segments=24, output_buffers=(1, 3))
    s = env.from_generator(gen, kind="int64")
    for i in range(stages - 2):                      # source, stages-2 middle stages, sink
        s = s.key_by(lambda x: x % 11) if partitioning == "key_by" else s.rebalance()
        s = s.map(lambda x: x, name=f"stage{i}")
    s.rebalance().sink(sink, parallelism=1)
    t0 = time.monotonic()
    job, probe = run_probed(env, pulled, lambda: state["n"])
    elapsed = time.monotonic() - t0

    # nothing dropped, nothing duplicated
    assert pulled() == n == state["n"]
    assert sorted(state["seen"]) == list(range(n))
    # the source never ran further ahead than the buffers can hold
    bound = bound_in_records(env, job)
    leads = [a - b for a, b, _ in probe.samples]
    assert len(probe.samples) > 20, len(probe.samples)
    assert max(leads) <= bound, (max(leads), bound)
    print(f"max lead {max(leads)} records, bound {bound}, {len(probe.samples)} samples")
    assert bound < n / 2                 # so the check means something
    # bounded memory: never more segments in use than configured, no pool over its cap
    assert max(u for _, _, u in probe.samples) <= job.network_pool.total_segments == 24
    assert probe.pool_violations == []
    # the source really was held back (it could make 40k records in a blink)
    src = job.tasks[0]
    assert src.task_name.startswith("generator")
    assert src.outputs[0].backpressure_ns > 0.2 * elapsed * 1e9
    pool = job.network_pool
    assert pool.available_segments == pool.total_segments


def test_backpressure_with_chaining_and_a_skewed_parallel_sink():
    """Chained stages and one slow sink subtask of two (skew): the hash
    exchange stalls the whole pipeline behind the slow one, and still nothing
    is lost."""
    n = 40_000
    gen, pulled = counting_source(n)
    seen = {0: 0, 1: 0}
    lock = threading.Lock()

    def sink(x):
        with lock:
            seen[x % 2] += 1
            c = seen[0]
        if x % 2 == 0 and c % 20 == 0:          # even keys are slow
            time.sleep(0.001)

    env = fb.Environment(parallelism=2, chaining=True, segment_size=4096, max_batch=128,
                         num_segments=32, output_buffers=(2, 4))
    (env.from_generator(gen, kind="int64")
        .rebalance().map(lambda x: x, parallelism=2).filter(lambda x: True)
        .key_by(lambda x: x % 2).sink(sink))
    job, probe = run_probed(env, pulled, lambda: seen[0] + seen[1])
    assert pulled() == n == seen[0] + seen[1]
    bound = bound_in_records(env, job)
    assert max(a - b for a, b, _ in probe.samples) <= bound
    assert max(u for _, _, u in probe.samples) <= 32
    assert probe.pool_violations == []


def test_backpressure_levels_show_in_metrics():
    n = 15_000
    gen, _ = counting_source(n)
    sink, state = slow_sink(every=10, pause=0.001)
    env = fb.Environment(chaining=False, segment_size=4096, max_batch=256, num_segments=16,
                         output_buffers=(1, 3), metrics_interval=0.1)
    env.from_generator(gen, kind="int64").map(lambda x: x).sink(sink)
    env.execute(60)
    history = env.last_execution.sampler.history
    levels = [m["level"] for _, snap in history for name, m in snap.items() if name.startswith("generator")]
    assert "HIGH" in levels, levels
    sink_busy = [m["busy_ms_per_s"] for _, snap in history for name, m in snap.items() if name.startswith("sink")]
    assert max(sink_busy) > 500, sink_busy      # the sink is the bottleneck


@pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
def test_minimum_buffers_still_make_progress(chaining):
    """One segment per output pool, 256-byte segments and records spanning
    many of them: slow, but no deadlock and every byte arrives."""
    data = [bytes([i % 256]) * (300 + 37 * i) for i in range(200)]   # 300 B .. 7.7 KB
    env = fb.Environment(chaining=chaining, segment_size=256, output_buffers=(1, 1), max_batch=4)
    env.from_collection(data).map(lambda b: bytes(b)).rebalance().map(lambda b: bytes(b)).rebalance().collect()
    h = env.from_collection(data).rebalance().collect()
    env.execute(60)
    assert h.result == data
    pool = env.last_execution.network_pool
    assert pool.available_segments == pool.total_segments


def test_exactly_the_minimum_number_of_segments():
    """num_segments equal to the sum of the pools' minimums is enough."""
    env = fb.Environment(chaining=False, segment_size=1024, output_buffers=(1, 1), num_segments=3)
    h = env.from_sequence(0, 20_000).map(lambda x: x + 1).rebalance().map(lambda x: x - 1).collect()
    env.execute(60)
    assert h.result == list(range(20_000))


def test_too_few_segments_is_a_clear_error():
    env = fb.Environment(chaining=False, segment_size=1024, output_buffers=(2, 4), num_segments=3)
    env.from_sequence(0, 10).map(lambda x: x).rebalance().map(lambda x: x).collect()
    with pytest.raises(MemoryError, match="network buffers"):
        env.execute(10)


def test_overload_keeps_rss_bounded():
    """A source far faster than the sink for a while: resident memory grows by
    no more than the pool (plus slack), and nothing is lost."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    n_bytes = 256
    env = fb.Environment(chaining=False, segment_size=32 * 1024, num_segments=64, max_batch=256)
    payload = b"x" * n_bytes
    produced = {"n": 0}

    def gen():
        while True:
            produced["n"] += 1
            yield payload

    received = {"n": 0}

    def sink(batch):
        received["n"] += len(batch)
        time.sleep(0.002)           # ~ 128 k records/s at most, the source does far more

    env.from_generator(gen, kind="bytes").map(lambda b: b).sink(sink, batched=True)
    rss0 = proc.memory_info().rss
    job = env.execute_async()
    peak = rss0
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.01)
    job.cancel()
    job.join(30)
    pool_mib = job.network_pool.total_bytes / 2**20
    growth_mib = (peak - rss0) / 2**20
    assert growth_mib - pool_mib < 30, (growth_mib, pool_mib)
    # in flight at the end <= what the buffers hold (cancel drops only what is in flight)
    per_segment = 32 * 1024 // (n_bytes + 4) + 1
    assert produced["n"] - received["n"] <= 64 * per_segment + 4 * 256
