"""A subtask: one thread running a mailbox loop over its chain of operators.

Processing input is the default action; control messages (cancel, flush,
user callables) arrive as mails and are handled between batches. A task with
several inputs (union, connect) reads a MultiInput and hands each batch, and
each event, to its chain with the index of the input it came from. Time is
accounted as Flink does: idle = waiting for input, backpressured = waiting for
an output buffer, busy = the rest.
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.channel import BARRIER, CANCEL_BARRIER
from pyflowbuf.runtime.alignment import SNAPSHOT, BarrierAligner
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error
from pyflowbuf.runtime.exchange import MultiInput
from pyflowbuf.runtime.pull import PullPolicy
from pyflowbuf.runtime.sources import payload_nbytes


def _no_op(key):
    pass


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
        # The writer checks every record it serializes: the operator feeding
        # it need not check again, and the writer's errors name that operator.
        producer = operators[-1] if operators else None
        if producer is not None and outputs:
            producer.check_output = False
        for out in outputs:
            out.producer = producer.name if producer is not None else vertex.head.name
        # Source records handed to a chained operator are never serialized:
        # check them here, against the source's kind, as a writer would.
        self._source_misfit = None if source is None or not operators else _SourceCheck(vertex.head)

    # ---- mailbox ----
    def post(self, mail) -> None:
        """Run ``mail()`` in this task's thread between batches."""
        self.mailbox.append(mail)
        if self.input is not None:
            self.input.notifier.notify()

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
                op.open(self.index, self.vertex.parallelism)
            if self.checkpointing is not None:
                self._arm_alignment()
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

    def _process(self, batch: list) -> None:
        for op in self.operators:
            self.current_operator = op.name
            batch = op.process_batch(batch)
            if not batch:
                return
        for out in self.outputs:
            out.emit(batch)

    def _process_input(self, batch: list, input_index: int) -> None:
        """``_process`` for a task with several inputs: the head operator learns
        which input the batch came from; the operators chained after it do not."""
        ops = self.operators
        head = ops[0]
        self.current_operator = head.name
        batch = head.process_input(batch, input_index)
        if not batch:
            return
        for op in ops[1:]:
            self.current_operator = op.name
            batch = op.process_batch(batch)
            if not batch:
                return
        for out in self.outputs:
            out.emit(batch)

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
        if self.restore is not None:
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

    def _run_input(self):
        job, inp = self.job, self.input
        self._timeout_ns = int(job.env.buffer_timeout * 1e9)
        self._next_flush = time.monotonic_ns() + self._timeout_ns
        per_record = job.env.buffer_timeout == 0
        max_batch = job.env.max_batch
        idle_wait = max(job.env.buffer_timeout, 0.05)
        while not job.cancelled:
            if self.mailbox:
                self._drain_mailbox()
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
                for rec in batch:
                    self._process([rec])
                    for out in self.outputs:
                        out.flush()
            else:
                self._process(batch)
                self._flush_if_due(time.monotonic_ns())

    def _run_multi_input(self):
        """``_run_input`` over several inputs: the same loop, each batch and
        each event tagged with its input index. A separate loop, so that a
        task with one input pays nothing for the index."""
        job, inp = self.job, self.input
        self._timeout_ns = int(job.env.buffer_timeout * 1e9)
        self._next_flush = time.monotonic_ns() + self._timeout_ns
        per_record = job.env.buffer_timeout == 0
        max_batch = job.env.max_batch
        idle_wait = max(job.env.buffer_timeout, 0.05)
        while not job.cancelled:
            if self.mailbox:
                self._drain_mailbox()
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
                for rec in batch:
                    self._process_input([rec], index)
                    for out in self.outputs:
                        out.flush()
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
            key = (input_index, event[0])
            if kind == BARRIER:
                self._carry_out(self.aligner.on_barrier(key, event[2]))
            else:
                self._carry_out(self.aligner.on_cancel(key, event[2]))
            return
        handler = self.job.event_handler
        if handler is not None:
            handler(self, event, input_index)

    def _finish(self):
        tail: list = []
        for op in self.operators:
            self.current_operator = op.name
            if tail:
                tail = op.process_batch(tail)
            tail = tail + op.finish()
        if tail:
            for out in self.outputs:
                out.emit(tail)
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
        inp = self.input
        if inp is None:
            return
        sides = inp.sides if isinstance(inp, MultiInput) else [inp]
        keys = [(i, ch) for i, side in enumerate(sides) for ch in range(side.num_channels)]
        if self.checkpointing.coordinator.config.mode == "at_least_once":
            block = resume = _no_op
        else:
            def block(key):
                sides[key[0]].block(key[1])

            def resume(key):
                sides[key[0]].resume(key[1])
        self._sides = sides
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

    def _carry_out(self, actions):
        for action, n in actions:
            if action == SNAPSHOT:
                al_ns = self.aligner.alignment_ns.get(n, 0) if self.aligner is not None else 0
                self.checkpointing.snapshot_and_write(n, al_ns)
                self.last_checkpoint, self.last_alignment_ms = n, al_ns / 1e6
                self._broadcast(BARRIER, n)
            else:   # ABORT: downstream tasks stop aligning it too
                self._broadcast(CANCEL_BARRIER, n)

    def _broadcast(self, kind, aux):
        for out in self.outputs:
            out.broadcast_event(kind, aux)

    def trigger_checkpoint(self, checkpoint_id: int) -> None:
        """Mail to a source subtask: snapshot, then barrier n on every output,
        in order with the records written before it."""
        if self.checkpointing is None or self.finished_ns or self.job.cancelled:
            return
        self.checkpointing.snapshot_and_write(checkpoint_id)
        self.last_checkpoint, self.last_alignment_ms = checkpoint_id, 0.0
        self._broadcast(BARRIER, checkpoint_id)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Mail: checkpoint n is complete (its sink commits were carried out)."""
        for op in self.operators:
            op.notify_checkpoint_complete(checkpoint_id)

    def abort_checkpoint(self, checkpoint_id: int) -> None:
        """Mail: the coordinator gave up checkpoint n (timeout, a decline)."""
        if self.aligner is not None:
            self._carry_out(self.aligner.abort(checkpoint_id))

    def _finish_restored(self):
        """A task restored as finished: its final state is back, its output was
        consumed before the checkpoint; it tells its consumers it has ended."""
        state = dict(self.restore)
        self.checkpointing.coordinator.task_finished(self.checkpointing.key, state, [])
        for out in self.outputs:
            out.end_input()

    def cancel(self):
        for out in self.outputs:
            out.cancel()
        if self.input is not None:
            self.input.cancel()
        if self.rate_limiter is not None:
            self.rate_limiter.cancel()

    # ---- counters for metrics ----
    def counters(self) -> dict:
        inp = self.input
        idle = self.source_idle_ns + (inp.idle_ns if inp is not None else 0)
        if self.finished_ns:
            # a task that has ended is idle from then on, not busy
            idle += time.monotonic_ns() - self.finished_ns
        return {
            "idle_ns": idle,
            "backpressure_ns": sum(o.backpressure_ns for o in self.outputs),
            "records_in": self.records_in,
            "records_out": sum(o.records for o in self.outputs),
            "bytes_in": inp.bytes_in if inp is not None else 0,
            "bytes_out": sum(o.bytes for o in self.outputs),
            # buffers shipped: with bytes_out it shows a per-record flush at once
            "buffers_out": sum(o.writer.buffers_out for o in self.outputs if o.writer is not None),
            "last_checkpoint": self.last_checkpoint,
            "checkpoint_alignment_ms": self.last_alignment_ms,
            "in_pool_usage": inp.in_pool_usage if inp is not None else 0.0,
            "out_pool_usage": max((o.pool.usage for o in self.outputs), default=0.0),
        }
