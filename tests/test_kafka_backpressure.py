"""Backpressure reaches the broker (real broker, the session's
``kafka_broker``): while a downstream task is blocked, the source's client
prefetches at most its bound, and once the task has not pulled for
``pause_after`` seconds its partitions are paused: librdkafka holds no
prefetched record and fetches nothing, while ``records_lag`` keeps growing.
Then everything is read, once."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

import pyflowbuf as fb
from pipeline_helpers import cancel_and_join, wait_for

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka

RECORD = 4096


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(bs, topic, start, n, partitions):
    p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 20, "compression.type": "none"})
    pad = b"x" * RECORD
    for i in range(start, start + n):
        while True:
            try:
                p.produce(topic, b"%08d" % i + pad, partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(60) == 0


class Gate:
    """A map that holds its task at the first record until ``open`` is set."""

    def __init__(self):
        self.open = threading.Event()
        self.held = threading.Event()

    def __call__(self, v):
        if not self.open.is_set():
            self.held.set()
            self.open.wait()
        return int(v[:8])


def test_a_blocked_pipeline_pauses_fetching_and_reads_everything_once_after(kafka_broker):
    bs = kafka_broker.bootstrap_servers
    topic = _name("bp")
    parts, n, prefetch_kb = 2, 4000, 1024
    kafka_broker.create_topic(topic, partitions=parts)
    produce(bs, topic, 0, n, parts)
    stats = []
    lock = threading.Lock()

    def on_stats(s):
        d = json.loads(s)
        ps = [v for k, v in d.get("topics", {}).get(topic, {}).get("partitions", {}).items() if k != "-1"]
        # (the source's metadata client has no partition assigned)
        if any(v["fetch_state"] != "none" for v in ps):
            with lock:
                stats.append((d["ts"] / 1e6, sum(v["fetchq_size"] for v in ps), sum(v["fetchq_cnt"] for v in ps),
                              d["rx_bytes"]))

    env = fb.Environment()
    gate = Gate()
    got = (env.read_kafka(topic, bootstrap_servers=bs, max_prefetch_kbytes=prefetch_kb, pause_after=0.3,
                          properties={"statistics.interval.ms": 50, "stats_cb": on_stats})
           .rebalance().map(gate).collect())
    job = env.execute_async()

    def source_metrics():
        return next((m for k, m in env.metrics().items() if "fetch_paused" in m), {})

    try:
        wait_for(gate.held.is_set, "the gate holding the first record", job=job)
        wait_for(lambda: source_metrics().get("fetch_paused") == parts, "fetching paused", job=job)
        paused_seen = time.monotonic()
        lag = source_metrics()["records_lag"]
        # the lag keeps growing while nothing is fetched: the end offsets are asked for
        produce(bs, topic, n, 1000, parts)
        wait_for(lambda: source_metrics().get("records_lag", 0) >= lag + 1000, "the lag grown while paused",
                 job=job)
        assert source_metrics()["fetch_paused"] == parts
        released = time.monotonic()
        gate.open.set()
        wait_for(lambda: len(got._parts.get(0, ())) >= n + 1000, "every record read", job=job)
        wait_for(lambda: source_metrics().get("fetch_paused") == 0, "fetching resumed", job=job)
        assert source_metrics()["fetch_pauses"] >= 1
    finally:
        gate.open.set()
        cancel_and_join(job)
    assert sorted(got._parts[0]) == list(range(n + 1000))
    with lock:
        during = [s for s in stats if paused_seen <= s[0] <= released]
        peak = max(s[1] for s in stats)
    assert during, "no statistics from the paused time"
    # paused: librdkafka dropped its prefetched records and fetched nothing
    # (the end offsets asked for meanwhile are a few hundred bytes)
    assert all(q == 0 for _, q, _, _ in during), during
    assert max(s[3] for s in during) - min(s[3] for s in during) < 64 * 1024, during
    # the prefetch bound: max_prefetch_kbytes plus about one fetch response
    # (max.partition.fetch.bytes, 1 MiB, per partition; a record batch is
    # never split, so one more MiB)
    assert peak <= prefetch_kb * 1024 + (parts + 1) * (1 << 20), peak
    print(f"prefetch peak {peak / 2**20:.2f} MiB (bound {prefetch_kb / 1024:.0f} MiB + {parts + 1} MiB); "
          f"{len(during)} statistics while paused, all with an empty queue")


# ---------------------------------------------------------------- the client's log

def test_a_refused_connection_logs_at_warning_and_other_client_errors_stay_errors(caplog):
    """librdkafka reports a refused connection (a broker restarting) at
    ERROR and retries it itself: it reaches logging at WARNING."""
    import logging
    import socket

    from pyflowbuf.connectors import kafka as kc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # nothing listens there once closed
    caplog.set_level(logging.DEBUG, logger="pyflowbuf.kafka")
    c = ck.Consumer(kc._client_conf(f"127.0.0.1:{port}", {"group.id": "g", "reconnect.backoff.ms": 10}))
    try:
        wait_for(lambda: c.poll(0.05) is None and any("Connection refused" in r.getMessage()
                                                       for r in caplog.records), "a refused connection logged")
    finally:
        c.close()
    refused = [r for r in caplog.records if "Connection refused" in r.getMessage()]
    assert refused and all(r.levelno == logging.WARNING for r in refused), [(r.levelname, r.getMessage())
                                                                             for r in refused]
    # what is not a connection's state keeps its level
    caplog.clear()
    kc.CLIENT_LOG.log(logging.ERROR, "%s [%s] %s", "TXNERR", "rdkafka#producer-1", "Current transaction failed")
    kc.CLIENT_LOG.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "SSL handshake failed: bad cert")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
