"""The checkpoint coordinator (Flink's asynchronous barrier snapshots), which
runs where the job was started.

The coordinator triggers checkpoint *n* at every source subtask (a mail in its
mailbox). A source records its position, snapshots its chain's state and emits
barrier *n* on all its outputs, in order with its records. Every other
subtask aligns barrier *n* over its input channels, snapshots and forwards it
(a subtask's side: ``pyflowbuf.checkpointing.subtask``). A snapshot is a copy
of the state taken in the task's thread; a background thread writes it to
durable storage and acknowledges it. When every subtask has acknowledged, the
coordinator writes the checkpoint's metadata (only then is it complete), and
tells the sinks to commit what the checkpoint covers. A subtask that finished
(end of input) hands the coordinator its final state, which stands for it in
every later checkpoint.

Recovery (``JobExecution``) restores every subtask from the latest complete
checkpoint (``pyflowbuf.checkpointing.restore_point``, ``restore``): sources
seek to their recorded positions, operators restore their state, sinks commit
what that checkpoint covered and drop everything written after it. Records in
flight at the failure are re-read from the sources: exactly-once state and
output.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pyflowbuf import errors
from pyflowbuf.config import DEFAULT_CHECKPOINT_DIR  # noqa: F401 - its old home
from pyflowbuf.checkpoint.storage import CheckpointStateError, SavepointStorage
from pyflowbuf.checkpoint.keygroups import DEFAULT_MAX_PARALLELISM, INCREMENTAL_MAX_AGE
from pyflowbuf.checkpointing.phases import checkpoint_phases
from pyflowbuf.checkpointing.restore import metadata_properties
from pyflowbuf.connectors import outputs as outputs_mod

log = logging.getLogger("pyflowbuf.checkpoint")


def publish_checkpoint(listeners, entry: dict) -> None:
    """A checkpoint ended (completed, aborted, expired, failed): listeners that
    keep checkpoint figures get its history entry."""
    for listener in listeners:
        hook = getattr(listener, "checkpoint", None)
        if hook is not None:
            try:
                hook(entry)
            except Exception:  # an exporter must never break the job
                pass


@dataclass
class CheckpointSettings:
    """What one job's checkpoints run with, from the Environment's
    ``CheckpointConfig`` and ``RestartConfig`` and the settings of the job
    that storage and restore need."""

    interval: float
    directory: str
    timeout: float = 600.0
    retained: int = 2
    restart_attempts: int = 0
    mode: str = "exactly_once"
    allow_pickle: bool = False
    alignment: str = "aligned"
    alignment_timeout: float | None = None
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    incremental: bool = True              # CheckpointConfig.incremental

    @property
    def starts_unaligned(self) -> bool:
        """Barriers overtake from the start (unaligned, no timeout or 0)."""
        return self.alignment == "unaligned" and not self.alignment_timeout

    @property
    def switchable(self) -> bool:
        """Checkpoints start aligned and turn unaligned after the timeout."""
        return self.alignment == "unaligned" and bool(self.alignment_timeout)

    @classmethod
    def from_env(cls, spec) -> "CheckpointSettings | None":
        """From the job's ``JobSpec`` (any object with its settings)."""
        c = spec.checkpoint_config
        if not c.enabled:
            return None
        return cls(interval=c.interval, directory=os.fspath(c.directory or DEFAULT_CHECKPOINT_DIR),
                   timeout=c.timeout, retained=c.retained, restart_attempts=spec.restart_config.attempts,
                   mode=c.mode, allow_pickle=spec.allow_pickle, alignment=c.alignment,
                   alignment_timeout=c.alignment_timeout, max_parallelism=spec.max_parallelism,
                   incremental=c.incremental)


@dataclass
class _Pending:
    checkpoint_id: int
    trigger_time: float           # epoch seconds
    trigger_ns: int               # monotonic
    expected: set
    handles: dict = field(default_factory=dict)       # task key -> TaskStateHandle
    alignment_ms: dict = field(default_factory=dict)  # task key -> ms spent aligning
    commits: list = field(default_factory=list)       # sink commit actions the checkpoint covers
    alignment: str = "aligned"    # aligned | unaligned | switched (by the alignment timeout)
    timer: Any = None
    storage: Any = None           # where its files go: the checkpoint_dir's, or a savepoint's own
    summaries: dict = field(default_factory=dict)     # task key -> what its state holds (restore.stored_state)
    savepoint: bool = False
    stop: bool = False            # stop-with-savepoint: the job ends once it completed
    done: Any = field(default_factory=threading.Event)
    outcome: Any = None           # ("completed", metadata) or (status, reason)
    # checkpoint (periodic, the job's own) | savepoint (the user's): in the history,
    # _metadata's properties and `pyflowbuf checkpoints list`
    kind: str = "checkpoint"
    trigger_at_ns: int = 0        # wall clock (the subtasks' phases are wall-clock instants)
    phases: dict = field(default_factory=dict)        # task key -> its phases (phases.phases_of)
    acked_at_ns: dict = field(default_factory=dict)   # task key -> when its acknowledgement came (wall clock)
    completion: Any = None        # wall clock: completing began, metadata written, commits done


class CheckpointCoordinator:
    """Triggers, collects and completes checkpoints for one job.

    ``execution`` provides ``trigger_sources(n)``, ``notify_complete(n)`` and
    ``abort_checkpoint(n)``; subtasks call ``acknowledge``, ``decline`` and
    ``task_finished`` from any thread.

    Attempts are fenced: every ``attach`` starts an epoch, and a call to the
    execution (a trigger, a completion, an abort) decided in an earlier
    epoch is dropped. Calls are made under ``_calls``, which ``attach`` takes
    too, so once ``attach`` returns none of the old epoch is under way: a
    restart that detaches first and then reads the latest checkpoint sees a
    completion that was in flight, and no trigger meant for the stopped
    attempt reaches the new one (a worker told "trigger" before "go" quit).
    """

    def __init__(self, config: CheckpointSettings, storage, job_name: str = "job"):
        self.config = config
        self.storage = storage
        self.job_name = job_name
        self._lock = threading.Lock()
        self._calls = threading.RLock()   # held while telling the execution; see the class docstring
        self._epoch = 0
        # after every directory there, damaged or abandoned ones too: a new
        # checkpoint never lands in a directory an old one left behind
        self._next_id = max(storage.checkpoint_ids(), default=0) + 1
        self.first_id = self._next_id      # this run's checkpoints are numbered from here
        self.fingerprint = None            # the job's (runtime.jobdir.job_fingerprint), into _metadata
        self.pending: dict[int, _Pending] = {}
        self.history: list[dict] = []
        self.finished: dict[str, tuple] = {}       # task key -> (state, commits, summary)
        self.task_keys: set = set()
        self.execution = None
        self._stop = threading.Event()
        self._thread = None
        self.completed = 0
        self._savepoints: dict = {}       # id -> _Pending of the savepoints triggered (their outcome)
        self.listeners: list = []      # metrics listeners with a checkpoint(entry) hook
        self.outputs: list = []        # the FileOutputs of the job's part-file sinks (run_commits)
        # (checkpoint id, task key) -> its state file's reference entry, for the
        # complete checkpoints in checkpoint_dir that incremental ones may refer to
        self._files: dict = {}

    # ---- lifecycle ----
    def attach(self, execution, task_keys, finished=None) -> None:
        """A (re)started attempt: which subtasks take part and how to reach them.
        Waits for a call to the execution under way (a completion, a trigger)."""
        with self._calls, self._lock:
            self._epoch += 1
            self.execution = execution
            self.task_keys = set(task_keys)
            # (state, commits[, summary]): a summary only where the state has the stored layout
            self.finished = {k: (tuple(v) + (None,))[:3] for k, v in (finished or {}).items()}

    def _tell(self, execution, epoch, what, checkpoint_id, *args) -> bool:
        """``execution.<what>(checkpoint_id)`` unless the attempt it was
        decided for is gone."""
        with self._calls:
            if epoch != self._epoch or execution is None:
                log.debug("pyflowbuf: %s(%d) of an earlier attempt dropped", what, checkpoint_id)
                return False
            if args and args[0] is not None:
                getattr(execution, what)(checkpoint_id, *args)
            else:
                getattr(execution, what)(checkpoint_id)
            return True

    def storage_for(self, checkpoint_id: int):
        """Where checkpoint ``checkpoint_id``'s files go (a savepoint has its own directory)."""
        with self._lock:
            p = self.pending.get(checkpoint_id) or self._savepoints.get(checkpoint_id)
        # (a savepoint aborted meanwhile: its own storage, which refuses the late write)
        return self.storage if p is None or p.storage is None else p.storage

    def savepoint(self, path: str, *, stop: bool = False, drain: bool = False, timeout: float | None = None):
        """Trigger a savepoint into ``path`` and wait for it; its
        CheckpointMetadata. Waits for a checkpoint under way first (one at a
        time). Raises CheckpointError when it is aborted, declined or expires.
        ``stop``: the job ends with it; ``drain`` (with ``stop``): the sources
        end event time before its barrier."""
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        SavepointStorage(path, allow_pickle=self.storage.allow_pickle).prepare_new()
        while True:
            with self._lock:
                if self.execution is None or self._stop.is_set():
                    raise errors.FlowBufError("the job is not running: no savepoint can be taken")
                if not (self.task_keys - set(self.finished)):
                    raise errors.FlowBufError(
                        "every task of the job has finished: there is nothing left to take a savepoint of")
            n = self.trigger(savepoint=path, stop=stop, drain=drain and stop)
            if n is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no savepoint could be triggered within {timeout} s (a checkpoint was pending)")
            time.sleep(0.01)
        with self._lock:
            p = self.pending.get(n)
        if p is None:       # completed or aborted already: find its record
            p = self._savepoints.get(n)
        left = max(0.0, deadline - time.monotonic())
        if not p.done.wait(left + 1.0):
            self.abort(n, f"savepoint {n} did not complete in time", status="expired")
            p.done.wait(5.0)
        status, what = p.outcome or ("expired", "no outcome")
        if status != "completed":
            raise CheckpointStateError(f"savepoint {n} into {path} {status}: {what}")
        return what

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pyflowbuf: checkpoint coordinator",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self):
        interval = self.config.interval
        while not self._stop.wait(interval):
            try:
                self._expire()
                self.trigger()
            except Exception:       # the coordinator must outlive one bad checkpoint
                log.exception("pyflowbuf: checkpoint coordinator")

    # ---- triggering ----
    def trigger(self, savepoint: str | None = None, stop: bool = False, drain: bool = False) -> int | None:
        """Start the next checkpoint; None when one is still pending (one at a
        time, Flink's default) or every subtask has finished. ``savepoint``: a
        directory for a savepoint instead (aligned, self-contained, never
        pruned); ``stop``: the job ends once that savepoint completed, and
        nothing flows after its barrier; ``drain``: the sources send the end
        of event time before it."""
        with self._lock:
            execution, epoch = self.execution, self._epoch
            if execution is None or self.pending or self._stop.is_set():
                return None
            running = self.task_keys - set(self.finished)
            if not running:
                return None
            n = self._next_id
            self._next_id += 1
            p = self.pending[n] = _Pending(n, time.time(), time.monotonic_ns(), set(self.task_keys),
                                           trigger_at_ns=time.time_ns())
            p.storage = self.storage
            if savepoint is not None:
                # a savepoint is aligned whatever the checkpoints are: its state
                # holds no in-flight data, so it restores into any graph
                p.storage = SavepointStorage(savepoint, allow_pickle=self.storage.allow_pickle,
                                             checkpoint_id=n)
                p.savepoint, p.stop, p.kind = True, stop, "savepoint"
                self._savepoints[n] = p
            elif self.config.starts_unaligned:
                p.alignment = "unaligned"
            elif self.config.switchable:
                p.timer = threading.Timer(self.config.alignment_timeout, self._switch, (n,))
                p.timer.daemon = True
            finished = dict(self.finished)
        for key, (state, commits, summary) in finished.items():
            self._write_final(p, key, state, commits, summary)
        options = {"aligned": True, "stop": stop, "drain": drain, "path": p.storage.url} if p.savepoint else None
        if not self._tell(execution, epoch, "trigger_sources", n, options):
            with self._lock:        # (a restart's abort_all has usually taken it already)
                stale = self.pending.pop(n, None)
            if stale is not None:
                self._drop(stale, "its attempt was stopped (a restart) before it was triggered")
            return None
        if p.timer is not None:
            p.timer.start()
        return n

    def _switch(self, checkpoint_id) -> None:
        """The alignment timeout passed with checkpoint n still pending: every
        subtask takes it unaligned from here on (Flink's aligned checkpoint
        timeout)."""
        with self._lock:
            p = self.pending.get(checkpoint_id)
            execution, epoch = self.execution, self._epoch
            if p is None or execution is None:
                return
            p.alignment = "switched"
        log.info("pyflowbuf: checkpoint %d switched to unaligned after %.3g s of alignment",
                 checkpoint_id, self.config.alignment_timeout)
        self._tell(execution, epoch, "switch_to_unaligned", checkpoint_id)

    def _write_final(self, p: _Pending, key, state, commits, summary=None) -> None:
        try:
            handle = p.storage.write_task_state(p.checkpoint_id, key, state)
        except Exception as exc:
            self.decline(key, p.checkpoint_id, f"writing the final state of {key}: {exc}")
            return
        self.acknowledge(key, p.checkpoint_id, handle, 0.0, commits, summary)

    def _expire(self) -> None:
        timeout_ns = self.config.timeout * 1e9
        now = time.monotonic_ns()
        with self._lock:
            late = [n for n, p in self.pending.items() if now - p.trigger_ns > timeout_ns]
        for n in late:
            self.abort(n, f"checkpoint {n} did not complete within checkpoint_timeout="
                          f"{self.config.timeout} s", status="expired")

    # ---- from subtasks ----
    def acknowledge(self, task_key, checkpoint_id, handle, alignment_ms, commits, summary=None) -> None:
        with self._lock:
            p = self.pending.get(checkpoint_id)
            if p is None or task_key not in p.expected:
                return          # aborted meanwhile: its directory is gone or going
            p.handles[task_key] = handle
            p.acked_at_ns[task_key] = time.time_ns()
            if summary is not None and "phases" in summary:
                p.phases[task_key] = summary.pop("phases")
            p.summaries[task_key] = summary
            p.alignment_ms[task_key] = alignment_ms
            p.commits.extend(commits)
            if set(p.handles) < p.expected:
                return
            del self.pending[checkpoint_id]
            epoch = self._epoch
        if p.timer is not None:
            p.timer.cancel()
        self._complete(p, epoch)

    def decline(self, task_key, checkpoint_id, reason) -> None:
        self.abort(checkpoint_id, f"task {task_key} declined: {reason}")

    def task_finished(self, task_key, state, commits, snapshotted: int = 0, summary=None) -> None:
        """A subtask ended its input: its final state stands for it from now on,
        also in checkpoints it has not snapshotted. Those it has snapshotted
        (ids up to ``snapshotted``) get its own write, which may still be on
        its way: writing the final state there too would race it for the file.
        ``state`` is in the stored layout already; ``summary`` describes it."""
        with self._lock:
            self.finished[task_key] = (state, list(commits), summary)
            waiting = [p for p in self.pending.values()
                       if task_key not in p.handles and p.checkpoint_id > snapshotted]
        for p in waiting:
            self._write_final(p, task_key, state, commits, summary)

    # ---- completing ----
    def _complete(self, p: _Pending, epoch: int) -> None:
        # Under _calls: an attach (a restart detaching the stopped attempt)
        # waits until this completion is on disk and told, or comes first
        # and this checkpoint of the stopped attempt is dropped.
        with self._calls:
            if epoch != self._epoch:
                self._drop(p, "its attempt was stopped (a restart) before it completed")
                return
            self._complete_now(p)

    def _drop(self, p: _Pending, reason) -> None:
        log.info("pyflowbuf: checkpoint %d aborted: %s", p.checkpoint_id, reason)
        try:
            p.storage.abort(p.checkpoint_id)
        except Exception:
            pass
        self._record(p, "aborted", (time.monotonic_ns() - p.trigger_ns) / 1e9, reason=reason)

    def _complete_now(self, p: _Pending) -> None:
        started = time.time_ns()
        duration = (time.monotonic_ns() - p.trigger_ns) / 1e9
        properties = {"job": self.job_name, "kind": p.kind, "alignment_ms": p.alignment_ms,
                      "mode": self.config.mode, "alignment": p.alignment, "commits": p.commits,
                      "savepoint": p.savepoint}
        if self.fingerprint is not None:
            properties["fingerprint"] = self.fingerprint
        properties.update(metadata_properties(p.summaries, self.config.max_parallelism))
        try:
            refs = self._references(p)
            if refs:
                properties["references"] = refs
            meta = p.storage.complete(p.checkpoint_id, list(p.handles.values()), trigger_time=p.trigger_time,
                                      duration=duration, properties=properties)
            written = time.time_ns()
        except Exception as exc:
            log.warning("pyflowbuf: completing checkpoint %d failed: %s", p.checkpoint_id, exc)
            self._record(p, "failed", duration, reason=str(exc))
            try:
                p.storage.abort(p.checkpoint_id)
            except Exception:
                pass
            return
        run_commits(p.commits, self.outputs)
        if not p.savepoint:
            self._remember_files(meta)
        with self._lock:
            self.completed += 1
        p.completion = (started, written, time.time_ns())
        self._record(p, "completed", duration, state_bytes=meta.state_bytes, size=meta.size,
                     inflight_bytes=meta.inflight_bytes,
                     task_inflight_bytes={k: h.inflight_bytes for k, h in meta.tasks.items() if h.inflight_bytes},
                     outcome=meta)
        execution = self.execution       # _calls held: the attempt it completed for
        if execution is not None:
            execution.notify_complete(p.checkpoint_id)
            if p.stop:
                # stop-with-savepoint: the sources stopped at its barrier and
                # its commits are done; the job ends here, nothing after it
                execution.stop_after_savepoint(p.checkpoint_id)

    def _references(self, p: _Pending) -> list:
        """The files of earlier checkpoints that checkpoint ``p``'s incremental
        task states refer to (``pyflowbuf.checkpoint.shared``)."""
        out = []
        for key, s in sorted(p.summaries.items()):
            for cid in (s or {}).get("refs", ()):
                ref = self._files.get((cid, key))
                if ref is None or p.savepoint:
                    raise CheckpointStateError(
                        f"task {key} refers to checkpoint {cid}, which is not a complete checkpoint of this job")
                out.append(ref)
        return out

    def _remember_files(self, meta) -> None:
        for key, h in meta.tasks.items():
            self._files[(meta.checkpoint_id, key)] = {"checkpoint": meta.checkpoint_id, "task": key,
                                                      "file": h.file, "size": h.size, "alignment": h.alignment}
        # (a reference reaches back at most INCREMENTAL_MAX_AGE checkpoints)
        oldest = meta.checkpoint_id - 2 * INCREMENTAL_MAX_AGE - 2
        for k in [k for k in self._files if k[0] < oldest]:
            del self._files[k]

    def abort(self, checkpoint_id, reason, status="aborted") -> None:
        with self._lock:
            p = self.pending.pop(checkpoint_id, None)
            execution, epoch = self.execution, self._epoch
        if p is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        log.info("pyflowbuf: checkpoint %d %s: %s", checkpoint_id, status, reason)
        try:
            p.storage.abort(checkpoint_id)
        except Exception:
            pass
        self._record(p, status, (time.monotonic_ns() - p.trigger_ns) / 1e9, reason=reason)
        if execution is not None:
            self._tell(execution, epoch, "abort_checkpoint", checkpoint_id)

    def abort_all(self, reason) -> None:
        with self._lock:
            ids = list(self.pending)
        for n in ids:
            self.abort(n, reason)

    def finish_job(self) -> None:
        """The job ended without failure: sinks commit their final output."""
        self.stop()
        with self._lock:
            commits = [c for _, cs, _ in self.finished.values() for c in cs]
        run_commits(commits, self.outputs)

    def _record(self, p: _Pending, status, duration, outcome=None, **extra) -> None:
        subtasks, phases = checkpoint_phases(p, p.completion)
        entry = {"id": p.checkpoint_id, "kind": p.kind, "status": status, "trigger_time": p.trigger_time,
                 "duration_s": round(duration, 6), "alignment": p.alignment,
                 "alignment_ms": dict(p.alignment_ms), "acknowledged": len(p.handles),
                 "tasks": len(p.expected), "savepoint": p.savepoint, "subtasks": subtasks,
                 "phases": phases, **extra}
        if p.savepoint:
            entry["path"] = p.storage.url
        with self._lock:
            self.history.append(entry)
            if len(self.history) > 1000:
                del self.history[:100]
        publish_checkpoint(self.listeners, entry)
        # a savepoint's caller waits for this; its entry is in the history by now
        p.outcome = (status, outcome if outcome is not None else extra.get("reason", status))
        p.done.set()

    def checkpoints(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self.history]


# ---------------------------------------------------------------- sink commits

def run_commits(commits, outputs) -> None:
    """Carry out the sink commits the driver runs (``connectors/outputs.py``:
    the final committables of ended sink subtasks, and the renames an older
    checkpoint lists, all checked before any runs)."""
    outputs_mod.run_commits(commits, outputs)


def check_rewindable(config: CheckpointSettings, name, source) -> None:
    """Exactly-once recovery replays the sources from their recorded positions."""
    if config.mode == "exactly_once" and not source.rewindable:
        why = source.not_rewindable_because     # a source that explains itself
        if why is not None:
            raise errors.ConfigurationError(why)
        raise errors.ConfigurationError(
            f"source {name!r} cannot rewind (a plain iterator or generator), so a "
            "recovery could not replay it and exactly-once checkpoints are impossible: pass a "
            "collection, a function returning a fresh iterable (from_generator), a file or a "
            "sequence, or Environment(checkpointing_mode='at_least_once')")
