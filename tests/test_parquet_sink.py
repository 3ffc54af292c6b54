"""write_parquet: records of every stream kind become Parquet rows, a batch that
does not fit the schema fails naming the column, and with checkpoints the
committed files hold exactly the rows of a run without failures."""
from __future__ import annotations

import collections
import os
import sys

import numpy as np
import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors.sinks import ParquetFileSink

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from test_checkpoints import FailOnce  # noqa: E402


def rows(path):
    """Every committed row, as dicts, in a stable order (the dataset reader
    skips files whose names start with '.' or '_')."""
    return sorted(pq.read_table(str(path)).to_pylist(), key=lambda r: tuple(map(str, r.values())))


def job_error(env, match):
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(30)
    cause = info.value.__cause__
    assert isinstance(cause, errors.RecordTypeError), repr(cause)
    assert "'out'" in str(cause)
    assert match in str(cause), str(cause)
    return cause


# ---------------------------------------------------------------- record kinds

def test_plain_records_one_file_per_subtask(tmp_path):
    env = fb.Environment(parallelism=2)
    env.from_sequence(0, 5000).write_parquet(tmp_path / "ints")
    env.from_iterable([f"s{i}" for i in range(50)]).write_parquet(tmp_path / "strs", parallelism=1)
    env.execute(30)
    assert sorted(os.listdir(tmp_path / "ints")) == ["part-00000-000000.parquet", "part-00001-000000.parquet"]
    table = pq.read_table(tmp_path / "ints")
    assert table.schema.names == ["value"] and table.schema.field("value").type == pa.int64()
    assert sorted(table.column("value").to_pylist()) == list(range(5000))
    assert sorted(r["value"] for r in rows(tmp_path / "strs")) == sorted(f"s{i}" for i in range(50))


def test_dicts_and_tuples(tmp_path):
    Point = collections.namedtuple("Point", "x label")
    env = fb.Environment()
    data = [{"id": i, "name": f"n{i}", "score": i / 2} for i in range(300)]
    data[7] = {"id": 7, "score": 3.5}                          # a missing key is a null
    env.from_iterable(data).write_parquet(tmp_path / "dicts")
    env.from_iterable([(i, str(i)) for i in range(20)]).write_parquet(tmp_path / "tuples")
    env.from_iterable([Point(i, str(i)) for i in range(20)]).write_parquet(tmp_path / "named")
    schema = pa.schema([("a", pa.int32()), ("b", pa.string())])
    env.from_iterable([(i, str(i)) for i in range(20)]).write_parquet(tmp_path / "declared", schema=schema)
    env.execute(30)
    got = pq.read_table(tmp_path / "dicts")
    assert got.schema.names == ["id", "name", "score"]
    assert sorted(got.to_pylist(), key=lambda r: r["id"]) == [dict({"name": None}, **d) for d in data]
    assert rows(tmp_path / "tuples") == sorted(({"f0": i, "f1": str(i)} for i in range(20)),
                                              key=lambda r: (str(r["f0"]), r["f1"]))
    assert pq.read_table(tmp_path / "named").schema.names == ["x", "label"]
    declared = pq.read_table(tmp_path / "declared")
    assert declared.schema.field("a").type == pa.int32()
    assert sorted(declared.column("a").to_pylist()) == list(range(20))


def test_arrow_batches_across_an_exchange(tmp_path):
    batches = [pa.record_batch({"x": np.arange(i * 500, (i + 1) * 500), "y": [f"v{j}" for j in range(500)]})
               for i in range(12)]
    env = fb.Environment(parallelism=2, chaining=False)
    env.from_iterable(batches).rebalance().write_parquet(tmp_path / "out", row_group_size=1000)
    env.execute(30)
    table = pq.read_table(tmp_path / "out")
    assert sorted(table.column("x").to_pylist()) == list(range(6000))
    for name in os.listdir(tmp_path / "out"):
        meta = pq.ParquetFile(tmp_path / "out" / name).metadata
        assert all(meta.row_group(i).num_rows <= 1000 for i in range(meta.num_row_groups))


def test_pandas_dataframes(tmp_path):
    pd = pytest.importorskip("pandas")
    frames = [pd.DataFrame({"k": np.arange(i * 10, i * 10 + 10), "v": np.linspace(0, 1, 10)},
                           index=np.arange(100, 110)) for i in range(8)]
    env = fb.Environment(parallelism=2)
    env.from_iterable(frames).write_parquet(tmp_path / "out")
    env.execute(30)
    table = pq.read_table(tmp_path / "out")
    assert table.schema.names == ["k", "v"]                   # the index is not a column
    assert sorted(table.column("k").to_pylist()) == list(range(80))


def test_numpy_rows(tmp_path):
    dt = np.dtype([("a", "i8"), ("b", "f8")])
    chunk = np.zeros(50, dtype=dt)
    chunk["a"] = np.arange(50)
    env = fb.Environment()
    env.from_arrays([chunk, chunk]).write_parquet(tmp_path / "out")
    env.execute(30)
    assert sorted(pq.read_table(tmp_path / "out").column("a").to_pylist()) == sorted(list(range(50)) * 2)


def test_small_batches_make_full_row_groups(tmp_path):
    env = fb.Environment(max_batch=10)
    env.from_sequence(0, 1000).write_parquet(tmp_path / "big")
    env.from_sequence(0, 1000).write_parquet(tmp_path / "small", row_group_size=100)
    env.execute(30)
    assert pq.ParquetFile(tmp_path / "big" / "part-00000-000000.parquet").metadata.num_row_groups == 1
    small = pq.ParquetFile(tmp_path / "small" / "part-00000-000000.parquet").metadata
    assert [small.row_group(i).num_rows for i in range(small.num_row_groups)] == [100] * 10


def test_empty_input_with_a_schema_leaves_the_schema(tmp_path):
    env = fb.Environment()
    schema = pa.schema([("x", pa.int64())])
    env.from_sequence(0, 0).write_parquet(tmp_path / "out", schema=schema, compression="zstd")
    env.execute(30)
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 0 and table.schema.equals(schema)


# ---------------------------------------------------------------- schema errors

def test_a_later_batch_that_does_not_fit_names_the_column(tmp_path):
    env = fb.Environment(max_batch=1)
    env.from_iterable([{"x": 1, "y": "a"}, {"x": "two", "y": "b"}]).write_parquet(tmp_path / "a", name="out")
    err = job_error(env, "column 'x'")
    assert err.column == "x" and "int64" in str(err)

    env = fb.Environment(max_batch=1)
    env.from_iterable([{"x": 1}, {"x": 2, "extra": 3}]).write_parquet(tmp_path / "b", name="out")
    assert job_error(env, "column 'extra'").column == "extra"

    env = fb.Environment(max_batch=1)
    batches = [pa.record_batch({"x": [1, 2]}), pa.record_batch({"x": [1.5, 2.0]})]   # 1.5 does not fit int64
    env.from_iterable(batches).write_parquet(tmp_path / "c", name="out")
    assert job_error(env, "column 'x'").column == "x"

    env = fb.Environment(max_batch=1)
    batches = [pa.record_batch({"x": [1], "y": [2]}), pa.record_batch({"x": [1]})]
    env.from_iterable(batches).write_parquet(tmp_path / "d", name="out")
    assert job_error(env, "is missing").column == "y"


def test_a_declared_schema_is_enforced(tmp_path):
    schema = pa.schema([pa.field("x", pa.int8(), nullable=False)])
    env = fb.Environment()
    env.from_sequence(0, 1000).write_parquet(tmp_path / "a", name="out", schema=schema)
    job_error(env, "column 'x'")                               # 128 does not fit int8

    env = fb.Environment()
    env.from_iterable([(1, 2)]).write_parquet(tmp_path / "b", name="out", schema=schema)
    job_error(env, "tuples of 1 fields")

    env = fb.Environment()
    env.from_iterable([{"x": None}]).write_parquet(tmp_path / "c", name="out", schema=schema)
    job_error(env, "not null")


def test_arguments_are_checked_when_declared(tmp_path):
    env = fb.Environment()
    s = env.from_sequence(0, 10)
    with pytest.raises(errors.ConfigurationError, match="row_group_size"):
        s.write_parquet(tmp_path, row_group_size=0)
    with pytest.raises(errors.ConfigurationError, match="compression"):
        s.write_parquet(tmp_path, compression="fastest")
    with pytest.raises(errors.ConfigurationError, match="schema"):
        s.write_parquet(tmp_path, schema="x long")
    assert env.nodes[-1].name != "write_parquet"


def test_without_pyarrow_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    env = fb.Environment()
    with pytest.raises(ImportError, match=r"pyflowbuf\[arrow\]"):
        env.from_sequence(0, 10).write_parquet(tmp_path)


# ---------------------------------------------------------------- checkpoints: exactly once

def counts_job(env, out, n, fail=None):
    """source -> map (may fail) -> running sum per key -> Parquet. One producer
    per reducer channel keeps each key's order, so the rows are deterministic."""
    (env.from_sequence(0, n, rate_limit=20_000)
        .map(fail or (lambda x: x), kind="int64", name="maybe_fail")
        .map(lambda x: (x % 7, x), kind="struct")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]), parallelism=2)
        .map(lambda kv: {"key": kv[0], "total": kv[1]}, kind="struct", parallelism=2)
        .write_parquet(out, parallelism=2))


def test_exactly_once_across_a_failure(tmp_path):
    n = 6000
    env = fb.Environment()
    counts_job(env, tmp_path / "plain", n)
    env.execute(60)
    want = rows(tmp_path / "plain")
    assert len(want) == n

    out = tmp_path / "out"
    os.makedirs(out)
    leftover = out / ".part-00001-000000.parquet.inprogress"   # what a crashed run left uncommitted
    leftover.write_bytes(b"not parquet")
    fail = FailOnce(2500)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", restart_attempts=2,
                         chaining=False)
    counts_job(env, out, n, fail)
    env.execute(120)
    assert fail.fired and env.last_execution.restarts == 1
    assert any(c["status"] == "completed" for c in env.checkpoints())
    assert rows(out) == want                                   # nothing lost, nothing twice
    names = os.listdir(out)
    assert not [f for f in names if f.startswith(".")]         # nothing uncommitted left
    assert all(f.startswith("part-0000") and f.endswith(".parquet") and f.count("-") == 2 for f in names)
    assert len(names) > 2                                      # parts rolled at checkpoints


def test_a_restored_subtask_keeps_the_schema_of_its_committed_files(tmp_path):
    first = ParquetFileSink("out", tmp_path, transactional=True)
    first.open(0, 1)
    first.write([{"x": 1}])
    state = first.snapshot_state()
    actions = first.prepare_commit(1)
    assert [a[0] for a in actions] == ["rename"] and state["schema"]

    again = ParquetFileSink("out", tmp_path, transactional=True)
    again.restore_state([first.snapshot_state()])
    again.open(0, 1)
    assert again.seq == 1 and again.schema.equals(first.schema)
    with pytest.raises(errors.RecordTypeError, match="column 'x'"):
        again.write([{"x": "one"}])


def test_a_part_of_empty_batches_still_commits_a_file(tmp_path):
    sink = ParquetFileSink("out", tmp_path, transactional=True)
    sink.open(0, 1)
    sink.write([pa.record_batch({"x": pa.array([], pa.int64())})])
    sink.commit(sink.prepare_commit(-1))
    assert os.listdir(tmp_path) == ["part-00000-000000.parquet"]
    assert pq.read_table(tmp_path).schema.names == ["x"]
