"""Running a job: its attempts (each deployed by ``deployment.Deployment``),
subtask threads, failure and cancel, checkpoints and restarts, metric sampling."""
from __future__ import annotations

import gc
import threading
import time
import traceback

from pyflowbuf import errors
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.exchange import debloat
from pyflowbuf.checkpointing import restore as restore_mod
from pyflowbuf.runtime.execution import CANCEL_GRACE_S, Execution
from pyflowbuf.runtime.deployment import Deployment, check_output_pools, output_pool_size, segments_needed
from pyflowbuf.runtime.launcher import ThreadLauncher
from pyflowbuf.runtime.metrics import MetricsSampler, close_listeners, make_listeners
from pyflowbuf.runtime.task import Subtask


class JobExecution(Execution):
    """One process's share of the job ``spec`` (a ``JobSpec``). Without ``placement`` every subtask runs
    here (threads); with it, only the subtasks placed on worker ``me`` do, and
    exchanges with subtasks elsewhere go through ``remote`` (a
    ``pyflowbuf.cluster.driver.RemoteContext``)."""

    def __init__(self, spec, placement=None, me=0, remote=None):
        self.spec = spec                # the JobSpec: the job's graph and settings (jobgraph/spec.py)
        self.vertices, self.edges = spec.plan()
        self.placement = placement or (lambda vertex, subtask: 0)
        self.me = me
        self.remote = remote
        self.cancelled = False
        self.failure = None            # (task name, operator name, exception, formatted traceback)
        self.event_handler = None
        self.launcher = ThreadLauncher()    # where the subtasks run: threads of this process
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.started = self.ended = None
        self.iterator_input = None
        self.sampler = None
        self._exported = set()         # ids of queues a remote consumer drains
        check_output_pools(spec, self.edges, [(self._here, self._remote_buffers())])
        # checkpoints: on when the Environment asks; a worker process is given
        # its config and a proxy of the driver's coordinator (cluster/driver.py)
        self.checkpoint_config = ckpt.CheckpointSettings.from_env(spec) if remote is None else None
        self.restart_failures: list = []   # (task, operator, exception text) of each failure recovered
        self.network_pools: list = []  # the pool of every attempt, to check that all came back
        # (the coordinator, the restore point, restarts: runtime/execution.py)

    @property
    def tasks(self) -> list[Subtask]:
        """The current attempt's subtasks."""
        return self.launcher.tasks

    # ---- building ----
    def _output_pool_size(self, nsub: int):
        return output_pool_size(self.spec, nsub)

    def _here(self, vertex, subtask):
        return self.placement(vertex, subtask) == self.me

    def _remote_buffers(self):
        r = self.remote
        return None if r is None else (r.exclusive_buffers, r.floating_buffers)

    def _segments_needed(self):
        return segments_needed(self.spec, self.edges, self._here, self._remote_buffers())

    def _build(self):
        """This attempt's memory, exchanges and subtasks (``Deployment``)."""
        d = Deployment(self)
        self.network_pool, self._queues, self.notifiers = d.network_pool, d.queues, d.notifiers
        self.network_pools.append(d.network_pool)
        self._exported |= d.exported
        self.launcher.place(d.tasks)
        self.iterator_input = d.iterator_input

    @property
    def _gate_output(self) -> bool:
        """Whether tasks wait for output buffers between batches (unaligned
        checkpoints: see Mailbox.wait_for_output in runtime/task/mailbox.py)."""
        c = self.spec.checkpoint_config
        return c.enabled and c.alignment == "unaligned"

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
        # The metrics listeners first: a busy prometheus_port is refused
        # before any memory is taken or any task runs. In a worker process
        # the driver serves them (one port, one log, one view for the job).
        listeners = make_listeners(self.spec) if self.remote is None else []
        try:
            self._build()
            if self.checkpoint_config is not None:
                self._start_checkpointing(listeners)
            if self.remote is None:
                # a worker process is forked after the driver did this
                self._prepare_outputs(restoring=self.restored_from is not None)
            self.sampler = MetricsSampler(self, self.spec.metrics_config.interval, listeners)
        except BaseException:
            close_listeners(listeners)
            self._stop_checkpointing()
            raise
        self.started = time.monotonic()
        try:
            self.ran = True
            self.launcher.launch()
            self.sampler.start()
            self._debloat_timer = debloat.start_timer(self)
            if self.coordinator is not None and self.remote is None:
                self.coordinator.start()
            self._watcher = threading.Thread(target=self._watch, name="pyflowbuf: job watcher", daemon=True)
            self._watcher.start()
        except BaseException:
            # a thread that could not start: stop those that did, leave nothing behind
            self.cancel()
            self.launcher.join(CANCEL_GRACE_S)
            debloat.stop_timer(self)
            self._release_buffers()
            self.sampler.stop()
            self._done.set()
            raise
        return self

    def _await_attempt(self):
        self.launcher.join()

    def _restart_failed(self, exc):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.failure = ("job", "recovery", exc, tb)
        self.cancel(_user=False)
        self.launcher.join()    # (a rebuild that failed half-way started none)

    def _attempts_over(self):
        self.ended = time.monotonic()
        debloat.stop_timer(self)
        self._release_buffers()

    def _no_attempt_follows(self):
        if self._jobdir is not None:
            self._jobdir.release()      # (done already, unless the end itself failed)
        # the final sample is the last thing the job records, taken
        # before anyone waiting on the job is woken
        self.sampler.stop()

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

    # ---- checkpoints and recovery ----
    def _start_checkpointing(self, listeners):
        config = self.checkpoint_config
        for t in self.tasks:
            if t.source is not None:
                ckpt.check_rewindable(config, t.vertex.head.name, t.source)
        if self.coordinator is None:
            meta = self._open_checkpointing(listeners)
        else:
            # a worker process, given a proxy of the driver's coordinator and
            # the id of a checkpoint the driver has already checked
            meta = self._started_from = ckpt.restore_plan(self.coordinator.storage, self.restore_from, verify=False)
            if meta is None:
                restore_mod.started_fresh(self)
        self._snapshot_writer = ckpt.new_writer()
        self._arm_checkpointing(meta)

    def _arm_checkpointing(self, meta):
        """Give every task its side of checkpoints and, after a failure or for
        ``restore_from``, the state of checkpoint ``meta`` to start from."""
        coordinator = self.coordinator
        states = {}
        plan = None
        if meta is not None:
            storage = ckpt.storage_of(coordinator.storage, meta)
            if restore_mod.is_current(meta):
                # by operator id, at any parallelism (pyflowbuf.checkpointing.restore)
                # (the driver checked it for a worker)
                plan = self._restore_plan(storage, meta, restore_mod.checks_key_kinds(self, meta, self.check_key_kinds),
                                          check=self.remote is None)
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
                # written before operator ids: only into the very same graph
                ckpt.check_graph(meta, ckpt.graph_task_keys(self.vertices), storage.url)
                mine = {ckpt.task_key(t.vertex, t.index) for t in self.tasks}
                states = ckpt.read_states(storage, meta, mine)
            ckpt.check_sources(meta, states, {ckpt.task_key(t.vertex, t.index): (t.vertex.head.name, t.source)
                                              for t in self.tasks if t.source is not None})
            if self.remote is None:
                self._commit_restored(meta)     # (with workers the driver does it)
            self.restored_from = meta.checkpoint_id
        for t in self.tasks:
            t.checkpoints.attach(coordinator, self._snapshot_writer)
            state = states.get(t.checkpoints.key)
            if plan is None and state is not None and state.get("vertex") != t.vertex.name:
                raise errors.ConfigurationError(
                    f"checkpoint {meta.checkpoint_id}: task {t.checkpoints.key} was {state.get('vertex')!r}, "
                    f"here it is {t.vertex.name!r}; the job graph changed")
            t.restore = state
        if self.remote is None:
            coordinator.attach(self, [t.checkpoints.key for t in self.tasks])
        else:
            # before any task runs: the collect sinks' restored counts
            self.remote.tasks_armed(self.tasks)

    def _coordinates(self) -> bool:
        # A worker's coordinator is a proxy: the driver's runs the checkpoints,
        # and restarts the whole job (every worker)
        return self.remote is None

    def _restartable(self, failure) -> bool:
        # a failure a restart would meet again (a restored key of another kind)
        return getattr(failure[2], "restartable", True)

    def _restart(self) -> bool:
        with debloat.paused(self):      # no page release while segments are counted
            self._rebuild()
        return True

    def _rebuild(self):
        """After a task failed: every task has stopped; give back every
        segment, then build the job again and restore the latest complete
        checkpoint (sources rewind to its positions)."""
        self._begin_restart([t.checkpoints.key for t in self.tasks])
        self._release_buffers()
        old = self.network_pool
        if old.available_segments != old.total_segments:
            gc.collect()    # a reference cycle (a traceback, a view) may still hold a Buffer
        if old.available_segments != old.total_segments:
            raise errors.FlowBufError(
                f"{old.total_segments - old.available_segments} segment(s) were not returned by the failed attempt")
        meta = self._restart_point()
        with self._lock:
            self.failure = None
            self.cancelled = False
        self.launcher.place([])
        self._build()
        self._arm_checkpointing(meta)
        if self.sampler is not None:
            self.sampler.forget_counters()
        self.launcher.launch()

    def _send(self, msg):
        if msg[0] == "trigger" and msg[2] and msg[2].get("path") and hasattr(self.coordinator, "register_savepoint"):
            self.coordinator.register_savepoint(msg[1], msg[2]["path"])
        self.launcher.send(msg)

    def task_failed(self, task, exc):
        with self._lock:
            first = self.failure is None and not (self.cancelled and isinstance(exc, errors.CancelledError))
            if first:
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                op = getattr(exc, "failed_operator", None) or task.current_operator
                self.failure = (task.task_name, op, exc, tb)
        # The frames of the traceback hold the batch that was in flight, and
        # its zero-copy records pin their segments: keep the text, drop locals.
        traceback.clear_frames(exc.__traceback__)
        if first:
            self.cancel()

    def cancel(self, _user=True):
        """Stop every task: blocked waits wake at once and raise inside the task."""
        if _user and self.failure is None:
            self._user_cancelled = True     # a cancel, not the fallout of a failure: no restart
            if self._jobdir is not None:
                self._jobdir.ending()
        self.cancelled = True
        self.launcher.cancel()
        if self.iterator_input is not None:
            self.iterator_input.gate.cancel()

    def _close(self):
        if self.sampler is not None:
            self.sampler.stop()
        # once every task ended, leave no pyflowbuf thread behind the caller
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and self._done.is_set() and watcher is not threading.current_thread():
            watcher.join()

    def iterate(self, sink_node):
        """Generator: the records reaching the iterator sink, in this thread."""
        self.start()
        inp = self.iterator_input
        try:
            while True:
                try:
                    batch = inp.read(self.spec.max_batch, 0.1)
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
    def summary(self) -> dict:
        return {} if self.sampler is None else self.sampler.summary()
