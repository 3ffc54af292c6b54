"""The exactly-once Kafka sink's committer thread, against a fake producer
(no broker): a commit whose librdkafka call never returns (as
send_offsets_to_transaction does while the group coordinator is away,
librdkafka issues 5456 and 5511) fails the task within connect_timeout +
COMMIT_GRACE_S, and neither a failure nor a cancel waits for it."""
from __future__ import annotations

import re
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
    with pytest.raises(errors.KafkaSinkError, match=r"p-0-0.*checkpoint 1.*did not end within"):
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


# ---------------------------------------------------------------- every other wait on the broker
#
# A fake client (``kc._ck`` patched): producers that deliver at once unless
# told otherwise, a marker group with nothing committed. The calls below ran
# on the task's (or the driver's) own thread before, without a bound of their
# own: each is now given up within its deadline, naming topic, step and
# checkpoint, and a cancel ends its wait at once.

ck = pytest.importorskip("confluent_kafka")


class FakeProducer:
    """A transactional producer; ``calls[name]`` says what ``name`` does:
    "block" (until ``release``, whatever its timeout), "never" (flush only:
    nothing is ever delivered, each flush waits its timeout), or an exception
    to raise."""

    def __init__(self, client, conf):
        self.client, self.conf = client, conf
        self.tid = conf.get("transactional.id")

    def _call(self, name):
        what = self.client.calls.get(name)
        if what == "block":
            self.client.blocked.set()
            self.client.release.wait()
        elif isinstance(what, BaseException):
            raise what

    def init_transactions(self, timeout):
        self._call("init_transactions")

    def begin_transaction(self):
        self._call("begin_transaction")

    def produce(self, *a, **kw):
        self._call("produce")
        self.client.produced += 1

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=None):
        if self.client.calls.get("flush") == "never":
            self.client.blocked.set()
            self.client.release.wait(timeout)
            return 1
        self._call("flush")
        return 0

    def send_offsets_to_transaction(self, *a):
        self._call("send_offsets_to_transaction")

    def commit_transaction(self, *a):
        self._call("commit_transaction")
        self.client.committed.append(self.tid)

    def abort_transaction(self, *a):
        pass

    def list_topics(self, topic=None, timeout=None):
        part = types.SimpleNamespace(error=None)
        return types.SimpleNamespace(topics={"out": types.SimpleNamespace(error=None, partitions={0: part})})


class FakeConsumer:
    def __init__(self, conf):
        pass

    def committed(self, tps, timeout=None):
        return [types.SimpleNamespace(offset=-1001)]        # no marker: the records are sent again

    def consumer_group_metadata(self):
        return object()

    def close(self):
        pass


class FakeClient:
    """What ``kc._ck()`` returns in these tests."""

    KafkaException = ck.KafkaException
    KafkaError = ck.KafkaError
    TopicPartition = ck.TopicPartition

    def __init__(self, release, **calls):
        self.release, self.calls = release, calls
        self.blocked = threading.Event()
        self.produced = 0
        self.committed = []

    def Producer(self, conf):  # noqa: N802 - confluent_kafka's name
        return FakeProducer(self, conf)

    def Consumer(self, conf):  # noqa: N802
        return FakeConsumer(conf)


def fake_client(monkeypatch, release, **calls):
    client = FakeClient(release, **calls)
    monkeypatch.setattr(kc, "_ck", lambda: client)
    return client


def in_thread(fn, *args):
    """Run ``fn`` in a daemon thread; (the thread, [its exception or None])."""
    out = []

    def run():
        try:
            fn(*args)
            out.append(None)
        except BaseException as exc:    # noqa: BLE001 - the test looks at it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def ended(t, out, within):
    t.join(within)
    assert not t.is_alive(), f"still waiting after {within} s"
    return out[0]


def eo_sink(connect_timeout, **kw):
    return kc.KafkaSink("127.0.0.1:9", "out", delivery="exactly_once", transactional_id_prefix="p",
                        connect_timeout=connect_timeout, name="sink", **kw)


RESTORED = {"tid": "p-0-1", "group": "p-0-marker", "topic": "out", "id": 7, "values": [b"a", b"b"], "keys": None}


@pytest.mark.parametrize("stuck", ["send_offsets_to_transaction", "commit_transaction"])
def test_the_re_send_of_a_restored_checkpoint_fails_within_its_deadline(monkeypatch, release, stuck):
    """Restore: the subtask opens, then commits the restored checkpoint again
    (its marker is not there: the records are sent again)."""
    monkeypatch.setattr(kc, "COMMIT_GRACE_S", 0.3)
    sink = eo_sink(0.3)
    client = fake_client(monkeypatch, release)
    sink.open(0, 1)
    client.calls[stuck] = "block"
    t, out = in_thread(sink.commit, [RESTORED])
    err = ended(t, out, 30)     # bound 0.6 s; the old call waited forever
    assert client.blocked.is_set()
    assert isinstance(err, errors.KafkaSinkError), err
    assert (err.topic, err.checkpoint_id, err.transactional_id) == ("out", 7, "p-0-1")
    assert stuck in err.step
    assert re.search(r"'out'.*'p-0-1'.*checkpoint 7.*did not end within.*reachable", str(err)), str(err)
    sink.abort()
    sink.close()


def test_fencing_on_open_fails_within_its_deadline(monkeypatch, release):
    monkeypatch.setattr(kc, "COMMIT_GRACE_S", 0.3)
    sink = eo_sink(0.3)
    client = fake_client(monkeypatch, release, init_transactions="block")
    t, out = in_thread(sink.open, 0, 1)
    err = ended(t, out, 30)
    assert client.blocked.is_set()
    assert isinstance(err, errors.KafkaSinkError), err
    assert "fencing" in err.step and "opening subtask 0" in str(err), err


def test_the_drivers_final_commit_fails_within_its_deadline(monkeypatch, release):
    """The driver commits a finished subtask's last transaction on a fresh
    copy of the sink (``api.run_final_commit``: no ``open``)."""
    from pyflowbuf.connectors import api

    monkeypatch.setattr(kc, "COMMIT_GRACE_S", 0.3)
    client = fake_client(monkeypatch, release, send_offsets_to_transaction="block")
    sink = eo_sink(0.3)
    t, out = in_thread(api.run_final_commit, ["connector", "k", [RESTORED]], sink)
    err = ended(t, out, 30)
    assert client.blocked.is_set()
    assert isinstance(err, errors.KafkaSinkError), err
    assert (err.topic, err.checkpoint_id, err.step) == ("out", 7, "its commit marker (send_offsets_to_transaction)")
    assert "final commit is done again by a restore" in str(err)


def test_the_at_least_once_flush_at_a_barrier_fails_without_deliveries(monkeypatch, release):
    """At least once, the barrier's flush waited for transaction_timeout
    (300 s) while nothing was delivered: now connect_timeout without any."""
    fake_client(monkeypatch, release, flush="never")
    sink = kc.KafkaSink("127.0.0.1:9", "out", delivery="at_least_once", connect_timeout=0.3, name="sink")
    sink.open(0, 1)
    sink.write(["x"])
    t, out = in_thread(sink.prepare_commit, 4)
    err = ended(t, out, 30)
    assert isinstance(err, errors.KafkaSinkError), err
    assert (err.topic, err.checkpoint_id, err.step) == ("out", 4, "flush")
    assert re.search(r"'out'.*checkpoint 4.*1 records not delivered, none for 0.3 s", str(err)), str(err)


def test_a_full_queue_without_deliveries_fails_the_write(monkeypatch, release):
    client = fake_client(monkeypatch, release, produce=BufferError("queue full"))
    sink = kc.KafkaSink("127.0.0.1:9", "out", delivery="at_least_once", connect_timeout=0.3, name="sink")
    sink.open(0, 1)
    t, out = in_thread(sink.write, ["x"])
    err = ended(t, out, 30)
    assert isinstance(err, errors.KafkaSinkError) and "queue stayed full for 0.3 s" in str(err), err
    assert client.produced == 0


@pytest.mark.parametrize("where", ["restore", "barrier", "at_least_once"])
def test_a_cancel_ends_a_wait_on_a_stuck_broker_at_once(monkeypatch, release, where):
    """(connect_timeout 60 s: the bound alone would take a minute)"""
    if where == "at_least_once":
        fake_client(monkeypatch, release, flush="never")
        sink = kc.KafkaSink("127.0.0.1:9", "out", delivery="at_least_once", connect_timeout=60, name="sink")
        sink.open(0, 1)
        sink.write(["x"])
        t, out = in_thread(sink.prepare_commit, 4)
    else:
        client = fake_client(monkeypatch, release)
        sink = eo_sink(60)
        sink.open(0, 1)
        client.calls["send_offsets_to_transaction"] = "block"
        if where == "restore":
            t, out = in_thread(sink.commit, [RESTORED])
        else:
            sink.write(["x"])
            sink.commit(sink.prepare_commit(1))
            t, out = in_thread(sink.prepare_commit, 2)
    fb_client = kc._ck()
    assert fb_client.blocked.wait(30)
    t0 = time.monotonic()
    sink._cancel()          # (ConnectorSinkOperator.cancel_connector, from the cancelling thread)
    err = ended(t, out, 30)
    assert isinstance(err, errors.CancelledError), err
    assert time.monotonic() - t0 < kc.CANCEL_WAIT_S + 10
    t0 = time.monotonic()
    sink.abort()
    sink.close()
    assert time.monotonic() - t0 < kc.CANCEL_WAIT_S + 10


# ---------------------------------------------------------------- librdkafka's errors, typed

def kafka_exception(code, fatal=False, retriable=False):
    return ck.KafkaException(ck.KafkaError(code, "from the fake broker", fatal=fatal, retriable=retriable))


def test_a_fenced_producer_at_commit_is_a_typed_error_with_its_cause(monkeypatch, release):
    client = fake_client(monkeypatch, release)
    sink = eo_sink(5)
    sink.open(0, 1)
    sink.write(["x"])
    cause = kafka_exception(ck.KafkaError._FENCED, fatal=True)
    client.calls["send_offsets_to_transaction"] = cause
    sink.commit(sink.prepare_commit(1))
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.prepare_commit(2)
    err = info.value
    assert err.__cause__ is cause
    assert (err.topic, err.transactional_id, err.step, err.checkpoint_id) == ("out", "p-0-0", "send_offsets_to_transaction", 1)
    assert (err.error_name, err.fatal, err.retriable) == ("_FENCED", True, False)
    assert re.search(r"_FENCED.*fatal: yes.*same transactional_id_prefix", str(err)), str(err)
    sink.abort()
    sink.close()


@pytest.mark.parametrize("call", ["init_transactions", "begin_transaction", "produce", "send_offsets_to_transaction",
                                  "flush", "commit_transaction"])
def test_a_client_error_of_the_re_send_is_a_typed_error_with_its_cause(monkeypatch, release, call):
    client = fake_client(monkeypatch, release)
    sink = eo_sink(5)
    sink.open(0, 1)
    cause = kafka_exception(ck.KafkaError.NOT_COORDINATOR, retriable=True)
    client.calls[call] = cause
    with pytest.raises(errors.KafkaSinkError) as info:
        sink.commit([dict(RESTORED, tid="p-0-9")])      # (an id open() did not fence)
    err = info.value
    assert err.__cause__ is cause
    assert (err.topic, err.transactional_id, err.checkpoint_id) == ("out", "p-0-9", 7)
    assert (err.error_name, err.fatal, err.retriable) == ("NOT_COORDINATOR", False, True)
    assert call in err.step or call == "produce" and "sending" in err.step
    sink.abort()
    sink.close()


def test_a_fenced_producer_when_writing_is_a_typed_error(monkeypatch, release):
    client = fake_client(monkeypatch, release)
    sink = eo_sink(5)
    sink.open(0, 1)
    client.calls["begin_transaction"] = kafka_exception(ck.KafkaError._FENCED, fatal=True)
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.write(["x"])
    assert info.value.transactional_id == "p-0-0" and info.value.error_name == "_FENCED"
    sink.abort()
    sink.close()
