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

import os
from typing import Any, Callable, Iterable

import numpy as np

from pyflowbuf.runtime import operators as ops
from pyflowbuf.runtime import sources as srcs
from pyflowbuf.runtime.graph import Node, plan

_UNSET = object()


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
        (subpartitions + 1, 2 * subpartitions + 8).
    max_batch : records a task moves per crossing into the core.
    metrics_interval : seconds between metric samples.
    workers : run subtasks in this many worker processes (subtask i of each
        operator on worker i % workers), connected by the TCP exchange with
        credit-based flow control; None runs everything in this process.
    allow_pickle : let streams of pickled Python objects cross processes
        (unpickling runs code the sender chose; only for trusted workers).
    bind_host : interface the workers' exchange listens on (loopback by default).
    credit_based : False uses the pre-credit mode (TCP window only), to compare.
    """

    def __init__(self, parallelism: int = 1, *, segment_size: int = 32 * 1024,
                 num_segments: int | None = None, buffer_timeout: float = 0.1,
                 chaining: bool = True, output_buffers: tuple | None = None,
                 max_batch: int = 1024, max_record_size: int = 64 * 1024 * 1024,
                 metrics_interval: float = 1.0, name: str = "job",
                 metrics_log: str | os.PathLike | None = None, prometheus_port: int | None = None,
                 live_view: bool = False, workers: int | None = None, allow_pickle: bool = False,
                 bind_host: str = "127.0.0.1", credit_based: bool = True):
        _positive_int("parallelism", parallelism)
        _positive_int("max_batch", max_batch)
        if num_segments is not None:
            _positive_int("num_segments", num_segments)
        if not buffer_timeout >= 0:
            raise ValueError(f"buffer_timeout must be >= 0 seconds, got {buffer_timeout!r}")
        if output_buffers is not None:
            lo, hi = output_buffers
            _positive_int("output_buffers max", hi)
            if not 0 <= lo <= hi:
                raise ValueError(f"output_buffers must be (min, max) with 0 <= min <= max, got {output_buffers!r}")
        _positive_int("segment_size", segment_size)
        if segment_size & (segment_size - 1) or not 256 <= segment_size <= 1 << 20:
            raise ValueError(f"segment_size must be a power of two between 256 and 1048576, got {segment_size}")
        _positive_int("max_record_size", max_record_size)
        if max_record_size >= 1 << 32:
            raise ValueError(f"max_record_size must be < 2**32, got {max_record_size}")
        if workers is not None:
            _positive_int("workers", workers)
        if not metrics_interval > 0:
            raise ValueError(f"metrics_interval must be > 0, got {metrics_interval!r}")
        self.parallelism = parallelism
        self.segment_size = segment_size
        self.num_segments = num_segments
        self.buffer_timeout = float(buffer_timeout)
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
        self.nodes: list[Node] = []
        self.last_execution = None

    # ---- sources ----
    def _add(self, **kw) -> Node:
        node = Node(id=len(self.nodes), **kw)
        if node.input is not None:
            node.input.consumers.append(node)
        self.nodes.append(node)
        return node

    def _source(self, name, source, kind, rate_limit, parallelism=1) -> "Stream":
        node = self._add(name=name, parallelism=parallelism, source=source, kind=kind,
                         rate_limit=rate_limit)
        return Stream(self, node)

    def from_iterable(self, iterable: Iterable, *, kind: Any = None, name: str = "iterable",
                      rate_limit=None) -> "Stream":
        """Records from an iterable (or a zero-argument function returning one),
        pulled lazily: an item is taken only when the task can write it."""
        if kind is None and isinstance(iterable, (list, tuple, range)) and len(iterable):
            from pyflowbuf.serializers import infer_kind
            kind = infer_kind(iterable[0])
        return self._source(name, lambda: srcs.IterableSource(iterable), kind, rate_limit)

    from_collection = from_iterable

    def from_generator(self, fn: Callable[[], Iterable], *, kind: Any = None, name: str = "generator",
                       rate_limit=None) -> "Stream":
        if not callable(fn):
            raise TypeError("from_generator takes a function that returns an iterable")
        return self._source(name, lambda: srcs.IterableSource(fn), kind, rate_limit)

    def from_sequence(self, start: int, stop: int | None = None, step: int = 1, *,
                      parallelism: int | None = None, name: str = "sequence", rate_limit=None) -> "Stream":
        """Integers in ``range(start, stop, step)`` (``stop=None``: unbounded)."""
        p = parallelism or self.parallelism
        return self._source(name, lambda: srcs.SequenceSource(start, stop, step), "int64", rate_limit, p)

    def read_text(self, path, *, encoding: str = "utf-8", name: str = "read_text", rate_limit=None) -> "Stream":
        """Lines of a text file; the source tracks byte offsets."""
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return self._source(name, lambda: srcs.TextFileSource(path, encoding), "str", rate_limit)

    def from_arrays(self, arrays: Iterable, *, dtype=None, name: str = "arrays", rate_limit=None) -> "Stream":
        """A rows stream: NumPy arrays of fixed-width rows, moved with one memcpy
        per buffer and read back as views. Operators see array chunks."""
        if dtype is None:
            if isinstance(arrays, (list, tuple)) and arrays:
                dtype = np.asarray(arrays[0]).dtype
            else:
                raise ValueError("from_arrays needs dtype= when the arrays are not a non-empty list")
        return self._source(name, lambda: srcs.ArraySource(arrays), np.dtype(dtype), rate_limit)

    # ---- running ----
    def plan(self):
        return plan(self.nodes, self.chaining)

    def execute(self, timeout: float | None = None):
        """Run the job to completion; raises JobFailedError if any task fails."""
        if any(n.is_iterator for n in self.nodes):
            raise ValueError("this job has a to_iterator() sink: run it with execute_iter()")
        job = self._execution()
        self.last_execution = job
        return job.run(timeout)

    def execute_async(self):
        """Start the job and return its JobExecution (``join``, ``cancel``, ``metrics``)."""
        job = self._execution()
        self.last_execution = job
        job.start()
        return job

    def execute_iter(self, sink: "IteratorSink"):
        """Run the job and yield the records that reach ``sink`` in this thread.
        Closing the generator cancels the job."""
        if not isinstance(sink, IteratorSink):
            raise TypeError("execute_iter takes the handle returned by Stream.to_iterator()")
        job = self._execution()
        self.last_execution = job
        return job.iterate(sink.node)

    def _execution(self):
        if self.workers:
            from pyflowbuf.runtime.cluster import ClusterExecution
            return ClusterExecution(self)
        from pyflowbuf.runtime.job import JobExecution
        return JobExecution(self)

    def metrics(self) -> dict:
        """The latest per-task metrics of the running or last job."""
        return {} if self.last_execution is None else self.last_execution.metrics()


class Stream:
    """A stream of records produced by one node of the graph."""

    def __init__(self, env: Environment, node: Node, key_fn: Callable | None = None):
        self.env = env
        self.node = node
        self._partitioner = None  # None: forward when parallelism matches, else rebalance
        self._key_fn = key_fn

    def _then(self, name, make_operator, parallelism, kind, *, sink=False, key_fn=None) -> Node:
        if parallelism is not None:
            _positive_int("parallelism", parallelism)
        p = parallelism or self.env.parallelism
        part = self._partitioner or ("forward" if p == self.node.parallelism else "rebalance")
        return self.env._add(name=name, parallelism=p, make_operator=make_operator, input=self.node,
                             partitioner=part, key_fn=key_fn or self._key_fn, kind=kind, is_sink=sink)

    # ---- partitioning ----
    def _with(self, partitioner, key_fn=None) -> "Stream":
        s = Stream(self.env, self.node, key_fn)
        s._partitioner = partitioner
        return s

    def forward(self) -> "Stream":
        return self._with("forward")

    def rebalance(self) -> "Stream":
        return self._with("rebalance")

    def broadcast(self) -> "Stream":
        return self._with("broadcast")

    def key_by(self, key_fn: Callable) -> "KeyedStream":
        if not callable(key_fn):
            raise TypeError("key_by takes a function record -> key")
        ks = KeyedStream(self.env, self.node, key_fn)
        ks._partitioner = "hash"
        return ks

    # ---- operators ----
    def map(self, fn: Callable, *, parallelism: int | None = None, name: str = "map", kind: Any = None) -> "Stream":
        _callable(fn, "map")
        return Stream(self.env, self._then(name, lambda: ops.Map(name, fn), parallelism, kind))

    def filter(self, fn: Callable, *, parallelism: int | None = None, name: str = "filter") -> "Stream":
        _callable(fn, "filter")
        return Stream(self.env, self._then(name, lambda: ops.Filter(name, fn), parallelism, self.node.kind))

    def flat_map(self, fn: Callable, *, parallelism: int | None = None, name: str = "flat_map",
                 kind: Any = None) -> "Stream":
        _callable(fn, "flat_map")
        return Stream(self.env, self._then(name, lambda: ops.FlatMap(name, fn), parallelism, kind))

    def map_batches(self, fn: Callable, *, parallelism: int | None = None, name: str = "map_batches",
                    kind: Any = None) -> "Stream":
        """Apply ``fn`` to whole batches: to NumPy array chunks on a rows stream
        (``from_arrays``), to each RecordBatch/DataFrame on an arrow/pandas stream."""
        _callable(fn, "map_batches")
        per_record = not isinstance(self.node.kind, np.dtype)
        if kind is None and not per_record:
            kind = self.node.kind
        return Stream(self.env, self._then(name, lambda: ops.MapBatch(name, fn, per_record), parallelism, kind))

    # ---- sinks ----
    def collect(self, *, parallelism: int | None = None, name: str = "collect") -> "CollectSink":
        handle = CollectSink()
        node = self._then(name, lambda: ops.CollectSink(name, handle._parts), parallelism, None, sink=True)
        node.collect_parts = handle._parts
        return handle

    def sink(self, fn: Callable, *, batched: bool = False, parallelism: int | None = None,
             name: str = "sink") -> None:
        """Call ``fn(record)`` (or ``fn(batch)`` with batched=True) in the sink task."""
        _callable(fn, "sink")
        self._then(name, lambda: ops.FunctionSink(name, fn, batched), parallelism, None, sink=True)

    def write_text(self, path, *, parallelism: int | None = None, name: str = "write_text") -> None:
        """One line per record (``str(record)``); with parallelism p > 1 the files are path.0 .. path.p-1."""
        self._then(name, lambda: ops.TextFileSink(name, path), parallelism, None, sink=True)

    def to_iterator(self, *, name: str = "iterator", zero_copy: bool = False) -> "IteratorSink":
        """A sink read by ``Environment.execute_iter`` in the caller's thread.

        Records own their memory by default, so the caller may keep them. With
        ``zero_copy=True`` large records come as views over segments: each one
        held keeps a segment from the pool, and holding a pool's worth stalls
        the job, so only use it when records are dropped promptly."""
        part = self._partitioner or ("forward" if self.node.parallelism == 1 else "rebalance")
        node = self.env._add(name=name, parallelism=1, make_operator=None, input=self.node,
                             partitioner=part, key_fn=self._key_fn, kind=None, is_sink=True)
        node.is_iterator = True
        node.zero_copy = zero_copy
        return IteratorSink(node)


class KeyedStream(Stream):
    """A stream partitioned by key; keyed operators keep per-key state in their task."""

    def reduce(self, fn: Callable, *, parallelism: int | None = None, name: str = "reduce",
               kind: Any = None) -> Stream:
        _callable(fn, "reduce")
        key_fn = self._key_fn
        node = self._then(name, lambda: ops.KeyedReduce(name, key_fn, fn), parallelism, kind)
        return Stream(self.env, node)

    def process(self, fn: Callable, *, parallelism: int | None = None, name: str = "process",
                kind: Any = None) -> Stream:
        """``fn(key, record, state_dict) -> iterable of outputs (or None)``."""
        _callable(fn, "process")
        key_fn = self._key_fn
        node = self._then(name, lambda: ops.KeyedProcess(name, key_fn, fn), parallelism, kind)
        return Stream(self.env, node)


class CollectSink:
    """Handle of a ``collect()`` sink; ``result`` is filled when the job ends."""

    def __init__(self):
        self._parts: dict = {}

    @property
    def result(self) -> list:
        out = []
        for k in sorted(self._parts):
            out.extend(self._parts[k])
        return out


class IteratorSink:
    def __init__(self, node: Node):
        self.node = node


def _positive_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _callable(fn, what):
    if not callable(fn):
        raise TypeError(f"{what} takes a function, got {type(fn).__name__}")
