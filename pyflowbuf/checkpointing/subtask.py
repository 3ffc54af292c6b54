"""A subtask's side of checkpoints, in its thread: barriers in (alignment and
what it decides), snapshots of its chain (written in the background and
acknowledged to the coordinator), barriers out, triggers at sources, the
mails of the coordinator, and the start after a restore (in-flight data
replayed, a task that had ended ending again). One ``SubtaskCheckpoints`` per
subtask (``Subtask.checkpoints``); its in-flight data is captured and
replayed by ``pyflowbuf.checkpointing.inflight``."""
from __future__ import annotations

import logging
import time

from pyflowbuf import errors
from pyflowbuf._core.events import BARRIER, BARRIER_STOP, BARRIER_UNALIGNED, CANCEL_BARRIER
from pyflowbuf.checkpoint.alignment import (CAPTURE, INFLIGHT_DONE, SNAPSHOT, SNAPSHOT_UNALIGNED,
                                         BarrierAligner)
from pyflowbuf.checkpoint.errors import CheckpointStateError
from pyflowbuf.checkpoint.keygroups import GroupChain, key_group_range
from pyflowbuf.checkpoint.storage import SavepointStorage, UnsupportedStateError
from pyflowbuf.checkpointing import inflight
from pyflowbuf.checkpointing.phases import phases_of, start_phases
from pyflowbuf.checkpointing.restore import stored_state, summary_of, task_key

log = logging.getLogger("pyflowbuf.checkpoint")


def _no_op(key):
    pass


class SubtaskCheckpoints:
    """The checkpoint side of one subtask.

    Made with the subtask (``task``: its vertex, index, operators, outputs,
    source and job; ``sides``: the InputSide of each input, by input index);
    ``attach(coordinator, writer)`` turns it on when the job checkpoints.
    ``aligner`` (a ``BarrierAligner`` over the input channels, keyed (input
    index, channel), made by ``arm``) decides when to snapshot, and this
    object carries its decisions out: it copies the chain's state in the
    task's thread and has ``writer`` (a ``SnapshotWriter``) write it and
    acknowledge it. A checkpoint that may hold in-flight data (unaligned, or
    aligned with an alignment timeout and outputs read by another process) is
    written once that data is complete (``inflight.InflightCapture``).

    Stop-with-savepoint: its barrier carries ``BARRIER_STOP``, from the
    sources (``trigger`` with ``stop``) to the sinks. A task that sent it
    sends nothing more: ``stopping`` holds its id and the ``mailbox`` is
    frozen, so the source reads no more, an input task reads no more input,
    and no timer or watermark mail runs, until the job ends or the savepoint
    is aborted (then the task thaws and goes on where it was).
    """

    def __init__(self, task, sides: list, mailbox=None):
        self.task = task
        self.job = getattr(task, "job", None)
        self.name = getattr(task, "name", "")
        self.operators = task.operators
        self.sides = sides
        self.outputs = task.outputs
        self.mailbox = mailbox
        self.key = task_key(task.vertex, task.index)
        self.coordinator = None     # set by attach: checkpoints are on
        self.writer = None
        self.aligner = None
        self.last_checkpoint = 0
        self.last_alignment_ms = 0.0
        self.snapshotted = 0        # the last checkpoint id this task snapshotted
        self.stopping = None        # the id of the stop-with-savepoint this task sent the barrier of
        self._stop_barriers: set = set()    # ids of stop barriers that came in, not yet sent on
        self.drained = None         # the id of the stop-with-savepoint (drain) this source ended event time for
        self._ended: set = set()
        self._overtook = 0
        self._event_key = None
        self._event_prefix = None   # what the reader held of the barrier's channel at the snapshot
        self._switching = False     # in switch_to_unaligned: the alignment so far counts
        self._captures = inflight.Captures()    # checkpoints whose write waits for in-flight data
        self.remote_outputs: list = []
        self.edges = None
        # incremental checkpoints: operator index -> its GroupChain (keyed operators that record
        # the keys they change; the others are written whole every time)
        self.chains: dict = {}

    def attach(self, coordinator, writer) -> None:
        """Checkpoints are on: ``coordinator`` (the job's, or a worker's proxy of
        it) gets the acknowledgements, ``writer`` writes the snapshots."""
        self.coordinator, self.writer = coordinator, writer
        task = self.task
        # outputs read by another process: what a barrier overtakes there comes from the network sender
        self.remote_outputs = inflight.remote_outputs(self.outputs)
        for o, out in enumerate(self.outputs):
            out.overtaken_listener = lambda n, sub, items, o=o: self.output_overtaken(n, f"out/{o}/{sub}", items)
        # the edges of its inputs and outputs, recorded with in-flight data: a
        # restore into a changed job moves it by key group on keyed edges
        self.edges = inflight.edge_descriptions(getattr(self.job, "edges", None), task.vertex)
        config = coordinator.config
        if getattr(config, "incremental", False):
            start, end = key_group_range(config.max_parallelism, task.vertex.parallelism, task.index)
            for i, op in enumerate(self.operators):
                if op.keyed_state and op.tracks_changes:
                    op.touched = set()
                    self.chains[i] = GroupChain(config.max_parallelism, start, end)

    def ended(self) -> bool:
        """Whether the subtask has ended (mails that come after are ignored)."""
        return bool(self.task.finished_ns)

    def _broadcast(self, kind, aux, flags=0, priority=False):
        for out in self.outputs:
            out.broadcast_event(kind, aux, flags, priority)

    # ---- barriers in ----
    def arm(self) -> None:
        """The barrier aligner over the input channels (checkpoints on). At-least-once
        counts barriers and never blocks."""
        sides = self.sides
        if not sides or self.coordinator is None:
            return
        keys = [(i, ch) for i, side in enumerate(sides) for ch in range(side.num_channels)]
        if self.coordinator.config.mode == "at_least_once":
            block = resume = _no_op
        else:
            def block(key):
                sides[key[0]].block(key[1])

            def resume(key):
                sides[key[0]].resume(key[1])
        self._ended = set()
        self.aligner = BarrierAligner(keys, block, resume)

    def check_channel_ends(self) -> None:
        """Channels that ended since the last look leave the alignment (an
        end-of-partition is consumed inside the reader, never an event)."""
        al = self.aligner
        for key in list(al.live):
            if key not in self._ended and self.sides[key[0]].channel_finished(key[1]):
                self._ended.add(key)
                self.carry_out(al.on_channel_finished(key))

    def on_barrier(self, event, input_index: int) -> None:
        """A barrier or cancel-barrier from a channel of input ``input_index``:
        ``event`` is (channel, kind, checkpoint id, flags)."""
        self.check_channel_ends()
        key = self._event_key = (input_index, event[0])
        if event[1] == BARRIER:
            if event[3] & BARRIER_STOP:
                self._stop_barriers.add(event[2])
            unaligned = bool(event[3] & BARRIER_UNALIGNED)
            if unaligned:
                # how many queued items it overtook (the reader stopped
                # right at it, so the queue's head is where it was)
                side = self.sides[input_index]
                self._overtook = side.gate.channels[event[0]].overtaken(side.reader.event_mark)
            try:
                self.carry_out(self.aligner.on_barrier(key, event[2], unaligned))
            finally:
                self._overtook = 0
                self._event_key = self._event_prefix = None
        else:
            self.carry_out(self.aligner.on_cancel(key, event[2]))

    def carry_out(self, actions) -> None:
        for action, arg in actions:
            if action == SNAPSHOT:
                n = arg
                al = self.aligner
                al_ns = al.alignment_ns.get(n, 0) if al is not None else 0
                self.snapshot_and_write(n, al_ns, al.started_ns if al is not None else 0)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
                self._send_barrier(n, 0, False)
            elif action == SNAPSHOT_UNALIGNED:
                n, keys = arg
                self._snapshot_overtaking(n, keys)
            elif action == CAPTURE:
                n, key = arg
                own = key == self._event_key
                prefix = self._event_prefix if own else None
                if own:
                    self._event_prefix = None
                items = inflight.recorded(self.sides[key[0]], key[1], self._overtook if own else 0, prefix)
                self._captures.input(n, inflight.input_channel(*key), items)
            elif action == INFLIGHT_DONE:
                n = arg
                al_ns = self.aligner.alignment_ns.get(n, 0)
                self.inputs_done(n, al_ns)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
            else:   # ABORT: downstream tasks stop aligning it too
                n = arg
                self._stop_barriers.discard(n)
                inflight.stop_recording(self.sides)
                self._captures.drop(n)
                self._broadcast(CANCEL_BARRIER, n)

    def _snapshot_overtaking(self, n, keys):
        """An overtaking barrier n: snapshot now and forward it ahead of the
        queued output; the channels in ``keys`` (barrier n not there yet) are
        recorded from now on, starting with what the readers hold of them."""
        if inflight.any_replaying(self.sides, keys):
            # An input still reads the in-flight data of the checkpoint it was
            # restored from (a barrier came on another input first): what is
            # left of it would be in neither this snapshot's state nor its
            # in-flight data, so this checkpoint is declined (the next one
            # comes once it is read) and the consumers stop aligning it.
            self.coordinator.decline(self.key, n, "an input was still replaying restored in-flight data")
            self._broadcast(CANCEL_BARRIER, n)
            return
        event_key = self._event_key
        if event_key is not None and event_key not in keys:
            # the barrier's own channel: the reader may be in the middle of a
            # buffer of it (an overtaking barrier is taken between batches),
            # and what is left of that buffer came before the barrier
            reader = self.sides[event_key[0]].reader
            self._event_prefix = reader.unread_prefix(event_key[1]) if reader is not None else None
        inputs = inflight.start_recording(self.sides, keys)
        started = self.aligner.started_ns if self.aligner is not None else 0
        aligned_ns = time.monotonic_ns() - started if self._switching and started else 0
        self.snapshot_unaligned(n, inputs, "unaligned", started, aligned_ns)
        self._send_barrier(n, BARRIER_UNALIGNED, True)

    def _send_barrier(self, n, flags, priority) -> None:
        """Barrier n on every output; a stop barrier freezes the task after it."""
        stop = n in self._stop_barriers
        if stop:
            self._stop_barriers.discard(n)
            flags |= BARRIER_STOP
        self._broadcast(BARRIER, n, flags, priority)
        if stop:
            self._freeze(n)

    def _freeze(self, n) -> None:
        self.stopping = n
        if self.mailbox is not None:
            self.mailbox.frozen = True

    def _thaw(self, n) -> None:
        self._stop_barriers.discard(n)
        if self.stopping == n:
            self.stopping = None
            if self.mailbox is not None:
                self.mailbox.frozen = False

    def input_finished(self) -> None:
        """End of input: the final state (no record will change it any more)
        goes to the coordinator."""
        if self.coordinator is None:
            return
        if self.aligner is not None:
            self.check_channel_ends()
        state, commits = self.snapshot(-1)
        state["finished"] = True
        state, summary = self.stored(state)
        summary["inflight"] = False
        self.coordinator.task_finished(self.key, state, commits, self.snapshotted, summary)

    # ---- snapshots ----
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
        for i, op in enumerate(self.operators):
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
        """An aligned snapshot, written in the background. ``barrier_ns``,
        ``alignment_ns``: for its phases (``phases.phases_of``)."""
        if self.remote_outputs and self.coordinator.config.switchable:
            # the timeout may still convert barrier n in a network sender: what
            # it overtakes there belongs to this snapshot, so wait for word
            self.snapshot_unaligned(checkpoint_id, {}, "aligned", barrier_ns, alignment_ns)
            self.inputs_done(checkpoint_id, alignment_ns)
            return
        phases = start_phases(self.task.source is not None, barrier_ns, alignment_ns, False)
        t0 = time.monotonic_ns()
        state, commits = self._snapshot_or_decline(checkpoint_id)
        phases["submit_ns"] = t1 = time.monotonic_ns()
        phases["sync_ns"] = t1 - t0
        if not self.writer.submit(self._write, checkpoint_id, state, commits, alignment_ns / 1e6,
                                  None, "aligned", phases):
            self._too_late(checkpoint_id)

    def snapshot_unaligned(self, checkpoint_id: int, inputs: dict, alignment: str,
                           barrier_ns: int = 0, alignment_ns: int = 0) -> None:
        """Snapshot now for a checkpoint whose in-flight data comes later:
        ``inputs`` maps each input channel still to deliver barrier n to what
        the reader held of it (a record cut by the snapshot), in order.
        ``barrier_ns``, ``alignment_ns``: for its phases (``phases.phases_of``)."""
        phases = start_phases(self.task.source is not None, barrier_ns, alignment_ns, alignment == "unaligned")
        t0 = time.monotonic_ns()
        state, commits = self._snapshot_or_decline(checkpoint_id)
        phases["sync_ns"] = time.monotonic_ns() - t0
        state["input_kinds"] = [side.kind_name for side in self.sides]
        state["output_kinds"] = [out.kind_name for out in self.outputs]
        p = inflight.InflightCapture(checkpoint_id, state, commits, alignment, bool(self.sides),
                                     self.remote_outputs, phases)
        for name, items in inputs.items():
            p.add(name, items)
        self._captures.start(p)
        self._submit_if_ready(p)

    def inputs_done(self, checkpoint_id: int, alignment_ns: int) -> None:
        p = self._captures.inputs_done(checkpoint_id, alignment_ns)
        if p is not None:
            self._submit_if_ready(p)

    def output_overtaken(self, checkpoint_id: int, name: str, items) -> None:
        """From a network sender thread: what barrier n overtook in subpartition
        ``name`` (None: an aligned barrier passed, nothing overtaken)."""
        p = self._captures.output(checkpoint_id, name, items)
        if p is not None:
            self._submit_if_ready(p)

    def _submit_if_ready(self, p) -> None:
        if not self._captures.take_if_ready(p):
            return
        data = p.encoded()
        if p.phases is not None:
            p.phases["submit_ns"] = time.monotonic_ns()
        if not self.writer.submit(self._write, p.checkpoint_id, p.state, p.commits, p.alignment_ms,
                                  data, "unaligned" if p.alignment == "unaligned" or data else "aligned",
                                  p.phases):
            self._too_late(p.checkpoint_id)

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

    def _write(self, checkpoint_id, state, commits, alignment_ms, data=None, alignment="aligned",
               phases=None):
        """In a writer thread: the snapshot in the stored layout, written, then
        acknowledged (or declined)."""
        storage = self.coordinator.storage_for(checkpoint_id)
        summary = None
        t0 = time.monotonic_ns()
        try:
            state, summary = self.stored(state)
            t1 = time.monotonic_ns()
            summary["inflight"] = bool(data)
            if data:
                summary["inflight_items"] = sorted(data)
                if self.edges is not None:
                    summary["edges"] = self.edges
            handle = storage.write_task_state(checkpoint_id, self.key, state, data, alignment=alignment)
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
                self.job.task_failed(self.task, exc)
            return
        self.coordinator.acknowledge(self.key, checkpoint_id, handle, alignment_ms, commits, summary)

    # ---- the coordinator's mails ----
    def trigger(self, checkpoint_id: int, options=None) -> None:
        """Mail to a source subtask: snapshot, then barrier n on every output,
        in order with the records written before it (unaligned: ahead of
        what is queued, which the checkpoint then holds as in-flight data).
        ``options`` (savepoints): ``aligned`` forces an aligned barrier,
        ``stop`` makes it a stop barrier: the task sends nothing after it
        (stop-with-savepoint)."""
        if not self.will_trigger():
            return
        options = options or {}
        if options.get("stop"):
            self._stop_barriers.add(checkpoint_id)
        now = time.monotonic_ns()       # the barrier is injected now (its phases start here)
        if self.coordinator.config.starts_unaligned and not options.get("aligned"):
            self.snapshot_unaligned(checkpoint_id, {}, "unaligned", now)
            self._send_barrier(checkpoint_id, BARRIER_UNALIGNED, True)
        else:
            self.snapshot_and_write(checkpoint_id, 0, now)
            self._send_barrier(checkpoint_id, 0, False)
        self.last_checkpoint, self.last_alignment_ms = checkpoint_id, 0.0

    def will_trigger(self) -> bool:
        """Whether a trigger mail takes a checkpoint now."""
        return self.coordinator is not None and not self.ended() and not self.job.cancelled

    def switch_to_unaligned(self, checkpoint_id: int) -> None:
        """Mail: the alignment timeout of checkpoint n passed. Aligning it
        here: snapshot now, unaligned. Barrier n already sent: an overtaking
        copy follows it."""
        if self.coordinator is None or self.ended() or self.job.cancelled:
            return
        if self.aligner is not None:
            self._switching = True
            try:
                self.carry_out(self.aligner.switch(checkpoint_id))
            finally:
                self._switching = False
        for out in self.outputs:
            out.convert_barrier(checkpoint_id)

    def notify_complete(self, checkpoint_id: int) -> None:
        """Mail: checkpoint n is complete (its sink commits were carried out)."""
        if self.coordinator is not None:
            self.confirm(checkpoint_id)    # incremental: what later checkpoints may refer to
        for op in self.operators:
            op.notify_checkpoint_complete(checkpoint_id)

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed (a mail, in the task's thread):
        later incremental checkpoints may refer to the key groups it wrote."""
        for chain in self.chains.values():
            chain.confirm(checkpoint_id)

    def abort(self, checkpoint_id: int) -> None:
        """Mail: the coordinator gave up checkpoint n (timeout, a decline)."""
        self._thaw(checkpoint_id)       # the stop failed: the task goes on
        if self.drained == checkpoint_id and not self.job.cancelled:
            # ... but not with event time ended (every later record would be
            # late): the job fails and restarts from its last checkpoint
            raise CheckpointStateError(
                f"stop-with-savepoint {checkpoint_id} (drain=True) was aborted after task {self.name!r} "
                "had ended event time: the job cannot go on. Restore it from its last checkpoint "
                "(restart_attempts does so by itself), or stop it again")
        if self.aligner is not None:
            self.carry_out(self.aligner.abort(checkpoint_id))

    # ---- after a restore ----
    def replay_inflight(self, restore) -> None:
        """After a restore from an unaligned checkpoint: its in-flight data
        first (``inflight.replay``)."""
        inflight.replay(restore, self.sides, self.outputs)

    def finish_restored(self, restore) -> None:
        """A task restored as finished: its final state is back, its output was
        consumed before the checkpoint; it tells its consumers it has ended."""
        stored = restore.get("stored")
        if stored is not None:
            self.coordinator.task_finished(self.key, stored, [], 0, summary_of(stored))
        else:       # a checkpoint written before operator ids: its raw states, in chain order
            legacy = {k: v for k, v in restore.items() if k not in ("inflight", "stored")}
            stored, summary = self.stored(dict(legacy, finished=True))
            self.coordinator.task_finished(self.key, stored, [], 0, summary)
        for out in self.outputs:
            out.end_input()
        self._drain_restored_inputs()

    def _drain_restored_inputs(self):
        """Read every input of a task restored as finished to its end. It had
        read them to the end before the checkpoint, so its producers were
        finished in it too and, restored so, send their end of partition
        again and nothing else. Reading it matters: a producer in another
        worker waits until its output is consumed, and a consumer whose
        worker closes its connections before reading fails that producer
        ("the consumer closed the connection")."""
        job = self.job
        for side in self.sides:
            while not job.cancelled and not (side.finished and not side.has_event):
                batch = side.read(1024, 0.05)      # (bounded: a cancel is seen)
                if batch:
                    raise errors.FlowBufError(
                        f"task {self.name!r} was restored as finished, yet an input sent it {len(batch)} "
                        "record(s): the checkpoint's states do not fit together")
                side.take_event()       # only its producers' ends can come (no barrier: they ended)
