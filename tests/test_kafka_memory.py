"""A slow sink over a large topic (about 1 GiB by default;
``PYFLOWBUF_KAFKA_MEMORY_BYTES`` sets it): the data waits in Kafka, not in
memory. A producer in another process writes the topic as fast as it can
while the job's sink is slow; the lag (``records_lag``) grows; the sink
speeds up and the lag drains. Meanwhile the test process (the job runs in
its threads) stays within the job's network pool plus 50 MiB, and every
record arrives once."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

import pyflowbuf as fb
from pipeline_helpers import cancel_and_join, wait_for

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka

RECORD = 10 * 1024
SEGMENT = 32 * 1024
SEGMENTS = 256                  # the job's network pool: 8 MiB
HEADROOM = 50 * 2**20

PRODUCER = r"""
import sys, confluent_kafka as ck
bs, topic, n, size, parts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 20, "batch.size": 1000000, "compression.type": "none",
                 "queue.buffering.max.kbytes": 65536, "acks": 1})
pad = b"x" * (size - 8)
for i in range(n):
    while True:
        try:
            p.produce(topic, b"%08d" % i + pad, partition=i % parts)
            break
        except BufferError:
            p.poll(0.01)
assert p.flush(120) == 0
"""


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Throttle:
    """The job's sink: slow (a sleep per record) until ``fast`` is set; marks
    every record it sees."""

    def __init__(self, n):
        self.fast = threading.Event()
        self.seen = bytearray(n)
        self.count = 0
        self.duplicates = 0

    def __call__(self, batch):
        for v in batch:
            i = int(v[:8])
            if self.seen[i]:
                self.duplicates += 1
            self.seen[i] = 1
        self.count += len(batch)
        if not self.fast.is_set():
            time.sleep(0.002 * len(batch))


def test_a_slow_sink_over_a_large_topic_keeps_memory_at_the_pool_and_the_lag_in_kafka(kafka_broker):
    bs = kafka_broker.bootstrap_servers
    total = int(os.environ.get("PYFLOWBUF_KAFKA_MEMORY_BYTES", str(1 << 30)))
    n, parts = max(1000, total // RECORD), 4
    topic = f"mem-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=parts, config={"retention.ms": "-1"})
    pool = SEGMENT * SEGMENTS
    env = fb.Environment(segment_size=SEGMENT, num_segments=SEGMENTS)
    sink = Throttle(n)
    env.read_kafka(topic, bootstrap_servers=bs).rebalance().sink(sink, batched=True, parallelism=1)

    def lag():
        return sum(m.get("records_lag", 0) or 0 for m in env.metrics().values())

    samples = []            # (t, rss, lag, phase)
    stop = threading.Event()
    base = _rss()

    def sample():
        k = 0
        while not stop.is_set():
            k += 1
            samples.append((time.monotonic(), _rss(), lag() if k % 5 == 0 else None,
                            "fast" if sink.fast.is_set() else "slow"))
            time.sleep(0.02)

    t0 = time.monotonic()
    job = env.execute_async()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, bs, topic, str(n), str(RECORD), str(parts)])
    try:
        wait_for(lambda: producer.poll() is not None, "the producer's end", timeout=300, job=job)
        assert producer.returncode == 0
        t_produced = time.monotonic()
        # the sink is still slow: most of the topic waits in Kafka
        wait_for(lambda: lag() >= n // 2, "the lag grown to half the topic", job=job)
        lag_slow = lag()
        sink.fast.set()
        t_fast = time.monotonic()
        wait_for(lambda: sink.count >= n, lambda: f"every record read ({sink.count} of {n})", timeout=300, job=job)
        t_read = time.monotonic()
        wait_for(lambda: lag() == 0, "the lag drained", job=job)
    finally:
        stop.set()
        sampler.join()
        if producer.poll() is None:
            producer.kill()
            producer.wait()
        cancel_and_join(job)
    peak = max(s[1] for s in samples)
    lags = [(t, lg, ph) for t, _, lg, ph in samples if lg is not None]
    slow_lags = [lg for _, lg, ph in lags if ph == "slow"]
    print(f"\n{n} records of {RECORD} B ({n * RECORD / 2**30:.2f} GiB), {parts} partitions: produced in "
          f"{t_produced - t0:.1f} s, lag at the switch {lag_slow} (max while slow {max(slow_lags)}), "
          f"read in {t_read - t_fast:.1f} s after the switch ({n * RECORD / 2**20 / (t_read - t_fast):.0f} MiB/s); "
          f"RSS base {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{(peak - base) / 2**20:.0f} MiB; "
          f"pool {pool / 2**20:.0f} MiB + 50 MiB allowed); {sink.count} read, {sink.duplicates} duplicated")
    assert sink.duplicates == 0 and sink.count == n and all(sink.seen)
    # the lag grew while the sink was slow (to half the topic, waited for above: the sampler,
    # reading it every 0.1 s, may have last read it just before)
    assert lag_slow >= n // 2 and slow_lags and slow_lags[-1] > slow_lags[0]
    assert peak - base <= pool + HEADROOM, f"peak RSS {peak / 2**20:.0f} MiB, base {base / 2**20:.0f} MiB"
