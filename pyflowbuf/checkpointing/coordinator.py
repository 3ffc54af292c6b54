"""Checkpoints (Flink's asynchronous barrier snapshots): the coordinator, which
runs where the job was started, and each subtask's side of it.

The coordinator triggers checkpoint *n* at every source subtask (a mail in its
mailbox). A source records its position, snapshots its chain's state and emits
barrier *n* on all its outputs, in order with its records. Every other
subtask aligns barrier *n* over its input channels (``alignment``), snapshots
and forwards it. A snapshot is a copy of the state taken in the task's thread;
a background thread writes it to durable storage and acknowledges it. When
every subtask has acknowledged, the coordinator writes the checkpoint's
metadata (only then is it complete), and tells the sinks to commit what the
checkpoint covers. A subtask that finished (end of input) hands the
coordinator its final state, which stands for it in every later checkpoint.

Recovery (``JobExecution``) restores every subtask from the latest complete
checkpoint: sources seek to their recorded positions, operators restore their
state, sinks commit what that checkpoint covered and drop everything written
after it. Records in flight at the failure are re-read from the sources:
exactly-once state and output.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from pyflowbuf import errors
from pyflowbuf.config import DEFAULT_CHECKPOINT_DIR  # noqa: F401 - its old home
from pyflowbuf.checkpoint.storage import (CheckpointStateError, CorruptCheckpointError, IncompatibleCheckpointError,
                                          SavepointStorage, UnsupportedStateError)
from pyflowbuf.checkpoint.inflight import _EVENT_TYPE, _ITEM_HEADER, decode_inflight, encode_inflight  # noqa: F401
from pyflowbuf.checkpoint.keygroups import (DEFAULT_MAX_PARALLELISM, INCREMENTAL_MAX_AGE, GroupChain,
                                         key_group_range)
from pyflowbuf.checkpointing.inflight_rescale import edge_descriptions
from pyflowbuf.checkpointing.restore import metadata_properties, stored_state
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
    phases: dict = field(default_factory=dict)        # task key -> its phases (TaskCheckpointing.phases_of)
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


def _ms(ns) -> float:
    return round(max(0, ns) / 1e6, 3)


_PHASE_MAX = ("alignment_ms", "inflight_wait_ms", "sync_ms", "write_queue_ms", "async_ms", "write_ms")


def checkpoint_phases(p: _Pending, completion=None) -> tuple[dict, dict]:
    """The phases of checkpoint ``p``: per subtask (task key -> figures) and
    for the whole checkpoint (the slowest subtask's figure of each phase,
    then the coordinator's part). Where a subtask's figures are instants
    (its barrier, its acknowledgement) they count from the trigger.
    ``completion``: (the last acknowledgement handled, metadata written,
    commits carried out), wall-clock ns; None for a checkpoint that did not
    complete. A final state written for a subtask that had ended has no
    phases: it is listed with ``finished``."""
    t0 = p.trigger_at_ns
    subtasks: dict = {}
    for key in sorted(p.handles):
        ph = p.phases.get(key)
        acked = p.acked_at_ns.get(key, t0)
        if ph is None:
            subtasks[key] = {"finished": True, "ack_received_ms": _ms(acked - t0)}
            continue
        sub = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ph.items()
               if k not in ("barrier_at_ns", "ack_at_ns")}
        # a source: trigger -> barrier injected (its mail latency); else trigger -> first barrier
        sub["start_delay_ms"] = _ms(ph["barrier_at_ns"] - t0)
        sub["ack_ms"] = _ms(ph["ack_at_ns"] - t0)
        sub["ack_received_ms"] = _ms(acked - t0)
        if completion is not None:
            sub["ack_to_complete_ms"] = _ms(completion[2] - acked)
        subtasks[key] = sub
    measured = [s for s in subtasks.values() if "start_delay_ms" in s]
    phases: dict = {}
    if measured:
        sources = [s["start_delay_ms"] for s in measured if s["source"]]
        phases["trigger_to_source_ms"] = max(sources) if sources else None
        phases["start_delay_ms"] = max(s["start_delay_ms"] for s in measured)
        for k in _PHASE_MAX:
            phases[k] = round(max(s[k] for s in measured), 3)
        phases["bytes"] = sum(s["bytes"] for s in measured)
        phases["inflight_bytes"] = sum(s["inflight_bytes"] for s in measured)
        phases["unaligned_subtasks"] = sum(1 for s in measured if s["unaligned"])
        phases["fsync"] = all(s["fsync"] for s in measured)
    if p.acked_at_ns:
        phases["last_ack_ms"] = _ms(max(p.acked_at_ns.values()) - t0)
    if completion is not None:
        started, written, done = completion
        last = max(p.acked_at_ns.values(), default=started)
        phases["metadata_ms"] = _ms(written - started)
        phases["commits_ms"] = _ms(done - written)
        phases["completion_ms"] = _ms(done - last)
    return subtasks, phases


# ---------------------------------------------------------------- sink commits

def run_commits(commits, outputs) -> None:
    """Carry out sink commit actions (``connectors/outputs.py``: checked against
    the job's part-file sinks, then each rename done where the files are)."""
    outputs_mod.run_commits(commits, outputs)


# ---------------------------------------------------------------- a subtask's side

class _InflightCheckpoint:
    """One checkpoint of a subtask whose write waits for in-flight data: its
    input channels' (until barrier n arrived on each) and, for outputs sent to
    other processes, what barrier n overtook in the network sender."""

    def __init__(self, checkpoint_id, state, commits, alignment, inputs_open, outputs, phases=None):
        self.checkpoint_id = checkpoint_id
        self.phases = phases
        self.state = state
        self.commits = commits
        self.alignment = alignment
        self.channels: dict[str, list] = {}
        self.inputs_open = inputs_open
        self.waiting_outputs = set(outputs)
        self.alignment_ms = 0.0

    def add(self, name, items):
        if items:
            self.channels.setdefault(name, []).extend(items)

    @property
    def ready(self):
        return not self.inputs_open and not self.waiting_outputs


class TaskCheckpointing:
    """What a subtask does for checkpoints: snapshot its chain, write it in the
    background, acknowledge; barrier alignment lives in ``aligner``.

    A checkpoint that may hold in-flight data (unaligned, or aligned with an
    alignment timeout and outputs read by another process) is written once
    that data is complete: see ``_InflightCheckpoint``."""

    def __init__(self, task, coordinator: CheckpointCoordinator, writer: "SnapshotWriter"):
        self.task = task
        self.coordinator = coordinator
        self.writer = writer
        self.key = task_key(task.vertex, task.index)
        self.aligner = None
        self.snapshotted = 0      # the last checkpoint id this task snapshotted
        self._lock = threading.Lock()
        self._inflight: dict[int, _InflightCheckpoint] = {}
        # outputs read by another process: (output index, subpartition) names
        self.remote_outputs = [f"out/{o}/{s}" for o, out in enumerate(task.outputs)
                               for s, remote in enumerate(out.remote) if remote]
        for o, out in enumerate(task.outputs):
            out.overtaken_listener = lambda n, sub, items, o=o: self.output_overtaken(n, f"out/{o}/{sub}", items)
        # the edges of its inputs and outputs, recorded with in-flight data: a
        # restore into a changed job moves it by key group on keyed edges
        self.edges = edge_descriptions(getattr(getattr(task, "job", None), "edges", None), task.vertex)
        # incremental checkpoints: operator index -> its GroupChain (keyed operators that record
        # the keys they change; the others are written whole every time)
        self.chains: dict = {}
        config = coordinator.config
        if getattr(config, "incremental", False):
            start, end = key_group_range(config.max_parallelism, task.vertex.parallelism, task.index)
            for i, op in enumerate(task.operators):
                if op.keyed_state and op.tracks_changes:
                    op.touched = set()
                    self.chains[i] = GroupChain(config.max_parallelism, start, end)

    def _phases(self, barrier_ns: int, alignment_ns: int, unaligned: bool):
        """The phases of one checkpoint at this subtask (see ``phases_of``),
        started: the snapshot is taken next. ``barrier_ns`` (monotonic): when
        the first barrier came (a source: when its trigger mail ran)."""
        return {"source": self.task.source is not None, "unaligned": unaligned,
                "barrier_ns": barrier_ns or time.monotonic_ns(), "alignment_ns": alignment_ns}

    def snapshot_unaligned(self, checkpoint_id: int, inputs: dict, alignment: str,
                           barrier_ns: int = 0, alignment_ns: int = 0) -> None:
        """Snapshot now for a checkpoint whose in-flight data comes later:
        ``inputs`` maps each input channel still to deliver barrier n to what
        the reader held of it (a record cut by the snapshot), in order.
        ``barrier_ns``, ``alignment_ns``: for its phases (``phases_of``)."""
        phases = self._phases(barrier_ns, alignment_ns, alignment == "unaligned")
        t0 = time.monotonic_ns()
        state, commits = self._snapshot_or_decline(checkpoint_id)
        phases["sync_ns"] = time.monotonic_ns() - t0
        state["input_kinds"] = self.task.input_kind_names()
        state["output_kinds"] = [out.kind_name for out in self.task.outputs]
        p = _InflightCheckpoint(checkpoint_id, state, commits, alignment, self.task.input is not None,
                                self.remote_outputs, phases)
        for name, items in inputs.items():
            p.add(name, items)
        with self._lock:
            self._inflight[checkpoint_id] = p
        self._submit_if_ready(p)

    def input_captured(self, checkpoint_id: int, name: str, items) -> None:
        with self._lock:
            p = self._inflight.get(checkpoint_id)
            if p is not None:
                p.add(name, items)

    def inputs_done(self, checkpoint_id: int, alignment_ns: int) -> None:
        with self._lock:
            p = self._inflight.get(checkpoint_id)
            if p is None:
                return
            p.inputs_open = False
            p.alignment_ms = alignment_ns / 1e6
            if p.phases is not None:
                if p.phases["unaligned"]:
                    # first barrier to last: the in-flight input was recorded meanwhile
                    p.phases["inflight_wait_ns"] = alignment_ns
                else:
                    p.phases["alignment_ns"] = alignment_ns
        self._submit_if_ready(p)

    def output_overtaken(self, checkpoint_id: int, name: str, items) -> None:
        """From a network sender thread: what barrier n overtook in subpartition
        ``name`` (None: an aligned barrier passed, nothing overtaken)."""
        with self._lock:
            p = self._inflight.get(checkpoint_id)
            if p is None or name not in p.waiting_outputs:
                return
            p.waiting_outputs.discard(name)
            p.add(name, items)
        self._submit_if_ready(p)

    def drop(self, checkpoint_id: int) -> None:
        with self._lock:
            self._inflight.pop(checkpoint_id, None)

    def _submit_if_ready(self, p: _InflightCheckpoint) -> None:
        with self._lock:
            if not p.ready or self._inflight.get(p.checkpoint_id) is not p:
                return
            del self._inflight[p.checkpoint_id]
            # older ones can no longer complete (one checkpoint at a time)
            for n in [n for n in self._inflight if n < p.checkpoint_id]:
                del self._inflight[n]
        inflight = {name: encode_inflight(items) for name, items in p.channels.items()}
        if p.phases is not None:
            p.phases["submit_ns"] = time.monotonic_ns()
        if not self.writer.submit(self._write, p.checkpoint_id, p.state, p.commits, p.alignment_ms,
                                  inflight, "unaligned" if p.alignment == "unaligned" or inflight else "aligned",
                                  p.phases):
            self._too_late(p.checkpoint_id)

    def snapshot(self, checkpoint_id: int) -> tuple[dict, list]:
        """Copy the chain's state now (in the task's thread): source position,
        operator states, sink transactions to commit with this checkpoint."""
        t = self.task
        commits: list = []
        states = []
        # a savepoint (and the final state, id -1) is whole and leaves the changes
        # recorded since the last checkpoint to the next one
        chains = self.chains if checkpoint_id >= 0 and self.chains and not isinstance(
            self.coordinator.storage_for(checkpoint_id), SavepointStorage) else None
        increments = []
        for i, op in enumerate(t.operators):
            commits.extend(op.prepare_commit(checkpoint_id))
            states.append(op.snapshot_state())
            chain = None if chains is None else chains.get(i)
            if chain is not None:
                written, refs, track = chain.plan(checkpoint_id, op.touched)
                op.touched = set() if track else None
                increments.append((written, refs))
            else:
                increments.append(None)
        state = {"vertex": t.vertex.name, "subtask": t.index, "finished": False,
                 "source": None if t.source is None else t.source.position(),
                 "operators": states}
        if chains is not None:
            state["increments"] = increments
        if t.source is not None:
            state["source_identity"] = t.source.identity()
        return state, commits

    def snapshot_and_write(self, checkpoint_id: int, alignment_ns: int = 0, barrier_ns: int = 0) -> None:
        if self.remote_outputs and self.coordinator.config.switchable:
            # the timeout may still convert barrier n in a network sender: what
            # it overtakes there belongs to this snapshot, so wait for word
            self.snapshot_unaligned(checkpoint_id, {}, "aligned", barrier_ns, alignment_ns)
            with self._lock:
                p = self._inflight.get(checkpoint_id)
                if p is not None:
                    p.alignment_ms = alignment_ns / 1e6
            self.inputs_done(checkpoint_id, alignment_ns)
            return
        phases = self._phases(barrier_ns, alignment_ns, False)
        t0 = time.monotonic_ns()
        state, commits = self._snapshot_or_decline(checkpoint_id)
        phases["submit_ns"] = t1 = time.monotonic_ns()
        phases["sync_ns"] = t1 - t0
        if not self.writer.submit(self._write, checkpoint_id, state, commits, alignment_ns / 1e6,
                                  None, "aligned", phases):
            self._too_late(checkpoint_id)

    def _too_late(self, checkpoint_id: int) -> None:
        """The job stopped its snapshot writer (its tasks ended) before this
        checkpoint's data was complete: it cannot be written any more."""
        log.debug("pyflowbuf: %s: checkpoint %d came after the job stopped writing snapshots",
                  self.key, checkpoint_id)
        self.coordinator.decline(self.key, checkpoint_id, "the job stopped before its snapshot was complete")

    def _snapshot_or_decline(self, checkpoint_id: int):
        self.snapshotted = max(self.snapshotted, checkpoint_id)
        try:
            return self.snapshot(checkpoint_id)
        except Exception as exc:
            self.coordinator.decline(self.key, checkpoint_id, f"snapshot failed: {exc!r}")
            raise

    def stored(self, state):
        """``state`` in the stored layout (per operator id, keyed state per
        key group: ``pyflowbuf.checkpointing.restore``) and its summary."""
        coordinator = self.coordinator
        return stored_state(self.task, state, coordinator.config.max_parallelism,
                            coordinator.storage.allow_pickle)

    def _write(self, checkpoint_id, state, commits, alignment_ms, inflight=None, alignment="aligned",
               phases=None):
        storage = self.coordinator.storage_for(checkpoint_id)
        summary = None
        t0 = time.monotonic_ns()
        try:
            state, summary = self.stored(state)
            t1 = time.monotonic_ns()
            summary["inflight"] = bool(inflight)
            if inflight:
                summary["inflight_items"] = sorted(inflight)
                if self.edges is not None:
                    summary["edges"] = self.edges
            handle = storage.write_task_state(checkpoint_id, self.key, state, inflight, alignment=alignment)
            if phases is not None:
                summary["phases"] = phases_of(phases, t0, t1, time.monotonic_ns(), handle,
                                              getattr(storage, "_fsync", False))
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            # a checkpoint aborted meanwhile (a failure, a restart) is no news
            level = logging.DEBUG if isinstance(exc, CheckpointStateError) else logging.WARNING
            log.log(level, "pyflowbuf: %s could not write checkpoint %d: %s", self.key, checkpoint_id, exc)
            self.coordinator.decline(self.key, checkpoint_id, repr(exc))
            if isinstance(exc, UnsupportedStateError):
                # no checkpoint of this job can ever complete: say so instead of
                # running on unprotected (Flink fails a job whose state cannot be
                # serialized, too)
                self.task.job.task_failed(self.task, exc)
            return
        self.coordinator.acknowledge(self.key, checkpoint_id, handle, alignment_ms, commits, summary)

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed (a mail, in the task's thread):
        later incremental checkpoints may refer to the key groups it wrote."""
        for chain in self.chains.values():
            chain.confirm(checkpoint_id)

    def finished(self) -> None:
        """End of input: the final state (no record will change it any more)."""
        state, commits = self.snapshot(-1)
        state["finished"] = True
        state, summary = self.stored(state)
        summary["inflight"] = False
        self.coordinator.task_finished(self.key, state, commits, self.snapshotted, summary)


# monotonic ns + this = wall-clock ns: the instants of a subtask's phases go
# to the coordinator as wall-clock times, which a worker process on the same
# host shares with the driver (monotonic clocks need not agree across hosts)
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def phases_of(ph: dict, write_ns: int, encoded_ns: int, written_ns: int, handle, fsync: bool) -> dict:
    """What one subtask reports of one checkpoint, in the acknowledgement
    (plain numbers: it crosses to the driver from a worker):
    ``barrier_at_ns`` (wall clock) when its first barrier came (a source:
    its trigger mail ran and it injected the barrier), ``ack_at_ns`` when
    its write was done and it acknowledged; ``alignment_ms`` the first
    barrier to the last, aligned (unaligned: 0, or how long it aligned before
    the alignment timeout switched it), ``inflight_wait_ms`` (unaligned)
    the first barrier to the last while in-flight input was recorded,
    ``sync_ms`` the snapshot in the task's thread, ``write_queue_ms`` the
    wait for a writer thread, ``async_ms`` the write (``encode_ms`` of it
    encoding, ``write_ms`` writing and, ``fsync`` True, syncing),
    ``bytes``/``state_bytes``/``inflight_bytes`` its file."""
    submit = ph.get("submit_ns", write_ns)
    return {"source": ph["source"], "unaligned": ph["unaligned"],
            "barrier_at_ns": ph["barrier_ns"] + _EPOCH_OFFSET_NS,
            "ack_at_ns": written_ns + _EPOCH_OFFSET_NS,
            "alignment_ms": ph["alignment_ns"] / 1e6,
            "inflight_wait_ms": ph.get("inflight_wait_ns", 0) / 1e6,
            "sync_ms": ph.get("sync_ns", 0) / 1e6,
            "write_queue_ms": max(0, write_ns - submit) / 1e6,
            "async_ms": (written_ns - write_ns) / 1e6,
            "encode_ms": (encoded_ns - write_ns) / 1e6,
            "write_ms": (written_ns - encoded_ns) / 1e6,
            "fsync": bool(fsync), "bytes": handle.size, "state_bytes": handle.state_bytes,
            "inflight_bytes": handle.inflight_bytes}


def task_key(vertex, index) -> str:
    """A subtask's name in checkpoints: stable across attempts and processes,
    for the same graph (vertex ids follow the order operators were declared)."""
    return f"v{vertex.id}-{index}"


def restore_id(restore_from) -> int | None:
    """The checkpoint id ``restore_from`` names: an int, or a str of digits
    (``restore_from="15"``, as ``pyflowbuf run --restore 15`` means it); None
    when it names something else. A directory named by digits is ``"./15"``."""
    if isinstance(restore_from, int) and not isinstance(restore_from, bool):
        return restore_from
    if isinstance(restore_from, str) and restore_from.isascii() and restore_from.isdigit():
        return int(restore_from)
    return None


def restore_plan(storage, restore_from, *, verify: bool = True):
    """The CheckpointMetadata to restore from: ``"latest"`` (None when there is
    none yet), a checkpoint id (an int or a str of digits), or a path: a
    ``chk-<id>`` directory, a savepoint, a checkpoint copied elsewhere."""
    if restore_from is None:
        return None
    if restore_from == "latest":
        return latest_checkpoint(storage, verify=verify)
    cid = restore_id(restore_from)
    if cid is not None:
        return storage.load_metadata(cid, verify=verify)
    if not isinstance(restore_from, (str, os.PathLike)) or isinstance(restore_from, bool):
        raise errors.ConfigurationError(
            f"restore_from must be 'latest', a checkpoint id, a chk-<id> directory or a savepoint directory, "
            f"got {restore_from!r}")
    path = os.fspath(restore_from).rstrip("/")
    name = os.path.basename(path)
    if name.startswith("chk-") and name[4:].isdigit():
        cid = int(name[4:])
        if not os.path.dirname(path) or _same_path(storage, path, storage.checkpoint_path(cid)):
            return storage.load_metadata(cid, verify=verify)
    # a savepoint, or a checkpoint directory copied elsewhere: self-contained
    sp = SavepointStorage(path, allow_pickle=storage.allow_pickle)
    return sp.load_metadata(sp.checkpoint_id, verify=verify)


def storage_of(storage, meta):
    """The storage that holds ``meta``'s files: the checkpoint_dir's, or the
    directory of a savepoint (or a copied checkpoint) on its own."""
    if not meta.path or meta.path == storage.fs.unstrip_protocol(storage.checkpoint_path(meta.checkpoint_id)):
        return storage
    return SavepointStorage(meta.path, allow_pickle=storage.allow_pickle, checkpoint_id=meta.checkpoint_id)


def restore_location(storage, meta):
    """What tells a worker process which checkpoint to restore: its id when it
    lies in the checkpoint_dir, else its directory."""
    return meta.checkpoint_id if storage_of(storage, meta) is storage else meta.path


def _same_path(storage, given: str, own: str) -> bool:
    strip = storage.fs._strip_protocol
    a, b = strip(given).rstrip("/"), strip(own).rstrip("/")
    if isinstance(storage.fs, LocalFileSystem):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def latest_checkpoint(storage, *, verify: bool = True, min_id: int = 0):
    """The newest intact complete checkpoint; None when there is none at all
    (a first run, or one that never completed a checkpoint). When complete
    checkpoints exist and every one is damaged: CorruptCheckpointError.
    Starting from scratch then would write again what they committed, so
    it must be asked for (``restore_from=None`` and the sinks' ``mode``).
    ``min_id``: only the checkpoints from that id on."""
    meta = storage.latest(verify=verify, min_id=min_id)
    if meta is not None:
        return meta
    broken = [info for info in storage.scan(verify=verify)
              if info.status == "CORRUPT" and info.checkpoint_id >= min_id]
    if not broken:
        return None
    what = "; ".join(f"chk-{info.checkpoint_id}: {info.error.reason}" for info in broken)
    raise CorruptCheckpointError(
        f"no intact checkpoint in {storage.url}, {len(broken)} damaged ({what}). Restoring none of them and "
        "starting from scratch would write again the output they committed: repair or restore them, or "
        "start from scratch on purpose with execute(restore_from=None) and mode='overwrite' on the file "
        "sinks (or another checkpoint_dir and output path)",
        checkpoint_id=broken[-1].checkpoint_id, path=broken[-1].path)


def restart_point(coordinator, started_from):
    """What a restart after a failure restores: the newest intact checkpoint
    of this run (numbered from ``coordinator.first_id`` on), else what the
    run started from (``started_from``: the restored checkpoint or savepoint,
    None for a fresh start). Never a checkpoint an earlier run of the job
    left in the directory: a run that started fresh (or from a savepoint)
    and failed before its first checkpoint would go on from that run's state."""
    meta = latest_checkpoint(coordinator.storage, verify=False, min_id=coordinator.first_id)
    return meta if meta is not None else started_from


class SnapshotWriter:
    """Writes a job's snapshots in the background, off the tasks' threads and
    several at a time (``threads``: writing is mostly waiting for the disk,
    an fsync above all, and with two threads the subtasks of one checkpoint
    queued behind each other's fsyncs; ``write_queue_ms`` in a checkpoint's
    phases shows that wait). Threads start as work comes. Once shut
    down it takes no more work and says so (``submit`` returns False)
    instead of raising: a network sender thread may report what a barrier
    overtook after the job's tasks have stopped (a failure, a restart, the
    end of input while consumers still drain), and that word belongs to an
    attempt that is over."""

    def __init__(self, threads: int = 8):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pyflowbuf: snapshot writer")
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> bool:
        with self._lock:       # no submit slips in between the check and a shutdown
            if self._closed:
                return False
            self._pool.submit(fn, *args)
            return True

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait)


def new_writer() -> SnapshotWriter:
    return SnapshotWriter()


def read_states(storage, meta, keys=None) -> dict[str, Any]:
    """The task states of a complete checkpoint, by task key: every task's, or
    those of ``keys`` (the tasks of one worker process). A task's in-flight
    data (unaligned checkpoints) comes with its state, under "inflight":
    channel name -> items to replay."""
    out = {}
    for key in meta.tasks:
        if keys is not None and key not in keys:
            continue
        snap = storage.read_task_state(meta.checkpoint_id, key, metadata=meta)
        state = snap.state
        if snap.inflight:
            state = dict(state)
            state["inflight"] = {name: decode_inflight(views) for name, views in snap.inflight.items()}
        out[key] = state
    return out


def graph_task_keys(vertices) -> set:
    """The task keys of a whole job graph (the iterator sink is no task)."""
    return {task_key(v, i) for v in vertices if not v.is_iterator for i in range(v.parallelism)}


def check_graph(meta, keys, url) -> None:
    """Refuse to restore a checkpoint taken of another graph or parallelism."""
    if set(meta.tasks) != set(keys):
        raise errors.ConfigurationError(
            f"checkpoint {meta.checkpoint_id} in {url} was taken of another job graph (tasks "
            f"{sorted(meta.tasks)}, this job has {sorted(keys)}); restoring into a different graph "
            "or parallelism is not supported")


def check_sources(meta, states, sources) -> None:
    """Refuse to restore a source from the position of other input: each
    source (``sources``: task key -> (name, Source), not yet opened) checks
    the identity its checkpointed state recorded. States from before
    identities were recorded are restored as they are."""
    for key, (name, source) in sources.items():
        state = states.get(key)
        if state is None or "source_identity" not in state:
            continue
        try:
            source.check_identity(state["source_identity"], state.get("source"))
        except IncompatibleCheckpointError as exc:
            raise IncompatibleCheckpointError(
                f"checkpoint {meta.checkpoint_id}: source {name!r} ({key}): {exc}", source=name) from None


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
