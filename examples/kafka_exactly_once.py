#!/usr/bin/env python
"""Kafka in, a keyed count, Kafka out, exactly once through a failure.

Starts a local Kafka broker (``python -m pyflowbuf.connectors.kafka_broker
install`` fetches it once; ci/setup.sh does), writes words to a topic, runs
words -> running count per word -> a topic with ``delivery="exactly_once"``,
fails the job once right between a checkpoint's completion and the commit of
its Kafka transaction, and reads the output back with a read_committed
consumer: every running count exactly once.

    python examples/kafka_exactly_once.py

See docs/kafka.md."""
import collections
import json
import os
import random
import tempfile

import confluent_kafka as ck

import pyflowbuf as fb
from pyflowbuf.connectors.kafka import KafkaSink
from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

WORDS = 20_000


class FailOnceBeforeCommit(KafkaSink):
    """The sink of write_kafka, failing once where it hurts most: the
    checkpoint is complete, its transaction not committed yet."""

    failed = []

    def _commit_live(self, c, *rest):
        if not self.failed:
            self.failed.append(c["id"])
            raise RuntimeError(f"injected failure before committing checkpoint {c['id']}")
        super()._commit_live(c, *rest)


def read_committed(bootstrap, topic, partitions):
    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "example-reader",
                     "isolation.level": "read_committed", "enable.partition.eof": True})
    c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(partitions)])
    got, ended = [], set()
    while len(ended) < partitions:
        for m in c.consume(1000, 1.0):
            if m.error() is None:
                got.append(tuple(json.loads(m.value())))
            elif m.error().code() == ck.KafkaError._PARTITION_EOF:
                ended.add(m.partition())
    c.close()
    return got


def main(d):
    with LocalKafkaBroker(os.path.join(d, "broker")) as broker:
        bs = broker.bootstrap_servers
        broker.create_topic("words", partitions=4)
        broker.create_topic("counts", partitions=2)
        rnd = random.Random(1)
        words = [rnd.choice(["apple", "pear", "plum", "fig", "kiwi"]) for _ in range(WORDS)]
        producer = ck.Producer({"bootstrap.servers": bs})
        for w in words:
            producer.produce("words", w.encode())
        producer.flush()

        env = fb.Environment(parallelism=2, checkpoint_interval=0.1, restart_attempts=1,
                             checkpoint_dir=os.path.join(d, "checkpoints"))
        counts = (env.read_kafka("words", bootstrap_servers=bs, value_format="str", bounded=True,
                                rate_limit=WORDS / 2).uid("words")          # about 2 s: checkpoints go by
                     .map(lambda w: (w, 1)).uid("pairs")
                     .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts"))
        # write_kafka(...) is this sink; the subclass adds the failure
        counts.sink_to(FailOnceBeforeCommit(bs, "counts", key=lambda kv: kv[0], value_format="json",
                                            delivery="exactly_once", transactional_id_prefix="example"),
                       name="counts-out").uid("counts-out")
        env.execute()

        got = collections.Counter(read_committed(bs, "counts", 2))
        want = collections.Counter((w, n) for w, total in collections.Counter(words).items()
                                   for n in range(1, total + 1))
        assert FailOnceBeforeCommit.failed, "the failure was not injected"
        assert got == want, f"missing {sum((want - got).values())}, duplicated {sum((got - want).values())}"
        print(f"failed once before committing checkpoint {FailOnceBeforeCommit.failed[0]}; "
              f"{sum(got.values())} running counts in 'counts', each exactly once")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        main(d)
