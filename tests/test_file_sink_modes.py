"""write_text / write_parquet into a directory that already holds output:
``mode="error"`` (default) refuses it before anything runs, ``"overwrite"``
replaces it, ``"append"`` adds parts whose names cannot collide. One layout
whatever the settings: ``path/part-<subtask>-<seq><suffix>``."""
from __future__ import annotations

import collections
import glob
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import read_parts
from pyflowbuf import errors

pq = pytest.importorskip("pyarrow.parquet")


def parquet_rows(path):
    return sorted(r["value"] for r in pq.read_table(str(path)).to_pylist())


def write(sink, out, values, p, mode=None, **env_kw):
    env = fb.Environment(parallelism=p, **env_kw)
    kw = {} if mode is None else {"mode": mode}
    s = env.from_iterable(list(values), kind="int64").rebalance()
    if sink == "parquet":
        s.write_parquet(out, parallelism=p, **kw)
    else:
        s.write_text(out, parallelism=p, **kw)
    env.execute(60)
    return env


def read(sink, out):
    return parquet_rows(out) if sink == "parquet" else sorted(int(x) for x in read_parts(out))


@pytest.mark.parametrize("sink", ["parquet", "text"])
def test_a_rerun_with_other_parallelism_into_the_same_directory(tmp_path, sink):
    out = tmp_path / "out"
    write(sink, out, range(10), 3)
    assert read(sink, out) == list(range(10))
    before = sorted(os.listdir(out))
    # default: refused before anything runs, nothing touched
    with pytest.raises(errors.OutputExistsError, match="mode='overwrite'") as info:
        write(sink, out, range(100, 106), 1)
    assert isinstance(info.value, FileExistsError) and isinstance(info.value, errors.ConfigurationError)
    assert sorted(os.listdir(out)) == before
    # overwrite: exactly the new rows
    write(sink, out, range(100, 106), 1, mode="overwrite")
    assert read(sink, out) == list(range(100, 106))
    # append: both runs' rows, and no part name reused
    names = set(os.listdir(out))
    write(sink, out, range(200, 210), 3, mode="append")
    assert read(sink, out) == list(range(100, 106)) + list(range(200, 210))
    assert names < set(os.listdir(out))


@pytest.mark.parametrize("sink", ["parquet", "text"])
@pytest.mark.parametrize("checkpoints", [False, True])
def test_one_layout_whatever_the_settings(tmp_path, sink, checkpoints):
    out = tmp_path / "out"
    kw = dict(checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk") if checkpoints else {}
    for p in (1, 2):
        write(sink, out, range(50), p, mode="overwrite", **kw)
        names = os.listdir(out)
        suffix = ".parquet" if sink == "parquet" else ".txt"
        assert names and all(n.startswith("part-") and n.endswith(suffix) and n.count("-") == 2 for n in names)
        assert {n.split("-")[1] for n in names} == {f"{i:05d}" for i in range(p)}
        assert read(sink, out) == list(range(50))


def test_hidden_leftovers_do_not_count_as_output(tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)
    (out / ".part-00000-000000.txt.inprogress").write_text("a crashed run's\n")
    (out / "_SUCCESS").write_text("")
    write("text", out, range(5), 1)
    assert read("text", out) == list(range(5))


def test_a_path_that_is_a_file(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("old layout\n")
    with pytest.raises(errors.OutputExistsError, match="not a directory"):
        write("text", out, range(5), 1)
    with pytest.raises(errors.OutputExistsError, match="not a directory"):
        write("text", out, range(5), 1, mode="append")
    write("text", out, range(5), 2, mode="overwrite")
    assert read("text", out) == list(range(5))


def test_overwrite_never_removes_the_checkpoint_dir(tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "old").write_text("x")
    with pytest.raises(errors.ConfigurationError, match="checkpoint_dir"):
        write("text", out, range(5), 1, mode="overwrite", checkpoint_interval=0.05,
              checkpoint_dir=out / "chk")
    assert (out / "old").exists()


def test_mode_is_checked_when_the_sink_is_declared(tmp_path):
    env = fb.Environment()
    s = env.from_sequence(0, 10)
    for bad in ("ignore", None, 1, "Overwrite"):
        with pytest.raises(errors.ConfigurationError, match="mode"):
            s.write_text(tmp_path / "t", mode=bad)
        with pytest.raises(errors.ConfigurationError, match="mode"):
            s.write_parquet(tmp_path / "p", mode=bad)
    assert [n.name for n in env.nodes] == ["sequence"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="workers need fork")
def test_modes_with_worker_processes(tmp_path):
    out = tmp_path / "out"
    write("parquet", out, range(20), 2, workers=2)
    with pytest.raises(errors.OutputExistsError):
        write("parquet", out, range(5), 2, workers=2)
    write("parquet", out, range(100, 104), 2, mode="append", workers=2)
    assert parquet_rows(out) == list(range(20)) + list(range(100, 104))


@settings(max_examples=15, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 30)), min_size=1, max_size=4))
def test_appends_keep_every_run_exactly_once(tmp_path_factory, runs):
    """Differential: the directory after any sequence of appends (any
    parallelism, empty runs too) reads back as the union of what was written."""
    out = tmp_path_factory.mktemp("append") / "out"
    want = collections.Counter()
    for i, (p, n) in enumerate(runs):
        values = range(i * 1000, i * 1000 + n)
        write("text", out, values, p, mode="append")
        want.update(values)
    assert collections.Counter(int(x) for x in read_parts(out)) == want


def test_read_text_of_a_write_text_directory_says_how_to_read_it(tmp_path):
    out = tmp_path / "o"
    env = fb.Environment(parallelism=2)
    env.from_iterable(["a", "b", "c"]).write_text(str(out))
    env.execute()
    with pytest.raises(IsADirectoryError, match="part files"):
        fb.Environment().read_text(str(out))
    # the way the message shows reads every line once
    env = fb.Environment()
    parts = [env.read_text(p) for p in sorted(glob.glob(str(out / "part-*")))]
    got = parts[0].union(*parts[1:]).collect() if len(parts) > 1 else parts[0].collect()
    env.execute()
    assert sorted(got.result) == ["a", "b", "c"]


# ---------------------------------------------------------------- fsspec URLs

fsspec = pytest.importorskip("fsspec")


def url_rows(sink, url):
    """The committed rows under an fsspec URL, read through fsspec (hidden parts skipped)."""
    fs, root = fsspec.core.url_to_fs(url)
    rows = []
    for name in sorted(fs.ls(root, detail=False)):
        base = name.rsplit("/", 1)[-1]
        if not base.startswith("part-"):
            continue
        with fs.open(name, "rb") as fh:
            if sink == "parquet":
                rows += [r["value"] for r in pq.read_table(fh).to_pylist()]
            else:
                rows += [int(x) for x in fh.read().decode().splitlines()]
    return sorted(rows)


@pytest.fixture
def memory_url():
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    # glob characters in the name on purpose: fsspec's generic mv/rm would
    # expand them; the sink names its files literally
    root = f"/pyflowbuf-sink-{uuid.uuid4().hex[:8]}[1]"
    yield f"memory://{root}/out"
    for key in [k for k in MemoryFileSystem.store if k.startswith(root)]:
        del MemoryFileSystem.store[key]
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs if not d.startswith(root)]


@pytest.mark.parametrize("sink", ["parquet", "text"])
def test_modes_on_an_fsspec_url_in_one_process(memory_url, sink):
    """memory:// is one process's: a job in one process writes there through
    fsspec, with the modes and the layout of a local directory."""
    write(sink, memory_url, range(10), 3)
    assert url_rows(sink, memory_url) == list(range(10))
    fs, root = fsspec.core.url_to_fs(memory_url)
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(root, detail=False))
    suffix = ".parquet" if sink == "parquet" else ".txt"
    assert names == [f"part-{i:05d}-000000{suffix}" for i in range(3)]     # every part committed
    with pytest.raises(errors.OutputExistsError, match="mode='overwrite'"):
        write(sink, memory_url, range(100, 106), 1)
    write(sink, memory_url, range(100, 106), 2, mode="overwrite")
    assert url_rows(sink, memory_url) == list(range(100, 106))
    write(sink, memory_url, range(200, 204), 2, mode="append")
    assert url_rows(sink, memory_url) == list(range(100, 106)) + list(range(200, 204))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="workers need fork")
def test_a_memory_url_is_refused_in_worker_processes(memory_url):
    # before any worker starts (tests/test_worker_locations.py has every sink and source)
    with pytest.raises(errors.ConfigurationError, match="one process's memory"):
        write("text", memory_url, range(10), 2, workers=2)


@pytest.mark.parametrize("sink", ["parquet", "text"])
@pytest.mark.parametrize("workers", [None, 2])
def test_a_restored_job_over_a_file_url_commits_exactly_once(tmp_path, sink, workers):
    """A failure after a checkpoint: the restored job's parts under a file://
    URL (the fsspec path, renamed through fsspec by the driver's commit) hold
    every record once, and nothing is left in progress."""
    if workers and not hasattr(os, "fork"):
        pytest.skip("workers need fork")
    url = (tmp_path / "out").as_uri()
    env = fb.Environment(parallelism=2, workers=workers, checkpoint_interval=0.05,
                         checkpoint_dir=(tmp_path / "chk").as_uri(), restart_attempts=2)
    s = (env.from_sequence(0, 3000, parallelism=2, rate_limit=20_000)
            .map(_fail_once_in_worker(tmp_path), name="fails once"))
    if sink == "parquet":
        s.write_parquet(url, parallelism=2)
    else:
        s.write_text(url, parallelism=2)
    env.execute(120)
    ex = env.last_execution
    assert ex.restarts == 1 and ex.restored_from is not None
    assert url_rows(sink, url) == list(range(3000))
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]


def _fail_once_in_worker(tmp_path):
    """In any process: fail once (a marker file), from record 300 on, after a
    checkpoint has completed; until one has, go slowly, so that the bounded
    job cannot end first however loaded the machine."""
    marker, chk = str(tmp_path / "failed"), str(tmp_path / "chk")

    def fn(x):
        if x >= 300 and not os.path.exists(marker):
            if os.path.isdir(chk) and any(n.startswith("chk-") and os.path.exists(os.path.join(chk, n, "_metadata"))
                                          for n in os.listdir(chk)):
                with open(marker, "w") as f:
                    f.write(str(x))
                raise RuntimeError(f"injected failure at {x}")
            time.sleep(0.002)
        return x
    return fn


def test_overwrite_never_removes_a_checkpoint_dir_given_as_a_file_url(tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "old").write_text("x")
    with pytest.raises(errors.ConfigurationError, match="checkpoint_dir"):
        write("text", out.as_uri(), range(5), 1, mode="overwrite", checkpoint_interval=0.05,
              checkpoint_dir=(out / "chk").as_uri())
    with pytest.raises(errors.ConfigurationError, match="checkpoint_dir"):
        write("text", out, range(5), 1, mode="overwrite", checkpoint_interval=0.05,
              checkpoint_dir=(out / "chk").as_uri())
    assert (out / "old").exists()


def test_a_memory_checkpoint_dir_is_refused_with_worker_processes_before_they_start():
    env = fb.Environment(workers=2, checkpoint_interval=0.5, checkpoint_dir="memory://pyflowbuf-test-ck")
    env.from_sequence(0, 100).map(lambda x: x + 1).collect()
    with pytest.raises(fb.errors.ConfigurationError, match="checkpoint_dir.*memory"):
        env.execute()


def test_a_subtask_brought_back_by_a_rescale_keeps_the_parts_it_committed_before(tmp_path):
    """3 -> 2 -> 3: subtask 2 had committed parts 0..4 while subtasks 0 and 1
    had one each; brought back, it numbers its parts after its own (the
    numbers of the others alone would have it remove parts 1..4 as written
    after the checkpoint, and write over them)."""
    from pyflowbuf.connectors.outputs import FileOutput
    from pyflowbuf.connectors.sinks import TextFileSink

    for sub, seq in [(0, 0), (1, 0)] + [(2, s) for s in range(5)]:
        (tmp_path / f"part-{sub:05d}-{seq:06d}.txt").write_text(f"{sub} {seq}\n")
    before = sorted(os.listdir(tmp_path))

    def sink(states, index, parallelism):
        out = FileOutput(tmp_path, ".txt")
        out.parallelism = parallelism
        s = TextFileSink("out", tmp_path, transactional=True, output=out)
        s.restore_state(s._rescale_writer_states(states, index, parallelism))
        s.open(index, parallelism)
        return s

    at3 = [{"seq": 1}, {"seq": 1}, {"seq": 5}]
    at2 = [sink(at3, i, 2).snapshot_state() for i in range(2)]
    assert sorted(os.listdir(tmp_path)) == before
    again = sink(at2, 2, 3)
    assert sorted(os.listdir(tmp_path)) == before
    again.write(["x"])
    assert again.prepare_commit(7)[0][2].endswith("part-00002-000005.txt")
