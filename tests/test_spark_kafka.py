"""Spark reads a Kafka topic that transactions wrote (issue 29, item 5).

One SparkSession for the module, in a process of its own, on
``local-cluster[2,1,1024]`` (two executor JVMs, everything on loopback) with
Spark's Kafka connector from Maven Central (``pyflowbuf.spark.kafka_jars``),
against the session's real broker
(``kafka_broker`` in conftest.py). A ``read_committed`` Spark read must see
exactly the records of committed transactions: this is how a Spark job
downstream of an exactly-once Kafka sink reads its output.
"""
import collections
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("pyspark")
confluent_kafka = pytest.importorskip("confluent_kafka")

from pyflowbuf.errors import KafkaJarsError  # noqa: E402
from pyflowbuf.spark import kafka_jars  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                                 reason="Spark and the Kafka broker need a JDK (17+)")]


# The connector must be on the driver JVM's class path from its launch: a JVM
# another test module started (one per process) cannot load the data source
# later, so the reads run in a process of their own.
READER = """
import json, os, sys
from pyspark.sql import SparkSession
bootstrap, topic, jars = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
builder = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("pyflowbuf-spark-kafka")
           .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
           .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
           .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
           .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1"))
for key, value in jars.items():
    builder = builder.config(key, value)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
out = {}
for isolation in ("read_committed", "read_uncommitted"):
    df = (spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
          .option("startingOffsets", "earliest").option("endingOffsets", "latest")
          .option("kafka.isolation.level", isolation).load())
    out[isolation] = [r.value for r in df.selectExpr("CAST(value AS STRING) AS value").collect()]
spark.stop()
print("READS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def reads(kafka_broker, transactional_topic):
    """What Spark's Kafka source read of the topic, by isolation level."""
    try:
        jars = kafka_jars.spark_conf()
    except KafkaJarsError as exc:
        pytest.skip(f"Spark's Kafka connector could not be fetched: {exc}")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
               PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p))
    res = subprocess.run([sys.executable, "-c", READER, kafka_broker.bootstrap_servers, transactional_topic[0],
                          json.dumps(jars)], env=env, capture_output=True, text=True, timeout=540)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("READS ")), None)
    assert res.returncode == 0 and line is not None, res.stderr[-3000:]
    return json.loads(line[len("READS "):])


@pytest.fixture(scope="module")
def transactional_topic(kafka_broker):
    """A 2-partition topic written by transactions: committed, aborted,
    committed (so the aborted records lie between committed ones on both
    partitions), each record keyed so that both partitions get some.
    Returns (topic, committed values, aborted values)."""
    topic = f"spark-txn-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_broker.bootstrap_servers,
                                         "transactional.id": f"test-spark-kafka-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    committed, aborted = [], []

    def transaction(name, n, commit):
        producer.begin_transaction()
        values = [f"{name}-{i}" for i in range(n)]
        for i, value in enumerate(values):
            producer.produce(topic, key=f"k{i % 7}", value=value, partition=i % 2)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
            committed.extend(values)
        else:
            producer.abort_transaction(30)
            aborted.extend(values)

    transaction("first", 60, commit=True)
    transaction("aborted", 40, commit=False)
    transaction("second", 50, commit=True)
    return topic, committed, aborted


def test_read_committed_sees_exactly_the_committed_records(reads, transactional_topic):
    topic, committed, aborted = transactional_topic
    seen = collections.Counter(reads["read_committed"])
    assert not [v for v, n in seen.items() if n > 1], "records seen more than once"
    assert set(seen) == set(committed), (
        f"missing: {sorted(set(committed) - set(seen))[:10]}, "
        f"not committed but seen: {sorted(set(seen) - set(committed))[:10]}")


def test_read_uncommitted_also_sees_the_aborted_records(reads, transactional_topic):
    """The control: the topic really holds aborted records, so the test above
    tells a read_committed read from one that is not."""
    topic, committed, aborted = transactional_topic
    seen = collections.Counter(reads["read_uncommitted"])
    assert set(seen) == set(committed) | set(aborted)
