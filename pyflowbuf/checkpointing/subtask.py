"""What checkpoints do in a subtask's thread: barriers in (alignment and
what it decides), barriers out, triggers at sources, the mails of the
coordinator, and the start after a restore (in-flight data replayed, a task
that had ended ending again). Snapshots are taken and written by
``pyflowbuf.checkpointing.coordinator.TaskCheckpointing`` (``checkpointing``)."""
from __future__ import annotations

import time

from pyflowbuf import errors
from pyflowbuf._core.events import BARRIER, BARRIER_STOP, BARRIER_UNALIGNED, CANCEL_BARRIER
from pyflowbuf.checkpoint.alignment import (CAPTURE, INFLIGHT_DONE, SNAPSHOT, SNAPSHOT_UNALIGNED,
                                         BarrierAligner)
from pyflowbuf.checkpoint.errors import CheckpointStateError
from pyflowbuf.checkpointing.restore import summary_of
from pyflowbuf.serializers import get_serializer


def _no_op(key):
    pass


def _parse_channel(name):
    """'in/<input>/<channel>', 'out/<output>/<subpartition>', or 'key/<input>'
    (records redistributed by key group: ``pyflowbuf.checkpointing.inflight_rescale``)."""
    where, *rest = name.split("/")
    if where == "key":
        return where, int(rest[0]), -1
    return where, int(rest[0]), int(rest[1])


class SubtaskCheckpoints:
    """The checkpoint side of one subtask, run in its thread.

    ``checkpointing`` (a ``TaskCheckpointing``, set by the job when
    checkpoints are on) snapshots and writes; ``aligner`` (a
    ``BarrierAligner`` over the input channels, keyed (input index,
    channel)) decides when, and this object carries its decisions out.
    ``ended()`` says whether the subtask has ended (mails that come after
    are ignored).

    Stop-with-savepoint: its barrier carries ``BARRIER_STOP``, from the
    sources (``trigger`` with ``stop``) to the sinks. A task that sent it
    sends nothing more: ``stopping`` holds its id and the ``mailbox`` is
    frozen, so the source reads no more, an input task reads no more input,
    and no timer or watermark mail runs, until the job ends or the savepoint
    is aborted (then the task thaws and goes on where it was).
    """

    def __init__(self, job, name: str, operators: list, sides: list, outputs: list, ended, mailbox=None):
        self.job = job
        self.name = name
        self.operators = operators
        self.sides = sides
        self.outputs = outputs
        self.ended = ended
        self.checkpointing = None
        self.aligner = None
        self.last_checkpoint = 0
        self.last_alignment_ms = 0.0
        self.mailbox = mailbox
        self.stopping = None        # the id of the stop-with-savepoint this task sent the barrier of
        self._stop_barriers: set = set()    # ids of stop barriers that came in, not yet sent on
        self.drained = None         # the id of the stop-with-savepoint (drain) this source ended event time for
        self._ended: set = set()
        self._overtook = 0
        self._event_key = None
        self._event_prefix = None   # what the reader held of the barrier's channel at the snapshot
        self._switching = False     # in switch_to_unaligned: the alignment so far counts

    def _broadcast(self, kind, aux, flags=0, priority=False):
        for out in self.outputs:
            out.broadcast_event(kind, aux, flags, priority)

    # ---- barriers in ----
    def arm(self) -> None:
        """The barrier aligner over the input channels. At-least-once counts
        barriers and never blocks."""
        sides = self.sides
        if not sides:
            return
        keys = [(i, ch) for i, side in enumerate(sides) for ch in range(side.num_channels)]
        if self.checkpointing.coordinator.config.mode == "at_least_once":
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
                self.checkpointing.snapshot_and_write(n, al_ns, al.started_ns if al is not None else 0)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
                self._send_barrier(n, 0, False)
            elif action == SNAPSHOT_UNALIGNED:
                n, keys = arg
                self._snapshot_unaligned(n, keys)
            elif action == CAPTURE:
                n, key = arg
                side, ch = self.sides[key[0]], key[1]
                items = side.reader.stop_recording(ch) if side.reader is not None else []
                k = self._overtook if key == self._event_key else 0
                if k > 0:
                    items = items + side.gate.channels[ch].copy_front(k)
                if key == self._event_key and self._event_prefix is not None:
                    # the rest of the buffer the reader was in when the barrier
                    # overtook it: before the barrier, after the snapshot
                    items = [self._event_prefix] + items
                    self._event_prefix = None
                self.checkpointing.input_captured(n, f"in/{key[0]}/{ch}", items)
            elif action == INFLIGHT_DONE:
                n = arg
                al_ns = self.aligner.alignment_ns.get(n, 0)
                self.checkpointing.inputs_done(n, al_ns)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
            else:   # ABORT: downstream tasks stop aligning it too
                n = arg
                self._stop_barriers.discard(n)
                self._stop_recording()
                self.checkpointing.drop(n)
                self._broadcast(CANCEL_BARRIER, n)

    def _snapshot_unaligned(self, n, keys):
        """Snapshot now and forward barrier n ahead of the queued output; the
        channels in ``keys`` (barrier n not there yet) are recorded from now
        on, starting with what the readers hold of them."""
        if any(self.sides[key[0]].reader is not None and self.sides[key[0]].reader.replaying for key in keys):
            # An input still reads the in-flight data of the checkpoint it was
            # restored from (a barrier came on another input first): what is
            # left of it would be in neither this snapshot's state nor its
            # in-flight data, so this checkpoint is declined (the next one
            # comes once it is read) and the consumers stop aligning it.
            ckpt = self.checkpointing
            ckpt.coordinator.decline(ckpt.key, n, "an input was still replaying restored in-flight data")
            self._broadcast(CANCEL_BARRIER, n)
            return
        inputs = {}
        event_key = self._event_key
        if event_key is not None and event_key not in keys:
            # the barrier's own channel: the reader may be in the middle of a
            # buffer of it (an overtaking barrier is taken between batches),
            # and what is left of that buffer came before the barrier
            reader = self.sides[event_key[0]].reader
            self._event_prefix = reader.unread_prefix(event_key[1]) if reader is not None else None
        for key in keys:
            side, ch = self.sides[key[0]], key[1]
            prefix = side.reader.unread_prefix(ch)
            inputs[f"in/{key[0]}/{ch}"] = [prefix] if prefix is not None else []
            side.reader.start_recording(ch)
        started = self.aligner.started_ns if self.aligner is not None else 0
        aligned_ns = time.monotonic_ns() - started if self._switching and started else 0
        self.checkpointing.snapshot_unaligned(n, inputs, "unaligned", started, aligned_ns)
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

    def _stop_recording(self):
        for side in self.sides:
            r = side.reader
            if r is not None:
                for ch in range(side.num_channels):
                    if r.is_recording(ch):
                        r.stop_recording(ch)

    def input_finished(self) -> None:
        """End of input: the final state goes to the coordinator."""
        if self.checkpointing is not None:
            if self.aligner is not None:
                self.check_channel_ends()
            self.checkpointing.finished()

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
        if self.checkpointing.coordinator.config.starts_unaligned and not options.get("aligned"):
            self.checkpointing.snapshot_unaligned(checkpoint_id, {}, "unaligned", now)
            self._send_barrier(checkpoint_id, BARRIER_UNALIGNED, True)
        else:
            self.checkpointing.snapshot_and_write(checkpoint_id, 0, now)
            self._send_barrier(checkpoint_id, 0, False)
        self.last_checkpoint, self.last_alignment_ms = checkpoint_id, 0.0

    def will_trigger(self) -> bool:
        """Whether a trigger mail takes a checkpoint now."""
        return self.checkpointing is not None and not self.ended() and not self.job.cancelled

    def switch_to_unaligned(self, checkpoint_id: int) -> None:
        """Mail: the alignment timeout of checkpoint n passed. Aligning it
        here: snapshot now, unaligned. Barrier n already sent: an overtaking
        copy follows it."""
        if self.checkpointing is None or self.ended() or self.job.cancelled:
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
        if self.checkpointing is not None:
            self.checkpointing.confirm(checkpoint_id)    # incremental: what later checkpoints may refer to
        for op in self.operators:
            op.notify_checkpoint_complete(checkpoint_id)

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
        """After a restore from an unaligned checkpoint: in-flight input is read
        again before anything new from the gate (each input's replayed items
        first, from every channel), in-flight output is sent again before any
        new record. Items of a channel go back into that channel; records
        redistributed by key group (``key/<input>``: whole records, no events)
        go through channel 0 of their input, ahead of everything else there."""
        inflight = restore["inflight"]
        in_kinds = restore.get("input_kinds") or []
        out_kinds = restore.get("output_kinds") or []
        sides = self.sides
        replays = {}
        for name in sorted(inflight, key=_parse_channel):
            where, a, b = _parse_channel(name)
            items = inflight[name]
            if where == "key":
                if a >= len(sides):
                    raise errors.ConfigurationError(
                        f"in-flight data redistributed to input {a} does not fit this task ({len(sides)} inputs)")
                # before this input's own channels' items (it has none: its whole edge moved)
                replays.setdefault(a, [])[:0] = [(0, item) for item in items]
            elif where == "in":
                if a >= len(sides) or b >= sides[a].num_channels:
                    raise errors.ConfigurationError(
                        f"in-flight data for input channel {name} does not fit this job: restoring "
                        "an unaligned checkpoint into another parallelism is not supported")
                replays.setdefault(a, []).extend((b, item) for item in items)
            else:
                if a >= len(self.outputs) or b >= len(self.outputs[a].queues):
                    raise errors.ConfigurationError(
                        f"in-flight data for output {name} does not fit this job: restoring "
                        "an unaligned checkpoint into another parallelism is not supported")
                self.outputs[a].replay(b, items, out_kinds[a] if a < len(out_kinds) else None)
        for a, pairs in replays.items():
            side = sides[a]
            kind = in_kinds[a] if a < len(in_kinds) else None
            if kind is not None and side.kind is None:
                side._configure(get_serializer(kind))
            side.reader.replay(pairs)

    def finish_restored(self, restore) -> None:
        """A task restored as finished: its final state is back, its output was
        consumed before the checkpoint; it tells its consumers it has ended."""
        stored = restore.get("stored")
        ckpt = self.checkpointing
        if stored is not None:
            ckpt.coordinator.task_finished(ckpt.key, stored, [], 0, summary_of(stored))
        else:       # a checkpoint written before operator ids: its raw states, in chain order
            legacy = {k: v for k, v in restore.items() if k not in ("inflight", "stored")}
            stored, summary = ckpt.stored(dict(legacy, finished=True))
            ckpt.coordinator.task_finished(ckpt.key, stored, [], 0, summary)
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
