"""Arrow, pandas and NumPy record kinds: round trips through real segments.

Every round trip goes RecordWriter -> BufferQueue -> RecordReader with the
serializer's ``zero_copy_min`` (0), so records that lie inside one 32 KiB
segment reach the decoder as memoryviews over the segment and records larger
than a segment as the reader's reassembled ``bytes``. Besides equality the
tests check that decoding copies no column buffer (their addresses lie inside
the record's memory) and that a segment stays pinned while a decoded batch
refers to it.
"""
import datetime as dt
import decimal
import gc
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")

from pyflowbuf import errors  # noqa: E402
from pyflowbuf._core.memory import NetworkBufferPool  # noqa: E402
from pyflowbuf._core.channel import BufferQueue  # noqa: E402
from pyflowbuf._core.serde import RecordReader, RecordWriter  # noqa: E402
from pyflowbuf.serializers import get_serializer, infer_kind  # noqa: E402
from pyflowbuf.serializers_arrow import (  # noqa: E402
    ArrowSerializer, NumpySerializer, PandasSerializer)

SEG = 32 * 1024


def through_segments(ser, records, segment_size=SEG, num_segments=None):
    """Encode, write into segments, read back (zero_copy_min from the
    serializer), decode. Returns (decoded, raw records as the reader gave
    them, the NetworkBufferPool)."""
    encoded = ser.encode_batch(list(records))
    total = sum(len(memoryview(e).cast("B")) + 4 for e in encoded)
    n = num_segments or max(8, total // segment_size + 4)
    nbp = NetworkBufferPool(n, segment_size)
    pool = nbp.create_pool(1, n)
    q = BufferQueue(nbp)
    w = RecordWriter(pool, [q], kind=ser.core_kind)
    w.write_batch(encoded)
    w.end_input()
    r = RecordReader(q, kind=ser.core_kind, zero_copy_min=ser.zero_copy_min)
    raw = list(r)
    assert r.finished
    del r, w, q, pool
    assert len(raw) == len(encoded)
    return ser.decode_batch(raw), raw, nbp


def _nan_free(v):
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, dict):
        return {k: _nan_free(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_free(x) for x in v]
    return v


def same_batch(a, b):
    """RecordBatch equality with NaN == NaN."""
    return a.equals(b) or (a.schema.equals(b.schema) and _nan_free(a.to_pylist()) == _nan_free(b.to_pylist()))


def buffers_of(batch):
    out = []
    for col in batch.columns:
        stack = [col]
        while stack:
            a = stack.pop()
            out += [b for b in a.buffers() if b is not None and b.size > 0]
            if isinstance(a, pa.DictionaryArray):
                stack.append(a.dictionary)
    return out


def assert_zero_copy(batch, raw):
    base = pa.py_buffer(raw)
    lo, hi = base.address, base.address + base.size
    for b in buffers_of(batch):
        assert lo <= b.address and b.address + b.size <= hi, "a column buffer was copied out of the record"


def expect_zero_copy(raw, segment_size=SEG):
    """In-segment records always decode in place; a reassembled record does
    when it was larger than a segment (it was then laid out for bytes)."""
    return isinstance(raw, memoryview) or len(raw) + 4 > segment_size


# ---------------------------------------------------------------- strategies

def _vals(draw, n, elem):
    return draw(st.lists(st.one_of(st.none(), elem), min_size=n, max_size=n))


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
COLUMN_KINDS = ["int64", "int32", "float64", "bool", "string", "large_string", "binary", "list_int",
                "struct", "timestamp_tz", "date", "decimal", "dict_string", "null", "uint8"]


def _column(draw, kind, n):
    if kind == "int64":
        return pa.array(_vals(draw, n, st.integers(-(2**63), 2**63 - 1)), pa.int64())
    if kind == "int32":
        return pa.array(_vals(draw, n, st.integers(-(2**31), 2**31 - 1)), pa.int32())
    if kind == "uint8":
        return pa.array(_vals(draw, n, st.integers(0, 255)), pa.uint8())
    if kind == "float64":
        return pa.array(_vals(draw, n, st.floats(allow_nan=False)), pa.float64())
    if kind == "bool":
        return pa.array(_vals(draw, n, st.booleans()), pa.bool_())
    if kind in ("string", "large_string", "dict_string"):
        a = pa.array(_vals(draw, n, TEXT), pa.large_string() if kind == "large_string" else pa.string())
        return a.dictionary_encode() if kind == "dict_string" else a
    if kind == "binary":
        return pa.array(_vals(draw, n, st.binary(max_size=16)), pa.binary())
    if kind == "list_int":
        return pa.array(_vals(draw, n, st.lists(st.integers(-5, 5), max_size=4)), pa.list_(pa.int64()))
    if kind == "struct":
        v = _vals(draw, n, st.fixed_dictionaries({"x": st.integers(-9, 9), "y": TEXT}))
        return pa.array(v, pa.struct([("x", pa.int64()), ("y", pa.string())]))
    if kind == "timestamp_tz":
        v = _vals(draw, n, st.integers(0, 2**40))
        return pa.array(v, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    if kind == "date":
        return pa.array(_vals(draw, n, st.dates(dt.date(1900, 1, 1), dt.date(2100, 1, 1))), pa.date32())
    if kind == "decimal":
        v = _vals(draw, n, st.decimals(-10**6, 10**6, places=2, allow_nan=False, allow_infinity=False))
        return pa.array(v, pa.decimal128(12, 2))
    if kind == "null":
        return pa.nulls(n)
    raise AssertionError(kind)


@st.composite
def arrow_batches(draw, max_rows=30):
    n = draw(st.integers(0, max_rows))
    kinds = draw(st.lists(st.sampled_from(COLUMN_KINDS), max_size=5))
    cols = [_column(draw, k, n) for k in kinds]
    names = [f"c{i}_{k}" for i, k in enumerate(kinds)]
    if not cols:
        return pa.RecordBatch.from_arrays([], names=[])
    return pa.RecordBatch.from_arrays(cols, names=names)


@st.composite
def big_batches(draw):
    """Batches of 40 KiB .. 600 KiB: always span several 32 KiB segments."""
    n = draw(st.integers(5_000, 40_000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = pa.array(rng.integers(-(2**62), 2**62, n))
    x = pa.array(rng.random(n), mask=rng.random(n) < 0.1)
    s = pa.array([None if i % 7 == 0 else f"r{i}-{seed % 1000}" for i in range(n)])
    return pa.RecordBatch.from_arrays([ids, x, s], names=["id", "x", "s"])


# ---------------------------------------------------------------- arrow

def test_registered_kinds():
    assert isinstance(get_serializer("arrow"), ArrowSerializer)
    assert isinstance(get_serializer("pandas"), PandasSerializer)
    assert isinstance(get_serializer("numpy"), NumpySerializer)
    for s in (get_serializer("arrow"), get_serializer("pandas"), get_serializer("numpy")):
        assert s.core_kind == "bytes" and s.zero_copy_min == 0 and not s.in_process_only
    assert infer_kind(pa.record_batch({"a": [1]})) == "arrow"
    assert infer_kind(pd.DataFrame({"a": [1]})) == "pandas"
    assert infer_kind(np.zeros(3)) == "numpy"


@given(batches=st.lists(arrow_batches(), min_size=1, max_size=6))
@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_arrow_round_trip_in_segments(batches):
    ser = ArrowSerializer()
    out, raw, nbp = through_segments(ser, batches)
    for b, o, r in zip(batches, out, raw):
        assert isinstance(o, pa.RecordBatch)
        assert o.schema.equals(b.schema)
        assert same_batch(o, b)
        o.validate(full=True)
        if expect_zero_copy(r):
            assert_zero_copy(o, r)
    del out, raw, o, r  # (the loop variables hold the last record too)
    gc.collect()
    assert nbp.available_segments == nbp.total_segments


@given(batches=st.lists(st.one_of(big_batches(), arrow_batches()), min_size=1, max_size=4))
@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_arrow_records_spanning_segments(batches):
    ser = ArrowSerializer()
    out, raw, _ = through_segments(ser, batches)
    for b, o, r in zip(batches, out, raw):
        assert same_batch(o, b)
        if b.nbytes > SEG:
            assert isinstance(r, bytes), "a record larger than a segment comes back reassembled"
        if expect_zero_copy(r):
            assert_zero_copy(o, r)
            for buf in buffers_of(o):
                assert buf.address % 8 == 0


def test_nulls_strings_and_empty_batches():
    schema = pa.schema([("i", pa.int64()), ("s", pa.string()), ("f", pa.float64())])
    cases = [
        pa.RecordBatch.from_pylist([], schema=schema),                       # no rows
        pa.RecordBatch.from_arrays([], names=[]),                            # no columns
        pa.record_batch({"i": [None, None], "s": [None, ""], "f": [None, float("nan")]}, schema=schema),
        pa.record_batch({"i": [1, 2, 3], "s": ["ä", "日本語", "\x00"], "f": [1.5, None, -0.0]}, schema=schema),
        pa.record_batch({"n": pa.nulls(5)}),
        pa.record_batch({"d": pa.array(["a", "b", "a", None]).dictionary_encode()}),
        pa.record_batch({"m": pa.array([{"k": 1}, None], pa.map_(pa.string(), pa.int64()))}),
        pa.record_batch({"dec": pa.array([decimal.Decimal("1.25"), None], pa.decimal128(5, 2))}),
    ]
    out, raw, _ = through_segments(ArrowSerializer(), cases)
    for b, o in zip(cases, out):
        assert same_batch(o, b), (b, o)
        assert o.schema.equals(b.schema, check_metadata=True)
    assert out[0].num_rows == 0 and out[1].num_columns == 0


def test_schema_metadata_and_table_records():
    ser = ArrowSerializer()
    b = pa.record_batch({"a": [1, 2]}).replace_schema_metadata({"origin": "test"})
    t = pa.Table.from_batches([pa.record_batch({"a": [1]}), pa.record_batch({"a": [2, 3]})])
    out, _, _ = through_segments(ser, [b, t])
    assert out[0].schema.metadata == {b"origin": b"test"}
    assert out[1].to_pydict() == {"a": [1, 2, 3]}


def test_segment_is_pinned_while_a_decoded_batch_lives():
    ser = ArrowSerializer()
    small = pa.record_batch({"x": np.arange(100, dtype=np.int64)})
    out, raw, nbp = through_segments(ser, [small], num_segments=8)
    assert isinstance(raw[0], memoryview)
    assert_zero_copy(out[0], raw[0])
    col = out[0].column(0)
    del raw, out
    gc.collect()
    assert nbp.available_segments == nbp.total_segments - 1, "the segment must stay pinned by the column"
    assert col.to_pylist() == list(range(100))
    del col
    gc.collect()
    assert nbp.available_segments == nbp.total_segments


def test_alignment_layout():
    ser = ArrowSerializer()
    for n in (1, 100, 3000, 50_000):
        rec = ser.encode_one(pa.record_batch({"x": np.arange(n)}))
        size = memoryview(rec).nbytes
        assert size % 8 == 4, "records keep the next record's payload aligned"
        off = int.from_bytes(memoryview(rec)[4:8], "little")
        assert off % 8 == (0 if size + 4 > SEG else 4)


def test_compressed_round_trip():
    ser = ArrowSerializer(compression="lz4")
    b = pa.record_batch({"x": np.zeros(50_000, dtype=np.int64), "s": ["abc"] * 50_000})
    rec = ser.encode_one(b)
    assert memoryview(rec).nbytes < b.nbytes / 2
    out, _, _ = through_segments(ser, [b])
    assert out[0].equals(b)


def test_arrow_bad_records():
    ser = ArrowSerializer()
    with pytest.raises(TypeError, match="record 1: an 'arrow' stream takes pyarrow.RecordBatch"):
        ser.encode_batch([pa.record_batch({"a": [1]}), {"a": [1]}])
    with pytest.raises(errors.CorruptRecordError, match="too short"):
        ser.decode_one(b"\xfbA")
    with pytest.raises(errors.CorruptRecordError, match="not a pyflowbuf arrow record"):
        ser.decode_one(b"x" * 40)
    with pytest.raises(errors.CorruptRecordError, match="not a pyflowbuf arrow record"):
        ser.decode_one(bytes(NumpySerializer().encode_one(np.zeros(3))))
    good = bytearray(memoryview(ser.encode_one(pa.record_batch({"a": [1, 2]}))))
    with pytest.raises(errors.CorruptRecordError, match="payload"):
        ser.decode_one(bytes(good[:-20]))
    bad = bytearray(good)
    bad[20:40] = b"\x01" * 20
    with pytest.raises(errors.CorruptRecordError):
        ser.decode_one(bytes(bad))
    assert isinstance(errors.CorruptRecordError("x"), ValueError)


def test_arrow_kind_through_a_parallel_pipeline():
    fb = pytest.importorskip("pyflowbuf")
    if not hasattr(fb, "Environment"):
        pytest.skip("pipeline runtime not available")
    batches = [pa.record_batch({"i": np.arange(k * 1000, (k + 1) * 1000), "s": [str(k)] * 1000})
               for k in range(40)]
    env = fb.Environment(parallelism=2, max_batch=4)
    s = env.from_iterable(iter(batches), kind="arrow").map(
        lambda b: b.append_column("twice", pa.compute.multiply(b.column("i"), 2)), kind="arrow")
    got = list(env.execute_iter(s.to_iterator()))
    assert sorted(b.column("i")[0].as_py() for b in got) == [k * 1000 for k in range(40)]
    for b in got:
        assert b.column("twice").to_pylist() == [2 * v for v in b.column("i").to_pylist()]


# ---------------------------------------------------------------- pandas

@st.composite
def frames(draw, max_rows=20):
    n = draw(st.integers(0, max_rows))
    data = {}
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["int", "float", "str", "bool", "ts"]), max_size=4))):
        name = f"c{i}"
        if kind == "int":
            data[name] = pd.Series(draw(st.lists(st.integers(-(2**53), 2**53), min_size=n, max_size=n)), dtype="int64")
        elif kind == "float":
            data[name] = pd.Series(draw(st.lists(st.one_of(st.none(), st.floats(allow_nan=False)),
                                                 min_size=n, max_size=n)), dtype="float64")
        elif kind == "str":
            data[name] = pd.Series(draw(st.lists(st.one_of(st.none(), TEXT), min_size=n, max_size=n)),
                                   dtype="object")
        elif kind == "bool":
            data[name] = pd.Series(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype="bool")
        else:
            v = draw(st.lists(st.integers(0, 2**50), min_size=n, max_size=n))
            data[name] = pd.to_datetime(pd.Series(v, dtype="int64"), unit="us", utc=True)
    df = pd.DataFrame(data, index=pd.RangeIndex(n))
    if draw(st.booleans()) and n:
        df.index = pd.Index(draw(st.lists(st.integers(-99, 99), min_size=n, max_size=n)), name="k")
    return df


@given(dfs=st.lists(frames(), min_size=1, max_size=4))
@settings(max_examples=25)
def test_pandas_round_trip(dfs):
    out, raw, nbp = through_segments(PandasSerializer(), dfs)
    for a, b in zip(dfs, out):
        assert isinstance(b, pd.DataFrame)
        expected = pa.Table.from_pandas(a).to_pandas()  # what Arrow itself gives back
        pd.testing.assert_frame_equal(b, expected)
        assert list(b.columns) == list(a.columns)
        assert len(b) == len(a)
        if len(a):
            pd.testing.assert_index_equal(b.index, a.index, exact=False)
    del out, b, raw
    gc.collect()
    assert nbp.available_segments == nbp.total_segments, "to_pandas copies: nothing stays pinned"


def test_pandas_series_and_big_frames():
    big = pd.DataFrame({"a": np.arange(100_000), "b": np.random.default_rng(1).random(100_000)})
    items = [pd.Series([1, 2, 3]), pd.Series(["x", None], name="named"), big, pd.DataFrame()]
    out, raw, _ = through_segments(PandasSerializer(), items)
    pd.testing.assert_series_equal(out[0], items[0])
    assert out[1].name == "named" and out[1].tolist()[0] == "x" and pd.isna(out[1].tolist()[1])
    pd.testing.assert_frame_equal(out[2], big)
    assert isinstance(raw[2], bytes)
    assert out[3].shape == (0, 0)
    out[2].loc[0, "a"] = -1  # decoded frames are writable


def test_pandas_bad_records():
    ser = PandasSerializer()
    with pytest.raises(TypeError, match="record 0: a 'pandas' stream takes pandas.DataFrame"):
        ser.encode_batch([[1, 2]])
    with pytest.raises(TypeError, match="cannot be converted to Arrow"):
        ser.encode_batch([pd.DataFrame({"a": [object()]})])


# ---------------------------------------------------------------- numpy

NUMPY_DTYPES = ["<i1", "<u2", "<i4", "<i8", ">i8", "<f4", "<f8", "<c16", "|b1", "<U3", "|S5",
                "<M8[ns]", "<m8[s]"]


STRUCT_DTYPE = np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "U2")])


@st.composite
def ndarrays(draw):
    name = draw(st.sampled_from(NUMPY_DTYPES + ["struct"]))
    dt_ = STRUCT_DTYPE if name == "struct" else np.dtype(name)
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    return _array(dt_, shape, draw(st.integers(0, 2**32 - 1)), layout)


def _array(dt_, shape, seed, layout):
    rng = random.Random(seed)
    n = int(np.prod(shape)) if shape else 1
    if dt_.kind == "U":
        arr = np.array([str(rng.randrange(999)) for _ in range(n)], dtype=dt_).reshape(shape)
    elif dt_.kind == "b":
        arr = np.array([rng.random() < 0.5 for _ in range(n)], dtype=bool).reshape(shape)
    elif dt_.kind == "f" or dt_.kind == "c":
        arr = np.array([rng.uniform(-1e6, 1e6) for _ in range(n)]).astype(dt_).reshape(shape)
    else:  # ints, bytes, datetimes, timedeltas, structs: any bit pattern will do
        raw = np.frombuffer(rng.randbytes(n * dt_.itemsize), dtype=np.uint8)
        arr = raw.view(dt_).reshape(shape) if dt_.kind != "V" else np.zeros(shape, dt_)
        if dt_.kind == "V" and n:
            arr.reshape(-1)["a"] = np.arange(n)
            arr.reshape(-1)["c"] = "xy"
    if layout == "F":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim and arr.shape[0] > 1:
        arr = arr[::2]
    return arr


@given(arrs=st.lists(ndarrays(), min_size=1, max_size=6))
def test_numpy_round_trip(arrs):
    out, raw, _ = through_segments(NumpySerializer(), arrs)
    for a, b, r in zip(arrs, out, raw):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(b, a)
        assert not b.flags.writeable
        if b.size and b.dtype.itemsize:
            assert b.flags.c_contiguous
            base = pa.py_buffer(r)
            assert base.address <= b.ctypes.data < base.address + base.size, "decoded as a view"
            if expect_zero_copy(r):
                assert b.ctypes.data % 8 == 0


def test_numpy_special_shapes_and_large_arrays():
    ser = NumpySerializer()
    big = np.arange(100_000, dtype=np.float64).reshape(1000, 100)  # 800 KB: spans segments
    items = [np.array(7), np.float32(2.5), np.zeros((0, 5)), big, big.T]
    out, raw, _ = through_segments(ser, items)
    assert out[0].shape == () and out[0] == 7
    assert out[1].dtype == np.float32 and out[1] == 2.5
    assert out[2].shape == (0, 5)
    np.testing.assert_array_equal(out[3], big)
    np.testing.assert_array_equal(out[4], big.T)
    assert isinstance(raw[3], bytes) and out[3].ctypes.data % 8 == 0


def test_numpy_bad_records():
    ser = NumpySerializer()
    with pytest.raises(TypeError, match="hold Python objects"):
        ser.encode_one(np.array([object()]))
    with pytest.raises(TypeError, match="record 1: a 'numpy' stream takes numpy.ndarray"):
        ser.encode_batch([np.zeros(1), [1, 2]])
    rec = bytearray(memoryview(ser.encode_one(np.arange(4))))
    rec[8] = 3  # ndim 3 with the data of a 1-d array
    with pytest.raises(errors.CorruptRecordError):
        ser.decode_one(bytes(rec))
    with pytest.raises(errors.CorruptRecordError, match="not a pyflowbuf numpy record"):
        ser.decode_one(bytes(memoryview(ArrowSerializer().encode_one(pa.record_batch({"a": [1]})))))


def test_copying_mode_does_not_pin_segments():
    small = [pa.record_batch({"x": np.arange(k, k + 50, dtype=np.int64)}) for k in range(20)]
    out, raw, nbp = through_segments(ArrowSerializer(zero_copy=False), small)
    arrs, raw2, nbp2 = through_segments(NumpySerializer(zero_copy=False), [np.arange(10)] * 5)
    del raw, raw2
    gc.collect()
    assert nbp.available_segments == nbp.total_segments and nbp2.available_segments == nbp2.total_segments
    assert [b.column(0)[0].as_py() for b in out] == list(range(20))
    assert all(a.flags.writeable and a.tolist() == list(range(10)) for a in arrs)


@pytest.mark.timeout(60)
def test_kept_zero_copy_records_would_stall_a_job_but_copies_do_not():
    """Why the copying mode exists: a consumer that keeps every record (the
    kind of the exchange is the kind of the operator before it)."""
    fb = pytest.importorskip("pyflowbuf")
    if not hasattr(fb, "Environment"):
        pytest.skip("pipeline runtime not available")
    batches = [pa.record_batch({"id": np.arange(k * 200, (k + 1) * 200)}) for k in range(2000)]  # 1.6 KB each
    env = fb.Environment()
    s = env.from_iterable(iter(batches), kind="arrow").map(lambda b: b, kind=ArrowSerializer(zero_copy=False))
    kept = list(env.execute_iter(s.to_iterator()))
    assert len(kept) == 2000 and kept[-1].column(0)[0].as_py() == 1999 * 200
