"""write_kafka against a real broker whose answers never come: the waits
that used to have no bound of their own. The broker is the session's
(``kafka_broker``); a call that never returns is a ``send_offsets_to_transaction``
held by the test (librdkafka's own does that while the group coordinator is
away, librdkafka issues 5456 and 5511). The job ends, failing with a typed
error within the sink's deadline, or at once when cancelled."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors import kafka as kc
from pipeline_helpers import wait_for

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Held:
    """``kc._ck()`` with a Producer whose ``send_offsets_to_transaction``
    blocks (until the test ends) when called in a thread whose name
    ``where`` accepts, once ``armed``."""

    def __init__(self, where):
        self.where = where
        self.armed = threading.Event()
        self.blocked = threading.Event()
        self.release = threading.Event()
        held = self

        class Producer(ck.Producer):
            def send_offsets_to_transaction(self, *a):
                if held.armed.is_set() and held.where(threading.current_thread().name):
                    held.blocked.set()
                    held.release.wait()
                return super().send_offsets_to_transaction(*a)

        self.Producer = Producer

    def __getattr__(self, name):
        return getattr(ck, name)


@pytest.fixture
def held(monkeypatch):
    holders = []

    def make(where):
        h = Held(where)
        monkeypatch.setattr(kc, "_ck", lambda: h)
        holders.append(h)
        return h

    yield make
    for h in holders:
        h.release.set()


def produce(bs, topic, values):
    p = ck.Producer({"bootstrap.servers": bs})
    for v in values:
        p.produce(topic, v.encode())
    assert p.flush(30) == 0


def test_a_final_commit_that_never_returns_fails_the_job_within_its_deadline(kafka_broker, tmp_path, held):
    """The driver commits the sink's last transaction once the job has ended;
    its send_offsets_to_transaction never returns. Before, the job never
    ended (or, had the call raised, ended as if it had succeeded)."""
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=1)
    kafka_broker.create_topic(out, partitions=1)
    produce(bs, src, [f"r{i}" for i in range(50)])
    # (the driver: its own committer thread; before, the job watcher thread)
    h = held(lambda thread: not thread.startswith("kafka-commit-") or thread.endswith("-driver"))
    h.armed.set()
    env = fb.Environment(checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "chk"))
    (env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).uid("in")
        .write_kafka(out, bootstrap_servers=bs, value_format="str", delivery="exactly_once", connect_timeout=2,
                     transactional_id_prefix=_name("eo")).uid("out"))
    job = env.execute_async()
    with pytest.raises(errors.JobFailedError) as info:
        job.join(120)           # the bound: 2 s + COMMIT_GRACE_S (5 s)
    assert h.blocked.is_set()
    err = info.value.__cause__
    assert isinstance(err, errors.KafkaSinkError), repr(err)
    assert err.topic == out and err.step == "its commit marker (send_offsets_to_transaction)"
    assert err.checkpoint_id is not None and "final commit" in str(err), str(err)
    assert "'final commit'" in str(info.value)


def test_cancel_ends_a_job_whose_commit_never_returns(kafka_broker, tmp_path, held):
    """connect_timeout=60: the commit's own deadline (65 s) would end it
    too, a minute later; the cancel ends it within CANCEL_WAIT_S."""
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=2)
    kafka_broker.create_topic(out, partitions=2)
    produce(bs, src, [f"r{i}" for i in range(200)])
    h = held(lambda thread: thread.startswith("kafka-commit-"))
    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "chk"))
    (env.read_kafka(src, bootstrap_servers=bs, value_format="str").uid("in")      # unbounded: runs until cancelled
        .write_kafka(out, bootstrap_servers=bs, value_format="str", delivery="exactly_once", connect_timeout=60,
                     transactional_id_prefix=_name("eo")).uid("out"))
    job = env.execute_async()
    try:
        wait_for(lambda: sum(c.get("status") == "completed" for c in job.checkpoints()) >= 2,
                 "two checkpoints", job=job)
        h.armed.set()
        produce(bs, src, ["more"] * 20)         # (a transaction to commit)
        wait_for(h.blocked.is_set, "a commit held", job=job)
        t0 = time.monotonic()
        job.cancel()
        try:
            job.join(120)
        except errors.JobFailedError:
            pass
        took = time.monotonic() - t0
    finally:
        if not job.done:
            job.cancel()
    assert took < 30, f"the cancel took {took:.1f} s"

