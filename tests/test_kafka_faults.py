"""Kafka faults against a real broker of the test's own (function scope,
its log on disk): the broker restarted while an exactly-once Kafka -> keyed
count -> Kafka job runs. A read_committed consumer finds every running
count exactly once."""
from __future__ import annotations

import collections
import json
import logging
import random
import time
import uuid

import pytest

import pyflowbuf as fb
from pipeline_helpers import wait_for
from test_kafka import read_committed      # (the same read_committed consumer)

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def own_broker(tmp_path):
    """A broker of this test alone, restarted on the same port and log folder."""
    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    broker = LocalKafkaBroker(tmp_path / "kafka")
    yield broker
    broker.close()


def produce(bs, topic, values, partitions):
    p = ck.Producer({"bootstrap.servers": bs, "linger.ms": 20})
    for i, v in enumerate(values):
        p.produce(topic, v.encode(), partition=i % partitions)
    assert p.flush(60) == 0


class Reconnects(logging.Handler):
    """The client's log lines about a broker it cannot reach (pyflowbuf.kafka)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        msg = record.getMessage()
        if "Connection refused" in msg or "Disconnected" in msg:
            self.records.append((record.levelno, msg))


def test_a_broker_restarted_mid_job_loses_and_duplicates_nothing(own_broker, tmp_path):
    bs = own_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    own_broker.create_topic(src, partitions=4)
    own_broker.create_topic(out, partitions=3)
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    words = [f"k{rnd.randrange(40)}" for _ in range(8000)]
    produce(bs, src, words, 4)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "chk"),
                         restart_attempts=10)
    (env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).uid("in")
        # slow enough that the broker's restart comes while records flow
        .map(lambda w: time.sleep(0.001) or w)
        .map(lambda w: (w, 1)).key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts")
        .write_kafka(out, bootstrap_servers=bs, key=lambda kv: kv[0], value_format="json",
                     delivery="exactly_once", transactional_id_prefix=_name("eo")).uid("out"))
    log = Reconnects()
    logger = logging.getLogger("pyflowbuf.kafka")
    logger.addHandler(log)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    t0 = time.monotonic()
    job = env.execute_async()
    try:
        wait_for(lambda: sum(c.get("status") == "completed" for c in job.checkpoints()) >= 3,
                 "three checkpoints before the restart", job=job)
        t_stop = time.monotonic()
        own_broker.stop()
        # the clients found the broker gone and try again
        wait_for(lambda: any("Connection refused" in m for _, m in log.records), "a refused reconnect")
        down_s = time.monotonic() - t_stop
        own_broker.start()
        t_up = time.monotonic()
        job.join(240)
    finally:
        logger.removeHandler(log)
        logger.setLevel(old_level)
        if not job.done:
            job.cancel()
    total_s = time.monotonic() - t0
    got = collections.Counter(tuple(json.loads(v)) for v in read_committed(bs, out, 3))
    per_key = collections.Counter(words)
    want = collections.Counter((k, c) for k, n in per_key.items() for c in range(1, n + 1))
    restarts = [f[2][:200] for f in job.restart_failures]
    print(f"broker down {down_s:.1f} s (+ start {t_up - t_stop - down_s:.1f} s), job {total_s:.1f} s, "
          f"restarts {restarts}, reconnect lines {len(log.records)} "
          f"(levels {sorted({logging.getLevelName(lv) for lv, _ in log.records})})")
    assert got == want, (f"seed {seed}: missing {sum((want - got).values())}, "
                         f"duplicated {sum((got - want).values())}")
    # an expected reconnect is not an error
    assert all(lv <= logging.WARNING for lv, _ in log.records)
