"""The operator chain of a subtask: the one walk of a batch through its
operators (from any operator on, with and without timestamps), what an
operator emits through its Output, watermarks through the chain and the end
of input, checked against applying the operators one after the other."""
from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflowbuf import errors
from pyflowbuf._core.events import EVT_WATERMARK
from pyflowbuf.time import watermarks as wmk
from pyflowbuf.operators.contracts import Operator
from pyflowbuf.runtime.task.chain import OperatorChain
from pyflowbuf.runtime.task.event_time import EventTime


class _Out:
    tag = None

    def __init__(self):
        self.got = []

    def emit(self, batch, ts=None):
        self.got.append(("records", list(batch), None if ts is None else list(ts)))

    def broadcast_event(self, kind, aux, flags, priority):
        assert kind == EVT_WATERMARK
        self.got.append(("watermark", wmk.decode(aux)))


class _Step(Operator):
    """f applied to each record (None drops it); keeps times as they are.
    On a watermark it fires ``fires`` (each at the watermark's time) and holds
    the watermark back if ``hold``; at the end it emits ``tail``."""

    timestamped = True

    def __init__(self, name, f, fires=(), hold=False, tail=()):
        super().__init__(name)
        self.f, self.fires, self.hold, self.tail = f, list(fires), hold, list(tail)
        self.seen = []

    def _apply(self, batch):
        self.seen.append(list(batch))
        return [y for y in map(self.f, batch) if y is not None]

    def process_batch(self, batch):
        return self._apply(batch)

    def process_ts(self, batch, ts):
        out = []
        times = []
        for x, t in zip(batch, ts if ts is not None else [None] * len(batch)):
            self.seen.append([x])
            y = self.f(x)
            if y is not None:
                out.append(y)
                times.append(t)
        return out, (None if ts is None else array("d", times))

    def on_watermark(self, wm):
        self.fired_ts = array("d", [wm] * len(self.fires))
        return list(self.fires), (None if self.hold else wm)

    def finish(self):
        self.fired_ts = array("d", [99.0] * len(self.tail))
        return list(self.tail)


def _chain(ops, timestamped):
    out = _Out()
    vertex = SimpleNamespace(head=SimpleNamespace(name="head"), nodes=())
    chain = OperatorChain(vertex, ops, [out], timestamped, by_input=False)
    job = SimpleNamespace(_event_time=True)
    et = EventTime(job, chain, [], [out])
    posted = []
    chain.give_outputs(posted.append, et)
    return chain, et, out


_FNS = {"inc": lambda x: x + 1, "even": lambda x: x if x % 2 == 0 else None, "x10": lambda x: x * 10}


def _model(names, batch):
    for n in names:
        batch = [y for y in map(_FNS[n], batch) if y is not None]
    return batch


@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.sampled_from(sorted(_FNS)), max_size=4),
       batch=st.lists(st.integers(-50, 50), min_size=1, max_size=20),
       start=st.integers(0, 4), timestamped=st.booleans())
def test_a_walk_is_the_operators_one_after_the_other(names, batch, start, timestamped):
    start = min(start, len(names))
    chain, _, out = _chain([_Step(n, _FNS[n]) for n in names], timestamped)
    ts = array("d", [float(x) for x in batch])
    chain.walk(batch, ts, start)
    want = _model(names[start:], batch)
    if not want:
        assert out.got == []        # an empty batch goes nowhere
        return
    assert [g[1] for g in out.got] == [want]
    if timestamped:
        # every step here keeps each record's time: the model's times are the inputs' that survived
        kept = [float(x) for x in batch if _model(names[start:], [x])]
        assert out.got[0][2] == kept
    else:
        assert out.got[0][2] is None


def test_an_operator_emits_through_its_output_after_itself():
    ops = [_Step("a", _FNS["inc"]), _Step("b", _FNS["x10"]), _Step("c", _FNS["inc"])]
    chain, _, out = _chain(ops, False)
    ops[1].chain_output.emit([1, 2])            # a timer of "b": through "c" only
    assert out.got == [("records", [2, 3], None)]
    assert ops[0].seen == [] and ops[1].seen == []
    assert chain.current_operator == "c"


def test_records_emitted_without_their_times_on_a_timestamped_chain_fail():
    ops = [_Step("a", _FNS["inc"]), _Step("b", _FNS["inc"])]
    chain, _, _ = _chain(ops, True)
    with pytest.raises(errors.FlowBufError, match="'a' emitted 1 record.* without their timestamps"):
        ops[0].chain_output.emit([1])           # no fired_ts


def test_a_watermark_fires_through_the_rest_of_the_chain_then_goes_out():
    ops = [_Step("a", _FNS["inc"], fires=[5]), _Step("b", _FNS["x10"], fires=[7]), _Step("c", _FNS["inc"])]
    _, et, out = _chain(ops, True)
    et.watermark_through(3.0, 0)
    # a's firing through b and c, then b's through c, then the watermark
    assert out.got == [("records", [51], [3.0]), ("records", [8], [3.0]), ("watermark", 3.0)]
    assert ops[1].seen == [[5]]


def test_a_held_back_watermark_stops_there_and_goes_nowhere():
    ops = [_Step("a", _FNS["inc"], fires=[1], hold=True), _Step("b", _FNS["inc"], fires=[100])]
    _, et, out = _chain(ops, False)
    et.watermark_through(3.0, 0)
    assert out.got == [("records", [2], None)]      # b fired nothing: it saw no watermark
    ops[0].hold = False
    ops[0].chain_output.emit_watermark(4.0)         # an assigner's own: after "a"
    assert out.got[-2:] == [("records", [100], None), ("watermark", 4.0)]


def test_the_end_of_input_goes_through_in_chain_order():
    ops = [_Step("a", _FNS["inc"], tail=[1]), _Step("b", _FNS["x10"], tail=[2]), _Step("c", _FNS["inc"], tail=[3])]
    chain, _, out = _chain(ops, True)
    chain.finish()
    assert [g[1] for g in out.got] == [[11], [3], [3]]
    assert [g[2] for g in out.got] == [[99.0], [99.0], [99.0]]
