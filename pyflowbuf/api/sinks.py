"""The sink declarations of ``Stream`` (``collect``, ``sink``, ``print``,
``write_text``, ``write_parquet``, ``to_iterator``) and the handles they
return."""
from __future__ import annotations

from typing import Callable


from pyflowbuf._validation import _callable, _output_path, _positive_int
from pyflowbuf.connectors import PrintSink
from pyflowbuf.errors import ConfigurationError
from pyflowbuf.connectors import api as capi
from pyflowbuf.connectors import sinks as sink_ops
from pyflowbuf.jobgraph.graph import Node, set_uid
from pyflowbuf.connectors.outputs import FileOutput, check_mode


class SinkDeclarations:
    """The ``Stream``'s methods that end it in a sink."""

    def collect(self, *, parallelism: int | None = None, name: str = "collect") -> "CollectSink":
        """A sink that keeps every record in memory and hands them to the caller
        once the job ends (also from worker processes).

        Returns a ``CollectSink``: its ``result`` is the list of records after
        ``execute()`` returns, subtask by subtask (in arrival order within a
        subtask). Meant for results that fit in memory; use ``write_text`` or
        ``to_iterator`` for more.

        Example::

            out = env.from_collection([3, 1, 2]).map(lambda x: x * 10).collect()
            env.execute()
            out.result          # [30, 10, 20]
        """
        handle = CollectSink()
        parts = handle._parts       # (the factory travels to workers: never the handle, which holds the env)
        node = self._then(name, lambda: sink_ops.CollectSink(name, parts), parallelism, None, sink=True)
        node.collect_parts = parts
        handle._env, handle._node = self.env, node
        return handle

    def sink(self, fn: Callable, *, batched: bool = False, parallelism: int | None = None,
             name: str = "sink") -> "DataSink":
        """Call ``fn(record)`` (or ``fn(batch)`` with batched=True) in the sink task.

        With ``Environment(workers=N)`` the sink task runs in a worker process:
        what ``fn`` does to the caller's objects happens to the worker's copy
        (use ``collect()`` or ``to_iterator()`` to bring records back).

        Returns a ``DataSink`` (a sink ends the stream; its ``uid()`` names it).
        A ``fn`` that is not callable is a ``TypeError``.

        Example::

            stream.sink(lambda r: db.insert(r))
            stream.sink(lambda batch: db.insert_many(batch), batched=True)
        """
        _callable(fn, "sink")
        node = self._then(name, lambda: sink_ops.FunctionSink(name, fn, batched), parallelism, None, sink=True)
        node.user_sink = True
        return DataSink(self.env, node)

    def print(self, prefix: str | None = None, *, parallelism: int | None = None,
              name: str = "print") -> "DataSink":
        """Each record on stdout as ``str(record)``, as PyFlink's print():
        after ``"<subtask>> "`` (from 1) when the sink has several subtasks,
        ``"<prefix>> "`` / ``"<prefix>:<subtask>> "`` with a prefix. With
        ``workers=`` what the workers print (here, or with ``print()`` in an
        operator's function) is carried to the caller's ``sys.stdout``, so a
        notebook or ``redirect_stdout`` sees it, whole lines in order per
        worker, all of it before ``execute()`` returns. Not transactional:
        after a restore, records since the checkpoint print again.

        Returns a ``DataSink``. A ``prefix`` that is not a str is a
        ``ConfigurationError``.

        Example::

            stream.print()                  # one line per record
            stream.print("debug")           # lines such as debug> 42
        """
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigurationError(f"print: prefix must be a str or None, got {prefix!r}")
        return DataSink(self.env, self._then(name, lambda: PrintSink(name, prefix), parallelism, None, sink=True))

    def write_text(self, path, *, parallelism: int | None = None, name: str = "write_text",
                   mode: str = "error") -> "DataSink":
        """One line per record (``str(record)``) in the directory ``path``:
        ``part-<subtask>-<seq>.txt`` files (one per subtask without
        checkpoints; read them back with ``read_text`` on each, or
        ``sorted(glob.glob(f"{path}/part-*"))``). ``path`` is a local
        directory or any fsspec URL (``s3://bucket/out``, ``file:///mnt/out``;
        ``memory://`` in a job in one process only), written through its
        file system.

        Each part is written under a hidden name (``.part-...inprogress``)
        and renamed into place when committed: when the job ends, or with
        checkpointing on when a checkpoint covering it completes: exactly
        once across failures. ``mode``: ``"error"`` (default) refuses a
        directory that already holds output (other than the parts of the
        checkpoint being restored), ``"overwrite"`` removes it first,
        ``"append"`` adds new parts beside it (``OutputExistsError``).

        Returns a ``DataSink``: give the sink a stable id with ``.uid()``
        (its pending parts are stored under it in checkpoints). A bad
        ``mode`` is a ``ConfigurationError`` here; output already in the
        directory with ``mode="error"`` is ``OutputExistsError`` from
        ``execute()``, before anything runs.

        Example::

            counts.write_text("out/counts", mode="overwrite").uid("counts-out")
        """

        path = _output_path(path, name)
        output = FileOutput(path, ".txt", check_mode(mode, f"write_text {name!r}"), f"write_text {name!r}",
                            legacy_suffixes=("",))
        sink = sink_ops.TextFileSink(name, path, output=output, transactional=self.env.checkpoint_config.enabled)
        return self._part_file_sink(name, sink, output, parallelism)

    def _part_file_sink(self, name, sink, output, parallelism) -> "DataSink":
        """A part-file sink is a connector sink (``connectors/sinks.py``): its
        subtasks commit through ``ConnectorSinkOperator``, the driver runs
        its final commits under its commit key."""
        checkpointed = self.env.checkpoint_config.enabled
        output.commit_key = key = f"files:{self.env.name}/{name}:{output.path}"
        capi.declare(key, sink)
        # the operator factory travels to the workers (a SparkCluster pickles
        # it): it holds plain values, never the Environment
        node = self._then(name, lambda: capi.ConnectorSinkOperator(name, sink, key, checkpointed),
                          parallelism, None, sink=True)
        output.parallelism = node.parallelism
        node.file_output = output
        return DataSink(self.env, node)

    def write_parquet(self, path, *, parallelism: int | None = None, name: str = "write_parquet",
                      schema=None, row_group_size: int | None = None, compression="snappy",
                      mode: str = "error") -> "DataSink":
        """Parquet files in the directory ``path``: ``part-<subtask>-<seq>.parquet``
        (pyarrow, the ``arrow`` extra), one per subtask without checkpoints.

        Records may be Arrow RecordBatches/Tables, pandas DataFrames, NumPy
        rows, dicts (a key per column), tuples (columns ``f0``, ``f1``.. or
        the schema's, in order) or single values (one column, ``value``). The
        schema is ``schema`` (a ``pyarrow.Schema``) or the first batch's, per
        subtask; a later batch that does not fit it raises ``RecordTypeError``
        naming the column. Pass ``schema`` when a column of the first batch
        may be all None, or for one schema across subtasks. Rows are buffered
        into row groups of ``row_group_size`` rows (default 131072).

        ``path`` as for ``write_text`` (a local directory or an fsspec URL).
        Parts are committed as ``write_text``'s are (hidden until committed;
        with checkpointing on, exactly once across failures; readers skip
        names starting with ``.``), and ``mode`` works the same way. Returns
        a ``DataSink`` (``.uid()`` as for ``write_text``).

        Example::

            rows.write_parquet("out/events", row_group_size=65536, compression="zstd")
        """

        if row_group_size is not None:
            _positive_int("row_group_size", row_group_size)
        path = _output_path(path, name)
        output = FileOutput(path, ".parquet", check_mode(mode, f"write_parquet {name!r}"),
                            f"write_parquet {name!r}")
        schema = sink_ops.parquet_settings(schema, compression)
        sink = sink_ops.ParquetFileSink(name, path, schema=schema, row_group_size=row_group_size,
                                        compression=compression, output=output,
                                        transactional=self.env.checkpoint_config.enabled)
        return self._part_file_sink(name, sink, output, parallelism)

    def to_iterator(self, *, name: str = "iterator", zero_copy: bool = False) -> "IteratorSink":
        """A sink read by ``Environment.execute_iter`` in the caller's thread.

        Records own their memory by default, so the caller may keep them. With
        ``zero_copy=True`` large records come as views over segments: each one
        held keeps a segment from the pool, and holding a pool's worth stalls
        the job, so only use it when records are dropped promptly.

        Returns an ``IteratorSink`` handle to pass to ``execute_iter``; the sink
        has parallelism 1. A job with such a sink runs only with
        ``execute_iter`` (``execute()`` refuses it).

        Example::

            handle = env.from_sequence(0, 5).to_iterator()
            print(list(env.execute_iter(handle)))      # [0, 1, 2, 3, 4]
        """
        node = self.env._add(name=name, parallelism=1, make_operator=None, inputs=[self._input_to(1)],
                             kind=None, is_sink=True)
        node.is_iterator = True
        node.zero_copy = zero_copy
        return IteratorSink(node)

    def execute_and_collect(self, job_execution_name: str | None = None, limit: int | None = None):
        """Run the job and hand this stream's records back (PyFlink's
        ``DataStream.execute_and_collect``): ``to_iterator()`` and
        ``env.execute_iter`` in one call. Without ``limit``: an iterator over
        the records as they come (closing it, or leaving its ``with`` block,
        cancels the job if it still runs). With ``limit``: a list of the
        first ``limit`` records, and the job is cancelled once it has them.

        The job's other sinks run too. Errors as for ``execute_iter``; a
        ``limit`` that is not an int >= 1 is a ``ConfigurationError``.

        Example::

            squares = env.from_sequence(0, 5).map(lambda x: x * x).execute_and_collect(limit=3)
            # [0, 1, 4]
        """
        if limit is not None:
            _positive_int("limit", limit)
        records = self.env.execute_iter(self.to_iterator(name="execute_and_collect"), job_execution_name)
        if limit is None:
            return ClosingIterator(records)
        out: list = []
        try:
            if limit:
                for record in records:
                    out.append(record)
                    if len(out) >= limit:
                        break
        finally:
            records.close()
        return out


class ClosingIterator:
    """What ``execute_and_collect()`` returns (PyFlink's CloseableIterator):
    the records as they come; ``close()``, or the end of a ``with`` block,
    cancels the job if it still runs.

    Example::

        with env.from_sequence(0, 100).execute_and_collect() as records:
            first = next(records)
    """

    def __init__(self, records):
        self._records = records

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._records)

    def close(self) -> None:
        """Stop reading: the job is cancelled if it still runs.

        Example::

            it = env.from_sequence(0, 100).execute_and_collect()
            it.close()
        """
        self._records.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False



class DataSink:
    """Handle of a sink declared by ``sink()``, ``print()``, ``write_text()``
    or ``write_parquet()`` (as Flink's DataStreamSink): ``uid()`` gives the
    sink a stable operator id, under which checkpoints store its state (a
    file sink's parts not yet committed), so a later version of the job
    that adds or removes sinks of the same kind still finds it.

    Example::

        rows.write_parquet("out/events").uid("events-out")
    """

    def __init__(self, env, node: Node):
        self._env = env
        self._node = node

    @property
    def name(self) -> str:
        """The sink's operator name (its ``name=``).

        Example::

            stream.write_text("out/lines", name="lines").name      # "lines"
        """
        return self._node.name

    def uid(self, uid: str) -> "DataSink":
        """Give the sink a stable operator id (see ``Stream.uid``); returns
        this handle. An id another operator of the job has is a
        ``ConfigurationError``; one that is not a non-empty str a ``TypeError``.

        Example::

            stream.write_text("out/lines").uid("lines-out")
        """
        set_uid(self._env.nodes, self._node, uid)
        return self

    def __repr__(self):
        return f"<DataSink {self._node.name!r} uid={self._node.uid!r}>"


class CollectSink:
    """Handle of a ``collect()`` sink; ``result`` is filled when the job ends.

    Example::

        handle = stream.collect()
        env.execute()
        print(handle.result)
    """

    def __init__(self):
        self._parts: dict = {}
        self._env = self._node = None

    def uid(self, uid: str) -> "CollectSink":
        """Give the sink a stable operator id (see ``Stream.uid``, ``DataSink.uid``);
        returns this handle.

        Example::

            out = stream.collect().uid("results")
        """
        set_uid(self._env.nodes, self._node, uid)
        return self

    @property
    def result(self) -> list:
        """The collected records as a new list: subtask 0's in arrival order, then
        subtask 1's, and so on. Complete once ``execute()`` has returned (or the
        job is ``done``); while the job runs it holds what has arrived so far.

        Example::

            out = env.from_collection(["x", "y"]).collect()
            env.execute()
            assert out.result == ["x", "y"]
        """
        out = []
        for k in sorted(self._parts):
            out.extend(self._parts[k])
        return out


class IteratorSink:
    """Handle of a ``to_iterator()`` sink: pass it to
    ``Environment.execute_iter`` to read the records in the caller's thread.

    Example::

        handle = stream.to_iterator()
        for record in env.execute_iter(handle):
            ...
    """
    def __init__(self, node: Node):
        self.node = node

