"""Running a job: memory, exchanges and subtask threads; failure and cancel;
metric sampling."""
from __future__ import annotations

import threading
import time
import traceback

from pyflowbuf import errors
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool, Notifier
from pyflowbuf.runtime.exchange import EdgeKind, InputSide, OutputSide
from pyflowbuf.runtime.metrics import MetricsSampler
from pyflowbuf.runtime.sources import RateLimiter
from pyflowbuf.runtime.task import Subtask

# How long a cancelled job waits for its threads: tasks blocked in C wake at
# once; only a user function that never returns can hold a thread longer.
CANCEL_GRACE_S = 10.0


class Execution:
    """What a job run in this process (JobExecution) and one spread over worker
    processes (ClusterExecution) share: waiting, and stopping on the way out."""

    def join(self, timeout=None):
        """Wait for the job; raise JobFailedError on failure, TimeoutError if it
        did not finish (the job is then cancelled)."""
        try:
            if not self._done.wait(timeout):
                self.cancel()
                self._done.wait(CANCEL_GRACE_S)
                raise TimeoutError(f"job {self.env.name!r} did not finish within {timeout} s (cancelled)")
        except KeyboardInterrupt:
            self.cancel()
            self._done.wait(CANCEL_GRACE_S)
            raise
        finally:
            self._close()
        self.raise_if_failed()
        return self

    def run(self, timeout=None):
        self.start()
        return self.join(timeout)

    @property
    def done(self):
        return self._done.is_set()


class JobExecution(Execution):
    """One process's share of a job. Without ``placement`` every subtask runs
    here (threads); with it, only the subtasks placed on worker ``me`` do, and
    exchanges with subtasks elsewhere go through ``remote`` (a
    ``pyflowbuf.runtime.cluster.RemoteContext``)."""

    def __init__(self, env, placement=None, me=0, remote=None):
        self.env = env
        self.vertices, self.edges = env.plan()
        self.placement = placement or (lambda vertex, subtask: 0)
        self.me = me
        self.remote = remote
        self.cancelled = False
        self.failure = None            # (task name, operator name, exception, formatted traceback)
        self.event_handler = None
        self.tasks: list[Subtask] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.started = self.ended = None
        self.iterator_input = None
        self.sampler = None
        self._exported = set()         # ids of queues a remote consumer drains

    # ---- building ----
    def _output_pool_size(self, nsub: int):
        if self.env.output_buffers is not None:
            return self.env.output_buffers
        return nsub + 1, 2 * nsub + 8

    def _here(self, vertex, subtask):
        return self.placement(vertex, subtask) == self.me

    def _segments_needed(self):
        """Every local output pool at its cap plus the exclusive and floating
        buffers of remote input channels: memory is bounded by construction
        and no pool ever waits on another pool's share."""
        total = 0
        for e in self.edges:
            up, down = e.source, e.target
            nsub = 1 if e.pointwise else down.parallelism
            total += sum(self._here(up, i) for i in range(up.parallelism)) * self._output_pool_size(nsub)[1]
            if self.remote is not None:
                for j in range(down.parallelism):
                    if self._here(down, j):
                        n = sum(not self._here(up, i) for i in range(up.parallelism)
                                if not e.pointwise or i == j)
                        if n:
                            total += n * self.remote.exclusive_buffers + self.remote.floating_buffers
        return total

    def _build(self):
        env = self.env
        num_segments = env.num_segments or max(self._segments_needed() + 16, 64)
        self.network_pool = net = NetworkBufferPool(num_segments, env.segment_size)
        self._queues = []  # every BufferQueue, to give back what is left in them
        inputs = {}      # (vertex id, subtask) -> InputSide
        outputs = {}     # (vertex id, subtask) -> [OutputSide]
        here = self._here
        for k, e in enumerate(self.edges):
            up, down = e.source, e.target
            kind = EdgeKind(e.kind)
            # A kind fixed by the graph is checked on both ends of a remote
            # channel; an inferred one travels in-band (EVT_KIND) as bytes.
            wire_kind = kind.value.core_kind if kind.fixed and not kind.is_rows else "bytes"
            needed = [(i, j) for i in range(up.parallelism) for j in range(down.parallelism)
                      if not e.pointwise or i == j]
            queues = {}
            for i, j in needed:
                if here(up, i) or here(down, j):
                    q = queues[i, j] = BufferQueue(net)
                    self._queues.append(q)
                    if not here(down, j):
                        self.remote.export(f"{k}/{i}", j, q, wire_kind, self._remote_failed)
                        self._exported.add(id(q))
            pools = {}
            for i in range(up.parallelism):
                if not here(up, i):
                    continue
                mine = [queues[i, j] for (a, j) in needed if a == i]
                lo, hi = self._output_pool_size(len(mine))
                pools[i] = pool = net.create_pool(lo, hi)
                outputs.setdefault((up.id, i), []).append(
                    OutputSide(pool, mine, e.partitioner, e.key_fn, kind, env.max_record_size))
            for j in range(down.parallelism):
                if not here(down, j):
                    continue
                if (down.id, j) in inputs:
                    raise ValueError(f"{down.name!r} has two inputs; union/join are not supported yet")
                producers = [i for (i, b) in needed if b == j]
                chans = [queues[i, j] for i in producers]
                remote_from = [i for i in producers if not here(up, i)]
                gate = InputGate(chans, Notifier())
                remote_channels = []
                if remote_from:
                    remote_channels = self.remote.connect(
                        net, gate, [(self.placement(up, i), f"{k}/{i}", j, queues[i, j]) for i in remote_from],
                        wire_kind, self._remote_failed)
                inputs[(down.id, j)] = InputSide(
                    gate, kind, env.max_record_size, [pools[i] for i in producers if i in pools],
                    remote_channels=remote_channels, allow_pickle=env.allow_pickle,
                    owned=down.is_iterator and not down.head.zero_copy)

        for v in self.vertices:
            for i in range(v.parallelism):
                if not here(v, i):
                    continue
                if v.is_iterator:
                    self.iterator_input = inputs[(v.id, 0)]
                    continue
                head = v.head
                ops = [n.make_operator() for n in v.nodes if n.make_operator is not None]
                for n, op in zip([n for n in v.nodes if n.make_operator is not None], ops):
                    op.node_id = n.id
                source = head.source() if head.source is not None else None
                limiter = None
                if head.rate_limit is not None:
                    rl = head.rate_limit
                    limiter = rl if isinstance(rl, RateLimiter) else RateLimiter(records_per_s=rl)
                self.tasks.append(Subtask(self, v, i, ops, outputs.get((v.id, i), []),
                                          source=source, input_side=inputs.get((v.id, i)),
                                          rate_limiter=limiter))

    def _remote_failed(self, exc):
        """A remote channel or export failed (peer died, protocol error, the
        consumer went away before the end): the job fails."""
        if isinstance(exc, errors.CancelledError) and self.cancelled:
            return
        with self._lock:
            first = self.failure is None and not self.cancelled
            if first:
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.failure = (f"worker {self.me}", "remote exchange", exc, tb)
        if first:
            self.cancel()

    # ---- running ----
    def start(self):
        self._build()
        self.started = time.monotonic()
        self.sampler = MetricsSampler(self, self.env.metrics_interval)
        for t in self.tasks:
            t.start()
        self.sampler.start()
        self._watcher = threading.Thread(target=self._watch, name="pyflowbuf: job watcher", daemon=True)
        self._watcher.start()
        return self

    def _watch(self):
        for t in self.tasks:
            t.join()
        self.ended = time.monotonic()
        try:
            self._release_buffers()
        finally:
            self._done.set()

    def _release_buffers(self, iterator_side=False):
        """After the tasks ended, give every segment still in flight back to its
        pool: partly filled output buffers, queued buffers and the buffers
        readers hold (a failed or cancelled job stops with data in flight).
        The iterator input is read by the caller's thread, which releases it
        (``iterator_side=True``) when it stops reading."""
        it = self.iterator_input
        it_queues = set() if it is None else {id(q) for q in it.gate.channels}
        if iterator_side:
            queues, readers = [q for q in self._queues if id(q) in it_queues], [it]
        else:
            for t in self.tasks:
                for out in t.outputs:
                    try:
                        out.flush()       # ships a partial buffer into its queue
                    except Exception:
                        pass
            # exported queues are drained by the network sender, not here
            queues = [q for q in self._queues if id(q) not in it_queues and id(q) not in self._exported]
            readers = [t.input for t in self.tasks if t.input is not None]
        for inp in readers:
            inp.release()
        for q in queues:
            while True:
                item = q.pop_buffer()
                if item is None:
                    break
                if not isinstance(item, tuple):   # a Buffer (events are tuples)
                    item.release()

    def task_failed(self, task, exc):
        with self._lock:
            first = self.failure is None and not (self.cancelled and isinstance(exc, errors.CancelledError))
            if first:
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.failure = (task.task_name, task.current_operator, exc, tb)
        # The frames of the traceback hold the batch that was in flight, and
        # its zero-copy records pin their segments: keep the text, drop locals.
        traceback.clear_frames(exc.__traceback__)
        if first:
            self.cancel()

    def cancel(self):
        """Stop every task: blocked waits wake at once and raise inside the task."""
        self.cancelled = True
        for t in self.tasks:
            t.cancel()
        if self.iterator_input is not None:
            self.iterator_input.gate.cancel()

    def _close(self):
        if self.sampler is not None:
            self.sampler.stop()
        # once every task ended, leave no pyflowbuf thread behind the caller
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and self._done.is_set() and watcher is not threading.current_thread():
            watcher.join()

    def raise_if_failed(self):
        if self.failure is not None:
            task, op, exc, tb = self.failure
            raise errors.JobFailedError(
                f"job {self.env.name!r} failed: operator {op!r} in task {task!r} raised "
                f"{type(exc).__name__}: {exc}\n\nOriginal traceback:\n{tb}") from exc

    def iterate(self, sink_node):
        """Generator: the records reaching the iterator sink, in this thread."""
        self.start()
        inp = self.iterator_input
        try:
            while True:
                try:
                    batch = inp.read(self.env.max_batch, 0.1)
                except errors.CancelledError:
                    if self.failure is None and not self.cancelled:
                        raise
                    break       # a task failed (raised below) or the job was cancelled
                if batch:
                    yield from batch
                    continue
                if inp.take_event() is not None:
                    continue
                if self.failure is not None:
                    break
                if inp.finished:
                    break
            self._done.wait(CANCEL_GRACE_S if self.failure else None)
            self.raise_if_failed()
        finally:
            if not self._done.is_set():
                self.cancel()
                self._done.wait(CANCEL_GRACE_S)
            if self._done.is_set():
                self._release_buffers(iterator_side=True)
            self._close()

    # ---- inspection ----
    def metrics(self) -> dict:
        return {} if self.sampler is None else self.sampler.latest()

    def summary(self) -> dict:
        return {} if self.sampler is None else self.sampler.summary()
