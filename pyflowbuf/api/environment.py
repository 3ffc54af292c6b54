"""``Environment``: the job graph, its settings, and running it.

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

import math
import os
import threading
from typing import Any

import numpy as np

from pyflowbuf._validation import _FIXED_WIDTH, _execute_args, _int, _job_name, _number, _positive_int, _warn_milliseconds
from pyflowbuf.api.sinks import IteratorSink
from pyflowbuf.api.sources import SourceDeclarations
from pyflowbuf.errors import AlreadyExecutedError, ConfigurationError
from pyflowbuf.runtime.checkpointing import ALIGNMENTS, MODES
from pyflowbuf.runtime.cluster import ClusterExecution
from pyflowbuf.runtime.debloat import check_settings as _check_debloat
from pyflowbuf.runtime.graph import Node, plan
from pyflowbuf.runtime import overrides as _overrides
from pyflowbuf.runtime.job import JobExecution
from pyflowbuf.runtime.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from pyflowbuf.runtime.restore import check_operator_ids
from pyflowbuf.serializers import get_serializer


class Environment(SourceDeclarations):
    """Holds the job graph and its settings.

    Parameters
    ----------
    parallelism : default parallelism of operators (``pyflowbuf run --parallelism N``
        replaces it, as ``--workers N`` does ``workers``).
    max_parallelism : the number of key groups (default 128, at most 32768):
        keyed state is stored per key group, so a job can be restored at any
        parallelism up to this; it cannot change between runs of a job.
    segment_size : bytes per memory segment (power of two, 256 B .. 1 MiB).
    num_segments : size of the NetworkBufferPool; default: enough for every
        output pool at its cap, so memory is bounded by construction.
    buffer_timeout : seconds after which a partly filled buffer is shipped
        (Flink's execution.buffer-timeout, default 0.1); 0 ships per record.
    chaining : fuse forward operators of equal parallelism into one task
        (an ``assign_timestamps`` right after a source is in the source's
        task either way: timestamps are assigned at the source).
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
    incremental_checkpoints : keyed state that did not change since the last
        checkpoint is not written again (default True; savepoints are always whole).
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
                 cluster: Any = None, max_parallelism: int = DEFAULT_MAX_PARALLELISM,
                 incremental_checkpoints: bool = True):
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
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
        self.incremental_checkpoints = incremental_checkpoints
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
        # `pyflowbuf run --parallelism/--workers`: in place before any stream is declared
        for setting, value in _overrides.current().items():
            setattr(self, setting, value)
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
        check_max_parallelism(self.max_parallelism)
        _positive_int("max_batch", self.max_batch)
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
        if type(self.incremental_checkpoints) is not bool:
            raise ConfigurationError(
                f"incremental_checkpoints must be True or False, got {self.incremental_checkpoints!r}")
        if not _int(self.restart_attempts) or self.restart_attempts < 0:
            raise ConfigurationError(f"restart_attempts must be an int >= 0, got {self.restart_attempts!r}")
        if self.checkpointing_mode not in MODES:
            raise ConfigurationError(
                f"checkpointing_mode must be one of {MODES}, got {self.checkpointing_mode!r}")
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
        """The checkpoints of the running or last job, oldest first: id, kind
        ("checkpoint"; "savepoint" for one the user asked for, with
        ``savepoint: True`` and its ``path``), status (completed / aborted /
        expired / failed), trigger_time, duration_s, alignment_ms per task,
        state_bytes, size.

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

    # ---- the graph ----
    def _add(self, **kw) -> Node:
        node = Node(id=len(self.nodes), **kw)
        self._check_node_kind(node)
        for inp in node.inputs:
            inp.node.consumers.append(node)
        self.nodes.append(node)
        return node

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
        record kind, and ``tag`` for the edge of a side output). Nothing runs. A ``forward()`` between operators of
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
                restore_from=None, allow_non_restored_state: bool = False):
        """Run the job to completion; raises JobFailedError if any task fails.

        ``execute("name")`` names the job (PyFlink's ``execute(job_name)``);
        a number first is the timeout, as ``execute(30)`` always meant:
        ``execute(timeout=30)``. On timeout the job is cancelled and
        TimeoutError raised. An Environment executes its graph once.

        ``restore_from`` (checkpointing on): start from a checkpoint of an
        earlier run of the same job in ``checkpoint_dir``: ``"latest"`` (the
        newest complete one, or a fresh start when there is none), a
        checkpoint id, a ``chk-<id>`` directory, or a savepoint directory
        (``job.savepoint()``), at any parallelism up to ``max_parallelism``.
        State maps to operators by id (``Stream.uid``); state of an operator
        the job no longer has is refused unless
        ``allow_non_restored_state=True``. When complete checkpoints
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
        job = self._claim(job_name, restore_from, allow_non_restored_state)
        self._start(job)
        return job.join(timeout)

    def execute_async(self, job_name: str | None = None, *, restore_from=None,
                      allow_non_restored_state: bool = False):
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
        job = self._claim(job_name, restore_from, allow_non_restored_state)
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

    def _claim(self, job_name, restore_from=None, allow_non_restored_state=False):
        """The execution of this graph, once: checks everything that can be
        checked before anything starts, then takes the Environment."""
        if restore_from is not None and self.checkpoint_interval is None:
            raise ConfigurationError("restore_from needs checkpointing: set checkpoint_interval (and checkpoint_dir)")
        self._check_settings()
        self._check_graph()
        check_operator_ids(self)
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
        job.allow_non_restored_state = bool(allow_non_restored_state)
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
            return ClusterExecution(self)
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


