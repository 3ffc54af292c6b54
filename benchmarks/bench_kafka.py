#!/usr/bin/env python
"""Kafka in and out against a real local broker (issue 29, item 6).

* ``kafka_source_vs_client``: records/s of ``read_kafka`` (bounded) into a
  counting sink, divided by a bare confluent-kafka consume loop over the same
  topic (the client's own limit). Goal >= 0.8.
* ``kafka_exactly_once_vs_at_least_once``: Kafka -> map -> Kafka, a
  checkpoint every second, exactly-once throughput / at-least-once. Goal >= 0.8.
* ``kafka_e2e_p50_ms`` / ``kafka_e2e_p99_ms``: produce -> read_committed
  visibility through the exactly-once job at half its top rate; the
  ``_at_least_once`` keys are the same with no commit wait.

The Spark Structured Streaming side and the bare-client loop shared with it
live in ``benchmarks/kafka_peers.py`` (another part of the issue); when that
module is there its ``bare_consume_rate`` is used as the client's limit and
its Spark figures are added (``kafka_throughput_vs_spark``,
``kafka_p99_vs_spark_microbatch``); without it those keys are left out.

    python benchmarks/run.py kafka --quick --json
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402

try:        # the peers (Spark, the shared bare loop): benchmarks/kafka_peers.py, when present
    import kafka_peers  # noqa: E402
except ImportError:
    kafka_peers = None

PARTITIONS = 4
VALUE = b"x" * 90


def _ck():
    import confluent_kafka
    return confluent_kafka


def fill(bs, topic, n):
    ck = _ck()
    p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 20, "batch.num.messages": 10000,
                     "queue.buffering.max.messages": 1_000_000})
    for i in range(n):
        while True:
            try:
                p.produce(topic, VALUE, partition=i % PARTITIONS)
                break
            except BufferError:
                p.poll(0.01)
    p.flush(120)


def bare_client_rate(bs, topic, n):
    """A plain confluent-kafka consume loop (batched) over every partition to its end."""
    if kafka_peers is not None:
        return kafka_peers.bare_client_consume_rate(bs, topic)["client_records_per_s"]
    ck = _ck()
    c = ck.Consumer({"bootstrap.servers": bs, "group.id": f"bare-{time.monotonic_ns()}",
                     "enable.partition.eof": True, "enable.auto.commit": False,
                     "isolation.level": "read_committed"})
    c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(PARTITIONS)])
    got, ended = 0, set()
    t0 = time.perf_counter()
    while len(ended) < PARTITIONS:
        for m in c.consume(10000, 1.0):
            if m.error() is None:
                got += 1
            elif m.error().code() == ck.KafkaError._PARTITION_EOF:
                ended.add(m.partition())
    dt = time.perf_counter() - t0
    c.close()
    assert got == n, (got, n)
    return got / dt


def source_rate(bs, topic, n):
    env = fb.Environment(parallelism=1)
    count = [0]
    env.read_kafka(topic, bootstrap_servers=bs, bounded=True).sink(
        lambda b: count.__setitem__(0, count[0] + len(b)), batched=True)
    t0 = time.perf_counter()
    env.execute()
    dt = time.perf_counter() - t0
    assert count[0] == n, (count[0], n)
    return n / dt


# ---- kafka_arrow_vs_bytes (read_kafka's Arrow batches; kept apart from the figures above) ----

def _rows_rate(bs, topic, n, value_format):
    env = fb.Environment(parallelism=1)
    count = [0]
    if value_format == "arrow":
        def add(b):
            count[0] += sum(x.num_rows for x in b)
    else:
        def add(b):
            count[0] += len(b)
    env.read_kafka(topic, bootstrap_servers=bs, bounded=True, value_format=value_format).sink(add, batched=True)
    t0 = time.perf_counter()
    env.execute()
    dt = time.perf_counter() - t0
    assert count[0] == n, (value_format, count[0], n)
    return n / dt


def kafka_arrow_vs_bytes(rep, bs, topic, n, reps):
    """Rows/s of ``read_kafka(value_format="arrow")`` (a RecordBatch per pull)
    into a counting sink, divided by ``value_format="bytes"`` (a record per
    value) over the same topic: what the vectorized path gains at the source."""
    rep.section("read_kafka: Arrow batches vs bytes records, into a counting sink")
    with common.progress("arrow", reps) as adv:
        s = common.interleaved({"arrow": lambda: _rows_rate(bs, topic, n, "arrow"),
                                "bytes": lambda: _rows_rate(bs, topic, n, "bytes")}, reps, advance=adv)
    rep.add("kafka_arrow_rows_per_s", s.median("arrow"), "rows/s", spread=s.spread("arrow"))
    rep.add("kafka_bytes_records_per_s", s.median("bytes"), "records/s", spread=s.spread("bytes"))
    rep.add("kafka_arrow_vs_bytes", s.ratio("arrow", "bytes"), "x",
            note="value_format='arrow' rows/s / 'bytes' records/s, same topic, parallelism 1")


def copy_rate(broker, src, n, delivery, tmp):
    bs = broker.bootstrap_servers
    out = f"out-{delivery}-{time.monotonic_ns()}"
    broker.create_topic(out, partitions=PARTITIONS)
    env = fb.Environment(parallelism=1, checkpoint_interval=1.0, checkpoint_dir=f"{tmp}/chk-{out}")
    (env.read_kafka(src, bootstrap_servers=bs, bounded=True).uid("in").map(lambda v: v).uid("m")
        .write_kafka(out, bootstrap_servers=bs, value_format="bytes", delivery=delivery,
                     transactional_id_prefix=out).uid("out"))
    t0 = time.perf_counter()
    env.execute()
    return n / (time.perf_counter() - t0)


def latency(broker, delivery, rate, seconds, tmp):
    """p50/p99 ms from produce to read_committed visibility through the job."""
    ck = _ck()
    bs = broker.bootstrap_servers
    stamp = time.monotonic_ns()
    src, out = f"lat-in-{stamp}", f"lat-out-{stamp}"
    broker.create_topic(src, partitions=PARTITIONS)
    broker.create_topic(out, partitions=PARTITIONS)
    env = fb.Environment(parallelism=1, checkpoint_interval=1.0 if delivery == "exactly_once" else 0.5,
                         checkpoint_dir=f"{tmp}/chk-{src}")
    (env.read_kafka(src, bootstrap_servers=bs, starting_offsets="earliest").uid("in").map(lambda v: v).uid("m")
        .write_kafka(out, bootstrap_servers=bs, value_format="bytes", delivery=delivery,
                     transactional_id_prefix=out).uid("out"))
    job = env.execute_async()
    lat = []
    stop = threading.Event()

    def consume():
        c = ck.Consumer({"bootstrap.servers": bs, "group.id": f"lat-{stamp}", "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
        c.assign([ck.TopicPartition(out, p, ck.OFFSET_BEGINNING) for p in range(PARTITIONS)])
        while not stop.is_set():
            for m in c.consume(10000, 0.2):
                if m.error() is None:
                    lat.append((time.time() - float(m.value())) * 1000)
        c.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 1})
    t0 = time.perf_counter()
    sent = 0
    while time.perf_counter() - t0 < seconds:
        due = int((time.perf_counter() - t0) * rate)
        while sent < due:
            p.produce(src, repr(time.time()).encode(), partition=sent % PARTITIONS)
            sent += 1
        p.poll(0)
        time.sleep(0.002)
    p.flush(30)
    deadline = time.monotonic() + 30
    while len(lat) < sent and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    reader.join(10)
    job.cancel()
    job.join(60)
    lat.sort()
    if not lat:
        return float("nan"), float("nan")
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def main(quick: bool = False) -> dict:
    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    n = 200_000 if quick else 1_000_000
    reps = 3 if quick else 5
    seconds = 8 if quick else 20
    rep = common.Report("kafka", quick, params={"records": n, "repeats": reps, "partitions": PARTITIONS,
                                                "value_bytes": len(VALUE), "latency_seconds": seconds})
    with tempfile.TemporaryDirectory() as tmp, LocalKafkaBroker(f"{tmp}/broker") as broker:
        bs = broker.bootstrap_servers
        broker.create_topic("bench-in", partitions=PARTITIONS)
        fill(bs, "bench-in", n)

        rep.section("read_kafka into a counting sink vs a bare confluent-kafka consume loop")
        with common.progress("source", reps) as adv:
            s = common.interleaved({"source": lambda: source_rate(bs, "bench-in", n),
                                    "client": lambda: bare_client_rate(bs, "bench-in", n)}, reps, advance=adv)
        rep.add("kafka_source_records_per_s", s.median("source"), "records/s", spread=s.spread("source"))
        rep.add("kafka_client_records_per_s", s.median("client"), "records/s", spread=s.spread("client"))
        rep.add("kafka_source_vs_client", s.ratio("source", "client"), "x", goal=Goal(">=", 0.8, "x"))
        kafka_arrow_vs_bytes(rep, bs, "bench-in", n, reps)

        rep.section("Kafka -> map -> Kafka, checkpoint every second: exactly once vs at least once")
        with common.progress("sink", reps) as adv:
            s = common.interleaved({"eo": lambda: copy_rate(broker, "bench-in", n, "exactly_once", tmp),
                                    "alo": lambda: copy_rate(broker, "bench-in", n, "at_least_once", tmp)},
                                   reps, warmup=0, advance=adv)
        eo_rate = s.median("eo")
        rep.add("kafka_exactly_once_records_per_s", eo_rate, "records/s", spread=s.spread("eo"))
        rep.add("kafka_at_least_once_records_per_s", s.median("alo"), "records/s", spread=s.spread("alo"))
        rep.add("kafka_exactly_once_vs_at_least_once", s.ratio("eo", "alo"), "x", goal=Goal(">=", 0.8, "x"))

        rep.section("produce -> read_committed latency at half the exactly-once job's top rate")
        rate = max(100.0, eo_rate / 2)
        p50, p99 = latency(broker, "exactly_once", rate, seconds, tmp)
        rep.add("kafka_e2e_p50_ms", p50, "ms", note=f"exactly once, {rate:.0f} records/s, checkpoint every 1 s")
        rep.add("kafka_e2e_p99_ms", p99, "ms")
        p50, p99 = latency(broker, "at_least_once", rate, seconds, tmp)
        rep.add("kafka_e2e_p50_ms_at_least_once", p50, "ms", note="no commit wait")
        rep.add("kafka_e2e_p99_ms_at_least_once", p99, "ms")

        if kafka_peers is not None:
            # the Spark Structured Streaming side (benchmarks/kafka_peers.py), same broker, same run:
            # the keyed count, Kafka in and out, a Python stateful function, micro-batch
            rep.section("the same keyed count on Spark Structured Streaming (micro-batch, local[2])")
            sizes = kafka_peers.QUICK if quick else kafka_peers.FULL
            kafka_peers.produce_topic(bs, "spark-in", sizes["spark_records"], PARTITIONS)
            spark = kafka_peers.spark_keyed_count(bs, "spark-in", "spark-out", latency_s=sizes["latency_s"],
                                                  warmup_s=sizes["warmup_s"])
            rep.add("spark_records_per_s", spark["spark_records_per_s"], "records/s",
                    note=f"{spark['spark_api']}, {spark['spark_master']}, Spark {spark['spark_version']}")
            rep.add("spark_e2e_p99_ms", spark.get("spark_e2e_p99_ms"), "ms",
                    note=f"at {spark.get('spark_latency_rate', 0):.0f} records/s, all seen: "
                         f"{spark.get('spark_latency_all_seen')}")
            ours = s.median("eo")
            rep.add("kafka_throughput_vs_spark", ours / spark["spark_records_per_s"], "x", goal=Goal(">=", 1.0, "x"),
                    note="our exactly-once keyed count / Spark's (both Kafka in and out)")
            if spark.get("spark_e2e_p99_ms"):
                rep.add("kafka_p99_vs_spark_microbatch", p99 / spark["spark_e2e_p99_ms"], "x",
                        goal=Goal("<=", 0.1, "x"), note="our at-least-once p99 / Spark micro-batch p99")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    common.render_result(result, "kafka")
