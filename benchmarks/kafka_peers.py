#!/usr/bin/env python
"""The peers of the Kafka benchmark (issue 29, item 6): what pyflowbuf's
``read_kafka`` / ``write_kafka`` are compared with, in the same run.

    python benchmarks/kafka_peers.py [--quick] [--no-spark]   # own broker, prints the figures as JSON

``bench_kafka.py`` imports this module (``import kafka_peers``, benchmarks/ is
on ``sys.path``) and calls, against its running broker:

* ``produce_topic(bootstrap, topic, n_records, partitions)``: creates the
  topic and fills it as fast as the client goes (the input of both jobs);
* ``bare_client_consume_rate(bootstrap, topic)``: a bare confluent-kafka
  consume loop over the whole topic, the client's own limit (the
  denominator of ``kafka_source_vs_client``);
* ``spark_keyed_count(bootstrap, in_topic, out_topic)``: the same keyed
  count job on Spark Structured Streaming (the denominators of
  ``kafka_throughput_vs_spark`` and ``kafka_p99_vs_spark_microbatch``);
* ``spark_latency(spark, bootstrap, in_topic, out_topic, rate=...)``: one
  more latency run of that job in the same session, so the benchmark can
  repeat Spark's latency interleaved with its own and take medians;
* ``paced_produce`` and ``LatencyProbe``: the paced producer and the
  ``read_committed`` output consumer that the latency figures of both sides
  are measured with, so ours and Spark's are measured the same way; each
  runs in a process of its own (``latency_in_subprocess``), apart from
  either job and from each other.

The records (both sides use these; ``encode_value`` / ``parse_value``)
======================================================================

* input: Kafka key = ``b"k<n>"`` (``keys`` distinct keys, record ``i`` has
  key ``k{i % keys}``), value = ``b"<key>,<seq>,<produce_ts_ns>"``: the key
  again, the record's sequence number and ``time.time_ns()`` when the
  producer was handed the record, all ASCII decimal.
* the job: per key, a running count; for **every** input record one output
  record (the count after it), as a keyed count with per-record updates does.
* output: Kafka key = the input key, value = ``b"<key>,<count>,<produce_ts_ns>"``
  (the input record's produce timestamp carried through). End-to-end latency
  of a record = the time a ``read_committed`` consumer of the output topic
  receives it minus ``produce_ts_ns`` (one host, one clock).

What each figure measures
=========================

``produce_topic``: ``produce_records_per_s`` (filling the topic, producer
``linger.ms=5``, 1 MiB batches, no compression; the time includes the final
flush, so every record is acknowledged by the broker).

``bare_client_consume_rate``: ``client_records_per_s`` = records / seconds
from ``assign`` (all partitions from the beginning) until every partition
reported its end (``enable.partition.eof``), through ``consume(num_messages)``
batches, touching every message's value and checking its error, nothing more:
no decoding, no records built. librdkafka's defaults otherwise
(``isolation.level=read_committed``, its prefetch queue); pass
``consumer_conf=`` the settings ``read_kafka`` uses so both sides fetch alike.
The end is seen by a fetch that finds no new record, which waits
``fetch.wait.max.ms`` (500 ms by default) on the broker: on a small topic that
tail is a visible part of the time, on both sides.
``client_records_per_s_steady`` = records / seconds from the first batch
received to the last record received (no connection set-up, no end tail).

``spark_keyed_count``: the same job on Spark Structured Streaming. Spark's
Kafka source (``spark-sql-kafka-0-10``, ``pyflowbuf.spark.kafka_jars``) ->
split the value -> ``groupBy(key)`` -> a Python stateful function emitting
one row per input row -> Spark's Kafka sink (at least once: Spark's Kafka
sink has no transactions). Micro-batch mode. The function is
``applyInPandasWithState`` by default, the faster of Spark's two here
(state travels with the Arrow batch): ``transformWithStateInPandas``
(``api=``, Spark 4.0+, RocksDB state, needs ``protobuf``) asks the JVM for
each key's state over a socket and ran the same 50,000 records over 100 keys
at 0.61x its rate (3,450 vs 5,620 records/s, one run each, loaded machine).
Master ``local[2]`` by default: one JVM with two task slots on this two-core
machine, Spark's cheapest way to use both cores here
(``local-cluster[2,1,1024]`` adds two executor JVMs and a cross-JVM shuffle on the same two cores: more realistic, slower; pass
``master=`` for it). ``spark.sql.shuffle.partitions`` = the task slots (2),
not Spark's default 200, which would cost 200 state store tasks per batch.

* warm-up: the same query over a small topic first (Python workers started,
  classes loaded), not timed.
* throughput, over the whole pre-filled input topic, ``trigger(availableNow=True)``:
  ``spark_records_per_s`` = input rows / the sum of the micro-batches'
  durations (Spark's own progress reports: planning, reading Kafka, the
  Python function, writing Kafka, committing offsets and state: the engine's
  rate while it runs); ``spark_records_per_s_wall`` = input rows / seconds
  from ``start()`` to the query's end (adds the query's start).
  ``max_offsets_per_trigger=None`` (Spark's default) reads what is there in
  one batch, Spark's best case for throughput.
* latency at ``rate`` records/s (default half of ``spark_records_per_s``),
  default trigger (the next micro-batch as soon as the last one ended), on
  fresh topics ``<in_topic>.latency-<tag>`` / ``<out_topic>.latency-<tag>``: records
  produced at a steady pace by ``paced_produce`` (``linger.ms=1``); the
  first ``warmup_s`` seconds of them are not counted; ``spark_e2e_p50_ms``,
  ``spark_e2e_p99_ms`` over the rest (``LatencyProbe``). A record not seen
  when the wait ends counts as infinitely late: a percentile among those is
  null and ``spark_latency_all_seen`` false (the rate was more than Spark
  keeps up with at that batch size). Spark's output is
  not transactional, so ``read_committed`` does not hold it back: this is
  Spark's latency with no commit wait.
* the output is checked after the throughput run (not timed): one output
  record per input record, and per key the counts 1..n.

Real-time mode (``trigger(realTime=...)``, Spark 4.1+) is not run: Spark
4.3's real-time mode takes stateless queries and, of the stateful ones, only
``dropDuplicates``, ``groupBy().agg()`` and the JVM ``transformWithState``;
a Python stateful function (``applyInPandasWithState``,
``transformWithStateInPandas``) is not among them, so the same job cannot
run in it (``spark_real_time_mode`` in the result says so).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

QUICK = dict(n_records=100_000, spark_records=30_000, latency_s=10.0, warmup_s=5.0)
FULL = dict(n_records=1_000_000, spark_records=300_000, latency_s=40.0, warmup_s=15.0)
# Few keys favour Spark: its Python stateful function is called once per key
# and micro-batch (a pandas frame in, one out, and for transformWithStateInPandas
# a state round trip to the JVM each), where a per-record keyed count costs
# about the same whatever the number of keys.
DEFAULT_KEYS = 100
SPARK_APIS = ("applyInPandasWithState", "transformWithStateInPandas")


# --------------------------------------------------------------------------- records


def encode_value(key: str, seq: int, ts_ns: int) -> bytes:
    """An input record's value: ``b"<key>,<seq>,<produce_ts_ns>"``."""
    return f"{key},{seq},{ts_ns}".encode()


def parse_value(value: bytes) -> tuple:
    """``(key, middle, ts_ns)`` of an input (middle = seq) or output
    (middle = count) value."""
    key, middle, ts = value.split(b",")
    return key.decode(), int(middle), int(ts)


# --------------------------------------------------------------------------- topics


def _admin(bootstrap):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def create_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Create ``topic`` and wait until every partition has a leader."""
    from confluent_kafka.admin import NewTopic

    admin = _admin(bootstrap)
    admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=timeout)[topic].result(timeout)
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        if md is not None and md.error is None and len(md.partitions) == partitions \
                and all(p.leader >= 0 for p in md.partitions.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic!r} on {bootstrap} has no leader for every partition after {timeout} s")
        time.sleep(0.05)


def partitions_of(bootstrap: str, topic: str, timeout: float = 30.0) -> int:
    md = _admin(bootstrap).list_topics(topic, timeout=timeout).topics.get(topic)
    if md is None or md.error is not None:
        raise RuntimeError(f"topic {topic!r} not found on {bootstrap}: {md.error if md else 'no metadata'}")
    return len(md.partitions)


def _producer(bootstrap, **conf):
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "queue.buffering.max.messages": 1_000_000,
                     "queue.buffering.max.kbytes": 1_048_576, **conf})


def _produce(producer, topic, key, value):
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:             # the client's queue is full: let it deliver
            producer.poll(0.05)


def produce_topic(bootstrap: str, topic: str, n_records: int, partitions: int = 4, *, keys: int = DEFAULT_KEYS,
                  create: bool = True, producer_conf: dict | None = None) -> dict:
    """Create ``topic`` (unless ``create=False``) and write ``n_records``
    input records (module docstring) as fast as the client goes; returns
    ``{"records", "bytes", "seconds", "produce_records_per_s"}``."""
    if create:
        create_topic(bootstrap, topic, partitions)
    producer = _producer(bootstrap, **{"linger.ms": 5, "batch.size": 1_048_576, **(producer_conf or {})})
    key_bytes = [f"k{k}".encode() for k in range(keys)]
    size = 0
    t0 = time.perf_counter()
    for i in range(n_records):
        kb = key_bytes[i % keys]
        value = b"%s,%d,%d" % (kb, i, time.time_ns())
        size += len(value) + len(kb)
        _produce(producer, topic, kb, value)
        if i & 0x3FFF == 0:
            producer.poll(0)
    left = producer.flush(120)
    seconds = time.perf_counter() - t0
    if left:
        raise RuntimeError(f"{left} records to {topic!r} on {bootstrap} were not delivered within 120 s")
    return {"records": n_records, "bytes": size, "seconds": seconds, "produce_records_per_s": n_records / seconds}


# --------------------------------------------------------------------------- the bare client


def _consumer(bootstrap, **conf):
    from confluent_kafka import Consumer

    return Consumer({"bootstrap.servers": bootstrap, "group.id": f"kafka-peers-{uuid.uuid4().hex[:8]}",
                     "enable.auto.commit": False, "enable.partition.eof": True,
                     "auto.offset.reset": "earliest", **conf})


def _assign_from_beginning(consumer, topic, partitions):
    """Assign every partition at its log start offset, asked first: given
    the logical OFFSET_BEGINNING, a fresh consumer's first fetch waits for
    librdkafka's fixed 500 ms retry of the offset query (``read_kafka``
    resolves it the same way, ``KafkaReader._resolve_beginnings``), which
    the latency probe would add to the first records it sees."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

    tps = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)]
    try:
        got = consumer.offsets_for_times(tps, timeout=5.0)     # timestamp -2: the earliest offset
        tps = [TopicPartition(topic, r.partition, r.offset if r.error is None and r.offset >= 0 else OFFSET_BEGINNING)
               for r in got]
    except KafkaException:
        pass        # (no leader yet) the logical offset: correct, only slower
    consumer.assign(tps)


def bare_client_consume_rate(bootstrap: str, topic: str, *, num_messages: int = 10_000, timeout: float = 1.0,
                             consumer_conf: dict | None = None, max_seconds: float = 600.0) -> dict:
    """A bare confluent-kafka loop over the whole topic (module docstring):
    ``{"records", "bytes", "seconds", "client_records_per_s"}``."""
    from confluent_kafka import KafkaError

    partitions = partitions_of(bootstrap, topic)
    consumer = _consumer(bootstrap, **(consumer_conf or {}))
    try:
        at_end = set()
        count = size = 0
        first = last = None
        t0 = time.perf_counter()
        _assign_from_beginning(consumer, topic, partitions)
        while len(at_end) < partitions:
            msgs = consumer.consume(num_messages, timeout)
            if msgs and first is None:
                first = time.perf_counter()
            for m in msgs:
                err = m.error()
                if err is None:
                    count += 1
                    size += len(m.value())
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition())
                else:
                    raise RuntimeError(f"consuming {topic!r} on {bootstrap}: {err}")
            if msgs and msgs[-1].error() is None:
                last = time.perf_counter()
            if time.perf_counter() - t0 > max_seconds:
                raise RuntimeError(f"{topic!r} on {bootstrap}: not at its end after {max_seconds} s "
                                   f"({count} records, partitions at end: {sorted(at_end)})")
        seconds = time.perf_counter() - t0
    finally:
        consumer.close()
    steady = (last - first) if first is not None and last is not None and last > first else math.nan
    return {"records": count, "bytes": size, "seconds": seconds, "client_records_per_s": count / seconds,
            "client_records_per_s_steady": count / steady}


def read_all(bootstrap: str, topic: str, *, isolation: str = "read_committed") -> list:
    """Every value of ``topic`` (its partitions one after the other), read
    until each partition's end; for checks, not timed."""
    from confluent_kafka import KafkaError

    partitions = partitions_of(bootstrap, topic)
    consumer = _consumer(bootstrap, **{"isolation.level": isolation})
    values, at_end = [], set()
    try:
        _assign_from_beginning(consumer, topic, partitions)
        deadline = time.monotonic() + 300
        while len(at_end) < partitions:
            for m in consumer.consume(10_000, 1.0):
                err = m.error()
                if err is None:
                    values.append(m.value())
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition())
                else:
                    raise RuntimeError(f"reading {topic!r}: {err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic!r}: not at its end after 300 s")
    finally:
        consumer.close()
    return values


def check_keyed_count_output(values: list, expected_records: int) -> dict:
    """The output of a keyed count (module docstring) is right: one record
    per input record, and per key the counts 1..n once each. Raises
    ``AssertionError`` naming what is wrong; returns ``{"keys": ...}``."""
    per_key = collections.defaultdict(list)
    for v in values:
        key, count, _ = parse_value(v)
        per_key[key].append(count)
    assert len(values) == expected_records, f"{len(values)} output records for {expected_records} input records"
    for key, counts in per_key.items():
        assert sorted(counts) == list(range(1, len(counts) + 1)), \
            f"key {key!r}: counts are not 1..{len(counts)} once each (first: {sorted(counts)[:10]})"
    return {"keys": len(per_key)}


# --------------------------------------------------------------------------- latency tools


def paced_produce(bootstrap: str, topic: str, rate: float, seconds: float, *, keys: int = DEFAULT_KEYS,
                  start_seq: int = 0, stop: threading.Event | None = None,
                  producer_conf: dict | None = None, mark_s: float | None = None) -> dict:
    """Produce input records at ``rate`` records/s for ``seconds`` (each
    value stamped when handed to the client; ``linger.ms=1``), then flush.
    Returns ``{"records", "start_ns", "seconds", "behind_s"}``: ``behind_s``
    is how far the producer itself lagged its schedule at worst (a figure
    taken at a rate this loop cannot keep is not at that rate). With
    ``mark_s``, also ``"mark_ns"`` (``start_ns`` + ``mark_s``) and
    ``"records_after_mark"``: how many records were stamped at or after it,
    counted, not estimated from the rate (``rate * mark_s`` was one off
    whenever it was not a whole number, and a probe then waited for a
    record that was never sent)."""
    if rate <= 0 or seconds <= 0:
        raise ValueError(f"rate and seconds must be positive, got {rate}, {seconds}")
    producer = _producer(bootstrap, **{"linger.ms": 1, **(producer_conf or {})})
    key_bytes = [f"k{k}".encode() for k in range(keys)]
    total = int(rate * seconds)
    sent, behind = 0, 0.0
    start_ns = time.time_ns()
    mark_ns = None if mark_s is None else start_ns + int(mark_s * 1e9)
    first_after = None if mark_s is not None else 0     # the first record stamped at or after mark_ns
    t0 = time.perf_counter()
    while sent < total and not (stop is not None and stop.is_set()):
        now = time.perf_counter() - t0
        due = min(total, int(now * rate) + 1)
        if due - sent > 1:
            behind = max(behind, (due - sent - 1) / rate)
        while sent < due:
            seq = start_seq + sent
            kb = key_bytes[seq % keys]
            ts = time.time_ns()
            if first_after is None and ts >= mark_ns:
                first_after = sent
            _produce(producer, topic, kb, b"%s,%d,%d" % (kb, seq, ts))
            sent += 1
        producer.poll(0)
        wait = (sent / rate) - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(min(wait, 0.002))
    producer.flush(60)
    out = {"records": sent, "start_ns": start_ns, "seconds": time.perf_counter() - t0, "behind_s": behind}
    if mark_s is not None:
        out.update(mark_ns=mark_ns, records_after_mark=0 if first_after is None else sent - first_after)
    return out


class LatencyProbe:
    """A ``read_committed`` consumer of an output topic in a thread of its
    own, from each partition's beginning: for every output record, the time
    it was received minus its ``produce_ts_ns`` (the receive time is taken
    once per ``consume`` batch, right after the batch came back).

        probe = LatencyProbe(bootstrap, "out").start()
        ... produce, run the job ...
        probe.wait_for(lambda p: p.count_since(t_ns) >= n, timeout=60)
        probe.stop(); probe.percentiles(since_ns=t_ns)   # {"p50_ms", "p99_ms", ...}

    The consuming thread only keeps each batch's values and receive time:
    the values are parsed when asked for (``count_since``, ``percentiles``),
    so that at tens of thousands of records a second the probe takes as
    little of the machine as it can while the job runs (it shares the cores
    with it and the broker).
    """

    def __init__(self, bootstrap: str, topic: str, *, isolation: str = "read_committed"):
        self.bootstrap, self.topic = bootstrap, topic
        self._conf = {"isolation.level": isolation, "enable.partition.eof": False}
        self._batches = []              # (receive time ns, [values]), in arrival order
        self._received = 0
        self._samples = []              # (produce_ts_ns, latency_ns): the batches parsed so far
        self._parsed = 0                # batches parsed into _samples
        self._counted = {}              # since_ns -> (samples scanned, count)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.error = None

    def start(self) -> "LatencyProbe":
        partitions = partitions_of(self.bootstrap, self.topic)
        consumer = _consumer(self.bootstrap, **self._conf)
        _assign_from_beginning(consumer, self.topic, partitions)
        self._thread = threading.Thread(target=self._run, args=(consumer,), name=f"latency-probe-{self.topic}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self, consumer):
        try:
            while not self._stop.is_set():
                # what is there now, else wait for the next record: consume(n, timeout)
                # waits until it has n records or the timeout passed, which would add
                # up to the timeout to every latency measured
                msgs = consumer.consume(10_000, 0) or consumer.consume(1, 0.05)
                now = time.time_ns()
                if not msgs:
                    continue
                values = [m.value() if m.error() is None else _message_error(self.topic, m) for m in msgs]
                with self._lock:
                    self._batches.append((now, values))
                    self._received += len(values)
        except BaseException as exc:     # noqa: BLE001 - reported by wait_for/stop
            self.error = exc
        finally:
            consumer.close()

    @property
    def received(self) -> int:
        """Records received so far (no parsing: cheap to poll)."""
        return self._received

    def _parse_new(self):
        """(Under the lock) the batches received since the last call, parsed
        into ``_samples``."""
        batches, samples = self._batches, self._samples
        for i in range(self._parsed, len(batches)):
            now, values = batches[i]
            for v in values:
                ts = int(v.rsplit(b",", 1)[1])
                samples.append((ts, now - ts))
        self._parsed = len(batches)
        return samples

    def count_since(self, since_ns: int = 0) -> int:
        """Records seen that were produced at or after ``since_ns``. Polled
        while the job runs, so it scans only what arrived since the last
        call for the same ``since_ns``."""
        with self._lock:
            samples = self._parse_new()
            scanned, count = self._counted.get(since_ns, (0, 0))
            count += sum(1 for i in range(scanned, len(samples)) if samples[i][0] >= since_ns)
            self._counted[since_ns] = (len(samples), count)
            return count

    def wait_for(self, condition, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition(self):
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.error is not None:
            raise self.error

    def percentiles(self, since_ns: int = 0, until_ns: int | None = None, *, expected: int | None = None) -> dict:
        """p50/p99/max of the records produced in [since_ns, until_ns).
        With ``expected``, records not seen count as infinitely late, so a
        percentile that falls among them is NaN (``None`` in JSON), never a
        figure made low by the records that had not arrived."""
        with self._lock:
            lat = sorted(l for ts, l in self._parse_new() if ts >= since_ns and (until_ns is None or ts < until_ns))
        seen = len(lat)
        if expected is not None and expected > seen:
            lat += [math.inf] * (expected - seen)
        if not lat:
            return {"records": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}

        def q(p):
            v = lat[min(len(lat) - 1, int(p * len(lat)))]
            return v / 1e6 if math.isfinite(v) else math.nan
        return {"records": seen, "p50_ms": q(0.50), "p99_ms": q(0.99), "max_ms": q(1.0)}


def _message_error(topic, m):
    raise RuntimeError(f"consuming {topic!r}: {m.error()}")


def latency_run(bootstrap: str, in_topic: str, out_topic: str, rate: float, seconds: float, warmup_s: float,
                keys: int = DEFAULT_KEYS) -> dict:
    """Produce at ``rate`` into ``in_topic`` for ``warmup_s + seconds`` while a
    ``LatencyProbe`` reads ``out_topic``; the percentiles of the records
    produced after the first ``warmup_s`` seconds (a record not seen within
    ``max(60, 4 * seconds)`` counts as infinitely late), and how the run went."""
    probe = LatencyProbe(bootstrap, out_topic).start()
    try:
        sent = paced_produce(bootstrap, in_topic, rate, warmup_s + seconds, keys=keys, mark_s=warmup_s)
        since, expected = sent["mark_ns"], sent["records_after_mark"]
        drained = probe.wait_for(lambda p: p.count_since(since) >= expected, timeout=max(60.0, 4 * seconds))
    finally:
        probe.stop()
    pct = probe.percentiles(since_ns=since, expected=expected)
    return {**pct, "all_seen": bool(drained), "behind_s": sent["behind_s"], "records_sent": sent["records"]}


def latency_in_subprocess(bootstrap: str, in_topic: str, out_topic: str, rate: float, seconds: float,
                          warmup_s: float, keys: int = DEFAULT_KEYS) -> dict:
    """``latency_run``'s figures, with the paced producer and the probe each
    in a Python process of its own (this file run with ``--latency-probe``
    and ``--paced-produce``), as the applications producing and reading a
    topic are: they share no interpreter (GIL, garbage collector) with the
    job measured, nor with each other (at tens of thousands of records a
    second, a probe parsing in the producer's process put the producer
    hundreds of milliseconds behind its schedule). For both sides alike: a
    pyflowbuf job in threads would otherwise share its GIL with them, where
    Spark's job runs in its JVM and Python workers."""
    import subprocess

    me = os.path.abspath(__file__)
    drain_s = max(60.0, 4 * seconds)
    probe = subprocess.Popen([sys.executable, me, "--latency-probe", json.dumps({"bootstrap": bootstrap,
                                                                                  "topic": out_topic})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if probe.stdout.readline().strip() != "ready":      # assigned: what is produced from now on is seen
            raise RuntimeError(f"the latency probe of {out_topic!r} did not start: {probe.communicate()[1][-3000:]}")
        args = json.dumps({"bootstrap": bootstrap, "topic": in_topic, "rate": rate, "seconds": warmup_s + seconds,
                           "keys": keys, "mark_s": warmup_s})
        prod = subprocess.run([sys.executable, me, "--paced-produce", args], capture_output=True, text=True,
                              timeout=warmup_s + seconds + 120)
        if prod.returncode != 0:
            raise RuntimeError(f"the paced producer into {in_topic!r} failed: {prod.stderr[-3000:]}")
        sent = json.loads(prod.stdout.strip().splitlines()[-1])
        since, expected = sent["mark_ns"], sent["records_after_mark"]
        out, err = probe.communicate(json.dumps({"since": since, "expected": expected, "timeout": drain_s}) + "\n",
                                     timeout=drain_s + 120)
        if probe.returncode != 0:
            raise RuntimeError(f"the latency probe of {out_topic!r} failed: {err[-3000:]}")
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    pct = json.loads(out.strip().splitlines()[-1])
    return {**pct, "behind_s": sent["behind_s"], "records_sent": sent["records"],
            "records_after_mark": sent["records_after_mark"]}


def _probe_child(args: dict) -> dict:
    """``--latency-probe``: probe ``topic``, say "ready", then read what to
    wait for from stdin and print the figures."""
    probe = LatencyProbe(args["bootstrap"], args["topic"]).start()
    print("ready", flush=True)
    want = json.loads(sys.stdin.readline())
    try:
        drained = probe.wait_for(lambda p: p.count_since(want["since"]) >= want["expected"], timeout=want["timeout"])
    finally:
        probe.stop()
    return {**probe.percentiles(since_ns=want["since"], expected=want["expected"]), "all_seen": bool(drained)}


# --------------------------------------------------------------------------- Spark


def spark_session(master: str = "local[2]", *, shuffle_partitions: int | None = None, app_name="kafka-peers"):
    """A SparkSession with Spark's Kafka connector on its class path (an
    active session without it is stopped: ``spark.jars`` is read when the
    JVM starts). ``pyflowbuf.errors.KafkaJarsError`` when the connector is
    not installed."""
    from pyflowbuf.spark import kafka_jars
    from pyflowbuf.spark.session import worker_python_env

    jars = kafka_jars.spark_conf()
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    worker_python_env()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    slots = _task_slots(master)
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.python.worker.reuse", "true")
               .config("spark.sql.shuffle.partitions", str(shuffle_partitions or slots))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
               .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    for key, value in jars.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _task_slots(master: str) -> int:
    import re

    m = re.match(r"local\[(\d+)", master) or re.match(r"local-cluster\[(\d+),\s*(\d+)", master)
    if not m:
        return 2
    return int(m.group(1)) * (int(m.group(2)) if m.lastindex == 2 else 1)


def has_transform_with_state_in_pandas() -> bool:
    from pyspark.sql.group import GroupedData

    return hasattr(GroupedData, "transformWithStateInPandas")


def _stateful_count(api: str):
    """The keyed count as a Python stateful function for ``api``, made inside
    a function so that cloudpickle ships it by value (Spark's Python workers
    cannot import this benchmarks/ module)."""
    import numpy as np
    import pandas as pd

    if api == "applyInPandasWithState":
        def count_with_state(key, frames, state):
            n = state.get[0] if state.exists else 0
            out = []
            for pdf in frames:
                out.append(pd.DataFrame({"key": pdf["key"], "count": np.arange(n + 1, n + 1 + len(pdf)),
                                         "ts": pdf["ts"]}))
                n += len(pdf)
            state.update((n,))
            yield from out
        return count_with_state

    from pyspark.sql.streaming import StatefulProcessor
    from pyspark.sql.types import LongType, StructField, StructType

    state_schema = StructType([StructField("n", LongType(), False)])

    class CountProcessor(StatefulProcessor):
        def init(self, handle):
            self.count = handle.getValueState("count", state_schema)

        def handleInputRows(self, key, rows, timerValues):
            n = self.count.get()[0] if self.count.exists() else 0
            out = []
            for pdf in rows:
                out.append(pd.DataFrame({"key": pdf["key"], "count": np.arange(n + 1, n + 1 + len(pdf)),
                                         "ts": pdf["ts"]}))
                n += len(pdf)
            self.count.update((n,))
            yield from out

        def close(self):
            pass

    return CountProcessor()


_STATE_STORES = {  # transformWithStateInPandas needs RocksDB; the other runs on Spark's default store
    "transformWithStateInPandas": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    "applyInPandasWithState": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
}


def _keyed_count_query(spark, bootstrap, in_topic, out_topic, checkpoint, *, api, trigger,
                       max_offsets_per_trigger=None):
    from pyspark.sql import functions as F

    spark.conf.set("spark.sql.streaming.stateStore.providerClass", _STATE_STORES[api])

    reader = (spark.readStream.format("kafka")
              .option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", in_topic)
              .option("startingOffsets", "earliest"))
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(int(max_offsets_per_trigger)))
    parts = F.split(F.col("value").cast("string"), ",")
    parsed = reader.load().select(parts.getItem(0).alias("key"), parts.getItem(2).cast("long").alias("ts"))
    out_schema = "key string, count long, ts long"
    fn = _stateful_count(api)
    grouped = parsed.groupBy("key")
    if api == "applyInPandasWithState":
        counted = grouped.applyInPandasWithState(fn, out_schema, "n long", "append", "NoTimeout")
    else:
        counted = grouped.transformWithStateInPandas(fn, out_schema, "Append", "None")
    out = counted.select(F.col("key"), F.concat_ws(",", F.col("key"), F.col("count").cast("string"),
                                                   F.col("ts").cast("string")).alias("value"))
    return (out.writeStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", out_topic)
            .option("checkpointLocation", checkpoint)
            .outputMode("append")
            .trigger(**trigger)
            .start())


def _batch_figures(progress: list) -> dict:
    rows = [p.get("numInputRows", 0) for p in progress]
    durations = [p.get("batchDuration", 0) for p in progress]
    ran = [(r, d) for r, d in zip(rows, durations) if r > 0]
    return {"rows": sum(rows), "batches": len(ran), "seconds": sum(d for _, d in ran) / 1000.0,
            "median_batch_ms": statistics.median([d for _, d in ran]) if ran else math.nan}


def spark_keyed_count(bootstrap: str, in_topic: str, out_topic: str, *, rate: float | None = None,
                      latency_s: float = QUICK["latency_s"], warmup_s: float = QUICK["warmup_s"],
                      master: str = "local[2]", api: str = "applyInPandasWithState", max_offsets_per_trigger: int | None = None,
                      keys: int = DEFAULT_KEYS, spark=None, check: bool = True,
                      work_dir: str | None = None) -> dict:
    """The keyed count on Spark Structured Streaming (module docstring):
    throughput over ``in_topic`` (already filled, e.g. by ``produce_topic``)
    into ``out_topic`` (created here, with ``in_topic``'s partitions), then
    latency at ``rate`` on topics of its own. Returns the figures
    (``spark_*``) and the settings. ``spark=`` reuses a session that has the
    connector (``spark_session()``); otherwise one is made and stopped."""
    if api not in SPARK_APIS:
        raise ValueError(f"api must be one of {SPARK_APIS}, got {api!r}")
    if api == "transformWithStateInPandas" and not has_transform_with_state_in_pandas():
        raise ValueError("this PySpark has no transformWithStateInPandas (Spark 4.0+): use applyInPandasWithState")
    import pyspark

    partitions = partitions_of(bootstrap, in_topic)
    own_session = spark is None
    work = tempfile.mkdtemp(prefix="kafka-peers-spark-", dir=work_dir)
    result = {"spark_version": pyspark.__version__, "spark_master": master, "spark_api": api,
              "spark_mode": "micro-batch", "spark_partitions": partitions, "spark_keys": keys}
    try:
        t0 = time.perf_counter()
        if own_session:
            spark = spark_session(master)
        from pyflowbuf.spark import kafka_jars
        result["spark_kafka_connector"] = kafka_jars.installed_version()
        result["spark_session_start_s"] = time.perf_counter() - t0

        # warm-up: Python workers, RocksDB, the connector's classes
        tag = uuid.uuid4().hex[:6]
        warm_in, warm_out = f"{in_topic}.warmup-{tag}", f"{out_topic}.warmup-{tag}"
        produce_topic(bootstrap, warm_in, 2 * keys, partitions, keys=keys)
        create_topic(bootstrap, warm_out, partitions)
        q = _keyed_count_query(spark, bootstrap, warm_in, warm_out, os.path.join(work, "warmup"), api=api,
                               trigger={"availableNow": True})
        q.awaitTermination()
        _raise_if_failed(q)

        # throughput over the whole input topic
        create_topic(bootstrap, out_topic, partitions)
        t0 = time.perf_counter()
        q = _keyed_count_query(spark, bootstrap, in_topic, out_topic, os.path.join(work, "throughput"), api=api,
                               trigger={"availableNow": True}, max_offsets_per_trigger=max_offsets_per_trigger)
        q.awaitTermination()
        wall = time.perf_counter() - t0
        _raise_if_failed(q)
        fig = _batch_figures([json.loads(p.json) for p in q.recentProgress])
        result.update({
            "spark_records": fig["rows"], "spark_batches": fig["batches"],
            "spark_median_batch_ms": fig["median_batch_ms"],
            "spark_records_per_s": fig["rows"] / fig["seconds"] if fig["seconds"] else math.nan,
            "spark_records_per_s_wall": fig["rows"] / wall,
        })
        if check:
            result.update({f"spark_output_{k}": v
                           for k, v in check_keyed_count_output(read_all(bootstrap, out_topic), fig["rows"]).items()})

        # latency at a steady rate, micro-batch as fast as Spark goes
        if latency_s > 0:
            rate = rate or 0.5 * result["spark_records_per_s"]
            result.update(_spark_latency(spark, bootstrap, f"{in_topic}.latency-{tag}", f"{out_topic}.latency-{tag}",
                                         partitions, os.path.join(work, "latency"), api=api, rate=rate,
                                         latency_s=latency_s, warmup_s=warmup_s, keys=keys))
        result["spark_real_time_mode"] = ("not run: Spark's real-time mode takes no Python stateful function "
                                          "(applyInPandasWithState, transformWithStateInPandas)")
        return result
    finally:
        if own_session and spark is not None:
            spark.stop()
        shutil.rmtree(work, ignore_errors=True)


def spark_latency(spark, bootstrap: str, in_topic: str, out_topic: str, *, rate: float,
                  latency_s: float = QUICK["latency_s"], warmup_s: float = QUICK["warmup_s"],
                  api: str = "applyInPandasWithState", keys: int = DEFAULT_KEYS, partitions: int | None = None,
                  work_dir: str | None = None) -> dict:
    """One latency run of the keyed count on Spark at ``rate`` (what
    ``spark_keyed_count`` measures after its throughput run), in a session
    that has run it before (``spark_keyed_count(..., spark=session)``: its
    Python workers started), on fresh topics ``<in_topic>.latency-<tag>`` /
    ``<out_topic>.latency-<tag>``: so a caller can repeat it, interleaved
    with its own runs, and take medians. Returns the ``spark_e2e_*`` figures.
    The query's checkpoint goes to a new folder in ``work_dir``, left there
    for the caller to remove after ``spark.stop()``: the batch that stopping
    the query interrupts may still write its state a moment later."""
    partitions = partitions or partitions_of(bootstrap, in_topic)
    tag = uuid.uuid4().hex[:6]
    work = tempfile.mkdtemp(prefix="kafka-peers-spark-latency-", dir=work_dir)
    return _spark_latency(spark, bootstrap, f"{in_topic}.latency-{tag}", f"{out_topic}.latency-{tag}",
                          partitions, os.path.join(work, "latency"), api=api, rate=rate, latency_s=latency_s,
                          warmup_s=warmup_s, keys=keys)


def _raise_if_failed(query):
    exc = query.exception()
    if exc is not None:
        raise RuntimeError(f"the Spark query failed: {exc}")


def _spark_latency(spark, bootstrap, in_topic, out_topic, partitions, checkpoint, *, api, rate, latency_s,
                   warmup_s, keys) -> dict:
    create_topic(bootstrap, in_topic, partitions)
    create_topic(bootstrap, out_topic, partitions)
    q = _keyed_count_query(spark, bootstrap, in_topic, out_topic, checkpoint, api=api,
                           trigger={"processingTime": "0 seconds"})
    try:
        pct = latency_in_subprocess(bootstrap, in_topic, out_topic, rate, latency_s, warmup_s, keys=keys)
        _raise_if_failed(q)
    finally:
        # stopping interrupts the batch under way: Spark logs that as errors
        spark.sparkContext.setLogLevel("OFF")
        q.stop()
        spark.sparkContext.setLogLevel("ERROR")
    batches = _batch_figures([json.loads(p.json) for p in q.recentProgress])
    return {"spark_latency_rate": rate, "spark_latency_records": pct["records"],
            "spark_latency_all_seen": pct["all_seen"], "spark_latency_producer_behind_s": pct["behind_s"],
            "spark_e2e_p50_ms": pct["p50_ms"], "spark_e2e_p99_ms": pct["p99_ms"], "spark_e2e_max_ms": pct["max_ms"],
            "spark_latency_median_batch_ms": batches["median_batch_ms"]}


# --------------------------------------------------------------------------- standalone


def run_peers(bootstrap: str, *, quick: bool = True, spark: bool = True, partitions: int = 4,
              keys: int = DEFAULT_KEYS, master: str = "local[2]", api: str = "applyInPandasWithState") -> dict:
    """Every peer figure against a running broker, on topics of its own."""
    size = QUICK if quick else FULL
    tag = uuid.uuid4().hex[:6]
    result = {"quick": quick, "partitions": partitions, "keys": keys}
    topic = f"peers-in-{tag}"
    produced = produce_topic(bootstrap, topic, size["n_records"], partitions, keys=keys)
    result.update({"produce_records_per_s": produced["produce_records_per_s"], "records": produced["records"],
                   "record_bytes": produced["bytes"] / produced["records"]})
    bare = bare_client_consume_rate(bootstrap, topic)
    if bare["records"] != produced["records"]:
        raise RuntimeError(f"the bare client read {bare['records']} of {produced['records']} records")
    result["client_records_per_s"] = bare["client_records_per_s"]
    if spark:
        spark_topic = topic
        if size["spark_records"] != size["n_records"]:
            spark_topic = f"peers-spark-in-{tag}"
            produce_topic(bootstrap, spark_topic, size["spark_records"], partitions, keys=keys)
        result.update(spark_keyed_count(bootstrap, spark_topic, f"peers-spark-out-{tag}", latency_s=size["latency_s"],
                                        warmup_s=size["warmup_s"], master=master, api=api, keys=keys))
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--latency-probe"]:     # latency_in_subprocess's children
        print(json.dumps(_probe_child(json.loads(argv[1]))))
        return 0
    if argv[:1] == ["--paced-produce"]:
        a = json.loads(argv[1])
        print(json.dumps(paced_produce(a["bootstrap"], a["topic"], a["rate"], a["seconds"], keys=a["keys"],
                                       mark_s=a.get("mark_s"))))
        return 0
    parser = argparse.ArgumentParser(description="The Kafka benchmark's peers, on a local broker of their own.")
    parser.add_argument("--quick", action="store_true", help="about a minute: smaller topics, shorter latency run")
    parser.add_argument("--no-spark", action="store_true", help="only the bare client")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--api", default="applyInPandasWithState", choices=SPARK_APIS)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--keys", type=int, default=DEFAULT_KEYS)
    args = parser.parse_args(argv)
    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    t0 = time.perf_counter()
    with LocalKafkaBroker() as broker:
        result = run_peers(broker.bootstrap_servers, quick=args.quick, spark=not args.no_spark,
                           partitions=args.partitions, keys=args.keys, master=args.master, api=args.api)
    result["total_s"] = time.perf_counter() - t0
    print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
