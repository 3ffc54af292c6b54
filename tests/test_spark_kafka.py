"""Spark reads a Kafka topic that transactions wrote (issue 29, item 5).

One SparkSession for the module on ``local-cluster[2,1,1024]`` (two executor
JVMs, everything on loopback) with Spark's Kafka connector from Maven Central
(``pyflowbuf.spark.kafka_jars``), against the session's real broker
(``kafka_broker`` in conftest.py). A ``read_committed`` Spark read must see
exactly the records of committed transactions: this is how a Spark job
downstream of an exactly-once Kafka sink reads its output.
"""
import collections
import os
import shutil
import uuid

import pytest

pytest.importorskip("pyspark")
confluent_kafka = pytest.importorskip("confluent_kafka")

from pyflowbuf.errors import KafkaJarsError  # noqa: E402
from pyflowbuf.spark import kafka_jars  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                                 reason="Spark and the Kafka broker need a JDK (17+)")]


@pytest.fixture(scope="module")
def spark():
    try:
        jars = kafka_jars.spark_conf()
    except KafkaJarsError as exc:
        pytest.skip(f"Spark's Kafka connector could not be fetched: {exc}")
    from pyflowbuf.spark.session import worker_python_env

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    worker_python_env()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()       # another module's session: this one needs the connector on its class path
    builder = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("pyflowbuf-spark-kafka")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
               .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1"))
    for key, value in jars.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


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


def _read(spark, bootstrap, topic, isolation):
    df = (spark.read.format("kafka")
          .option("kafka.bootstrap.servers", bootstrap)
          .option("subscribe", topic)
          .option("startingOffsets", "earliest")
          .option("endingOffsets", "latest")
          .option("kafka.isolation.level", isolation)
          .load())
    return [row.value for row in df.selectExpr("CAST(value AS STRING) AS value").collect()]


def test_read_committed_sees_exactly_the_committed_records(spark, kafka_broker, transactional_topic):
    topic, committed, aborted = transactional_topic
    seen = collections.Counter(_read(spark, kafka_broker.bootstrap_servers, topic, "read_committed"))
    assert not [v for v, n in seen.items() if n > 1], "records seen more than once"
    assert set(seen) == set(committed), (
        f"missing: {sorted(set(committed) - set(seen))[:10]}, "
        f"not committed but seen: {sorted(set(seen) - set(committed))[:10]}")


def test_read_uncommitted_also_sees_the_aborted_records(spark, kafka_broker, transactional_topic):
    """The control: the topic really holds aborted records, so the test above
    tells a read_committed read from one that is not."""
    topic, committed, aborted = transactional_topic
    seen = collections.Counter(_read(spark, kafka_broker.bootstrap_servers, topic, "read_uncommitted"))
    assert set(seen) == set(committed) | set(aborted)
