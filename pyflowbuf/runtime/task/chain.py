"""The operator chain of a subtask: the one walk of a batch through its
operators, and the ``Output`` each operator is given instead of the task.

Every path that moves records along the chain (a batch read from an input
or pulled from a source, what a watermark fires, what a processing-time
timer or an assigner makes between batches, what ``finish`` returns at the
end) goes through ``OperatorChain.walk``. A chain that carries timestamps (an
operator of it, or an input, is timestamped: ``Node.timestamped``) walks with
the batch's times beside it (``Operator.process_ts``); any other chain walks
the plain way and pays nothing for timestamps.
"""
from __future__ import annotations

from array import array as _array

from pyflowbuf import errors
from pyflowbuf.operators.contracts import Output
from pyflowbuf.time.processing_time import schedule
from pyflowbuf.operators.side_outputs import SideOutputs
from pyflowbuf.time.watermarks import to_seconds


class OperatorChain:
    """The operators of one subtask, in order, and where their records go.

    ``main_outputs`` take the records of the last operator; side records
    (``ctx.output(tag, value)``) go to the outputs of their operator's tags,
    shipped after each walk so that they precede any barrier or watermark.
    ``by_input``: the head reads several inputs (union, connect) and learns
    which one each batch came from (``Operator.process_input``).
    """

    def __init__(self, vertex, operators: list, outputs: list, timestamped: bool, by_input: bool):
        self.operators = operators
        self.timestamped = timestamped
        self.by_input = by_input and bool(operators)
        self.current_operator = vertex.head.name
        self.main_outputs = [o for o in outputs if o.tag is None]
        self._side_routes = _route_side_outputs(vertex, operators, outputs)
        # the operators from index k on, for each k: a walk starts anywhere
        self._from = [tuple(operators[k:]) for k in range(len(operators) + 1)]

    # ---- the walk ----
    def walk(self, batch: list, ts=None, start: int = 0) -> None:
        """``batch`` through the operators from index ``start`` on, then to the
        main outputs; then the side records made meanwhile. ``ts``: the
        batch's times (an array('d'), or None where they are not known) on a
        chain that carries timestamps, ignored on any other."""
        if batch:
            if self.timestamped:
                for op in self._from[start]:
                    self.current_operator = op.name
                    batch, ts = op.process_ts(batch, ts)
                    if not batch:
                        break
                    if not op.timestamped:
                        ts = None       # its output carries none, chained or not
                else:
                    for out in self.main_outputs:
                        out.emit(batch, ts)
            else:
                for op in self._from[start]:
                    self.current_operator = op.name
                    batch = op.process_batch(batch)
                    if not batch:
                        break
                else:
                    for out in self.main_outputs:
                        out.emit(batch)
        if self._side_routes:
            self.ship_side_outputs()

    def process(self, batch: list, ts=None, input_index: int = 0) -> None:
        """A batch read from input ``input_index``: a head that reads several
        inputs learns which one (``process_input``); the operators chained
        after it do not."""
        if not self.by_input:
            self.walk(batch, ts)
            return
        head = self.operators[0]
        self.current_operator = head.name
        if self.timestamped:
            batch, ts = head.process_input_ts(batch, ts, input_index)
            if not head.timestamped:
                ts = None
        else:
            batch = head.process_input(batch, input_index)
        self.walk(batch, ts, 1)

    def emit_after(self, index: int, records: list) -> None:
        """Records operator ``index`` made outside of a batch (a processing-time
        timer): through the operators after it, then to the outputs; and the
        side records it made meanwhile."""
        op = self.operators[index]
        self.walk(records, self.times_of(op, records) if records else None, index + 1)

    def finish(self) -> None:
        """End of input: each operator's ``finish`` records, in chain order,
        through the operators after it (each has had what came before)."""
        for k, op in enumerate(self.operators):
            self.current_operator = op.name
            more = op.finish()
            if more:
                self.walk(more, self.times_of(op, more), k + 1)
        if self._side_routes:
            self.ship_side_outputs()

    def times_of(self, op, records: list):
        """The times of ``records``, which ``op`` made outside of a batch (fired
        windows and timers, its end) with their times in ``op.fired_ts``;
        None on a chain without timestamps or where its output carries none."""
        if not self.timestamped or not op.timestamped:
            return None
        fired = op.fired_ts
        op.fired_ts = None
        if fired is None or len(fired) != len(records):
            raise errors.FlowBufError(
                f"operator {op.name!r} emitted {len(records)} record(s) without their timestamps on a stream "
                "that carries them")
        return fired if isinstance(fired, _array) else _array("d", fired)

    def ship_side_outputs(self) -> None:
        """Side records collected since the last call, to their outputs (with
        their times where the side output's stream carries timestamps)."""
        for buf, times, outs, producer in self._side_routes:
            if buf:
                batch = buf[:]
                buf.clear()
                ts = None
                if times is not None:
                    ts = _side_times(times, producer)
                    times.clear()
                for out in outs:
                    out.emit(batch, ts)

    def give_outputs(self, post, event_time) -> None:
        """Hand each operator its ``ChainOutput`` (before ``open``): ``post``
        puts a mail in the task's mailbox, ``event_time`` sends watermarks."""
        for k, op in enumerate(self.operators):
            op.chain_output = ChainOutput(self, k, post, event_time)

    def metrics(self) -> dict:
        """Counters of the chain's operators (late records of windows), summed."""
        out: dict = {}
        for op in self.operators:
            m = op.metrics
            if m is not None:
                for k, v in m().items():
                    out[k] = out.get(k, 0) + v
        return out


class ChainOutput(Output):
    """The ``Output`` of operator ``index`` of a running chain."""

    __slots__ = ("_chain", "_index", "_post", "_event_time")

    def __init__(self, chain: OperatorChain, index: int, post, event_time):
        self._chain = chain
        self._index = index
        self._post = post
        self._event_time = event_time

    def post(self, mail) -> None:
        self._post(mail)

    def schedule(self, deadline: float, mail):
        post = self._post
        return schedule(deadline, lambda: post(mail))

    def emit(self, records: list) -> None:
        self._chain.emit_after(self._index, records)

    def emit_watermark(self, watermark: float, force: bool = False) -> None:
        self._event_time.watermark_through(watermark, self._index + 1, force=force)

    def emit_idle(self) -> None:
        self._event_time.emit_idle()


def _route_side_outputs(vertex, operators, outputs) -> list:
    """Give each operator whose node declares side outputs its
    ``SideOutputs``; the routes [(buffer, [outputs])] of the tags some
    stream reads, which ``ship_side_outputs`` empties."""
    nodes = {n.id: n for n in getattr(vertex, "nodes", ())}
    routes: list = []
    for op in operators:
        node = nodes.get(op.node_id)
        tags = None if node is None else node.side_tags
        if not tags:
            continue
        table = {}
        times = {}
        for name, tag in tags.items():
            outs = [o for o in outputs if o.tag == name and o.source_node == node.id]
            buf = [] if outs else None
            table[name] = (tag, buf)
            if outs:
                timed = times[name] = [] if any(o.timestamped for o in outs) else None
                routes.append((buf, timed, outs, op.name))
                for o in outs:
                    o.produced_by(f"{op.name} (side output {name!r})")
        op.side = SideOutputs(op.name, table, {n: t for n, t in times.items() if t is not None})
    return routes


def _side_times(times: list, producer: str):
    """The times of a batch of side records, as an array('d'): each is the
    time of the record or timer it was made for."""
    try:
        return _array("d", times)
    except TypeError:
        pass
    out = _array("d")
    for t in times:
        if t is None:
            raise errors.ConfigurationError(
                f"operator {producer!r}: a record it sent to a side output has no event time, and the side "
                "output's stream carries timestamps: set ctx.timestamp (seconds) before ctx.output")
        out.append(to_seconds(t))
    return out
