#!/usr/bin/env python
"""Kafka in and out against a real local broker (issue 29, item 6).

* ``kafka_source_vs_client``: the steady rate of ``read_kafka`` (bounded)
  into a counting sink, divided by the steady rate of a bare confluent-kafka
  consume loop over the same topic (the client's own limit,
  ``kafka_peers.bare_client_consume_rate``). Steady: records / seconds from
  the first batch received to the last record received, on both sides, so
  neither the connection set-up nor the end-of-partition wait is counted.
  Goal >= 0.8. The wall-clock rates are reported too (``_wall``).
* ``kafka_exactly_once_vs_at_least_once``: the keyed count (Kafka -> parse ->
  keyed running count -> Kafka, the job Spark runs below), a checkpoint
  every second, exactly-once throughput / at-least-once, in steady state:
  an unbounded job over a pre-filled topic, its rate taken from the output
  topic's last stable offset (what ``read_committed`` readers see) between
  10 % and 90 % of the input, so the start (producers, transactions' fencing)
  and the end are left out. Goal >= 0.8.
* ``kafka_e2e_p50_ms`` / ``kafka_e2e_p99_ms``: produce -> read_committed
  visibility through the exactly-once keyed count at half its steady rate;
  the ``_at_least_once`` keys are the same with no commit wait. Measured as
  Spark's is (``kafka_peers.paced_produce`` and ``LatencyProbe``, each in a
  process of its own apart from either job, the first
  ``warmup_s`` seconds of records not counted on either side: the jobs'
  start and their first checkpoints), with ``buffer_timeout=0.01`` (the
  throughput runs keep the default 0.1 s).
* The same keyed count on Spark Structured Streaming
  (``kafka_peers.spark_keyed_count``, micro-batch): ``kafka_throughput_vs_spark``
  (our exactly-once rate / Spark's) and ``kafka_p99_vs_spark_microbatch``
  (our at-least-once p99 / Spark's p99 at half its own rate; Spark's Kafka
  sink is at least once).
* Latency figures are medians of ``repeats`` runs of each side, interleaved
  (ours exactly once, ours at least once, Spark; the order rotated), in one
  Spark session that ran its warm-up query and throughput run first; the
  ratio is the median of the runs' ratios. One run says little on a shared
  machine: a p99 of a 10 s window is the worst 100 ms of it.

    python benchmarks/run.py kafka --quick --json
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
import kafka_peers  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402

PARTITIONS = 4
VALUE = b"x" * 90
LATENCY_BUFFER_TIMEOUT = 0.01


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


def client_rate(bs, topic, n):
    # the fetch settings read_kafka gives its client, so both sides fetch alike: its prefetch
    # bound (max_prefetch_kbytes), and the 20 ms back-off once that queue was full (librdkafka's
    # 1 s caps a consumer that drains its queue faster than it fills at a queue's worth a second:
    # the bare loop measured 0.17-0.71 M records/s from run to run with it)
    from pyflowbuf.connectors import kafka as kc
    got = kafka_peers.bare_client_consume_rate(bs, topic, consumer_conf={
        "queued.max.messages.kbytes": 16384, "fetch.queue.backoff.ms": 20,
        "fetch.wait.max.ms": kc.FETCH_WAIT_MS, "fetch.min.bytes": kc.FETCH_MIN_BYTES})
    assert got["records"] == n, (got["records"], n)
    return {"rate": got["client_records_per_s_steady"], "wall": got["client_records_per_s"]}


def source_rate(bs, topic, n):
    """read_kafka (bounded) into a counting sink: steady and wall-clock rates."""
    env = fb.Environment(parallelism=1)
    count, first, last = [0], [None], [None]

    def counting(batch):
        now = time.perf_counter()
        if first[0] is None:
            first[0] = now
        count[0] += len(batch)
        last[0] = now
    env.read_kafka(topic, bootstrap_servers=bs, bounded=True).sink(counting, batched=True)
    t0 = time.perf_counter()
    env.execute()
    dt = time.perf_counter() - t0
    assert count[0] == n, (count[0], n)
    return {"rate": n / (last[0] - first[0]), "wall": n / dt}


def _parse(v):
    key, _, ts = v.split(b",")
    return (key, 1, ts)


def _count(a, b):
    return (a[0], a[1] + 1, b[2])


def _out(r):
    return b"%s,%d,%s" % r


def _key(v):
    return v[:v.index(b",")]


def keyed_count(env, bs, src, out, delivery):
    """Kafka -> parse -> keyed running count -> Kafka: one output record
    ``key,count,produce_ts_ns`` per input record (kafka_peers' format)."""
    (env.read_kafka(src, bootstrap_servers=bs, value_format="bytes").uid("in")
        .map(_parse).uid("parse")
        .key_by(lambda r: r[0]).reduce(_count).uid("count")
        .map(_out).uid("format")
        .write_kafka(out, bootstrap_servers=bs, key=_key, value_format="bytes", delivery=delivery,
                     transactional_id_prefix=out).uid("out"))


def _visible(consumer, topic):
    """Records read_committed readers can see: the sum of the partitions'
    last stable offsets (a read_committed client's end offsets)."""
    ck = _ck()
    return sum(consumer.get_watermark_offsets(ck.TopicPartition(topic, p), timeout=10, cached=False)[1]
               for p in range(PARTITIONS))


def steady_rate(broker, src, n, delivery, tmp):
    """The keyed count's steady rate over the pre-filled ``src``: visible
    output records per second between 10 % and 90 % of ``n``."""
    ck = _ck()
    bs = broker.bootstrap_servers
    out = f"out-{delivery}-{time.monotonic_ns()}"
    kafka_peers.create_topic(bs, out, PARTITIONS)       # every partition led: its offsets can be asked
    env = fb.Environment(parallelism=1, checkpoint_interval=1.0, checkpoint_dir=f"{tmp}/chk-{out}")
    keyed_count(env, bs, src, out, delivery)
    probe = ck.Consumer({"bootstrap.servers": bs, "group.id": f"probe-{out}", "isolation.level": "read_committed"})
    job = env.execute_async()
    samples = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                got = _visible(probe, out)
            except _ck().KafkaException:    # the probe's metadata not yet current: "not leader"
                time.sleep(0.05)
                continue
            samples.append((time.perf_counter(), got))
            if got >= 0.9 * n:
                break
            if time.monotonic() > deadline or job.done:
                raise RuntimeError(f"{delivery}: {got} of {n} records visible when the job stopped or timed out")
            time.sleep(0.05)
    finally:
        job.cancel()
        job.join(60)
        probe.close()
    a = next(s for s in samples if s[1] >= 0.1 * n)
    b = samples[-1]
    return (b[1] - a[1]) / (b[0] - a[0])


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


def latency(broker, delivery, rate, sizes, tmp):
    """p50/p99 ms from produce to read_committed visibility through the keyed
    count at ``rate``, as ``kafka_peers`` measures Spark's."""
    bs = broker.bootstrap_servers
    stamp = time.monotonic_ns()
    src, out = f"lat-in-{stamp}", f"lat-out-{stamp}"
    kafka_peers.create_topic(bs, src, PARTITIONS)
    kafka_peers.create_topic(bs, out, PARTITIONS)
    # a partly filled buffer ships after 10 ms, not 100 (Flink's low-latency setting of
    # execution.buffer-timeout): the exchange before the keyed count
    env = fb.Environment(parallelism=1, checkpoint_interval=1.0, checkpoint_dir=f"{tmp}/chk-{src}",
                         buffer_timeout=LATENCY_BUFFER_TIMEOUT)
    keyed_count(env, bs, src, out, delivery)
    job = env.execute_async()
    try:
        # the producer and the probe in a process of their own, as for Spark's job
        pct = kafka_peers.latency_in_subprocess(bs, src, out, rate, sizes["latency_s"], sizes["warmup_s"])
    finally:
        job.cancel()
        job.join(60)
    return {"p50": pct["p50_ms"], "p99": pct["p99_ms"], "behind": pct["behind_s"]}


def _spark_latency(session, bs, rate, sizes, tmp):
    got = kafka_peers.spark_latency(session, bs, "spark-in", "spark-out", rate=rate, latency_s=sizes["latency_s"],
                                    warmup_s=sizes["warmup_s"], work_dir=tmp)
    return {"p50": got["spark_e2e_p50_ms"], "p99": got["spark_e2e_p99_ms"],
            "all_seen": float(got["spark_latency_all_seen"])}


def _interleaved_with_gc(cases, reps, advance):
    """``common.interleaved`` (the order rotated each repetition), but with
    the cyclic GC left on: its pauses are part of a real job's latency."""
    names = list(cases)
    runs = {n: [] for n in names}
    for i in range(reps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            runs[n].append(dict(cases[n]()))
        advance()
    return common.Samples(runs)


def main(quick: bool = False) -> dict:
    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    n = 200_000 if quick else 1_000_000
    n_count = 1_200_000 if quick else 4_000_000     # the keyed count's input: many commits in 10-90 %
    reps = 3 if quick else 5
    sizes = kafka_peers.QUICK if quick else kafka_peers.FULL
    rep = common.Report("kafka", quick, params={"records": n, "keyed_count_records": n_count, "repeats": reps,
                                                "partitions": PARTITIONS, "value_bytes": len(VALUE),
                                                "keys": kafka_peers.DEFAULT_KEYS,
                                                "latency_seconds": sizes["latency_s"],
                                                "latency_warmup_seconds": sizes["warmup_s"]})
    with tempfile.TemporaryDirectory() as tmp, LocalKafkaBroker(f"{tmp}/broker") as broker:
        bs = broker.bootstrap_servers
        broker.create_topic("bench-in", partitions=PARTITIONS)
        fill(bs, "bench-in", n)

        rep.section("read_kafka into a counting sink vs a bare confluent-kafka consume loop (steady rates)")
        with common.progress("source", reps) as adv:
            s = common.interleaved({"source": lambda: source_rate(bs, "bench-in", n),
                                    "client": lambda: client_rate(bs, "bench-in", n)}, reps, advance=adv)
        rep.add("kafka_source_records_per_s", s.median("source"), "records/s", spread=s.spread("source"),
                note="steady: first batch to last record")
        rep.add("kafka_client_records_per_s", s.median("client"), "records/s", spread=s.spread("client"),
                note="client_records_per_s_steady")
        rep.add("kafka_source_vs_client", s.ratio("source", "client"), "x", goal=Goal(">=", 0.8, "x"))
        rep.add("kafka_source_records_per_s_wall", s.median("source", "wall"), "records/s",
                note="job start to end, end-of-partition wait included")
        rep.add("kafka_client_records_per_s_wall", s.median("client", "wall"), "records/s",
                note="assign to every partition's end")
        kafka_arrow_vs_bytes(rep, bs, "bench-in", n, reps)

        rep.section("keyed count, Kafka in and out, checkpoint every second, steady state: "
                    "exactly once vs at least once")
        kafka_peers.produce_topic(bs, "count-in", n_count, PARTITIONS)
        with common.progress("sink", reps) as adv:
            s = common.interleaved({"eo": lambda: steady_rate(broker, "count-in", n_count, "exactly_once", tmp),
                                    "alo": lambda: steady_rate(broker, "count-in", n_count, "at_least_once", tmp)},
                                   reps, warmup=0, advance=adv)
        eo_rate = s.median("eo")
        rep.add("kafka_exactly_once_records_per_s", eo_rate, "records/s", spread=s.spread("eo"),
                note="visible to read_committed, 10-90 % of the input")
        rep.add("kafka_at_least_once_records_per_s", s.median("alo"), "records/s", spread=s.spread("alo"))
        rep.add("kafka_exactly_once_vs_at_least_once", s.ratio("eo", "alo"), "x", goal=Goal(">=", 0.8, "x"))

        # the Spark Structured Streaming side (benchmarks/kafka_peers.py), same broker, same run:
        # the keyed count, Kafka in and out, a Python stateful function, micro-batch
        rep.section("the same keyed count on Spark Structured Streaming (micro-batch, local[2]): throughput")
        kafka_peers.produce_topic(bs, "spark-in", sizes["spark_records"], PARTITIONS)
        session = kafka_peers.spark_session()
        try:
            # its warm-up query and throughput run (the session stays, for the latency runs below)
            spark = kafka_peers.spark_keyed_count(bs, "spark-in", "spark-out", latency_s=0, spark=session)
            rep.add("spark_records_per_s", spark["spark_records_per_s"], "records/s",
                    note=f"{spark['spark_api']}, {spark['spark_master']}, Spark {spark['spark_version']}")
            rep.add("kafka_throughput_vs_spark", eo_rate / spark["spark_records_per_s"], "x",
                    goal=Goal(">=", 1.0, "x"), note="our exactly-once keyed count / Spark's (both Kafka in and out)")

            rep.section("produce -> read_committed latency at half of each job's steady rate, steady state "
                        f"(the first {sizes['warmup_s']:g} s of records not counted), medians of {reps} "
                        "interleaved runs: ours exactly once, ours at least once, Spark micro-batch")
            rate = max(100.0, eo_rate / 2)
            spark_rate = 0.5 * spark["spark_records_per_s"]
            with common.progress("latency", reps) as adv:
                s = _interleaved_with_gc({
                    "eo": lambda: latency(broker, "exactly_once", rate, sizes, tmp),
                    "alo": lambda: latency(broker, "at_least_once", rate, sizes, tmp),
                    "spark": lambda: _spark_latency(session, bs, spark_rate, sizes, tmp),
                }, reps, advance=adv)
        finally:
            session.stop()
        rep.add("kafka_e2e_p50_ms", s.median("eo", "p50"), "ms", spread=s.spread("eo", "p50"),
                note=f"exactly once, {rate:.0f} records/s, checkpoint every 1 s, producer behind by "
                     f"{max(s.values('eo', 'behind')) * 1000:.0f} ms at worst")
        rep.add("kafka_e2e_p99_ms", s.median("eo", "p99"), "ms", spread=s.spread("eo", "p99"))
        rep.add("kafka_e2e_p50_ms_at_least_once", s.median("alo", "p50"), "ms", spread=s.spread("alo", "p50"),
                note=f"no commit wait, buffer_timeout {LATENCY_BUFFER_TIMEOUT:g} s, producer behind by "
                     f"{max(s.values('alo', 'behind')) * 1000:.0f} ms at worst")
        rep.add("kafka_e2e_p99_ms_at_least_once", s.median("alo", "p99"), "ms", spread=s.spread("alo", "p99"),
                note="runs: " + ", ".join(f"{v:.0f}" for v in s.values("alo", "p99")))
        rep.add("spark_e2e_p50_ms", s.median("spark", "p50"), "ms", spread=s.spread("spark", "p50"))
        rep.add("spark_e2e_p99_ms", s.median("spark", "p99"), "ms", spread=s.spread("spark", "p99"),
                note=f"at {spark_rate:.0f} records/s, all seen in every run: "
                     f"{all(v > 0 for v in s.values('spark', 'all_seen'))}; runs: "
                     + ", ".join(f"{v:.0f}" for v in s.values("spark", "p99")))
        rep.add("kafka_p99_vs_spark_microbatch", s.ratio("alo", "spark", "p99"), "x", goal=Goal("<=", 0.1, "x"),
                note="our at-least-once p99 / Spark micro-batch p99, median of the runs' ratios")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    common.render_result(result, "kafka")
