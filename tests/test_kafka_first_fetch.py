"""read_kafka's reader assigns partitions read from the beginning at their
log start offset, asked for first, not at the logical OFFSET_BEGINNING: a
fresh consumer given a logical offset fetched its first record only after
librdkafka's fixed 500 ms retry of the offset query (measured: 500-1000 ms
between the first record produced and the first fetched, 20-80 ms with the
offsets resolved). Counted, not timed: the offsets handed to
``incremental_assign``. Against the session's ``kafka_broker``."""
from __future__ import annotations

import pytest

from test_kafka import _name, produce

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


class AssignSpy:
    """The reader's consumer, recording every assignment; ``fail_lookup``
    makes the start offset lookup fail as a broker without a leader does."""

    def __init__(self, consumer, fail_lookup=False):
        self._c = consumer
        self.assigned = []
        self.fail_lookup = fail_lookup

    def incremental_assign(self, tps):
        self.assigned += [(tp.topic, tp.partition, tp.offset) for tp in tps]
        return self._c.incremental_assign(tps)

    def offsets_for_times(self, *a, **kw):
        if self.fail_lookup:
            raise ck.KafkaException(ck.KafkaError(ck.KafkaError.NOT_LEADER_FOR_PARTITION))
        return self._c.offsets_for_times(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._c, name)


def _read_all(reader, n):
    got = []
    while len(got) < n:
        pulled = reader.poll(1000)
        assert pulled is not None
        got += pulled
    return got


def _topic_with_a_truncated_partition(kafka_broker):
    """Partition 0 holds v0..v9 from offset 0; partition 1 held w0..w9 and
    its first 4 were deleted: its log starts at offset 4."""
    bs = kafka_broker.bootstrap_servers
    src = _name("first-fetch")
    kafka_broker.create_topic(src, partitions=2)
    p = ck.Producer({"bootstrap.servers": bs})
    for i in range(10):
        p.produce(src, f"v{i}".encode(), partition=0)
        p.produce(src, f"w{i}".encode(), partition=1)
    assert p.flush(30) == 0
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bs})
    fut = admin.delete_records([ck.TopicPartition(src, 1, 4)], request_timeout=30)
    for f in fut.values():
        f.result(30)
    return bs, src


def _from_the_beginning(kafka_broker, **spy_kw):
    """Both partitions of a truncated topic read from the beginning by one
    reader: what it assigned, and every record it read."""
    from pyflowbuf.connectors.kafka import KafkaSource

    bs, src = _topic_with_a_truncated_partition(kafka_broker)
    reader = KafkaSource(bs, [src], pause_after=None).create_reader(0, 1)
    reader.consumer = spy = AssignSpy(reader.consumer, **spy_kw)
    try:
        reader.add_splits({(src, 0): None, (src, 1): None})
        assigned = sorted(spy.assigned)
        got = _read_all(reader, 16)
    finally:
        reader.consumer = spy._c
        reader.close()
    assert sorted(got) == sorted([f"v{i}".encode() for i in range(10)] + [f"w{i}".encode() for i in range(4, 10)])
    return src, assigned


def test_partitions_read_from_the_beginning_are_assigned_at_their_log_start(kafka_broker):
    src, assigned = _from_the_beginning(kafka_broker)
    # explicit offsets, none logical (negative): no offset query, no 500 ms retry
    assert assigned == [(src, 0, 0), (src, 1, 4)]


def test_a_failed_start_offset_lookup_keeps_the_logical_beginning(kafka_broker):
    """The broker not answering the lookup (no leader yet): the logical
    offset is assigned, and the reader still reads from the log start."""
    src, assigned = _from_the_beginning(kafka_broker, fail_lookup=True)
    assert assigned == [(src, 0, ck.OFFSET_BEGINNING), (src, 1, ck.OFFSET_BEGINNING)]


def test_restored_and_explicit_offsets_are_assigned_as_they_are(kafka_broker):
    """Only the beginning is looked up: a position from a checkpoint (or
    given explicitly) is assigned unchanged."""
    from pyflowbuf.connectors.kafka import KafkaSource

    bs = kafka_broker.bootstrap_servers
    src = _name("first-fetch")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [f"v{i}" for i in range(20)], 2)
    reader = KafkaSource(bs, [src], pause_after=None).create_reader(0, 1)
    reader.consumer = spy = AssignSpy(reader.consumer, fail_lookup=True)     # a lookup would fail the test
    try:
        reader.add_splits({(src, 0): [3, None], (src, 1): [7, None]})
        assert sorted(spy.assigned) == [(src, 0, 3), (src, 1, 7)]
    finally:
        reader.consumer = spy._c
        reader.close()
