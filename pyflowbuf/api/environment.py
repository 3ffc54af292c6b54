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

import copy
import os
import threading
from typing import Any

from pyflowbuf import config as _config
from pyflowbuf._validation import (_execute_args, _job_name, _positive_int, check_graph, check_key_hashes,
                                   check_node_kind)
from pyflowbuf.api.sinks import IteratorSink
from pyflowbuf.api.connectors import ConnectorSourceDeclarations
from pyflowbuf.api.sources import SourceDeclarations
from pyflowbuf.config import UNSET, CheckpointConfig, DebloatConfig, MetricsConfig, NetworkConfig, RestartConfig
from pyflowbuf.errors import AlreadyExecutedError, ConfigurationError
from pyflowbuf.cluster.driver import WorkerLauncher
from pyflowbuf.jobgraph.graph import Node, plan
from pyflowbuf.jobgraph.spec import JobSpec
from pyflowbuf.cluster import control as _control
from pyflowbuf import ui as _ui
from pyflowbuf.net import tls as _net_tls
from pyflowbuf.runtime import overrides as _overrides
from pyflowbuf.runtime.job import JobExecution
from pyflowbuf.checkpoint.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from pyflowbuf.checkpointing.restore import check_operator_ids


@_config.flat_settings
class Environment(SourceDeclarations, ConnectorSourceDeclarations):
    """Holds the job graph and its settings.

    Parameters
    ----------
    parallelism : default parallelism of operators (``pyflowbuf run --parallelism N``
        replaces it, as ``--workers N`` does ``workers``).
    max_parallelism : the number of key groups (default 128, at most 32768):
        keyed state is stored per key group, so a job can be restored at any
        parallelism up to this; it cannot change between runs of a job.
    chaining : fuse forward operators of equal parallelism into one task
        (an ``assign_timestamps`` right after a source is in the source's
        task either way: timestamps are assigned at the source).
    max_batch : records a task moves per crossing into the core.
    name : the job's name in errors, metrics and Prometheus labels
        (``execute("name")`` sets it too).
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
    checkpoint, restart, network, debloat, metrics : the configuration objects
        (``pyflowbuf.config``): ``CheckpointConfig`` (checkpoints, off while
        its interval is None; see docs/checkpoints.md), ``RestartConfig``,
        ``NetworkConfig`` (segments, buffers, buffer timeout, record size,
        TCP), ``DebloatConfig`` (or ``debloat=True``), ``MetricsConfig``
        (samples to a JSON-lines log, Prometheus, a live view). The Environment
        holds them as ``checkpoint_config``, ``restart_config``, ...
    segment_size, num_segments, buffer_timeout, output_buffers, max_record_size,
    credit_based, bind_host, metrics_interval, metrics_log, prometheus_port,
    live_view, ui_port, ui_host, checkpoint_interval, checkpoint_dir, checkpoint_timeout,
    checkpoints_retained, checkpointing_mode, checkpoint_alignment,
    alignment_timeout, incremental_checkpoints, restart_attempts, debloat_target, debloat_period,
    debloat_samples, debloat_threshold, min_buffer_size : the same settings
        as flat keywords (``pyflowbuf.config.FLAT`` names the field of each:
        ``checkpoint_interval`` is ``CheckpointConfig.interval``), readable
        and settable as attributes. A setting given both ways is a
        ``ConfigurationError``. ``checkpoint_mode`` is the old spelling of
        ``checkpoint_alignment`` (deprecated).
    control_port : open the job's control endpoint on ``bind_host`` at this port
        (0: a free one), for ``pyflowbuf savepoint`` and ``pyflowbuf stop``; it
        writes ``<checkpoint_dir>/_control.json`` (mode 0600) while the job
        runs. Needs checkpointing. None (default): no endpoint. With ``tls``
        the endpoint is mutual TLS (docs/checkpoints.md).
    tls : mutual TLS 1.3 on every connection between the job's processes
        (``workers=N`` or a cluster): ``True`` makes a private CA for the job
        and one certificate per attempt, in memory; a
        ``pyflowbuf.net.TLSConfig(cert, key, ca, fingerprint=None)`` uses
        your own files. None (default): authenticated, not encrypted (with a
        ``SparkCluster`` TLS turns on by itself when Spark encrypts; see
        docs/workers.md). A job in one process has no connection to encrypt
        but its control endpoint (``control_port``).

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

    def __init__(self, parallelism: int = 1, *, max_parallelism: int = DEFAULT_MAX_PARALLELISM,
                 chaining: bool = True, max_batch: int = 1024, name: str = "job", workers: int | None = None,
                 cluster: Any = None, allow_pickle: bool = False, control_port: int | None = None,
                 checkpoint: CheckpointConfig | None = None, restart: RestartConfig | None = None,
                 network: NetworkConfig | None = None, debloat: DebloatConfig | bool = UNSET,
                 metrics: MetricsConfig | None = None,
                 segment_size: int = UNSET, num_segments: int | None = UNSET, buffer_timeout: float = UNSET,
                 output_buffers: tuple | None = UNSET, max_record_size: int = UNSET, credit_based: bool = UNSET,
                 bind_host: str = UNSET, metrics_interval: float = UNSET,
                 metrics_log: str | os.PathLike | None = UNSET, prometheus_port: int | None = UNSET,
                 live_view: bool = UNSET, ui_port: int | None = UNSET, ui_host: str = UNSET,
                 checkpoint_interval: float | None = UNSET,
                 checkpoint_dir: str | os.PathLike | None = UNSET, checkpoint_timeout: float = UNSET,
                 checkpoints_retained: int = UNSET, checkpointing_mode: str = UNSET,
                 checkpoint_alignment: str = UNSET, alignment_timeout: float | None = UNSET,
                 incremental_checkpoints: bool = UNSET,
                 restart_attempts: int = UNSET, debloat_target: float = UNSET, debloat_period: float = UNSET,
                 debloat_samples: int = UNSET, debloat_threshold: float = UNSET, min_buffer_size: int = UNSET,
                 checkpoint_mode: str = UNSET, tls: Any = None):
        given = locals()
        flat = {k: given[k] for k in (*_config.FLAT, *_config.DEPRECATED)
                if k != "debloat" and given[k] is not UNSET}
        groups = {"checkpoint": checkpoint, "restart": restart, "network": network, "metrics": metrics,
                  "debloat": None if debloat is UNSET else debloat}
        for group, obj in _config.resolve(groups, flat).items():
            setattr(self, _config.GROUPS[group][1], obj)
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.chaining = chaining
        self.max_batch = max_batch
        self.name = name
        self.workers = workers
        self.cluster = cluster
        self.allow_pickle = allow_pickle
        self.control_port = control_port
        self.tls = tls
        # `pyflowbuf run --parallelism/--workers`: in place before any stream is declared
        for setting, value in _overrides.current().items():
            setattr(self, setting, value)
        self._check_settings()
        self.nodes: list[Node] = []
        self._side_streams: dict = {}   # the reader node's id -> its Stream (side_output(), late())
        self._salted_key_functions: list = []     # (what, use) of key functions calling hash()
        self.last_execution = None
        self._claim_lock = threading.Lock()
        self._claimed_by = None        # the job that ran (or runs) this graph

    def _check_settings(self) -> None:
        """The settings outside the config objects (which check themselves) and
        those that must agree, at construction and again before a job starts
        (the attributes are public, so they may have changed in between)."""
        _positive_int("parallelism", self.parallelism)
        check_max_parallelism(self.max_parallelism)
        _positive_int("max_batch", self.max_batch)
        _job_name("name", self.name)
        for group, (cls, attr) in _config.GROUPS.items():
            if not isinstance(getattr(self, attr), cls):
                raise ConfigurationError(f"{attr} must be a pyflowbuf.{cls.__name__}, got {getattr(self, attr)!r}")
        _config.check_together(self.network_config, self.debloat_config)
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
        _control.check_settings(self.control_port, self.checkpoint_config)
        _net_tls.resolve(self.tls, "Environment(tls=...)")

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The ``CheckpointConfig``, as the job uses it: with checkpoints on and
        no directory given, ``directory`` is the job's own,
        ``checkpoints/<name>`` (``pyflowbuf.config.default_checkpoint_dir``),
        which follows the job's name (``execute("payments")`` too).

        Example::

            env = fb.Environment(checkpoint_interval=1.0, name="payments")
            env.checkpoint_dir                 # 'checkpoints/payments'
        """
        given = self._given_checkpoint_config
        name = getattr(self, "name", None)
        if not isinstance(given, CheckpointConfig) or given.directory is not None or not given.enabled or not isinstance(name, str) or not name:
            return given
        # a copy made without __post_init__: reading the setting must not warn again
        resolved = copy.copy(given)
        object.__setattr__(resolved, "directory", _config.default_checkpoint_dir(name))
        return resolved

    @checkpoint_config.setter
    def checkpoint_config(self, value) -> None:
        self._given_checkpoint_config = value

    def configuration(self) -> dict:
        """The keyword arguments that build an Environment with these settings:
        the plain ones and one config object per group (no graph, no job).

        Example::

            env = fb.Environment(parallelism=2, checkpoint_interval=1.0)
            kw = env.configuration()
            kw["checkpoint"]                   # CheckpointConfig(interval=1.0, ...)
            twin = fb.Environment(**kw)        # the same settings, an empty graph
        """
        out = {"parallelism": self.parallelism, "max_parallelism": self.max_parallelism,
               "chaining": self.chaining, "max_batch": self.max_batch, "name": self.name,
               "workers": self.workers, "cluster": self.cluster, "allow_pickle": self.allow_pickle,
               "control_port": self.control_port, "tls": self.tls}
        for group, (_, attr) in _config.GROUPS.items():
            out[group] = getattr(self, attr)
        return out

    def checkpoints(self) -> list:
        """The checkpoints of the running or last job, oldest first: id, kind
        ("checkpoint"; "savepoint" for one the user asked for, with
        ``savepoint: True`` and its ``path``), status (completed / aborted /
        expired / failed), trigger_time, duration_s, alignment_ms per task,
        state_bytes, size; ``subtasks``: per task its phases (start delay,
        alignment, synchronous snapshot, asynchronous write and fsync, bytes,
        in-flight bytes, whether it went unaligned, acknowledgement), and
        ``phases``: the slowest subtask per phase and the coordinator's own
        (trigger to source barrier, metadata, commits). docs/checkpoints.md,
        "Where a checkpoint's time goes", shows how to read them.

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
        net = self.network_config
        check_node_kind(node, net.segment_size, net.max_record_size)

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
        checkpoint id (``15`` or ``"15"``), a ``chk-<id>`` directory, or a
        savepoint directory (``job.savepoint()``), at any parallelism up to
        ``max_parallelism``. A checkpoint found by ``"latest"`` or an id must
        be this job's (its name, and its stateful operators), else
        ``IncompatibleCheckpointError``; one given by path may be of an
        earlier version of it. A ``checkpoint_dir`` in use by another running
        job, or holding another job's checkpoints, is
        ``CheckpointDirectoryInUseError`` (docs/checkpoints.md, "Whose
        checkpoints: the job's directory").
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
        if self.control_port is not None:
            raise ConfigurationError("execute_iter runs without a control endpoint: control_port is for "
                                     "execute() and execute_async()")
        if self.checkpoint_config.enabled and self.restart_config.attempts:
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
        if restore_from is not None and not self.checkpoint_config.enabled:
            raise ConfigurationError("restore_from needs checkpointing: set checkpoint_interval (and checkpoint_dir)")
        self._check_settings()
        check_graph(self.nodes)
        check_operator_ids(self.job_spec())
        check_key_hashes(self._salted_key_functions, checkpoints=self.checkpoint_config.enabled,
                         cluster=self.cluster)
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
            for node in self.nodes:     # what a node takes from the job as it starts (its name, its directory)
                bind = getattr(node.job_check, "bind", None)
                if bind is not None:
                    bind(self.name, self.checkpoint_config)
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

    def _unclaim(self, job):
        """A job that could not start ran nothing: the graph is still unused."""
        with self._claim_lock:
            if self._claimed_by is getattr(job, "claim", None):
                self._claimed_by = None
                self.name = job.previous_name

    def _start(self, job):
        try:
            # control_port and ui_port: bound before the job starts
            with _control.endpoint_for(job.spec, job), _ui.served_for(job.spec, job):
                job.start()
        except BaseException:
            if not job.ran:
                self._unclaim(job)
            raise
        self.last_execution = job

    def job_spec(self) -> JobSpec:
        """The job as the runtime receives it (``pyflowbuf.jobgraph.spec``):
        this graph and these settings, resolved. ``execute()`` runs one;
        building it starts nothing and claims nothing.

        Example::

            spec = env.job_spec()
            spec.name, spec.parallelism, len(spec.nodes)
            spec.checkpoint_config.directory     # the job's own, when none was given
        """
        given = self._given_checkpoint_config
        return JobSpec(
            name=self.name, nodes=self.nodes, parallelism=self.parallelism,
            max_parallelism=self.max_parallelism, chaining=self.chaining, max_batch=self.max_batch,
            allow_pickle=self.allow_pickle, workers=self.workers, control_port=self.control_port,
            network_config=self.network_config, checkpoint_config=self.checkpoint_config,
            restart_config=self.restart_config, debloat_config=self.debloat_config,
            metrics_config=self.metrics_config, tls=self.tls,
            default_checkpoint_dir=given.enabled and given.directory is None)

    def _execution(self):
        spec = self.job_spec()
        if self.cluster is not None:
            return self.cluster.execution(spec)
        if self.workers:
            return JobExecution(spec, launcher=WorkerLauncher(spec))
        return JobExecution(spec)

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


