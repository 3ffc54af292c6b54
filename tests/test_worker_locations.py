"""A file sink or source at a ``memory://`` location (one process's memory)
in a job whose tasks run in worker processes: refused before any worker
starts, naming the sink or source, as a ``memory://`` checkpoint directory
is (issue 27). In one process the same job runs."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyflowbuf as fb
from pyflowbuf import errors

fsspec = pytest.importorskip("fsspec")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers need fork")


def _inputs(root):
    """The same ten numbers as a text, a CSV and a Parquet file in memory://."""
    fs = fsspec.filesystem("memory")
    with fs.open(f"{root}/in/a.txt", "w") as f:
        f.write("".join(f"{i}\n" for i in range(10)))
    with fs.open(f"{root}/csv/a.csv", "w") as f:
        f.write("x\n" + "".join(f"{i}\n" for i in range(10)))
    with fs.open(f"{root}/pq/a.parquet", "wb") as f:
        pq.write_table(pa.table({"x": list(range(10))}), f)


SINKS = {
    "write_text": lambda s, url: s.write_text(url),
    "write_parquet": lambda s, url: s.map(lambda x: {"x": x}).write_parquet(url),
}
SOURCES = {
    "read_text": lambda env, root: env.read_text(f"memory://{root}/in/a.txt"),
    "read_text monitored": lambda env, root: env.read_text(f"memory://{root}/in", monitor=0.05,
                                                           monitor_timeout=0.5),
    "read_csv": lambda env, root: env.read_csv(f"memory://{root}/csv/a.csv"),
    "read_parquet": lambda env, root: env.read_parquet(f"memory://{root}/pq"),
}


@pytest.mark.parametrize("sink", sorted(SINKS))
def test_a_memory_sink_is_refused_with_workers_before_they_start(memory_root, sink):
    env = fb.Environment(parallelism=2, workers=2)
    SINKS[sink](env.from_sequence(0, 100), f"memory://{memory_root}/out")
    with pytest.raises(errors.ConfigurationError,
                       match=rf"sink '{sink}': 'memory:///.*/out' is in one process's memory.*workers=2.*"
                             r"never commits them.*file://"):
        env.execute(timeout=60)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_memory_source_is_refused_with_workers_before_they_start(memory_root, source):
    _inputs(memory_root)
    env = fb.Environment(parallelism=2, workers=2)
    SOURCES[source](env, memory_root).collect()
    with pytest.raises(errors.ConfigurationError, match=r"source '.*': 'memory://.*' is in one process's memory"):
        env.execute(timeout=60)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_same_memory_locations_in_one_process_run(memory_root, source):
    _inputs(memory_root)
    env = fb.Environment(parallelism=2)
    s = SOURCES[source](env, memory_root)
    s.map(lambda r: str(r), kind="str").write_text(f"memory://{memory_root}/out")
    env.execute(timeout=60)
    fs = fsspec.filesystem("memory")
    assert [p for p in fs.ls(f"{memory_root}/out", detail=False) if p.rsplit("/", 1)[-1].startswith("part-")]
