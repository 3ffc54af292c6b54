"""The job API: build a graph of sources, operators and sinks, then run it.

    env = Environment(parallelism=2)
    counts = (env.from_collection(["a b", "b c"])
                 .flat_map(str.split)
                 .key_by(lambda w: w)
                 .reduce(lambda a, b: a)          # any rolling reduce
                 .collect())
    env.execute()
    counts.result
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
import threading
import warnings
from typing import Any, Callable, Iterable

import numpy as np

from pyflowbuf.errors import AlreadyExecutedError, ConfigurationError, UnitWarning
from pyflowbuf.runtime import operators as ops
from pyflowbuf.runtime import sources as srcs
from pyflowbuf.runtime.graph import Input, Node, plan
from pyflowbuf.runtime.job import check_timeout

_UNSET = object()
_INT64 = (-(1 << 63), (1 << 63) - 1)


class Environment:
    """Holds the job graph and its settings.

    Parameters
    ----------
    parallelism : default parallelism of operators.
    segment_size : bytes per memory segment (power of two, 256 B .. 1 MiB).
    num_segments : size of the NetworkBufferPool; default: enough for every
        output pool at its cap, so memory is bounded by construction.
    buffer_timeout : seconds after which a partly filled buffer is shipped
        (Flink's execution.buffer-timeout, default 0.1); 0 ships per record.
    chaining : fuse forward operators of equal parallelism into one task.
    output_buffers : (min, max) segments per output pool; default Flink's
        (subpartitions + 1, 2 * subpartitions + 8). A RecordWriter holds one
        buffer per subpartition, so a job whose max is below an edge's
        subpartitions (or, when num_segments is too small for every pool to
        reach its max, whose min is) is refused at execute(): it would deadlock.
    max_batch : records a task moves per crossing into the core.
    max_record_size : bytes a serialized record may take (default 64 MiB).
    metrics_interval : seconds between metric samples.
    name : the job's name in errors, metrics and Prometheus labels
        (``execute("name")`` sets it too).
    metrics_log, prometheus_port, live_view : where metric samples go: JSON
        lines appended to a file, Prometheus gauges on 127.0.0.1 (0: a free
        port, which the job's ``prometheus_port`` gives), a live table in the terminal. With workers they are served by
        the calling process.
    workers : run subtasks in this many worker processes (subtask i of each
        operator on worker i % workers), connected by the TCP exchange with
        credit-based flow control; None runs everything in this process.
        The workers are forked: operators, and ``sink(fn)`` functions, run on
        the workers' copies of the caller's objects, so a sink that appends to
        a list or bumps a counter of the caller changes the worker's copy and
        the caller sees nothing (a job that ran a ``sink(fn)`` in a worker
        warns with ``WorkerSideEffectWarning``). Bring results back with
        ``collect()`` or ``to_iterator()`` (``execute_iter``), or write them
        somewhere both can reach (``write_text``, a database).
    cluster : run the workers elsewhere, e.g. ``pyflowbuf.spark.SparkCluster(spark,
        workers=N)``: each worker a Spark barrier task (see docs/spark-cluster.md).
    allow_pickle : let streams of pickled Python objects cross processes
        (unpickling runs code the sender chose; only for trusted workers).
    bind_host : interface the workers' exchange listens on (loopback by default).
    credit_based : False uses the pre-credit mode (TCP window only), to compare.
    checkpoint_interval, checkpoint_dir, checkpoint_timeout, checkpoints_retained,
    restart_attempts, checkpointing_mode : checkpoints (off while the interval
        is None) and recovery; see docs/checkpoints.md.
    checkpoint_mode : "aligned" (default: barriers wait behind queued data) or
        "unaligned" (barriers overtake it and the checkpoint stores it; needs
        exactly-once).
    alignment_timeout : with "unaligned", start each checkpoint aligned and
        switch it to unaligned after this many seconds (Flink's aligned
        checkpoint timeout); None or 0: unaligned from the start.
    debloat, debloat_target, debloat_period, debloat_samples, debloat_threshold,
    min_buffer_size : buffer debloating (off by default): in-flight data sized
        by time, and pool memory given back; see "Buffer debloating".

    An Environment executes its graph once, as Flink's does: ``execute()``,
    ``execute_async()`` or ``execute_iter()``, one of them, one time. Build a
    new Environment to run a job again. A call refused before anything started
    (bad arguments, a setting that cannot work) leaves it unused.

    Example::

        import pyflowbuf as fb

        env = fb.Environment(parallelism=2, buffer_timeout=0.01)   # seconds
        out = env.from_collection(["a b", "b"]).flat_map(str.split).collect()
        env.execute()
        sorted(out.result)        # ['a', 'b', 'b']
    """

    def __init__(self, parallelism: int = 1, *, segment_size: int = 32 * 1024,
                 num_segments: int | None = None, buffer_timeout: float = 0.1,
                 chaining: bool = True, output_buffers: tuple | None = None,
                 max_batch: int = 1024, max_record_size: int = 64 * 1024 * 1024,
                 metrics_interval: float = 1.0, name: str = "job",
                 metrics_log: str | os.PathLike | None = None, prometheus_port: int | None = None,
                 live_view: bool = False, workers: int | None = None, allow_pickle: bool = False,
                 bind_host: str = "127.0.0.1", credit_based: bool = True,
                 checkpoint_interval: float | None = None, checkpoint_dir: str | os.PathLike | None = None,
                 checkpoint_timeout: float = 600.0, checkpoints_retained: int = 2,
                 restart_attempts: int = 0, checkpointing_mode: str = "exactly_once",
                 checkpoint_mode: str = "aligned", alignment_timeout: float | None = None,
                 debloat: bool = False, debloat_target: float = 1.0, debloat_period: float = 0.2,
                 debloat_samples: int = 20, debloat_threshold: float = 0.25, min_buffer_size: int = 256,
                 cluster: Any = None):
        self.parallelism = parallelism
        self.segment_size = segment_size
        self.num_segments = num_segments
        self.buffer_timeout = buffer_timeout
        self.chaining = chaining
        self.output_buffers = output_buffers
        self.max_batch = max_batch
        self.max_record_size = max_record_size
        self.metrics_interval = metrics_interval
        self.metrics_log = metrics_log
        self.prometheus_port = prometheus_port
        self.live_view = live_view
        self.name = name
        self.workers = workers
        self.allow_pickle = allow_pickle
        self.bind_host = bind_host
        self.credit_based = credit_based
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_timeout = checkpoint_timeout
        self.checkpoints_retained = checkpoints_retained
        self.restart_attempts = restart_attempts
        self.checkpointing_mode = checkpointing_mode
        self.checkpoint_mode = checkpoint_mode
        self.alignment_timeout = alignment_timeout
        # buffer debloating (off by default, as in Flink): runtime/debloat.py
        self.debloat = debloat
        self.debloat_target = debloat_target
        self.debloat_period = debloat_period
        self.debloat_samples = debloat_samples
        self.debloat_threshold = debloat_threshold
        self.min_buffer_size = min_buffer_size
        self.cluster = cluster
        self._check_settings()
        _warn_milliseconds(self)
        self.buffer_timeout = float(buffer_timeout)
        self.nodes: list[Node] = []
        self.last_execution = None
        self._claim_lock = threading.Lock()
        self._claimed_by = None        # the job that ran (or runs) this graph

    def _check_settings(self) -> None:
        """Every setting, checked at construction and again before a job starts
        (the attributes are public, so they may have changed in between)."""
        _positive_int("parallelism", self.parallelism)
        _positive_int("max_batch", self.max_batch)
        from pyflowbuf.runtime.debloat import check_settings as _check_debloat
        _check_debloat(self)
        if self.num_segments is not None:
            _positive_int("num_segments", self.num_segments)
        if not _number(self.buffer_timeout) or not 0 <= self.buffer_timeout < math.inf:
            raise ConfigurationError(f"buffer_timeout must be >= 0 seconds, got {self.buffer_timeout!r}")
        if self.output_buffers is not None:
            ob = self.output_buffers
            if not isinstance(ob, (tuple, list)) or len(ob) != 2:
                raise ConfigurationError(f"output_buffers must be a (min, max) pair, got {ob!r}")
            lo, hi = ob
            _positive_int("output_buffers max", hi)
            if not _int(lo) or not 0 <= lo <= hi:
                raise ConfigurationError(f"output_buffers must be (min, max) with 0 <= min <= max, got {ob!r}")
        ss = self.segment_size
        _positive_int("segment_size", ss)
        if ss & (ss - 1) or not 256 <= ss <= 1 << 20:
            raise ConfigurationError(f"segment_size must be a power of two between 256 and 1048576, got {ss}")
        _positive_int("max_record_size", self.max_record_size)
        if self.max_record_size >= 1 << 32:
            raise ConfigurationError(f"max_record_size must be < 2**32, got {self.max_record_size}")
        if self.workers is not None:
            _positive_int("workers", self.workers)
        if self.cluster is not None:
            if not callable(getattr(self.cluster, "execution", None)):
                raise ConfigurationError(
                    f"cluster must be a cluster such as pyflowbuf.spark.SparkCluster, got {self.cluster!r}")
            if self.workers is not None:
                raise ConfigurationError(
                    "give the number of workers to the cluster (SparkCluster(spark, workers=N)), not also "
                    "Environment(workers=...)")
        if not _number(self.metrics_interval) or not 0 < self.metrics_interval < math.inf:
            raise ConfigurationError(f"metrics_interval must be > 0 seconds, got {self.metrics_interval!r}")
        port = self.prometheus_port
        if port is not None and (not _int(port) or not 0 <= port <= 65535):
            raise ConfigurationError(f"prometheus_port must be an int in 0..65535 (0: a free port), got {port!r}")
        _job_name("name", self.name)
        ci = self.checkpoint_interval
        if ci is not None and (not _number(ci) or not 0 < ci < math.inf):
            raise ConfigurationError(f"checkpoint_interval must be None (off) or seconds > 0, got {ci!r}")
        if not _number(self.checkpoint_timeout) or not 0 < self.checkpoint_timeout < math.inf:
            raise ConfigurationError(f"checkpoint_timeout must be seconds > 0, got {self.checkpoint_timeout!r}")
        _positive_int("checkpoints_retained", self.checkpoints_retained)
        if not _int(self.restart_attempts) or self.restart_attempts < 0:
            raise ConfigurationError(f"restart_attempts must be an int >= 0, got {self.restart_attempts!r}")
        from pyflowbuf.runtime.checkpointing import MODES
        if self.checkpointing_mode not in MODES:
            raise ConfigurationError(
                f"checkpointing_mode must be one of {MODES}, got {self.checkpointing_mode!r}")
        from pyflowbuf.runtime.checkpointing import ALIGNMENTS
        if self.checkpoint_mode not in ALIGNMENTS:
            raise ConfigurationError(
                f"checkpoint_mode must be one of {ALIGNMENTS}, got {self.checkpoint_mode!r}")
        at = self.alignment_timeout
        if at is not None and (not _number(at) or not 0 <= at < math.inf):
            raise ConfigurationError(f"alignment_timeout must be None or seconds >= 0, got {at!r}")
        if at is not None and self.checkpoint_mode != "unaligned":
            raise ConfigurationError(
                "alignment_timeout switches a checkpoint from aligned to unaligned: it needs "
                "checkpoint_mode='unaligned' (with alignment_timeout=0 every checkpoint is unaligned "
                "from the start)")
        if self.checkpoint_mode == "unaligned" and self.checkpointing_mode != "exactly_once":
            raise ConfigurationError(
                "checkpoint_mode='unaligned' needs checkpointing_mode='exactly_once' (at-least-once "
                "checkpoints never block a channel, so there is nothing to overtake)")
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, (str, os.PathLike)):
            raise ConfigurationError(f"checkpoint_dir must be a path or an fsspec URL, got {self.checkpoint_dir!r}")

    def checkpoints(self) -> list:
        """The checkpoints of the running or last job, oldest first: id, status
        (completed / aborted / expired / failed), trigger_time, duration_s,
        alignment_ms per task, state_bytes, size.

        Returns a list of dicts (empty before the first checkpoint, or with
        checkpointing off).

        Example::

            env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir="checkpoints")
            ...
            env.execute()
            for c in env.checkpoints():
                print(c["id"], c["status"], c["duration_s"])
        """
        ex = self.last_execution
        return [] if ex is None else ex.checkpoints()

    # ---- sources ----
    def _add(self, **kw) -> Node:
        node = Node(id=len(self.nodes), **kw)
        for inp in node.inputs:
            # a window result split by late(): its results come from the selector
            split = getattr(inp.node, "split_into", None)
            if split is not None:
                inp.node = split
        self._check_node_kind(node)
        for inp in node.inputs:
            inp.node.consumers.append(node)
        self.nodes.append(node)
        return node

    def _source(self, name, source, kind, rate_limit, parallelism=1) -> "Stream":
        srcs.rate_limiter(rate_limit)   # a bad rate_limit= fails here, not in the running task
        node = self._add(name=name, parallelism=parallelism, source=source, kind=kind,
                         rate_limit=rate_limit)
        return Stream(self, node)

    def from_iterable(self, iterable: Iterable, *, kind: Any = None, name: str = "iterable",
                      rate_limit=None) -> "Stream":
        """Records from an iterable (or a zero-argument function returning one),
        pulled lazily: an item is taken only when the task can write it.

        ``kind`` declares the record kind (None: inferred from the first record;
        a list of plain numbers gets a fixed-width number kind when its values
        fit one); ``rate_limit`` caps the source at that
        many records per second, or takes a ``RateLimiter``. The source has
        parallelism 1. Returns a ``Stream``. A bad ``kind`` is a
        ``ConfigurationError``, a bad ``rate_limit`` a ``ValueError``, both
        raised here. ``from_collection`` is the same method.

        Example::

            words = env.from_iterable(["a", "b", "c"])
            lines = env.from_iterable(lambda: open("words.txt"), kind="str", rate_limit=1000)
        """
        kind = _check_kind(kind, f"from_iterable {name!r}")
        if kind is None and isinstance(iterable, (list, tuple, range)) and len(iterable):
            from pyflowbuf.serializers import infer_kind
            kind = infer_kind(iterable[0])
            if kind == "number":
                # all the records are known: plain ints (or floats) take the
                # fixed-width kind, as from_sequence does
                from pyflowbuf._core.serde import number_kind
                if isinstance(iterable, range):
                    fits = -(1 << 63) <= min(iterable[0], iterable[-1]) and max(iterable[0], iterable[-1]) < (1 << 63)
                    kind = "int64" if fits else "number"
                else:
                    kind = number_kind(iterable if isinstance(iterable, list) else list(iterable))
        return self._source(name, lambda: srcs.IterableSource(iterable), kind, rate_limit)

    from_collection = from_iterable

    def from_generator(self, fn: Callable[[], Iterable], *, kind: Any = None, name: str = "generator",
                       rate_limit=None) -> "Stream":
        """Records from ``fn()``, a function of no arguments returning an iterable
        (a generator function), called when the job starts.

        ``kind``, ``name`` and ``rate_limit`` as for ``from_iterable``; the
        source has parallelism 1. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``, a bad ``kind`` a ``ConfigurationError``.

        Example::

            def readings():
                for i in range(1000):
                    yield ("sensor-1", float(i))

            stream = env.from_generator(readings, name="sensor")
        """
        if not callable(fn):
            raise TypeError("from_generator takes a function that returns an iterable")
        kind = _check_kind(kind, f"from_generator {name!r}")
        return self._source(name, lambda: srcs.IterableSource(fn), kind, rate_limit)

    def from_sequence(self, start: int, stop: int | None = None, step: int = 1, *,
                      parallelism: int | None = None, name: str = "sequence", rate_limit=None) -> "Stream":
        """Integers in ``range(start, stop, step)`` (``stop=None``: unbounded).

        The stream's kind is ``int64``; with ``parallelism`` p each subtask
        takes every p-th value. Returns a ``Stream``. Arguments that are not
        ints, a ``step`` of 0 or values outside int64 are a
        ``ConfigurationError``.

        Example::

            evens = env.from_sequence(0, 100, 2, parallelism=2)    # 0, 2, .., 98
            ticks = env.from_sequence(0, rate_limit=10)             # unbounded, 10 per second
        """
        start, stop, step = _sequence_args(start, stop, step)
        if parallelism is not None:
            _positive_int("parallelism", parallelism)
        p = self.parallelism if parallelism is None else parallelism
        return self._source(name, lambda: srcs.SequenceSource(start, stop, step), "int64", rate_limit, p)

    def read_text(self, path, *, encoding: str = "utf-8", name: str = "read_text", rate_limit=None) -> "Stream":
        """Lines of a text file; the source tracks byte offsets.

        Each record is one line as a ``str`` without its line break, decoded
        with ``encoding``; the byte offset makes a restore resume exactly. A
        missing file is ``FileNotFoundError``, raised here. Returns a ``Stream``.

        Example::

            lines = env.read_text("words.txt")
            words = lines.flat_map(str.split)
        """
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        if os.path.isdir(path):
            # e.g. the directory of part files write_text made: reading its
            # parts in some order of our choosing would be a guess
            raise IsADirectoryError(
                f"read_text reads one file, and {path} is a directory (write_text writes a directory of "
                "part files): read each part, e.g. env.read_text(p) for p in "
                f"sorted(glob.glob('{os.path.join(os.fspath(path), 'part-*')}')), joined with union()")
        return self._source(name, lambda: srcs.TextFileSource(path, encoding), "str", rate_limit)

    def read_parquet(self, path, *, columns: list | None = None, batch_size: int = 65536,
                     as_: str = "records", parallelism: int | None = None, name: str = "read_parquet",
                     rate_limit=None) -> "Stream":
        """Rows of Parquet files (pyarrow): ``path`` is a file, a directory
        (its files, hidden ``.``/``_`` names skipped), a glob or a list of them.

        ``as_``: ``"records"`` (a dict per row), ``"tuples"`` (a tuple per row,
        in column order), ``"arrow"`` (RecordBatches of up to ``batch_size``
        rows) or ``"pandas"`` (DataFrames). The row groups are split over the
        ``parallelism`` subtasks; the position (file, row group, row) rewinds
        exactly for checkpoints. Files are listed and their footers read
        here: a missing file is FileNotFoundError, a broken one
        ``connectors.FileFormatError``.

        Returns a ``Stream``.

        Example::

            rows = env.read_parquet("lines.parquet", columns=["ts", "text"])       # dicts
            batches = env.read_parquet("events/", as_="arrow", parallelism=2)      # RecordBatches
        """
        from pyflowbuf import connectors

        factory, kind = connectors.parquet_source(path, columns=columns, batch_size=batch_size, as_=as_,
                                                  what=f"read_parquet {name!r}")
        return self._source(name, factory, kind, rate_limit, _parallelism(self, parallelism))

    def read_csv(self, path, *, columns: list | None = None, column_types=None, column_names: list | None = None,
                 header: bool = True, delimiter: str = ",", quote_char: str = '"', batch_size: int = 65536,
                 block_size: int = 1 << 20, as_: str = "records", parallelism: int | None = None,
                 name: str = "read_csv", rate_limit=None) -> "Stream":
        """Rows of CSV files (pyarrow.csv), ``path`` as for ``read_parquet``,
        records as its ``as_`` says.

        The column names are the header line's (``header=True``, every file
        has one), ``column_names``, or f0, f1, ..; the types are
        ``column_types`` (a pyarrow Schema or a dict of name to type) and, for
        the other columns, inferred from the first ``block_size`` bytes. An
        unquoted empty field is None, a quoted one ``""``. Each file's lines
        are split over the ``parallelism`` subtasks by byte ranges; a value
        holding a line break inside quotes is refused at every parallelism. A
        row that does not parse is ``connectors.FileFormatError`` naming the
        file and line.

        Returns a ``Stream``.

        Example::

            users = env.read_csv("users.csv", columns=["name", "age"])
            for_windows = env.read_csv("events.csv", as_="arrow")
        """
        from pyflowbuf import connectors

        factory, kind = connectors.csv_source(
            path, columns=columns, column_types=column_types, column_names=column_names, header=header,
            delimiter=delimiter, quote_char=quote_char, batch_size=batch_size, block_size=block_size,
            as_=as_, what=f"read_csv {name!r}")
        return self._source(name, factory, kind, rate_limit, _parallelism(self, parallelism))

    def from_arrays(self, arrays: Iterable, *, dtype=None, name: str = "arrays", rate_limit=None) -> "Stream":
        """A rows stream: NumPy arrays of fixed-width rows, moved with one memcpy
        per buffer and read back as views. Operators see array chunks.

        ``dtype`` is the rows' NumPy dtype; it may be left out only when
        ``arrays`` is a non-empty list (the first array's dtype). A missing or
        invalid dtype, or one of Python objects, is a ``ConfigurationError``.
        Returns a ``Stream`` of that dtype.

        Example::

            import numpy as np

            rows = np.zeros(10_000, dtype=[("key", "i8"), ("value", "f8")])
            stream = env.from_arrays([rows[:5000], rows[5000:]])
            positive = stream.map_batches(lambda chunk: chunk[chunk["value"] > 0])
        """
        if dtype is None:
            if isinstance(arrays, (list, tuple)) and arrays:
                dtype = np.asarray(arrays[0]).dtype
            else:
                raise ConfigurationError("from_arrays needs dtype= when the arrays are not a non-empty list")
        try:
            dtype = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"from_arrays {name!r}: dtype={dtype!r} is not a NumPy dtype: {exc}") from None
        return self._source(name, lambda: srcs.ArraySource(arrays), dtype, rate_limit)

    def _check_node_kind(self, node: Node) -> None:
        """A declared or inferred kind the settings cannot carry: every record
        of the stream would fail where it is serialized, and in a chained job
        perhaps never, so it is refused where the stream is declared."""
        kind = node.kind
        if kind is None:
            return
        what = f"{node.name!r}"
        if isinstance(kind, np.dtype):
            if kind.hasobject:
                raise ConfigurationError(
                    f"{what}: rows of dtype {kind} hold Python object references, which cannot travel as "
                    "bytes; use a dtype of fixed-width fields, or a record kind ('pickle', 'numpy')")
            if kind.itemsize == 0:
                raise ConfigurationError(f"{what}: rows of dtype {kind} are 0 bytes wide; give the dtype fields")
            if kind.itemsize > self.segment_size:
                raise ConfigurationError(
                    f"{what}: rows of dtype {kind} are {kind.itemsize} bytes wide and a row must fit one "
                    f"segment: raise segment_size (now {self.segment_size}) to at least {kind.itemsize} "
                    "rounded up to a power of two, or send the rows as records (kind='numpy')")
            return
        from pyflowbuf.serializers import get_serializer

        core = getattr(get_serializer(kind), "core_kind", None)
        width = _FIXED_WIDTH.get(core)
        if width is not None and self.max_record_size < width:
            raise ConfigurationError(
                f"{what}: its {core} records are {width} bytes each, over max_record_size="
                f"{self.max_record_size}: every record would be refused; raise max_record_size")

    # ---- running ----
    def plan(self):
        """The job as it would run: ``(vertices, edges)``, the tasks after chaining
        (each ``JobVertex`` lists its operators' nodes and its parallelism) and
        the exchanges between them (``JobEdge``: partitioner, key function,
        record kind). Nothing runs. A ``forward()`` between operators of
        different parallelism is a ``ValueError``.

        Example::

            vertices, edges = env.plan()
            for v in vertices:
                print(v.name, v.parallelism)
            for e in edges:
                print(e.source.name, "->", e.target.name, e.partitioner)
        """
        return plan(self.nodes, self.chaining)

    def execute(self, job_name: str | float | None = None, timeout: float | None = None, *,
                restore_from=None):
        """Run the job to completion; raises JobFailedError if any task fails.

        ``execute("name")`` names the job (PyFlink's ``execute(job_name)``);
        a number first is the timeout, as ``execute(30)`` always meant:
        ``execute(timeout=30)``. On timeout the job is cancelled and
        TimeoutError raised. An Environment executes its graph once.

        ``restore_from`` (checkpointing on): start from a checkpoint of an
        earlier run of the same job in ``checkpoint_dir``: ``"latest"`` (the
        newest complete one, or a fresh start when there is none), a
        checkpoint id, or a ``chk-<id>`` directory. When complete checkpoints
        exist and none is intact, ``CorruptCheckpointError``: a fresh start
        over their committed output is ``restore_from=None`` with the file
        sinks' ``mode="overwrite"``. A source whose input differs from what
        the checkpoint recorded is ``IncompatibleCheckpointError``.

        Returns the job's ``JobExecution`` once it has finished. Raises
        ``AlreadyExecutedError`` on a second run, ``ConfigurationError`` for a
        job without a sink or with settings that cannot work (before anything
        starts).

        Example::

            out = env.from_sequence(0, 1000).map(lambda x: x % 7).collect()
            env.execute("mod-seven", timeout=60)      # seconds; then out.result
        """
        job_name, timeout = _execute_args(job_name, timeout)
        if any(n.is_iterator for n in self.nodes):
            raise ConfigurationError("this job has a to_iterator() sink: run it with execute_iter()")
        job = self._claim(job_name, restore_from)
        self._start(job)
        return job.join(timeout)

    def execute_async(self, job_name: str | None = None, *, restore_from=None):
        """Start the job and return its JobExecution (``join``, ``cancel``,
        ``metrics``, ``done``). An Environment executes its graph once.

        Errors as for ``execute``, raised here.

        Example::

            job = env.execute_async("nightly")
            ...                          # the caller goes on meanwhile
            job.join(timeout=600)        # seconds; JobFailedError if a task failed
        """
        _job_name("job_name", job_name, optional=True)
        if any(n.is_iterator for n in self.nodes):
            # nobody would read it: the job would stall once its buffers fill
            raise ConfigurationError("this job has a to_iterator() sink: run it with execute_iter()")
        job = self._claim(job_name, restore_from)
        self._start(job)
        return job

    def execute_iter(self, sink: "IteratorSink", job_name: str | None = None):
        """Run the job and yield the records that reach ``sink`` in this thread.
        Closing the generator cancels the job. An Environment executes its
        graph once: this call takes it, even before the first record is read.

        A ``sink`` that is not a ``to_iterator()`` handle is a ``TypeError``,
        one of another Environment a ``ConfigurationError``; with checkpoints
        and ``restart_attempts`` > 0 it is refused (records handed out could be
        handed out again).

        Example::

            it = env.from_sequence(0, 10).map(lambda x: x * x).to_iterator()
            for square in env.execute_iter(it):
                print(square)
        """
        if not isinstance(sink, IteratorSink):
            raise TypeError("execute_iter takes the handle returned by Stream.to_iterator()")
        if not any(n is sink.node for n in self.nodes):
            raise ConfigurationError("execute_iter: the sink handle belongs to another Environment")
        _job_name("job_name", job_name, optional=True)
        if self.checkpoint_interval is not None and self.restart_attempts:
            raise ConfigurationError(
                "execute_iter hands records to the caller before a checkpoint covers them, so a restart "
                "would hand them out again: with restart_attempts > 0 use collect() or write_text()")
        job = self._claim(job_name)
        return self._iterate(job, sink.node)

    def _iterate(self, job, node):
        previous, self.last_execution = self.last_execution, job
        try:
            yield from job.iterate(node)
        except BaseException:
            if not job.ran:
                self.last_execution = previous
                self._unclaim(job)
            raise

    def _claim(self, job_name, restore_from=None):
        """The execution of this graph, once: checks everything that can be
        checked before anything starts, then takes the Environment."""
        if restore_from is not None and self.checkpoint_interval is None:
            raise ConfigurationError("restore_from needs checkpointing: set checkpoint_interval (and checkpoint_dir)")
        self._check_settings()
        self._check_graph()
        for node in self.nodes:
            self._check_node_kind(node)
        with self._claim_lock:
            if self._claimed_by is not None:
                raise AlreadyExecutedError(
                    f"this Environment already executed its graph (job {self.name!r}); an Environment "
                    "runs its graph once, as Flink's does: build a new Environment to run the job again")
            self._claimed_by = claim = object()
        name = self.name
        try:
            if job_name is not None:
                self.name = job_name
            job = self._execution()
        except BaseException:
            with self._claim_lock:
                self.name = name
                self._claimed_by = None
            raise
        job.claim = claim
        job.previous_name = name
        job.restore_from = restore_from
        return job

    def _check_graph(self) -> None:
        """A job that could do nothing visible is refused: with nothing
        declared, or without a sink, it would run (perhaps for a long time)
        and every record would vanish without a word."""
        if not self.nodes:
            raise ConfigurationError(
                "this Environment has nothing to run: declare a source (from_collection, read_text, ..), "
                "the operators and a sink (collect(), print(), write_text(), sink(fn), to_iterator()) "
                "before execute()")
        if not any(n.is_sink for n in self.nodes):
            ends = [n.name for n in self.nodes if not n.consumers]
            raise ConfigurationError(
                f"this job has no sink: the records of {', '.join(repr(e) for e in ends)} would go nowhere; "
                "end the stream with collect(), print(), write_text(), write_parquet(), sink(fn) or "
                "to_iterator()")

    def _unclaim(self, job):
        """A job that could not start ran nothing: the graph is still unused."""
        with self._claim_lock:
            if self._claimed_by is getattr(job, "claim", None):
                self._claimed_by = None
                self.name = job.previous_name

    def _start(self, job):
        try:
            job.start()
        except BaseException:
            if not job.ran:
                self._unclaim(job)
            raise
        self.last_execution = job

    def _execution(self):
        if self.cluster is not None:
            return self.cluster.execution(self)
        if self.workers:
            from pyflowbuf.runtime.cluster import ClusterExecution
            return ClusterExecution(self)
        from pyflowbuf.runtime.job import JobExecution
        return JobExecution(self)

    def metrics(self) -> dict:
        """The latest per-task metrics of the running job; once it has ended
        (``execute()`` returned, or ``done``), its final sample: every task's
        end state and total counts.

        A dict keyed by task name; each value holds that task's counts (records,
        bytes and buffers in and out), time shares (idle, busy, backpressured,
        ms per second) and operator counters such as ``late_records_dropped``.

        Example::

            env.execute()
            for task, m in env.metrics().items():
                print(task, m.get("records_out"), m.get("late_records_dropped"))
        """
        return {} if self.last_execution is None else self.last_execution.metrics()


class Stream:
    """A stream of records produced by one node of the graph.

    Streams are declared, not run: each method adds an operator to the
    Environment's graph and returns the stream of its output;
    ``env.execute()`` runs the whole graph.

    Example::

        doubled = env.from_sequence(0, 10).map(lambda x: 2 * x, name="double")
    """

    def __init__(self, env: Environment, node: Node, key_fn: Callable | None = None):
        self.env = env
        self.node = node
        self._partitioner = None  # None: forward when parallelism matches, else rebalance
        self._key_fn = key_fn

    def _input_to(self, parallelism: int) -> Input:
        """How this stream feeds an operator of ``parallelism``: the partitioner
        set on it, else forward when the parallelism matches, else rebalance."""
        part = self._partitioner or ("forward" if parallelism == self.node.parallelism else "rebalance")
        return Input(self.node, part, self._key_fn)

    def _then(self, name, make_operator, parallelism, kind, *, sink=False) -> Node:
        p = _parallelism(self.env, parallelism)
        return self.env._add(name=name, parallelism=p, make_operator=make_operator,
                             inputs=[self._input_to(p)], kind=kind, is_sink=sink)

    # ---- partitioning ----
    def _with(self, partitioner, key_fn=None) -> "Stream":
        s = Stream(self.env, self.node, key_fn)
        s._partitioner = partitioner
        return s

    def forward(self) -> "Stream":
        """Send each record to the subtask of the same index in the next operator
        (no exchange across subtasks; chained when possible). The next operator
        must have the same parallelism: otherwise ``execute()`` (and ``plan()``)
        raise ``ValueError``. Returns a ``Stream`` to declare that operator on.

        Example::

            s.forward().map(fn)        # same parallelism as s
        """
        return self._with("forward")

    def rebalance(self) -> "Stream":
        """Spread the records over the next operator's subtasks round-robin, to
        even out skewed subtasks or change parallelism. Returns a ``Stream``.

        Example::

            s.rebalance().map(expensive, parallelism=8)
        """
        return self._with("rebalance")

    def broadcast(self) -> "Stream":
        """Send every record to every subtask of the next operator. Returns a
        ``Stream``.

        Example::

            rules.broadcast().connect(events).process(on_rule, on_event)
        """
        return self._with("broadcast")

    def key_by(self, key_fn: Callable) -> "KeyedStream":
        """Partition by ``key_fn(record)``: records with equal keys reach the same
        subtask (a stable hash, the same in every process), where keyed
        operators keep per-key state.

        ``key_fn`` may be a column name (a str) only on a stream of Arrow or
        pandas batches, for the vectorized windows. Returns a ``KeyedStream``.
        A ``key_fn`` that is not callable (or a column name on another stream)
        is a ``TypeError``.

        Example::

            totals = orders.key_by(lambda o: o["customer"]).reduce(
                lambda a, b: {**a, "amount": a["amount"] + b["amount"]})
        """
        if isinstance(key_fn, str):
            return _key_by_column(self, key_fn)
        if not callable(key_fn):
            raise TypeError("key_by takes a function record -> key")
        ks = KeyedStream(self.env, self.node, key_fn)
        ks._partitioner = "hash"
        return ks

    # ---- event time ----
    def assign_timestamps(self, fn: Callable | str, out_of_orderness: float = 0.0,
                          idle_timeout: float | None = None, *, watermark_interval: float = 0.2,
                          unit: str = "s", parallelism: int | None = None,
                          name: str = "timestamps") -> "Stream":
        """Event time for this stream: ``fn(record)`` is a record's timestamp in
        seconds (a float or int; a datetime is converted), or in ``unit``
        ("ms", "us", "ns" since 1970) when given; timestamps that look like
        milliseconds while read as seconds warn once (``UnitWarning``), and a
        NaN timestamp is an ``InvalidTimestampError``. Watermarks follow
        the records: the highest timestamp seen minus ``out_of_orderness``,
        sent every ``watermark_interval`` seconds (Flink's 200 ms; 0: after
        every batch). A subtask that gets no records for ``idle_timeout``
        seconds is marked idle, so it does not hold back the watermark of
        the tasks it feeds. On an Arrow/pandas stream ``fn`` may be a column
        name. See ``pyflowbuf.windows``.

        Returns a ``Stream`` with timestamps (the same records). Bad durations
        or ``unit`` are a ``ConfigurationError``, a ``fn`` that is not callable
        a ``TypeError``.

        Example::

            timed = events.assign_timestamps(lambda e: e["ts"], out_of_orderness=2.0, idle_timeout=30)
            in_ms = events.assign_timestamps(lambda e: e["ts_ms"], unit="ms")
        """
        from pyflowbuf.runtime.watermarks import UNITS, TimestampsAssigner, check_seconds, in_unit

        if not isinstance(fn, str):
            _callable(fn, "assign_timestamps")
        if not isinstance(unit, str) or unit not in UNITS:
            raise ConfigurationError(f"unit must be one of {', '.join(map(repr, UNITS))}, got {unit!r}")
        if unit != "s":
            if isinstance(fn, str):
                raise ConfigurationError(
                    f"unit={unit!r} applies to a timestamp function; the column {fn!r} is read as seconds, "
                    "or as an Arrow timestamp column, whose type carries its unit (pa.timestamp('ms'))")
            fn = in_unit(fn, unit)
        ooo = check_seconds("out_of_orderness", out_of_orderness)
        idle = check_seconds("idle_timeout", idle_timeout, optional=True, positive=True)
        interval = check_seconds("watermark_interval", watermark_interval)
        if interval >= 60:
            warnings.warn(UnitWarning(
                f"assign_timestamps {name!r}: watermark_interval={watermark_interval!r} is in seconds; "
                f"values this large are usually milliseconds: for {interval / 1000:g} s pass "
                f"watermark_interval={interval / 1000:g}"), stacklevel=2)
        shared: dict = {}
        node = self._then(name, lambda: TimestampsAssigner(name, fn, ooo, idle, interval, unit, shared),
                          parallelism, self.node.kind)
        node.timestamps = fn
        node.event_time = True
        return Stream(self.env, node)

    # ---- operators ----
    def map(self, fn: Callable, *, parallelism: int | None = None, name: str = "map", kind: Any = None) -> "Stream":
        """One output record ``fn(record)`` per input record.

        ``kind`` declares the output record kind (None: inferred from the first
        output); ``parallelism`` defaults to the Environment's. Returns a
        ``Stream``. A ``fn`` that is not callable is a ``TypeError``, a bad
        ``kind`` a ``ConfigurationError``; an output that does not fit the kind
        fails the job with ``RecordTypeError`` naming the operator.

        Example::

            lengths = words.map(len, kind="int64")
            pairs = words.map(lambda w: (w, 1), name="pair")
        """
        _callable(fn, "map")
        kind = _check_kind(kind, f"map {name!r}")
        return Stream(self.env, self._then(name, lambda: ops.Map(name, fn), parallelism, kind))

    def filter(self, fn: Callable, *, parallelism: int | None = None, name: str = "filter") -> "Stream":
        """The records for which ``fn(record)`` is true, unchanged (they keep
        their kind and their timestamps). Returns a ``Stream``. A ``fn`` that is
        not callable is a ``TypeError``.

        Example::

            errors_only = lines.filter(lambda line: line.startswith("ERROR"))
        """
        _callable(fn, "filter")
        node = self._then(name, lambda: ops.Filter(name, fn), parallelism, self.node.kind)
        node.timestamps = getattr(self.node, "timestamps", None)    # the records stay as they were
        return Stream(self.env, node)

    def flat_map(self, fn: Callable, *, parallelism: int | None = None, name: str = "flat_map",
                 kind: Any = None) -> "Stream":
        """Zero or more output records per input record: ``fn(record)`` returns an
        iterable of them (a list, a generator, a set).

        A str, bytes, tuple, dict or None returned by ``fn`` is never taken
        apart: the job fails with ``RecordTypeError`` (return ``[record]`` for
        one record). ``kind`` as for ``map``. Returns a ``Stream``. A ``fn`` that
        is not callable is a ``TypeError``.

        Example::

            words = lines.flat_map(str.split)
            pairs = lines.flat_map(lambda line: [(w, 1) for w in line.split()])
        """
        _callable(fn, "flat_map")
        kind = _check_kind(kind, f"flat_map {name!r}")
        return Stream(self.env, self._then(name, lambda: ops.FlatMap(name, fn), parallelism, kind))

    def map_batches(self, fn: Callable, *, parallelism: int | None = None, name: str = "map_batches",
                    kind: Any = None) -> "Stream":
        """Apply ``fn`` to whole batches: to NumPy array chunks on a rows stream
        (``from_arrays``), to each RecordBatch/DataFrame on an arrow/pandas stream.

        ``fn`` returns the output batch (an array chunk, a RecordBatch or a
        DataFrame). On a rows stream the output keeps the input's dtype unless
        ``kind`` says otherwise. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``.

        Example::

            scaled = rows.map_batches(lambda chunk: chunk * 2)             # a rows stream
            big = batches.map_batches(lambda df: df[df["amount"] > 100])   # pandas batches
        """
        _callable(fn, "map_batches")
        kind = _check_kind(kind, f"map_batches {name!r}")
        per_record = not isinstance(self.node.kind, np.dtype)
        if kind is None and not per_record:
            kind = self.node.kind
        return Stream(self.env, self._then(name, lambda: ops.MapBatch(name, fn, per_record), parallelism, kind))

    # ---- several inputs ----
    def union(self, *others: "Stream", parallelism: int | None = None, name: str = "union") -> "Stream":
        """The records of this stream and of ``others``, in arrival order.

        Every stream must belong to this Environment, and the kinds the streams
        declare (or that their sources fixed) must agree: the union carries
        that kind. Each input is partitioned as its stream says (forward when
        the parallelism matches, else rebalance, or what key_by / rebalance /
        broadcast set on it). The union is a task of its own, reading one gate
        per input; the operators after it chain to it.

        Returns a ``Stream``. A stream of another Environment or of another kind
        is a ``ConfigurationError``, something that is not a Stream a
        ``TypeError``.

        Example::

            everything = clicks.union(views, purchases)
        """
        streams = (self,) + others
        for s in others:
            _same_env(self.env, s, "union")
        kind = _common_kind(streams, f"union {name!r}")
        p = _parallelism(self.env, parallelism)
        node = self.env._add(name=name, parallelism=p, make_operator=lambda: ops.Union(name),
                             inputs=[s._input_to(p) for s in streams], kind=kind)
        return Stream(self.env, node)

    def join(self, other: "Stream"):
        """A window join: ``a.join(b).where(key_a).equal_to(key_b)
        .window(Tumbling(5)).apply(fn(left, right))``, one output per pair
        of records with equal keys in the same window (Flink's join).

        Returns a ``JoinedStreams`` to finish with ``where``, ``equal_to``,
        ``window`` and ``apply``. Both streams need timestamps. A stream of
        another Environment is a ``ConfigurationError``.

        Example::

            pairs = (orders.join(payments)
                           .where(lambda o: o["id"]).equal_to(lambda p: p["order"])
                           .window(fb.Tumbling(60))
                           .apply(lambda o, p: (o["id"], p["amount"])))
        """
        from pyflowbuf.windows import JoinedStreams
        _same_env(self.env, other, "join")
        return JoinedStreams(self, other)

    def connect(self, other: "Stream") -> "ConnectedStreams":
        """Two streams read by one operator with a function per input
        (``.process(fn1, fn2)``, ``.map(fn1, fn2)``); the inputs may carry
        different kinds. Connect two KeyedStreams for per-key state that both
        inputs share.

        Returns ``ConnectedStreams``. A stream of another Environment is a
        ``ConfigurationError``.

        Example::

            out = commands.connect(readings).map(lambda c: ("cmd", c), lambda r: ("reading", r))
        """
        _same_env(self.env, other, "connect")
        return ConnectedStreams(self, other)

    # ---- sinks ----
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
        node = self._then(name, lambda: ops.CollectSink(name, handle._parts), parallelism, None, sink=True)
        node.collect_parts = handle._parts
        return handle

    def sink(self, fn: Callable, *, batched: bool = False, parallelism: int | None = None,
             name: str = "sink") -> None:
        """Call ``fn(record)`` (or ``fn(batch)`` with batched=True) in the sink task.

        With ``Environment(workers=N)`` the sink task runs in a worker process:
        what ``fn`` does to the caller's objects happens to the worker's copy
        (use ``collect()`` or ``to_iterator()`` to bring records back).

        Returns None (a sink ends the stream). A ``fn`` that is not callable is a
        ``TypeError``.

        Example::

            stream.sink(lambda r: db.insert(r))
            stream.sink(lambda batch: db.insert_many(batch), batched=True)
        """
        _callable(fn, "sink")
        node = self._then(name, lambda: ops.FunctionSink(name, fn, batched), parallelism, None, sink=True)
        node.user_sink = True

    def print(self, prefix: str | None = None, *, parallelism: int | None = None, name: str = "print") -> None:
        """Each record on stdout as ``str(record)``, as PyFlink's print():
        after ``"<subtask>> "`` (from 1) when the sink has several subtasks,
        ``"<prefix>> "`` / ``"<prefix>:<subtask>> "`` with a prefix. With
        ``workers=`` what the workers print (here, or with ``print()`` in an
        operator's function) is carried to the caller's ``sys.stdout``, so a
        notebook or ``redirect_stdout`` sees it, whole lines in order per
        worker, all of it before ``execute()`` returns. Not transactional:
        after a restore, records since the checkpoint print again.

        A ``prefix`` that is not a str is a ``ConfigurationError``.

        Example::

            stream.print()                  # one line per record
            stream.print("debug")           # "debug> record"
        """
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigurationError(f"print: prefix must be a str or None, got {prefix!r}")
        from pyflowbuf.connectors import PrintSink

        self._then(name, lambda: PrintSink(name, prefix), parallelism, None, sink=True)

    def write_text(self, path, *, parallelism: int | None = None, name: str = "write_text",
                   mode: str = "error") -> None:
        """One line per record (``str(record)``) in the directory ``path``:
        ``part-<subtask>-<seq>.txt`` files (one per subtask without
        checkpoints; read them back with ``read_text`` on each, or
        ``sorted(glob.glob(f"{path}/part-*"))``).

        Each part is written under a hidden name (``.part-...inprogress``)
        and renamed into place when committed: when the job ends, or with
        checkpointing on when a checkpoint covering it completes: exactly
        once across failures. ``mode``: ``"error"`` (default) refuses a
        directory that already holds output (other than the parts of the
        checkpoint being restored), ``"overwrite"`` removes it first,
        ``"append"`` adds new parts beside it (``OutputExistsError``).

        A bad ``mode`` is a ``ConfigurationError`` here; output already in the
        directory with ``mode="error"`` is ``OutputExistsError`` from
        ``execute()``, before anything runs.

        Example::

            counts.write_text("out/counts", mode="overwrite")
        """
        from pyflowbuf.runtime.outputs import FileOutput, check_mode

        path = _output_path(path, name)
        output = FileOutput(path, ".txt", check_mode(mode, f"write_text {name!r}"), f"write_text {name!r}",
                            legacy_suffixes=("",))
        env = self.env
        node = self._then(name, lambda: ops.TextFileSink(name, path, output=output,
                                                         transactional=env.checkpoint_interval is not None),
                          parallelism, None, sink=True)
        output.parallelism = node.parallelism
        node.file_output = output

    def write_parquet(self, path, *, parallelism: int | None = None, name: str = "write_parquet",
                      schema=None, row_group_size: int | None = None, compression="snappy",
                      mode: str = "error") -> None:
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

        Parts are committed as ``write_text``'s are (hidden until committed;
        with checkpointing on, exactly once across failures; readers skip
        names starting with ``.``), and ``mode`` works the same way.

        Example::

            rows.write_parquet("out/events", row_group_size=65536, compression="zstd")
        """
        from pyflowbuf.runtime.outputs import FileOutput, check_mode

        if row_group_size is not None:
            _positive_int("row_group_size", row_group_size)
        path = _output_path(path, name)
        output = FileOutput(path, ".parquet", check_mode(mode, f"write_parquet {name!r}"),
                            f"write_parquet {name!r}")
        schema = ops.parquet_settings(schema, compression)
        env = self.env
        node = self._then(name, lambda: ops.ParquetFileSink(name, path, schema=schema,
                                                            row_group_size=row_group_size,
                                                            compression=compression, output=output,
                                                            transactional=env.checkpoint_interval is not None),
                          parallelism, None, sink=True)
        output.parallelism = node.parallelism
        node.file_output = output

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


class KeyedStream(Stream):
    """A stream partitioned by key; keyed operators keep per-key state in their task.

    Made by ``Stream.key_by``; besides the ``Stream`` methods it has the
    keyed operators ``reduce``, ``process``, ``window`` and
    ``interval_join``.

    Example::

        keyed = words.key_by(lambda w: w)
    """

    def reduce(self, fn: Callable, *, parallelism: int | None = None, name: str = "reduce",
               kind: Any = None) -> Stream:
        """A rolling reduce per key: each record is folded into its key's value
        with ``fn(previous, record)``, and every updated value is emitted (the
        first record of a key as it is).

        ``kind`` declares the output kind. The per-key values live in the task
        and go into checkpoints. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``.

        Example::

            counts = (words.map(lambda w: (w, 1))
                           .key_by(lambda kv: kv[0])
                           .reduce(lambda a, b: (a[0], a[1] + b[1])))
            # "a", "b", "a" -> ("a", 1), ("b", 1), ("a", 2)
        """
        _callable(fn, "reduce")
        kind = _check_kind(kind, f"reduce {name!r}")
        key_fn = self._key_fn
        node = self._then(name, lambda: ops.KeyedReduce(name, key_fn, fn), parallelism, kind)
        return Stream(self.env, node)

    def process(self, fn: Callable, *, on_timer: Callable | None = None, on_end: Callable | None = None,
                parallelism: int | None = None, name: str = "process", kind: Any = None) -> Stream:
        """``fn(key, record, state_dict) -> iterable of outputs (or None)``.

        A ``fn`` that takes a fourth argument gets a context
        (``pyflowbuf.runtime.timers.Context``): ``ctx.timestamp`` (the
        record's event time), ``ctx.watermark``,
        ``ctx.register_event_time_timer(t)``,
        ``ctx.register_processing_time_timer(t)``. Timers call
        ``on_timer(key, t, state, ctx)``; they are per key, deduplicated, fire
        in time order in the task's thread, and go into checkpoints. At end of
        input every event-time timer fires (the watermark goes to +inf), then
        ``on_end(key, state, ctx)`` runs for every key with state. ``fn`` may
        also be a ``KeyedProcessFunction`` (process_element, on_timer, on_end).

        Returns a ``Stream``. A function that cannot take the arguments it will
        be called with is a ``ConfigurationError``, one that is not callable a
        ``TypeError``, both raised here.

        Example::

            def count(key, record, state):
                state["n"] = state.get("n", 0) + 1
                return [(key, state["n"])]

            def alarm(key, record, state, ctx):
                ctx.register_event_time_timer(ctx.timestamp + 60)    # seconds

            counts = events.key_by(lambda e: e["user"]).process(count)
            alarms = timed.key_by(lambda e: e["user"]).process(
                alarm, on_timer=lambda key, t, state, ctx: [(key, t)])
        """
        from pyflowbuf.runtime.timers import KeyedProcessFunction, KeyedProcessOperator, takes_context

        is_class = isinstance(fn, KeyedProcessFunction)
        if not is_class:
            _callable(fn, "process")
            _check_arity(fn, f"process {name!r}", "fn(key, record, state) or fn(key, record, state, ctx)", 3, 4)
        if on_timer is not None:
            _callable(on_timer, "process on_timer")
            _check_arity(on_timer, f"process {name!r} on_timer", "on_timer(key, t, state, ctx)", 4)
        if on_end is not None:
            _callable(on_end, "process on_end")
            _check_arity(on_end, f"process {name!r} on_end", "on_end(key, state, ctx)", 3)
        kind = _check_kind(kind, f"process {name!r}")
        key_fn = self._key_fn
        with_ctx = is_class or takes_context(fn, 3)
        if not (with_ctx or on_timer or on_end):
            node = self._then(name, lambda: ops.KeyedProcess(name, key_fn, fn), parallelism, kind)
            return Stream(self.env, node)
        ts_fn = getattr(self.node, "timestamps", None)
        if isinstance(ts_fn, str):
            ts_fn = None
        node = self._then(name, lambda: KeyedProcessOperator(name, key_fn, ts_fn, fn, on_timer, on_end,
                                                             with_ctx), parallelism, kind)
        node.event_time = True
        return Stream(self.env, node)

    def window(self, assigner) -> "Any":
        """Event-time windows per key: ``Tumbling(size)``, ``Sliding(size,
        slide)`` or ``Session(gap)``; then ``.reduce``, ``.aggregate`` or
        ``.process`` (``allowed_lateness(s)`` first, if wanted). The stream
        needs timestamps (``assign_timestamps``). See ``pyflowbuf.windows``.

        Returns a ``WindowedStream``. An ``assigner`` that is not one of those
        is a ``TypeError``, a stream without timestamps a
        ``ConfigurationError``.

        Example::

            per_minute = (timed.key_by(lambda e: e["page"])
                               .window(fb.Tumbling(60))
                               .aggregate(fb.Count(), window_function=lambda page, w, n: (page, w.start, n)))
        """
        from pyflowbuf.windows import WindowedStream
        return WindowedStream(self, assigner)

    def interval_join(self, other: "KeyedStream", lower: float | None = None, upper: float | None = None):
        """Join each record of this stream with the records of ``other`` of
        the same key whose time lies in [t + lower, t + upper]:
        ``a.interval_join(b).between(lower, upper).process(fn)``, or
        ``a.interval_join(b, lower, upper).process(fn)``.

        ``lower`` and ``upper`` are seconds of event time (finite, ``lower <=
        upper``, either sign). Returns an ``IntervalJoin`` (finish it with
        ``process``). Streams that are not both keyed are a
        ``ConfigurationError``.

        Example::

            matched = (clicks.key_by(lambda c: c["ad"])
                             .interval_join(views.key_by(lambda v: v["ad"]), -5.0, 0.0)
                             .process(lambda click, view: [(click["ad"], view["ts"], click["ts"])]))
        """
        from pyflowbuf.windows import IntervalJoin
        join = IntervalJoin(self, other)
        return join if lower is None and upper is None else join.between(lower, upper)


class ConnectedStreams:
    """Two streams connected for one operator with two inputs (``Stream.connect``).

    ``fn1`` handles the records of the first stream, ``fn2`` those of the
    second. When both streams are keyed (``a.key_by(k1).connect(b.key_by(k2))``)
    both are hash partitioned with the same stable hash, so records with equal
    keys from either side reach the same subtask and share its per-key state.

    Example::

        a = orders.key_by(lambda o: o["id"])
        b = payments.key_by(lambda p: p["order"])
        both = a.connect(b)
    """

    def __init__(self, first: Stream, second: Stream):
        self.env = first.env
        self.first = first
        self.second = second

    @property
    def keyed(self) -> bool:
        """Whether both connected streams are keyed (``key_by``), so the inputs
        share per-key state.

        Example::

            assert orders.key_by(k1).connect(payments.key_by(k2)).keyed
        """
        return isinstance(self.first, KeyedStream) and isinstance(self.second, KeyedStream)

    def _node(self, name, make_operator, parallelism, kind) -> Stream:
        p = _parallelism(self.env, parallelism)
        node = self.env._add(name=name, parallelism=p, make_operator=make_operator,
                             inputs=[self.first._input_to(p), self.second._input_to(p)], kind=kind)
        return Stream(self.env, node)

    def process(self, fn1: Callable, fn2: Callable, *, on_timer: Callable | None = None,
                on_end: Callable | None = None, parallelism: int | None = None,
                name: str = "co_process", kind: Any = None) -> Stream:
        """Keyed: ``fn_i(key, record, state) -> iterable of outputs (or None)``,
        ``state`` the per-key dict both inputs share. Unkeyed:
        ``fn_i(record, state)`` with one ``state`` dict per subtask.

        Keyed, a ``fn_i`` taking a fourth argument gets the context of
        ``KeyedStream.process`` (timestamps, watermark, timers), and
        ``on_timer(key, t, state, ctx)`` / ``on_end(key, state, ctx)`` work as
        there; the watermark is the minimum of the two inputs'.

        Returns a ``Stream``. One input keyed and the other not, timers on
        unkeyed inputs, or functions that cannot take their arguments are a
        ``ConfigurationError``; a function that is not callable a ``TypeError``.

        Example::

            def on_order(key, order, state):
                state["order"] = order

            def on_payment(key, payment, state):
                order = state.pop("order", None)
                return None if order is None else [(key, order["amount"], payment["amount"])]

            paid = (orders.key_by(lambda o: o["id"])
                          .connect(payments.key_by(lambda p: p["order"]))
                          .process(on_order, on_payment))
        """
        _callable(fn1, "process (fn1, for the first input)")
        _callable(fn2, "process (fn2, for the second input)")
        kind = _check_kind(kind, f"process {name!r}")
        first_keyed = isinstance(self.first, KeyedStream)
        if first_keyed != isinstance(self.second, KeyedStream):
            keyed, plain = ("first", "second") if first_keyed else ("second", "first")
            raise ConfigurationError(
                f"process {name!r}: the {keyed} connected stream is keyed and the {plain} is not, so "
                "records with equal keys would not meet in one subtask and the per-key state could not "
                "be shared: key_by both streams, or neither for one state dict per subtask")
        from pyflowbuf.runtime.timers import KeyedCoProcessOperator, takes_context

        for i, f in ((1, fn1), (2, fn2)):
            if first_keyed:
                _check_arity(f, f"process {name!r} (fn{i})",
                             f"fn{i}(key, record, state) or fn{i}(key, record, state, ctx)", 3, 4)
            else:
                _check_arity(f, f"process {name!r} (fn{i})", f"fn{i}(record, state)", 2)
        if on_timer is not None:
            _check_arity(on_timer, f"process {name!r} on_timer", "on_timer(key, t, state, ctx)", 4)
        if on_end is not None:
            _check_arity(on_end, f"process {name!r} on_end", "on_end(key, state, ctx)", 3)
        ctx = (takes_context(fn1, 3 if first_keyed else 2), takes_context(fn2, 3 if first_keyed else 2))
        if first_keyed and (any(ctx) or on_timer is not None or on_end is not None):
            k1, k2 = self.first._key_fn, self.second._key_fn
            ts = tuple(None if isinstance(t, str) else t
                       for t in (getattr(s.node, "timestamps", None) for s in (self.first, self.second)))
            make = lambda: KeyedCoProcessOperator(name, (k1, k2), ts, (fn1, fn2), on_timer,  # noqa: E731
                                                  on_end, ctx)
            stream = self._node(name, make, parallelism, kind)
            stream.node.event_time = True
            return stream
        if on_timer is not None or on_end is not None:
            raise ConfigurationError(f"process {name!r}: timers are per key: key_by both connected streams")
        if first_keyed:
            k1, k2 = self.first._key_fn, self.second._key_fn
            make = lambda: ops.KeyedCoProcess(name, k1, k2, fn1, fn2)  # noqa: E731
        else:
            make = lambda: ops.CoProcess(name, fn1, fn2)  # noqa: E731
        return self._node(name, make, parallelism, kind)

    def map(self, fn1: Callable, fn2: Callable, *, parallelism: int | None = None,
            name: str = "co_map", kind: Any = None) -> Stream:
        """One output per record: ``fn1(record)`` for the first input,
        ``fn2(record)`` for the second.

        Returns a ``Stream``; a function that is not callable is a ``TypeError``.

        Example::

            tagged = clicks.connect(views).map(lambda c: ("click", c), lambda v: ("view", v))
        """
        _callable(fn1, "map (fn1, for the first input)")
        _callable(fn2, "map (fn2, for the second input)")
        kind = _check_kind(kind, f"map {name!r}")
        return self._node(name, lambda: ops.CoMap(name, fn1, fn2), parallelism, kind)


class CollectSink:
    """Handle of a ``collect()`` sink; ``result`` is filled when the job ends.

    Example::

        handle = stream.collect()
        env.execute()
        print(handle.result)
    """

    def __init__(self):
        self._parts: dict = {}

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


_FIXED_WIDTH = {"int64": 8, "float64": 8}


def _key_by_column(stream, column):
    """``key_by("column")`` of an Arrow/pandas batch stream: for the
    vectorized windows (``window(...).aggregate({...})``), which group rows
    by that column themselves."""
    kind = stream.node.kind
    name = None
    if kind is not None and not isinstance(kind, np.dtype):
        from pyflowbuf.serializers import get_serializer
        name = get_serializer(kind).name
    if name not in ("arrow", "pandas"):
        raise TypeError(f"key_by takes a function record -> key; a column name ({column!r}) keys only a stream "
                        "declared as Arrow or pandas batches (kind='arrow' / 'pandas')")

    def no_record_key(batch):
        raise ConfigurationError(
            f"key_by({column!r}) names a column of Arrow/pandas batches; it keys the vectorized windows "
            "(window(...).aggregate({...})) only: key other operators with a function")
    ks = KeyedStream(stream.env, stream.node, no_record_key)
    ks._partitioner = "hash"
    ks._key_column = column
    return ks


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Settings in seconds, and the value from which each only makes sense as
# milliseconds (Flink's unit for all of them): 1000 is "1 s" in Flink and
# "17 minutes" here. A user who does mean that many seconds can filter
# UnitWarning.
_SECONDS_SETTINGS = {"checkpoint_interval": 1000, "checkpoint_timeout": 100_000, "buffer_timeout": 10,
                     "alignment_timeout": 1000, "debloat_target": 100, "debloat_period": 60,
                     "metrics_interval": 1000}


def _warn_milliseconds(env) -> None:
    for name, limit in _SECONDS_SETTINGS.items():
        v = getattr(env, name)
        if v is not None and v >= limit:
            warnings.warn(UnitWarning(
                f"{name}={v!r} is in seconds ({v / 60:.4g} minutes); values this large are usually "
                f"milliseconds: for {v / 1000:g} s pass {name}={v / 1000:g}. (If you mean seconds, "
                "filter pyflowbuf.errors.UnitWarning.)"), stacklevel=3)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _positive_int(name, v):
    if not _int(v) or v < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {v!r}")


def _output_path(path, name):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigurationError(f"{name!r}: path must be a directory path, got {path!r}")
    return os.fspath(path)


def _parallelism(env, parallelism) -> int:
    if parallelism is None:
        return env.parallelism
    _positive_int("parallelism", parallelism)
    return parallelism


def _same_env(env, stream, what):
    if not isinstance(stream, Stream):
        raise TypeError(f"{what} takes Streams, got {type(stream).__name__}")
    if stream.env is not env:
        raise ConfigurationError(f"{what}: the streams belong to different Environments; "
                                 "a job reads streams of its own Environment only")


def _kind_identity(kind):
    """What makes two declared kinds the same: a dtype itself, else the
    serializer's name ('int64' and get_serializer('int64') are one kind)."""
    if isinstance(kind, np.dtype):
        return kind
    from pyflowbuf.serializers import get_serializer

    return get_serializer(kind).name


def _common_kind(streams, what):
    """The kind the streams declare (None when none does); streams declaring
    different kinds are refused, as they would be at their first record."""
    from pyflowbuf.serializers import kind_label

    known = [s for s in streams if s.node.kind is not None]
    if not known:
        return None
    first = known[0]
    for s in known[1:]:
        if _kind_identity(s.node.kind) != _kind_identity(first.node.kind):
            raise ConfigurationError(
                f"{what}: the streams carry different record kinds: {first.node.name!r} carries "
                f"{kind_label(first.node.kind)} and {s.node.name!r} carries {kind_label(s.node.kind)}; "
                "a union carries one kind: map the streams to one kind first, or connect() them")
    return first.node.kind


def _job_name(param, v, optional=False):
    if v is None and optional:
        return
    if not isinstance(v, str) or not v:
        raise ConfigurationError(f"{param} must be a non-empty str, got {v!r}")


def _check_kind(kind, what):
    """kind= as a declaration takes it: None (inferred from the first record),
    a NumPy dtype (a rows stream), a Serializer instance or a registered name.
    The serializers' registry decides what a name means."""
    if kind is None or isinstance(kind, np.dtype):
        return kind
    if isinstance(kind, type) and issubclass(kind, np.generic):
        raise ConfigurationError(
            f"{what}: kind={kind.__name__} is a NumPy scalar type; a rows stream takes a dtype: "
            f"kind=np.dtype(np.{kind.__name__})")
    from pyflowbuf.serializers import get_serializer

    try:
        get_serializer(kind)
    except ValueError as exc:
        raise ConfigurationError(f"{what}: kind={kind!r} is not a record kind: {exc}") from None
    except TypeError:        # unhashable: no name can match it
        raise ConfigurationError(
            f"{what}: kind={kind!r} is not a record kind: give None (inferred), a NumPy dtype, a "
            "Serializer instance or a registered name such as 'int64', 'str', 'bytes'") from None
    return kind


def _sequence_args(start, stop, step):
    def as_int(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConfigurationError(f"from_sequence: {name} must be an int, got {v!r}")
        return int(v)

    start = as_int("start", start)
    step = as_int("step", step)
    if stop is not None:
        stop = as_int("stop", stop)
    if step == 0:
        raise ConfigurationError("from_sequence: step must not be 0")
    lo, hi = _INT64
    if not lo <= start <= hi:
        raise ConfigurationError(f"from_sequence: start={start} does not fit the stream's kind, int64")
    if stop is not None:
        r = range(start, stop, step)
        if r and not lo <= r[-1] <= hi:
            raise ConfigurationError(
                f"from_sequence: stop={stop} makes values up to {r[-1]}, which do not fit the "
                "stream's kind, int64")
    return start, stop, step


def _execute_args(job_name, timeout):
    """execute(job_name=None, timeout=None), where a number in job_name's place
    is the timeout: execute(30) has always meant execute(timeout=30)."""
    if _number(job_name):
        if timeout is not None:
            raise ConfigurationError(
                f"execute() got a timeout twice ({job_name!r} and timeout={timeout!r}); "
                "execute(job_name, timeout) takes the name first")
        job_name, timeout = None, job_name
    _job_name("job_name", job_name, optional=True)
    return job_name, check_timeout(timeout)


def _callable(fn, what):
    if not callable(fn):
        raise TypeError(f"{what} takes a function, got {type(fn).__name__}")


def _check_arity(fn, what, call, *counts):
    """Refuse, where the operator is declared, a function that cannot take the
    positional arguments its operator will pass (``counts``: the accepted
    numbers; ``call`` shows them); otherwise its first record fails the job.
    A callable without a signature (some builtins) is left to that call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    for n in counts:
        try:
            sig.bind(*range(n))
            return
        except TypeError:
            pass
    label = getattr(fn, "__qualname__", None) or type(fn).__name__
    raise ConfigurationError(f"{what}: the function is called as {call}, but {label}{sig} cannot take "
                             f"{' or '.join(map(str, counts))} positional arguments")
