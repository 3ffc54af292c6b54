"""The exactly-once Kafka sink's committer thread, against a fake producer
(no broker): a commit whose librdkafka call never returns (as
send_offsets_to_transaction does while the group coordinator is away,
librdkafka issues 5456 and 5511) fails the task within connect_timeout +
COMMIT_GRACE_S, and neither a failure nor a cancel waits for it."""
from __future__ import annotations

import threading
import time
import types

import pytest

from pyflowbuf import errors
from pyflowbuf.connectors import kafka as kc


class StuckProducer:
    """Delivers at once; its ``stuck`` call blocks until ``release`` is set,
    whatever timeout it is given."""

    def __init__(self, stuck, release):
        self.stuck, self.release = stuck, release
        self.committed = False

    def flush(self, timeout=None):
        return 0

    def _block(self, *a):
        self.release.wait()

    def send_offsets_to_transaction(self, *a):
        if self.stuck == "send_offsets_to_transaction":
            self._block()

    def commit_transaction(self, *a):
        if self.stuck == "commit_transaction":
            self._block()
        self.committed = True

    def abort_transaction(self, *a):
        pass


def stuck_sink(stuck, release, connect_timeout):
    """A subtask's sink as ``open`` leaves it, one transaction prepared."""
    sink = kc.KafkaSink("127.0.0.1:9", "out", delivery="exactly_once", transactional_id_prefix="p",
                        connect_timeout=connect_timeout)
    sink.ck = types.SimpleNamespace(KafkaException=RuntimeError, TopicPartition=lambda *a: a)
    sink.subtask, sink.base, sink.group = 0, "p-0", "p-0-marker"
    sink._errors, sink._lock, sink._metas = [], threading.Lock(), {"p-0-marker": object()}
    sink.values, sink.keys, sink.current, sink.last_id = [], None, None, 1
    sink.producers = {"p-0-0": StuckProducer(stuck, release)}
    sink.prepared = {1: "p-0-0"}
    sink._committer = kc.Committer("kafka-commit-test")
    return sink


COMMITTABLE = {"tid": "p-0-0", "group": "p-0-marker", "topic": "out", "id": 1, "values": [b"v"], "keys": None}


@pytest.fixture
def release():
    ev = threading.Event()
    yield ev
    ev.set()        # the stuck thread ends with the test


@pytest.mark.parametrize("stuck", ["send_offsets_to_transaction", "commit_transaction"])
def test_a_stuck_commit_fails_the_next_barrier_within_the_bound(monkeypatch, release, stuck):
    monkeypatch.setattr(kc, "COMMIT_GRACE_S", 0.3)
    sink = stuck_sink(stuck, release, connect_timeout=0.3)
    sink.commit([COMMITTABLE])
    t0 = time.monotonic()
    with pytest.raises(errors.KafkaSinkError, match=r"checkpoint 1 \(p-0-0\).*did not end in time"):
        sink.prepare_commit(2)
    # bound 0.6 s; a loaded machine gets slack, the old wait had none (forever)
    assert time.monotonic() - t0 < 10
    # the task fails: abort (and close) no longer wait for the stuck thread
    t0 = time.monotonic()
    sink.abort()
    sink.close()
    assert time.monotonic() - t0 < 1


def test_a_cancel_gives_up_on_a_stuck_commit_within_the_bound(monkeypatch, release):
    monkeypatch.setattr(kc, "COMMIT_GRACE_S", 0.3)
    sink = stuck_sink("send_offsets_to_transaction", release, connect_timeout=0.3)
    sink.commit([COMMITTABLE])
    t0 = time.monotonic()
    sink.abort()        # a cancel right after the checkpoint completed
    assert time.monotonic() - t0 < 10
    sink.close()        # aborted: the given-up commit is not raised (the restore re-does it)


def test_a_commit_that_ends_is_waited_for_by_a_cancel(release):
    """The commit of a completed checkpoint still happens on a cancel when the
    broker answers: the records are there afterwards."""
    release.set()
    sink = stuck_sink(None, release, connect_timeout=0.3)
    sink.commit([COMMITTABLE])
    sink.abort()
    assert sink.producers["p-0-0"].committed
