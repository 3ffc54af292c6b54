"""read_kafka and write_kafka against a real broker (the session's
``kafka_broker``): round trips, bounded reads, exactly once through failures
(also between a checkpoint's completion and its transaction's commit),
rescaling through savepoints, per-partition watermarks, errors."""
from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import random
import re
import time
import uuid

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors import kafka as kc
from pipeline_helpers import cancel_and_join, wait_for

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(bs, topic, values, partitions, *, transactional=False, timestamps=None):
    """``values`` (str) round-robin over ``partitions`` (or at ``(partition,
    value)`` pairs), flushed."""
    conf = {"bootstrap.servers": bs}
    if transactional:
        conf["transactional.id"] = _name("t")
    p = ck.Producer(conf)
    if transactional:
        p.init_transactions(30)
        p.begin_transaction()
    for i, v in enumerate(values):
        part, v = v if isinstance(v, tuple) else (i % partitions, v)
        kw = {} if timestamps is None else {"timestamp": int(timestamps[i] * 1000)}
        p.produce(topic, v if isinstance(v, bytes) else str(v).encode(), partition=part, **kw)
    assert p.flush(30) == 0
    if transactional:
        p.commit_transaction(30)


def read_committed(bs, topic, partitions):
    """Every committed record of ``topic`` (values, decoded), up to each
    partition's end."""
    c = ck.Consumer({"bootstrap.servers": bs, "group.id": _name("g"), "isolation.level": "read_committed",
                     "enable.partition.eof": True, "enable.auto.commit": False})
    c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(partitions)])
    got, ended = [], set()
    try:
        deadline = time.monotonic() + 60
        while len(ended) < partitions:
            assert time.monotonic() < deadline, "the output topic's partitions never reached their end"
            for m in c.consume(1000, 0.5):
                if m.error() is None:
                    got.append(m.value().decode())
                elif m.error().code() == ck.KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
    finally:
        c.close()
    return got


def env_with(tmp_path, **kw):
    kw.setdefault("checkpoint_interval", 0.1)
    return fb.Environment(checkpoint_dir=str(tmp_path / "chk"), **kw)


# ---------------------------------------------------------------- round trips

def test_round_trip_with_keys_headers_and_timestamps(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=3)
    kafka_broker.create_topic(out, partitions=2)
    produce(bs, src, [json.dumps({"n": i}) for i in range(3000)], 3, timestamps=[1000.0 + i for i in range(3000)])
    env = env_with(tmp_path, parallelism=2)
    recs = env.read_kafka(src, bootstrap_servers=bs, value_format="json", bounded=True,
                          include=("timestamp", "partition", "offset"))
    seen = recs.collect()
    recs.map(lambda r: {"n": r["value"]["n"], "t": r["timestamp"]}).write_kafka(
        out, bootstrap_servers=bs, key=lambda r: str(r["n"] % 5), value_format="json", delivery="exactly_once")
    env.execute()
    got = [json.loads(v) for v in read_committed(bs, out, 2)]
    assert sorted(r["n"] for r in got) == list(range(3000))
    assert all(r["t"] == 1000.0 + r["n"] for r in got)
    rows = seen.result
    assert {(r["partition"], r["offset"]) for r in rows} == {(p, o) for p in range(3) for o in range(1000)}


def test_at_least_once_round_trip_of_str(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=2)
    kafka_broker.create_topic(out, partitions=1)
    produce(bs, src, [f"w{i}" for i in range(2000)], 2)
    env = env_with(tmp_path)
    env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).map(str.upper).write_kafka(
        out, bootstrap_servers=bs, delivery="at_least_once")
    env.execute()
    assert sorted(read_committed(bs, out, 1)) == sorted(f"W{i}" for i in range(2000))


def test_bounded_read_ends_on_the_end_of_partition_signal_past_transaction_markers(kafka_broker, tmp_path):
    """A transactional producer leaves control records: the log end offset is
    past the last data record, and a read waiting for a record at end - 1
    would never end. Records written after the start are not read."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [str(i) for i in range(500)], 2, transactional=True)
    env = env_with(tmp_path)
    res = env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).collect()
    job = env.execute_async()
    wait_for(lambda: job.done or sum(map(len, res._parts.values())) >= 500, "the first 500 records", job=job)
    produce(bs, src, [str(i) for i in range(500, 600)], 2)       # after the start: not read
    job.join(120)
    assert sorted(map(int, res.result)) == list(range(500))


def test_starting_offsets_latest_timestamp_and_explicit(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=1)
    # (librdkafka reads a timestamp of 0 as "now")
    produce(bs, src, [str(i) for i in range(100)], 1, timestamps=[1000.0 + i for i in range(100)])

    def run(**kw):
        env = fb.Environment()
        res = env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True, **kw).collect()
        env.execute()
        return list(map(int, res.result))

    assert run(starting_offsets=1060.0) == list(range(60, 100))
    assert run(starting_offsets={(src, 0): 95}) == list(range(95, 100))
    assert run(starting_offsets={src: {0: 98}}) == [98, 99]
    assert run(starting_offsets="latest") == []
    # an aware datetime is its instant; explicit offsets name a partition that exists
    assert run(starting_offsets=datetime.datetime.fromtimestamp(1090.0, datetime.timezone.utc)) == list(range(90, 100))
    with fails_with(errors.ConfigurationError, r"partition\(s\) \[3\] of topic .* has partitions 0\.\.0"):
        run(starting_offsets={(src, 3): 0})


def test_a_bounded_read_with_more_subtasks_than_partitions(kafka_broker, tmp_path):
    """Subtasks that own no partition end at once; with threads they share
    the source object, and the first to end closed the metadata client the
    others were still asking ("Handle has been closed")."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [str(i) for i in range(200)], 2)
    for p in (3, 4, 6):
        env = fb.Environment(parallelism=p)
        res = env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).collect()
        env.execute()
        assert sorted(map(int, res.result)) == list(range(200)), p


def test_a_value_json_cannot_write_is_a_typed_error(kafka_broker):
    out = _name("out")
    kafka_broker.create_topic(out, partitions=1)
    env = fb.Environment()
    env.from_collection([{"a": 1}, {"b": {2, 3}}], kind="pickle").write_kafka(
        out, bootstrap_servers=kafka_broker.bootstrap_servers, value_format="json", delivery="at_least_once")
    with fails_with(errors.RecordTypeError, r"value_format='json' cannot write the record \{'b': \{2, 3\}\}"):
        env.execute()


# ---------------------------------------------------------------- exactly once through failures

class FailOnce:
    """A marker file makes it once over all attempts and processes."""

    def __init__(self, marker):
        self.marker = str(marker)

    def now(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


class FailingMap:
    def __init__(self, once, at):
        self.once, self.at, self.calls = once, at, 0

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.at and self.once.now():
            raise RuntimeError("injected failure in the map")
        return x


class CommitFailingSink(kc.KafkaSink):
    """Fails once, in the commit of the first checkpoint that has records:
    ``before`` the transaction's commit (the checkpoint is complete, its
    transaction is not) or ``after`` it (committed, not yet forgotten)."""

    def __init__(self, *a, once, when, **kw):
        super().__init__(*a, **kw)
        self.once, self.when = once, when

    def _commit_live(self, c, committer=None):
        if self.when == "before" and self.once.now():
            raise RuntimeError("injected failure between the checkpoint's completion and the commit")
        super()._commit_live(c, committer)
        if self.when == "after" and self.once.now():
            raise RuntimeError("injected failure right after the commit")


def count_job(env, bs, src, out, *, fault, seed, tmp_path, prefix):
    rnd = random.Random(seed)
    once = FailOnce(tmp_path / "failed")
    words = env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).uid("in")
    # slow enough that checkpoints with records complete while it runs
    words = words.map(lambda w: time.sleep(0.0008) or w)
    if fault == "map":
        words = words.map(FailingMap(once, rnd.randint(1, 3000)))
    counted = words.map(lambda w: (w, 1)).key_by(lambda kv: kv[0]).reduce(
        lambda a, b: (a[0], a[1] + b[1])).uid("counts")
    if fault in ("before", "after"):
        sink = CommitFailingSink(bs, out, key=lambda kv: kv[0], value_format="json", delivery="exactly_once",
                                 transactional_id_prefix=prefix, once=once, when=fault)
        counted.sink_to(sink, name="out").uid("out")
    else:
        counted.write_kafka(out, bootstrap_servers=bs, key=lambda kv: kv[0], value_format="json",
                            delivery="exactly_once", transactional_id_prefix=prefix).uid("out")
    return once


@pytest.mark.parametrize("workers,fault", [(None, "map"), (None, "before"), (None, "after"),
                                           (2, "map"), (2, "before")])
def test_exactly_once_keyed_count_through_a_failure(kafka_broker, tmp_path, workers, fault):
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=4)
    kafka_broker.create_topic(out, partitions=3)
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    words = [f"k{rnd.randrange(40)}" for _ in range(6000)]
    produce(bs, src, words, 4)
    kw = {"workers": workers} if workers else {}
    env = env_with(tmp_path, parallelism=2, checkpoint_interval=0.05, restart_attempts=3, **kw)
    once = count_job(env, bs, src, out, fault=fault, seed=seed, tmp_path=tmp_path, prefix=_name("eo"))
    env.execute()
    assert os.path.exists(once.marker), f"the injected failure ({fault}) did not happen (seed {seed})"
    got = collections.Counter(tuple(json.loads(v)) for v in read_committed(bs, out, 3))
    per_key = collections.Counter(words)
    want = collections.Counter((k, c) for k, n in per_key.items() for c in range(1, n + 1))
    assert got == want, (f"seed {seed}: missing {sum((want - got).values())}, "
                         f"duplicated {sum((got - want).values())}")


def test_exactly_once_needs_checkpoints(kafka_broker):
    env = fb.Environment()
    s = env.from_collection(["a"])
    with pytest.raises(errors.ConfigurationError, match="checkpoint"):
        s.write_kafka("t", bootstrap_servers=kafka_broker.bootstrap_servers, delivery="exactly_once")


# ---------------------------------------------------------------- rescale through savepoints

def test_rescale_2_3_1_through_savepoints_with_4_partitions(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src, out = _name("in"), _name("out")
    kafka_broker.create_topic(src, partitions=4)
    kafka_broker.create_topic(out, partitions=2)
    prefix = _name("rs")
    total = 0

    def job(p, bounded):
        env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "chk"),
                             name="rescale")
        (env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=bounded).uid("in")
            .map(lambda v: v).uid("m")
            .write_kafka(out, bootstrap_servers=bs, delivery="exactly_once",
                         transactional_id_prefix=prefix).uid("out"))
        return env

    savepoint = None
    for step, p in enumerate((2, 3)):
        produce(bs, src, [str(i) for i in range(total, total + 3000)], 4)
        total += 3000
        job_ = job(p, False).execute_async(restore_from=savepoint)
        wait_for(lambda: sum(c.get("status") == "completed" for c in job_.checkpoints()) >= 2,
                 "two checkpoints", job=job_)
        savepoint = job_.stop(savepoint=str(tmp_path / f"sp{step}"), timeout=60)
    produce(bs, src, [str(i) for i in range(total, total + 3000)], 4)
    total += 3000
    job(1, True).execute(restore_from=savepoint)
    got = collections.Counter(map(int, read_committed(bs, out, 2)))
    assert got == collections.Counter(range(total))


# ---------------------------------------------------------------- event time per partition

def test_per_partition_watermarks_with_an_out_of_order_and_an_idle_partition(kafka_broker, tmp_path):
    """Partition 0 in order and read first, partition 1 out of order by up to
    9 s, its first 10 records read with partition 0 and the rest written
    after the job has read those, partition 2 idle (no
    records). One watermark per subtask would close the windows on partition
    0's times alone and drop partition 1's records as late; per partition none
    is late, and the idle partition does not hold the windows back."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=3)
    rnd = random.Random(7)
    in_order = list(range(100))
    shuffled = [t for b in range(0, 100, 10) for t in rnd.sample(range(b, b + 10), 10)]
    produce(bs, src, [(0, json.dumps({"p": 0, "t": t})) for t in in_order]
            + [(1, json.dumps({"p": 1, "t": t})) for t in shuffled[:10]], 3)
    env = fb.Environment()
    events = env.read_kafka(src, bootstrap_servers=bs, value_format="json", timestamps=lambda r: r["t"],
                            out_of_orderness=10.0, idle_timeout=8.0)
    counts = (events.key_by(lambda r: 0).window(fb.Tumbling(10))
              .aggregate(fb.Count(), window_function=lambda k, w, n: (w.start, n)).collect())
    job = env.execute_async()
    # let the job read partition 0 and tick its watermark (every 200 ms); on a
    # slow start both partitions come together, which weakens the test but
    # never fails it
    time.sleep(4.0)
    produce(bs, src, [(1, json.dumps({"p": 1, "t": t})) for t in shuffled[10:]], 3)
    # the plain-Python reference: a window fires once the lowest per-partition
    # watermark (highest timestamp - 10) reaches its end; none is late
    wm = min(max(in_order), max(shuffled)) - 10.0
    want = {(float(s), 20) for s in range(0, 100, 10) if s + 10 <= wm}
    starts = {s for s, _ in want}
    try:
        wait_for(lambda: {s for s, _ in counts._parts.get(0, [])} >= starts, "the windows the watermark closed",
                 job=job)
    finally:
        cancel_and_join(job)
    got = set(counts._parts.get(0, []))
    assert got == want


# ---------------------------------------------------------------- errors

@contextlib.contextmanager
def fails_with(kind, pattern):
    """The job fails (JobFailedError) because of a ``kind`` error matching ``pattern``."""
    with pytest.raises(errors.JobFailedError) as info:
        yield
    cause = info.value.__cause__
    assert isinstance(cause, kind), f"the job failed with {cause!r}, not {kind.__name__}"
    assert re.search(pattern, str(cause)), str(cause)


def test_an_unreachable_broker_fails_within_the_timeout_naming_it(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # nothing listens there once closed
    env = fb.Environment()
    env.read_kafka("t", bootstrap_servers=f"127.0.0.1:{port}", connect_timeout=2.0).collect()
    t0 = time.monotonic()
    with fails_with(errors.KafkaConnectionError, f"127.0.0.1:{port}.* within 2 s"):
        env.execute()
    assert time.monotonic() - t0 < 30


def test_a_missing_topic_is_a_clear_error_unless_waiting_is_asked(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    missing = _name("missing")
    env = fb.Environment()
    env.read_kafka(missing, bootstrap_servers=bs, connect_timeout=2.0).collect()
    with fails_with(errors.KafkaTopicError, f"{missing}.*wait_for_topics=True"):
        env.execute()
    env = fb.Environment()
    res = env.read_kafka(missing, bootstrap_servers=bs, value_format="str", wait_for_topics=True,
                         discovery_interval=0.2).collect()
    job = env.execute_async()
    kafka_broker.create_topic(missing, partitions=1)
    produce(bs, missing, ["late"], 1)
    try:
        wait_for(lambda: res._parts.get(0) == ["late"], "the topic created while waiting", job=job)
    finally:
        cancel_and_join(job)


def test_an_undecodable_record_names_topic_partition_and_offset_or_goes_to_dead_letters(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=1)
    produce(bs, src, ['{"a": 1}', "not json", '{"a": 2}'], 1)
    env = fb.Environment()
    env.read_kafka(src, bootstrap_servers=bs, value_format="json", bounded=True).collect()
    with fails_with(errors.KafkaDecodeError, rf"{src}/0 offset 1 is not json"):
        env.execute()
    env = fb.Environment()
    good = env.read_kafka(src, bootstrap_servers=bs, value_format="json", bounded=True, dead_letter=True)
    ok = good.collect()
    dead = good.dead_letters().collect()
    env.execute()
    assert ok.result == [{"a": 1}, {"a": 2}]
    [d] = dead.result
    assert (d["topic"], d["partition"], d["offset"], d["value"]) == (src, 0, 1, b"not json")


def test_write_to_a_missing_topic_is_a_clear_error(kafka_broker):
    env = fb.Environment()
    missing = _name("nope")
    env.from_collection(["a"]).write_kafka(missing, bootstrap_servers=kafka_broker.bootstrap_servers,
                                           connect_timeout=2.0)
    with fails_with(errors.KafkaTopicError, missing):
        env.execute()


def test_bad_arguments_are_refused_where_declared():
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="topics .* or pattern"):
        env.read_kafka(bootstrap_servers="x:1")
    with pytest.raises(errors.ConfigurationError, match="value_format"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="xml")
    with pytest.raises(errors.ConfigurationError, match="starting_offsets"):
        env.read_kafka("t", bootstrap_servers="x:1", starting_offsets="yesterday")
    # wrong units and wrong shapes of starting_offsets
    with pytest.raises(errors.ConfigurationError, match=r"looks like milliseconds: pass seconds \(1700000000\.0\)"):
        env.read_kafka("t", bootstrap_servers="x:1", starting_offsets=1_700_000_000_000)
    with pytest.raises(errors.ConfigurationError, match="has no time zone"):
        env.read_kafka("t", bootstrap_servers="x:1", starting_offsets=datetime.datetime(2024, 1, 1))
    for bad in ({("t", 0): -1}, {("t", -1): 0}, {"t": 5}, {("t", 0, 1): 0}, float("nan"), -1.0):
        with pytest.raises(errors.ConfigurationError, match="starting_offsets"):
            env.read_kafka("t", bootstrap_servers="x:1", starting_offsets=bad)
    with pytest.raises(errors.ConfigurationError, match="names topic 'u', which this source does not read"):
        env.read_kafka("t", bootstrap_servers="x:1", starting_offsets={("u", 0): 0})
    with pytest.raises(errors.ConfigurationError, match="delivery"):
        env.from_collection(["a"]).write_kafka("t", bootstrap_servers="x:1", delivery="twice")


def test_partitions_are_dealt_out_by_the_formula_and_every_one_owned_once():
    for p in (1, 2, 3, 5):
        owners = collections.Counter(kc.flink_owner("topic-a", i, p) for i in range(12))
        assert sum(owners.values()) == 12 and max(owners.values()) - min(owners.values()) <= 1


def test_an_out_of_order_partition_read_behind_another_loses_nothing(kafka_broker, tmp_path):
    """Partition 0 is read to its end while partition 1 has given only its
    first 10 records: a watermark per subtask (its highest timestamp) would
    close windows up to 80 s on partition 0's times and drop the rest of
    partition 1 as late; per partition the lowest, partition 1's, holds them."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    rnd = random.Random(3)
    shuffled = [t for b in range(0, 100, 10) for t in rnd.sample(range(b, b + 10), 10)]
    produce(bs, src, [(0, json.dumps({"t": t})) for t in range(100)]
            + [(1, json.dumps({"t": t})) for t in shuffled[:10]], 2)
    env = fb.Environment()
    events = env.read_kafka(src, bootstrap_servers=bs, value_format="json", timestamps=lambda r: r["t"],
                            out_of_orderness=10.0)
    counts = (events.key_by(lambda r: 0).window(fb.Tumbling(10))
              .aggregate(fb.Count(), window_function=lambda k, w, n: (w.start, n)).collect())
    job = env.execute_async()
    time.sleep(4.0)     # the first records read and watermarks ticked (a slow start weakens, never fails, this)
    produce(bs, src, [(1, json.dumps({"t": t})) for t in shuffled[10:]], 2)
    want = {(float(s), 20) for s in range(0, 80, 10)}
    try:
        wait_for(lambda: {s for s, _ in counts._parts.get(0, [])} >= {s for s, _ in want}, "windows 0-70",
                 job=job)
    finally:
        cancel_and_join(job)
    assert set(counts._parts.get(0, [])) == want


# ---- the default transactional id prefix: the job's name and the sink's uid

def test_two_exactly_once_sinks_with_the_same_name_do_not_collide(kafka_broker, tmp_path):
    """Same name, no prefix given: each sink's transactions are its own
    (named by its uid), so both outputs hold every record exactly once."""
    bs = kafka_broker.bootstrap_servers
    src, out_a, out_b = _name("in"), _name("out-a"), _name("out-b")
    kafka_broker.create_topic(src, partitions=2)
    for t in (out_a, out_b):
        kafka_broker.create_topic(t, partitions=2)
    words = [f"w{i}" for i in range(2000)]
    produce(bs, src, words, 2)
    env = env_with(tmp_path, parallelism=2, checkpoint_interval=0.05, name=_name("job"))
    read = env.read_kafka(src, bootstrap_servers=bs, value_format="str", bounded=True).uid("in")
    slow = read.map(lambda w: time.sleep(0.0005) or w).uid("slow")     # checkpoints complete while it runs
    slow.write_kafka(out_a, bootstrap_servers=bs, delivery="exactly_once").uid("a")
    slow.write_kafka(out_b, bootstrap_servers=bs, delivery="exactly_once").uid("b")
    env.execute()
    for t in (out_a, out_b):
        assert sorted(read_committed(bs, t, 2)) == sorted(words)
    # each sink's commit markers are in groups
    # pyflowbuf-<job>-<checkpoint directory's scope>-<uid>-<subtask>-marker-<writer's token>
    scope = kc.checkpoint_scope(env.checkpoint_config.directory)
    assert re.fullmatch(r"[0-9a-f]{8}", scope)
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bs})

    def marker_groups():
        # (a listing right after the client starts may come back empty)
        listed = [g.group_id for g in admin.list_consumer_groups().result(30).valid]
        return {(uid, s): [g for g in listed if re.fullmatch(rf"pyflowbuf-{env.name}-{scope}-{uid}-{s}-marker-[0-9a-f]+", g)]
                for uid in "ab" for s in range(2)}

    groups = wait_for(lambda: (lambda m: m if all(m.values()) else None)(marker_groups()), "the marker groups")
    for uid, topic in (("a", out_a), ("b", out_b)):
        for s in range(2):
            [group] = groups[uid, s]
            c = ck.Consumer({"bootstrap.servers": bs, "group.id": group, "isolation.level": "read_committed"})
            try:
                assert c.committed([ck.TopicPartition(topic, 0)], timeout=30)[0].offset >= kc.MARKER_BIAS
            finally:
                c.close()


def test_two_sinks_with_the_same_prefix_are_refused(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    env = env_with(tmp_path, name="prefixes")
    words = env.from_collection(["a", "b"])
    # refused before anything runs (the topics do not exist)
    words.write_kafka("x", bootstrap_servers=bs, delivery="exactly_once", transactional_id_prefix="p", name="one")
    words.write_kafka("y", bootstrap_servers=bs, delivery="exactly_once", transactional_id_prefix="p", name="two")
    with pytest.raises(errors.ConfigurationError, match=r"'one' and write_kafka 'two' both have .* prefix 'p'"):
        env.execute()
    # a prefix given that is another sink's default one
    env = env_with(tmp_path, name="prefixes")
    words = env.from_collection(["a", "b"])
    words.write_kafka("x", bootstrap_servers=bs, delivery="exactly_once").uid("out")
    taken = kc.default_prefix("prefixes", "out", kc.checkpoint_scope(env.checkpoint_config.directory))
    assert taken.startswith("pyflowbuf-prefixes-") and taken.endswith("-out")
    words.write_kafka("y", bootstrap_servers=bs, delivery="exactly_once", transactional_id_prefix=taken)
    with pytest.raises(errors.ConfigurationError, match=taken):
        env.plan()
