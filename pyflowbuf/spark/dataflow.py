"""``run_dataflow``: one pyflowbuf job over a DataFrame's partitions, across
Spark executors, with exchanges (``key_by``) between them.

Unlike ``map_in_arrow`` (an independent pipeline per partition, nothing
crosses partitions), the job here is one dataflow: source subtask i reads
partition i of the DataFrame as Arrow batches, in Spark barrier task i
(``df.mapInArrow(..., barrier=True)``); the operators ``build`` adds run
across the tasks as with ``SparkCluster``; the records of the stream it
returns come back to the driver (as ``collect()`` does: exactly once with
checkpoints) and become the rows of the returned DataFrame.

With checkpoints a restart replays each partition from its recorded
position (batches read), so the DataFrame must be deterministic: the same
rows in the same partitions and batches when Spark computes it again (no
``rand()`` without a seed, no source that changes between reads).
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

import pyarrow as pa

from pyflowbuf import errors
from pyflowbuf.api import Environment
from pyflowbuf.runtime.execution import JobExecution
from pyflowbuf.connectors.sources import Source
from pyflowbuf.spark._schema import conform_batch, resolve_schema, session_timezone
from pyflowbuf.spark.cluster import SparkCluster, SparkLauncher, run_barrier_task, task_function

# partition iterators handed from a Spark task to its source subtask, by
# (job key, subtask); an entry lives only while its task runs
_PARTITIONS: dict = {}
_PARTITIONS_LOCK = threading.Lock()


class PartitionSource(Source):
    """Reads the Arrow batches of the DataFrame partition whose barrier task
    runs this subtask. Its position is the number of batches read."""

    name = "partition"
    default_kind = "arrow"
    rewindable = True

    def __init__(self, key: str):
        self.key = key
        self._it = None
        self.offset = 0

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        with _PARTITIONS_LOCK:
            it = _PARTITIONS.pop((self.key, subtask), None)
        if it is None:
            raise errors.FlowBufError(
                f"source subtask {subtask} of run_dataflow found no DataFrame partition in this process: "
                "it runs only inside its Spark barrier task")
        self._it = it

    def next_batch(self, max_records):
        batch = []
        for rec in self._it:
            if rec.num_rows:
                batch.append(rec)
                if len(batch) >= max_records:
                    break
        self.offset += len(batch)
        return batch or None

    def position(self):
        return self.offset

    def seek(self, position):
        # the task's iterator is a fresh computation of the partition (a new attempt)
        skipped = 0
        while skipped < position:
            rec = next(self._it, None)
            if rec is None:
                raise errors.FlowBufError(
                    f"partition {self.subtask} has fewer batches ({skipped}) than the checkpoint read "
                    f"({position}): the DataFrame is not deterministic")
            skipped += 1 if rec.num_rows else 0
        self.offset = position

    def identity(self):
        return {"run_dataflow": self.key}

    def close(self):
        self._it = None


class _DataflowTask:
    """The mapInArrow function of one attempt (pickled into the closure)."""

    def __init__(self, spec, key):
        self.spec = spec
        self.key = key

    def __call__(self, iterator):
        w, addresses = self.spec.task_addresses()
        with _PARTITIONS_LOCK:
            _PARTITIONS[(self.key, w)] = iterator
        try:
            pid = run_barrier_task(self.spec, w, addresses)
        finally:
            with _PARTITIONS_LOCK:
                _PARTITIONS.pop((self.key, w), None)
        yield pa.RecordBatch.from_pydict({"pyflowbuf_worker_pid": [pid]})


class DataflowLauncher(SparkLauncher):
    """A SparkLauncher whose barrier tasks are the DataFrame's partitions."""

    def __init__(self, cluster, job_spec, df, key):
        super().__init__(cluster, job_spec)
        self.df = df
        self.key = key

    def submit(self, spec):
        self.df.mapInArrow(task_function(_DataflowTask(spec, self.key)), "pyflowbuf_worker_pid long",
                           barrier=True).collect()


class _DataflowCluster(SparkCluster):
    def __init__(self, df, key, **kw):
        super().__init__(df.sparkSession, **kw)
        self.df = df
        self.key = key

    def execution(self, job_spec):
        return JobExecution(job_spec, launcher=DataflowLauncher(self, job_spec, self.df, self.key))


def run_dataflow(df, build: Callable[[Any], Any], schema, workers: int = 2, *, task_cpus: int = 1,
                 port_range: tuple | None = None, start_timeout: float = 60.0, allow_unencrypted: bool = False,
                 timeout: float | None = None, **environment_settings):
    """Run ``build`` as one job over ``df``'s partitions on ``workers`` Spark
    barrier tasks; returns a DataFrame of its output rows.

    ``df`` is brought to ``workers`` partitions first (``repartition``); source subtask i reads partition
    i as ``pyarrow.RecordBatch`` records. ``build(stream)`` returns the
    stream whose records are the result: RecordBatches (or pandas
    DataFrames) fitted to ``schema``, or rows (tuples or dicts) in its
    order. ``environment_settings`` go to ``Environment`` (parallelism,
    checkpoint_interval, checkpoint_dir, restart_attempts, ...);
    parallelism defaults to ``workers``. The job runs now (the returned
    DataFrame holds its result in the driver), with the checks, restarts
    and metrics of ``SparkCluster``.

    Example::

        from pyflowbuf.spark import run_dataflow

        def build(batches):
            return (batches.flat_map(lambda b: zip(b["key"].to_pylist(), b["v"].to_pylist()))
                           .key_by(lambda r: r[0])
                           .reduce(lambda a, b: (a[0], a[1] + b[1])))

        out = run_dataflow(df, build, "key string, v long", workers=2)
    """
    if "cluster" in environment_settings or "workers" in environment_settings:
        raise errors.ConfigurationError("run_dataflow takes workers= itself; do not pass cluster= or "
                                        "an Environment's workers=")
    spark = df.sparkSession
    struct, arrow_schema = resolve_schema(schema, timezone=session_timezone())
    key = uuid.uuid4().hex
    cluster = _DataflowCluster(_with_partitions(df, workers), key, workers=workers, task_cpus=task_cpus,
                               port_range=port_range, start_timeout=start_timeout,
                               allow_unencrypted=allow_unencrypted)
    settings = {"parallelism": workers, "name": "run_dataflow", **environment_settings}
    env = Environment(cluster=cluster, **settings)
    source = env._source("partitions", lambda: PartitionSource(key), "arrow", None, parallelism=workers)
    out = build(source)
    if out is None or not hasattr(out, "collect"):
        raise TypeError(f"build(stream) must return the stream it built, got {type(out).__name__}")
    result = out.collect()
    env.execute(timeout=timeout)
    records = result.result
    if records and _is_batch(records[0]):
        batches = [conform_batch(r, arrow_schema) for r in records]
        table = pa.Table.from_batches([b for b in batches if b.num_rows], schema=arrow_schema)
        return spark.createDataFrame(table.to_pandas(), struct)
    return spark.createDataFrame(records, struct)


def _is_batch(rec) -> bool:
    if isinstance(rec, (pa.RecordBatch, pa.Table)):
        return True
    return type(rec).__module__.startswith("pandas")


def _with_partitions(df, n: int):
    # not coalesce(): a barrier stage may not narrow its parents' partitions
    # (SPARK-24820); a repartition puts a shuffle between them
    if df.rdd.getNumPartitions() != n:
        return df.repartition(n)
    return df


__all__ = ["run_dataflow", "PartitionSource"]
