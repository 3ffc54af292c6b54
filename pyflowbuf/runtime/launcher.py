"""Where a job's subtasks run: the placement strategy of the one execution
(``runtime/execution.py`` ``JobExecution``), and the two declared interfaces
between them.

``Launcher`` (an ABC): what the execution asks of a placement. The execution
owns the job's coordination, restarts, restore and failure policy; a
launcher owns only where and how an attempt's subtasks run:

- ``ThreadLauncher`` (here): on threads of this process. It builds each
  attempt (``Deployment``), arms the subtasks with the state they restore,
  starts, joins and cancels them, and posts the coordinator's calls to their
  mailboxes. A worker process runs its share of a job on one too.
- ``WorkerLauncher`` (``pyflowbuf/cluster/driver.py``; ``ForkLauncher`` is its
  earlier name): in worker processes forked from a zygote.
- ``SparkLauncher`` (``pyflowbuf/spark/cluster.py``): as Spark barrier tasks.

Both of the latter derive from ``pyflowbuf.cluster.driver.RemoteLauncher``,
which holds the driver's side of the workers: their connections, the
ready/go handshake, their messages, fencing by attempt, the collected
records, the exit reports.

``AttemptEvents`` (a Protocol): what a launcher reports to the execution
while an attempt runs: the attempt is let go, a subtask acknowledged,
declined or finished a checkpoint's part, a subtask (or a whole worker)
failed. Subtasks on threads reach the coordinator directly (it is their
``CoordinatorGateway``); a worker's words reach it through these events.

Example::

    from pyflowbuf.runtime.job import JobExecution

    job = JobExecution(environment.job_spec())
    assert job.launcher.what == "subtask threads"
"""
from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from pyflowbuf import errors
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.exchange import debloat
from pyflowbuf.runtime.deployment import Deployment, check_output_pools
from pyflowbuf.runtime.metrics import MetricsSampler

# How long a cancelled job waits for its subtasks: tasks blocked in C wake at
# once; only a user function that never returns can hold a thread longer.
CANCEL_GRACE_S = 10.0


@runtime_checkable
class AttemptEvents(Protocol):
    """What a launcher reports to the execution (``JobExecution``) about the
    attempt it runs. ``attempt`` on a failure: the attempt it belongs to
    (a word of an attempt already given up is ignored)."""

    def attempt_ready(self) -> None:
        """Every subtask of the attempt is placed and let go now: the
        coordinator may reach them from here on."""

    def subtask_acknowledged(self, task_key: str, checkpoint_id: int, handle: Any, alignment_ms: float,
                             commits: list, summary: dict | None = None) -> None:
        """A subtask's snapshot of ``checkpoint_id`` is durable at ``handle``."""

    def subtask_declined(self, task_key: str, checkpoint_id: int, reason: str) -> None:
        """A subtask cannot take part in ``checkpoint_id``."""

    def subtask_finished(self, task_key: str, state: Any, commits: list, snapshotted: int = 0,
                         summary: dict | None = None) -> None:
        """A subtask reached the end of its input with final state ``state``."""

    def subtask_failed(self, task: str, operator: str, what: Any, tb: str, secondary: bool = False,
                       attempt: int | None = None) -> None:
        """A subtask (or a worker: ``task`` names it) failed with ``what``
        (the exception, or its text where it was raised elsewhere).
        ``secondary``: a consequence of another failure or of a cancel (a
        lost connection, a cancelled wait), which a real failure replaces."""


class Launcher(ABC):
    """A placement of a job's subtasks, driven by its execution. The
    execution calls, in order: ``check`` (in its constructor: refusals before
    anything starts), ``open`` (first in ``start``, before the execution
    starts a thread), ``sampler``; per attempt ``build``, ``sources``,
    ``restore`` (when a checkpoint is restored and ``reads_state_here``),
    ``arm`` (checkpoints on), ``launch``, ``await_attempt``, and after a
    failure ``stop_attempt`` (a restart follows); ``attempts_over`` and
    ``finished`` once no attempt follows, ``close`` when the caller joins.
    ``cancel`` and ``send`` come from any thread. Each reports to the
    execution through ``AttemptEvents``."""

    what: str = "subtasks"
    traceback_where: str = ""       # where a failure's traceback was taken, in its message
    reads_state_here = False        # whether this process reads the restored state of the subtasks
    workers: int | None = None      # how many worker processes run the subtasks (None: this one)
    addresses: Mapping = MappingProxyType({})   # worker -> (host, port) of its exchange server

    def check(self, execution) -> None:
        """Refusals before anything starts; the launcher serves ``execution`` from here on."""
        self.execution = execution

    def open(self) -> None:
        """First in ``start``, before the execution starts a thread of its own."""

    @abstractmethod
    def sampler(self, listeners):
        """The job's metrics sampler (``stop()`` takes the final sample)."""

    def build(self) -> None:
        """The attempt's subtasks, placed but not started."""

    @abstractmethod
    def sources(self):
        """(name, source) of every source subtask of the attempt, to check before it starts."""

    def restore(self, meta, plan, storage) -> None:
        """(``reads_state_here`` only) the state each subtask starts from, checked."""

    def arm(self, snapshot_writer) -> None:
        """Checkpoints on: the subtasks' side of them, before any runs."""

    @abstractmethod
    def launch(self, restore_id) -> None:
        """Start the attempt (from checkpoint ``restore_id``, or fresh);
        calls ``execution.attempt_ready()`` as its subtasks are let go. A
        launch that raises leaves nothing of the attempt running."""

    @abstractmethod
    def await_attempt(self) -> None:
        """Until every subtask of the attempt has ended, reporting its events."""

    @abstractmethod
    def stop_attempt(self) -> None:
        """After a failure: every subtask of the attempt has ended (or is
        stopped now) and what it held is let go; a new attempt follows."""

    def restarting(self):
        """A context around a restart (``stop_attempt`` to ``launch``)."""
        return contextlib.nullcontext()

    def restartable(self) -> bool:
        """Whether a restart may follow a failure (not a job whose records were handed out)."""
        return True

    @abstractmethod
    def cancel(self) -> None:
        """Every subtask of the attempt stops (its blocked waits wake at once)."""

    @abstractmethod
    def send(self, msg) -> None:
        """The coordinator's call ``msg`` to the attempt's subtasks."""

    def attempts_over(self) -> None:
        """No attempt follows (before the final commit): what the attempts held."""

    def finished(self, graceful: bool) -> None:
        """No attempt follows, the last thing before the job is done."""

    def close(self) -> None:
        """When the caller joins or stops the job (after ``finished``)."""

    def joined_ok(self) -> None:
        """The job finished without failure; called in the thread that joined it."""

    def records(self):
        """Generator: the records reaching the job's iterator sink, in the caller's thread."""
        raise errors.FlowBufError(f"{type(self).__name__} has no iterator sink to read")

    @property
    def subtasks(self) -> list:
        """The current attempt's subtasks in this process."""
        return []

    def summary(self) -> dict:
        return {}


class ThreadLauncher(Launcher):
    """One attempt's subtasks (``Subtask`` threads) in this process.

    The coordinator's calls arrive as the messages a worker is sent
    (``("trigger", id, options)``, ``("complete", id)``, ``("abort", id)``,
    ``("unaligned", id)``) and go into the subtasks' mailboxes: a trigger to
    the sources only; a completion and an abort as control mails, which run
    in a task a failed stop-with-savepoint froze (an abort thaws it)."""

    what = "subtask threads"
    reads_state_here = True

    def __init__(self):
        self.tasks: list = []       # the current attempt's subtasks (Deployment builds them)
        self.started: list = []     # those whose thread was started
        self.execution = None
        self._timers = False        # the sampler's and the debloat timer's threads, started once

    def check(self, execution) -> None:
        super().check(execution)
        check_output_pools(execution.spec, execution.edges, [(execution._here, execution._remote_buffers())])

    def sampler(self, listeners):
        return MetricsSampler(self.execution, self.execution.spec.metrics_config.interval, listeners)

    def place(self, tasks) -> None:
        """The subtasks of a new attempt, not started yet."""
        self.tasks = list(tasks)
        self.started = []

    @property
    def subtasks(self) -> list:
        return self.tasks

    # ---- an attempt ----
    def build(self) -> None:
        """This attempt's memory, exchanges and subtasks (``Deployment``)."""
        ex = self.execution
        d = Deployment(ex)
        ex.network_pool, ex._queues, ex.notifiers = d.network_pool, d.queues, d.notifiers
        ex.network_pools.append(d.network_pool)
        ex._exported |= d.exported
        ex.iterator_input = d.iterator_input
        self.place(d.tasks)

    def sources(self):
        return [(t.vertex.head.name, t.source) for t in self.tasks if t.source is not None]

    def restore(self, meta, plan, storage) -> None:
        """Each subtask's state of checkpoint ``meta``: by ``plan`` (by
        operator id, at any parallelism), or for a checkpoint written before
        operator ids, only into the very same graph."""
        ex = self.execution
        states = {}
        if plan is not None:
            # Decoding keyed state makes millions of objects that all live
            # on: the cyclic collector's passes over them would find nothing
            # and cost ~15% of a restore (more at another parallelism).
            was = gc.isenabled()
            gc.disable()
            try:
                for t in self.tasks:
                    states[ckpt.task_key(t.vertex, t.index)] = plan.task_restore(t)
            finally:
                if was:
                    gc.enable()
        else:
            ckpt.check_graph(meta, ckpt.graph_task_keys(ex.vertices), storage.url)
            mine = {ckpt.task_key(t.vertex, t.index) for t in self.tasks}
            states = ckpt.read_states(storage, meta, mine)
        ckpt.check_sources(meta, states, {ckpt.task_key(t.vertex, t.index): (t.vertex.head.name, t.source)
                                          for t in self.tasks if t.source is not None})
        for t in self.tasks:
            state = states.get(t.checkpoints.key)
            if plan is None and state is not None and state.get("vertex") != t.vertex.name:
                raise errors.ConfigurationError(
                    f"checkpoint {meta.checkpoint_id}: task {t.checkpoints.key} was {state.get('vertex')!r}, "
                    f"here it is {t.vertex.name!r}; the job graph changed")
            t.restore = state

    def arm(self, snapshot_writer) -> None:
        ex = self.execution
        for t in self.tasks:
            t.checkpoints.attach(ex.coordinator, snapshot_writer)
        if ex.remote is not None:
            # before any task runs: the collect sinks' restored counts
            ex.remote.tasks_armed(self.tasks)

    def launch(self, restore_id=None) -> None:
        """Start every subtask's thread (and, first time, the sampler and the
        debloat timer); a thread that cannot start stops those that did."""
        ex = self.execution
        ex.attempt_ready()
        try:
            for t in self.tasks:
                t.start()
                self.started.append(t)
            if not self._timers:
                self._timers = True
                ex.sampler.start()
                ex._debloat_timer = debloat.start_timer(ex)
        except BaseException:
            self.cancel()
            self.join(CANCEL_GRACE_S)
            debloat.stop_timer(ex)
            self._release_buffers()
            raise

    def join(self, timeout=None) -> None:
        """Until every started subtask has ended (``timeout``: per subtask)."""
        for t in self.started:
            t.join(timeout)

    def await_attempt(self) -> None:
        self.join()

    def restarting(self):
        return debloat.paused(self.execution)   # no page release while segments are counted

    def stop_attempt(self) -> None:
        """Every subtask has stopped: give back every segment (checked)."""
        ex = self.execution
        self.join()     # (a rebuild that failed half-way started none)
        self._release_buffers()
        old = ex.network_pool
        if old.available_segments != old.total_segments:
            gc.collect()    # a reference cycle (a traceback, a view) may still hold a Buffer
        if old.available_segments != old.total_segments:
            raise errors.FlowBufError(
                f"{old.total_segments - old.available_segments} segment(s) were not returned by the failed attempt")
        self.place([])
        if ex.sampler is not None:
            ex.sampler.forget_counters()

    def attempts_over(self) -> None:
        debloat.stop_timer(self.execution)
        self._release_buffers()

    def cancel(self) -> None:
        """Every subtask stops: its blocked waits wake at once and raise inside it."""
        for t in self.tasks:
            t.cancel()
        ex = self.execution
        if ex is not None and ex.iterator_input is not None:
            ex.iterator_input.gate.cancel()

    def send(self, msg) -> None:
        what, checkpoint_id, *rest = msg
        if what == "trigger":
            options = rest[0] if rest else None
            for t in self.tasks:
                if t.source is not None:
                    t.post(lambda t=t: t.trigger_checkpoint(checkpoint_id, options))
        elif what == "complete":
            for t in self.tasks:
                t.post_control(lambda t=t: t.notify_checkpoint_complete(checkpoint_id))
        elif what == "abort":
            for t in self.tasks:
                t.post_control(lambda t=t: t.abort_checkpoint(checkpoint_id))
        elif what == "unaligned":
            for t in self.tasks:
                t.post(lambda t=t: t.switch_to_unaligned(checkpoint_id))
        else:
            raise ValueError(f"ThreadLauncher.send: unknown call {what!r}")

    def records(self):
        """The records reaching the iterator sink, read in the caller's
        thread until its input ends, a subtask fails or the job is cancelled;
        the caller's thread releases what it holds of the input after."""
        ex = self.execution
        inp = ex.iterator_input
        while True:
            try:
                batch = inp.read(ex.spec.max_batch, 0.1)
            except errors.CancelledError:
                if ex.failure is None and not ex.cancelled:
                    raise
                break       # a task failed (raised by the execution) or the job was cancelled
            if batch:
                yield from batch
                continue
            if inp.take_event() is not None:
                continue
            if ex.failure is not None or inp.finished:
                break

    def close(self) -> None:
        """The iterator sink's input is read by the caller's thread, which
        closes the job: it releases what that input holds once every subtask ended."""
        ex = self.execution
        if ex.iterator_input is not None and ex.done and not ex._iterator_released:
            ex._iterator_released = True
            self._release_buffers(iterator_side=True)

    def summary(self) -> dict:
        sampler = self.execution.sampler
        return {} if sampler is None else sampler.summary()

    def _release_buffers(self, iterator_side=False):
        """After the tasks ended, give every segment still in flight back to its
        pool: partly filled output buffers, queued buffers and the buffers
        readers hold (a failed or cancelled job stops with data in flight).
        The iterator input is read by the caller's thread, which releases it
        (``iterator_side=True``) when it stops reading."""
        ex = self.execution
        it = ex.iterator_input
        it_queues = set() if it is None else {id(q) for q in it.gate.channels}
        if iterator_side:
            queues, readers = [q for q in ex._queues if id(q) in it_queues], [it]
        else:
            for t in self.tasks:
                for out in t.outputs:
                    try:
                        out.flush()       # ships a partial buffer into its queue
                    except Exception:
                        pass
            # exported queues are drained by the network sender, not here
            queues = [q for q in ex._queues if id(q) not in it_queues and id(q) not in ex._exported]
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
