"""A subtask: one thread running a mailbox loop over its chain of operators.

Processing input is the default action; control messages (cancel, flush,
user callables) arrive as mails and are handled between batches. A task with
several inputs (union, connect) reads a MultiInput and hands each batch, and
each event, to its chain with the index of the input it came from. Time is
accounted as Flink does: idle = waiting for input, backpressured = waiting for
an output buffer, busy = the rest.

A chain that carries timestamps (an operator of it, or an input, is
timestamped: ``Node.timestamped``) runs the ``_ts`` variants of the batch
paths, which hand each operator the batch's times beside it
(``Operator.process_ts``); any other chain runs the plain ones and pays
nothing for timestamps.
"""
from __future__ import annotations

import collections
import threading
import time
from array import array as _array

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.events import BARRIER, BARRIER_UNALIGNED, CANCEL_BARRIER, EVT_WATERMARK
from pyflowbuf.runtime.alignment import (CAPTURE, INFLIGHT_DONE, SNAPSHOT, SNAPSHOT_UNALIGNED,
                                         BarrierAligner)
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error
from pyflowbuf.runtime.exchange import MultiInput
from pyflowbuf.runtime.pull import PullPolicy
from pyflowbuf.runtime.restore import summary_of
from pyflowbuf.runtime.side_outputs import SideOutputs
from pyflowbuf.runtime import watermarks as _wm
from pyflowbuf.runtime.watermarks import END_OF_TIME, NO_WATERMARK
from pyflowbuf.runtime.sources import payload_nbytes


def _no_op(key):
    pass


def _joined_ts(ts, n, op, more):
    """The times of ``n`` records (``ts``) followed by ``more``, which ``op``
    made outside of a batch (fired windows and timers, its end) with their
    times in ``op.fired_ts``; None where the operator's output carries none."""
    if not getattr(op, "timestamped", False):
        return None
    fired = op.fired_ts
    op.fired_ts = None
    if fired is None or len(fired) != len(more):
        raise errors.FlowBufError(
            f"operator {op.name!r} emitted {len(more)} record(s) without their timestamps on a stream "
            "that carries them")
    if not n:
        return fired if isinstance(fired, _array) else _array("d", fired)
    if ts is None:
        return None
    out = _array("d", ts)
    out.extend(fired)
    return out


def _parse_channel(name):
    """'in/<input>/<channel>' or 'out/<output>/<subpartition>'."""
    where, a, b = name.split("/")
    return where, int(a), int(b)


class _SourceCheck:
    """Checks the records of a source whose first operator is chained."""

    def __init__(self, node):
        self.node = node
        self.kind = None
        self.find = None

    def __call__(self, batch):
        if self.find is None:
            if not batch:
                return
            kind = self.node.kind if self.node.kind is not None else infer_kind(batch[0])
            self.kind = kind if isinstance(kind, np.dtype) else get_serializer(kind)
            self.find = misfit_finder(self.kind) or (lambda records: -1)
        i = self.find(batch)
        if i >= 0:
            raise record_type_error(self.kind, batch[i], operator=self.node.name)


class Subtask(threading.Thread):
    def __init__(self, job, vertex, index: int, operators: list, outputs: list,
                 source=None, input_side=None, rate_limiter=None):
        name = f"{vertex.name} ({index + 1}/{vertex.parallelism})"
        super().__init__(name=f"pyflowbuf: {name}", daemon=True)
        self.job = job
        self.vertex = vertex
        self.index = index
        self.task_name = name
        self.operators = operators
        self.outputs = outputs
        self.source = source
        self.input = input_side
        # the InputSide of each input, by input index (one for a plain input)
        self._sides = ([] if input_side is None else
                       list(input_side.sides) if isinstance(input_side, MultiInput) else [input_side])
        self.rate_limiter = rate_limiter
        self.mailbox: collections.deque = collections.deque()
        self.current_operator = vertex.head.name
        self.records_in = 0
        self.bytes_in_source = 0
        self.source_idle_ns = 0
        self.pull_policy = None
        # checkpoints (set by the job when they are on): the task's side of
        # them, its barrier aligner, and the state to start from after a restore
        self.checkpointing = None
        self.aligner = None
        self.restore = None
        self.last_checkpoint = 0
        self.last_alignment_ms = 0.0
        self.pulls = 0
        self.started_ns = 0
        self.finished_ns = 0
        self.state = "CREATED"
        # Every output carries barriers, watermarks and the end of input; the
        # chain's records go to the main ones, side records (ctx.output) to
        # the outputs of their operator's tags (_route_side_outputs).
        self.main_outputs = [o for o in outputs if o.tag is None]
        self._side_routes = self._route_side_outputs(vertex, operators, outputs)
        # The writer checks every record it serializes: the operator feeding
        # it need not check again, and the writer's errors name that operator.
        producer = operators[-1] if operators else None
        if producer is not None and self.main_outputs:
            producer.check_output = False
        for out in self.main_outputs:
            out.producer = producer.name if producer is not None else vertex.head.name
        # Source records handed to a chained operator are never serialized:
        # check them here, against the source's kind, as a writer would.
        self._source_misfit = None if source is None or not operators else _SourceCheck(vertex.head)
        if self._source_misfit is not None and outputs and all(
                getattr(op, "passes_records", False) for op in operators):
            # an assigner at the source hands its records to the writers as
            # they came, and a writer checks each one: the source's check
            # would be paid twice (the writer's errors name the source)
            self._source_misfit = None
            for out in self.main_outputs:
                out.producer = vertex.head.name
        # decided once: does this chain carry timestamps?
        self.timestamped = (any(getattr(op, "timestamped", False) for op in operators)
                            or any(getattr(side, "timestamped", False) for side in self._sides))
        if self.timestamped:
            self._process = self._process_ts
            self._process_input = self._process_input_ts
            self._watermark_through = self._watermark_through_ts
        # An unbounded source that waits for input (a socket, a watched
        # directory) wakes up for a mail or a cancel instead of polling
        self._source_wakeup = getattr(source, "wakeup", None)

    @staticmethod
    def _route_side_outputs(vertex, operators, outputs) -> list:
        """Give each operator whose node declares side outputs its
        ``SideOutputs``; the routes [(buffer, [outputs])] of the tags some
        stream reads, which ``_ship_side_outputs`` empties."""
        nodes = {n.id: n for n in getattr(vertex, "nodes", ())}
        routes: list = []
        for op in operators:
            node = nodes.get(getattr(op, "node_id", None))
            tags = getattr(node, "side_tags", None)
            if not tags:
                continue
            table = {}
            for name, tag in tags.items():
                outs = [o for o in outputs if o.tag == name and o.source_node == node.id]
                buf = [] if outs else None
                table[name] = (tag, buf)
                if outs:
                    routes.append((buf, outs))
                    for o in outs:
                        o.producer = f"{op.name} (side output {name!r})"
            op.side = SideOutputs(op.name, table)
        return routes

    def _ship_side_outputs(self) -> None:
        """Side records collected since the last call, to their outputs: after
        each batch, watermark and timer, so they precede any barrier."""
        for buf, outs in self._side_routes:
            if buf:
                batch = buf[:]
                buf.clear()
                for out in outs:
                    out.emit(batch)

    # ---- mailbox ----
    notifier = None         # set when tasks wait for output buffers (unaligned checkpoints)
    bp_wait_ns = 0

    def post(self, mail) -> None:
        """Run ``mail()`` in this task's thread between batches."""
        self.mailbox.append(mail)
        if self.input is not None:
            self.input.notifier.notify()
        elif self.notifier is not None:
            self.notifier.notify()
        if self._source_wakeup is not None:
            self._source_wakeup()

    def _output_blocked(self) -> bool:
        """Unaligned checkpoints: whether an output has no buffer to give now.
        The task then waits here, between batches, instead of inside a write,
        so mails (a checkpoint trigger) and overtaking barriers get through
        under backpressure, as Flink's mailbox does."""
        if self.notifier is None:
            return False
        for out in self.outputs:
            if not out.pool.available:
                return True
        return False

    def _wait_for_output(self) -> None:
        """Park until an output buffer is free, a mail comes, or an overtaking
        barrier arrives (each wakes the task's Notifier), then take those
        barriers. After a while without a buffer, ship the partly filled ones:
        the consumer may be waiting for exactly those."""
        notifier = self.notifier
        token = notifier.prepare()
        if self.mailbox or not self._output_blocked() or self._take_priority_events():
            notifier.cancel()
            return
        t0 = time.monotonic_ns()
        woke = notifier.wait(token, 0.05)
        self.bp_wait_ns += time.monotonic_ns() - t0
        if not woke and self._output_blocked():
            for out in self.outputs:
                out.flush()
        self._take_priority_events()

    def _take_priority_events(self) -> bool:
        sides = self._sides
        took = False
        for i, side in enumerate(sides):
            if side.reader is None or side.has_event:
                continue
            ev = side.reader.poll_priority()
            if ev is not None:
                took = True
                self._on_event(ev, i)
        return took

    def _drain_mailbox(self):
        mb = self.mailbox
        while mb:
            mb.popleft()()

    # ---- the loop ----
    def run(self):
        self.started_ns = time.monotonic_ns()
        self.state = "RUNNING"
        try:
            restore = self.restore
            if restore is not None:
                for op, state in zip(self.operators, restore["operators"]):
                    self.current_operator = op.name
                    op.restore_state(state)
            for op in self.operators:
                self.current_operator = op.name
                op.task = self      # event-time operators post mails and emit through it
                op.open(self.index, self.vertex.parallelism)
            if self.checkpointing is not None:
                self._arm_alignment()
            if restore is not None and restore.get("inflight"):
                self._replay_inflight(restore)
            finished_before = restore is not None and restore["finished"]
            if finished_before:
                # it had ended before the checkpoint: nothing more comes from it
                self._finish_restored()
            elif self.source is not None:
                self._run_source()
            elif isinstance(self.input, MultiInput):
                self._run_multi_input()
            else:
                self._run_input()
            if not self.job.cancelled:
                if not finished_before:
                    self._finish()
                self.state = "FINISHED"
            else:
                self.state = "CANCELED"
        except BaseException as exc:  # noqa: BLE001 - every failure fails the job
            cancelled = self.job.cancelled and isinstance(exc, errors.CancelledError)
            self.state = "CANCELED" if cancelled else "FAILED"
            self.job.task_failed(self, exc)
        finally:
            self.finished_ns = time.monotonic_ns()
            if self.source is not None:
                try:
                    self.source.close()
                except Exception:
                    pass

    def _process(self, batch: list, ts=None) -> None:
        for op in self.operators:
            self.current_operator = op.name
            batch = op.process_batch(batch)
            if not batch:
                break
        else:
            for out in self.main_outputs:
                out.emit(batch)
        if self._side_routes:
            self._ship_side_outputs()

    def _process_ts(self, batch: list, ts=None) -> None:
        """``_process`` of a chain that carries timestamps: ``ts`` (the batch's
        times, an array('d'), or None before an assigner) goes along."""
        for op in self.operators:
            self.current_operator = op.name
            batch, ts = op.process_ts(batch, ts)
            if not batch:
                break
            if not op.timestamped:
                ts = None       # its output carries none, chained or not
        else:
            for out in self.main_outputs:
                out.emit(batch, ts)
        if self._side_routes:
            self._ship_side_outputs()

    def _process_input(self, batch: list, input_index: int, ts=None) -> None:
        """``_process`` for a task with several inputs: the head operator learns
        which input the batch came from; the operators chained after it do not."""
        ops = self.operators
        head = ops[0]
        self.current_operator = head.name
        batch = head.process_input(batch, input_index)
        if batch:
            for op in ops[1:]:
                self.current_operator = op.name
                batch = op.process_batch(batch)
                if not batch:
                    break
            else:
                for out in self.main_outputs:
                    out.emit(batch)
        if self._side_routes:
            self._ship_side_outputs()

    def _process_input_ts(self, batch: list, input_index: int, ts=None) -> None:
        ops = self.operators
        head = ops[0]
        self.current_operator = head.name
        batch, ts = head.process_input_ts(batch, ts, input_index)
        if batch:
            if not head.timestamped:
                ts = None
            for op in ops[1:]:
                self.current_operator = op.name
                batch, ts = op.process_ts(batch, ts)
                if not batch:
                    break
                if not op.timestamped:
                    ts = None
            else:
                for out in self.main_outputs:
                    out.emit(batch, ts)
        if self._side_routes:
            self._ship_side_outputs()

    def _flush_if_due(self, now_ns: int) -> None:
        if now_ns >= self._next_flush:
            for out in self.outputs:
                out.flush()
            self._next_flush = now_ns + self._timeout_ns

    def _run_source(self):
        job, src, limiter = self.job, self.source, self.rate_limiter
        outputs = self.outputs
        self.current_operator = self.vertex.head.name
        src.open(self.index, self.vertex.parallelism)
        if self.restore is not None and self.restore.get("source") is not None:
            src.seek(self.restore["source"])
        self._timeout_ns = int(job.env.buffer_timeout * 1e9)
        self._next_flush = time.monotonic_ns() + self._timeout_ns
        # buffer_timeout == 0: Flink's "flush after every record"
        flush_every_record = job.env.buffer_timeout == 0
        policy = self.pull_policy = PullPolicy(
            1 if flush_every_record else job.env.max_batch, 4 * job.env.segment_size, limiter=limiter)
        count_bytes = limiter is not None and limiter.counts_bytes
        bytes_before = 0
        while not job.cancelled:
            if self.mailbox:
                self._drain_mailbox()
            if self.stopping is not None:
                # stop-with-savepoint: nothing after its barrier, until the
                # job ends (or the savepoint fails and reading goes on)
                self._wait_stopped()
                continue
            if self.notifier is not None and self._output_blocked():
                self._wait_for_output()
                # under backpressure pull what one buffer holds, so a trigger
                # waits for at most one buffer's worth of writing
                if policy.bytes_per_record:
                    policy.size = max(1, min(policy.size, int(job.env.segment_size // policy.bytes_per_record)))
                continue
            self.current_operator = self.vertex.head.name
            if policy.slow:
                # the source may block for a while: ship what is buffered first
                # (Flink's OutputFlusher would, on the buffer timeout)
                for out in outputs:
                    out.flush()
            t0 = time.monotonic_ns()
            batch = src.next_batch(policy.size)
            pulled_ns = time.monotonic_ns() - t0
            if batch is None:
                break
            if not batch:
                # an unbounded source waited (a bounded time) and nothing
                # came: ship what is buffered, then see to the mailbox
                self.source_idle_ns += pulled_ns
                for out in outputs:
                    out.flush()
                self._next_flush = time.monotonic_ns() + self._timeout_ns
                continue
            self.pulls += 1
            if self._source_misfit is not None:
                self._source_misfit(batch)
            if limiter is not None:
                t0 = time.monotonic_ns()
                limiter.acquire(len(batch), payload_nbytes(batch) if count_bytes else 0)
                self.source_idle_ns += time.monotonic_ns() - t0
            self.records_in += len(batch)
            self._process(batch)
            if flush_every_record:
                for out in outputs:
                    out.flush()
            else:
                self._flush_if_due(time.monotonic_ns())
            written = sum(o.bytes for o in outputs)
            policy.observe(len(batch), pulled_ns, written - bytes_before)
            bytes_before = written

    def _loop_settings(self):
        """Start the buffer-timeout clock of an input loop; (flush per record,
        records per read, seconds of an idle read)."""
        env = self.job.env
        self._timeout_ns = int(env.buffer_timeout * 1e9)
        self._next_flush = time.monotonic_ns() + self._timeout_ns
        return env.buffer_timeout == 0, env.max_batch, max(env.buffer_timeout, 0.05)

    def _run_input(self):
        job, inp = self.job, self.input
        per_record, max_batch, idle_wait = self._loop_settings()
        while not job.cancelled:
            if self.mailbox:
                self._drain_mailbox()
            if self.notifier is not None and self._output_blocked():
                self._wait_for_output()
                continue
            # An event that ended the idle read below is still pending: reading
            # again would go past it (and a second event would replace it, so
            # a barrier got lost and its alignment hung until end of input).
            batch = [] if inp.has_event else inp.read(max_batch, 0)
            if self.aligner is not None:
                self._check_channel_ends()
            if not batch:
                event = inp.take_event()
                if event is not None:
                    self._on_event(event)
                    continue
                if inp.finished:
                    return
                # about to idle: ship what is buffered first (Flink flushes too)
                for out in self.outputs:
                    out.flush()
                self._next_flush = time.monotonic_ns() + self._timeout_ns
                batch = inp.read(max_batch, idle_wait)
                if not batch:
                    continue
            self.records_in += len(batch)
            if per_record:
                ts = inp.ts if self.timestamped else None
                for i, rec in enumerate(batch):
                    if ts is None:
                        self._process([rec])
                    else:
                        self._process([rec], ts[i:i + 1])
                    for out in self.outputs:
                        out.flush()
            else:
                if self.timestamped:
                    self._process(batch, inp.ts)
                else:
                    self._process(batch)
                self._flush_if_due(time.monotonic_ns())

    def _run_multi_input(self):
        """``_run_input`` over several inputs: the same loop, each batch and
        each event tagged with its input index. A separate loop, so that a
        task with one input pays nothing for the index."""
        job, inp = self.job, self.input
        per_record, max_batch, idle_wait = self._loop_settings()
        while not job.cancelled:
            if self.mailbox:
                self._drain_mailbox()
            if self.notifier is not None and self._output_blocked():
                self._wait_for_output()
                continue
            index, batch = inp.read(max_batch, 0)
            if self.aligner is not None:
                self._check_channel_ends()
            if not batch:
                got = inp.take_event()
                if got is not None:
                    self._on_event(got[1], got[0])
                    continue
                if inp.finished:
                    return
                for out in self.outputs:
                    out.flush()
                self._next_flush = time.monotonic_ns() + self._timeout_ns
                index, batch = inp.read(max_batch, idle_wait)
                if not batch:
                    continue
            self.records_in += len(batch)
            if per_record:
                ts = inp.sides[index].ts if self.timestamped else None
                for i, rec in enumerate(batch):
                    if ts is None:
                        self._process_input([rec], index)
                    else:
                        self._process_input([rec], index, ts[i:i + 1])
                    for out in self.outputs:
                        out.flush()
            else:
                if self.timestamped:
                    self._process_input(batch, index, inp.sides[index].ts)
                else:
                    self._process_input(batch, index)
                self._flush_if_due(time.monotonic_ns())

    def _on_event(self, event, input_index: int = 0):
        """Events other than end-of-partition (barriers arrive here), with the
        index of the input that delivered them: ``event`` is (channel, kind,
        aux, flags), channel counted within that input's gate."""
        kind = event[1]
        if (kind == BARRIER or kind == CANCEL_BARRIER) and self.aligner is not None:
            self._check_channel_ends()
            key = self._event_key = (input_index, event[0])
            if kind == BARRIER:
                unaligned = bool(event[3] & BARRIER_UNALIGNED)
                if unaligned:
                    # how many queued items it overtook (the reader stopped
                    # right at it, so the queue's head is where it was)
                    side = self._sides[input_index]
                    self._overtook = side.gate.channels[event[0]].overtaken(side.reader.event_mark)
                self._carry_out(self.aligner.on_barrier(key, event[2], unaligned))
                self._overtook = 0
            else:
                self._carry_out(self.aligner.on_cancel(key, event[2]))
            return
        if kind == EVT_WATERMARK:
            self._on_watermark_event(event, input_index)
            return
        handler = self.job.event_handler
        if handler is not None:
            handler(self, event, input_index)

    def _finish(self):
        if self._event_time_job():
            # end of input: every window fires, every event-time timer too
            self._watermark_through(END_OF_TIME, 0)
        tail: list = []
        if not self.timestamped:
            for op in self.operators:
                self.current_operator = op.name
                if tail:
                    tail = op.process_batch(tail)
                tail = tail + op.finish()
            if tail:
                for out in self.main_outputs:
                    out.emit(tail)
        else:
            ts = None
            for op in self.operators:
                self.current_operator = op.name
                if tail:
                    tail, ts = op.process_ts(tail, ts)
                    if not op.timestamped:
                        ts = None
                more = op.finish()
                if more:
                    tail, ts = tail + more, _joined_ts(ts, len(tail), op, more)
            if tail:
                for out in self.main_outputs:
                    out.emit(tail, ts)
        if self._side_routes:
            self._ship_side_outputs()
        if self.checkpointing is not None:
            if self.aligner is not None:
                self._check_channel_ends()
            self.checkpointing.finished()
        for out in self.outputs:
            out.end_input()

    # ---- checkpoints ----
    def _arm_alignment(self):
        """The barrier aligner over this task's input channels, keyed
        (input index, channel). At-least-once counts barriers and never blocks."""
        sides = self._sides
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

    def _check_channel_ends(self):
        """Channels that ended since the last look leave the alignment (an
        end-of-partition is consumed inside the reader, never an event)."""
        al = self.aligner
        for key in list(al.live):
            if key not in self._ended and self._sides[key[0]].channel_finished(key[1]):
                self._ended.add(key)
                self._carry_out(al.on_channel_finished(key))

    _overtook = 0
    _event_key = None

    def _carry_out(self, actions):
        for action, arg in actions:
            if action == SNAPSHOT:
                n = arg
                al_ns = self.aligner.alignment_ns.get(n, 0) if self.aligner is not None else 0
                self.checkpointing.snapshot_and_write(n, al_ns)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
                self._broadcast(BARRIER, n)
            elif action == SNAPSHOT_UNALIGNED:
                n, keys = arg
                self._snapshot_unaligned(n, keys)
            elif action == CAPTURE:
                n, key = arg
                side, ch = self._sides[key[0]], key[1]
                items = side.reader.stop_recording(ch) if side.reader is not None else []
                k = self._overtook if key == self._event_key else 0
                if k > 0:
                    items = items + side.gate.channels[ch].copy_front(k)
                self.checkpointing.input_captured(n, f"in/{key[0]}/{ch}", items)
            elif action == INFLIGHT_DONE:
                n = arg
                al_ns = self.aligner.alignment_ns.get(n, 0)
                self.checkpointing.inputs_done(n, al_ns)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
            else:   # ABORT: downstream tasks stop aligning it too
                n = arg
                self._stop_recording()
                self.checkpointing.drop(n)
                self._broadcast(CANCEL_BARRIER, n)

    def _snapshot_unaligned(self, n, keys):
        """Snapshot now and forward barrier n ahead of the queued output; the
        channels in ``keys`` (barrier n not there yet) are recorded from now
        on, starting with what the readers hold of them."""
        inputs = {}
        for key in keys:
            side, ch = self._sides[key[0]], key[1]
            prefix = side.reader.unread_prefix(ch)
            inputs[f"in/{key[0]}/{ch}"] = [prefix] if prefix is not None else []
            side.reader.start_recording(ch)
        self.checkpointing.snapshot_unaligned(n, inputs, "unaligned")
        self._broadcast(BARRIER, n, BARRIER_UNALIGNED, True)

    def _stop_recording(self):
        for side in self._sides:
            r = side.reader
            if r is not None:
                for ch in range(side.num_channels):
                    if r.is_recording(ch):
                        r.stop_recording(ch)

    def _broadcast(self, kind, aux, flags=0, priority=False):
        for out in self.outputs:
            out.broadcast_event(kind, aux, flags, priority)

    stopping = None         # the id of the stop-with-savepoint this source stopped at

    def _wait_stopped(self):
        for out in self.outputs:
            out.flush()
        time.sleep(0.01)

    def trigger_checkpoint(self, checkpoint_id: int, options=None) -> None:
        """Mail to a source subtask: snapshot, then barrier n on every output,
        in order with the records written before it (unaligned: ahead of
        what is queued, which the checkpoint then holds as in-flight data).
        ``options`` (savepoints): ``aligned`` forces an aligned barrier,
        ``stop`` stops reading after it (stop-with-savepoint)."""
        if self.checkpointing is None or self.finished_ns or self.job.cancelled:
            return
        options = options or {}
        if options.get("stop"):
            self.stopping = checkpoint_id
        if self.checkpointing.coordinator.config.starts_unaligned and not options.get("aligned"):
            self.checkpointing.snapshot_unaligned(checkpoint_id, {}, "unaligned")
            self._broadcast(BARRIER, checkpoint_id, BARRIER_UNALIGNED, True)
        else:
            self.checkpointing.snapshot_and_write(checkpoint_id)
            self._broadcast(BARRIER, checkpoint_id)
        self.last_checkpoint, self.last_alignment_ms = checkpoint_id, 0.0

    def switch_to_unaligned(self, checkpoint_id: int) -> None:
        """Mail: the alignment timeout of checkpoint n passed. Aligning it
        here: snapshot now, unaligned. Barrier n already sent: an overtaking
        copy follows it."""
        if self.checkpointing is None or self.finished_ns or self.job.cancelled:
            return
        if self.aligner is not None:
            self._carry_out(self.aligner.switch(checkpoint_id))
        for out in self.outputs:
            out.convert_barrier(checkpoint_id)

    def input_kind_names(self) -> list:
        return [side.kind_name for side in self._sides]

    def _replay_inflight(self, restore):
        """After a restore from an unaligned checkpoint: in-flight input is read
        again before anything new (per channel, in order), in-flight output is
        sent again before any new record."""
        inflight = restore["inflight"]
        in_kinds = restore.get("input_kinds") or []
        out_kinds = restore.get("output_kinds") or []
        sides = self._sides
        replays = {}
        for name in sorted(inflight, key=_parse_channel):
            where, a, b = _parse_channel(name)
            items = inflight[name]
            if where == "in":
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

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Mail: checkpoint n is complete (its sink commits were carried out)."""
        if self.checkpointing is not None:
            self.checkpointing.confirm(checkpoint_id)
        for op in self.operators:
            op.notify_checkpoint_complete(checkpoint_id)

    def abort_checkpoint(self, checkpoint_id: int) -> None:
        """Mail: the coordinator gave up checkpoint n (timeout, a decline)."""
        if self.stopping == checkpoint_id:
            self.stopping = None        # the stop failed: the source reads on
        if self.aligner is not None:
            self._carry_out(self.aligner.abort(checkpoint_id))

    def _finish_restored(self):
        """A task restored as finished: its final state is back, its output was
        consumed before the checkpoint; it tells its consumers it has ended."""
        stored = self.restore.get("stored")
        if stored is not None:
            self.checkpointing.coordinator.task_finished(self.checkpointing.key, stored, [], 0,
                                                         summary_of(stored))
        else:       # a checkpoint written before operator ids: its raw states, in chain order
            legacy = {k: v for k, v in self.restore.items() if k not in ("inflight", "stored")}
            stored, summary = self.checkpointing.stored(dict(legacy, finished=True))
            self.checkpointing.coordinator.task_finished(self.checkpointing.key, stored, [], 0, summary)
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
        for side in self._sides:
            while not job.cancelled and not (side.finished and not side.has_event):
                batch = side.read(1024, 0.05)      # (bounded: a cancel is seen)
                if batch:
                    raise errors.FlowBufError(
                        f"task {self.name!r} was restored as finished, yet an input sent it {len(batch)} "
                        "record(s): the checkpoint's states do not fit together")
                side.take_event()       # only its producers' ends can come (no barrier: they ended)

    def cancel(self):
        for out in self.outputs:
            out.cancel()
        if self.input is not None:
            self.input.cancel()
        if self.rate_limiter is not None:
            self.rate_limiter.cancel()
        if self._source_wakeup is not None:
            self._source_wakeup()

    # ---- counters for metrics ----
    def counters(self) -> dict:
        inp = self.input
        idle = self.source_idle_ns + (inp.idle_ns if inp is not None else 0)
        if self.finished_ns:
            # a task that has ended is idle from then on, not busy
            idle += time.monotonic_ns() - self.finished_ns
        return {
            "idle_ns": idle,
            "backpressure_ns": sum(o.backpressure_ns for o in self.outputs) + self.bp_wait_ns,
            "records_in": self.records_in,
            "records_out": sum(o.records for o in self.outputs),
            "bytes_in": inp.bytes_in if inp is not None else 0,
            "bytes_out": sum(o.bytes for o in self.outputs),
            # buffers shipped: with bytes_out it shows a per-record flush at once
            "buffers_out": sum(o.writer.buffers_out for o in self.outputs if o.writer is not None),
            # buffers that came over TCP from another worker (0 with every producer local)
            "remote_buffers_in": sum(ch.buffers_received for side in getattr(inp, "sides", (inp,))
                                     for ch in getattr(side, "remote_channels", ())),
            "last_checkpoint": self.last_checkpoint,
            "checkpoint_alignment_ms": self.last_alignment_ms,
            "in_pool_usage": inp.in_pool_usage if inp is not None else 0.0,
            "out_pool_usage": max((o.pool.usage for o in self.outputs), default=0.0),
            # buffer debloating, per input gate (None when it is off)
            "debloat": getattr(self, "debloat_gates", None),
        }

    def debloat_tick(self, gates) -> None:
        """Mail (buffer debloating): measure each input gate over the last
        period, announce new buffer sizes upstream, keep the figures for
        ``counters``. ``gates``: this task's GateDebloats (runtime/debloat.py)."""
        for g in gates:
            g.tick()
        self.debloat_gates = [g.snapshot for g in gates]

    # ---- event time (pyflowbuf.runtime.watermarks) ----
    _valve = None
    _wm_out = NO_WATERMARK      # the last watermark this task sent downstream
    _idle_out = False

    def _event_time_job(self) -> bool:
        """Whether any operator of the job keeps event time: only then does a
        task send watermarks (and +inf at its end)."""
        job = self.job
        flag = getattr(job, "_event_time", None)
        if flag is None:
            flag = job._event_time = any(getattr(n, "event_time", False) for n in job.env.nodes)
        return flag

    def _on_watermark_event(self, event, input_index):
        """A watermark (or idle marker) from one input channel: the valve
        combines the channels, and a rise goes through the chain."""
        valve = self._valve
        sides = self._sides
        if valve is None:
            valve = self._valve = _wm.WatermarkValve(
                (i, ch) for i, side in enumerate(sides) for ch in range(side.num_channels))
        # channels that ended count as +inf (a task restored as finished sends none)
        for key, w in valve.channel_wm.items():
            if w != END_OF_TIME and sides[key[0]].channel_finished(key[1]):
                valve.on_channel_finished(key)
        key = (input_index, event[0])
        wm = _wm.decode(event[2])
        risen = valve.on_idle(key) if wm is None else valve.on_watermark(key, wm)
        if valve.idle:
            if not self._idle_out:
                self._idle_out = True
                self._broadcast(EVT_WATERMARK, _wm.IDLE_AUX)
            return
        if risen is not None:
            self._watermark_through(risen, 0, force=self._idle_out)
        elif self._idle_out:
            self._watermark_through(valve.current, 0, force=True)

    def _watermark_through(self, wm, start, force=False):
        """Watermark ``wm`` through the operators from index ``start`` on: each
        event-time operator fires what it completes (its records go through
        the rest of the chain) and may hold the watermark back; then what is
        left goes to the outputs, the watermark after the records."""
        ops = self.operators
        batch: list = []
        for k in range(start, len(ops)):
            op = ops[k]
            self.current_operator = op.name
            if batch:
                batch = op.process_batch(batch)
            if wm is not None:
                handler = getattr(op, "on_watermark", None)
                if handler is not None:
                    more, wm = handler(wm)
                    if more:
                        batch = batch + more if batch else more
        if batch:
            for out in self.main_outputs:
                out.emit(batch)
        if self._side_routes:
            self._ship_side_outputs()
        if wm is not None and (wm > self._wm_out or force):
            self._wm_out = max(wm, self._wm_out)
            self._idle_out = False
            self._broadcast(EVT_WATERMARK, _wm.encode(self._wm_out))

    def _watermark_through_ts(self, wm, start, force=False):
        """``_watermark_through`` of a chain that carries timestamps: what an
        operator fires comes with its times (``op.fired_ts``)."""
        ops = self.operators
        batch: list = []
        ts = None
        for k in range(start, len(ops)):
            op = ops[k]
            self.current_operator = op.name
            if batch:
                batch, ts = op.process_ts(batch, ts)
                if not op.timestamped:
                    ts = None
            if wm is not None:
                handler = getattr(op, "on_watermark", None)
                if handler is not None:
                    more, wm = handler(wm)
                    if more:
                        batch, ts = batch + more, _joined_ts(ts, len(batch), op, more)
        if batch:
            for out in self.main_outputs:
                out.emit(batch, ts)
        if self._side_routes:
            self._ship_side_outputs()
        if wm is not None and (wm > self._wm_out or force):
            self._wm_out = max(wm, self._wm_out)
            self._idle_out = False
            self._broadcast(EVT_WATERMARK, _wm.encode(self._wm_out))

    def emit_watermark_after(self, op, wm, force=False):
        """Operator ``op`` of this chain made watermark ``wm`` (an assigner)."""
        self._watermark_through(wm, self.operators.index(op) + 1, force=force)

    def emit_idle_after(self, op):
        """Operator ``op`` (an assigner) saw no records for its idle timeout."""
        if not self._idle_out:
            self._idle_out = True
            self._broadcast(EVT_WATERMARK, _wm.IDLE_AUX)

    def emit_after(self, op, records):
        """Records an operator made outside of a batch (a processing-time
        timer): through the operators after it, then to the outputs; and the
        side records it made meanwhile."""
        ops = self.operators
        if records and self.timestamped:
            ts = _joined_ts(None, 0, op, records)
            for nxt in ops[ops.index(op) + 1:]:
                self.current_operator = nxt.name
                records, ts = nxt.process_ts(records, ts)
                if not records:
                    break
                if not nxt.timestamped:
                    ts = None
            else:
                for out in self.main_outputs:
                    out.emit(records, ts)
        elif records:
            for nxt in ops[ops.index(op) + 1:]:
                self.current_operator = nxt.name
                records = nxt.process_batch(records)
                if not records:
                    break
            else:
                for out in self.main_outputs:
                    out.emit(records)
        if self._side_routes:
            self._ship_side_outputs()

    def operator_metrics(self) -> dict:
        """Counters of the chain's operators (late records of windows), summed."""
        out: dict = {}
        for op in self.operators:
            m = getattr(op, "metrics", None)
            if m is not None:
                for k, v in m().items():
                    out[k] = out.get(k, 0) + v
        return out
