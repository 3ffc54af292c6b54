"""The settings read_kafka and write_kafka give their clients, against the
session's real broker: the source's fetches wait for a batch (10 ms or
64 KiB) unless ``properties=`` says otherwise; the sink asks for reports of
failed deliveries only, and a record the broker refuses still fails the job
with a typed error naming the topic, in both delivery modes."""
from __future__ import annotations

import uuid

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors import kafka as kc

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _fill(bs, topic, n):
    p = ck.Producer({"bootstrap.servers": bs})
    for i in range(n):
        p.produce(topic, str(i).encode())
    assert p.flush(30) == 0


@pytest.fixture
def client_confs(monkeypatch):
    """The configuration of every Consumer and Producer made meanwhile, in
    order (the real clients are made with it)."""
    seen = {"consumer": [], "producer": []}
    real_consumer, real_producer = ck.Consumer, ck.Producer

    class Consumer(real_consumer):
        def __init__(self, conf, *a, **kw):
            seen["consumer"].append(dict(conf))
            super().__init__(conf, *a, **kw)

    class Producer(real_producer):
        def __init__(self, conf, *a, **kw):
            seen["producer"].append(dict(conf))
            super().__init__(conf, *a, **kw)

    monkeypatch.setattr(ck, "Consumer", Consumer)
    monkeypatch.setattr(ck, "Producer", Producer)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("properties, wait_ms, min_bytes", [
    (None, kc.FETCH_WAIT_MS, kc.FETCH_MIN_BYTES),
    ({"fetch.wait.max.ms": 250, "fetch.min.bytes": 1}, 250, 1),
])
def test_the_source_fetches_in_batches_unless_told_otherwise(kafka_broker, tmp_path, client_confs, properties,
                                                             wait_ms, min_bytes):
    bs, topic = kafka_broker.bootstrap_servers, _name("fetch")
    kafka_broker.create_topic(topic, partitions=2)
    _fill(bs, topic, 300)
    env = fb.Environment()
    got = env.read_kafka(topic, bootstrap_servers=bs, value_format="str", bounded=True,
                         properties=properties).collect()
    env.execute()
    assert sorted(map(int, got.result)) == list(range(300))      # the batching loses nothing
    readers = [c for c in client_confs["consumer"] if c.get("enable.partition.eof")]
    assert readers, client_confs["consumer"]
    for conf in readers:
        assert (conf["fetch.wait.max.ms"], conf["fetch.min.bytes"]) == (wait_ms, min_bytes)
    assert kc.FETCH_WAIT_MS == 10 and kc.FETCH_MIN_BYTES == 64 * 1024


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_only_failed_deliveries_are_reported_and_one_fails_the_job(kafka_broker, tmp_path, client_confs, delivery):
    """A record larger than the topic's ``max.message.bytes`` passes the
    client (its own limit is 1 MB) and is refused by the broker: the only
    report the sink gets is that one, and the job fails with a
    ``KafkaSinkError`` naming the topic instead of going on without it."""
    bs, out = kafka_broker.bootstrap_servers, _name("small")
    kafka_broker.create_topic(out, partitions=1, config={"max.message.bytes": "1024"})
    env = fb.Environment(checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "chk"))
    (env.from_collection(["a" * 10, "b" * 4000, "c" * 10])
        .write_kafka(out, bootstrap_servers=bs, value_format="str", delivery=delivery))
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=120)
    chain = []
    exc = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    sink_errors = [e for e in chain if isinstance(e, errors.KafkaSinkError)]
    assert sink_errors, chain
    msg = str(sink_errors[0])
    assert out in msg and ("MSG_SIZE_TOO_LARGE" in msg.upper().replace(" ", "_") or "too large" in msg.lower()), msg
    producers = [c for c in client_confs["producer"] if c.get("enable.idempotence")]
    assert producers
    for conf in producers:
        assert conf["delivery.report.only.error"] is True and callable(conf["on_delivery"])


@pytest.mark.parametrize("key", ["on_delivery", "dr_cb", "dr_msg_cb"])
def test_a_delivery_callback_in_properties_is_refused(key):
    """The sink's delivery callback is what turns a failed delivery into the
    job's error: one given in ``properties`` would replace it (and lose
    that error), so it is refused when the job is built."""
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match=rf"'{key}' is the sink's own"):
        env.from_collection(["a"]).write_kafka("out", bootstrap_servers="127.0.0.1:9",
                                               properties={key: lambda err, msg: None})
