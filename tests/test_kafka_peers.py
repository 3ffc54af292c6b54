"""The Kafka benchmark's measuring tools (benchmarks/kafka_peers.py): what
they count is what was written, and a latency they cannot see is never
reported as a low figure. Spark's run is left to the benchmark (minutes)."""
import importlib.util
import math
import os
import time
import uuid

import pytest

confluent_kafka = pytest.importorskip("confluent_kafka")

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "kafka_peers.py")
_spec = importlib.util.spec_from_file_location("kafka_peers", _PATH)
kafka_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kafka_peers)


def test_values_round_trip():
    assert kafka_peers.parse_value(kafka_peers.encode_value("k7", 42, 1_700_000_000_123_456_789)) == \
        ("k7", 42, 1_700_000_000_123_456_789)


def test_output_check_catches_a_lost_a_duplicated_and_a_wrong_count():
    good = [kafka_peers.encode_value(k, c, 0) for k in ("a", "b") for c in (1, 2, 3)]
    assert kafka_peers.check_keyed_count_output(good, 6) == {"keys": 2}
    with pytest.raises(AssertionError, match="5 output records for 6"):
        kafka_peers.check_keyed_count_output(good[:-1], 6)
    with pytest.raises(AssertionError, match="key 'a'"):
        kafka_peers.check_keyed_count_output(good[:2] + good[1:2] + good[3:], 6)       # a: 1, 2, 2
    with pytest.raises(AssertionError, match="key 'b'"):
        kafka_peers.check_keyed_count_output(good[:3] + [kafka_peers.encode_value("b", c, 0) for c in (1, 2, 4)], 6)


def test_latency_percentiles_count_unseen_records_as_late():
    probe = kafka_peers.LatencyProbe("127.0.0.1:1", "unused")
    probe._samples = [(100 + i, (i + 1) * 1_000_000) for i in range(100)]      # 1..100 ms
    seen = probe.percentiles(since_ns=100)
    assert (seen["records"], seen["p50_ms"], seen["p99_ms"], seen["max_ms"]) == (100, 51.0, 100.0, 100.0)
    assert probe.percentiles(since_ns=150)["records"] == 50
    assert probe.count_since(150) == 50 and probe.count_since(150) == 50 and probe.count_since(0) == 100
    # 10 of 110 expected records never came: p99 lies among them
    late = probe.percentiles(since_ns=100, expected=110)
    assert late["p50_ms"] == 56.0 and math.isnan(late["p99_ms"]) and math.isnan(late["max_ms"])
    probe._samples += [(10, 1), (160, 1)]         # arrivals after a count: counted once, by their stamp
    assert probe.count_since(150) == 51 and probe.count_since(0) == 102


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_produce_and_bare_consume_count_every_record(kafka_broker):
    bootstrap, topic = kafka_broker.bootstrap_servers, f"peers-{uuid.uuid4().hex[:8]}"
    produced = kafka_peers.produce_topic(bootstrap, topic, 5_000, 3, keys=10)
    assert produced["records"] == 5_000
    consumed = kafka_peers.bare_client_consume_rate(bootstrap, topic, num_messages=700)
    assert consumed["records"] == 5_000 and consumed["bytes"] > 0
    values = kafka_peers.read_all(bootstrap, topic)
    assert sorted(kafka_peers.parse_value(v)[1] for v in values) == list(range(5_000))
    assert {kafka_peers.parse_value(v)[0] for v in values} == {f"k{k}" for k in range(10)}


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_paced_records_are_all_seen_by_the_probe(kafka_broker):
    """Records written straight into the probed topic: every one is seen,
    with a latency of the producer and the broker alone."""
    bootstrap, topic = kafka_broker.bootstrap_servers, f"peers-lat-{uuid.uuid4().hex[:8]}"
    kafka_peers.create_topic(bootstrap, topic, 2)
    probe = kafka_peers.LatencyProbe(bootstrap, topic).start()
    try:
        sent = kafka_peers.paced_produce(bootstrap, topic, rate=2_000, seconds=1.0, keys=5)
        assert sent["records"] == 2_000
        assert probe.wait_for(lambda p: p.count_since(sent["start_ns"]) >= 2_000, timeout=60)
    finally:
        probe.stop()
    pct = probe.percentiles(since_ns=sent["start_ns"], expected=2_000)
    assert pct["records"] == 2_000 and 0 < pct["p50_ms"] <= pct["p99_ms"] < 60_000


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_latency_run_in_its_own_process_sees_every_record(kafka_broker):
    """latency_in_subprocess (the producer and the probe apart from the job
    measured) over a topic that is its own output: every record after the
    warm-up is seen, and the child's figures come back."""
    bootstrap, topic = kafka_broker.bootstrap_servers, f"peers-sub-{uuid.uuid4().hex[:8]}"
    kafka_peers.create_topic(bootstrap, topic, 2)
    got = kafka_peers.latency_in_subprocess(bootstrap, topic, topic, rate=2_000, seconds=1.0, warmup_s=0.5, keys=5)
    assert got["all_seen"] and got["records"] == 2_000 and got["records_sent"] == 3_000
    assert 0 < got["p50_ms"] <= got["p99_ms"] < 60_000


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_latency_run_at_a_rate_with_a_fractional_warm_up_count_waits_for_no_record_never_sent(kafka_broker):
    """At 1999.7 records/s the warm-up of 0.5 s holds 999.85 records: the
    records after it are counted by the producer, so the probe sees every
    one it waits for (estimated from the rate, it waited for one more, a
    minute, and reported the run as not all seen)."""
    bootstrap, topic = kafka_broker.bootstrap_servers, f"peers-frac-{uuid.uuid4().hex[:8]}"
    kafka_peers.create_topic(bootstrap, topic, 2)
    t0 = time.monotonic()
    got = kafka_peers.latency_in_subprocess(bootstrap, topic, topic, rate=1999.7, seconds=1.0, warmup_s=0.5, keys=5)
    assert got["all_seen"] and got["records"] == got["records_after_mark"], got
    assert 1990 <= got["records"] <= 2010 and got["records_sent"] == int(1999.7 * 1.5), got
    assert time.monotonic() - t0 < 50, "the probe waited out its drain time"
