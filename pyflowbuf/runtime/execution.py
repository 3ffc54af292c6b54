"""The one execution of a job, wherever its subtasks run: ``JobExecution``.

It owns the job's coordination, restarts, restore and failure policy, for
every placement: waiting and stopping, savepoints, the coordinator and its
hold on the checkpoint directory, the restore point and its checks, the
commits a restore carries out, the sinks' outputs, the restart decision and
the restart, the one loop of the job's attempts (``_watch``), the one rule
for recording a failure (``subtask_failed``) and the failure message.

Where the subtasks run is its launcher's business (``runtime/launcher.py``:
threads here, ``ThreadLauncher``; forked workers, ``WorkerLauncher``; Spark
barrier tasks, ``SparkLauncher``): the execution calls the ``Launcher``
methods, and the launcher reports back through ``AttemptEvents``. The
execution is the coordinator's ``SubtaskGateway``
(``pyflowbuf.checkpointing.gateway``): each call goes to the subtasks as the
message a worker is sent (``_send``), through the launcher.

A worker process runs its share of a job as a ``JobExecution`` too
(``placement``, ``me`` and ``remote`` say which share), on a
``ThreadLauncher``; it does not coordinate: its driver's execution does.

Example::

    from pyflowbuf.runtime.execution import JobExecution

    job = JobExecution(environment.job_spec()).start()
    job.join(timeout=60)
"""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid

from pyflowbuf import errors
from pyflowbuf import ui as _ui
from pyflowbuf._validation import check_timeout
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.checkpointing.gateway import SubtaskGateway
from pyflowbuf.checkpointing import jobdir
from pyflowbuf.checkpointing import restore as restore_mod
from pyflowbuf.connectors import outputs as sink_outputs
from pyflowbuf.runtime.deployment import output_pool_size, segments_needed
from pyflowbuf.runtime.launcher import CANCEL_GRACE_S, AttemptEvents, Launcher, ThreadLauncher
from pyflowbuf.runtime.metrics import close_listeners, make_listeners

log = logging.getLogger("pyflowbuf.runtime")

__all__ = ["CANCEL_GRACE_S", "JobExecution", "is_secondary"]

# failures a restart would meet again, by the type name a worker's text starts with
NOT_RESTARTED = ("KeyKindError:",)


def is_secondary(exc, op) -> bool:
    """Failures that follow another one or a cancel (a cancelled wait, a peer
    going away, a remote exchange that broke): a real failure replaces them."""
    return op == "remote exchange" or isinstance(exc, (errors.CancelledError, errors.ConnectionLostError))


class JobExecution(SubtaskGateway, AttemptEvents):
    """One job ``spec`` (a ``JobSpec``), its subtasks placed by ``launcher``
    (default: a ``ThreadLauncher``, threads of this process). Without
    ``placement`` every subtask of the job is this execution's; with it, only
    those placed on worker ``me`` are (a worker's share), and exchanges with
    subtasks elsewhere go through ``remote`` (a
    ``pyflowbuf.cluster.worker.RemoteContext``).

    ``ran`` turns True just before the first subtask is let go: a start that
    failed before it ran nothing and left nothing running."""

    ran = False
    control = None      # the control endpoint (Environment(control_port=...)); closed when the job ends
    secret = None       # (worker launchers) the shared secret of the current attempt
    tls = None          # (worker launchers) each attempt's TLSConfig (pyflowbuf.net.tls.AttemptTLS)

    def __init__(self, spec, placement=None, me=0, remote=None, *, launcher: Launcher | None = None):
        self.spec = spec                # the JobSpec: the job's graph and settings (jobgraph/spec.py)
        self.vertices, self.edges = spec.plan()
        self.placement = placement or (lambda vertex, subtask: 0)
        self.me = me
        self.remote = remote
        self.launcher = launcher if launcher is not None else ThreadLauncher()
        self.cancelled = False
        # (task name, operator name, the exception or its text where it was
        # raised in another process, formatted traceback); secondary: a
        # consequence of another failure, which a real one replaces
        self.failure = None
        self._failure_secondary = True
        self.event_handler = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.started = self.ended = None
        self.startup_s = None           # from start() to every subtask let go
        self.sampler = None
        # Fencing: the attempt every word between the execution and its
        # subtasks carries (a restart counts it up); what belongs to an
        # earlier attempt is ignored. The coordinator fences its own calls
        # the same way: see CheckpointCoordinator.attach.
        self.attempt = 0
        # this process's share of the subtasks, when they run here (ThreadLauncher.build)
        self.network_pool = None
        self.network_pools: list = []  # the pool of every attempt, to check that all came back
        self.iterator_input = None
        self._queues: list = []
        self._exported = set()         # ids of queues a remote consumer drains
        self._iterator_released = False
        # checkpoints: on when the spec asks; a worker process is given its
        # config and a proxy of the driver's coordinator (cluster/worker.py)
        self.checkpoint_config = ckpt.CheckpointSettings.from_env(spec) if remote is None else None
        self.restart_failures: list = []   # (task, operator, exception text) of each failure recovered
        self._task_keys = ckpt.graph_task_keys(self.vertices)
        self.launcher.check(self)

    # ---- what the launcher places ----
    @property
    def tasks(self) -> list:
        """The current attempt's subtasks in this process (none where workers run them)."""
        return self.launcher.subtasks

    @property
    def workers(self) -> int | None:
        """How many worker processes run the job (None: threads of this process)."""
        return self.launcher.workers

    @property
    def addresses(self) -> dict:
        """worker -> (host, port) of its exchange server (empty for threads)."""
        return self.launcher.addresses

    @property
    def traceback_where(self) -> str:
        """Where a failure's traceback was taken, in the message that raises it."""
        return self.launcher.traceback_where

    # the Deployment of a share of the job reads these
    def _output_pool_size(self, nsub: int):
        return output_pool_size(self.spec, nsub)

    def _here(self, vertex, subtask):
        return self.placement(vertex, subtask) == self.me

    def _remote_buffers(self):
        r = self.remote
        return None if r is None else (r.exclusive_buffers, r.floating_buffers)

    def _segments_needed(self):
        return segments_needed(self.spec, self.edges, self._here, self._remote_buffers())

    @property
    def _gate_output(self) -> bool:
        """Whether tasks wait for output buffers between batches (unaligned
        checkpoints: see Mailbox.wait_for_output in runtime/task/mailbox.py)."""
        c = self.spec.checkpoint_config
        return c.enabled and c.alignment == "unaligned"

    # ---- running ----
    def start(self):
        launcher = self.launcher
        # First, before this execution starts a thread (the exporter's, the
        # coordinator's, the sampler's, the watcher's): a zygote to fork from
        launcher.open()
        coordinating = self._coordinates()
        listeners = []
        self.started = time.monotonic()
        try:
            # The metrics listeners first: a busy prometheus_port is refused
            # before any memory is taken or any subtask runs. A worker's share
            # has none: its driver serves them (one port, one log, one view).
            listeners = make_listeners(self.spec) if coordinating else []
            launcher.build()
            restore_id = None
            if self.checkpoint_config is not None:
                restore_id = self._start_checkpointing(listeners)
            if coordinating:
                # before any subtask starts (a worker is forked with what was decided)
                self._prepare_outputs(restoring=self.restored_from is not None)
            self.sampler = launcher.sampler(listeners)
            launcher.launch(restore_id)
            self.startup_s = time.monotonic() - self.started
        except BaseException:
            if self.sampler is not None:
                self.sampler.stop()         # (closes the listeners)
            else:
                close_listeners(listeners)
            self._stop_checkpointing()
            try:
                launcher.finished(graceful=False)
            finally:
                self._done.set()
            raise
        if self.coordinator is not None and coordinating:
            self.coordinator.start()
        self._watcher = threading.Thread(target=self._watch, name="pyflowbuf: job watcher", daemon=True)
        self._watcher.start()
        return self

    # ---- what the launcher reports (AttemptEvents) ----
    def attempt_ready(self) -> None:
        self.ran = True
        if self.coordinator is not None and self._coordinates():
            self.coordinator.attach(self, self._task_keys)

    def subtask_acknowledged(self, task_key, checkpoint_id, handle, alignment_ms, commits, summary=None) -> None:
        self.coordinator.acknowledge(task_key, checkpoint_id, handle, alignment_ms, commits, summary)

    def subtask_declined(self, task_key, checkpoint_id, reason) -> None:
        self.coordinator.decline(task_key, checkpoint_id, reason)

    def subtask_finished(self, task_key, state, commits, snapshotted=0, summary=None) -> None:
        self.coordinator.task_finished(task_key, state, commits, snapshotted, summary)

    def subtask_failed(self, task, operator, what, tb, secondary=False, attempt=None) -> None:
        """The one rule for every placement: the first real failure is the
        job's; a secondary one (a consequence: a lost peer, a cancelled wait)
        stands only until a real one arrives, and is none at all once the job
        was cancelled; a word of an attempt already given up is ignored."""
        with self._lock:
            if attempt is not None and attempt != self.attempt:
                return      # the failure of an attempt already restarted
            if secondary and self.cancelled and self.failure is None:
                return      # a peer going away because the job was cancelled is no failure
            if self.failure is None or (self._failure_secondary and not secondary):
                self.failure = (task, operator, what, tb)
                self._failure_secondary = bool(secondary)
        self.cancel(_user=False)

    def task_failed(self, task, exc):
        """A subtask of this process raised ``exc``."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        op = getattr(exc, "failed_operator", None) or task.current_operator
        # The frames of the traceback hold the batch that was in flight, and
        # its zero-copy records pin their segments: keep the text, drop locals.
        traceback.clear_frames(exc.__traceback__)
        self.subtask_failed(task.task_name, op, exc, tb, secondary=is_secondary(exc, op))

    def _remote_failed(self, exc):
        """A remote channel or export failed (peer died, protocol error, the
        consumer went away before the end): the job fails, unless a real
        failure (or a cancel) explains it."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.subtask_failed(f"worker {self.me}", "remote exchange", exc, tb, secondary=True)

    def cancel(self, _user=True):
        """Stop every subtask: blocked waits wake at once and raise inside them."""
        if _user:
            # the caller's cancel (or join's timeout), even during a recovery:
            # no restart; failures cancel with _user=False
            self._user_cancelled = True
            if self._jobdir is not None:
                self._jobdir.ending()
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
        self.launcher.cancel()

    def _close(self):
        if self.sampler is not None:
            self.sampler.stop()
        # once the job ended, leave no pyflowbuf thread behind the caller
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and self._done.is_set() and watcher is not threading.current_thread():
            watcher.join(CANCEL_GRACE_S)    # it has set _done: only its last lines are left
        self.launcher.close()

    def _finished_ok(self):
        """Called once the job finished without failure, in the joining thread."""
        self.launcher.joined_ok()

    def iterate(self, sink_node):
        """Generator: the records reaching the iterator sink, in this thread."""
        self.start()
        ended = False
        try:
            yield from self.launcher.records()
            ended = True
        except errors.CancelledError:
            if self.failure is None:
                raise
            ended = True        # a subtask failed: raised below
        finally:
            if not ended:
                # the caller closed the generator (a break) or an error left
                # it: cancel, then end and close everything, as join() would;
                # nothing outlives the generator
                self._stop_now()
        if self.failure is not None and not self._done.wait(CANCEL_GRACE_S):
            self._stop_now()
            self.raise_if_failed()
        self.join()

    # ---- inspection ----
    def summary(self) -> dict:
        return self.launcher.summary()

    def join(self, timeout=None):
        """Wait for the job; raise JobFailedError on failure, TimeoutError if it
        did not finish (the job is then cancelled). ``join(0)`` does not wait:
        on a job that has ended it returns or raises its failure."""
        timeout = check_timeout(timeout, zero_ok=True)
        try:
            finished = self._done.wait(timeout)
        except BaseException:
            # KeyboardInterrupt, or anything else: never leave the job running behind it
            self._stop_now()
            raise
        if not finished:
            self._stop_now()
            raise TimeoutError(f"job {self.spec.name!r} did not finish within {timeout} s (cancelled)")
        if self.control is not None:
            self.control.close()
        self._close()
        self.raise_if_failed()
        self._finished_ok()
        return self

    def raise_if_failed(self):
        """The job's failure as ``JobFailedError``: the task and operator that
        failed, what they raised, and its original traceback. ``failure`` is
        (task, operator, the exception, or its text where it was raised in a
        worker process, formatted traceback)."""
        if self.failure is not None:
            task, op, what, tb = self.failure
            text = what if isinstance(what, str) else f"{type(what).__name__}: {what}"
            err = errors.JobFailedError(f"job {self.spec.name!r} failed: operator {op!r} in task {task!r} raised "
                                        f"{text}\n\nOriginal traceback{self.traceback_where}:\n{tb}")
            if isinstance(what, BaseException):
                raise err from what
            raise err

    def _stop_now(self):
        try:
            self.cancel()
            self._done.wait(CANCEL_GRACE_S)
        finally:
            self._close()

    def run(self, timeout=None):
        self.start()
        return self.join(timeout)

    stopped_with_savepoint = None       # the id of the savepoint job.stop() ended the job with

    def _savepoint_coordinator(self, what):
        coordinator = getattr(self, "coordinator", None)
        if coordinator is None:
            raise errors.ConfigurationError(
                f"{what} needs checkpointing: set checkpoint_interval (and checkpoint_dir) on the Environment")
        if not self.ran or self.done:
            raise errors.FlowBufError(f"{what}: the job is not running")
        return coordinator

    def _savepoint_path(self, path):
        if path is not None:
            return os.fspath(path)
        base = self.checkpoint_config.directory.rstrip("/")
        return f"{base}/savepoints/savepoint-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"

    def savepoint(self, path=None, *, timeout=None) -> str:
        """Take a savepoint of the running job and return its directory.

        A savepoint is an aligned checkpoint that belongs to the user: it is
        written self-contained to ``path`` (a new or empty directory; any
        fsspec URL; default ``<checkpoint_dir>/savepoints/savepoint-<time>``),
        never removed by retention, and can be moved or copied. Restore it
        with ``execute(restore_from=path)``, at another parallelism too.
        Raises ``CheckpointStateError`` when it could not complete.

        Example::

            job = environment.execute_async()
            path = job.savepoint("/backups/wordcount-v1")
        """
        coordinator = self._savepoint_coordinator("savepoint()")
        path = self._savepoint_path(path)
        coordinator.savepoint(path, timeout=timeout)
        return path

    def stop(self, savepoint=None, *, drain=False, timeout=None) -> str:
        """Stop the job with a final savepoint: the sources stop, the
        savepoint is taken (aligned), the sinks commit what it covers, and the
        job ends without processing anything after it. Returns the
        savepoint's directory; ``execute(restore_from=that)`` resumes with
        nothing lost or duplicated. If the savepoint fails the job runs on
        and ``CheckpointStateError`` is raised.

        Nothing runs after the savepoint: once a source has sent its barrier
        it reads nothing and sends nothing more (no record, watermark or idle
        marker), and every task that passed the barrier on stops there: no
        timer fires, no window fires, nothing reaches a sink, and the cancel
        that ends the job sends no end of input. A ``collect()`` holds exactly
        what the savepoint covers; a window whose end the watermark had not
        reached stays open in the savepoint and fires once, in the job
        restored from it.

        ``drain=True`` (Flink's ``stop --drain``): the sources end event time
        (a watermark at +inf) just before the barrier, so every window and
        event-time timer fires once, inside the savepoint. For a job ended for
        good: a job restored from a drained savepoint starts at the end of
        event time, and every record it reads is late. If a drained stop
        fails, the job fails (restarting from its last checkpoint where
        ``restart_attempts`` allows), since its event time has ended.

        Example::

            job = environment.execute_async()
            ...
            path = job.stop(savepoint="/backups/before-upgrade")
            # or, to end it for good with every window fired:
            # path = job.stop(savepoint="/backups/final", drain=True)
        """
        coordinator = self._savepoint_coordinator("stop(savepoint=...)")
        path = self._savepoint_path(savepoint)
        coordinator.savepoint(path, stop=True, drain=bool(drain), timeout=timeout)
        self._done.wait()
        if self.control is not None:
            self.control.close()
        self._close()
        return path

    # ---- the coordinator's calls (SubtaskGateway), whatever places the subtasks ----
    def trigger_sources(self, checkpoint_id, options=None):
        self._send(("trigger", checkpoint_id, options))

    def notify_complete(self, checkpoint_id):
        self._send(("complete", checkpoint_id))

    def abort_checkpoint(self, checkpoint_id):
        self._send(("abort", checkpoint_id))

    def switch_to_unaligned(self, checkpoint_id):
        self._send(("unaligned", checkpoint_id))

    def _send(self, msg):
        """The coordinator's call ``msg`` (as a worker is sent it), to every
        subtask of the current attempt, through the launcher that placed them."""
        if msg[0] == "trigger" and msg[2] and msg[2].get("path") and self.remote is not None \
                and self.coordinator is not None:
            # a worker's share: its tasks write a savepoint where the driver's coordinator said
            self.coordinator.register_savepoint(msg[1], msg[2]["path"])
        self.launcher.send(msg)

    def stop_after_savepoint(self, checkpoint_id):
        """Stop-with-savepoint: savepoint ``checkpoint_id`` completed and its
        commits are done; the job ends without processing anything more."""
        self.stopped_with_savepoint = checkpoint_id
        threading.Thread(target=self.cancel, name="pyflowbuf: stop with savepoint", daemon=True).start()

    def checkpoints(self) -> list:
        return [] if self.coordinator is None else self.coordinator.checkpoints()

    ui = None           # the web view (pyflowbuf.ui.UiServer) when one is served

    def serve_ui(self, port: int = 0, host: str = _ui.LOOPBACK) -> str:
        """Serve the web view of this job (graph, backpressure, checkpoints,
        watermarks: docs/monitoring.md) and return its URL, also logged and
        kept in ``ui_url``. ``host`` other than 127.0.0.1 puts an access
        token in the URL. It serves until the handle is gone (``ui.close()``
        stops it sooner), showing the final state once the job ended."""
        if self.ui is None:
            self.ui = _ui.serve(self, port, host)
        return self.ui.url

    @property
    def ui_url(self) -> str | None:
        return None if self.ui is None else self.ui.url

    def metrics(self) -> dict:
        return {} if self.sampler is None else self.sampler.latest()

    @property
    def done(self):
        return self._done.is_set()

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus exporter serves on (the free one it took
        for ``prometheus_port=0``), None when the job has none."""
        sampler = getattr(self, "sampler", None)
        for listener in (sampler.listeners if sampler is not None else ()):
            if type(listener).__name__ == "PrometheusExporter":
                return listener.port
        return None

    # ---- checkpoints, restore and restarts: one copy for every placement ----
    # Set by the execution: its JobSpec, vertices, CheckpointSettings (None:
    # checkpoints off), coordinator, restore_from, failure, restarts.
    coordinator = None
    checkpoint_config = None
    restore_from = None                 # set by Environment.execute(restore_from=...)
    restored_from = None                # the checkpoint id the job (or its last attempt) started from
    allow_non_restored_state = False    # set by Environment.execute(allow_non_restored_state=...)
    check_key_kinds = True              # whether the restore point's key kinds are checked (restore.checks_key_kinds)
    restarts = 0
    _user_cancelled = False
    _jobdir = None                      # the driver's hold on checkpoint_dir (checkpointing/jobdir.py)
    _snapshot_writer = None
    _started_from = None                # the checkpoint or savepoint this run started from

    def _open_checkpointing(self, listeners):
        """In the process that coordinates the job: its hold on its checkpoint
        directory (nothing of another job's is read or written), the
        coordinator, and the checkpoint ``restore_from`` names, checked to be
        this job's. Returns that checkpoint's metadata, or None."""
        config, spec = self.checkpoint_config, self.spec
        storage = CheckpointStorage(config.directory, retained=config.retained, allow_pickle=config.allow_pickle)
        fingerprint = jobdir.job_fingerprint(spec.nodes, spec.max_parallelism)
        self._jobdir = jobdir.open_directory(storage, spec.name, fingerprint)
        self.coordinator = ckpt.CheckpointCoordinator(config, storage, spec.name)
        self.coordinator.fingerprint = fingerprint
        self.coordinator.listeners = listeners
        self.coordinator.outputs = sink_outputs.graph_outputs(spec.nodes)
        meta = ckpt.restore_plan(storage, self.restore_from)
        jobdir.check_restore_point(storage, self.restore_from, meta, spec, fingerprint)
        jobdir.check_no_other_job(storage, spec.name)
        self._started_from = meta
        if self.restore_from is None:
            jobdir.warn_fresh_start(storage, spec.name)
        if meta is None:
            restore_mod.started_fresh(self)
        return meta

    def _restore_plan(self, storage, meta, check_key_kinds: bool = True, check: bool = True):
        """The ``RestorePlan`` of checkpoint ``meta`` (by operator id, at any
        parallelism), checked against this job's vertices and sources before
        anything starts (``check``: the process that coordinates checks; a
        worker is told it was)."""
        plan = restore_mod.RestorePlan(storage, meta, self.spec.max_parallelism, self.allow_non_restored_state,
                                       check_key_kinds)
        if check:
            plan.check(self.vertices)
            # (before any source hands out its positions: a changed input is named as such)
            plan.check_sources(self.vertices)
        return plan

    def _commit_restored(self, meta):
        """What checkpoint ``meta`` covered is committed (its notification may
        have been lost). Once per job, by the process that coordinates it: two
        processes renaming the same files would race."""
        commits = restore_mod.restored_commits(meta, self.spec.nodes, self.allow_non_restored_state)
        ckpt.run_commits(commits, restore_mod.commit_outputs(self.spec.nodes, meta))

    def _prepare_outputs(self, restoring: bool):
        """The file sinks' outputs, before any subtask (or worker) starts."""
        sink_outputs.prepare_outputs(self.spec.nodes, restoring=restoring,
                                     checkpoint_dir=self.spec.checkpoint_config.directory)

    def _coordinates(self) -> bool:
        """Whether this process coordinates the job: a worker's share does
        not (its coordinator is a proxy of the driver's, which runs the
        checkpoints and restarts the whole job)."""
        return self.remote is None

    def _restartable(self, failure) -> bool:
        """Whether a restart of the job may follow ``failure``: not one a
        restart would meet again (a restored key of another kind: its type,
        or a worker's text naming it), nor where the launcher says no (records
        handed out to an iterator would be handed out again)."""
        what = failure[2]
        if isinstance(what, str):
            again = what.startswith(NOT_RESTARTED)
        else:
            again = not getattr(what, "restartable", True)
        return not again and self.launcher.restartable()

    def _should_restart(self) -> bool:
        config = self.checkpoint_config
        return (self.failure is not None and self.coordinator is not None and config is not None
                and self._coordinates() and self.restarts < config.restart_attempts and not self._user_cancelled
                and self._restartable(self.failure))

    def _begin_restart(self, task_keys):
        """After a failure, before the job is built again: count the restart,
        and let nothing decided for the failed attempt reach the next one (a
        completion under way finishes first)."""
        task, op, what, _ = self.failure
        self.restarts += 1
        self.restart_failures.append((task, op, what if isinstance(what, str) else f"{type(what).__name__}: {what}"))
        self.coordinator.attach(None, task_keys)
        self.coordinator.abort_all(f"task {task!r} failed; restarting")

    def _restart_point(self):
        """The metadata of the checkpoint a restart restores: the latest
        complete one, else the one the job started from."""
        return ckpt.restart_point(self.coordinator, self._started_from)

    # ---- the job's attempts: one loop for every placement ----
    def _watch(self):
        """The job from its first attempt to its end, in the execution's own
        thread: wait for the attempt to end (``_await_attempt``), decide on a
        restart (``_should_restart``) and start the next attempt
        (``_restart``: False when none was started; a restart that raises
        fails the job, ``_restart_failed``); once no attempt follows, the
        sinks commit their final output (a job that finished), the
        checkpoints stop, the placement lets go of what it kept
        (``_no_attempt_follows``), and whoever waits on the job is woken."""
        try:
            while True:
                self._await_attempt()
                if not self._should_restart():
                    break
                try:
                    if not self._restart():
                        break
                except BaseException as exc:  # noqa: BLE001 - the restart itself failed: the job fails
                    self._restart_failed(exc)
                    break
            self._attempts_over()
            if self.coordinator is not None:
                if self.failure is None and not self.cancelled and self._coordinates():
                    try:
                        self.coordinator.finish_job()     # sinks commit their final output
                    except BaseException as exc:  # noqa: BLE001 - a final commit that failed fails the job
                        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                        with self._lock:
                            self.failure = ("job", "final commit", exc, tb)
                            self._failure_secondary = False
                self._stop_checkpointing()
        finally:
            try:
                self._no_attempt_follows()
            finally:
                self._done.set()

    def _await_attempt(self):
        """Until every subtask of the current attempt has ended (the launcher
        reports its events meanwhile)."""
        self.launcher.await_attempt()

    def _restart(self) -> bool:
        """After a failure every subtask of the attempt has ended (or is
        stopped now): start the next attempt from the latest complete
        checkpoint (sources rewind to its positions). False when the job was
        cancelled meanwhile (nothing restarted)."""
        task, op, what, _ = self.failure
        log.info("pyflowbuf: job %r: %s in task %s failed (%s); restarting (%d of %d)", self.spec.name, op,
                 task, what, self.restarts + 1, self.checkpoint_config.restart_attempts)
        launcher = self.launcher
        with launcher.restarting():
            self._begin_restart(self._task_keys)     # nothing to trigger until the new attempt runs
            launcher.stop_attempt()
            meta = self._restart_point()
            with self._lock:
                if self._user_cancelled:
                    return False        # cancelled while recovering: the job ends with its failure
                self.attempt += 1       # from here on, what the stopped attempt says is ignored
                self.failure = None
                self._failure_secondary = True
                self.cancelled = False
            launcher.build()
            restore_id = self._restore(meta)
            launcher.arm(self._snapshot_writer)
            launcher.launch(restore_id)
        if self.cancelled:
            launcher.cancel()           # a cancel that came while the attempt started
        return True

    def _restart_failed(self, exc):
        """The restart raised ``exc`` (inside its except block): the job fails
        with it, and whatever the restart started stops."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with self._lock:
            self.failure = ("job", "recovery", exc, tb)
            self._failure_secondary = False
            self.cancelled = True
        self.launcher.cancel()
        self.launcher.await_attempt()

    def _attempts_over(self):
        """No attempt follows, before the final commit: what the attempts held."""
        self.ended = time.monotonic()
        self.launcher.attempts_over()

    def _no_attempt_follows(self):
        """The last thing before ``done``, even when the end failed: the
        placement lets go of what it kept for restarts, the job's directory
        is let go (done already, unless the end itself failed), the final
        metrics sample is taken."""
        try:
            self.launcher.finished(graceful=not self.cancelled)
        except Exception:  # noqa: BLE001 - _close stops what is left
            log.exception("pyflowbuf: job %r: ending its subtasks failed", self.spec.name)
        if self.ended is None:
            self.ended = time.monotonic()
        if self._jobdir is not None:
            self._jobdir.release()
        if self.sampler is not None:
            self.sampler.stop()

    # ---- checkpoints and restore ----
    def _start_checkpointing(self, listeners):
        """Before any subtask starts: the sources checked, the coordinator (or
        a worker's proxy of it) and the restore point; returns what the
        launcher starts the attempt from (``_restore``)."""
        config = self.checkpoint_config
        # refused here, before any subtask (or worker) exists
        for name, source in self.launcher.sources():
            ckpt.check_rewindable(config, name, source)
        if self._coordinates():
            meta = self._open_checkpointing(listeners)
        else:
            # a worker's share, given a proxy of the driver's coordinator and
            # the id of a checkpoint the driver has already checked
            meta = self._started_from = ckpt.restore_plan(self.coordinator.storage, self.restore_from, verify=False)
            if meta is None:
                restore_mod.started_fresh(self)
        self._snapshot_writer = ckpt.new_writer()
        restore_id = self._restore(meta)
        self.launcher.arm(self._snapshot_writer)
        return restore_id

    def _restore(self, meta):
        """The state an attempt starts from: checkpoint ``meta`` (None: none),
        checked before anything starts; the commits it covered are done (by
        the process that coordinates). Where the subtasks run here the
        launcher reads each one's state (``Launcher.restore``); where they run
        in workers, each worker reads its own and is told the id returned."""
        if meta is None:
            restore_mod.started_fresh(self)
            self.restored_from = None
            return None
        storage = ckpt.storage_of(self.coordinator.storage, meta)
        coordinating = self._coordinates()
        restore_id = None
        if self.launcher.reads_state_here:
            plan = None
            if restore_mod.is_current(meta):
                # by operator id, at any parallelism (pyflowbuf.checkpointing.restore)
                # (the driver checked it for a worker)
                plan = self._restore_plan(storage, meta, restore_mod.checks_key_kinds(self, meta, self.check_key_kinds),
                                          check=coordinating)
            self.launcher.restore(meta, plan, storage)
        else:
            # told to the workers, which restore it (a restart's own checkpoint is not checked)
            self.check_key_kinds = restore_mod.checks_key_kinds(self, meta)
            if restore_mod.is_current(meta):
                self._restore_plan(storage, meta)
            else:
                ckpt.check_graph(meta, self._task_keys, storage.url)
                # the sources' identities, here before any worker starts
                sources = {ckpt.task_key(v, i): (v.head.name, v.head.source())
                           for v in self.vertices if v.head.source is not None for i in range(v.parallelism)}
                ckpt.check_sources(meta, ckpt.read_states(storage, meta, set(sources)), sources)
            restore_id = ckpt.restore_location(self.coordinator.storage, meta)
        if coordinating:
            self._commit_restored(meta)     # (with workers the driver does it)
        self.restored_from = meta.checkpoint_id
        return restore_id

    def _stop_checkpointing(self):
        if self.coordinator is not None and self._coordinates():
            self.coordinator.stop()
            self.coordinator.abort_all("the job ended")
        if self._snapshot_writer is not None:
            self._snapshot_writer.shutdown(wait=True)
        if self._jobdir is not None:
            self._jobdir.release()      # the last write to the directory is done
