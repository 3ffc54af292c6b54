"""Test one operator by hand: ``OperatorHarness`` feeds it records,
watermarks and processing time, and shows what it emitted, its timers and
its state, with no job, no buffers and no threads.

The operator is the real runtime object (a ``WindowOperator``, an
``IntervalJoinOperator``, a ``KeyedProcessOperator``, ...), built from a
stream declared with the job API or constructed directly, and the harness
calls it as a task does: ``restore_state`` then ``open``, ``process_batch``
(``process_input`` for an operator with two inputs), ``on_watermark``,
``fire_processing``, ``snapshot_state`` and ``finish``. Records carry their
keys and timestamps as in a job: the key and timestamp functions given to
``key_by`` and ``assign_timestamps`` read them.

Example::

    import pyflowbuf as fb
    from pyflowbuf.testing import OperatorHarness

    env = fb.Environment()
    counts = (env.from_collection([("a", 1.0)])
                .assign_timestamps(lambda r: r[1])
                .key_by(lambda r: r[0])
                .window(fb.Tumbling(10))
                .aggregate(fb.Count(), window_function=lambda k, w, n: (k, w.start, n)))
    h = OperatorHarness(counts)          # the window operator of that stream
    h.process([("a", 1.0), ("a", 4.0), ("b", 12.0)])
    h.process_watermark(10.0)            # the window [0, 10) fires
    assert h.take() == [("a", 0.0, 2)]
    assert h.watermarks == [10.0]

Differences from a running task, all about time: the harness has no wall
clock, so processing-time timers fire only when ``advance_processing_time``
says, and processing-time windows place records at the harness's
processing time (``ctx.current_processing_time()`` of a keyed ``process``
still reads ``time.time()``), and a
``TimestampsAssigner`` is driven only with ``watermark_interval=0`` and no
``idle_timeout`` (its watermarks follow each batch).
"""
from __future__ import annotations

import math
from array import array
from typing import Any

from pyflowbuf import errors
from pyflowbuf.api import Stream
from pyflowbuf.checkpoint import dumps, loads
from pyflowbuf.operators.contracts import Operator, Output
from pyflowbuf.api.side_outputs import OutputTag
from pyflowbuf.operators.side_outputs import LATE, SideOutputs
from pyflowbuf.time.watermarks import END_OF_TIME, NO_WATERMARK, TimestampsAssigner

__all__ = ["OperatorHarness"]


class OperatorHarness:
    """One operator, driven by hand from a test.

    Parameters
    ----------
    operator : an ``Operator`` instance, or a ``Stream`` declared with the
        job API (its last operator is built as a job would build it, with
        the stream's declared kind as the output kind).
    subtask, parallelism : what ``open(subtask, parallelism)`` is told.
    restore : a state from ``snapshot()`` (of an earlier harness): restored
        before ``open``, as a task restores from a checkpoint.
    allow_pickle : whether ``snapshot()`` may pickle what the checkpoint
        format cannot hold (a job's ``Environment(allow_pickle=...)``).
    side_outputs : for an operator built by hand, the ``OutputTag`` s whose
        records ``side_output(tag)`` keeps (a declared stream brings its
        own); a window operator's late records are ``fb.OutputTag("late")``.

    Every feeding method returns the records that call made (those of the
    main output: ``side_output(tag)`` holds a side output's, for the tags
    the stream declared); ``output`` holds them all in emission order
    (``output_timestamps`` their times, once records were fed with
    ``timestamps=``: as on a stream whose timestamps travel with its
    records), ``watermarks`` the watermarks the
    operator sent on, and ``events`` both, in order, as ``("record", r)``
    and ``("watermark", w)`` (``("idle", None)`` for an idle marker).
    Raises ``ConfigurationError`` for a stream with no operator (a source,
    a ``to_iterator()`` sink) or an assigner that needs a wall clock.

    Example::

        from pyflowbuf.time.process import KeyedProcessOperator
        from pyflowbuf.testing import OperatorHarness

        def fn(key, record, state, ctx):
            ctx.register_event_time_timer(record[1] + 5)

        op = KeyedProcessOperator("alarm", lambda r: r[0], lambda r: r[1], fn,
                                  on_timer=lambda k, t, state, ctx: [(k, t)])
        h = OperatorHarness(op)
        h.process([("a", 1.0)])
        assert h.timers["event"] == [(6.0, ["a"])]
        assert h.process_watermark(6.0) == [("a", 6.0)]
    """

    def __init__(self, operator, *, subtask: int = 0, parallelism: int = 1, restore: Any = None,
                 allow_pickle: bool = False, side_outputs=()):
        self.operator = op = _build(operator)
        self._side: dict = {}
        node = getattr(operator, "node", None)
        tags = getattr(node, "side_tags", None)
        if tags:
            # a window's late records are kept as in a job: when late() was taken
            taken = node.side_readers
            self._side = {name: (tag, [] if name != LATE or name in taken else None) for name, tag in tags.items()}
            op.side = SideOutputs(op.name, self._side)
        elif side_outputs:
            for tag in side_outputs:
                if not isinstance(tag, OutputTag):
                    raise TypeError(f"OperatorHarness: side_outputs takes OutputTags, got {type(tag).__name__}")
            self._side = {tag.name: (tag, []) for tag in side_outputs}
            op.side = SideOutputs(op.name, self._side)
        self.allow_pickle = allow_pickle
        self.output: list = []
        self.output_timestamps: list = []
        self.watermarks: list = []
        self.events: list = []
        self.processing_time = NO_WATERMARK
        self.finished = False
        self._wm_out = NO_WATERMARK
        self._mail: list = []
        if isinstance(op, TimestampsAssigner) and (op.interval > 0 or op.idle_timeout is not None):
            raise errors.ConfigurationError(
                f"OperatorHarness: assigner {op.name!r} emits its watermarks on wall-clock ticks, which a "
                "harness does not have: declare it with watermark_interval=0 and no idle_timeout")
        if restore is not None:
            op.restore_state(restore)
        # what it emits between calls comes to the harness, as it goes to a task's chain
        op.chain_output = _HarnessOutput(self)
        # operators that read the wall clock (processing-time windows) read
        # the harness's processing time instead
        if op.clock is not None:
            op.clock = self._clock
        op.open(subtask, parallelism)
        self._run_mail()

    # ---- feeding ----
    def process(self, records, input: int | None = None, timestamps=None) -> list:
        """Feed a batch of records (to input 0 or 1 of a two-input operator:
        ``input=`` is required there); returns the records it emitted.

        ``timestamps``: one time (seconds) per record, fed beside the records
        as a job does on a stream whose timestamps travel with its records
        (after a map or a window, say); the operator's output then carries
        times too, in ``output_timestamps``. A count that does not match the
        records is a ``ConfigurationError``.

        Example::

            h.process([("a", 1.0), ("b", 2.0)])
            join.process([("k", 0.5)], input=1)
            h.process([("a", 1), ("b", 1)], timestamps=[1.0, 2.0])
        """
        self._check_open("process")
        batch = list(records)
        op = self.operator
        if timestamps is None:
            out = op.process_batch(batch) if input is None else op.process_input(batch, input)
            return self._after(out)
        ts = array("d", [_seconds(t, "process") for t in timestamps])
        if len(ts) != len(batch):
            raise errors.ConfigurationError(
                f"OperatorHarness.process: {len(batch)} records but {len(ts)} timestamps")
        op.timestamped = True
        out, out_ts = op.process_ts(batch, ts) if input is None else op.process_input_ts(batch, ts, input)
        fired = self._emit(out, out_ts)
        self._run_mail()
        return fired

    def process_watermark(self, watermark: float) -> list:
        """Feed a watermark (seconds of event time) as the task's inputs
        would: the operator fires what it completes, and a watermark that
        rises is sent on after those records. Returns the records fired.
        For a two-input operator it is the combined watermark (a task takes
        the minimum over its inputs). A time that is not a number is a
        ``ConfigurationError``.

        Example::

            h.process_watermark(10.0)     # windows ending at or before 10 s fire
        """
        self._check_open("process_watermark")
        wm = _seconds(watermark, "process_watermark")
        handler = self.operator.on_watermark
        out: list = []
        if handler is not None:
            out, wm = handler(wm)
        fired = self._emit(out, self._fired())
        if wm is not None:
            self._emit_watermark(wm)
        self._run_mail()
        return fired

    def advance_processing_time(self, now: float) -> list:
        """Set the harness's processing time (``time.time()`` seconds) and
        fire the processing-time timers due by then; returns their records.

        Example::

            h.advance_processing_time(1_700_000_060.0)
        """
        self._check_open("advance_processing_time")
        now = _seconds(now, "advance_processing_time")
        if now < self.processing_time:
            raise errors.ConfigurationError(
                f"OperatorHarness: processing time goes forward only ({now} < {self.processing_time})")
        self.processing_time = now
        fire = self.operator.fire_processing
        out = self._emit(fire(now), self._fired()) if fire is not None else []
        self._run_mail()
        return out

    def finish(self) -> list:
        """End of input, as a task ends it: an event-time operator first gets
        the +inf watermark (every window and event-time timer fires), then
        ``finish()``. Returns the records of both; the harness takes nothing
        after it.

        Example::

            rest = h.finish()
        """
        self._check_open("finish")
        out: list = []
        if self.operator.event_time:
            out = self.process_watermark(END_OF_TIME)
        out = out + self._emit(self.operator.finish(), self._fired())
        self._run_mail()
        self.finished = True
        return out

    # ---- what it holds ----
    def snapshot(self) -> Any:
        """The operator's state as a checkpoint stores it: ``snapshot_state()``
        through the checkpoint format and back, so state the format cannot
        hold fails here as it would in a job. Restore it with
        ``OperatorHarness(new_operator, restore=state)``.

        Example::

            state = h.snapshot()
            h2 = OperatorHarness(make_operator(), restore=state)
        """
        state = self.operator.snapshot_state()
        return loads(dumps(state, allow_pickle=self.allow_pickle), allow_pickle=self.allow_pickle)

    @property
    def state(self) -> Any:
        """The operator's ``snapshot_state()`` as it is now (not encoded).

        Example::

            assert h.state["windows"] == {("a", 0.0, 10.0): 2}
        """
        return self.operator.snapshot_state()

    @property
    def timers(self) -> dict | None:
        """The operator's timers: ``{"watermark": w, "event": [(t, [keys])],
        "processing": [(t, [keys])]}`` in time order; None for an operator
        without timers.

        Example::

            assert h.timers["event"] == [(10.0, [("a", 0.0, 10.0)])]
        """
        timers = self.operator.timers
        return None if timers is None else timers.snapshot()

    @property
    def metrics(self) -> dict:
        """The operator's counters (e.g. ``late_records_dropped``).

        Example::

            assert h.metrics["late_records_dropped"] == 1
        """
        m = self.operator.metrics
        return {} if m is None else m()

    def side_output(self, tag) -> list:
        """The records the operator sent to side output ``tag`` so far (a tag
        its stream declared with ``side_outputs=``; the late records of a
        window whose ``late()`` was taken are ``side_output(fb.OutputTag("late"))``).
        The list is the harness's: clear it to start over.

        Example::

            bad = fb.OutputTag("bad")
            h = OperatorHarness(lines.process(parse, side_outputs=[bad]))
            h.process(["1", "x"])
            assert h.side_output(bad) == ["x"]
        """
        route = self._side.get(getattr(tag, "name", None))
        if route is None or route[1] is None:
            raise errors.ConfigurationError(
                f"OperatorHarness: the operator {self.operator.name!r} declares no side output {tag!r}; "
                f"declared: {', '.join(repr(t) for t, _ in self._side.values()) or 'none'}")
        return route[1]

    def take(self) -> list:
        """The records emitted since the last ``take()``, and forget them.

        Example::

            h.process_watermark(10.0)
            assert h.take() == [("a", 0.0, 2)]
        """
        out, self.output = self.output, []
        self.output_timestamps = []
        return out

    # ---- the task's side ----
    def _clock(self) -> float:
        if self.processing_time == NO_WATERMARK:
            raise errors.ConfigurationError(
                "OperatorHarness: this operator reads processing time; call advance_processing_time(t) "
                "before feeding it records")
        return self.processing_time

    def _check_open(self, what):
        if self.finished:
            raise errors.ConfigurationError(f"OperatorHarness.{what}: the operator has finished")

    def _after(self, out) -> list:
        fired = self._emit(out)
        self._run_mail()
        return fired

    def _fired(self):
        """The times of what the operator made outside of a batch."""
        op = self.operator
        fired, op.fired_ts = op.fired_ts, None
        return fired

    def _emit(self, records, ts=None) -> list:
        records = list(records or ())
        if self.operator.timestamped and records:
            times = list(ts) if ts is not None else [None] * len(records)
            self.output_timestamps.extend(times)
        self.output.extend(records)
        self.events.extend(("record", r) for r in records)
        return records

    def _emit_watermark(self, wm, force=False):
        if wm > self._wm_out or force:
            self._wm_out = max(wm, self._wm_out)
            self.watermarks.append(self._wm_out)
            self.events.append(("watermark", self._wm_out))

    def _run_mail(self):
        mail = self._mail
        while mail:
            mail.pop(0)()


class _HarnessOutput(Output):
    """The ``Output`` of an operator alone in the harness: mails run after
    the call that posted them, what it emits goes to the harness's output,
    and nothing is scheduled on a wall clock (the harness has none: its
    processing-time timers fire in ``advance_processing_time``)."""

    def __init__(self, harness: OperatorHarness):
        self._h = harness

    def post(self, mail) -> None:
        self._h._mail.append(mail)

    def schedule(self, deadline, mail):
        return None

    def emit(self, records) -> None:
        self._h._emit(records, self._h._fired())

    def emit_watermark(self, watermark, force=False) -> None:
        self._h._emit_watermark(watermark, force)

    def emit_idle(self) -> None:
        self._h.events.append(("idle", None))


def _build(operator) -> Operator:
    if isinstance(operator, Operator):
        return operator
    if not isinstance(operator, Stream):
        raise TypeError(f"OperatorHarness takes an Operator or a Stream, got {type(operator).__name__}")
    node = operator.node
    if node.make_operator is None:
        raise errors.ConfigurationError(
            f"OperatorHarness: {node.name!r} has no operator to test (a source, or a to_iterator() sink)")
    op = node.make_operator()
    op.out_kind = node.kind
    return op


def _seconds(t, what) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t):
        raise errors.ConfigurationError(f"OperatorHarness.{what}: a time in seconds, got {t!r}")
    return float(t)
