"""The local Kafka broker that the Kafka tests and the demo run against is a
real one: transactions are honoured by ``read_committed`` consumers (what no
mock broker does), its log survives a restart, and a failed start says why."""
import os
import uuid

import pytest

from pyflowbuf.connectors import kafka_broker as kb
from pyflowbuf.errors import KafkaBrokerError

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _topic(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _read_all(bootstrap, topic, partitions, isolation="read_committed"):
    """Every record of ``topic`` up to the end of each partition, as ints."""
    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": _topic("g"), "isolation.level": isolation,
                     "enable.partition.eof": True, "enable.auto.commit": False})
    c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(partitions)])
    got, ended = [], set()
    try:
        for _ in range(1000):         # bounded: a partition's end arrives within a few polls
            for m in c.consume(1000, 1.0):
                if m.error() is None:
                    got.append(int(m.value()))
                elif m.error().code() == ck.KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
                else:
                    raise AssertionError(m.error())
            if len(ended) == partitions:
                return got
        raise AssertionError(f"partitions {set(range(partitions)) - ended} never reached their end")
    finally:
        c.close()


def test_read_committed_sees_committed_transactions_only(kafka_broker):
    topic = _topic("tx")
    kafka_broker.create_topic(topic, partitions=2)
    p = ck.Producer({"bootstrap.servers": kafka_broker.bootstrap_servers, "transactional.id": _topic("t")})
    p.init_transactions(30)
    p.begin_transaction()
    for i in range(500):
        p.produce(topic, str(i).encode(), partition=i % 2)
    assert p.flush(30) == 0      # in the broker's log, not only in the client's queue
    p.abort_transaction()
    p.begin_transaction()
    for i in range(500, 600):
        p.produce(topic, str(i).encode(), partition=i % 2)
    p.commit_transaction()
    assert sorted(_read_all(kafka_broker.bootstrap_servers, topic, 2)) == list(range(500, 600))
    # the aborted records are in the log all the same: read_uncommitted sees them
    assert len(_read_all(kafka_broker.bootstrap_servers, topic, 2, "read_uncommitted")) == 600


def test_records_survive_a_restart_of_a_broker_with_its_log_on_disk(tmp_path):
    with kb.LocalKafkaBroker(tmp_path / "broker") as broker:
        topic = _topic("durable")
        broker.create_topic(topic, partitions=3)
        p = ck.Producer({"bootstrap.servers": broker.bootstrap_servers, "acks": "all"})
        for i in range(300):
            p.produce(topic, str(i).encode(), partition=i % 3)
        assert p.flush(30) == 0
        broker.restart()
        assert broker.running
        assert sorted(_read_all(broker.bootstrap_servers, topic, 3)) == list(range(300))
    assert not broker.running
    assert os.path.exists(tmp_path / "broker" / "log")       # a given folder is kept


def test_a_temporary_folder_is_removed_and_the_jvm_gone_after_close():
    broker = kb.LocalKafkaBroker()
    folder, proc = broker.data_dir, broker._proc
    broker.close()
    assert proc.poll() is not None
    assert not os.path.exists(folder)


def test_no_jars_is_a_clear_error_naming_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PYFLOWBUF_KAFKA_LIBS", str(tmp_path / "empty"))
    monkeypatch.delenv("KAFKA_HOME", raising=False)
    with pytest.raises(KafkaBrokerError, match="kafka_broker install"):
        kb.LocalKafkaBroker()


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="port"):
        kb.LocalKafkaBroker(port=-1)
    with pytest.raises(ValueError, match="seconds"):
        kb.LocalKafkaBroker(start_timeout=0)


def test_a_bad_setting_is_refused_naming_it(tmp_path):
    with pytest.raises(KafkaBrokerError, match="num.partitions"):
        kb.LocalKafkaBroker(tmp_path / "b", properties={"num.partitions": "not-a-number"})


def test_a_broker_that_exits_while_starting_says_so_with_its_log(tmp_path):
    import socket

    with socket.socket() as taken:        # its port is held by another listener
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(KafkaBrokerError, match="exited .* while starting"):
            kb.LocalKafkaBroker(tmp_path / "b", port=taken.getsockname()[1])
