"""The Spark adapters' engine without a JVM: run_partition (order, errors,
cancellation, backpressure), the order-keeping envelopes, and the checks of
pipeline output against a declared schema."""
import collections
import gc
import os
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyspark")

from pyflowbuf import errors  # noqa: E402
from pyflowbuf._core.memory import NetworkBufferPool  # noqa: E402
from pyflowbuf._core.channel import BufferQueue  # noqa: E402
from pyflowbuf._core.serde import RecordReader, RecordWriter  # noqa: E402
from pyflowbuf.serializers_arrow import ArrowSerializer  # noqa: E402
from pyflowbuf.spark import (  # noqa: E402
    DEFAULT_ENV, SchemaMismatchError, aggregate_stages, arrow_udf, conform_batch, run_partition, summarize)
from pyflowbuf.spark._ordered import (  # noqa: E402
    OrderedStream, PartitionArrowSerializer, SequencedSerializer, reorder)
from pyflowbuf.spark._schema import check_pandas_frame, resolve_schema  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def batches(n, rows=100, start=0):
    return [pa.record_batch({"id": np.arange(start + k * rows, start + (k + 1) * rows, dtype=np.int64)})
            for k in range(n)]


def first_ids(out):
    return [b.column("id")[0].as_py() for b in out]


def pyflowbuf_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pyflowbuf")]


# ---------------------------------------------------------------- run_partition

def test_order_is_kept_through_parallel_stages():
    rng = random.Random(7)
    delays = [rng.random() * 0.004 for _ in range(60)]

    def jitter(b):
        time.sleep(delays[b.column("id")[0].as_py() // 100])
        return b.append_column("twice", pa.compute.multiply(b.column("id"), 2))

    out = list(run_partition(iter(batches(60)),
                             lambda s: s.map(jitter, parallelism=3, name="jitter").map(lambda b: b, parallelism=2)))
    assert first_ids(out) == [k * 100 for k in range(60)]
    assert out[5].column("twice").to_pylist() == [2 * v for v in range(500, 600)]


def test_filter_and_flat_map_keep_order_in_parallel():
    def split(b):
        return [b.slice(0, 30), b.slice(30)]

    out = list(run_partition(
        iter(batches(40)),
        lambda s: s.filter(lambda b: b.column("id")[0].as_py() % 300 != 0, parallelism=2)
                   .flat_map(split, parallelism=3)
                   .map_batches(lambda b: b, parallelism=2)))
    kept = [k * 100 for k in range(40) if (k * 100) % 300 != 0]
    assert first_ids(out) == [x for k in kept for x in (k, k + 30)]


def test_sequential_pipeline_is_not_enveloped():
    seen = []
    out = list(run_partition(iter(batches(5)), lambda s: s.map(lambda b: seen.append(type(b)) or b)))
    assert first_ids(out) == [0, 100, 200, 300, 400]
    assert set(seen) == {pa.RecordBatch}
    # and with parallelism > 1 the user's functions still see plain batches
    seen.clear()
    list(run_partition(iter(batches(5)), lambda s: s.map(lambda b: seen.append(type(b)) or b, parallelism=2)))
    assert set(seen) == {pa.RecordBatch}


def test_preserve_order_false_gives_the_full_stream_api():
    import pyflowbuf as fb

    got = []

    def build(s):
        assert isinstance(s, fb.Stream)
        return s.map(lambda b: b, parallelism=3).key_by(lambda b: b.num_rows).process(
            lambda k, b, st: [b], kind="arrow")

    for b in run_partition(iter(batches(30)), build, preserve_order=False):
        got.append(b.column("id")[0].as_py())
    assert sorted(got) == [k * 100 for k in range(30)]


def test_build_mistakes_are_clear():
    with pytest.raises(TypeError, match="returned None"):
        list(run_partition(iter(batches(1)), lambda s: None))
    with pytest.raises(AttributeError, match="preserve_order=False"):
        list(run_partition(iter(batches(1)), lambda s: s.key_by(len)))
    with pytest.raises(TypeError, match="map takes a function"):
        list(run_partition(iter(batches(1)), lambda s: s.map(3)))


@pytest.mark.parametrize("parallelism", [1, 3])
def test_operator_failure_raises_job_failed_with_the_operator_and_cause(parallelism):
    def enrich(b):
        if b.column("id")[0].as_py() == 700:
            raise ValueError("bad row 700")
        return b

    with pytest.raises(errors.JobFailedError, match=r"operator 'enrich'.*ValueError: bad row 700"):
        for _ in run_partition(iter(batches(20)), lambda s: s.map(enrich, parallelism=parallelism, name="enrich")):
            pass
    for _ in range(50):
        if not pyflowbuf_threads():
            break
        time.sleep(0.05)
    assert not pyflowbuf_threads()


def test_source_failure_is_reported():
    def spark_iterator():
        yield from batches(3)
        raise OSError("connection to the JVM lost")

    with pytest.raises(errors.JobFailedError, match="connection to the JVM lost"):
        list(run_partition(spark_iterator(), lambda s: s.map(lambda b: b)))


@pytest.mark.parametrize("output_buffers, bound", [((2, 10), 12), ((4, 32), 20)])
def test_slow_consumer_stops_the_reading_of_the_input(output_buffers, bound):
    """Backpressure end to end: while the consumer (Spark's writer) is slow,
    the pipeline takes only a bounded number of batches from the input: what
    the output pool holds (10 or 32 segments of 32 KiB, for 100 KB batches)
    plus the few batches the threads have in hand (max_batch = 4)."""
    pulled = 0
    big = pa.record_batch({"x": np.zeros(12_500, dtype=np.int64)})  # 100 KB: about 3 segments

    def spark_input():
        nonlocal pulled
        for _ in range(500):
            pulled += 1
            yield big

    env_kwargs = {**DEFAULT_ENV, "num_segments": 128, "output_buffers": output_buffers}
    gen = run_partition(spark_input(), lambda s: s.map(lambda b: b, name="a").map(lambda b: b, name="b"),
                        env_kwargs=env_kwargs)
    consumed = 0
    for _ in gen:
        consumed += 1
        time.sleep(0.03)
        if consumed == 15:
            break
    ahead = pulled - consumed
    gen.close()
    assert ahead <= bound, f"pulled {pulled} batches for {consumed} consumed"
    for _ in range(50):
        if not pyflowbuf_threads():
            break
        time.sleep(0.05)
    assert not pyflowbuf_threads(), "closing the output cancels the pipeline"


def test_partition_report():
    reports = []
    out = list(run_partition(iter(batches(10, rows=50)), lambda s: s.map(lambda b: b, name="ident", parallelism=2),
                             on_done=reports.append))
    assert len(out) == 10
    (rep,) = reports
    assert rep["rows_in"] == rep["rows_out"] == 500 and rep["batches_in"] == 10
    assert rep["pool_segments"] > 0 and 0 < rep["pool_peak_segments"] <= rep["pool_segments"]
    assert rep["rss_peak_mib"] >= rep["rss_start_mib"] > 0
    stages = aggregate_stages(reports)
    assert set(stages) == {"spark-input", "ident"}
    assert stages["ident"]["subtasks"] == 2 and stages["ident"]["records_in"] == 10
    assert stages["ident"]["level"] in ("OK", "LOW", "HIGH")
    assert summarize(reports)["rows_in"] == 500


# ---------------------------------------------------------------- envelopes

ITEMS = st.one_of(
    st.integers(0, 3000).map(lambda n: pa.record_batch({"i": np.arange(n), "s": [str(i) for i in range(n)]})),
    st.integers(0, 50).map(lambda n: pd.DataFrame({"a": np.arange(n, dtype=float)})),
    st.integers(0, 50).map(lambda n: pd.Series(np.arange(n), name="v")),
    st.integers(0, 20_000).map(lambda n: np.arange(n, dtype=np.int32)),
    st.one_of(st.none(), st.text(max_size=20), st.tuples(st.integers(), st.floats(allow_nan=False))),
)


def _equal(a, b):
    if isinstance(a, pa.RecordBatch):
        return a.equals(b)
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b)
        return True
    if isinstance(a, pd.Series):
        pd.testing.assert_series_equal(a, b)
        return True
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@given(envs=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.lists(ITEMS, max_size=4)), min_size=1, max_size=5))
@settings(max_examples=30)
def test_sequenced_envelopes_round_trip_through_segments(envs):
    ser = SequencedSerializer()
    enc = ser.encode_batch(envs)
    nbp = NetworkBufferPool(256, 32 * 1024)
    pool = nbp.create_pool(1, 256)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    w.write_batch(enc)
    w.end_input()
    raw = list(RecordReader(q, zero_copy_min=0))
    out = ser.decode_batch(raw)
    for (seq, items), (seq2, items2) in zip(envs, out):
        assert seq == seq2 and len(items) == len(items2)
        for a, b in zip(items, items2):
            assert _equal(a, b)
    for r, (_, items2) in zip(raw, out):
        if isinstance(r, memoryview):  # in place: inner Arrow buffers are aligned, not copied
            for b in items2:
                if isinstance(b, pa.RecordBatch):
                    assert all(buf.address % 8 == 0 for c in b.columns for buf in c.buffers() if buf is not None)


def test_envelope_errors():
    ser = SequencedSerializer()
    with pytest.raises(TypeError, match=r"\(seq, \[records\]\)"):
        ser.encode_one(5)
    with pytest.raises(errors.CorruptRecordError):
        ser.decode_one(b"\xfbS\x01\x00" + bytes(8) + b"\xff\x00\x00\x00")
    with pytest.raises(errors.CorruptRecordError):
        ser.decode_one(b"nonsense-nonsense")


def test_reorder():
    assert list(reorder([(2, ["c"]), (0, ["a"]), (1, ["b", "b2"]), (3, [])])) == ["a", "b", "b2", "c"]
    with pytest.raises(RuntimeError, match="without their predecessors"):
        list(reorder([(1, ["x"])]))


def test_records_waiting_in_the_reorder_buffer_do_not_pin_segments():
    backing = bytearray(np.arange(100, dtype=np.int64).tobytes())
    view_batch = pa.RecordBatch.from_arrays(
        [pa.Array.from_buffers(pa.int64(), 100, [None, pa.py_buffer(memoryview(backing))])], names=["x"])
    view_array = np.frombuffer(memoryview(backing), dtype=np.int64)
    out = list(reorder([(1, [view_batch, view_array, memoryview(b"ab")]), (0, ["first"])]))
    assert out[0] == "first"
    b, a, m = out[1:]
    addr = pa.py_buffer(memoryview(backing)).address
    assert b.column(0).buffers()[1].address != addr and b.equals(view_batch)
    assert a.ctypes.data != addr and np.array_equal(a, view_array)
    assert m == b"ab" and isinstance(m, bytes)


def test_ordered_stream_knows_when_to_sequence():
    s = OrderedStream()
    assert not s.map(len).filter(bool).needs_sequencing(1)
    assert s.map(len, parallelism=2).needs_sequencing(1)
    assert s.map(len).needs_sequencing(2)
    assert not s.rebalance().forward().needs_sequencing(1)


# ---------------------------------------------------------------- per-batch work of the arrow adapter

def spark_like(n, rows=1000):
    """Batches like the spark benchmark's: 1,000 rows of (long, int, double,
    string) are ~32 KB, so nearly every record straddles two 32 KiB segments."""
    out = []
    for k in range(n):
        ids = np.arange(k * rows, (k + 1) * rows, dtype=np.int64)
        out.append(pa.record_batch({"id": ids, "k": (ids % 1000).astype(np.int32), "x": ids * 0.5,
                                    "s": [f"name-{i % 997}" for i in ids]}))
    return out


def count_ipc_streams(monkeypatch):
    """Counts the Arrow IPC stream writers and readers opened."""
    calls = collections.Counter()
    for name in ("new_stream", "open_stream"):
        def counted(*a, _orig=getattr(pa.ipc, name), _name=name, **k):
            calls[_name] += 1
            return _orig(*a, **k)
        monkeypatch.setattr(pa.ipc, name, counted)
    return calls


@pytest.mark.parametrize("parallelism, most", [(1, 1), (2, 8)])
def test_arrow_udf_parses_a_partitions_schema_once_not_per_batch(monkeypatch, parallelism, most):
    """Opening an IPC stream writer and reader for every batch cost more than
    the rest of a 1,000-row batch's trip through the pipeline (the spark
    benchmark's overhead_vs_mapinarrow_1k). A partition's batches share their
    schema: it is written and parsed once per reader, not once per batch."""
    data = spark_like(120)
    fn = arrow_udf(lambda s: s.map(lambda b: b, parallelism=parallelism).map(lambda b: b), data[0].schema)
    calls = count_ipc_streams(monkeypatch)
    out = list(fn(iter(data)))
    assert [b.column("id")[0].as_py() for b in out] == [k * 1000 for k in range(120)]
    assert all(a.equals(b) for a, b in zip(out, data))
    assert calls["new_stream"] == 0
    assert calls["open_stream"] <= most, dict(calls)


def test_arrow_udf_output_may_change_schema_and_be_pandas_or_tables():
    def vary(b):
        k = b.column("id")[0].as_py() // 100
        if k % 3 == 0:
            return b.to_pandas()
        if k % 3 == 1:
            return pa.Table.from_batches([pa.record_batch({"id": b.column("id").cast(pa.int32())})])
        return b.select(["id"])

    out_schema = pa.schema([("id", pa.int64())])
    fn = arrow_udf(lambda s: s.map(vary), out_schema)
    out = list(fn(iter(batches(30))))
    assert [b.schema for b in out] == [out_schema] * 30
    assert first_ids(out) == [k * 100 for k in range(30)]


def test_arrow_udf_output_of_another_type_names_the_operator():
    fn = arrow_udf(lambda s: s.map(lambda b: b.num_rows, name="count"), pa.schema([("n", pa.int64())]))
    with pytest.raises(errors.JobFailedError, match=r"'count'.*must end in pyarrow.RecordBatch"):
        list(fn(iter(batches(3))))


SCHEMAS = [
    pa.schema([("i", pa.int64()), ("s", pa.string())]),
    pa.schema([("i", pa.int64()), ("s", pa.string())], metadata={b"k": b"v"}),
    pa.schema([("f", pa.float32()), ("l", pa.list_(pa.int16())), ("b", pa.bool_())]),
    pa.schema([("d", pa.dictionary(pa.int8(), pa.string())), ("i", pa.int64())]),
    pa.schema([("st", pa.struct([("d", pa.dictionary(pa.int8(), pa.string()))]))]),
]


def _batch_of(schema_index, n):
    sch = SCHEMAS[schema_index]
    cols = []
    for f in sch:
        t = f.type
        if pa.types.is_struct(t):
            cols.append(pa.StructArray.from_arrays(
                [pa.array([str(i % 3) for i in range(n)]).dictionary_encode().cast(t.field(0).type)],
                fields=[t.field(0)]))
        elif pa.types.is_dictionary(t):
            cols.append(pa.array([str(i % 5) for i in range(n)]).dictionary_encode().cast(t))
        elif pa.types.is_list(t):
            cols.append(pa.array([[i, None] if i % 4 else None for i in range(n)], t))
        elif pa.types.is_string(t):
            cols.append(pa.array([None if i % 7 == 0 else "v" * (i % 13) for i in range(n)], t))
        else:
            cols.append(pa.array([i % 2 if t == pa.bool_() else i for i in range(n)]).cast(t))
    return pa.RecordBatch.from_arrays(cols, schema=sch)


@given(spec=st.lists(st.tuples(st.integers(0, len(SCHEMAS) - 1), st.integers(0, 3000)), min_size=1, max_size=12),
       writer=st.sampled_from(["partition", "arrow"]), zero_copy=st.booleans())
@settings(max_examples=40, deadline=None)
def test_partition_arrow_records_round_trip_through_segments(spec, writer, zero_copy):
    """Whatever the schema changes, dictionaries, sizes (in one segment or
    straddling several) and which serializer wrote the records, the partition
    serializer decodes the batches written, their values aligned; and
    ArrowSerializer reads what it writes (the records keep the arrow layout)."""
    data = [_batch_of(i, n) for i, n in spec]
    enc = (PartitionArrowSerializer() if writer == "partition" else ArrowSerializer()).encode_batch(data)
    nbp = NetworkBufferPool(512, 32 * 1024)
    pool = nbp.create_pool(1, 512)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q])
    w.write_batch(enc)
    w.end_input()
    raw = list(RecordReader(q, zero_copy_min=0))
    reader = PartitionArrowSerializer(zero_copy=zero_copy)
    out = reader.decode_batch(raw)
    generic = ArrowSerializer().decode_batch(raw)
    for a, b, c in zip(data, out, generic):
        assert a.equals(b) and b.schema.equals(a.schema, check_metadata=True) and c.equals(a)
        for col in b.columns:   # values aligned as their type needs: Arrow never reads them misaligned
            if pa.types.is_primitive(col.type) and col.type.bit_width >= 8 and len(col):
                assert col.buffers()[1].address % (col.type.bit_width // 8) == 0
    del out, generic, raw


def test_partition_arrow_large_batches_take_the_stream_writer_and_still_decode_by_message(monkeypatch):
    ser, big = PartitionArrowSerializer(), spark_like(1, rows=20_000)[0]   # ~650 KB
    calls = count_ipc_streams(monkeypatch)
    recs = [ser.encode_one(b) for b in (big, big, spark_like(1)[0])]
    assert calls["new_stream"] == 2            # no extra copy of a large message
    reader = PartitionArrowSerializer()
    out = [reader.decode_one(memoryview(r)) for r in recs]
    assert out[0].equals(big) and out[1].equals(big) and out[2].num_rows == 1000
    assert calls["open_stream"] == 1


def test_partition_arrow_corrupt_records_are_typed_errors():
    ser = PartitionArrowSerializer()
    rec = bytes(ser.encode_one(_batch_of(0, 100)))
    ser.decode_one(rec)   # the schema is known from here on: the batch-message path
    schema_len = len(ser._decode_cache[0])
    off = int.from_bytes(rec[4:8], "little")
    for bad in (rec[:off + schema_len] + bytes(len(rec) - off - schema_len),          # no message
                rec[:off + schema_len + 8] + bytes(len(rec) - off - schema_len - 8),  # garbage message
                rec[:off + schema_len + 4] + (1 << 30).to_bytes(4, "little") + rec[off + schema_len + 8:]):
        with pytest.raises(errors.CorruptRecordError):
            ser.decode_one(bad)
    with pytest.raises(TypeError, match="an 'arrow' stream takes pyarrow.RecordBatch"):
        ser.encode_one(pd.DataFrame({"a": [1]}))
    assert PartitionArrowSerializer(accept_pandas=True).decode_one(
        PartitionArrowSerializer(accept_pandas=True).encode_one(pd.DataFrame({"a": [1]}))).to_pydict() == {"a": [1]}


# ---------------------------------------------------------------- schemas

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("score", pa.float64())])


def test_conform_passes_matching_batches_through():
    b = pa.record_batch({"id": [1], "name": ["a"], "score": [0.5]}, schema=SCHEMA)
    assert conform_batch(b, SCHEMA) is b


def test_conform_reorders_and_casts_losslessly():
    b = pa.record_batch({"score": pa.array([1, 2], pa.int32()), "id": pa.array([1, 2], pa.int32()),
                         "name": pa.array(["x", None], pa.large_string())})
    out = conform_batch(b, SCHEMA)
    assert out.schema.equals(SCHEMA)
    assert out.to_pydict() == {"id": [1, 2], "name": ["x", None], "score": [1.0, 2.0]}
    df = pd.DataFrame({"id": [3], "name": ["z"], "score": [1.5]})
    assert conform_batch(df, SCHEMA).to_pydict() == {"id": [3], "name": ["z"], "score": [1.5]}
    assert conform_batch(pa.Table.from_pandas(df, preserve_index=False), SCHEMA).num_rows == 1


def test_conform_names_missing_extra_and_mistyped_columns():
    b = pa.record_batch({"id": ["not a number"], "extra": [1], "score": ["2.5x"]})
    with pytest.raises(SchemaMismatchError) as ei:
        conform_batch(b, SCHEMA)
    msg = str(ei.value)
    assert "missing columns ['name']" in msg and "unexpected columns ['extra']" in msg
    assert "'id' expected int64, got string" in msg and "'score' expected double, got string" in msg
    assert ei.value.missing == ["name"] and ei.value.extra == ["extra"]
    assert [w[0] for w in ei.value.wrong_types] == ["id", "score"]
    with pytest.raises(SchemaMismatchError, match="'id' expected int64, got int32"):
        conform_batch(pa.record_batch({"id": pa.array([1], pa.int32()), "name": ["a"], "score": [1.0]}),
                      SCHEMA, cast=False)
    with pytest.raises(SchemaMismatchError, match="'id' expected int32, got int64"):
        conform_batch(pa.record_batch({"id": [2**40]}), pa.schema([("id", pa.int32())]))  # overflow
    with pytest.raises(TypeError, match="must end in pyarrow.RecordBatch"):
        conform_batch([1, 2], SCHEMA)


def test_pandas_frames_are_checked_by_name_and_type_family():
    check_pandas_frame(pd.DataFrame({"id": [1], "name": ["a"], "score": [1]}), SCHEMA)  # int for double: fine
    check_pandas_frame(pd.DataFrame({"id": [None], "name": [None], "score": [None]}), SCHEMA)
    with pytest.raises(SchemaMismatchError) as ei:
        check_pandas_frame(pd.DataFrame({"id": ["x"], "nam": ["a"], "score": [1.0]}), SCHEMA)
    msg = str(ei.value)
    assert "missing columns ['name']" in msg and "unexpected columns ['nam']" in msg and "'id' expected int64" in msg


def test_resolve_schema_without_a_session():
    from pyspark.sql.types import LongType, StructField, StructType

    struct, arrow = resolve_schema(StructType([StructField("id", LongType())]))
    assert arrow == pa.schema([("id", pa.int64())])
    struct2, arrow2 = resolve_schema(SCHEMA)
    assert arrow2.names == SCHEMA.names and [f.name for f in struct2.fields] == SCHEMA.names
    with pytest.raises(TypeError, match="StructType, a DDL string or a pyarrow.Schema"):
        resolve_schema(42)


def test_no_segment_leaks_after_many_partitions():
    for _ in range(5):
        out = list(run_partition(iter(batches(10)), lambda s: s.map(lambda b: b, parallelism=2)))
        assert len(out) == 10
    del out
    gc.collect()
    assert not pyflowbuf_threads() or all(not t.is_alive() for t in pyflowbuf_threads())


# ---------------------------------------------------------------- a reused Python worker

def _census():
    gc.collect()
    return len(gc.get_objects()), threading.active_count(), len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
@pytest.mark.parametrize("preserve_order, parallelism", [(True, 1), (False, 2), (True, 2)])
def test_partitions_in_one_reused_worker_leave_nothing_behind(preserve_order, parallelism):
    """Spark runs partition after partition in one reused Python worker:
    after a warm-up (caches filled once), more partitions through arrow_udf
    leave no objects, threads or descriptors behind. A leak of one object per
    partition would show as 40 here."""
    fn = arrow_udf(lambda s: s.map(lambda b: b), pa.schema([("id", pa.int64())]), preserve_order=preserve_order,
                   parallelism=parallelism)

    def partition():
        out = list(fn(iter(batches(6))))
        assert sum(b.num_rows for b in out) == 600

    for _ in range(10):
        partition()
    objects, threads, fds = _census()
    for _ in range(40):
        partition()
    objects_after, threads_after, fds_after = _census()
    assert (threads_after, fds_after) == (threads, fds)
    assert objects_after - objects < 20, f"{objects_after - objects} more objects after 40 partitions"
