"""The demonstration's Kafka step: Kafka as the durable source that
backpressure assumes (the seed articles' last sentence).

A local broker (KRaft, one node, 127.0.0.1; ``ci/setup.sh`` fetched it)
holds a topic of clicks that a producer keeps writing at a steady rate. The
job reads it (``read_kafka``), counts clicks per user and writes the running
counts back to Kafka exactly once (``write_kafka(delivery="exactly_once")``).
For the first seconds its sink side is slow: the job reads only as fast as it
can write, so the records it has not read yet wait in Kafka, where the lag
grows, while the job's memory stays flat (its network buffers are bounded).
Then the sink speeds up and the lag drains. On the way the job fails once,
after a checkpoint, and restarts from it. At the end a ``read_committed``
consumer finds every running count exactly once."""
from __future__ import annotations

import collections
import os
import threading
import time

import pyflowbuf as fb
from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker, find_libs

USERS = 50


def _rss_mib() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        return float("nan")


class _Throttle:
    """The slow sink side, in the chain before write_kafka: ``per_s``
    records a second while slow, no wait once fast."""

    def __init__(self, per_s: float):
        self.per_s = per_s
        self.slow = True

    def __call__(self, batch):
        if self.slow and batch:
            time.sleep(len(batch) / self.per_s)
        return batch


class _FailOnce:
    """Fails the job once, at the first record after ``after`` records once a
    checkpoint of ``env`` completed: the restart restores that checkpoint."""

    def __init__(self, after: int):
        self.after, self.seen, self.fired, self.env = after, 0, False, None
        self.lock = threading.Lock()

    def __call__(self, rec):
        with self.lock:
            self.seen += 1
            fire = (not self.fired and self.seen >= self.after
                    and any(c["status"] == "completed" for c in self.env.checkpoints()))
            self.fired = self.fired or fire
        if fire:
            raise RuntimeError("injected failure (the demo's): the job restarts from its last checkpoint")
        return rec


def _read_committed(bootstrap: str, topic: str, partitions: int) -> list:
    import confluent_kafka as ck

    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "pyflowbuf-demo-reader",
                     "isolation.level": "read_committed", "enable.partition.eof": True,
                     "auto.offset.reset": "earliest", "log_level": 0})
    c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(partitions)])
    got, ended = [], set()
    try:
        while len(ended) < partitions:
            for m in c.consume(5000, 1.0):
                if m.error() is None:
                    user, n = m.value().decode().split(",")
                    got.append((user, int(n)))
                elif m.error().code() == ck.KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
    finally:
        c.close()
    return got


def kafka_demo(out, quick: bool = False, say=print) -> dict:
    """Run the step; returns its figures (``exactly_once`` among them)."""
    try:
        import confluent_kafka as ck
    except ImportError as exc:
        say(f"  skipped: {exc} (pip install 'pyflowbuf[kafka]')")
        return {"skipped": str(exc)}
    if find_libs() is None:
        say("  skipped: the local Kafka broker is not installed (python -m pyflowbuf.connectors.kafka_broker install)")
        return {"skipped": "broker not installed"}
    rate = 10_000 if quick else 20_000          # records/s the producer writes
    produce_s = 8.0 if quick else 14.0
    slow_s = produce_s / 2
    total = int(rate * produce_s)
    work = os.path.join(str(out), "kafka")
    os.makedirs(work, exist_ok=True)
    with LocalKafkaBroker(os.path.join(work, "broker")) as broker:
        bs = broker.bootstrap_servers
        broker.create_topic("clicks", partitions=4)
        broker.create_topic("click-counts", partitions=2)
        say(f"  broker {bs} (KRaft, one node): topic 'clicks' (4 partitions) <- {rate:,} records/s for "
            f"{produce_s:.0f} s; the job's sink side is slow for the first {slow_s:.0f} s")

        throttle = _Throttle(per_s=rate / 10)
        fail = _FailOnce(after=total * 4 // 5)      # after the slow phase: its lag drained first
        # buffer debloating: about a second of data in flight, so what the job cannot take yet stays in Kafka
        env = fb.Environment(parallelism=2, checkpoint_interval=0.5, restart_attempts=1, name="kafka-demo",
                             checkpoint_dir=os.path.join(work, "checkpoints"), metrics_interval=0.5,
                             debloat=True)
        fail.env = env
        # a small client prefetch: what the job has not taken waits in Kafka, not in this process
        (env.read_kafka("clicks", bootstrap_servers=bs, value_format="str", max_prefetch_kbytes=256).uid("clicks")
            .map(fail, name="fail-once").uid("fail-once")
            .map(lambda v: (v.split(",")[0], 1), kind="struct").uid("users")
            .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("click-counts")
            .map_batches(throttle, name="slow-sink-side").uid("slow-sink-side")
            .map(lambda kv: f"{kv[0]},{kv[1]}", kind="str").uid("format")
            .write_kafka("click-counts", bootstrap_servers=bs, key=lambda line: line.split(",")[0],
                         value_format="str", delivery="exactly_once",
                         transactional_id_prefix="pyflowbuf-demo").uid("click-counts-out"))

        produced = [0]
        stop = threading.Event()

        def produce():
            p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 5, "log_level": 0})
            t0 = time.monotonic()
            while produced[0] < total and not stop.is_set():
                due = min(total, int((time.monotonic() - t0) * rate) + 1)
                while produced[0] < due:
                    i = produced[0]
                    p.produce("clicks", f"user{i % USERS},{i}".encode(), key=f"user{i % USERS}".encode())
                    produced[0] += 1
                p.poll(0)
                time.sleep(0.01)
            p.flush(30)

        producer = threading.Thread(target=produce, name="demo producer", daemon=True)
        job = env.execute_async()
        producer.start()
        t0 = time.monotonic()
        rows = []
        say(f"  {'t s':>5}  {'phase':<5} {'produced':>9} {'lag in Kafka':>12} {'RSS MiB':>8}")
        try:
            while True:
                time.sleep(0.5)
                t = time.monotonic() - t0
                if t >= slow_s and throttle.slow:
                    throttle.slow = False
                lag = sum(m.get("records_lag", 0) or 0 for m in env.metrics().values())
                row = {"t_s": round(t, 1), "phase": "slow" if throttle.slow else "fast",
                       "produced": produced[0], "records_lag": lag, "rss_mib": round(_rss_mib(), 1)}
                rows.append(row)
                say(f"  {row['t_s']:>5}  {row['phase']:<5} {row['produced']:>9,} {lag:>12,} {row['rss_mib']:>8}")
                if job.done:
                    job.join(0)         # raises what failed it
                if produced[0] >= total and not producer.is_alive() and lag == 0 and t > produce_s:
                    break
                if t > produce_s + 120:
                    raise TimeoutError("the Kafka demo's job did not catch up within 2 minutes")
            # every record read: the next completed checkpoint commits the last transaction
            last = max((c["id"] for c in env.checkpoints() if c["status"] == "completed"), default=0)
            deadline = time.monotonic() + 60
            while not any(c["status"] == "completed" and c["id"] > last + 1 for c in env.checkpoints()):
                if time.monotonic() > deadline or job.done:
                    break
                time.sleep(0.1)
        finally:
            stop.set()
            job.cancel()
            try:
                job.join(30)
            except Exception:   # noqa: BLE001 - a cancelled job's end
                pass
        got = collections.Counter(_read_committed(bs, "click-counts", 2))
    per_user = collections.Counter(f"user{i % USERS}" for i in range(total))
    want = collections.Counter((u, n) for u, c in per_user.items() for n in range(1, c + 1))
    slow = [r for r in rows if r["phase"] == "slow"]
    slow_lags = [r["records_lag"] for r in slow]
    rss = [r["rss_mib"] for r in slow]
    result = {"records": total, "restarted": bool(fail.fired), "samples": rows,
              "max_records_lag": max((r["records_lag"] for r in rows), default=0),
              "lag_grew_while_slow": len(slow_lags) >= 2 and slow_lags[-1] > slow_lags[0],
              "rss_mib_min": min(rss, default=0), "rss_mib_max": max(rss, default=0),     # in the slow phase
              "missing": sum((want - got).values()), "duplicated": sum((got - want).values()),
              "exactly_once": got == want}
    say(f"  while the sink side was slow the lag in Kafka grew to {max(slow_lags, default=0):,} records and the "
        f"process stayed at {result['rss_mib_min']:.0f}-{result['rss_mib_max']:.0f} MiB; failed once and restarted: "
        f"{result['restarted']}; output read back read_committed: {sum(got.values()):,} running counts, "
        f"missing {result['missing']}, duplicated {result['duplicated']}: "
        f"{'exactly once' if result['exactly_once'] else 'NOT exactly once'}")
    return result
