"""File connectors: read_parquet and read_csv give every row of their files
exactly once over any parallelism, in file order per subtask, rewind exactly
to a checkpoint's position, and name the file and place of bad input;
print() writes records as PyFlink's print does."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import connectors, errors
from pyflowbuf.connectors import FileFormatError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pacsv = pytest.importorskip("pyarrow.csv")

from test_checkpoints import FailOnce  # noqa: E402

SCHEMA = pa.schema([("id", pa.int64()), ("n", pa.int64()), ("x", pa.float64()), ("s", pa.string())])
HYP = settings(max_examples=int(os.environ.get("PYFLOWBUF_CONNECTOR_EXAMPLES", "25")), deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# CSV splits at line ends: no line breaks inside values there
_CSV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def tables(draw, text=_TEXT, max_rows=250):
    """A table of random ints, floats and strings, each with nulls, and a
    unique increasing ``id`` to find rows by."""
    n = draw(st.integers(0, max_rows))
    ints = st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1))
    floats = st.one_of(st.none(), st.floats(allow_nan=False))
    strs = st.one_of(st.none(), text)
    return pa.table({"id": list(range(n)), "n": draw(st.lists(ints, min_size=n, max_size=n)),
                     "x": draw(st.lists(floats, min_size=n, max_size=n)),
                     "s": draw(st.lists(strs, min_size=n, max_size=n))}, schema=SCHEMA)


def split_files(table, nfiles):
    """Consecutive slices of ``table``, one per file, so file order is id order."""
    n = table.num_rows
    cuts = [n * i // nfiles for i in range(nfiles + 1)]
    return [table.slice(cuts[i], cuts[i + 1] - cuts[i]) for i in range(nfiles)]


def write_parquet_files(directory, table, nfiles, row_group_size):
    os.makedirs(directory, exist_ok=True)
    for i, part in enumerate(split_files(table, nfiles)):
        pq.write_table(part, os.path.join(directory, f"part-{i:03d}.parquet"), row_group_size=row_group_size)
    return str(directory)


def write_csv_files(directory, table, nfiles):
    os.makedirs(directory, exist_ok=True)
    for i, part in enumerate(split_files(table, nfiles)):
        pacsv.write_csv(part, os.path.join(directory, f"part-{i:03d}.csv"))
    return str(directory)


def as_dicts(mode, records, names=SCHEMA.names):
    if mode == "records":
        return list(records)
    if mode == "tuples":
        return [dict(zip(names, r)) for r in records]
    if mode == "pandas":
        return [r for df in records for r in pa.Table.from_pandas(df, preserve_index=False).to_pylist()]
    return [r for b in records for r in b.to_pylist()]


def parquet_units_reference(directory, parallelism):
    """Plain Python: what subtask i reads, in order: every parallelism-th row
    group of the sorted files, from i."""
    units = []
    for name in sorted(os.listdir(directory)):
        pf = pq.ParquetFile(os.path.join(directory, name))
        for g in range(pf.metadata.num_row_groups):
            units.append(pf.read_row_group(g).to_pylist())
    return [[r for u in units[i::parallelism] for r in u] for i in range(parallelism)]


def parts(handle):
    return [handle._parts.get(i, []) for i in range(max(handle._parts, default=-1) + 1)]


# ---------------------------------------------------------------- round trips

@HYP
@given(table=tables(), nfiles=st.integers(1, 3), row_group_size=st.integers(1, 80),
       parallelism=st.integers(1, 3), mode=st.sampled_from(["records", "tuples", "arrow"]),
       batch_size=st.integers(1, 100))
def test_parquet_rows_reach_their_subtask_in_file_order(tmp_path_factory, table, nfiles, row_group_size,
                                                        parallelism, mode, batch_size):
    d = write_parquet_files(tmp_path_factory.mktemp("pq"), table, nfiles, row_group_size)
    env = fb.Environment(parallelism=parallelism)
    h = env.read_parquet(d, as_=mode, batch_size=batch_size).collect()
    env.execute(60)
    got = [as_dicts(mode, p) for p in parts(h)]
    want = parquet_units_reference(d, parallelism)
    assert got + [[]] * (parallelism - len(got)) == want
    if mode == "arrow":
        assert all(b.num_rows <= batch_size and b.schema.equals(SCHEMA) for p in parts(h) for b in p)


@HYP
@given(table=tables(text=_CSV_TEXT), nfiles=st.integers(1, 3), parallelism=st.integers(1, 3),
       block_size=st.integers(1024, 4096), mode=st.sampled_from(["records", "tuples", "arrow"]),
       batch_size=st.integers(1, 100))
def test_csv_gives_every_row_once_in_file_order_per_subtask(tmp_path_factory, table, nfiles, parallelism,
                                                           block_size, mode, batch_size):
    d = write_csv_files(tmp_path_factory.mktemp("csv"), table, nfiles)
    env = fb.Environment(parallelism=parallelism)
    h = env.read_csv(d, as_=mode, column_types=SCHEMA, block_size=block_size, batch_size=batch_size).collect()
    env.execute(60)
    got = [as_dicts(mode, p) for p in parts(h)]
    for p in got:     # a subtask reads its lines in file order, and the files in id order
        ids = [r["id"] for r in p]
        assert ids == sorted(ids)
    assert sorted((r for p in got for r in p), key=lambda r: r["id"]) == table.to_pylist()


def test_csv_infers_types_from_the_first_rows_and_reads_the_header(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("word,count,score,note\nb,1,0.5,\nc,2,1.5,\"\"\na,3,,x\n")
    env = fb.Environment()
    h = env.read_csv(path).collect()
    env.execute(30)
    assert h.result == [{"word": "b", "count": 1, "score": 0.5, "note": None},
                        {"word": "c", "count": 2, "score": 1.5, "note": ""},
                        {"word": "a", "count": 3, "score": None, "note": "x"}]
    env = fb.Environment()
    h = env.read_csv(path, columns=["count", "word"], as_="tuples").collect()
    env.execute(30)
    assert h.result == [(1, "b"), (2, "c"), (3, "a")]


def test_csv_without_header_takes_names_or_numbers_them(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("1,a\n2,b\r\n3,c")            # CRLF and no line end at the end
    env = fb.Environment()
    h1 = env.read_csv(path, header=False, as_="tuples").collect()
    h2 = env.read_csv(path, header=False, column_names=["k", "v"]).collect()
    env.execute(30)
    assert h1.result == [(1, "a"), (2, "b"), (3, "c")]
    assert h2.result == [{"k": 1, "v": "a"}, {"k": 2, "v": "b"}, {"k": 3, "v": "c"}]


def test_csv_column_names_rename_the_headers_of_every_file(tmp_path):
    (tmp_path / "1.csv").write_text("a,b\n1,x\n")
    (tmp_path / "2.csv").write_text("a,b\n2,y\n")
    env = fb.Environment()
    h = env.read_csv(tmp_path, column_names=["k", "v"]).collect()
    env.execute(30)
    assert h.result == [{"k": 1, "v": "x"}, {"k": 2, "v": "y"}]


def test_empty_csv_files_have_no_rows_and_all_empty_is_an_error(tmp_path):
    (tmp_path / "0.csv").write_bytes(b"")
    (tmp_path / "1.csv").write_text("a,b\n1,x\n")
    (tmp_path / "2.csv").write_bytes(b"")
    (tmp_path / "3.csv").write_text("a,b\n")
    env = fb.Environment(parallelism=2)
    h = env.read_csv(tmp_path).collect()
    env.execute(30)
    assert h.result == [{"a": 1, "b": "x"}]
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "0.csv").write_bytes(b"")
    with pytest.raises(FileFormatError, match="every file is empty"):
        fb.Environment().read_csv(tmp_path / "e")


def test_read_parquet_takes_a_glob_a_list_and_columns_and_pandas(tmp_path):
    t = pa.table({"a": [1, 2, 3, 4], "b": ["w", "x", "y", "z"]})
    pq.write_table(t.slice(0, 2), tmp_path / "one.parquet")
    pq.write_table(t.slice(2), tmp_path / "two.parquet")
    (tmp_path / ".hidden.parquet").write_bytes(b"not parquet")     # skipped, as readers skip it
    env = fb.Environment()
    g = env.read_parquet(str(tmp_path / "*.parquet"), columns=["b"], as_="tuples").collect()
    ls = env.read_parquet([tmp_path / "two.parquet", tmp_path / "one.parquet"]).collect()
    pd_ = env.read_parquet(tmp_path, as_="pandas", batch_size=1).collect()
    env.execute(30)
    assert g.result == [("w",), ("x",), ("y",), ("z",)]
    assert ls.result == t.slice(2).to_pylist() + t.slice(0, 2).to_pylist()
    assert [df.to_dict("records") for df in pd_.result] == [[r] for r in t.to_pylist()]


def test_kinds_plain_values_travel_as_struct_others_as_pickle(tmp_path):
    import datetime

    pq.write_table(pa.table({"a": [1], "l": [[1.5, None]], "st": [{"k": "v"}]}), tmp_path / "plain.parquet")
    pq.write_table(pa.table({"t": [datetime.datetime(2024, 1, 1)]}), tmp_path / "ts.parquet")
    env = fb.Environment()
    assert env.read_parquet(tmp_path / "plain.parquet").node.kind == "struct"
    assert env.read_parquet(tmp_path / "ts.parquet", as_="tuples").node.kind == "pickle"
    assert env.read_parquet(tmp_path / "ts.parquet", as_="arrow").node.kind == "arrow"


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_workers_read_their_share_and_the_driver_collects_all(tmp_path, fmt):
    table = pa.table({"id": list(range(3000)), "s": [f"v{i % 17}" for i in range(3000)]})
    if fmt == "parquet":
        write_parquet_files(tmp_path / "in", table, 2, 400)
    else:
        write_csv_files(tmp_path / "in", table, 2)
    env = fb.Environment(workers=2, parallelism=2)
    src = env.read_parquet(tmp_path / "in") if fmt == "parquet" else env.read_csv(tmp_path / "in", block_size=4096)
    h = src.map(lambda r: (r["id"], r["s"]), kind="struct").collect()
    env.execute(120)
    assert sorted(h.result) == [(r["id"], r["s"]) for r in table.to_pylist()]


def test_read_parquet_then_write_parquet_round_trips(tmp_path):
    table = pa.table({"id": list(range(500)), "x": [None if i % 3 == 0 else i / 7 for i in range(500)],
                      "s": [None if i % 4 == 0 else str(i) for i in range(500)]})
    write_parquet_files(tmp_path / "in", table, 2, 64)
    for mode in ("records", "arrow"):
        env = fb.Environment(parallelism=2)
        # dicts carry no types: the sink takes its schema from the first batch
        # (a first row with x None would make x a null column), so pass it;
        # arrow batches carry their schema
        schema = table.schema if mode == "records" else None
        env.read_parquet(tmp_path / "in", as_=mode).write_parquet(tmp_path / mode, schema=schema)
        env.execute(60)
        back = pq.read_table(tmp_path / mode).sort_by("id")
        assert back.equals(table), mode
        # and the written directory reads back through read_parquet
        env = fb.Environment()
        h = env.read_parquet(tmp_path / mode).collect()
        env.execute(60)
        assert sorted(h.result, key=lambda r: r["id"]) == table.to_pylist()


# ---------------------------------------------------------------- positions

def read_all(src, sizes):
    out, i = [], 0
    while True:
        b = src.next_batch(sizes[i % len(sizes)])
        i += 1
        if b is None:
            return out
        out.extend(b)


@HYP
@given(table=tables(text=_CSV_TEXT, max_rows=200), fmt=st.sampled_from(["parquet", "csv"]),
       nfiles=st.integers(1, 3), parallelism=st.integers(1, 3), data=st.data(),
       mode=st.sampled_from(["records", "arrow"]), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_a_source_sought_to_a_position_reads_exactly_the_rest(tmp_path_factory, table, fmt, nfiles, parallelism,
                                                             data, mode, sizes):
    tmp = tmp_path_factory.mktemp("pos")
    if fmt == "parquet":
        d = write_parquet_files(tmp, table, nfiles, data.draw(st.integers(1, 50)))
        factory, _ = connectors.parquet_source(d, as_=mode, batch_size=data.draw(st.integers(1, 30)))
    else:
        d = write_csv_files(tmp, table, nfiles)
        factory, _ = connectors.csv_source(d, as_=mode, column_types=SCHEMA, block_size=1024,
                                           batch_size=data.draw(st.integers(1, 30)))
    subtask = data.draw(st.integers(0, parallelism - 1))
    first = factory()
    first.open(subtask, parallelism)
    whole = as_dicts(mode, read_all(first, sizes))
    first.close()
    pulls = data.draw(st.integers(0, 12))
    src = factory()
    src.open(subtask, parallelism)
    head = []
    for i in range(pulls):
        b = src.next_batch(sizes[i % len(sizes)])
        if b is None:
            break
        head.extend(b)
    position = src.position()
    assert all(type(v) is int for v in position)          # plain data for the checkpoint
    src.close()
    again = factory()
    again.open(subtask, parallelism)
    again.seek(list(position))          # as it comes back from checkpoint storage
    rest = as_dicts(mode, read_all(again, sizes))
    again.close()
    assert as_dicts(mode, head) + rest == whole


def test_a_position_of_another_subtask_or_file_listing_is_refused(tmp_path):
    d = write_parquet_files(tmp_path / "in", pa.table({"id": list(range(100))}), 1, 10)
    factory, _ = connectors.parquet_source(d)
    src = factory()
    src.open(0, 2)
    with pytest.raises(errors.ConfigurationError, match="parallelism"):
        src.seek((0, 1, 0))            # row group 1 is subtask 1's
    for bad in ("nonsense", (0, -1, 0), (0, 0, 1.5)):
        with pytest.raises(errors.ConfigurationError, match="position"):
            src.seek(bad)


# ---------------------------------------------------------------- exactly once across failures

def test_read_parquet_to_write_parquet_is_exactly_once_across_a_failure(tmp_path):
    n = 6000
    table = pa.table({"id": list(range(n)), "s": [f"s{i % 13}" for i in range(n)]})
    write_parquet_files(tmp_path / "in", table, 3, 250)
    fail = FailOnce(2500)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    (env.read_parquet(tmp_path / "in", rate_limit=20_000)
        .map(fail, kind="struct")
        .write_parquet(tmp_path / "out"))
    env.execute(120)
    assert fail.fired and env.last_execution.restarts == 1
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    assert done
    assert pq.read_table(tmp_path / "out").sort_by("id").equals(table)     # nothing lost, nothing twice
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".")]


def test_read_csv_is_exactly_once_across_a_failure(tmp_path):
    n = 6000
    table = pa.table({"id": list(range(n)), "s": [f"s,{i % 13}" for i in range(n)]})
    write_csv_files(tmp_path / "in", table, 2)
    fail = FailOnce(3100)
    env = fb.Environment(parallelism=3, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=False)
    h = (env.read_csv(tmp_path / "in", rate_limit=20_000, block_size=2048)
            .map(fail, kind="struct")
            .map(lambda r: (r["id"], r["s"]), kind="struct")
            .collect())
    env.execute(120)
    assert fail.fired and env.last_execution.restarts == 1
    assert collections.Counter(h.result) == collections.Counter((r["id"], r["s"]) for r in table.to_pylist())


RESUME = textwrap.dedent("""
    import os, sys
    import pyflowbuf as fb
    src, chk, out, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    seen = []
    def maybe_die(r):
        seen.append(r["id"])
        # dies (no cleanup) past kill_at once a checkpoint is complete: the
        # first one of a fresh process can take a few hundred ms
        if kill_at and r["id"] >= kill_at and any(c["status"] == "completed" for c in env.checkpoints()):
            os._exit(17)
        return r
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=chk, chaining=False)
    (env.read_parquet(src, batch_size=100, rate_limit=2500)
        .map(maybe_die, kind="struct")
        .write_parquet(out))
    env.execute(120, restore_from="latest")
    print("first", min(seen), "count", len(seen))
""")


def test_a_new_process_resumes_reading_parquet_mid_file_from_the_checkpoint(tmp_path):
    n = 5000
    table = pa.table({"id": list(range(n)), "x": [i * 0.25 for i in range(n)]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=2000)
    script = tmp_path / "job.py"
    script.write_text(RESUME)
    args = [str(tmp_path / "in.parquet"), str(tmp_path / "chk"), str(tmp_path / "out")]
    run = lambda kill: subprocess.run([sys.executable, str(script), *args, str(kill)],  # noqa: E731
                                      capture_output=True, text=True, timeout=180)
    first = run(2500)
    assert first.returncode == 17, first.stderr
    from pyflowbuf.checkpoint import CheckpointStorage
    assert CheckpointStorage(str(tmp_path / "chk")).latest() is not None
    second = run(0)
    assert second.returncode == 0, second.stderr
    # it read on from the checkpoint, not from the start
    first_id, count = int(second.stdout.split()[1]), int(second.stdout.split()[3])
    assert 0 < first_id < n and count == n - first_id
    assert pq.read_table(tmp_path / "out").sort_by("id").equals(table)


# ---------------------------------------------------------------- bad input

def test_missing_files_are_refused_where_the_stream_is_declared(tmp_path):
    env = fb.Environment()
    for read in (env.read_parquet, env.read_csv):
        with pytest.raises(FileNotFoundError, match="no such file"):
            read(tmp_path / "nope")
        with pytest.raises(FileNotFoundError, match="no file matches"):
            read(str(tmp_path / "*.nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no data files"):
        env.read_parquet(tmp_path / "empty")


def test_a_file_that_is_not_parquet_is_a_format_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but then nothing useful at all")
    with pytest.raises(FileFormatError, match="bad.parquet.*not a readable Parquet file"):
        fb.Environment().read_parquet(tmp_path / "bad.parquet")


def test_a_parquet_file_corrupted_after_declaration_fails_the_job_naming_it(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"s": [f"value {i}" * 5 for i in range(2000)]}), path, compression="snappy",
                   row_group_size=1000)
    env = fb.Environment()
    env.read_parquet(path).collect()
    data = bytearray(path.read_bytes())
    data[200:2000] = b"\xff" * 1800          # the first row group's pages, the footer intact
    path.write_bytes(bytes(data))
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(30)
    cause = info.value.__cause__
    assert isinstance(cause, FileFormatError), repr(cause)
    assert "t.parquet" in str(cause) and "row group 0" in str(cause)


def test_parquet_files_of_different_schemas_or_missing_columns_are_refused(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"a": ["x"]}), tmp_path / "2.parquet")
    env = fb.Environment()
    with pytest.raises(FileFormatError, match="2.parquet has the schema"):
        env.read_parquet(tmp_path)
    with pytest.raises(errors.ConfigurationError, match="no column 'b'"):
        env.read_parquet(tmp_path / "1.parquet", columns=["b"])


def test_a_csv_row_with_the_wrong_column_count_fails_naming_file_and_line(tmp_path):
    path = tmp_path / "t.csv"
    lines = ["a,b,c"] + [f"{i},{i},{i}" for i in range(3000)]
    lines[2001] = "1,2"
    path.write_text("\n".join(lines) + "\n")
    env = fb.Environment()
    env.read_csv(path, block_size=4096).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(30)
    cause = info.value.__cause__
    assert isinstance(cause, FileFormatError), repr(cause)
    msg = str(cause)
    assert "t.csv" in msg and "Expected 3 columns" in msg
    line = int(msg.split("from line ")[1].split()[0])
    assert line <= 2002 < line + 4096 // 6                  # the block that holds line 2002


def test_a_csv_value_of_another_type_than_the_first_rows_fails_with_a_hint(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("n\n" + "".join(f"{i}\n" for i in range(2000)) + "1.5\n")
    env = fb.Environment()
    env.read_csv(path, block_size=1024).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(30)
    assert isinstance(info.value.__cause__, FileFormatError)
    assert "column_types" in str(info.value.__cause__)
    env = fb.Environment()
    h = env.read_csv(path, block_size=1024, column_types={"n": "double"}).collect()
    env.execute(30)
    assert h.result[-1] == {"n": 1.5} and len(h.result) == 2001


def test_csv_files_with_different_headers_are_refused(tmp_path):
    (tmp_path / "1.csv").write_text("a,b\n1,2\n")
    (tmp_path / "2.csv").write_text("a,c\n1,2\n")
    env = fb.Environment()
    env.read_csv(tmp_path).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(30)
    assert isinstance(info.value.__cause__, FileFormatError)
    assert "2.csv has the header ['a', 'c']" in str(info.value.__cause__)


def test_arguments_are_checked_when_declared(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("a\n1\n")
    env = fb.Environment()
    bad = [dict(as_="rows"), dict(batch_size=0), dict(columns="a"), dict(columns=[]), dict(parallelism=0)]
    for kw in bad:
        with pytest.raises(errors.ConfigurationError):
            env.read_parquet(tmp_path / "t.parquet", **kw)
        with pytest.raises(errors.ConfigurationError):
            env.read_csv(tmp_path / "t.csv", **kw)
    for kw in (dict(block_size=10), dict(header="yes"), dict(column_types={"a": "no such type"}),
               dict(column_types={"zz": "int64"}), dict(column_names=["a", "b"]), dict(delimiter="")):
        with pytest.raises(errors.ConfigurationError):
            env.read_csv(tmp_path / "t.csv", **kw)
    with pytest.raises(errors.ConfigurationError):
        env.read_parquet(42)
    assert env.nodes == []


# ---------------------------------------------------------------- print

def test_print_writes_records_as_pyflink_does(capsys):
    env = fb.Environment()
    env.from_collection([1, 2, 3]).print()
    env.from_collection(["a"]).print("out")
    env.execute(30)
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(["1", "2", "3", "out> a"])

    env = fb.Environment(parallelism=2)
    env.from_collection(list(range(10))).rebalance().print()
    env.from_collection(["x", "y"]).rebalance().print("p")
    env.execute(30)
    lines = capsys.readouterr().out.splitlines()
    plain = [ln for ln in lines if not ln.startswith("p")]
    assert sorted(int(ln.split("> ")[1]) for ln in plain) == list(range(10))
    assert {ln.split("> ")[0] for ln in plain} <= {"1", "2"}
    assert sorted(ln for ln in lines if ln.startswith("p")) in (["p:1> x", "p:2> y"], ["p:1> y", "p:2> x"],
                                                                  ["p:1> x", "p:1> y"], ["p:2> x", "p:2> y"])
    with pytest.raises(errors.ConfigurationError):
        env.from_collection([1]).print(prefix=3)


def test_print_from_worker_processes_reaches_stdout(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import pyflowbuf as fb
        env = fb.Environment(workers=2, parallelism=2)
        env.from_sequence(0, 6, parallelism=2).print("n")
        env.execute(60)
    """))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("n:"))
    assert sorted(int(ln.split("> ")[1]) for ln in lines) == list(range(6))
    assert {ln.split("> ")[0] for ln in lines} == {"n:1", "n:2"}


def test_connector_warnings_stay_quiet(tmp_path):
    pq.write_table(pa.table({"a": list(range(10))}), tmp_path / "t.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = fb.Environment(workers=2, parallelism=2)
        h = env.read_parquet(tmp_path / "t.parquet").print()
        env.execute(60)
    assert isinstance(h, fb.DataSink)        # (print ends the stream; its handle names it)


# ---- issue 18, item 3: byte-order marks, text that is not UTF-8, CSV nulls and quoted line breaks

def _read(build, timeout=60):
    env = fb.Environment()
    h = build(env).collect()
    env.execute(timeout=timeout)
    return h.result


def test_read_text_strips_a_utf8_byte_order_mark_like_read_csv(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello\nworld\n")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfa,b\n1,x\n")
    assert _read(lambda env: env.read_text(str(tmp_path / "bom.txt"))) == ["hello", "world"]
    assert _read(lambda env: env.read_csv(str(tmp_path / "bom.csv"))) == [{"a": 1, "b": "x"}]


def test_read_text_that_is_not_utf8_names_file_line_and_encoding(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("ok\nstill ok\ncaf\xe9\n".encode("latin-1"))
    env = fb.Environment()
    env.read_text(str(path)).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=30)
    cause = info.value.__cause__
    assert isinstance(cause, FileFormatError) and isinstance(cause, ValueError)
    assert str(path) in str(cause) and "line 3" in str(cause) and "encoding=" in str(cause)
    assert _read(lambda env: env.read_text(str(path), encoding="latin-1")) == ["ok", "still ok", "caf\xe9"]


def test_a_parquet_file_read_as_text_or_csv_is_a_file_format_error(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"a": list(range(50)), "b": ["x"] * 50}), path)
    with pytest.raises(FileFormatError, match="read_parquet"):
        fb.Environment().read_csv(path)
    env = fb.Environment()
    env.read_text(path).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=30)
    assert isinstance(info.value.__cause__, FileFormatError) and path in str(info.value.__cause__)


def test_a_csv_column_that_is_not_utf8_is_refused_not_bytes(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("a,b\n1,ok\n2,caf\xe9\n".encode("latin-1"))
    with pytest.raises(FileFormatError, match=r"line 3.*'b'.*binary"):
        fb.Environment().read_csv(str(path))
    got = _read(lambda env: env.read_csv(str(path), column_types={"b": "binary"}))
    assert got == [{"a": 1, "b": b"ok"}, {"a": 2, "b": b"caf\xe9"}]


def test_csv_null_markers_are_text_only_the_unquoted_empty_field_is_none(tmp_path):
    path = tmp_path / "na.csv"
    path.write_text('a,s\n1,NA\n2,null\n3,N/A\n4,#N/A\n5,NaN\n6,\n7,""\n8,x\n')
    got = _read(lambda env: env.read_csv(str(path)))
    assert [r["s"] for r in got] == ["NA", "null", "N/A", "#N/A", "NaN", None, "", "x"]


def test_a_header_only_csv_without_final_newline_has_no_rows(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("a,b")
    assert _read(lambda env: env.read_csv(str(path))) == []


_CELL = st.text(alphabet='ab,"\n x', max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(0, 9), _CELL), min_size=1, max_size=60))
def test_csv_gives_the_same_rows_at_every_parallelism_or_refuses(tmp_path_factory, rows):
    # a quoted line break gave 21 rows at parallelism 3 (a truncated value and a
    # phantom row) and 20 at parallelism 1 and 2
    import csv
    import io
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["a", "b"])
    w.writerows(rows)
    path = tmp_path_factory.mktemp("csv") / "rows.csv"
    path.write_text(buf.getvalue())
    want = [{"a": a, "b": b if b != "" else None} for a, b in rows]
    outcomes = []
    for p in (1, 2, 3, 4):
        try:
            got = _read(lambda env: env.read_csv(str(path), parallelism=p, block_size=1024,
                                                 column_types={"a": "int64", "b": "string"}))
            outcomes.append(sorted(got, key=repr))
        except (errors.JobFailedError, FileFormatError) as exc:
            cause = exc.__cause__ if isinstance(exc, errors.JobFailedError) else exc
            assert isinstance(cause, FileFormatError), repr(cause)
            outcomes.append("refused")
    assert all(o == outcomes[0] for o in outcomes), outcomes
    # refused exactly when a value holds a line break; read right otherwise
    assert (outcomes[0] == "refused") == any("\n" in b for _, b in rows)
    if outcomes[0] != "refused":
        assert outcomes[0] == sorted(want, key=repr)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(0, 9), st.text(alphabet='ab" x', max_size=6)), min_size=1, max_size=60))
def test_csv_quotes_inside_unquoted_fields_are_plain_characters_at_every_parallelism(tmp_path_factory, rows):
    # 12" screen: a quote that does not open a field is text, not a quoted line break
    rows = [(a, "x" + b) for a, b in rows]
    path = tmp_path_factory.mktemp("csv") / "rows.csv"
    path.write_text("a,b\n" + "".join(f"{a},{b}\n" for a, b in rows))
    want = sorted(({"a": a, "b": b} for a, b in rows), key=repr)
    for p in (1, 2, 3):
        got = _read(lambda env: env.read_csv(str(path), parallelism=p, block_size=1024,
                                             column_types={"a": "int64", "b": "string"}))
        assert sorted(got, key=repr) == want, p


# ---------------------------------------------------------------- fsspec URLs

fsspec = pytest.importorskip("fsspec")


def _copy_tree_to(local_dir, url):
    fs, root = fsspec.core.url_to_fs(url)
    for name in sorted(os.listdir(local_dir)):
        with open(os.path.join(local_dir, name), "rb") as src, fs.open(f"{root}/{name}", "wb") as dst:
            dst.write(src.read())


def _read_all(where, fmt, parallelism=2, **env_kw):
    env = fb.Environment(parallelism=parallelism, **env_kw)
    if fmt == "parquet":
        s = env.read_parquet(where, batch_size=97)
    elif fmt == "csv":
        s = env.read_csv(where, block_size=2048)
    else:
        s = env.read_text(where, parallelism=parallelism, monitor=0.05, monitor_timeout=0.6)
    h = (s.map(lambda r: r if isinstance(r, str) else (r["id"], r["s"]), kind="struct").collect())
    env.execute(120)
    return collections.Counter(h.result)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "text"])
def test_file_sources_read_an_fsspec_url_as_a_local_directory(tmp_path, memory_root, fmt):
    """Differential: the same files as a local directory, as memory:// (in
    one process) and as file:// (read by worker processes) give the same rows;
    text goes through a monitored directory."""
    table = pa.table({"id": list(range(2500)), "s": [f"v,{i % 17}" for i in range(2500)]})
    local = tmp_path / "in"
    if fmt == "parquet":
        write_parquet_files(local, table, 3, 300)
    elif fmt == "csv":
        write_csv_files(local, table, 3)
    else:
        os.makedirs(local)
        for i in range(3):
            (local / f"f{i}.txt").write_text("".join(f"line {j}\n" for j in range(i * 100, i * 100 + 100)))
    want = _read_all(str(local), fmt)
    assert sum(want.values()) == (300 if fmt == "text" else 2500)
    _copy_tree_to(local, f"memory://{memory_root}/in")
    assert _read_all(f"memory://{memory_root}/in", fmt) == want
    if hasattr(os, "fork"):
        assert _read_all(local.as_uri(), fmt, workers=2) == want


def test_read_text_of_one_fsspec_file_and_its_position(memory_root):
    from pyflowbuf.connectors.sources import TextFileSource

    fs = fsspec.filesystem("memory")
    with fs.open(f"{memory_root}/a.txt", "wb") as f:
        f.write(b"\xef\xbb\xbfalpha\nbeta\r\ngamma")
    env = fb.Environment()
    h = env.read_text(f"memory://{memory_root}/a.txt").collect()
    env.execute(30)
    assert h.result == ["alpha", "beta", "gamma"]
    # bounded by a size, as a monitored source reads a file found complete
    src = TextFileSource(f"memory://{memory_root}/a.txt", end=12)
    src.open(0, 1)
    assert src.next_batch(10) == ["alpha", "bet"] and src.position() == 12
    src.seek(9)
    assert src.identity()["path"] == f"memory://{memory_root}/a.txt"
    src.close()
    with pytest.raises(FileNotFoundError):
        fb.Environment().read_text(f"memory://{memory_root}/missing.txt")


def test_read_csv_over_an_fsspec_url_is_exactly_once_across_a_failure(tmp_path):
    n = 6000
    table = pa.table({"id": list(range(n)), "s": [f"s,{i % 13}" for i in range(n)]})
    write_csv_files(tmp_path / "in", table, 2)
    fail = FailOnce(3100)
    env = fb.Environment(parallelism=3, checkpoint_interval=0.02, checkpoint_dir=(tmp_path / "chk").as_uri(),
                         restart_attempts=2, chaining=False)
    h = (env.read_csv((tmp_path / "in").as_uri(), rate_limit=20_000, block_size=2048)
            .map(fail, kind="struct")
            .map(lambda r: (r["id"], r["s"]), kind="struct")
            .collect())
    env.execute(120)
    assert fail.fired and env.last_execution.restarts == 1
    assert collections.Counter(h.result) == collections.Counter((r["id"], r["s"]) for r in table.to_pylist())


def test_a_bounded_line_from_a_file_whose_readline_takes_no_limit():
    """fsspec's buffered files (s3, gcs, http) have readline() without a
    size: the bound of a monitored file's last line is kept all the same."""
    import io

    from pyflowbuf.connectors.sources import _readline

    class NoLimit(io.BytesIO):
        def readline(self):
            return super().readline()

    f = NoLimit(b"abcdef\nxy")
    assert _readline(f, 3) == b"abc" and f.tell() == 3
    assert _readline(f, 10) == b"def\n" and f.tell() == 7
    assert _readline(f, 10) == b"xy"
