"""What every execution of a job shares, wherever its subtasks run (threads
here: ``runtime.job.JobExecution``; worker processes or Spark barrier tasks:
``cluster.driver.ClusterExecution``): waiting and stopping, savepoints, and
one copy of the coordination of checkpoints: the coordinator and its hold on
the checkpoint directory, the restore point and its checks, the commits a
restore carries out, the sinks' outputs, the restart decision and the start
of a restart, the one loop of the job's attempts (``_watch``) and the
failure message. An execution is the coordinator's ``SubtaskGateway``
(``pyflowbuf.checkpointing.gateway``): each call goes to the subtasks as the
message a worker is sent (``_send``), through the launcher that placed them
(``runtime.launcher.ThreadLauncher`` for threads)."""
from __future__ import annotations

import os
import threading
import time
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

# How long a cancelled job waits for its threads: tasks blocked in C wake at
# once; only a user function that never returns can hold a thread longer.
CANCEL_GRACE_S = 10.0




class Execution(SubtaskGateway):
    """What a job run in this process (JobExecution) and one spread over worker
    processes (ClusterExecution) share: waiting, stopping on the way out, and
    the coordination of checkpoints (below). Each is the coordinator's
    ``SubtaskGateway``: it posts the coordinator's calls to its subtasks,
    or sends them to its workers.

    ``ran`` turns True just before the first task (or worker) is let go: a
    start that failed before it ran nothing and left nothing running."""

    ran = False
    control = None      # the control endpoint (Environment(control_port=...)); closed when the job ends

    def join(self, timeout=None):
        """Wait for the job; raise JobFailedError on failure, TimeoutError if it
        did not finish (the job is then cancelled)."""
        timeout = check_timeout(timeout)
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

    # where a failure's traceback was taken, in the message that raises it
    traceback_where = ""

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

    def _finished_ok(self):
        """Called once the job finished without failure, in the joining thread."""

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
        raise NotImplementedError

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
        """Whether this process coordinates the job (a worker's share does not)."""
        return True

    def _restartable(self, failure) -> bool:
        """Whether a restart of the job may follow ``failure`` (one it would not meet again)."""
        return True

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
                    self.coordinator.finish_job()     # sinks commit their final output
                self._stop_checkpointing()
        finally:
            try:
                self._no_attempt_follows()
            finally:
                self._done.set()

    def _await_attempt(self):
        """Until every subtask of the current attempt has ended."""
        raise NotImplementedError

    def _restart(self) -> bool:
        """After a failure, the next attempt from the restart point; False when none was started."""
        raise NotImplementedError

    def _restart_failed(self, exc):
        """The restart raised ``exc`` (inside its except block): the job fails with it."""
        raise NotImplementedError

    def _attempts_over(self):
        """No attempt follows, before the final commit: what the attempts held."""

    def _no_attempt_follows(self):
        """The last thing before ``done``, even when the end failed: the job's
        directory let go (done already, unless the end itself failed), the
        final metrics sample taken."""

    def _stop_checkpointing(self):
        if self.coordinator is not None and self._coordinates():
            self.coordinator.stop()
            self.coordinator.abort_all("the job ended")
        if self._snapshot_writer is not None:
            self._snapshot_writer.shutdown(wait=True)
        if self._jobdir is not None:
            self._jobdir.release()      # the last write to the directory is done
