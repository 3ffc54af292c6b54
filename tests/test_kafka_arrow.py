"""read_kafka(value_format="arrow" | "arrow-json") against a real broker
(the session's ``kafka_broker``): every include field against the
value_format="bytes" read of the same topic, exactly once through a failure,
dead letters and typed errors, write_parquet of the batches."""
from __future__ import annotations

import collections
import json
import os
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pipeline_helpers import cancel_and_join, wait_for
from test_kafka import FailingMap, FailOnce, _name, env_with, fails_with, produce, read_committed

ck = pytest.importorskip("confluent_kafka")
pa = pytest.importorskip("pyarrow")
pytestmark = pytest.mark.kafka

FIELDS = ("key", "headers", "timestamp", "topic", "partition", "offset")


def produce_full(bs, topic, n, partitions):
    """``n`` records with keys (some None), headers (some None), timestamps
    and values (a tombstone among them) over ``partitions``."""
    p = ck.Producer({"bootstrap.servers": bs})
    for i in range(n):
        kw = {}
        if i % 3:
            kw["headers"] = [("h", f"v{i}".encode()), ("n", None if i % 7 == 0 else b"\x00\xff")]
        p.produce(topic, None if i == 5 else json.dumps({"n": i}).encode(), key=None if i % 4 == 0 else f"k{i}",
                  partition=i % partitions, timestamp=1_700_000_000_000 + i, **kw)
    assert p.flush(30) == 0


def test_arrow_batches_hold_what_bytes_records_hold_with_every_include_field(kafka_broker, tmp_path):
    """The differential check: value_format='arrow' and 'bytes' over the same
    topic give the same rows, every include field included."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=3)
    produce_full(bs, src, 3000, 3)
    env = fb.Environment(parallelism=2)
    as_bytes = env.read_kafka(src, bootstrap_servers=bs, bounded=True, include=FIELDS, name="b").collect()
    batches = env.read_kafka(src, bootstrap_servers=bs, value_format="arrow", bounded=True, include=FIELDS,
                             batch_size=700, name="a").collect()
    env.execute()
    assert all(isinstance(b, pa.RecordBatch) and b.num_rows <= 700 for b in batches.result)
    assert batches.result[0].schema.names == ["value", *FIELDS]
    rows = [r for b in batches.result for r in b.to_pylist()]
    want = {}
    for r in as_bytes.result:
        want[(r["partition"], r["offset"])] = (
            r["value"], r["key"], r["headers"] and [{"key": k, "value": v} for k, v in r["headers"]],
            round(r["timestamp"] * 1000), r["topic"])
    got = {(r["partition"], r["offset"]): (r["value"], r["key"], r["headers"],
                                           round(r["timestamp"].timestamp() * 1000), r["topic"]) for r in rows}
    assert len(rows) == len(got) == 3000
    assert got == want
    assert sum(v[0] is None for v in got.values()) == 1          # the tombstone is a null value


def test_arrow_json_parses_values_into_the_schema_and_dead_letters_the_rest(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=1)
    values = []
    for i in range(1000):
        values.append(json.dumps({"n": i, "name": f"x{i}", "extra": [1]}))
    bad = {100: '{"n": "one hundred"}', 200: "not json", 300: '{"n": 1}{"n": 2}', 400: "",
           500: '{"n": 500,\n "name": "multi-line"}', 600: "[1]"}
    for i, v in bad.items():
        values[i] = v
    produce(bs, src, [v.encode() for v in values], 1)
    schema = pa.schema([("n", pa.int64()), ("name", pa.string())])
    env = fb.Environment()
    read = env.read_kafka(src, bootstrap_servers=bs, value_format="arrow-json", schema=schema, bounded=True,
                          include="offset", dead_letter=True)
    ok, dead = read.collect(), read.dead_letters().collect()
    env.execute()
    rows = [r for b in ok.result for r in b.to_pylist()]
    want = [{"n": i, "name": f"x{i}", "offset": i} for i in range(1000) if i not in bad]
    # the multi-line value is one JSON object: it parses, value by value
    want.insert(next(k for k, w in enumerate(want) if w["offset"] > 500), {"n": 500, "name": "multi-line",
                                                                             "offset": 500})
    assert rows == want
    assert sorted((d["offset"], d["value"]) for d in dead.result) == sorted(
        (i, v.encode()) for i, v in bad.items() if i != 500)
    assert all(d["topic"] == src and d["partition"] == 0 for d in dead.result)


def test_arrow_json_of_another_schema_names_topic_partition_and_offset(kafka_broker, tmp_path):
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [(0, '{"n": 1}'), (1, '{"n": 2}'), (1, '{"n": 3.5}')], 2)
    env = fb.Environment()
    env.read_kafka(src, bootstrap_servers=bs, value_format="arrow-json", schema={"n": "int64"},
                   bounded=True).collect()
    with fails_with(errors.KafkaDecodeError, rf"{src}/1 offset 1 is not a JSON object of schema \{{n: int64\}}"):
        env.execute()


def test_arrow_arguments_are_refused_where_declared():
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="needs schema="):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="arrow-json")
    with pytest.raises(errors.ConfigurationError, match="arrow-json"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="arrow", schema={"n": "int64"})
    with pytest.raises(errors.ConfigurationError, match="schema= is for"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="json", schema={"n": "int64"})
    with pytest.raises(errors.ConfigurationError, match="both name a column"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="arrow-json", schema={"offset": "int64"},
                       include="offset")
    with pytest.raises(errors.ConfigurationError, match="timestamps= takes 'kafka'"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="arrow", timestamps=lambda b: 0.0)
    with pytest.raises(errors.ConfigurationError, match="batch_size"):
        env.read_kafka("t", bootstrap_servers="x:1", value_format="arrow", batch_size=0)
    with pytest.raises(errors.ConfigurationError, match="value_format"):
        env.from_collection(["a"]).write_kafka("t", bootstrap_servers="x:1", value_format="arrow")


def test_arrow_batches_go_to_write_parquet(kafka_broker, tmp_path):
    import pyarrow.parquet as pq

    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [json.dumps({"n": i}) for i in range(2000)], 2)
    env = env_with(tmp_path, parallelism=2)
    (env.read_kafka(src, bootstrap_servers=bs, value_format="arrow-json", schema={"n": "int64"}, bounded=True,
                    include=("partition", "offset"))
        .write_parquet(str(tmp_path / "out")))
    env.execute()
    t = pq.read_table(str(tmp_path / "out"))
    assert sorted(t.column("n").to_pylist()) == list(range(2000))
    assert t.schema.field("offset").type == pa.int64()


def _words(batch):
    return [(w, 1) for w in batch.column("value").to_pylist()]


@pytest.mark.parametrize("workers", [None, 2])
def test_arrow_exactly_once_keyed_count_through_a_failure(kafka_broker, tmp_path, workers):
    """Kafka -> Arrow batches -> rows -> keyed count -> Kafka, exactly once,
    with a failure after checkpoints have completed: the restored positions
    cover whole batches, so no row is lost or counted twice."""
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
    once = FailOnce(tmp_path / "failed")
    batches = env.read_kafka(src, bootstrap_servers=bs, value_format="arrow", bounded=True,
                             batch_size=rnd.choice([1, 37, 200])).uid("in")
    # slow enough that checkpoints with records complete before the failure
    counted = (batches.flat_map(lambda b: [(w.decode(), 1) for w in b.column("value").to_pylist()])
               .map(lambda kv: time.sleep(0.0008) or kv)
               .map(FailingMap(once, rnd.randint(500, 2500)))
               .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts"))
    counted.write_kafka(out, bootstrap_servers=bs, key=lambda kv: kv[0], value_format="json",
                        delivery="exactly_once", transactional_id_prefix=_name("eo")).uid("out")
    env.execute()
    assert os.path.exists(once.marker), f"the injected failure did not happen (seed {seed})"
    got = collections.Counter(tuple(json.loads(v)) for v in read_committed(bs, out, 3))
    per_key = collections.Counter(words)
    want = collections.Counter((k, c) for k, n in per_key.items() for c in range(1, n + 1))
    assert got == want, (f"seed {seed}: missing {sum((want - got).values())}, "
                         f"duplicated {sum((got - want).values())}")


def test_arrow_watermarks_per_partition_with_a_partition_read_behind(kafka_broker, tmp_path):
    """As test_kafka's test of the same name, with Arrow batches of one row
    (a batch's time is its earliest row's) and the records' Kafka times:
    partition 0 is read to its end while partition 1 has given its first 10
    records only; one watermark per subtask would close windows on partition
    0's times and drop the rest of partition 1 as late, per partition none is."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    rnd = random.Random(3)
    shuffled = [t for b in range(0, 100, 10) for t in rnd.sample(range(b, b + 10), 10)]
    first = [(0, str(t)) for t in range(100)] + [(1, str(t)) for t in shuffled[:10]]
    # (librdkafka reads a timestamp of 0 as "now": the times start at 1000 s)
    produce(bs, src, first, 2, timestamps=[1000.0 + int(v) for _, v in first])
    env = fb.Environment()
    batches = env.read_kafka(src, bootstrap_servers=bs, value_format="arrow", batch_size=1, timestamps="kafka",
                             out_of_orderness=10.0)
    counts = (batches.key_by(lambda b: 0).window(fb.Tumbling(10))
              .aggregate(fb.Count(), window_function=lambda k, w, n: (w.start, n)).collect())
    job = env.execute_async()
    time.sleep(4.0)     # the first records read and watermarks ticked (a slow start weakens, never fails, this)
    rest = [(1, str(t)) for t in shuffled[10:]]
    produce(bs, src, rest, 2, timestamps=[1000.0 + int(v) for _, v in rest])
    want = {(1000.0 + s, 20) for s in range(0, 80, 10)}
    try:
        wait_for(lambda: {s for s, _ in counts._parts.get(0, [])} >= {s for s, _ in want}, "windows 0-70",
                 job=job)
    finally:
        cancel_and_join(job)
    assert set(counts._parts.get(0, [])) == want


# ---------------------------------------------------------------- arrow-json's parse, no broker

class _Msg:
    def __init__(self, offset, value):
        self._o, self._v = offset, value

    def topic(self):
        return "t"

    def partition(self):
        return 0

    def offset(self):
        return self._o

    def key(self):
        return None

    def value(self):
        return self._v


PIECES = ['{"n": 1}', '{"n": 2, "s": "a", "x": [1]}', '{"s": "b"}', "", "   ", '{"n": 1}{"n": 2}',
          '{"n": 1} {"n": 2}', "not json", '{"n": "one"}', '{"n":\n3}', '{"n": 4}\r{"n": 5}', "[1]", "7",
          '{"n": 1.5}', None]


@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=30))
@settings(max_examples=300, deadline=None)
def test_arrow_json_rows_and_dead_letters_match_parsing_each_value_alone(values):
    """Parsing a pull's values in one call must never misalign rows and
    values (an empty value gives no row, "{}{}" two): the rows and dead
    letters are those of parsing each value alone."""
    import io
    import types

    import pyarrow.json as pj

    from pyflowbuf.connectors.kafka_arrow import ArrowBatches

    schema = pa.schema([("n", pa.int64()), ("s", pa.string())])
    src = types.SimpleNamespace(batch_size=100, value_format="arrow-json", schema=schema, include=(),
                                dead_letter=True, name="r")
    r = types.SimpleNamespace(s=src, dead=[])
    raw = [None if v is None else v.encode() for v in values]
    msgs = [_Msg(i, v) for i, v in enumerate(raw)]
    columns, good = ArrowBatches(src)._parse(r, msgs, raw)
    got = pa.Table.from_arrays(columns, schema=schema).to_pylist() if columns else []
    want, bad = [], []
    for i, v in enumerate(raw):
        try:
            t = pj.read_json(io.BytesIO(v), parse_options=pj.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore", newlines_in_values=True))
            assert t.num_rows == 1
            want.extend(t.to_pylist())
        except Exception:       # noqa: BLE001 - any failure: the value is a dead letter
            bad.append(i)
    assert got == want
    assert [d["offset"] for d in r.dead] == bad
    assert [d["value"] for d in r.dead] == [raw[i] for i in bad]


# ---------------------------------------------------------------- the pull size

def test_an_arrow_pull_holds_at_most_the_rows_asked_for(kafka_broker):
    """A pull asked for n records gives a RecordBatch of at most n rows (the
    bytes path's cap), not up to batch_size whatever was asked."""
    from pyflowbuf.connectors.kafka import KafkaSource

    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=2)
    produce(bs, src, [f"v{i}" for i in range(600)], 2)
    source = KafkaSource(bs, [src], value_format="arrow", bounded=True, pause_after=None)
    reader = source.create_reader(0, 1)
    try:
        reader.add_splits({(src, 0): None, (src, 1): None})
        rnd = random.Random(7)
        got = []
        while True:
            n = rnd.choice([1, 7, 50, 333])
            pulled = reader.poll(n)
            if pulled is None:
                break
            assert len(pulled) <= 1 and all(b.num_rows <= n for b in pulled), (n, [b.num_rows for b in pulled])
            got += [v for b in pulled for v in b.column("value").to_pylist()]
    finally:
        reader.close()
    assert sorted(got) == sorted(f"v{i}".encode() for i in range(600))


def test_an_arrow_source_under_backpressure_pulls_the_runtimes_size(kafka_broker):
    """A slow sink in its own task: every batch the source pulled holds at
    most max_batch rows (the pull size the runtime asks for), not batch_size
    (10,000)."""
    bs = kafka_broker.bootstrap_servers
    src = _name("in")
    kafka_broker.create_topic(src, partitions=1)
    produce(bs, src, [f"v{i}" for i in range(5000)], 1)
    env = fb.Environment(max_batch=64)
    rows = []

    def slow(batches):
        time.sleep(0.002)
        rows.extend(b.num_rows for b in batches)

    (env.read_kafka(src, bootstrap_servers=bs, value_format="arrow", bounded=True)
        .rebalance().sink(slow, batched=True))
    env.execute()
    assert sum(rows) == 5000
    assert max(rows) <= 64, collections.Counter(rows).most_common(5)
