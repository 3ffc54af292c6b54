"""A subtask: one thread running a mailbox loop over its chain of operators.

Processing input is the default action; control messages (cancel, flush,
user callables) arrive as mails and are handled between batches. Time is
accounted as Flink does: idle = waiting for input, backpressured = waiting
for an output buffer, busy = the rest.

``Subtask`` puts together the parts that do the work: the ``OperatorChain``
(the walk of a batch through the operators, each operator's ``Output``), the
``Mailbox``, the ``InputProcessor`` (or, for a source, the pull loop here),
``SubtaskCheckpoints`` and ``EventTime``.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from pyflowbuf import errors
from pyflowbuf.exchange.sides import MultiInput
from pyflowbuf.runtime.pull import PullPolicy
from pyflowbuf.connectors.sources import payload_nbytes
from pyflowbuf.runtime.task.chain import OperatorChain
from pyflowbuf.checkpointing.subtask import SubtaskCheckpoints
from pyflowbuf.runtime.task.event_time import EventTime
from pyflowbuf.runtime.task.input import InputProcessor
from pyflowbuf.runtime.task.mailbox import ControlMail, Mailbox, OutputFlusher
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error


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
    """One parallel instance of a job vertex: its chain of operators fed by a
    source or by input gates, writing to its outputs, in a thread of its own."""

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
        sides = ([] if input_side is None else
                 list(input_side.sides) if isinstance(input_side, MultiInput) else [input_side])
        self.rate_limiter = rate_limiter
        self.records_in = 0         # a source's (an input processor counts its own)
        self.bytes_in_source = 0
        self.source_idle_ns = 0
        self.pull_policy = None
        self.restore = None         # the state to start from after a restore (set by the job)
        self.pulls = 0
        self.started_ns = 0
        self.finished_ns = 0
        self.state = "CREATED"
        # decided once: does this chain carry timestamps?
        timestamped = (any(op.timestamped for op in operators)
                       or any(side.timestamped for side in sides))
        # Every output carries barriers, watermarks and the end of input; the
        # chain's records go to the main ones, side records (ctx.output) to
        # the outputs of their operator's tags.
        self.chain = chain = OperatorChain(vertex, operators, outputs, timestamped,
                                           by_input=isinstance(input_side, MultiInput))
        self._check_records(vertex, operators, outputs, source)
        self.mailbox = Mailbox(input_side, outputs, None if source is None else source.wakeup)
        self.checkpoints = SubtaskCheckpoints(self, sides, self.mailbox)
        self.event_time = EventTime(job, chain, sides, outputs)
        self.input_processor = None if input_side is None else InputProcessor(
            self, input_side, chain, self.mailbox, self.checkpoints, self.event_time, outputs)
        self._sides = sides

    def _check_records(self, vertex, operators, outputs, source) -> None:
        """Who checks the records against their kind: each once, and its errors
        name the operator that made them."""
        main_outputs = self.chain.main_outputs
        # The writer checks every record it serializes: the operator feeding
        # it need not check again, and the writer's errors name that operator.
        producer = operators[-1] if operators else None
        if producer is not None and main_outputs:
            producer.check_output = False
        for out in main_outputs:
            out.produced_by(producer.name if producer is not None else vertex.head.name)
        # Source records handed to a chained operator are never serialized:
        # check them here, against the source's kind, as a writer would.
        self._source_misfit = None if source is None or not operators else _SourceCheck(vertex.head)
        if self._source_misfit is not None and outputs and all(
                op.passes_records for op in operators):
            # an assigner at the source hands its records to the writers as
            # they came, and a writer checks each one: the source's check
            # would be paid twice (the writer's errors name the source)
            self._source_misfit = None
            for out in main_outputs:
                out.produced_by(vertex.head.name)

    # ---- what the job and the rest of the runtime see ----
    @property
    def current_operator(self) -> str:
        """The operator running now (a failure names it)."""
        return self.chain.current_operator

    @current_operator.setter
    def current_operator(self, name: str) -> None:
        self.chain.current_operator = name

    @property
    def notifier(self):
        """Set by the job when tasks wait for output buffers (unaligned checkpoints)."""
        return self.mailbox.notifier

    @notifier.setter
    def notifier(self, notifier) -> None:
        self.mailbox.notifier = notifier

    def post(self, mail) -> None:
        """Run ``mail()`` in this task's thread between batches."""
        self.mailbox.post(mail)

    def post_control(self, mail) -> None:
        """``post``, for a mail that runs after a stop barrier too (the
        coordinator's completions and aborts; see ``Mailbox``)."""
        self.mailbox.post(ControlMail(mail))

    def input_kind_names(self) -> list:
        return [side.kind_name for side in self._sides]

    # mails of the checkpoint coordinator (see SubtaskCheckpoints)
    def trigger_checkpoint(self, checkpoint_id: int, options=None) -> None:
        if options and options.get("drain") and self.checkpoints.will_trigger():
            # stop-with-savepoint with drain: event time ends before the
            # barrier, so every window fires inside the savepoint
            self.checkpoints.drained = checkpoint_id
            self.event_time.finish()
        self.checkpoints.trigger(checkpoint_id, options)

    def switch_to_unaligned(self, checkpoint_id: int) -> None:
        self.checkpoints.switch_to_unaligned(checkpoint_id)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.checkpoints.notify_complete(checkpoint_id)

    def abort_checkpoint(self, checkpoint_id: int) -> None:
        self.checkpoints.abort(checkpoint_id)

    # ---- the loop ----
    def run(self):
        self.started_ns = time.monotonic_ns()
        self.state = "RUNNING"
        try:
            finished_before = self._open()
            if finished_before:
                # it had ended before the checkpoint: nothing more comes from it
                self.checkpoints.finish_restored(self.restore)
            elif self.source is not None:
                self._run_source()
            elif self.input_processor is not None:
                self.input_processor.run()
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
            if self.state == "CANCELED" and self.checkpoints.stopping is not None:
                self._commit_stop_savepoint()
            if self.source is not None:
                try:
                    self.source.close()
                except Exception:
                    pass
            for op in self.operators:      # connector sinks (connectors/api.py) release their clients
                close = getattr(op, "close_connector", None)
                if close is not None:
                    try:
                        close(self.state != "FINISHED")
                    except Exception:
                        pass

    def _commit_stop_savepoint(self) -> None:
        """Stopped with a savepoint: the job is cancelled once it completed,
        right after telling every subtask so (a control mail). The mail may
        not have run yet; it runs here, so that the sinks commit what the
        savepoint covers before the job ends (the task is frozen: only
        control mails run)."""
        try:
            self.mailbox.drain()
        except BaseException as exc:  # noqa: BLE001 - a commit that failed fails the job
            self.state = "FAILED"
            self.job.task_failed(self, exc)

    def _open(self) -> bool:
        """Restore the operators' state, open them with their Outputs, arm the
        checkpoint side; whether the task had ended before its checkpoint."""
        restore = self.restore
        if restore is not None:
            for op, state in zip(self.operators, restore["operators"]):
                self.current_operator = op.name
                op.restore_state(state)
        # event-time operators post mails and emit through their Output
        self.chain.give_outputs(self.mailbox.post, self.event_time)
        for op in self.operators:
            self.current_operator = op.name
            op.open(self.index, self.vertex.parallelism)
        self.checkpoints.arm()      # (checkpoints on: the job attached its coordinator)
        if restore is not None and restore.get("inflight"):
            self.checkpoints.replay_inflight(restore)
        return restore is not None and restore["finished"]

    def _run_source(self):
        job, src, limiter = self.job, self.source, self.rate_limiter
        outputs, mailbox, checkpoints = self.outputs, self.mailbox, self.checkpoints
        chain, head = self.chain, self.vertex.head.name
        walk = chain.walk
        chain.current_operator = head
        src.open(self.index, self.vertex.parallelism)
        if self.restore is not None and self.restore.get("source") is not None:
            src.seek(self.restore["source"])
        network = job.spec.network_config
        flusher = OutputFlusher(outputs, network.buffer_timeout)
        # buffer_timeout == 0: Flink's "flush after every record"
        flush_every_record = network.buffer_timeout == 0
        policy = self.pull_policy = PullPolicy(
            1 if flush_every_record else job.spec.max_batch, 4 * network.segment_size, limiter=limiter)
        count_bytes = limiter is not None and limiter.counts_bytes
        # a source whose record holds many rows (read_kafka's Arrow batches) has
        # its pull sized in rows: the byte cap then holds per row, not per batch
        rows_of = src.rows_of
        bytes_before = 0
        while not job.cancelled:
            if mailbox.mails:
                mailbox.drain()
            if (checkpoints.stopping is not None or mailbox.notifier is not None) and self._source_waits(policy):
                continue
            chain.current_operator = head
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
                flusher.flush()
                continue
            self.pulls += 1
            if self._source_misfit is not None:
                self._source_misfit(batch)
            if limiter is not None:
                t0 = time.monotonic_ns()
                limiter.acquire(len(batch), payload_nbytes(batch) if count_bytes else 0)
                self.source_idle_ns += time.monotonic_ns() - t0
            self.records_in += len(batch)
            walk(batch)
            if flush_every_record:
                for out in outputs:
                    out.flush()
            else:
                flusher.flush_if_due(time.monotonic_ns())
            written = sum(o.bytes for o in outputs)
            policy.observe(len(batch) if rows_of is None else rows_of(batch), pulled_ns, written - bytes_before)
            bytes_before = written

    def _source_waits(self, policy) -> bool:
        """Whether the source waits instead of pulling now: after the barrier
        of a stop-with-savepoint (until the job ends, or the savepoint fails
        and reading goes on: the mailbox is frozen meanwhile), or while no
        output buffer is free (unaligned checkpoints: see
        Mailbox.output_blocked)."""
        if self.checkpoints.stopping is not None:
            time.sleep(0.01)
            return True
        if self.mailbox.output_blocked():
            self.mailbox.wait_for_output()
            return True
        if policy.bytes_per_record:
            # Pull no more than the free output buffers take: a write that
            # blocks holds the trigger mail until the consumers give buffers
            # back (the pulled batch is written whole before a barrier, since
            # the source's position is already past it). With debloated
            # buffers of 300 bytes, a segment's worth of records was a
            # hundred buffers to wait for.
            # (one buffer kept back, and a fifth, for the buffer being
            # filled, records larger than the average and a cap lowered by
            # the debloat timer meanwhile)
            free = min((self._free_buffers(o.pool) for o in self.outputs), default=1)
            size = int(0.8 * max(1, free - 1) * self._buffer_bytes() // policy.bytes_per_record)
            policy.size = max(1, min(policy.size, size))
        return False

    def _free_buffers(self, pool) -> int:
        """Buffers ``pool`` would give now: up to its guaranteed minimum,
        then as many as the network's unpromised segments (shared with every
        other pool) and its cap allow."""
        in_use = pool.in_use
        net = getattr(self.job, "network_pool", None)
        spare = net.unreserved_segments if net is not None else pool.max_size
        return max(0, pool.min_size - in_use) + max(0, min(pool.max_size - max(in_use, pool.min_size), spare))

    def _buffer_bytes(self) -> int:
        """The largest buffer an output writes now: the segment size, or
        the smallest size debloating announced on its channels."""
        seg = self.job.spec.network_config.segment_size
        sizes = [q.buffer_size for out in self.outputs for q in getattr(out, "queues", ()) if q.buffer_size]
        return min(sizes) if sizes else seg

    def _finish(self):
        self.event_time.finish()
        self.chain.finish()
        self.checkpoints.input_finished()
        for out in self.outputs:
            out.end_input()

    def cancel(self):
        for out in self.outputs:
            out.cancel()
        if self.input is not None:
            self.input.cancel()
        if self.rate_limiter is not None:
            self.rate_limiter.cancel()
        wakeup = None if self.source is None else self.source.wakeup
        if wakeup is not None:
            wakeup()
        for op in self.operators:      # a connector sink waiting for its outside system
            if op.cancel_connector is not None:
                op.cancel_connector()

    # ---- counters for metrics ----
    def counters(self) -> dict:
        inp, proc = self.input, self.input_processor
        remote = [ch for side in getattr(inp, "sides", (inp,)) for ch in getattr(side, "remote_channels", ())]
        idle = self.source_idle_ns + (inp.idle_ns if inp is not None else 0)
        if self.finished_ns:
            # a task that has ended is idle from then on, not busy
            idle += time.monotonic_ns() - self.finished_ns
        return {
            "idle_ns": idle,
            "backpressure_ns": sum(o.backpressure_ns for o in self.outputs) + self.mailbox.bp_wait_ns,
            "records_in": self.records_in + (proc.records_in if proc is not None else 0),
            "records_out": sum(o.records for o in self.outputs),
            "bytes_in": inp.bytes_in if inp is not None else 0,
            "bytes_out": sum(o.bytes for o in self.outputs),
            # buffers shipped: with bytes_out it shows a per-record flush at once
            "buffers_out": sum(o.writer.buffers_out for o in self.outputs if o.writer is not None),
            # buffers that came over TCP from another worker (0 with every producer local)
            "remote_buffers_in": sum(ch.buffers_received for ch in remote),
            # credit-based flow control of the inputs from other processes (None: all local):
            # buffers the senders may send now, and what they said they have queued
            "credit_available": sum(ch.credit.available for ch in remote) if remote else None,
            "sender_backlog": sum(ch.credit.backlog for ch in remote) if remote else None,
            "last_checkpoint": self.checkpoints.last_checkpoint,
            "checkpoint_alignment_ms": self.checkpoints.last_alignment_ms,
            "in_pool_usage": inp.in_pool_usage if inp is not None else 0.0,
            "out_pool_usage": max((o.pool.usage for o in self.outputs), default=0.0),
            # buffer debloating, per input gate (None when it is off)
            "debloat": getattr(self, "debloat_gates", None),
        }

    def debloat_tick(self, gates) -> None:
        """Mail (buffer debloating): measure each input gate over the last
        period, announce new buffer sizes upstream, keep the figures for
        ``counters``. ``gates``: this task's GateDebloats (exchange/debloat.py)."""
        for g in gates:
            g.tick()
        self.debloat_gates = [g.snapshot for g in gates]

    def operator_metrics(self) -> dict:
        """Counters of the chain's operators (late records of windows), summed."""
        return self.chain.metrics()
